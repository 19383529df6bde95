"""Compiled passes of a two-hop table route (``multihop.plan_from_routes`` with H = 2: DeepEP's
RDMA-then-NVLink dispatch, Tutel's 2DH): both hops, the slot layout and the final rows in two loops
over the N entries (``moonep_sim.jit.kernel``).

Notation as in :mod:`moonep_sim.plan.ir`: R ranks, T tokens (in rank order), K top-k, N = T*K
entries, every one kept, S slots. Entry e of token t on source rank r, of slot s on final rank d,
travels r -> v = via[r, d] -> d:

- hop 0 sends one message per (token, v) (``dedup0``) or per entry, in (r, v, token) order; v's
  receive buffer holds them in (source, token) order; the message's source row is t's row on r;
- hop 1 sends one message per (token, d) (``dedup1``) or per entry, from v, in (v, d, token) order
  (every token of one (v, d) block comes from sources whose tokens are in rank order, so token
  order is source order); its source row is the entry's hop-0 receive row (the first entry's, for a
  message of several); d's receive buffer holds them in (v, token) order; a later entry of a
  (token, d) message is a duplicate;
- the layout is ``fused``'s counting sort by slot, and each final row is gathered from its
  entry's hop-1 receive row.

Every array equals the readable form's (of ``multihop.plan_from_routes``: ``tests/test_plan_fused.py``,
any K, more than 256 ranks included), which builds the routes this one does not cover and every
route below ``perf.plan_compiled_min`` entries (``multihop.plan_from_routes`` asks
``compiled.covers``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.jit import kernel
from moonep_sim.plan.assembly import SlotLayout, slot_geometry
from moonep_sim.plan.fused import _check, _fill_blocks, _messages, token_entries
from moonep_sim.plan.ir import Hop
from moonep_sim.plan.kinds import INDEX, require_index


class Route2(NamedTuple):
    """A two-hop table route as the kernels read it: each entry's slot (``slot_N``), the slots'
    ranks, the relay table ``via_RR`` and its classes (``_relay_classes``: ``cls_RR``, ``class_RC``,
    ``ncls_R``), whether hop 0 is found token by token (``by_token``), each rank's first token, K,
    and the two hops' dedup flags."""

    slot_N: np.ndarray
    slot_rank_S: np.ndarray
    via_RR: np.ndarray
    cls_RR: np.ndarray
    class_RC: np.ndarray
    ncls_R: np.ndarray
    by_token: bool
    tok_off_R: np.ndarray
    K: int
    dedup0: bool
    dedup1: bool


class Route2Starts(NamedTuple):
    """Where the second pass starts writing: each slot's first place in the slot order
    (``first_S``), its row on its rank (``offset_S``) and first final row (``cum_S``); each hop's
    blocks' first message and first receive row (int64 [R*R], source-major)."""

    first_S: np.ndarray
    offset_S: np.ndarray
    cum_S: np.ndarray
    mstart0: np.ndarray
    row0_0: np.ndarray
    mstart1: np.ndarray
    row0_1: np.ndarray


class Route2Out(NamedTuple):
    """What the second pass writes: the slot order, each entry's row, rank and dup flag, the two
    hops' messages' source rows, the final rows' sources; with ``padded`` each kept entry's final
    row (``grow``) and each final row's entry (``row_entry``)."""

    order: np.ndarray
    entry_row: np.ndarray
    entry_rank: np.ndarray
    dup: np.ndarray
    m_srow0: np.ndarray
    m_srow1: np.ndarray
    expand: np.ndarray
    grow: np.ndarray
    row_entry: np.ndarray
    padded: bool


@kernel
def _route2_counts(route, scnt, cnt0, cnt1):
    """First pass: scnt int64 [S] entries per slot; cnt0 / cnt1 int64 [R*R] messages of hop 0's
    (r, v) and hop 1's (v, d) blocks, source-major (``by_token``: hop 0's from a bit set of each
    token's relay classes, as :func:`_route2_place` finds them). Returns the first entry whose slot
    is outside [0, S), else -1."""
    slot_N, slot_rank_S, via_RR, cls_RR, class_RC, ncls_R, by_token, tok_off_R, K, dedup0, dedup1 = route
    S, R = slot_rank_S.size, tok_off_R.size - 1
    last0 = np.full(R, -1, np.int64)  # the last token counted towards each relay
    last1 = np.full(R, -1, np.int64)  # and towards each final rank
    one = np.uint64(1)
    for r in range(R):
        for t in range(tok_off_R[r], tok_off_R[r + 1]):
            mask = np.uint64(0)
            for e in range(t * K, t * K + K):
                s = slot_N[e]
                if s < 0 or s >= S:
                    return e
                scnt[s] += 1
                d = slot_rank_S[s]
                v = via_RR[r, d]
                if by_token:
                    mask |= one << np.uint64(cls_RR[r, d])
                else:
                    # (counted without a branch: whether an entry starts a message is a coin flip
                    # on hop 0, ~7 relays among 16 entries at K3 EP64)
                    cnt0[r * R + v] += not dedup0 or last0[v] != t
                    last0[v] = t
                cnt1[v * R + d] += not dedup1 or last1[d] != t
                last1[d] = t
            if by_token:
                for c in range(ncls_R[r]):
                    cnt0[r * R + class_RC[r, c]] += (mask >> np.uint64(c)) & one
    return -1


