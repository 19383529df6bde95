"""Routes composed of hops: each hop is built by one function, a strategy lists its hops.

Notation as in :mod:`moonep_sim.plan.ir`: R ranks, G GPUs per node, T tokens, K top-k,
N = T*K entries, S slots.

A route takes every (token, k) entry from its token's rank to the rank of its slot. A hop says
where the token is after it -- a rank that depends only on the route's two ends (source rank s,
final rank d), given as an [R, R] table -- in which scope the hop's messages travel, and whether a
token crosses it once per receiving rank (``dedup``) or once per entry. The last hop of every
route goes to the final rank. The hop builders:

- :func:`to_final` -- the last hop, straight to the entry's rank (any scope).
- :func:`to_node_of_final` -- across nodes, on the token's own rail: to the GPU of the final
  rank's node with the source's local index (DeepEP's RDMA hop).
- :func:`to_rail_of_final` -- inside the source's node, to the GPU with the final rank's local
  index (Tutel 2DH's first hop).
- :func:`via` -- any other table.

:func:`plan_from_hops` turns a list of hops into a Plan. Two examples::

    # DeepEP: RDMA once per destination node, then NVLink once per destination GPU
    hops = [to_node_of_final(ctx.cluster), to_final(Scope.INTRA_NODE, dedup=True)]
    # Tutel 2DH: NVLink to the destination's rail, then across nodes on that rail
    hops = [to_rail_of_final(ctx.cluster, dedup=d), to_final(Scope.INTER_NODE, dedup=d)]
    plan = plan_from_hops(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), entry_slot_TK, hops)

``docs/extending.md`` builds a new two-hop strategy this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.plan.assembly import Route, Slots
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan.build import plan_from_slots
from moonep_sim.plan.ir import GlobalRouting, Plan, RowCosts
from moonep_sim.plan.kinds import Scope
from moonep_sim.plan.multihop import plan_from_routes
from moonep_sim.plan.placement import ClusterShape


@dataclass(frozen=True)
class HopSpec:
    """One hop of a route (what the hop builders return).

    scope: where its messages may travel (:class:`~moonep_sim.plan.kinds.Scope`).
    dedup: a token crosses the hop once per receiving rank (True) or once per entry (False).
    via_RR: int64 [R, R], ``via_RR[s, d]`` the rank a token from source rank s bound for final
      rank d is on after this hop; None = the final rank itself (the last hop of a route).
    """

    scope: Scope
    dedup: bool
    via_RR: np.ndarray | None = None


def _ends(cluster: ClusterShape) -> tuple[np.ndarray, np.ndarray]:
    """int64 [R, 1] source ranks and [1, R] final ranks, broadcast into an [R, R] table."""
    r = np.arange(cluster.ranks, dtype=np.int64)
    return r[:, None], r[None, :]


def to_final(scope: Scope | str = Scope.GLOBAL, *, dedup: bool = False) -> HopSpec:
    """The last hop: from wherever the token is to the entry's rank."""
    return HopSpec(Scope(scope), bool(dedup))


def to_node_of_final(cluster: ClusterShape, *, dedup: bool = True) -> HopSpec:
    """Across nodes on the token's own rail: to the final rank's node, at the source's local index
    (scope ``inter_node``; a token of the final node stays on its GPU)."""
    s, d = _ends(cluster)
    return HopSpec(Scope.INTER_NODE, bool(dedup), cluster.rank_at(cluster.node_of(d), cluster.local_index(s)))


def to_rail_of_final(cluster: ClusterShape, *, dedup: bool = False) -> HopSpec:
    """Inside the source's node: to its GPU with the final rank's local index (scope ``intra_node``)."""
    s, d = _ends(cluster)
    return HopSpec(Scope.INTRA_NODE, bool(dedup), cluster.rank_at(cluster.node_of(s), cluster.local_index(d)))


def via(via_RR: np.ndarray, scope: Scope | str, *, dedup: bool) -> HopSpec:
    """A hop to ``via_RR[s, d]`` (int64 [R, R], see :class:`HopSpec`)."""
    return HopSpec(Scope(scope), bool(dedup), np.asarray(via_RR, dtype=np.int64))


def plan_from_hops(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots,
                   entry_slot_TK: np.ndarray, hops: Sequence[HopSpec], *, token_padding: int = 1,
                   options: dict[str, Any] | None = None, perf: PerfConfig = DEFAULT_PERF, **extra) -> Plan:
    """A Plan whose tokens take ``hops`` (the last one :func:`to_final`) to their slots' ranks.

    slots / entry_slot_TK: as in :func:`~moonep_sim.plan.plan_from_slots` (a
    :class:`~moonep_sim.plan.Slots`; entry_slot_TK int64 [T, K], -1 = dropped).
    options, extra: what the planner reports and further Plan fields (``kernel``, ...).
    perf: where the builders take their compiled passes (the same Plan whatever it says).
    One global hop is :func:`~moonep_sim.plan.plan_from_slots`; longer routes are
    :func:`~moonep_sim.plan.plan_from_routes` of the hops' tables.
    """
    hops = list(hops)
    if not hops or hops[-1].via_RR is not None or any(h.via_RR is None for h in hops[:-1]):
        raise PlanError(f"hops ({len(hops)}) must end with one to_final hop, every earlier hop naming the rank "
                        "it reaches (to_node_of_final, to_rail_of_final, via)")
    if len(hops) == 1 and hops[0].scope == Scope.GLOBAL:
        return plan_from_slots(routing, cluster, costs, slots, entry_slot_TK, dedup=hops[0].dedup,
                               token_padding=token_padding, options=options, perf=perf, **extra)
    route = Route([h.via_RR for h in hops[:-1]], [h.scope for h in hops], [h.dedup for h in hops], via_table=True)
    return plan_from_routes(routing, cluster, costs, slots, entry_slot_TK, route, token_padding=token_padding,
                            options=options, perf=perf, **extra)


__all__ = ["HopSpec", "plan_from_hops", "to_final", "to_node_of_final", "to_rail_of_final", "via"]
