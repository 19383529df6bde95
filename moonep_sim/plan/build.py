"""The public builder API strategies use to make single-hop Plans (multi-hop: ``multihop``).

Notation as in ``moonep_sim.plan.ir``: R ranks, T tokens (ranks concatenated), K top-k, N = T*K
entries (flat id ``e = t*K + k``), S slots, M messages of one hop, W final rows.

Typical use, in a strategy (``moonep_sim.strategies``)::

    sr, se, slot_of = home_slots(ctx.placement)          # moonep_sim.plan.multihop
    return plan_from_slots(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), slot_of[routing.topk_ids_TK],
                           dedup=dedup, token_padding=ctx.token_padding)

:func:`plan_from_slots` has two forms and one seam (:func:`moonep_sim.plan.compiled.covers`): the
readable builder (:func:`moonep_sim.plan.reference.plan_from_slots`) and, from
``perf.plan_compiled_min`` entries, the compiled passes (``fused.single_hop_plan``); the same Plan.

The pieces, for planners that need them: :func:`slot_sort` / :func:`sorted_layout` /
:func:`slot_layout` / :func:`layout_slots` (the expert-grouped layout), :func:`block_messages`
(messages of (src, dst) blocks), :func:`final_rows` (final rows from a layout) and the sorting
primitives :func:`stable_order`, :func:`entry_token` (``moonep_sim.plan.order``).
Builders leave ``strategy`` empty and ``plan_seconds`` 0: the registry's ``make_plan`` stamps them.

Per-entry, per-message and per-final-row arrays are written as :data:`~moonep_sim.plan.kinds.INDEX`
(int32), the dtype the Plan holds them in (``entry_*_N``, ``*_M``, ``grow_K``, ``order_N`` where
this module sorts); per-slot and per-rank arrays are int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import compiled, reference
from moonep_sim.plan.assembly import SlotLayout, Slots, slot_geometry
from moonep_sim.plan.ir import GlobalRouting, Hop, Plan, RowCosts
from moonep_sim.plan.kinds import INDEX, Scope, require_index
from moonep_sim.plan.order import (entry_token, segment_ranges, small_key_dtype, stable_order, stable_order_counts,
                                   stable_order_positions)
from moonep_sim.plan.placement import ClusterShape


def sorted_layout(order_N: np.ndarray, n_drop: int, slot_rows_S: np.ndarray, slot_rank_S: np.ndarray,
                  token_padding: int = 1, min_rows_S: np.ndarray | None = None,
                  ranks: int | None = None, scratch: list | None = None,
                  placed: tuple[np.ndarray, np.ndarray] | None = None, with_ranks: bool = False) -> SlotLayout:
    """The expert-grouped layout from entries already sorted by (slot, entry), dropped first.

    order_N: int64 [N] entry ids in that order (as :func:`slot_sort` returns); n_drop: how many
    dropped ones lead; slot_rows_S: int64 [S] entries of each slot, in order after them.
    slot_rank_S: int64 [S] sorted.  token_padding: pad each slot's rows to a multiple of this.
    min_rows_S: optional [S] rows to allocate at least (capacity padding).  ranks: R (default:
    the largest slot rank + 1).  scratch: optional list of dead int64 arrays; one of the kept
    entries' size, if there, holds a temporary (it ends up in no field of the layout).
    placed: optional (entry_slot_N, pos_N), each entry's slot (int64 [N], -1 dropped) and its place
    in ``order_N`` (``pos_N[order_N[p]] = p``, as :func:`slot_sort_positions` returns them): the
    entries' rows then follow in entry order, without a scatter of N entries; ``pos_N`` becomes
    the layout's ``entry_row_N`` (it is written in place; INDEX). with_ranks: also each entry's rank
    (``entry_rank_N``; without ``placed`` it travels in the same int32 scatter as the entry's row
    where rank and row fit 31 bits together, as at K3 EP64).
    """
    S = slot_rank_S.size
    N = order_N.size
    padded, cum, offset, rows_R = slot_geometry(slot_rows_S, slot_rank_S, token_padding, min_rows_S, ranks)
    # sorted position p of a kept entry of slot s, the j-th of its slot: row within its rank =
    # offset[s] + j; global row (ranks concatenated) = cum[s] + j
    n_kept = N - n_drop
    require_index(N, "entries (tokens x top-k)")
    require_index(int(padded.sum()), "final rows")
    entry_rank = None
    if placed is None:
        kept = order_N[n_drop:]
        spare = next((b for b in (scratch or ()) if b.shape == (n_kept,) and b.dtype == INDEX), None)
        # with_ranks: rank << shift | row in one int32 where both fit, so one scatter places both
        shift = int(offset.max() + slot_rows_S.max()).bit_length() if S else 0
        packed = with_ranks and S and (int(slot_rank_S.max()) + 1) << shift <= 1 << 31
        first = offset if not packed else offset + (slot_rank_S << shift)
        row_sorted = segment_ranges(first, slot_rows_S, out=spare if spare is not None else
                                    np.empty(n_kept, dtype=INDEX))
        entry_row = np.empty(N, dtype=INDEX)
        entry_row[kept] = row_sorted
        if packed:
            entry_rank = entry_row >> shift
            entry_row &= (1 << shift) - 1
            entry_rank[order_N[:n_drop]] = -1
        elif with_ranks:
            entry_rank = np.full(N, -1, dtype=INDEX) if n_drop else np.empty(N, dtype=INDEX)
            entry_rank[kept] = np.repeat(slot_rank_S.astype(INDEX), slot_rows_S)
        del row_sorted
    else:  # the j-th entry of slot s sits at place n_drop + start[s] + j: row offset[s] + j
        entry_slot, entry_row = placed
        delta = np.append(offset - (np.cumsum(slot_rows_S) - slot_rows_S) - n_drop, 0)  # (slot -1: the 0)
        for lo in range(0, N, _CHUNK):  # loop over chunks of entries, not entries
            entry_row[lo:lo + _CHUNK] += delta[entry_slot[lo:lo + _CHUNK]]
    entry_row[order_N[:n_drop]] = -1
    if with_ranks and entry_rank is None:
        entry_rank = np.append(slot_rank_S, -1).astype(INDEX)[placed[0]]
    # no padding rows: global rows are 0..n_kept-1 in this order
    grow = None if int(padded.sum()) == n_kept else segment_ranges(cum, slot_rows_S, out=np.empty(n_kept, INDEX))
    return SlotLayout(slot_rows_S, padded, offset, entry_row, order_N, n_drop, rows_R, grow, entry_rank)


#: entries per chunk of the builders' chunked passes (their temporaries stay in cache)
_CHUNK = 1 << 18


def slot_sort(entry_slot_N: np.ndarray, num_slots: int) -> tuple[np.ndarray, int, np.ndarray]:
    """Entries sorted by (slot, entry), dropped (-1) first: (order_N, n_drop, slot_rows_S).

    entry_slot_N: int64 [N] slot of each entry (in [0, num_slots)), -1 = dropped.

    One counting pass and one stable radix sort on a small-int key (0 = dropped, s+1 = slot s).
    """
    key = entry_slot_N.astype(small_key_dtype(num_slots + 1), copy=True)
    key += 1
    order, counts = stable_order_counts(key, num_slots + 1)
    return order, int(counts[0]), counts[1:]


def slot_sort_positions(entry_slot_N: np.ndarray, num_slots: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """:func:`slot_sort` (its order INDEX [N]), and each entry's place in the order (INDEX [N],
    ``pos[order[p]] = p``), written by the chunked sort as it goes
    (``moonep_sim.plan.order.stable_order_positions``)."""
    require_index(entry_slot_N.size, "entries (tokens x top-k)")
    key = entry_slot_N.astype(small_key_dtype(num_slots + 1), copy=True)
    key += 1
    order, counts, pos = stable_order_positions(key, num_slots + 1, INDEX)
    return order, int(counts[0]), counts[1:], pos


def slot_layout(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int = 1,
                min_rows_S: np.ndarray | None = None, ranks: int | None = None,
                scratch: list | None = None, perf: PerfConfig = DEFAULT_PERF) -> SlotLayout:
    """:func:`sorted_layout` of the entries' slots (int64 or INDEX [N], -1 = dropped): sorts them first
    (from ``perf.plan_compiled_min`` entries by the compiled counting sort ``fused.layout_by_slot``:
    the same layout)."""
    if compiled.covers(np.size(entry_slot_N), perf):
        from moonep_sim.plan import fused

        return fused.layout_by_slot(entry_slot_N, slot_rank_S, token_padding, min_rows_S, ranks)
    order, n_drop, slot_rows, pos = slot_sort_positions(entry_slot_N, slot_rank_S.size)
    return sorted_layout(order, n_drop, slot_rows, slot_rank_S, token_padding, min_rows_S, ranks, scratch=scratch,
                         placed=(entry_slot_N, pos))


def layout_slots(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int = 1,
                 min_rows_S: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Expert-grouped layout from each entry's slot (vectorised).

    entry_slot_N: int64 [N] slot of each entry in flat entry order (e = t*K + k), -1 = dropped.
    slot_rank_S: int64 [S] sorted.  min_rows_S: optional [S] rows to allocate at least (capacity pad).
    Returns (slot_rows_S, slot_padded_S, slot_offset_S, entry_row_N): entries keep their global
    order within a slot (tokens of source ranks concatenated in rank order, then k).
    """
    lay = slot_layout(np.asarray(entry_slot_N, dtype=np.int64), np.asarray(slot_rank_S, dtype=np.int64),
                      token_padding, min_rows_S)
    return lay.slot_rows_S, lay.slot_padded_S, lay.slot_offset_S, lay.entry_row_N


