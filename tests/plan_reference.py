"""The readable references the Plan builders are held equal to (element-wise, values and dtypes):
``assemble_plan`` and ``plan_from_slots`` in their plainest numpy, each with the signature of the
public builder of the same name (:mod:`moonep_sim.plan`) and built on the package's own readable
primitives (:mod:`moonep_sim.plan.reference`: ``slot_layout``, ``single_hop_messages``);
``plan_from_routes`` is the package's readable branch itself with the compiled kernels off (a copy of
it here would test it against itself). ``assemble_plan`` here reads
``entries.slot_N`` and ``entries.buf_row_N`` only (no layout hint) and fills arrived padding rows
by one stable sort; the package's uses segment ranges (tests/test_plan_assembly.py,
tests/test_planner_outputs_pinned.py, tests/test_plan_builders.py, tests/test_plan_hops.py,
tests/test_plan_core.py)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.plan.assembly import Entries, Padding, Route, Slots
from moonep_sim.plan.ir import GlobalRouting, Hop, Plan, RowCosts
from moonep_sim.perf import PerfConfig
from moonep_sim.plan import multihop
from moonep_sim.plan.placement import ClusterShape
from moonep_sim.plan.reference import single_hop_messages, slot_layout

#: the builders with no compiled kernel (the readable forms at every size)
READABLE = PerfConfig(plan_compiled_min=1 << 62)


def assemble_plan(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots, entries: Entries,
                  hops: Sequence[Hop], *, padding: Padding = Padding(), options: dict[str, Any] | None = None,
                  **extra) -> Plan:
    """The Plan of :func:`moonep_sim.plan.assemble_plan` (without its fast-path hints: it reads
    ``entries.slot_N`` and ``entries.buf_row_N``, never ``entries.rank_N`` or a given layout)."""
    T, K = routing.topk_ids_TK.shape
    R = cluster.ranks
    if entries.slot_N is None or entries.buf_row_N is None:
        raise PlanError("entries.slot_N and entries.buf_row_N (None) must be given to the reference assemble_plan")
    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    entry_slot = np.asarray(entries.slot_N, dtype=np.int64).ravel()
    lay = slot_layout(entry_slot, slot_rank_S, padding.token_padding, padding.min_rows_S)
    slot_rows, padded, offset, entry_row = lay.slot_rows_S, lay.slot_padded_S, lay.slot_offset_S, lay.entry_row_N
    entry_rank = np.where(entry_slot >= 0, slot_rank_S[np.maximum(entry_slot, 0)], -1)
    rows_R = np.bincount(slot_rank_S, weights=padded, minlength=R).astype(np.int64)
    row_off = np.concatenate([[0], np.cumsum(rows_R)])
    W = int(row_off[-1])
    row_entry = np.full(W, -1, dtype=np.int64)
    expand = np.full(W, -1, dtype=np.int64)
    kept = np.flatnonzero(entry_slot >= 0)
    g = row_off[entry_rank[kept]] + entry_row[kept]
    row_entry[g] = kept
    expand[g] = np.asarray(entries.buf_row_N, dtype=np.int64)[kept]
    if padding.slot_P is not None and len(padding.slot_P):
        # padding rows that arrived over the wire fill their slot's padding rows in arrival order
        ps = np.asarray(padding.slot_P, dtype=np.int64)
        order = np.argsort(ps, kind="stable")
        ps_sorted = ps[order]
        cnt = np.bincount(ps, minlength=slot_rank_S.size)
        if (cnt > padded - slot_rows).any():
            s = int(np.argmax(cnt > padded - slot_rows))
            raise PlanError(f"padding rows of slot {s} ({int(cnt[s])}) must fit its padding "
                            f"({int(padded[s] - slot_rows[s])})")
        j = np.arange(ps.size) - (np.cumsum(cnt) - cnt)[ps_sorted]
        gp = row_off[slot_rank_S[ps_sorted]] + offset[ps_sorted] + slot_rows[ps_sorted] + j
        expand[gp] = np.asarray(padding.buf_row_P, dtype=np.int64)[order]
    return Plan(
        strategy="", options=dict(options or {}), cluster=cluster, num_experts=routing.num_experts, top_k=K,
        tokens_per_rank_R=routing.tokens_per_rank_R, costs=costs, token_padding=max(int(padding.token_padding), 1),
        entry_rank_TK=entry_rank.reshape(T, K), entry_row_TK=entry_row.reshape(T, K),
        entry_dup_TK=np.asarray(entries.dup_N, dtype=bool).reshape(T, K), entry_weight_TK=routing.topk_weights_TK,
        slot_rank_S=slot_rank_S, slot_expert_S=np.asarray(slots.expert_S, dtype=np.int64),
        slot_home_S=np.asarray(slots.home_S, dtype=np.int64), slot_offset_S=offset, slot_rows_S=slot_rows,
        slot_padded_S=padded, row_entry_W=row_entry, expand_src_row_W=expand, hops=tuple(hops), **extra)


def plan_from_slots(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots,
                    entry_slot_TK: np.ndarray, *, dedup: bool, token_padding: int = 1,
                    min_rows_S: np.ndarray | None = None, capacity_R: np.ndarray | None = None,
                    options: dict[str, Any] | None = None, **extra) -> Plan:
    """The Plan of :func:`moonep_sim.plan.plan_from_slots`: one global hop to each slot's rank."""
    K = routing.top_k
    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    entry_slot = np.asarray(entry_slot_TK, dtype=np.int64).ravel()
    entry_rank = np.where(entry_slot >= 0, slot_rank_S[np.maximum(entry_slot, 0)], -1)
    hop, entry_buf_row, entry_dup = single_hop_messages(entry_rank, routing.src_rank_T(), routing.tok_off_R(), K,
                                                        cluster.ranks, dedup)
    return assemble_plan(routing, cluster, costs, Slots(slot_rank_S, slots.expert_S, slots.home_S),
                         Entries(entry_slot, entry_buf_row, entry_dup), [hop],
                         padding=Padding(token_padding, min_rows_S), capacity_R=capacity_R, options=options, **extra)


def plan_from_routes(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots,
                     entry_slot_TK: np.ndarray, route: Route, *, token_padding: int = 1,
                     options: dict[str, Any] | None = None, **extra) -> Plan:
    """The Plan of :func:`moonep_sim.plan.plan_from_routes` in its readable form: the package's
    own readable branch (each hop :func:`route_hop` of the ranks an entry passes, keyed by token
    (dedup) or by entry), with every compiled kernel switched off."""
    return multihop.plan_from_routes(routing, cluster, costs, slots, entry_slot_TK, route,
                                     token_padding=token_padding, options=options, perf=READABLE, **extra)
