"""The public builder API strategies use to make single-hop Plans (multi-hop: ``multihop``).

Notation as in ``moonep_sim.plan.ir``: R ranks, T tokens (ranks concatenated), K top-k, N = T*K
entries (flat id ``e = t*K + k``), S slots, M messages of one hop, W final rows.

Typical use, in a strategy (``moonep_sim.strategies``)::

    sr, se, slot_of = home_slots(ctx.placement)          # moonep_sim.plan.multihop
    return plan_from_slots(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), slot_of[routing.topk_ids_TK],
                           dedup=dedup, token_padding=ctx.token_padding)

:func:`plan_from_slots` has two forms and one seam (:func:`moonep_sim.plan.compiled.covers`): the
readable hop (:func:`moonep_sim.plan.reference.single_hop_messages`) and, from
``perf.plan_compiled_min`` entries, the compiled passes (``fused.single_hop_plan``); both end in
:func:`assemble_plan` (also the builder of Plans from hops a planner built itself); the same Plan.

The pieces, for planners that need them: :func:`slot_layout` (the expert-grouped layout),
:func:`final_rows` (final rows from a layout) and :func:`entry_token` (``moonep_sim.plan.order``).
Builders leave ``strategy`` empty and ``plan_seconds`` 0: the registry's ``make_plan`` stamps them.

Per-entry, per-message and per-final-row arrays are written as :data:`~moonep_sim.plan.kinds.INDEX`
(int32), the dtype the Plan holds them in (``entry_*_N``, ``*_M``, ``grow_K``, ``order_N`` where
this module sorts); per-slot and per-rank arrays are int64.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import compiled, reference
from moonep_sim.plan.assembly import Entries, Padding, SlotLayout, Slots
from moonep_sim.plan.ir import GlobalRouting, Hop, Plan, RowCosts
from moonep_sim.plan.kinds import INDEX, flat_ids
from moonep_sim.plan.order import entry_token, segment_ranges
from moonep_sim.plan.placement import ClusterShape


def slot_layout(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int = 1,
                min_rows_S: np.ndarray | None = None, ranks: int | None = None, *, with_ranks: bool = False,
                perf: PerfConfig = DEFAULT_PERF) -> SlotLayout:
    """The expert-grouped layout of the entries' slots: entries sorted stably by slot (dropped first),
    each slot's rows padded to a multiple of ``token_padding`` and to at least ``min_rows_S``.

    entry_slot_N: any integer dtype [N], each entry's slot (-1 = dropped).  slot_rank_S: int64 [S]
    sorted.  min_rows_S: optional int64 [S] rows to allocate at least (capacity padding).  ranks: R
    (default: the largest slot rank + 1).  with_ranks: also each entry's rank (``entry_rank_N``).
    Returns a :class:`~moonep_sim.plan.assembly.SlotLayout`: entries keep their global order within
    a slot (tokens of source ranks concatenated in rank order, then k).

    Two forms, one seam (:func:`moonep_sim.plan.compiled.covers`): the readable
    :func:`moonep_sim.plan.reference.slot_layout` and, from ``perf.plan_compiled_min`` entries, the
    compiled counting sort ``fused.layout_by_slot``: the same layout (``tests/test_plan_fused.py``).
    """
    if compiled.covers(np.size(entry_slot_N), perf):
        from moonep_sim.plan import fused

        return fused.layout_by_slot(entry_slot_N, slot_rank_S, token_padding, min_rows_S, ranks, with_ranks)
    return reference.slot_layout(entry_slot_N, slot_rank_S, token_padding, min_rows_S, ranks, with_ranks)


def final_rows(lay: SlotLayout, kept_sorted: np.ndarray, entry_buf_row: np.ndarray | None,
               kept_buf_row: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(row_entry_W, expand_src_row_W) from the layout ``lay``, the kept entries in slot order
    (``lay.order_N[lay.n_drop:]``) and each entry's row (int64 [N]) in the last hop's buffer
    (or ``kept_buf_row``: those rows of the kept entries in slot order, when the caller has them);
    padding rows get -1. Without padding rows, row_entry_W is ``kept_sorted`` itself (no copy;
    INDEX where the layout's sort made it) and expand_src_row_W the buffer rows' dtype; with padding
    rows both are INDEX [W]."""
    if kept_buf_row is None:
        kept_buf_row = entry_buf_row[kept_sorted]
    if lay.grow_K is None:  # no padding rows: the final rows are the slot-sorted kept entries
        return kept_sorted, kept_buf_row
    W = int(lay.rows_R.sum())
    row_entry = np.full(W, -1, dtype=INDEX)
    expand = np.full(W, -1, dtype=INDEX)
    row_entry[lay.grow_K] = kept_sorted
    expand[lay.grow_K] = kept_buf_row
    return row_entry, expand


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
    else:
        entry_rank = np.append(slot_rank_S, -1).astype(INDEX)[entry_slot]  # (a dropped entry's slot -1 reads the -1)
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


