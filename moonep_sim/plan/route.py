"""The fast kernel of one route hop whose messages have one source each (what ``multihop`` runs).

Notation as in :mod:`moonep_sim.plan.ir`: R ranks, N entries, n of them taking part in the hop,
M messages. Its reference is :func:`moonep_sim.plan.reference.route_hop` (the tests compare).

A hop is described by two small records -- where its entries sit before it (:class:`Sources`)
and what makes one of its messages (:class:`Messages`) -- and built by :func:`grouped_hop` in
three steps, each a function of its own:

1. :func:`block_order`: the entries in (source, destination) blocks, stably, and each block's
   size -- one radix sort (per source rank on one-byte ranks, or on a 16-bit key, or on int64);
2. :func:`group_messages`: the first entry of each message (a new token, or a new block), the
   messages per block, each sorted entry's receive row (one running sum) and, if asked, the
   duplicate flags;
3. :func:`message_sources`: each message's source row, by arithmetic for tokens leaving their own
   ranks, else gathered source by source.

Requires the message key (token id) non-decreasing in entry order and entries with an equal
(destination, key) on one source rank -- true for a hop of tokens leaving their own ranks and for
any hop without deduplication. Equal keys of a (source, destination) block are then neighbours,
each first one a message, and a destination's receive rows follow the blocks.

Routes given as [R, R] tables (``multihop``'s usual path: every entry kept, tokens in rank order)
have two hops built without a sort over all N entries, each equal to :func:`grouped_hop`'s
(``tests/test_plan_hops.py``): the first hop when it deduplicates, from a [tokens, relays] table
per source rank (:func:`token_hop`), and the last hop, from the (source rank, final rank) pairs
of a per-source one-byte sort (:func:`pair_hop`). Their accesses stay inside one source rank's
entries; at K3 EP64 (8.4M entries) each took ~20-30% less CPU than the grouped form, measured
alternating in one process on the shared 2-core machine (load 5-6, 2026-12-02).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moonep_sim.plan.build import block_messages
from moonep_sim.plan.ir import Hop
from moonep_sim.plan.kinds import INDEX
from moonep_sim.plan.order import segment_ranges, stable_order, stable_order_counts


@dataclass(frozen=True)
class Sources:
    """Where a hop's n entries sit before it: either per entry, or as runs of the first hop.

    rank_N: int64 (or uint8, R <= 256) [n] the source rank of each entry; None with ``bound_R``.
    row_N: [n] the entry's row on that rank (INDEX, or int64); None with ``tok_off_R`` (rows by arithmetic).
    bound_R: int64 [R+1] for entries in source-rank runs (the first hop, every entry kept): rank
      r's entries are ``[bound_R[r], bound_R[r+1])``.
    sorted: ``rank_N`` is non-decreasing (the first hop's tokens in rank order).
    tok_off_R: int64 [R+1] first token of each rank: with a message key ``shift`` >= 0 the entries'
      source rows are ``(e >> shift) - tok_off_R[rank]`` (tokens on their own ranks).
    """

    rank_N: np.ndarray | None = None
    row_N: np.ndarray | None = None
    bound_R: np.ndarray | None = None
    sorted: bool = False
    tok_off_R: np.ndarray | None = None

    @classmethod
    def own_ranks(cls, bound_R: np.ndarray, tok_off_R: np.ndarray) -> "Sources":
        """Tokens on their own ranks, every entry kept, in rank runs (needs ``Messages.shift``)."""
        return cls(bound_R=bound_R, sorted=True, tok_off_R=tok_off_R)


@dataclass(frozen=True)
class Messages:
    """What makes one message of a hop.

    dedup: entries of one token bound for one rank share a message (else one per entry).
    gid_N: int64 [n] the token of each entry, non-decreasing; None when ``shift`` says it (or
      without dedup).
    shift: >= 0 when entry e's token is ``e >> shift`` (every entry kept, K a power of two).
    dup_N: with a value, :func:`grouped_hop` also returns bool [dup_N] flags of the entries that
      are not the first of their message (``kept_N[i]`` for the hop's entry i, or i itself).
    """

    dedup: bool
    gid_N: np.ndarray | None = None
    shift: int = -1
    dup_N: int | None = None
    kept_N: np.ndarray | None = None


class Scratch:
    """Dead [n] arrays of the Plan's index dtype (:data:`~moonep_sim.plan.kinds.INDEX`) a builder
    may write into instead of fresh pages (a caller's list: arrays the caller no longer reads; one
    taken may end up in what the builder returns). Arrays of another shape or dtype are dropped."""

    def __init__(self, n: int, spare: list | None):
        self.n, self.spare = n, [] if spare is None else spare

    def take(self) -> np.ndarray:
        while self.spare:
            b = self.spare.pop()
            if b.shape == (self.n,) and b.dtype == INDEX:
                return b
        return np.empty(self.n, dtype=INDEX)


def _sort_within_sources(dst_rank_N: np.ndarray, bound_R: np.ndarray, R: int, order: np.ndarray) -> np.ndarray:
    """Entries grouped by source rank (``bound_R``: int [R + 1] each source's run) sorted by
    destination inside each run, stably (one byte per destination: R <= 256), written into
    ``order``; returns int64 [R * R] the entries of each (source, destination) pair."""
    cnt = np.zeros((R, R), dtype=np.int64)
    for r in range(R):  # loop over source ranks, not entries
        lo, hi = int(bound_R[r]), int(bound_R[r + 1])
        if hi > lo:
            d8 = dst_rank_N[lo:hi].astype(np.uint8, copy=False)
            cnt[r] = np.bincount(d8, minlength=R)
            np.add(np.argsort(d8, kind="stable"), lo, out=order[lo:hi])
    return cnt.ravel()


def block_order(src: Sources, dst_rank_N: np.ndarray, ranks: int, msg: Messages,
                scratch: Scratch) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The entries stably sorted into (source, destination) blocks: (order_n, ecnt, key).

    ecnt: int64 [R*R] entries per block (source-major). key: the int64 block key when the wide
    path built one (its buffer is reused for the running sums), else None. Source runs with
    R <= 256 are sorted one byte per source rank; a 16-bit key (R*R <= 2^16) in place; else int64.
    """
    n, R = dst_rank_N.size, ranks
    if (src.sorted or src.bound_R is not None) and R <= 256:
        order = scratch.take()
        bound = src.bound_R if src.bound_R is not None else np.searchsorted(src.rank_N, np.arange(R + 1))
        return order, _sort_within_sources(dst_rank_N, bound, R, order), None
    if R * R <= 1 << 16 and (not msg.dedup or msg.shift >= 0):  # a 16-bit key, sorted in place
        key16 = np.empty(n, dtype=np.uint16)
        np.multiply(src.rank_N, R, out=key16, dtype=np.uint16, casting="unsafe")  # (values < R*R fit)
        np.add(key16, dst_rank_N, out=key16, dtype=np.uint16, casting="unsafe")
        order, ecnt = stable_order_counts(key16, R * R, out=scratch.take() if n else None)
        return order, ecnt, None
    key = src.rank_N.astype(np.int64) * R
    key += dst_rank_N
    return stable_order(key, R * R), np.bincount(key, minlength=R * R), key


def group_messages(order: np.ndarray, ecnt: np.ndarray, ranks: int, msg: Messages, buf: np.ndarray):
    """Messages of the sorted entries: (cnt, lead, row_sorted, dup).

    cnt: int64 [R*R] messages per block; lead: entry id of each message's first entry;
    row_sorted: int64 [n] (in ``buf``) the receive row of each sorted entry; dup: the duplicate
    flags ``msg.dup_N`` asks for (else None). Requires ``msg.dedup`` and n > 0.
    """
    n, R = order.size, ranks
    if msg.shift >= 0:
        gs = np.right_shift(order, msg.shift, out=buf)
    else:  # (order is in range: clip mode writes straight into buf)
        gs = np.take(np.asarray(msg.gid_N).astype(buf.dtype, copy=False), order, out=buf, mode="clip")
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(gs[1:], gs[:-1], out=first[1:])
    ebound = np.cumsum(ecnt) - ecnt
    nzb = ecnt > 0
    first[ebound[nzb]] = True  # a new (src, dst) block starts a new message
    lead_pos = np.flatnonzero(first)  # sorted position of each message's first entry
    cnt = np.diff(np.searchsorted(lead_pos, np.concatenate([[0], np.cumsum(ecnt)])))  # messages per block
    lead = order[lead_pos]
    np.copyto(buf, first)  # 1 where a message starts: running sums count messages
    dup = None
    if msg.dup_N is not None:
        np.logical_not(first, out=first)  # now: later entries of a message
        if msg.kept_N is None and msg.dup_N == n:  # order is a permutation of every entry
            dup = np.empty(n, dtype=bool)
            dup[order] = first
        else:
            dup = np.zeros(msg.dup_N, dtype=bool)
            later = order[first]
            dup[later if msg.kept_N is None else msg.kept_N[later]] = True
    # the receive row of a sorted entry is its message's: block b's messages take rows
    # dst_row0[b], dst_row0[b] + 1, ... (see block_messages), so a running sum of the message
    # starts, with a jump to dst_row0[b] at each block's first entry, gives every entry's row
    cnt_RR = cnt.reshape(R, R)
    r0 = (np.cumsum(cnt_RR, axis=0) - cnt_RR).ravel()[nzb]
    c_b = cnt[nzb]
    jump = r0.copy()
    jump[1:] -= r0[:-1] + c_b[:-1] - 1  # from the previous block's last row
    buf[ebound[nzb]] = jump
    return cnt, lead, np.cumsum(buf, out=buf), dup


def message_sources(src: Sources, msg: Messages, order: np.ndarray, lead: np.ndarray, cnt: np.ndarray,
                    ecnt: np.ndarray, m_src: np.ndarray, rows_sorted: np.ndarray, ranks: int,
                    dst_row: np.ndarray) -> np.ndarray:
    """[M] each message's source row (INDEX, or ``row_N``'s dtype); writes each entry's receive row
    into ``dst_row``."""
    R = ranks
    if src.tok_off_R is not None and msg.shift >= 0:  # tokens on their own ranks: rows by arithmetic
        # (lead is the hop's own array when it is not the sort itself: shifted in place)
        m_srow = np.right_shift(lead, msg.shift, out=None if lead is order else lead)
        m_bound = np.concatenate([[0], np.cumsum(cnt.reshape(R, R).sum(axis=1))])
        tok_off = np.asarray(src.tok_off_R, dtype=np.int64)
        for r in range(R):  # messages are in source-rank order: token -> row on its rank, in place
            m_srow[m_bound[r]:m_bound[r + 1]] -= tok_off[r]
        dst_row[order] = rows_sorted
        return m_srow
    # gather the messages' source rows and scatter the entries' receive rows source by source,
    # sources whose entries start lowest first: sources fed by the same earlier ranks (a relay's)
    # then follow each other and find those ranks' rows still in cache
    m_bound = np.concatenate([[0], np.cumsum(cnt.reshape(R, R).sum(axis=1))])
    e_bound = np.concatenate([[0], np.cumsum(ecnt.reshape(R, R).sum(axis=1))])
    has = np.flatnonzero(m_bound[1:] > m_bound[:-1])
    first_lead = np.minimum.reduceat(lead, m_bound[has]) if has.size else has
    m_srow = np.empty(lead.size, dtype=np.asarray(src.row_N).dtype)
    for r in has[np.argsort(first_lead, kind="stable")]:  # loop over source ranks, not entries
        a, b = int(m_bound[r]), int(m_bound[r + 1])
        np.take(src.row_N, lead[a:b], out=m_srow[a:b], mode="clip")  # (lead holds valid entries)
        a, b = int(e_bound[r]), int(e_bound[r + 1])
        dst_row[order[a:b]] = rows_sorted[a:b]
    return m_srow


def grouped_hop(src: Sources, dst_rank_N: np.ndarray, msg: Messages, ranks: int, scope: str,
                scratch: list | None = None):
    """One hop of a route (see the module doc): (hop, dst_row_N), and the duplicate flags as a
    third item when ``msg.dup_N`` is given.

    dst_rank_N: int64 (or uint8, R <= 256) [n] the rank each entry's token must reach.
    scratch: a list of dead INDEX [n] arrays the hop may write its sort and running sums into; it
    adds its own when done with them.
    """
    n, R = dst_rank_N.size, int(ranks)
    sc = Scratch(n, scratch)
    order, ecnt, key = block_order(src, dst_rank_N, R, msg, sc)
    row_sorted = None
    if msg.dedup and n:
        # one [n] int64 buffer holds each sorted entry's token, then its receive row
        cnt, lead, row_sorted, dup = group_messages(order, ecnt, R, msg, key if key is not None else sc.take())
    else:
        cnt, lead = ecnt.astype(np.int64), order
        dup = np.zeros(msg.dup_N or 0, dtype=bool)
    del key
    m_src, m_dst, m_row, per_dst = block_messages(cnt, R)
    dst_row = np.empty(n, dtype=INDEX)
    m_srow = message_sources(src, msg, order, lead, cnt, ecnt, m_src, m_row if row_sorted is None else row_sorted,
                             R, dst_row)
    hop = Hop(scope, m_src, m_srow, m_dst, m_row, per_dst)
    del m_srow, lead
    if scratch is not None:  # dead from here: the sort, and the running sums' buffer
        scratch.extend(b for b in (order, row_sorted) if b is not None and b.dtype == INDEX and b.shape == (n,))
    return (hop, dst_row) if msg.dup_N is None else (hop, dst_row, dup)


def token_hop(bound_R: np.ndarray, via_RR: np.ndarray, dst_rank_N: np.ndarray, shift: int, ranks: int,
              scope: str, scratch: list | None = None) -> tuple[Hop, np.ndarray]:
    """The first hop of a table route when it deduplicates, built token by token: what
    :func:`grouped_hop` returns for ``Sources.own_ranks`` and ``Messages(True, shift=shift)``.

    bound_R: int64 [R+1] the entries of source rank s are ``[bound_R[s], bound_R[s+1])`` (every
    entry kept, tokens in rank order, K = 1 << shift).  via_RR: [R, R] ``via_RR[s, d]``, the rank
    a token of source s bound for final rank d reaches on this hop.  dst_rank_N: uint8 [N] each
    entry's final rank.  Returns (hop, dst_row_N).

    Source s reaches a few relays (its *classes*: the distinct ``via_RR[s, :]``, in rank order; a
    node's GPU for DeepEP's hop, C <= 8 there), and a message is one (token, class) pair: a
    [T_s, C] table of which pairs occur gives the block (s, relay) as a column (its tokens in
    order) and each message's receive row by a running count down the column. The work is over
    T*C table cells in one source's rows at a time, instead of a sort of the N entries.
    Requires at most 64 classes per source; taken where there are at most 4*K (:func:`token_hop_fits`).
    """
    n, R = dst_rank_N.size, int(ranks)
    via = np.asarray(via_RR, dtype=np.int64)
    K = 1 << shift
    cnt = np.zeros((R, R), dtype=np.int64)  # messages per block (s, relay)
    tables = []
    cell = np.empty(int(np.max(np.diff(bound_R[:R + 1]), initial=0)), dtype=np.int64)  # one source's cell ids
    for s in range(R):  # loop over source ranks, not entries: which (token, class) pairs occur
        lo, hi = int(bound_R[s]), int(bound_R[s + 1])
        v = np.sort(via[s])
        classes = v[np.concatenate([[True], v[1:] != v[:-1]])]  # np.unique's, without its overhead
        cls_of = np.searchsorted(classes, via[s]).astype(np.uint8)  # final rank -> class (< 64)
        C, T_s = classes.size, (hi - lo) >> shift
        cls_TK = np.take(cls_of, dst_rank_N[lo:hi], mode="clip").reshape(T_s, K)  # (final ranks < R)
        seen_TC = np.zeros((T_s, C), dtype=bool)
        seen_TC.ravel()[_cells(cls_TK, C, cell)] = True
        cnt[s, classes] = seen_TC.sum(axis=0)
        tables.append((classes, cls_TK, seen_TC))
    m_src, m_dst, m_row, per_dst = block_messages(cnt.ravel(), R)
    first_row_RR = np.cumsum(cnt, axis=0) - cnt  # first receive row of each block (s, relay)
    m_srow = np.empty(m_src.size, dtype=INDEX)
    dst_row = Scratch(n, scratch).take()
    m = 0
    for s, (classes, cls_TK, seen_TC) in enumerate(tables):  # loop over source ranks, not entries
        lo, hi = int(bound_R[s]), int(bound_R[s + 1])
        T_s, C = seen_TC.shape
        if T_s == 0:
            continue
        # messages of source s in (relay, token) order: the table's columns, each down its tokens
        at = np.flatnonzero(seen_TC.T)
        np.remainder(at, T_s, out=m_srow[m:m + at.size])
        m += at.size
        # each pair's receive row: its block's first row plus the pairs above it in its column
        row_TC = np.cumsum(seen_TC, axis=0, dtype=INDEX)
        row_TC += first_row_RR[s, classes] - 1
        np.take(row_TC.ravel(), _cells(cls_TK, C, cell), out=dst_row[lo:hi].reshape(T_s, K), mode="clip")
    return Hop(scope, m_src, m_srow, m_dst, m_row, per_dst), dst_row


def _cells(cls_TK: np.ndarray, C: int, out: np.ndarray) -> np.ndarray:
    """int64 [T_s, K] (in ``out``): each entry's cell ``t*C + class`` of a source's [T_s, C] table,
    as a flat index (``np.take`` and a flat put run faster than a two-array fancy index)."""
    T_s, K = cls_TK.shape
    cell = out[:T_s * K].reshape(T_s, K)
    np.add(cls_TK, (np.arange(T_s, dtype=np.int64) * C)[:, None], out=cell)
    return cell


def token_hop_fits(via_RR: np.ndarray, top_k: int) -> bool:
    """Whether :func:`token_hop` takes this first hop: at most 64 relays per source rank, and at
    most 4*K (so that its T*C table cells stay within 4 per entry)."""
    v = np.sort(np.asarray(via_RR), axis=1)
    return bool(v.size == 0 or (1 + (v[:, 1:] != v[:, :-1]).sum(axis=1)).max() <= min(64, 4 * int(top_k)))


def pair_hop(bound_R: np.ndarray, via_RR: np.ndarray, dst_rank_N: np.ndarray, row_N: np.ndarray, msg: Messages,
             ranks: int, scope: str, scratch: list | None = None):
    """The last hop of a table route, built from the (source rank, final rank) pairs: what
    :func:`grouped_hop` returns for ``Sources(via_RR[s, d] per entry, row_N)``.

    bound_R: int64 [R+1] the entries of source rank s are ``[bound_R[s], bound_R[s+1])`` (every
    entry kept, tokens in rank order).  via_RR: [R, R] ``via_RR[s, d]``, the rank a token of
    source s bound for final rank d leaves from on this hop.  dst_rank_N: uint8 [N] each entry's
    final rank.  row_N: [N] its row in the hop's source buffer (INDEX).  msg: ``dedup``, ``shift``
    (K = 1 << shift) and, with ``dup_N``, the duplicate flags as a third item.

    The hop's block (v, d) holds the pairs (s, d) with ``via_RR[s, d] == v``, in source order; a
    pair's entries are a run of each source's entries sorted by final rank (one-byte sort per
    source), and tokens of different sources never mix, so the hop is that per-source order with
    its pair runs listed block by block. Every access to an [N] array then stays inside one
    source's run instead of ranging over all N entries, as a sort on (v, d) does; the tokens, the
    running sums and the messages' source rows are built source by source in one run-sized buffer
    (no [N] or [M] temporaries: at K3 EP64 ~0.5 -> ~0.35 s of a first run, line-profiled).
    """
    n, R = dst_rank_N.size, int(ranks)
    sc = Scratch(n, scratch)
    order = sc.take()  # entries by (source, final rank, entry): pair runs, s-major
    pc = _sort_within_sources(dst_rank_N, bound_R, R, order)  # entries of each pair (s, d)
    pc_RR = pc.reshape(R, R)
    bound = [int(b) for b in bound_R[:R + 1]]
    longest = max([b - a for a, b in zip(bound[:-1], bound[1:])] + [0])
    tmp = np.empty(longest, dtype=np.int64)  # one source's temporaries (in cache), not [N] arrays
    dedup = bool(msg.dedup and n)
    first = np.empty(n, dtype=bool) if dedup else None
    if dedup:  # a message per (token, final rank): the first entry of each token in a pair run
        mc_RR = np.zeros((R, R), dtype=np.int64)  # messages per pair
        for s, (lo, hi) in enumerate(zip(bound[:-1], bound[1:])):  # loop over source ranks, not entries
            if hi == lo:
                continue
            tok = np.right_shift(order[lo:hi], msg.shift, out=tmp[:hi - lo])
            f = first[lo:hi]
            f[0] = True
            np.not_equal(tok[1:], tok[:-1], out=f[1:])
            nz = np.flatnonzero(pc_RR[s])
            starts = (np.cumsum(pc_RR[s]) - pc_RR[s])[nz]
            f[starts] = True  # a new pair starts a new message
            mc_RR[s, nz] = np.add.reduceat(f.view(np.uint8), starts, dtype=np.int64)
        mc = mc_RR.ravel()
    else:
        mc = pc
    blk = (np.asarray(via_RR, dtype=np.int64) * R + np.arange(R, dtype=np.int64)[None, :]).ravel()
    cnt = np.bincount(blk, weights=mc, minlength=R * R).astype(np.int64)  # messages per block (v, d)
    m_src, m_dst, m_row, per_dst = block_messages(cnt, R)
    porder = np.argsort(blk, kind="stable")  # pairs in the hop's order: by block, then source
    mc_o = mc[porder]
    mstart_o = np.cumsum(mc_o) - mc_o  # each pair's first message in the hop
    has = mc_o > 0
    row0 = np.zeros(R * R, dtype=np.int64)  # each pair's first receive row
    row0[porder[has]] = m_row[mstart_o[has]]
    mstart = np.zeros(R * R, dtype=np.int64)  # each pair's first message in the hop, in pair order
    mstart[porder] = mstart_o
    dst_row = np.empty(n, dtype=INDEX)
    m_srow = np.empty(m_src.size, dtype=INDEX)
    dup = np.zeros(msg.dup_N, dtype=bool) if msg.dup_N is not None else None
    # source by source: each entry's receive row, the messages' source rows moved pair by pair into
    # the hop's order (reading one source's run at a time), the duplicate flags
    for s, (lo, hi) in enumerate(zip(bound[:-1], bound[1:])):  # loop over source ranks, not entries
        if hi == lo:
            continue
        o = order[lo:hi]
        nz = np.flatnonzero(mc_RR[s] if dedup else pc_RR[s])
        r0, c = row0[s * R + nz], mc[s * R + nz]
        if dedup:
            # a running sum of the message starts, jumping to the pair's first row at its first entry
            f = first[lo:hi]
            rows = tmp[:hi - lo]
            np.copyto(rows, f)
            jump = r0.copy()
            jump[1:] -= r0[:-1] + c[:-1] - 1  # from the previous pair's last row
            rows[(np.cumsum(pc_RR[s]) - pc_RR[s])[nz]] = jump
            np.cumsum(rows, out=rows)
            dst_row[o] = rows  # (within the source's run)
            lead = o[f]
        else:
            dst_row[o] = segment_ranges(r0, c, out=tmp[:hi - lo])
            lead = o
        srow = np.take(row_N, lead)  # the source's messages' source rows, in pair order
        for a, b, m in zip((np.cumsum(c) - c).tolist(), c.tolist(), mstart[s * R + nz].tolist()):  # loop over pairs
            m_srow[m:m + b] = srow[a:a + b]
        if dedup and dup is not None:
            np.logical_not(first[lo:hi], out=first[lo:hi])
            dup[o] = first[lo:hi]
    hop = Hop(scope, m_src, m_srow, m_dst, m_row, per_dst)
    if scratch is not None:  # dead from here: the order
        scratch.append(order)
    return (hop, dst_row) if msg.dup_N is None else (hop, dst_row, dup)


__all__ = ["Messages", "Scratch", "Sources", "block_order", "group_messages", "grouped_hop", "message_sources",
           "pair_hop", "token_hop", "token_hop_fits"]