@kernel
def _route2_place(route, starts, out):
    """Second pass, in entry order (see the module doc): each entry's place in the slot order, its
    row and rank, its hop-0 and hop-1 messages (the next of their blocks, or its token's earlier
    one), the messages' source rows and the source of its final row (route: :class:`Route2`;
    starts: :class:`Route2Starts`; out: :class:`Route2Out`). A source's hop-0 messages are one
    run, written in a cached buffer and copied (as ``fused._single_place`` does); hop 1's blocks
    and the slot order's are streams.

    With ``by_token`` (hop 0 deduplicates, at most 64 relays per source), a token's hop-0 messages
    are found first from a bit set of its relays' classes (``cls_RR[r, d]``: the index of
    ``via_RR[r, d]`` among r's ``ncls_R[r]`` relays ``class_RC[r, :]``, in rank order), one message
    per set bit in class order: entry by entry, the relay's counters are read right after the
    previous entry wrote them (~7 relays among 16 entries at K3 EP64), a chain through memory that
    cost ~20 ms of the pass."""
    slot_N, slot_rank_S, via_RR, cls_RR, class_RC, ncls_R, by_token, tok_off_R, K, dedup0, dedup1 = route
    first_S, offset_S, cum_S, mstart0, row0_0, mstart1, row0_1 = starts
    order, entry_row, entry_rank, dup, m_srow0, m_srow1, expand, grow, row_entry, padded = out
    S, R = slot_rank_S.size, tok_off_R.size - 1
    nxt = first_S.copy()
    nxt0 = mstart0.copy()
    nxt1 = mstart1.copy()
    last0 = np.full(R, -1, np.int64)
    row_a = np.zeros(R, np.int64)  # receive row of the last token's hop-0 message to each relay
    last1 = np.full(R, -1, np.int64)
    row_b = np.zeros(R, np.int64)  # receive row of the last token's hop-1 message to each final rank
    win = np.empty(0, m_srow0.dtype)
    one = np.uint64(1)
    d0, d1 = row0_0 - mstart0, row0_1 - mstart1  # (a block's m-th message's receive row: m + a constant)
    row_delta, g_delta = offset_S - first_S, cum_S - first_S
    for r in range(R):
        a0 = mstart0[r * R]
        a1 = mstart0[r * R + R] if r + 1 < R else m_srow0.size
        if a1 - a0 + 1 > win.size:
            win = np.empty(a1 - a0 + 1, m_srow0.dtype)
        spare = win.size - 1
        for t in range(tok_off_R[r], tok_off_R[r + 1]):
            if by_token:
                mask = np.uint64(0)
                for e in range(t * K, t * K + K):
                    mask |= one << np.uint64(cls_RR[r, slot_rank_S[slot_N[e]]])
                for c in range(ncls_R[r]):
                    if (mask >> np.uint64(c)) & one:
                        v = class_RC[r, c]
                        b = r * R + v
                        m = nxt0[b]
                        nxt0[b] = m + 1
                        row_a[v] = m + d0[b]
                        win[m - a0] = t - tok_off_R[r]
            for e in range(t * K, t * K + K):
                s = slot_N[e]
                d = slot_rank_S[s]
                v = via_RR[r, d]
                if not by_token:
                    # hop 0 entry by entry, without a branch (see _route2_counts): a token's later
                    # entry to relay v writes into the buffer's spare last place and keeps v's row
                    new0 = not dedup0 or last0[v] != t
                    b = r * R + v
                    m = nxt0[b]
                    nxt0[b] = m + new0
                    row_a[v] = m + d0[b] if new0 else row_a[v]
                    win[m - a0 if new0 else spare] = t - tok_off_R[r]
                    last0[v] = t
                if not dedup1 or last1[d] != t:
                    b = v * R + d
                    m = nxt1[b]
                    nxt1[b] = m + 1
                    m_srow1[m] = row_a[v]
                    row_b[d] = m + d1[b]
                    last1[d] = t
                    dup[e] = False
                else:
                    dup[e] = True
                p = nxt[s]
                nxt[s] = p + 1
                g = p + g_delta[s]
                order[p] = e
                entry_row[e] = p + row_delta[s]
                entry_rank[e] = d
                expand[g] = row_b[d]
                if padded:
                    grow[p] = g
                    row_entry[g] = e
        for i in range(a1 - a0):   # (a loop, not a slice assignment: no shape check's message to compile)
            m_srow0[a0 + i] = win[i]