def plan_from_slots(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots,
                    entry_slot_TK: np.ndarray, *, dedup: bool, token_padding: int = 1,
                    min_rows_S: np.ndarray | None = None, capacity_R: np.ndarray | None = None,
                    options: dict[str, Any] | None = None, perf: PerfConfig = DEFAULT_PERF, **extra) -> Plan:
    """A single-hop Plan from each entry's slot: the builder behind most strategies.

    slots: the expert slots (:class:`~moonep_sim.plan.Slots`: int64 [S] rank, expert and home of each,
    sorted by rank; a slot whose home differs from its rank is a copy whose weights are prefetched).
    entry_slot_TK: int64 [T, K] index into the slot arrays, -1 = dropped. The hop sends tokens
    straight to the slot's rank (deduplicated per rank if ``dedup``); the destination expands them
    into the expert-grouped layout, each slot padded to a multiple of ``token_padding`` and to at
    least ``min_rows_S`` rows. capacity_R: optional [R] rows a rank may hold.
    options: what the planner reports (resolved options, statistics); ``make_plan`` overlays them
    on the parsed options and stamps the strategy's name and planning time.
    extra: further :class:`~moonep_sim.plan.Plan` fields (``migrate_*_X``, ``host_plan_us``).
    perf: from ``perf.plan_compiled_min`` entries the compiled passes build it
    (:mod:`moonep_sim.plan.compiled`), below it the readable hop
    (:func:`moonep_sim.plan.reference.single_hop_messages`): the same Plan.
    """
    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    slots = Slots(slot_rank_S, slots.expert_S, slots.home_S)
    padding = Padding(token_padding, min_rows_S)
    if not compiled.covers(np.size(entry_slot_TK), perf):
        entry_slot = np.asarray(entry_slot_TK, dtype=np.int64).ravel()
        entry_rank = np.where(entry_slot >= 0, slot_rank_S[np.maximum(entry_slot, 0)], -1)
        hop, entry_buf_row, entry_dup = reference.single_hop_messages(
            entry_rank, routing.src_rank_T(), routing.tok_off_R(), routing.top_k, cluster.ranks, dedup)
        return assemble_plan(routing, cluster, costs, slots, Entries(entry_slot, entry_buf_row, entry_dup), [hop],
                             padding=padding, capacity_R=capacity_R, options=options, perf=perf, **extra)
    # the compiled passes (moonep_sim.plan.fused): the counting sort by slot, the hop and the final
    # rows in two passes over the entries; the readable form's arrays
    from moonep_sim.plan import fused

    lay, hop, entry_dup, row_entry, expand = fused.single_hop_plan(
        entry_slot_TK, slot_rank_S, routing.tok_off_R(), routing.top_k, cluster.ranks, dedup, token_padding,
        min_rows_S)
    return assemble_plan(routing, cluster, costs, slots, Entries(None, None, entry_dup, rank_N=lay.entry_rank_N),
                         [hop], padding=padding, layout=(lay, row_entry, expand), capacity_R=capacity_R,
                         options=options, **extra)


__all__ = ["SlotLayout", "assemble_plan", "entry_token", "final_rows", "plan_from_slots", "slot_layout"]
