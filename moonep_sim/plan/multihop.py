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
from moonep_sim.plan import compiled, threads
from moonep_sim.plan.assembly import Entries, Padding, Slots
from moonep_sim.plan.build import final_rows, slot_layout, sorted_layout
from moonep_sim.plan.ir import GlobalRouting, Hop, Plan, RowCosts
from moonep_sim.plan.kinds import INDEX
from moonep_sim.plan.order import segment_ranges, stable_order
from moonep_sim.plan.placement import ClusterShape
from moonep_sim.plan.route import Messages, Scratch, Sources, grouped_hop, pair_hop, token_hop, token_hop_fits


def _route_hop(src_rank_N: np.ndarray, src_row_N: np.ndarray, dst_rank_N: np.ndarray, gid_N: np.ndarray,
               ranks: int, scope: str) -> tuple[Hop, np.ndarray]:
    """:func:`route_hop` for int64 arrays: any gid order, and entries of one message may sit on
    different sources (the message takes the first entry's)."""
    n = dst_rank_N.size
    R = int(ranks)
    if n == 0:
        z = np.zeros(0, np.int64)
        return Hop(scope, z, z, z, z, np.zeros(R, np.int64)), z
    if n > 1 and bool((gid_N[1:] < gid_N[:-1]).any()):  # general case: sort on (dst, gid)
        G = int(gid_N.max()) + 1
        order = np.argsort(dst_rank_N * G + gid_N, kind="stable")
    else:  # gid non-decreasing in entry order: a stable sort on dst alone gives (dst, gid, entry)
        order = stable_order(dst_rank_N, R)
    cnt_D = np.bincount(dst_rank_N, minlength=R)
    gs = gid_N[order]
    first = np.empty(n, dtype=bool)
    np.not_equal(gs[1:], gs[:-1], out=first[1:])
    first[0] = True
    bound = (np.cumsum(cnt_D) - cnt_D)[cnt_D > 0]
    first[bound] = True  # a new destination starts a new message
    lead = order[first]  # one representative entry per message: the first in entry order
    M = lead.size
    del gs
    mcum = np.cumsum(first.view(np.uint8), dtype=np.int64)  # messages up to and including each sorted entry
    ends = np.cumsum(cnt_D)
    m_at = np.where(ends > 0, mcum[np.maximum(ends - 1, 0)], 0)  # messages before each dst's end
    per_dst = np.diff(np.concatenate([[0], m_at])).astype(np.int64)  # messages per destination
    # messages are in (dst, gid) order; the receive buffer of each dst is in (src, gid) order
    m_src = src_rank_N[lead]
    m_srow = src_row_N[lead]
    del lead
    m_dst = np.repeat(np.arange(R, dtype=np.int64), per_dst)
    o2 = stable_order(m_dst * R + m_src, R * R)  # (dst, src, gid); keeps each dst's block in place
    dst_start = np.cumsum(per_dst) - per_dst
    m_row = np.empty(M, dtype=np.int64)
    m_row[o2] = np.arange(M, dtype=np.int64) - np.repeat(dst_start, per_dst)
    del o2
    key3 = m_src * R + m_dst
    o3 = stable_order(key3, R * R)  # (src, dst, gid): the hop's message order
    cnt3 = np.bincount(key3, minlength=R * R)
    del key3
    blocks = np.arange(R * R, dtype=np.int64)
    hop = Hop(scope, np.repeat(blocks // R, cnt3), m_srow[o3], np.repeat(blocks % R, cnt3), m_row[o3], per_dst)
    dst_row = np.empty(n, dtype=np.int64)
    mcum -= 1
    dst_row[order] = m_row[mcum]
    return hop, dst_row


def route_hop(src_rank_N: np.ndarray, src_row_N: np.ndarray, dst_rank_N: np.ndarray, gid_N: np.ndarray,
              ranks: int, scope: str) -> tuple[Hop, np.ndarray]:
    """One hop of a route, vectorised over the (kept) entries that take part in it.

    src_rank_N, src_row_N: where each entry's token sits before the hop (rank, buffer row).
    dst_rank_N: the rank the entry's token must reach.  gid_N: message key within a destination
    (token id to deduplicate, entry id not to); entries with equal (dst, gid) share one message,
    whose source is the first such entry's (lowest entry order) -- equal tokens, so any is correct.
    Returns (hop, dst_row_N): the Hop and each entry's row in the hop's receive buffer.

    When ``gid_N`` is non-decreasing (entries in entry order) the entries are sorted by destination
    alone with a radix sort, and the messages by (dst, src) and (src, dst) with 16-bit ones.
    :func:`plan_from_routes` uses a one-sort form where each message has a single source
    (:func:`moonep_sim.plan.route.grouped_hop`).
    """
    return _route_hop(np.asarray(src_rank_N, dtype=np.int64), np.asarray(src_row_N, dtype=np.int64),
                      np.asarray(dst_rank_N, dtype=np.int64), np.asarray(gid_N, dtype=np.int64), ranks, scope)


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
    expand = Scratch(N, scratch).take() if dt == INDEX else np.empty(N, dtype=dt)
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


def plan_from_routes(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slot_rank_S: np.ndarray,
                     slot_expert_S: np.ndarray, slot_home_S: np.ndarray, entry_slot_TK: np.ndarray,
                     via_N: Sequence[np.ndarray], scopes: Sequence[str], dedup: Sequence[bool], *,
                     token_padding: int = 1, via_table: bool = False, options: dict[str, Any] | None = None,
                     perf: PerfConfig = DEFAULT_PERF, **extra) -> Plan:
    """A multi-hop Plan: entry e's token goes src -> via_N[0][e] -> ... -> its slot's rank.

    entry_slot_TK: int64 [T, K] slot per entry (-1 dropped).  via_N: H-1 int64 [N] arrays, the
    intermediate rank of each entry after hops 0..H-2 (values at dropped entries are ignored); with
    ``via_table`` H-1 int64 [R, R] tables instead, ``via[s, d]`` the intermediate rank of every
    token going from source rank s to final rank d (a route that depends on its ends only, as
    Tutel's 2DH and DeepEP's are; it lets the last hop be ordered with one radix sort).
    scopes / dedup: one per hop (H = len(scopes)); dedup[h] sends a token once per receiving rank.
    perf: where the compiled passes and a second thread take over (:class:`~moonep_sim.perf.PerfConfig`;
    the same Plan whatever it says).
    """
    T, K = routing.topk_ids_TK.shape
    R = cluster.ranks
    H = len(scopes)
    if len(via_N) != H - 1 or len(dedup) != H:
        raise PlanError(f"route ({len(via_N)} intermediate ranks, {len(dedup)} dedup flags) must match "
                        f"hops ({H}): H-1 intermediate ranks and H flags")
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    entry_slot = slot_ids(entry_slot_TK)
    N = entry_slot.size
    K1 = max(K, 1)
    all_kept = bool(N == 0 or entry_slot.min() >= 0)
    src_T = routing.src_rank_T()
    src_sorted = bool(src_T.size < 2 or (np.diff(src_T) >= 0).all())  # tokens in rank order (as usual)
    shift = K1.bit_length() - 1 if all_kept and K1 & (K1 - 1) == 0 else -1  # tok[i] == i >> shift
    if (via_table and shift >= 0 and src_sorted and 0 < R <= 256
            and all(h == 0 or not dedup[h] or h == H - 1 for h in range(H))):
        return _plan_from_table_routes(routing, cluster, costs, slot_rank_S, slot_expert_S, slot_home_S, entry_slot,
                                       via_N, scopes, dedup, shift, token_padding=token_padding, options=options,
                                       perf=perf, **extra)
    if all_kept:  # (no array of kept entry ids: they are 0..N-1)
        kept = None
        tok = np.repeat(np.arange(T, dtype=np.int64), K)
        src = np.repeat(src_T, K)
        row = np.repeat(np.arange(T, dtype=np.int64) - routing.tok_off_R()[src_T], K)
    else:
        kept = np.flatnonzero(entry_slot >= 0)
        tok = kept >> (K1.bit_length() - 1) if K1 & (K1 - 1) == 0 else kept // K1
        src = src_T[tok]
        row = tok - routing.tok_off_R()[src]
    pick = (lambda a: a) if all_kept else (lambda a: a[kept])
    n_kept = N if all_kept else kept.size
    dst = slot_rank_S[pick(entry_slot)]
    if via_table:
        for v in via_N:
            if np.shape(v) != (R, R):
                raise PlanError(f"via table shape ({list(np.shape(v))}) must be [R, R] = [{R}, {R}]")
        tables = [np.asarray(v, dtype=np.int64) for v in via_N]
        for t in tables:
            if t.size and (int(t.min()) < 0 or int(t.max()) >= R):
                raise PlanError(f"via table values ({int(t.min())}..{int(t.max())}) must be ranks in [0, {R})")
        if src_sorted and R <= 256:  # each source rank's entries are one run: look up its table row
            bound = np.searchsorted(src, np.arange(R + 1))
            mids = [np.empty(n_kept, dtype=np.int64) for _ in tables]
            for r in range(R):  # loop over source ranks, not entries
                lo, hi = int(bound[r]), int(bound[r + 1])
                if hi > lo:
                    for m, v in zip(mids, tables):
                        np.take(v[r], dst[lo:hi], out=m[lo:hi], mode="clip")
        else:
            ends = src * R
            ends += dst
            mids = [v.ravel()[ends] for v in tables]
            del ends
    else:
        mids = [pick(np.asarray(v, dtype=np.int64).ravel()) for v in via_N]
    pos = [src] + mids + [dst]
    del mids
    entry_rank = pos[H] if all_kept else np.where(entry_slot >= 0, slot_rank_S[np.maximum(entry_slot, 0)], -1)
    entry_dup = None
    hops = []
    for h in range(H):
        if h == 0 or not dedup[h]:
            # hop 0 leaves each token's own rank; without dedup every entry is its own message: either
            # way each message has one source, and one (src, dst) radix sort orders the hop
            at = Sources(pos[h], row, sorted=h == 0 and src_sorted, tok_off_R=routing.tok_off_R() if h == 0 else None)
            hop, row = grouped_hop(at, pos[h + 1], Messages(dedup[h], tok, shift), R, scopes[h])
        else:
            hop = None
            if h == H - 1 and via_table:
                # the hop's source is via[s, d]: one per (token, final rank), so messages group as
                # (src, dst, token) and the entries after the first of each are the duplicates
                hop, row, entry_dup = grouped_hop(Sources(pos[h], row), pos[h + 1],
                                                  Messages(True, tok, shift, dup_N=N, kept_N=kept), R, scopes[h])
            elif h == H - 1:
                # the last hop's messages are (token, final rank) pairs, one per non-duplicate entry;
                # the grouped form is exact when it finds that many (no message with two sources)
                entry_dup = dup_flags(entry_rank, K)
                hop2, row2 = grouped_hop(Sources(pos[h], row), pos[h + 1], Messages(True, tok, shift), R, scopes[h])
                if hop2.src_rank_M.size == n_kept - int(np.count_nonzero(entry_dup)):
                    hop, row = hop2, row2
                del hop2, row2
            if hop is None:
                hop, row = _route_hop(pos[h], row, pos[h + 1], tok, R, scopes[h])
        hops.append(hop)
    entry_buf_row = row if all_kept else np.full(N, -1, dtype=np.int64)
    if not all_kept:
        entry_buf_row[kept] = row
    if entry_dup is None:
        entry_dup = dup_flags(entry_rank, K) if dedup[-1] else np.zeros(N, dtype=bool)
    return assemble_plan(routing, cluster, costs, Slots(slot_rank_S, slot_expert_S, slot_home_S),
                         Entries(entry_slot, entry_buf_row, entry_dup), hops, padding=Padding(token_padding),
                         options=options, perf=perf, **extra)


def _plan_from_table_routes(routing: GlobalRouting, cluster: ClusterShape, costs: RowCosts, slot_rank_S: np.ndarray,
                            slot_expert_S: np.ndarray, slot_home_S: np.ndarray, entry_slot_N: np.ndarray,
                            via_RR: Sequence[np.ndarray], scopes: Sequence[str], dedup: Sequence[bool], shift: int, *,
                            token_padding: int, options: dict[str, Any] | None, perf: PerfConfig,
                            **extra) -> Plan:
    """:func:`plan_from_routes` for the usual case: routes given as [R, R] tables, every entry kept,
    K a power of two (``K == 1 << shift``), tokens in rank order, R <= 256, and no deduplicating
    hop between the first and the last.

    An entry's token (``e >> shift``), source rank (its run of entries) and source row then follow
    from its id, so no [N] array of them is built; the ranks an entry passes are one byte each.
    The Plan equals the general path's (``tests/test_planner_outputs_pinned.py``).
    """
    R, H = cluster.ranks, len(scopes)
    N = entry_slot_N.size
    tok_off = routing.tok_off_R()
    bound = tok_off << shift  # entries of source rank r: [bound[r], bound[r + 1])
    tables = []
    for v in via_RR:
        t = np.asarray(v)
        if t.shape != (R, R):
            raise PlanError(f"via table shape ({list(t.shape)}) must be [R, R] = [{R}, {R}]")
        if t.size and (int(t.min()) < 0 or int(t.max()) >= R):
            raise PlanError(f"via table values ({int(t.min())}..{int(t.max())}) must be ranks in [0, {R})")
        tables.append(t.astype(np.uint8))
    if H == 2 and compiled.covers(N, perf):
        # both hops, the layout and the final rows in two compiled passes over the entries
        # (moonep_sim.plan.fused_routes): the same arrays as below
        from moonep_sim.plan import fused_routes

        hops, entry_rank, entry_dup, layout = fused_routes.two_hop_plan(entry_slot_N, slot_rank_S, tables[0], tok_off,
                                                                        routing.top_k, R, scopes, dedup, token_padding)
        return assemble_plan(routing, cluster, costs, Slots(slot_rank_S, slot_expert_S, slot_home_S),
                             Entries(entry_slot_N, None, entry_dup, rank_N=entry_rank), hops,
                             padding=Padding(token_padding), options=options, layout=layout, **extra)
    # the slot sort and layout depend on the slots alone: on a second thread beside the hops (the
    # same Plan either way; numpy's loops release the GIL, so the wall time falls on two cores)
    layout_job = threads.Beside(slot_layout, entry_slot_N, slot_rank_S, token_padding, None, R, None, perf,
                                run=N >= perf.thread_min)
    with layout_job:
        hops, row, entry_rank, entry_dup, scratch = _table_hops(routing, entry_slot_N, slot_rank_S, tables, scopes,
                                                               dedup, shift, bound)
    layout = entry_layout(entry_slot_N, slot_rank_S, row, R, token_padding, scratch=scratch, lay=layout_job.result())
    return assemble_plan(routing, cluster, costs, Slots(slot_rank_S, slot_expert_S, slot_home_S),
                         Entries(entry_slot_N, row, entry_dup, rank_N=entry_rank), hops,
                         padding=Padding(token_padding), options=options, layout=layout, **extra)


def _table_hops(routing: GlobalRouting, entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, tables: list,
                scopes: Sequence[str], dedup: Sequence[bool], shift: int, bound: np.ndarray):
    """The hops of :func:`_plan_from_table_routes` (one-byte [R, R] ``tables``, entries of source
    rank r ``[bound[r], bound[r + 1])``): (hops, last buffer rows, entry ranks, duplicate flags,
    the dead INDEX [N] arrays left)."""
    R, H, N = bound.size - 1, len(scopes), entry_slot_N.size
    tok_off = routing.tok_off_R()
    entry_rank = slot_rank_S.astype(INDEX)[entry_slot_N]  # INDEX [N]: the Plan's entry_rank (every entry kept)
    dst8 = entry_rank.astype(np.uint8)
    mids = [np.empty(N, dtype=np.uint8) for _ in tables]
    for r in range(R):  # each source rank's entries are one run: look up its table row
        lo, hi = int(bound[r]), int(bound[r + 1])
        if hi > lo:
            for m, t in zip(mids, tables):
                np.take(t[r], dst8[lo:hi], out=m[lo:hi], mode="clip")  # (values checked above)
    pos = [None] + mids + [dst8]
    del mids
    entry_dup = None
    row = None
    hops = []
    scratch: list[np.ndarray] = []  # dead INDEX [N] arrays, reused rather than fresh pages
    for h in range(H):
        prev = row
        if h == 0 and dedup[0] and H > 1 and token_hop_fits(tables[0], 1 << shift):  # once per (token, relay)
            hop, row = token_hop(bound, tables[0], pos[H], shift, R, scopes[0], scratch)
        elif h == 0:  # tokens leave their own ranks: runs by source, rows by arithmetic
            hop, row = grouped_hop(Sources.own_ranks(bound, tok_off), pos[1], Messages(dedup[0], shift=shift), R,
                                   scopes[0], scratch)
        elif h == H - 1:  # the last hop: its blocks gather (source, final rank) pairs (see pair_hop)
            out = pair_hop(bound, tables[h - 1], pos[h + 1], row,
                           Messages(dedup[h], shift=shift, dup_N=N if dedup[h] else None), R, scopes[h], scratch)
            hop, row = out[:2]
            if dedup[h]:
                entry_dup = out[2]
        elif dedup[h]:  # (the caller's condition excludes a deduplicating hop between the first and the last)
            raise PlanError(f"hop {h} of {H} must not deduplicate on the table path (internal error)")
        else:
            hop, row = grouped_hop(Sources(pos[h], row), pos[h + 1], Messages(False, shift=shift), R, scopes[h],
                                   scratch)
        if prev is not None:  # the previous buffer's rows: read by this hop's messages, dead now
            scratch.append(prev)
        del prev
        pos[h] = None
        hops.append(hop)
    del pos, dst8
    if entry_dup is None:
        entry_dup = dup_flags(entry_rank, routing.top_k) if dedup[-1] else np.zeros(N, dtype=bool)
    return hops, row, entry_rank, entry_dup, scratch


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
