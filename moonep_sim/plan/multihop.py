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
from moonep_sim.plan.build import final_rows, slot_layout, sorted_layout
from moonep_sim.plan.ir import GlobalRouting, Hop, Plan, RowCosts
from moonep_sim.plan.reference import route_hop
from moonep_sim.plan.kinds import INDEX
from moonep_sim.plan.order import segment_ranges, stable_order
from moonep_sim.plan.placement import ClusterShape


def dup_flags(entry_rank_N: np.ndarray, top_k: int) -> np.ndarray:
    """bool [N]: True for a kept entry whose token has an earlier kept entry at the same rank."""
    entry_rank_N = np.asarray(entry_rank_N)
    N = entry_rank_N.size
    dup = np.zeros(N, dtype=bool)
    if N == 0:
        return dup
    R = int(entry_rank_N.max()) + 1
    if R == 0:
        return dup
    K = max(int(top_k), 1)
    if R < 255 and K <= DUP_PAIRWISE_MAX_K and N % K == 0:
        # ranks as one byte (-1 -> 255, never a rank here), top-k slot-major: entry k of every token
        # is one contiguous [T] row, and entry k is a duplicate where it equals an earlier entry j
        # (a dropped one, 255, marks nothing and is never one): K*(K-1)/2 byte compares per token
        rank_KT = np.empty((K, N // K), dtype=np.uint8)
        np.copyto(rank_KT, entry_rank_N.reshape(-1, K).T, casting="unsafe")
        dup_KT = np.zeros((K, N // K), dtype=bool)
        eq = np.empty(N // K, dtype=bool)
        for k in range(1, K):  # loop over top-k slot pairs, not tokens
            for j in range(k):
                np.equal(rank_KT[j], rank_KT[k], out=eq)
                dup_KT[k] |= eq
        if bool(entry_rank_N.min() < 0):
            dup_KT &= rank_KT != 255
        dup.reshape(-1, K)[:] = dup_KT.T
        return dup
    entry_rank_N = entry_rank_N.astype(np.int64, copy=False)
    if R <= 64 and N % K == 0:
        # per token, a bit set of the ranks its earlier entries went to: K passes over the tokens
        rank_TK = entry_rank_N.reshape(-1, K)
        dup_TK = dup.reshape(-1, K)
        seen = np.zeros(rank_TK.shape[0], dtype=np.uint64)
        one = np.uint64(1)
        any_drop = bool(entry_rank_N.min() < 0)
        bit = np.empty(rank_TK.shape[0], dtype=np.uint64)
        hit = np.empty(rank_TK.shape[0], dtype=np.uint64)
        for k in range(K):  # loop over top-k slots, not tokens
            col = rank_TK[:, k]
            if any_drop:
                np.left_shift(one, np.maximum(col, 0).astype(np.uint64), out=bit)
                bit[col < 0] = 0  # dropped entries are never duplicates and mark nothing
            else:
                np.left_shift(one, col.astype(np.uint64), out=bit)
            np.bitwise_and(seen, bit, out=hit)
            np.not_equal(hit, 0, out=dup_TK[:, k])
            seen |= bit
        return dup
    if entry_rank_N.min() >= 0:
        kept, rank = None, entry_rank_N
    else:
        kept = np.flatnonzero(entry_rank_N >= 0)
        rank = entry_rank_N[kept]
    # kept entries sorted stably by rank: (rank, token, entry); a later entry of an equal (rank,
    # token) pair is a duplicate
    order = stable_order(rank, R)
    tok = (np.arange(N, dtype=np.int64) if kept is None else kept)[order] // max(int(top_k), 1)
    cnt = np.bincount(rank, minlength=R)
    later = np.zeros(order.size, dtype=bool)
    np.equal(tok[1:], tok[:-1], out=later[1:])
    later[(np.cumsum(cnt) - cnt)[cnt > 0]] = False  # a new rank starts a new group
    sel = order[later]
    dup[sel if kept is None else kept[sel]] = True
    return dup


#: largest top-k for which :func:`dup_flags` compares every pair of a token's entries (one byte
#: each, K*(K-1)/2 compares per token; beyond it a bit set per token, K passes, or a sort)
DUP_PAIRWISE_MAX_K = 16


def entry_layout(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, entry_buf_row_N: np.ndarray, ranks: int,
                 token_padding: int = 1, min_rows_S: np.ndarray | None = None, scratch: list | None = None,
                 lay=None, perf: PerfConfig = DEFAULT_PERF):
    """The expert-grouped layout and the final rows of entries given by slot:
    (lay, row_entry_W, expand_src_row_W), what ``slot_layout`` then ``final_rows`` return.

    entry_slot_N: [N] slot of each entry (int64, or any integer dtype), -1 = dropped.
    slot_rank_S: int64 [S] sorted.
    entry_buf_row_N: [N] the last buffer's row of each entry (INDEX or int64).  ranks: R.
    scratch: optional list of dead INDEX [N] arrays (not ``entry_buf_row_N``) to write into
    instead of fresh pages (they may end up in the Plan).  lay: the entries' ``slot_layout``
    (with these ``token_padding``, ``min_rows_S`` and ``ranks``) where the caller made it already.

    Without padding or dropped entries, each entry's buffer row is written to its final row in
    entry order (its slot's rank's first row plus its row there, chunk by chunk) instead of
    gathered in slot order: one slot's entries lie ~N/S entries apart, so that gather touches a new
    page nearly every access, where entry order writes one run per slot. Measured on deepep's arrays at K3 EP64 (8.4M
    entries, 896 slots; 2026-12-02, four runs alternating in one process, load ~6 on 2 CPUs):
    0.33-0.44 s of CPU against 0.47-0.67 s for ``slot_layout`` then ``final_rows``.
    """
    N = entry_slot_N.size
    # (the final rows' sources in the buffer rows' dtype, as final_rows gives them: INDEX from the
    # route builders)
    dt = np.asarray(entry_buf_row_N).dtype
    spare = [b for b in (scratch or []) if b.shape == (N,) and b.dtype == INDEX] if dt == INDEX else []
    expand = spare.pop() if spare else np.empty(N, dtype=dt)
    if scratch:  # the other dead arrays go before the layout allocates its own
        scratch.clear()
    if lay is None:
        lay = slot_layout(entry_slot_N, slot_rank_S, token_padding, min_rows_S, ranks, perf=perf)
    if lay.grow_K is not None or lay.n_drop:  # padding rows or dropped entries: the gather in slot order
        return (lay,) + final_rows(lay, lay.order_N[lay.n_drop:], entry_buf_row_N)
    # each entry's final row (ranks concatenated): its slot's rank's first row plus its row there,
    # chunk by chunk (the rows stay in cache until they are scattered to)
    slot_first = np.concatenate([[0], np.cumsum(lay.rows_R)])[slot_rank_S]
    row = np.empty(min(N, _CHUNK), dtype=np.int64)
    for lo in range(0, N, _CHUNK):  # loop over chunks of entries, not entries
        r = row[:min(N - lo, _CHUNK)]
        np.take(slot_first, entry_slot_N[lo:lo + _CHUNK], out=r, mode="clip")  # (every slot valid here)
        r += lay.entry_row_N[lo:lo + _CHUNK]
        expand[r] = entry_buf_row_N[lo:lo + _CHUNK]
    return lay, lay.order_N, expand


#: entries per chunk of :func:`entry_layout`'s pass over the entries (2 MiB of int64 rows)
_CHUNK = 1 << 18


def assemble_plan(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slots: Slots, entries: Entries,
                  hops: Sequence[Hop], *, padding: Padding = Padding(), options: dict[str, Any] | None = None,
                  scratch: list | None = None, layout: tuple | None = None, perf: PerfConfig = DEFAULT_PERF,
                  **extra) -> Plan:
    """A Plan from explicit hops and each entry's row in the last hop's buffer.

    slots: the expert slots, sorted by rank.  entries: where each entry is after the last hop
    (its slot, its row in the last buffer, its duplicate flag; optionally its rank and slot
    order).  hops: the dispatch hops in order (see :class:`~moonep_sim.plan.Hop`).
    padding: how slots are padded (:class:`~moonep_sim.plan.assembly.Padding`).
    options: what the planner reports (``make_plan`` overlays them on the parsed options).
    scratch: optional list of dead INDEX [N] arrays (the caller's own, no longer referenced) the
    layout may write into instead of fresh pages (they may end up in the Plan).
    layout: optional (lay, row_entry_W, expand_src_row_W) of these entries, as :func:`entry_layout`
    returns it, where the planner built it itself (``allgather``: its buffer rows are the tokens,
    so the final rows' sources follow from the slot order by arithmetic); then ``entries`` needs
    only ``dup_N`` and ``rank_N`` (or ``slot_N``).
    perf: where the layout takes the compiled counting sort (:mod:`moonep_sim.plan.compiled`).
    extra: further Plan fields (``capacity_R``, ``kernel``, ...).
    """
    T, K = routing.topk_ids_TK.shape
    R = cluster.ranks
    slot_rank_S = np.asarray(slots.rank_S, dtype=np.int64)
    so = entries.order
    if entries.slot_N is None and ((so is None and layout is None) or entries.rank_N is None):
        raise PlanError("entries.slot_N (None) must be given unless entries.order (or a layout) and "
                        "entries.rank_N are")
    entry_slot = None if entries.slot_N is None else slot_ids(entries.slot_N)
    kept_buf_row = None if so is None or so.buf_row_K is None else np.asarray(so.buf_row_K)
    if entries.buf_row_N is None and kept_buf_row is None and layout is None:
        raise PlanError("entries.buf_row_N (None) must be given unless entries.order carries the kept entries' rows")
    entry_buf_row = None if entries.buf_row_N is None else np.asarray(entries.buf_row_N)
    tp = padding.token_padding
    # entries sorted by (slot, entry), dropped first: the final rows in order (see plan.layout_slots)
    if layout is not None:
        lay, row_entry, expand = layout
    elif so is None and entry_buf_row is not None:
        lay, row_entry, expand = entry_layout(entry_slot, slot_rank_S, entry_buf_row, R, tp, padding.min_rows_S,
                                              scratch, perf=perf)
    else:
        lay = sorted_layout(so.order_N, int(so.n_drop), np.asarray(so.slot_rows_S, dtype=np.int64), slot_rank_S, tp,
                            padding.min_rows_S, R, scratch=scratch)
        row_entry, expand = final_rows(lay, lay.order_N[lay.n_drop:], entry_buf_row, kept_buf_row)
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
            pad_row = pad_row[stable_order(ps, slot_rank_S.size)]
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
    entry_slot = slot_ids(entry_slot_TK)
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


def slot_ids(entry_slot) -> np.ndarray:
    """The entries' slots as a flat integer array, in the caller's integer dtype (a planner whose
    entries are all kept may give them in a small unsigned one: less to write, gather and sort),
    else int64."""
    a = np.asarray(entry_slot)
    return (a if a.dtype.kind in "iu" else a.astype(np.int64)).ravel()


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


__all__ = ["assemble_plan", "dup_flags", "entry_layout", "home_entry_slots", "home_slots", "plan_from_routes",
           "route_hop"]