def block_messages(cnt: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Messages laid out in (src, dst) blocks, ``cnt[src*R + dst]`` in each (int64 [R*R],
    src-major), in message order.

    Returns (src_rank_M, dst_rank_M, dst_row_M, per_dst_R): INDEX [M] message arrays, int64 [R]
    rows per destination; each destination's receive buffer holds its messages in (source rank,
    message order) order, so dst_row numbers them that way.
    """
    cnt_RR = cnt.reshape(R, R)  # [src, dst]
    per_dst = cnt_RR.sum(axis=0).astype(np.int64)
    require_index(int(per_dst.sum()), "messages of a hop")
    dst_row0 = (np.cumsum(cnt_RR, axis=0) - cnt_RR).ravel()  # first receive row of each (src, dst) block
    blocks = np.arange(R * R, dtype=INDEX)
    row = segment_ranges(dst_row0, cnt, out=np.empty(int(per_dst.sum()), dtype=INDEX))
    return np.repeat(blocks // R, cnt), np.repeat(blocks % R, cnt), row, per_dst


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
    (:mod:`moonep_sim.plan.compiled`), below it :func:`moonep_sim.plan.reference.plan_from_slots`
    does: the same Plan.
    """
    if not compiled.covers(np.size(entry_slot_TK), perf):
        return reference.plan_from_slots(routing, cluster, costs, slots, entry_slot_TK, dedup=dedup,
                                         token_padding=token_padding, min_rows_S=min_rows_S, capacity_R=capacity_R,
                                         options=options, **extra)
    # the compiled passes (moonep_sim.plan.fused): the counting sort by slot, the hop and the final
    # rows in two passes over the entries; the reference's arrays
    from moonep_sim.plan import fused

    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    lay, hop, entry_dup, row_entry, expand = fused.single_hop_plan(
        entry_slot_TK, slot_rank_S, routing.tok_off_R(), routing.top_k, cluster.ranks, dedup, token_padding,
        min_rows_S)
    T, K = routing.topk_ids_TK.shape
    return Plan(
        strategy="", options=dict(options or {}), cluster=cluster, num_experts=routing.num_experts, top_k=K,
        tokens_per_rank_R=routing.tokens_per_rank_R, costs=costs, token_padding=max(int(token_padding), 1),
        entry_rank_TK=lay.entry_rank_N.reshape(T, K), entry_row_TK=lay.entry_row_N.reshape(T, K),
        entry_dup_TK=entry_dup.reshape(T, K), entry_weight_TK=routing.topk_weights_TK,
        slot_rank_S=slot_rank_S, slot_expert_S=np.asarray(slots.expert_S, dtype=np.int64),
        slot_home_S=np.asarray(slots.home_S, dtype=np.int64), slot_offset_S=lay.slot_offset_S,
        slot_rows_S=lay.slot_rows_S, slot_padded_S=lay.slot_padded_S, row_entry_W=row_entry,
        expand_src_row_W=expand, hops=(hop,), capacity_R=capacity_R, **extra)


__all__ = ["SlotLayout", "block_messages", "entry_token", "final_rows", "layout_slots", "plan_from_slots", "slot_layout",
           "slot_sort", "sorted_layout", "stable_order"]