def _relay_classes(via_RR: np.ndarray):
    """(cls_RR, class_RC, ncls_R): each source's distinct relays in rank order (``class_RC[r, :ncls_R[r]]``,
    int64) and the index of ``via_RR[r, d]`` among them (int64 [R, R])."""
    R = via_RR.shape[0]
    v = np.sort(via_RR, axis=1)
    new = np.ones_like(v, dtype=bool)
    new[:, 1:] = v[:, 1:] != v[:, :-1]
    ncls = new.sum(axis=1).astype(np.int64)
    C = int(ncls.max()) if R else 0
    class_RC = np.zeros((R, max(C, 1)), dtype=np.int64)
    cls_RR = np.zeros((R, R), dtype=np.int64)
    for r in range(R):  # loop over source ranks, not entries
        cl = v[r][new[r]]
        class_RC[r, :cl.size] = cl
        cls_RR[r] = np.searchsorted(cl, via_RR[r])
    return cls_RR, class_RC, ncls


def two_hop_plan(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, via_RR: np.ndarray, tok_off_R: np.ndarray,
                 top_k: int, ranks: int, scopes, dedup, token_padding: int = 1):
    """(hops, entry_rank_N, entry_dup_N, (lay, row_entry_W, expand_src_row_W)) of a two-hop table route
    (see the module doc): what ``multihop.plan_from_routes`` builds for it readably.

    entry_slot_N: any integer dtype [N], every entry kept (slots in [0, S)).  slot_rank_S: int64 [S]
    sorted, in [0, R).  via_RR: [R, R] the relay of each (source, final rank), in [0, R).
    tok_off_R: int64 [R+1] each rank's first token (N = T*K).  scopes, dedup: the two hops'.
    """
    slot, slot_rank_S, tok_off, S, N, R, K = token_entries(entry_slot_N, slot_rank_S, tok_off_R, top_k, ranks)
    via = np.asarray(via_RR, dtype=np.int64)
    if via.shape != (R, R) or (via.size and (int(via.min()) < 0 or int(via.max()) >= R)):
        raise PlanError(f"via table (shape {list(via.shape)}) must be [R, R] = [{R}, {R}] of ranks in [0, {R})")
    d0, d1 = bool(dedup[0]), bool(dedup[1])
    scnt = np.zeros(S, dtype=np.int64)
    cnt0 = np.zeros(R * R, dtype=np.int64)
    cnt1 = np.zeros(R * R, dtype=np.int64)
    cls_RR, class_RC, ncls = _relay_classes(via)
    by_token = d0 and (ncls.size == 0 or int(ncls.max()) <= 64)
    route = Route2(slot, slot_rank_S, via, cls_RR, class_RC, ncls, by_token, tok_off, K, d0, d1)
    _check(_route2_counts(route, scnt, cnt0, cnt1), f"entry slot (must be in [0, {S}): every entry kept)")
    padded, cum, offset, rows_R = slot_geometry(scnt, slot_rank_S, token_padding, None, R)
    W = int(padded.sum())
    require_index(W, "final rows")
    pad = W != N
    first = np.cumsum(scnt) - scnt
    per0, M0, mstart0, row0_0 = _messages(cnt0, R)
    per1, M1, mstart1, row0_1 = _messages(cnt1, R)
    order, entry_row, entry_rank = (np.empty(N, dtype=INDEX) for _ in range(3))
    dup = np.empty(N, dtype=bool)
    src0, dst0, srow0, drow0 = (np.empty(M0, dtype=INDEX) for _ in range(4))
    src1, dst1, srow1, drow1 = (np.empty(M1, dtype=INDEX) for _ in range(4))
    expand = np.full(W, -1, dtype=INDEX) if pad else np.empty(W, dtype=INDEX)
    grow = np.empty(N if pad else 0, dtype=INDEX)
    row_entry = np.full(W, -1, dtype=INDEX) if pad else grow
    _route2_place(route, Route2Starts(first, offset, cum, mstart0, row0_0, mstart1, row0_1),
                  Route2Out(order, entry_row, entry_rank, dup, srow0, srow1, expand, grow, row_entry, pad))
    _fill_blocks(cnt0, R, row0_0, src0, dst0, drow0)
    _fill_blocks(cnt1, R, row0_1, src1, dst1, drow1)
    hops = [Hop(scopes[0], src0, srow0, dst0, drow0, per0), Hop(scopes[1], src1, srow1, dst1, drow1, per1)]
    lay = SlotLayout(scnt, padded, offset, entry_row, order, 0, rows_R, grow if pad else None)
    return hops, entry_rank, dup, (lay, row_entry if pad else order, expand)


__all__ = ["two_hop_plan"]
