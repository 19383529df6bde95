"""Compiled passes of the Plan builders: the slot layout, one global hop and its final rows, each one
loop over the N entries (``moonep_sim.jit.kernel``).

Notation as in :mod:`moonep_sim.plan.ir`: R ranks, T tokens (ranks concatenated, in rank order), K
top-k, N = T*K entries (flat id ``e = t*K + k``), S slots, M messages of the hop, W final rows.

A numpy builder sorts the N entries and then gathers and scatters them several times over, one
array pass per step (at K3 EP64 and 4096 tokens per rank, 4.2M entries and 896 slots, ~0.18 CPU s
per layer for ``alltoall`` in the tuned numpy this module replaced). Here the sort by slot is a
counting sort (one pass counts the slots, a second places each entry at its slot's next place:
every slot's entries in entry order, so it is the stable sort) and the hop is two passes in entry
order: one counts the messages of each (source, destination) block, the other hands each entry its
block's next message (or, when a token is sent once per rank, its token's earlier message to that
rank) and writes the final row it expands to (:func:`single_hop_plan`; alone, the counting sort is
:func:`layout_by_slot`). The planners whose entries' slots follow from their experts' runs get them
in one pass too: :func:`split_runs` (an expert's entries cut into consecutive pieces: moonep, llep,
eplb's contiguous replicas), :func:`cycle_runs` (dealt round-robin: eplb's default); and deepep's
nodes per token, :func:`distinct_per_token`; and each entry's duplicate flag, :func:`dup_flags`.

Every array equals the readable builders' (``build.plan_from_slots``', ``runs``: values and
dtypes; ``tests/test_plan_fused.py``), which run below ``perf.plan_compiled_min`` entries
(``compiled.covers``, asked once per builder). A process's first compiled call starts numba
(~0.24 s of CPU where scipy is not loaded yet, ~0.05 s where it is), whichever kernel makes it.

Kernels never trust an index they read: an out-of-range slot, rank or entry id makes the kernel
return its position (``>= 0``; -1 = all in range) before anything is written through it, and the
caller raises.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.jit import inline, kernel
from moonep_sim.plan.assembly import SlotLayout, slot_geometry
from moonep_sim.plan.ir import Hop
from moonep_sim.plan.kinds import INDEX, Scope, flat_ids, require_index
from moonep_sim.plan.compiled import check_at as _check
from moonep_sim.plan.compiled import key_starts as _key_starts


@kernel
def _slot_counts(slot_N, S, cnt):
    """cnt int64 [S+1]: dropped entries (slot -1) in ``cnt[0]``, slot s in ``cnt[s+1]``. Returns the
    first entry whose slot is outside [-1, S), else -1 (nothing counted past it)."""
    for e in range(slot_N.size):
        s = slot_N[e]
        if s < -1 or s >= S:
            return e
        cnt[s + 1] += 1
    return -1


@inline
def _place_dropped(e, S, nxt, order, entry_row):
    """Entry e, dropped (slot -1), to the dropped entries' next place of ``order`` (``nxt[S]``, then
    advanced); its row -1. (Inlined into the counting sorts' second passes.)"""
    p = nxt[S]
    nxt[S] = p + 1
    order[p] = e
    entry_row[e] = -1


@kernel
def _place_by_slot(slot_N, slot_rank_S, first_S, offset_S, cum_S, order, entry_row, entry_rank, grow, padded,
                   with_rank):
    """The counting sort's second pass: entry e of slot s (the j-th of its slot in entry order) goes to
    place ``first_S[s] + j`` of ``order`` (dropped entries, slot -1, to the places before every
    slot's, in entry order: ``first_S[-1]`` is 0 there); its row in its rank's layout is
    ``offset_S[s] + j`` (-1 dropped), with ``with_rank`` its rank ``slot_rank_S[s]`` (-1 dropped); with ``padded`` its
    global final row ``cum_S[s] + j`` is written at ``grow[place - n_drop]``. first_S: int64 [S+1],
    the dropped entries' first place (0) last."""
    S = slot_rank_S.size
    nxt = first_S.copy()
    n_drop = first_S[0] if S else slot_N.size
    for e in range(slot_N.size):
        s = slot_N[e]
        if s < 0:
            _place_dropped(e, S, nxt, order, entry_row)
            if with_rank:
                entry_rank[e] = -1
            continue
        p = nxt[s]
        nxt[s] = p + 1
        order[p] = e
        j = p - first_S[s]
        entry_row[e] = offset_S[s] + j
        if with_rank:
            entry_rank[e] = slot_rank_S[s]
        if padded:
            grow[p - n_drop] = cum_S[s] + j


@kernel
def _single_counts(slot_N, slot_rank_S, tok_off_R, K, dedup, scnt, mcnt):
    """The first pass of a single-hop Plan: scnt int64 [S+1] the entries of each slot (dropped ones,
    slot -1, in ``scnt[0]``, slot s in ``scnt[s+1]``); mcnt int64 [R*R] the hop's messages per
    (source, destination) block, source-major (``dedup``: one per (token, destination rank), else
    one per kept entry). Returns the first entry whose slot is outside [-1, S), else -1 (nothing
    counted past it)."""
    S, R = slot_rank_S.size, tok_off_R.size - 1
    last = np.full(R, -1, np.int64)  # the last token counted towards each destination
    for r in range(R):
        for t in range(tok_off_R[r], tok_off_R[r + 1]):
            for e in range(t * K, t * K + K):
                s = slot_N[e]
                if s < -1 or s >= S:
                    return e
                scnt[s + 1] += 1
                if s < 0:
                    continue
                d = slot_rank_S[s]
                mcnt[r * R + d] += not dedup or last[d] != t  # (no branch: see fused_routes._route2_counts)
                last[d] = t
    return -1


#: entries per block of the placing passes (``_next_block``): two int32 buffers of 256 KiB, in a core's L2
_BLOCK = 1 << 16


@kernel
def _next_block(slot_N, e0, e1, nxt, blk, buf, g_delta, out, n_drop):
    """A block buffer out, the next block (entries [e0, e1)) started. ``blk`` int64 [3, S]: each slot's
    kept entries in the block, its next place (``nxt``) then, and the shift from there to its place in
    ``buf`` [2, B] (the entries and their final rows' sources, slots in order). Each slot's run goes
    to ``out.order`` and ``out.expand`` (place + ``g_delta[s]``), ``grow``/``row_entry`` if padded."""
    for s in range(blk.shape[1]):
        p0, q0, g0 = blk[1, s], blk[1, s] + blk[2, s], blk[1, s] + g_delta[s]
        for i in range(blk[0, s]):
            out.order[p0 + i] = buf[0, q0 + i]
            out.expand[g0 + i] = buf[1, q0 + i]
            if out.padded:
                out.grow[p0 + i - n_drop] = g0 + i
                out.row_entry[g0 + i] = buf[0, q0 + i]
    blk[0] = 0
    for e in range(e0, e1):
        if slot_N[e] >= 0:
            blk[0, slot_N[e]] += 1
    run = 0  # (loops, not slice assignments between arrays: no shape check's message to compile)
    for s in range(blk.shape[1]):
        blk[1, s] = nxt[s]
        blk[2, s] = run - nxt[s]
        run += blk[0, s]


class SingleHop(NamedTuple):
    """One global hop as the single-hop kernels read it: each entry's slot, the slots' ranks, each
    rank's first token, K, and whether a token is sent once per destination rank."""

    slot_N: np.ndarray
    slot_rank_S: np.ndarray
    tok_off_R: np.ndarray
    K: int
    dedup: bool


class SingleStarts(NamedTuple):
    """Where :func:`_single_place` starts writing: each slot's first place in the order (the dropped
    entries' last, ``_slot_firsts``), the dropped entries, each slot's row on its rank and first
    final row, each (source, destination) block's first message and first receive row."""

    first_S: np.ndarray
    n_drop: int
    offset_S: np.ndarray
    cum_S: np.ndarray
    mstart: np.ndarray
    row0: np.ndarray


class SingleOut(NamedTuple):
    """What :func:`_single_place` writes (see there); ``padded``: whether the slots have padding rows."""

    order: np.ndarray
    entry_row: np.ndarray
    entry_rank: np.ndarray
    dup: np.ndarray
    m_srow: np.ndarray
    expand: np.ndarray
    grow: np.ndarray
    row_entry: np.ndarray
    padded: bool


@kernel
def _single_place(hop, starts, out):
    """The second pass, in entry order; entry e of token t on source rank r, of slot s on rank d, the
    j-th of its slot in entry order:

    - the counting sort: e goes to place ``first_S[s] + j`` of ``order`` (dropped entries to the
      places before every slot's, from ``first_S[S]`` = 0, in entry order); its row in d's layout
      is ``offset_S[s] + j`` (``entry_row``; -1 dropped), its rank d (``entry_rank``; -1 dropped);
    - the hop: e takes the next message of block (r, d) (``mstart``: int64 [R*R] each block's
      first message; ``row0``: its first receive row), whose source row ``m_srow`` is t's row on r,
      or with ``dedup`` its token's earlier message to d (``dup[e]`` True);
    - the final rows: its global final row ``g = cum_S[s] + j`` is gathered from that message's
      receive row (``expand[g]``); with ``padded`` also ``grow[place - n_drop] = g`` and
      ``row_entry[g] = e`` (without padding, ``row_entry`` is the order's kept part).

    A source's messages are one run of the hop's (its blocks, in destination order), written first
    into a run-sized buffer that stays in cache and then copied: written straight into ``m_srow``
    each store fetches a line of its own, R runs interleaved being too many for the prefetcher
    (measured at K3 EP64: ~12 ms per [M] array scattered so, ~1 ms copied). ``order`` and
    ``expand`` (S streams each) likewise: a block of tokens' entries goes into a buffer in slot order,
    then out in one run per slot (``_next_block``). At K3 EP64 (4.2M entries, 896 slots; CPU, least
    of 9-15): alltoall 52-55 ms, moonep 55-60, against 54-58 and 54-57 with an LLVM prefetch ahead of
    each stream (numba's public API has none) and 64-70 with both written straight.

    hop: :class:`SingleHop`; starts: :class:`SingleStarts`; out: :class:`SingleOut`."""
    slot_N, slot_rank_S, tok_off_R, K, dedup = hop
    first_S, n_drop, offset_S, cum_S, mstart, row0 = starts
    order, entry_row, entry_rank, dup, m_srow, expand, grow, row_entry, padded = out
    S, R = slot_rank_S.size, tok_off_R.size - 1
    nxt = first_S.copy()
    nxt_m = mstart.copy()
    last = np.full(R, -1, np.int64)  # the last token that took a message to each destination
    last_row = np.zeros(R, np.int64)  # and that message's receive row
    win = np.empty(0, m_srow.dtype)
    # (a slot's j-th entry at place p = first_S[s] + j: its row and final row are p plus a constant
    # of the slot; a block's m-th message's receive row is m plus a constant of the block)
    row_delta = offset_S - first_S[:S]
    g_delta = cum_S - first_S[:S]
    m_delta = row0 - mstart
    blk = np.zeros((3, S), np.int64)
    T, tpb = tok_off_R[R], max(_BLOCK // K, 1)  # (tokens, and tokens per block)
    buf = np.empty((2, min(tpb, T) * K), order.dtype)
    for r in range(R):
        m0 = mstart[r * R]
        m1 = mstart[r * R + R] if r + 1 < R else m_srow.size
        if m1 - m0 > win.size:
            win = np.empty(m1 - m0, m_srow.dtype)
        rR = r * R
        for t in range(tok_off_R[r], tok_off_R[r + 1]):
            if t % tpb == 0:  # (a new block of tokens: the last one's entries out first)
                _next_block(slot_N, t * K, min(t + tpb, T) * K, nxt, blk, buf, g_delta, out, n_drop)
            tok = t - tok_off_R[r]
            for e in range(t * K, t * K + K):
                s = slot_N[e]
                if s < 0:
                    _place_dropped(e, S, nxt, order, entry_row)
                    entry_rank[e] = -1
                    dup[e] = False
                    continue
                p = nxt[s]
                nxt[s] = p + 1
                entry_row[e] = p + row_delta[s]
                d = slot_rank_S[s]
                entry_rank[e] = d
                if dedup and last[d] == t:
                    row = last_row[d]
                    dup[e] = True
                else:
                    b = rR + d
                    m = nxt_m[b]
                    nxt_m[b] = m + 1
                    row = m + m_delta[b]
                    win[m - m0] = tok
                    if dedup:  # (without, no entry reads them: measured 2-5 ms less for alltoall)
                        last[d] = t
                        last_row[d] = row
                    dup[e] = False
                q = p + blk[2, s]  # (its place in the buffer)
                buf[0, q] = e
                buf[1, q] = row
        for i in range(m1 - m0):   # (a loop, not a slice assignment: no shape check's message to compile)
            m_srow[m0 + i] = win[i]
    _next_block(slot_N, 0, 0, nxt, blk, buf, g_delta, out, n_drop)  # (the last block out)


@kernel
def _fill_blocks(cnt, R, row0, m_src, m_dst, m_row):
    """The messages' source, destination and receive row, block by block (block b = (src, dst),
    source-major, ``cnt[b]`` messages from receive row ``row0[b]`` on), written in message order
    (the readable builders' hop lists its messages in the same (source, destination, row) order)."""
    m = 0
    for b in range(cnt.size):
        s, d, r0 = b // R, b % R, row0[b]
        for j in range(cnt[b]):
            m_src[m] = s
            m_dst[m] = d
            m_row[m] = r0 + j
            m += 1


@kernel
def _run_pieces(key_N, piece_first_X, piece_end_P, piece_slot_P, slot_N):
    """Entry e of key x, the j-th of x in entry order, gets the slot of x's piece holding j: x's pieces
    are ``[piece_first_X[x], piece_first_X[x+1])``, piece c ending (exclusive) at ``piece_end_P[c]``
    entries of x. Returns the first entry whose key is outside [0, X) or beyond its pieces, else -1."""
    X = piece_first_X.size - 1
    cur = piece_first_X[:X].copy()  # each key's current piece
    seen = np.zeros(X, np.int64)  # each key's entries so far
    for e in range(key_N.size):
        x = key_N[e]
        if x < 0 or x >= X:
            return e
        j = seen[x]
        seen[x] = j + 1
        c = cur[x]
        while c < piece_first_X[x + 1] and j >= piece_end_P[c]:
            c += 1
        if c >= piece_first_X[x + 1]:
            return e
        cur[x] = c
        slot_N[e] = piece_slot_P[c]
    return -1


def split_runs(key_N: np.ndarray, n_keys: int, piece_key_P: np.ndarray, piece_len_P: np.ndarray,
               piece_slot_P: np.ndarray) -> np.ndarray:
    """INDEX [N] the slot of each entry when each key's entries, in entry order, are cut into
    consecutive pieces: the first ``piece_len_P[c]`` entries of key x into the slot of x's first
    piece c, the next into its second, and so on (``moonep``'s split of an expert's entries over
    its ranks). piece_key_P: int [P] non-decreasing keys in [0, n_keys) (a key's pieces in order);
    piece_len_P: int [P] entries of each piece (each key's lengths summing to at least its
    entries); piece_slot_P: int [P] each piece's slot. One pass in entry order, instead of a stable
    sort by key and the pieces moved into slot order."""
    key = np.asarray(key_N).ravel()
    first = _key_starts(piece_key_P, n_keys, "piece")
    ln = np.asarray(piece_len_P, dtype=np.int64)
    end = np.cumsum(ln) - np.repeat(np.concatenate([[0], np.cumsum(ln)])[first[:-1]], np.diff(first))
    out = np.empty(key.size, dtype=INDEX)
    _check(_run_pieces(key, first.astype(np.int64), end, np.asarray(piece_slot_P, dtype=np.int64), out),
           f"entry key (must be in [0, {int(n_keys)}) and within its pieces)")
    return out


@kernel
def _run_cycle(key_N, rep_first_X, rep_count_X, rep_slot_P, slot_N):
    """Entry e of key x, the j-th of x in entry order, gets the slot ``rep_slot_P[rep_first_X[x] + j %
    rep_count_X[x]]``. Returns the first entry whose key is outside [0, X) or has no slot, else -1."""
    X = rep_first_X.size
    seen = np.zeros(X, np.int64)  # each key's entries so far
    for e in range(key_N.size):
        x = key_N[e]
        if x < 0 or x >= X or rep_count_X[x] <= 0:
            return e
        j = seen[x]
        seen[x] = j + 1
        slot_N[e] = rep_slot_P[rep_first_X[x] + j % rep_count_X[x]]
    return -1


def cycle_runs(key_N: np.ndarray, n_keys: int, rep_key_P: np.ndarray, rep_slot_P: np.ndarray) -> np.ndarray:
    """INDEX [N] the slot of each entry when each key's entries, in entry order, are dealt round-robin
    over its slots: the j-th entry of key x to x's slot ``j % c_x`` (``eplb``'s ``round_robin``
    choice of replicas). rep_key_P: int [P] non-decreasing keys in [0, n_keys); rep_slot_P: int [P]
    the slots of each key in that order."""
    key = np.asarray(key_N).ravel()
    first = _key_starts(rep_key_P, n_keys, "replica")
    out = np.empty(key.size, dtype=INDEX)
    _check(_run_cycle(key, first[:-1].astype(np.int64), np.diff(first).astype(np.int64),
                      np.asarray(rep_slot_P, dtype=np.int64), out),
           f"entry key (must be in [0, {int(n_keys)}) with a slot)")
    return out


@kernel
def _distinct_per_group(key_N, value_X, G, out):
    """out[t]: the distinct ``value_X[key]`` (each in [0, 64)) among the keys ``key_N[t*G:(t+1)*G]``,
    counted as the bits of their OR-ed bit set. Returns the first entry whose key is outside
    [0, X), else -1."""
    X = value_X.size
    one = np.uint64(1)
    for t in range(out.size):
        mask = np.uint64(0)
        for e in range(t * G, t * G + G):
            x = key_N[e]
            if x < 0 or x >= X:
                return e
            mask |= one << np.uint64(value_X[x])
        # the set bits of mask (SWAR popcount)
        mask = mask - ((mask >> np.uint64(1)) & np.uint64(0x5555555555555555))
        mask = (mask & np.uint64(0x3333333333333333)) + ((mask >> np.uint64(2)) & np.uint64(0x3333333333333333))
        mask = (mask + (mask >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
        out[t] = (mask * np.uint64(0x0101010101010101)) >> np.uint64(56)
    return -1


def distinct_per_token(key_TK: np.ndarray, value_X: np.ndarray) -> np.ndarray:
    """int64 [T]: the distinct ``value_X[key]`` among each token's K keys (``deepep``'s nodes per
    token from the entries' slots and the slots' nodes), in one pass over the entries instead of a
    gather and a bit set per entry. value_X: int [X] values in [0, 64)."""
    key = np.asarray(key_TK)
    T = key.shape[0]
    K = key.shape[1] if key.ndim == 2 else 1
    val = np.asarray(value_X, dtype=np.int64)
    if val.size and (int(val.min()) < 0 or int(val.max()) >= 64):
        raise PlanError(f"values ({int(val.min())}..{int(val.max())}) must lie in [0, 64) to be counted as bits")
    out = np.zeros(T, dtype=np.int64)
    _check(_distinct_per_group(key.reshape(-1), val, K, out), f"key (must be in [0, {val.size}))")
    return out


@kernel
def _dup_flags(rank_N, K, dup):
    """dup[e]: entry e is kept (rank >= 0) and an earlier entry of its token (of K each) has its rank
    (ranks below 64 looked up in a bit set of the token's ranks so far, others by a scan)."""
    N = rank_N.size
    one = np.uint64(1)
    for t in range((N + K - 1) // K):
        seen = np.uint64(0)
        for e in range(t * K, min(t * K + K, N)):
            r = rank_N[e]
            d = False
            if 0 <= r < 64:
                bit = one << np.uint64(r)
                d = (seen & bit) != 0
                seen |= bit
            elif r >= 64:
                for j in range(t * K, e):
                    if rank_N[j] == r:
                        d = True
                        break
            dup[e] = d


def dup_flags(entry_rank_N: np.ndarray, top_k: int) -> np.ndarray:
    """``multihop.dup_flags`` in one pass over the tokens: bool [N], each kept entry (rank >= 0, any
    integer dtype [N]) against its token's earlier entries (entry e is token ``e // top_k``'s)."""
    rank = flat_ids(entry_rank_N)
    dup = np.empty(rank.size, dtype=bool)
    _dup_flags(rank, max(int(top_k), 1), dup)
    return dup


def token_entries(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, tok_off_R: np.ndarray, top_k: int, ranks: int):
    """(slot_N, slot_rank_S int64, tok_off int64, S, N, R, K) of a route's entries, checked: else
    :class:`PlanError` unless ``tok_off`` is R + 1 non-decreasing token offsets from 0 to N / K and
    every slot rank lies in [0, R)."""
    slot = flat_ids(entry_slot_N)
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    tok_off = np.asarray(tok_off_R, dtype=np.int64)
    S, N, R, K = slot_rank_S.size, slot.size, int(ranks), max(int(top_k), 1)
    require_index(N, "entries (tokens x top-k)")
    if tok_off.size != R + 1 or int(tok_off[-1]) * K != N or bool((np.diff(tok_off) < 0).any()) or tok_off[0] != 0:
        raise PlanError(f"token offsets ({tok_off.size} values, {int(tok_off[-1]) if tok_off.size else 0} tokens) "
                        f"must be R + 1 = {R + 1} non-decreasing values from 0 to N / K = {N // K}")
    if S and (int(slot_rank_S.min()) < 0 or int(slot_rank_S.max()) >= R):
        raise PlanError(f"slot ranks ({int(slot_rank_S.min())}..{int(slot_rank_S.max())}) must lie in [0, {R})")
    return slot, slot_rank_S, tok_off, S, N, R, K


def _slot_firsts(slot_rows_S: np.ndarray, n_drop: int) -> np.ndarray:
    """int64 [S+1] each slot's first place in the slot-sorted order (after the ``n_drop`` dropped
    entries), the dropped entries' first place (0) last: the counting sorts' ``first_S``."""
    S = slot_rows_S.size
    first = np.empty(S + 1, dtype=np.int64)
    first[:S] = np.cumsum(slot_rows_S) - slot_rows_S + n_drop
    first[S] = 0
    return first


def _messages(cnt: np.ndarray, R: int):
    """(per_dst_R, M, mstart, row0) of a hop's block counts (int64 [R*R], source-major)."""
    cnt_RR = cnt.reshape(R, R)
    per_dst = cnt_RR.sum(axis=0).astype(np.int64)
    M = int(per_dst.sum())
    require_index(M, "messages of a hop")
    return per_dst, M, np.cumsum(cnt) - cnt, (np.cumsum(cnt_RR, axis=0) - cnt_RR).ravel()


def layout_by_slot(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int = 1,
                   min_rows_S: np.ndarray | None = None, ranks: int | None = None, with_ranks: bool = False):
    """``build.slot_layout`` by counting sort, in two passes over the entries: the
    :class:`~moonep_sim.plan.assembly.SlotLayout` of the entries' slots (any integer dtype [N], -1 =
    dropped), with ``with_ranks`` its ``entry_rank_N`` too."""
    slot = flat_ids(entry_slot_N)
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    S, N = slot_rank_S.size, slot.size
    require_index(N, "entries (tokens x top-k)")
    cnt = np.zeros(S + 1, dtype=np.int64)
    _check(_slot_counts(slot, S, cnt), f"entry slot (must be in [-1, {S}))")
    n_drop, slot_rows = int(cnt[0]), cnt[1:]
    padded, cum, offset, rows_R = slot_geometry(slot_rows, slot_rank_S, token_padding, min_rows_S, ranks)
    require_index(int(padded.sum()), "final rows")
    n_kept = N - n_drop
    first = _slot_firsts(slot_rows, n_drop)
    order = np.empty(N, dtype=INDEX)
    entry_row = np.empty(N, dtype=INDEX)
    entry_rank = np.empty(N if with_ranks else 0, dtype=INDEX)
    pad = int(padded.sum()) != n_kept
    grow = np.empty(n_kept if pad else 0, dtype=INDEX)
    _place_by_slot(slot, slot_rank_S, first, offset, cum, order, entry_row, entry_rank, grow, pad, with_ranks)
    return SlotLayout(slot_rows, padded, offset, entry_row, order, n_drop, rows_R, grow if pad else None,
                      entry_rank if with_ranks else None)


def single_hop_plan(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, tok_off_R: np.ndarray, top_k: int,
                    ranks: int, dedup: bool, token_padding: int = 1, min_rows_S: np.ndarray | None = None):
    """What ``build.plan_from_slots`` computes from the entries' slots, in two passes over them:
    (lay, hop, entry_dup_N, row_entry_W, expand_src_row_W) -- the layout
    (:class:`~moonep_sim.plan.assembly.SlotLayout`, ``entry_rank_N`` included), the hop
    (``build.single_hop_messages``) and the final rows (``build.final_rows``).

    entry_slot_N: any integer dtype [N], -1 = dropped.  slot_rank_S: int64 [S] sorted, in [0, R).
    tok_off_R: int64 [R+1] each rank's first token (tokens in rank order, N = T*K).
    """
    slot, slot_rank_S, tok_off, S, N, R, K = token_entries(entry_slot_N, slot_rank_S, tok_off_R, top_k, ranks)
    scnt = np.zeros(S + 1, dtype=np.int64)
    cnt = np.zeros(R * R, dtype=np.int64)
    _check(_single_counts(slot, slot_rank_S, tok_off, K, bool(dedup), scnt, cnt), f"entry slot (must be in [-1, {S}))")
    n_drop, slot_rows = int(scnt[0]), scnt[1:]
    padded, cum, offset, rows_R = slot_geometry(slot_rows, slot_rank_S, token_padding, min_rows_S, R)
    W = int(padded.sum())
    require_index(W, "final rows")
    n_kept = N - n_drop
    pad = W != n_kept
    first = _slot_firsts(slot_rows, n_drop)
    per_dst, M, mstart, row0 = _messages(cnt, R)
    order, entry_row, entry_rank = (np.empty(N, dtype=INDEX) for _ in range(3))
    dup = np.empty(N, dtype=bool)
    m_src, m_dst, m_srow, m_row = (np.empty(M, dtype=INDEX) for _ in range(4))
    expand = np.full(W, -1, dtype=INDEX) if pad else np.empty(W, dtype=INDEX)
    grow = np.empty(n_kept if pad else 0, dtype=INDEX)
    row_entry = np.full(W, -1, dtype=INDEX) if pad else grow
    _single_place(SingleHop(slot, slot_rank_S, tok_off, K, bool(dedup)),
                  SingleStarts(first, n_drop, offset, cum, mstart, row0),
                  SingleOut(order, entry_row, entry_rank, dup, m_srow, expand, grow, row_entry, pad))
    _fill_blocks(cnt, R, row0, m_src, m_dst, m_row)
    lay = SlotLayout(slot_rows, padded, offset, entry_row, order, n_drop, rows_R, grow if pad else None, entry_rank)
    hop = Hop(Scope.GLOBAL, m_src, m_srow, m_dst, m_row, per_dst)
    return lay, hop, dup, (row_entry if pad else order[n_drop:]), expand


__all__ = ["cycle_runs", "distinct_per_token", "dup_flags", "layout_by_slot", "single_hop_plan", "split_runs"]
