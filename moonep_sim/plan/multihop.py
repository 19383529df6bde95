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

from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import compiled, reference
from moonep_sim.plan.assembly import Entries, Padding, Route, Slots
from moonep_sim.plan.build import final_rows, slot_layout
from moonep_sim.plan.ir import GlobalRouting, Hop, Plan, RowCosts
from moonep_sim.plan.reference import route_hop
from moonep_sim.plan.kinds import INDEX, flat_ids
from moonep_sim.plan.order import segment_ranges
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


def assemble_plan(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots, entries: Entries,
                  hops: Sequence[Hop], *, padding: Padding = Padding(), options: dict[str, Any] | None = None,
                  layout: tuple | None = None, perf: PerfConfig = DEFAULT_PERF, **extra) -> Plan:
    """A Plan from explicit hops and each entry's row in the last hop's buffer.

    slots: the expert slots, sorted by rank.  entries: where each entry is after the last hop
    (its slot, its row in the last buffer, its duplicate flag; optionally its rank).  hops: the dispatch hops in order (see :class:`~moonep_sim.plan.Hop`).
    padding: how slots are padded (:class:`~moonep_sim.plan.assembly.Padding`).
    options: what the planner reports (``make_plan`` overlays them on the parsed options).
    layout: optional (lay, row_entry_W, expand_src_row_W) of these entries (a
    :class:`~moonep_sim.plan.assembly.SlotLayout` and :func:`~moonep_sim.plan.final_rows` of it),
    where the planner built it itself (``allgather``: its buffer rows are the tokens, so the final
    rows' sources follow from the slot order by arithmetic); then ``entries`` needs only ``dup_N``
    and ``rank_N`` (or ``slot_N``).
    perf: where the layout takes the compiled counting sort (:mod:`moonep_sim.plan.compiled`).
    extra: further Plan fields (``capacity_R``, ``kernel``, ...).
    """
    T, K = routing.topk_ids_TK.shape
    R = cluster.ranks
    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    if entries.slot_N is None and (layout is None or entries.rank_N is None):
        raise PlanError("entries.slot_N (None) must be given unless a layout and entries.rank_N are")
    if entries.buf_row_N is None and layout is None:
        raise PlanError("entries.buf_row_N (None) must be given unless a layout is")
    entry_slot = None if entries.slot_N is None else flat_ids(entries.slot_N)
    tp = padding.token_padding
    # entries sorted by (slot, entry), dropped first: the final rows in order (see plan.slot_layout)
    if layout is not None:
        lay, row_entry, expand = layout
    else:
        lay = slot_layout(entry_slot, slot_rank_S, tp, padding.min_rows_S, R, perf=perf)
        row_entry, expand = final_rows(lay, lay.order_N[lay.n_drop:], np.asarray(entries.buf_row_N))
    slot_rows, padded, offset, entry_row = lay.slot_rows_S, lay.slot_padded_S, lay.slot_offset_S, lay.entry_row_N
    # (per-entry arrays are the Plan's index dtype: its caller's where given, else written as INDEX)
    if entries.rank_N is not None:
        entry_rank = np.asarray(entries.rank_N).ravel()
    elif lay.n_drop:
        entry_rank = np.append(slot_rank_S, -1).astype(INDEX)[entry_slot]  # (slot -1 reads the -1)
    else:
        entry_rank = slot_rank_S.astype(INDEX)[entry_slot]
    row_off = np.concatenate([[0], np.cumsum(lay.rows_R)])
    del lay
    if padding.slot_P is not None and len(padding.slot_P):
        ps = np.asarray(padding.slot_P, dtype=np.int64)
        cnt = np.bincount(ps, minlength=slot_rank_S.size)
        if (cnt > padded - slot_rows).any():
            s = int(np.argmax(cnt > padded - slot_rows))
            raise PlanError(f"padding rows of slot {s} ({int(cnt[s])}) must fit its padding "
                            f"({int(padded[s] - slot_rows[s])})")
        pad_row = np.asarray(padding.buf_row_P, dtype=np.int64)
        if ps.size > 1 and bool((ps[1:] < ps[:-1]).any()):  # padding rows by slot, arrival order kept
            pad_row = pad_row[np.argsort(ps, kind="stable")]
        # the j-th arrived padding row of slot s fills row slot_rows[s] + j of its segment
        expand[segment_ranges(row_off[slot_rank_S] + offset + slot_rows, cnt)] = pad_row
    return Plan(
        strategy="", options=dict(options or {}), cluster=cluster, num_experts=routing.num_experts, top_k=K,
        tokens_per_rank_R=routing.tokens_per_rank_R, costs=costs, token_padding=max(int(tp), 1),
        entry_rank_TK=entry_rank.reshape(T, K), entry_row_TK=entry_row.reshape(T, K),
        entry_dup_TK=np.asarray(entries.dup_N, dtype=bool).reshape(T, K), entry_weight_TK=routing.topk_weights_TK,
        slot_rank_S=slot_rank_S, slot_expert_S=np.asarray(slots.expert_S, dtype=np.int64),
        slot_home_S=np.asarray(slots.home_S, dtype=np.int64), slot_offset_S=offset, slot_rows_S=slot_rows,
        slot_padded_S=padded, row_entry_W=row_entry, expand_src_row_W=expand, hops=tuple(hops), **extra)


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
    every other route and size the readable builder (:func:`moonep_sim.plan.reference.plan_from_routes`).
    The same Plan (``tests/test_plan_fused.py``, ``tests/test_planner_outputs_pinned.py``).
    """
    R, H = cluster.ranks, len(route.scopes)
    route.check(R)
    entry_slot = flat_ids(entry_slot_TK)
    N = entry_slot.size
    if not (route.via_table and H == 2 and compiled.covers(N, perf) and N and int(entry_slot.min()) >= 0):
        return reference.plan_from_routes(routing, cluster, costs, slots, entry_slot_TK, route,
                                          token_padding=token_padding, options=options, **extra)
    # both hops, the layout and the final rows in two compiled passes over the entries
    from moonep_sim.plan import fused_routes

    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    hops, entry_rank, entry_dup, layout = fused_routes.two_hop_plan(entry_slot, slot_rank_S, route.via_N[0],
                                                                    routing.tok_off_R(), routing.top_k, R,
                                                                    route.scopes, route.dedup, token_padding)
    return assemble_plan(routing, cluster, costs, Slots(slot_rank_S, slots.expert_S, slots.home_S),
                         Entries(entry_slot, None, entry_dup, rank_N=entry_rank), hops,
                         padding=Padding(token_padding), options=options, layout=layout, **extra)


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


__all__ = ["assemble_plan", "dup_flags", "home_entry_slots", "home_slots", "plan_from_routes",
           "route_hop"]
