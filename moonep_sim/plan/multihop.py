"""Builders for plans whose tokens travel over several hops (Tutel 2DH, DeepEP) or carry padding rows.

Notation (as in :mod:`moonep_sim.plan.ir`): R ranks, T tokens (ranks concatenated), K top-k,
N = T*K entries (flat id ``e = t*K + k``), S slots, M messages of one hop, P padding rows.

A *route* gives, for every entry, the rank its token sits on after each hop: ``via_N[h]`` after
hop h (the source rank before hop 0, the entry's slot rank after the last hop). Each hop sends one
row per *message key*: ``(token, rank after the hop)`` when the hop deduplicates (a token crosses
a hop once per receiving rank), ``(entry, rank after the hop)`` otherwise. A rank's receive buffer
of each hop is ordered by (source rank, token, k), so messages come out sorted by (src, dst) as
:class:`~moonep_sim.plan.Hop` requires.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import compiled, reference
from moonep_sim.plan.assembly import Entries, Padding, Route, Slots
from moonep_sim.plan.build import assemble_plan
from moonep_sim.plan.ir import GlobalRouting, Plan, RowCosts
from moonep_sim.plan.reference import route_hop
from moonep_sim.plan.kinds import flat_ids
from moonep_sim.plan.placement import ClusterShape


def dup_flags(entry_rank_N: np.ndarray, top_k: int, *, perf: PerfConfig = DEFAULT_PERF) -> np.ndarray:
    """bool [N]: True for a kept entry (rank >= 0; any integer dtype [N]) whose token has an earlier
    kept entry at the same rank. Two forms, one seam (:func:`moonep_sim.plan.compiled.covers`):
    :func:`moonep_sim.plan.reference.dup_flags` and, from ``perf.plan_compiled_min`` entries, the
    compiled pass ``fused.dup_flags`` (each entry against its token's earlier ones)."""
    if compiled.covers(np.size(entry_rank_N), perf):
        from moonep_sim.plan import fused

        return fused.dup_flags(entry_rank_N, top_k)
    return reference.dup_flags(entry_rank_N, top_k)


def plan_from_routes(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots,
                     entry_slot_TK: np.ndarray, route: Route, *, token_padding: int = 1,
                     options: dict[str, Any] | None = None, perf: PerfConfig = DEFAULT_PERF, **extra) -> Plan:
    """A multi-hop Plan: entry e's token goes src -> via_N[0][e] -> ... -> its slot's rank
    (``route``: a :class:`~moonep_sim.plan.Route`, checked here).

    slots: the expert slots (:class:`~moonep_sim.plan.Slots`). entry_slot_TK: int64 [T, K] slot per
    entry (-1 dropped).

    Two forms, one seam (:func:`moonep_sim.plan.compiled.covers`): a two-hop table route of every
    entry kept (every planner's: deepep, hierarchical, costaware), from ``perf.plan_compiled_min``
    entries, takes the compiled passes (``fused_routes.two_hop_plan``: any K, any number of ranks);
    every other route and size the readable form (each hop :func:`~moonep_sim.plan.reference.route_hop`
    of the ranks an entry passes; :func:`~moonep_sim.plan.build.assemble_plan`). The same Plan (``tests/test_plan_fused.py``, ``tests/test_planner_outputs_pinned.py``).
    """
    R, K, H = cluster.ranks, routing.top_k, len(route.scopes)
    route.check(R)
    entry_slot = flat_ids(entry_slot_TK)
    N = entry_slot.size
    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    slots = Slots(slot_rank_S, slots.expert_S, slots.home_S)
    if route.via_table and H == 2 and compiled.covers(N, perf) and N and int(entry_slot.min()) >= 0:
        # both hops, the layout and the final rows in two compiled passes over the entries
        from moonep_sim.plan import fused_routes

        hops, entry_rank, entry_dup, layout = fused_routes.two_hop_plan(entry_slot, slot_rank_S, route.via_N[0],
                                                                        routing.tok_off_R(), K, R, route.scopes,
                                                                        route.dedup, token_padding)
        return assemble_plan(routing, cluster, costs, slots, Entries(entry_slot, None, entry_dup, rank_N=entry_rank),
                             hops, padding=Padding(token_padding), options=options, layout=layout, **extra)
    # the readable form: each hop is route_hop of the ranks an entry passes, keyed by token or entry
    entry_slot = np.asarray(entry_slot, dtype=np.int64)
    kept = np.flatnonzero(entry_slot >= 0)
    tok = kept // max(K, 1)
    src = routing.src_rank_T()[tok]
    dst = slot_rank_S[entry_slot[kept]]
    if route.via_table:  # [R, R] tables: the intermediate rank of a token from s bound for d
        mids = [np.asarray(v, dtype=np.int64)[src, dst] for v in route.via_N]
    else:
        mids = [np.asarray(v, dtype=np.int64).ravel()[kept] for v in route.via_N]
    pos = [src] + mids + [dst]
    row = tok - routing.tok_off_R()[src]
    hops = []
    for h in range(H):
        hop, row = route_hop(pos[h], row, pos[h + 1], tok if route.dedup[h] else kept, R, route.scopes[h])
        hops.append(hop)
    entry_buf_row = np.full(N, -1, dtype=np.int64)
    entry_buf_row[kept] = row
    entry_rank = np.where(entry_slot >= 0, slot_rank_S[np.maximum(entry_slot, 0)], -1)
    entry_dup = dup_flags(entry_rank, K, perf=perf) if route.dedup[-1] else np.zeros(N, dtype=bool)
    return assemble_plan(routing, cluster, costs, slots, Entries(entry_slot, entry_buf_row, entry_dup), hops,
                         padding=Padding(token_padding), options=options, perf=perf, **extra)


def home_slots(placement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot_rank_S, slot_expert_S, slot_of_E): a placement's home slots only (replicas ignored),
    sorted by rank, and the index of each expert's home slot among them."""
    p = placement
    home = p.slot_rank_S == p.home_E[p.slot_expert_S]
    sr, se = p.slot_rank_S[home], p.slot_expert_S[home]
    slot_of = np.empty(p.num_experts, dtype=np.int64)
    slot_of[se] = np.arange(se.size)
    return sr, se, slot_of


def home_entry_slots(slot_of_E: np.ndarray, ids_TK: np.ndarray) -> np.ndarray:
    """Each entry's home slot, ``slot_of_E[ids_TK]`` (as :func:`home_slots` numbers them): the
    routing's ids themselves, not a copy, where home groups number the slots as the experts (an
    [N] gather and its fresh pages saved). Read-only use: the result may be the routing's array."""
    if np.array_equal(slot_of_E, np.arange(np.asarray(slot_of_E).size)):
        return ids_TK
    return slot_of_E[ids_TK]


__all__ = ["dup_flags", "home_entry_slots", "home_slots", "plan_from_routes"]
