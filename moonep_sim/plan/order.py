"""Sorting primitives the Plan builders and ``validate`` share.

Notation: N items (entries of a layer, flat id ``e = t*K + k``), K top-k.
"""

from __future__ import annotations

import numpy as np


def small_key_dtype(n_keys: int) -> type:
    """Smallest unsigned dtype holding ``n_keys`` distinct keys (int64 beyond 16 bits)."""
    return np.uint8 if n_keys <= 1 << 8 else np.uint16 if n_keys <= 1 << 16 else np.int64


def stable_order(key_N: np.ndarray, n_keys: int) -> np.ndarray:
    """int64 [N] permutation sorting ``key_N`` (integers in [0, n_keys)) stably.

    numpy's stable sort is a radix sort for integer dtypes of 16 bits or less, so keys of up to 16
    bits are sorted in one pass on a narrowed copy, and wider keys least-significant 16-bit digit
    first (one stable pass per digit: a radix sort whose digits are 16 bits wide). A stable sort's
    permutation is unique, so this equals ``np.argsort(key_N, kind="stable")``.
    """
    if n_keys <= 1 << 8:
        return np.argsort(key_N.astype(np.uint8, copy=False), kind="stable")
    if n_keys <= 1 << 16:
        key16 = key_N.astype(np.uint16, copy=False)
        chunks = min(-(-key16.size // CHUNK), key16.size // (2 * n_keys))
        if chunks >= 4:
            return _chunked_order(key16, n_keys, chunks)
        return np.argsort(key16, kind="stable")
    key = np.asarray(key_N, dtype=np.int64)
    order = np.argsort((key & 0xFFFF).astype(np.uint16), kind="stable")
    shift = 16
    while (n_keys - 1) >> shift:
        digit = ((key[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
        shift += 16
    return order


#: entries per chunk of :func:`stable_order`'s 16-bit sort: its keys and permutation (~320 KiB)
#: stay in cache, where one radix sort of millions reads its keys in a random order
CHUNK = 1 << 15


def key_counts(key_N: np.ndarray, n_keys: int) -> np.ndarray:
    """int64 [n_keys]: ``np.bincount(key_N, minlength=n_keys)`` counted chunk by chunk, so that a
    narrow key array is never widened to an [N] int64 copy (what ``bincount`` does in one call)."""
    n = key_N.size
    if n <= 4 * CHUNK:
        return np.bincount(key_N, minlength=n_keys).astype(np.int64, copy=False)
    out = np.zeros(n_keys, dtype=np.int64)
    for lo in range(0, n, 4 * CHUNK):  # loop over chunks, not entries
        out += np.bincount(key_N[lo:lo + 4 * CHUNK], minlength=n_keys)
    return out


def stable_order_counts(key_N: np.ndarray, n_keys: int,
                        out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(:func:`stable_order`, :func:`key_counts`) of ``key_N``, counting once where the sort counts.
    ``out``: an int64 [N] array the order may be written to (used where the sort fills its own)."""
    if 1 << 8 < n_keys <= 1 << 16:
        key16 = key_N.astype(np.uint16, copy=False)
        chunks = min(-(-key16.size // CHUNK), key16.size // (2 * n_keys))
        if chunks >= 4:
            return _chunked_order(key16, n_keys, chunks, counts=True, out=out)
    return stable_order(key_N, n_keys), key_counts(key_N, n_keys)


def stable_order_positions(key_N: np.ndarray, n_keys: int,
                           dtype: type = np.int64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, counts, pos): :func:`stable_order_counts` and the inverse permutation, ``pos[order[p]]
    = p`` (each item's place in the order); order and pos of ``dtype`` (int64, or int32 for the
    Plan's index dtype, written as such). Where the sort goes chunk by chunk, each chunk writes its
    items' places as it places them (in cache), instead of one scatter of N."""
    if 1 << 8 < n_keys <= 1 << 16:
        key16 = key_N.astype(np.uint16, copy=False)
        chunks = min(-(-key16.size // CHUNK), key16.size // (2 * n_keys))
        if chunks >= 4:
            pos = np.empty(key16.size, dtype=dtype)
            order, counts = _chunked_order(key16, n_keys, chunks, counts=True, pos=pos,
                                           out=np.empty(key16.size, dtype=dtype))
            return order, counts, pos
    order, counts = stable_order(key_N, n_keys).astype(dtype, copy=False), key_counts(key_N, n_keys)
    pos = np.empty(order.size, dtype=dtype)
    pos[order] = np.arange(order.size, dtype=dtype)
    return order, counts, pos


def _chunked_order(key16_N: np.ndarray, n_keys: int, chunks: int, counts: bool = False,
                   out: np.ndarray | None = None, pos: np.ndarray | None = None):
    """``np.argsort(key16_N, kind="stable")`` as ``chunks`` sorts of consecutive chunks, each moved
    block by block -- its entries of key k -- to where block (chunk, key) lies in (key, chunk)
    order. Chunks are in entry order, so that is the stable order. One pass counts each chunk's
    keys (where every block goes), a second sorts the chunks and places them; no [N] temporary
    beyond the result. The loops are over chunks (N / CHUNK), not entries. With ``counts`` also
    returns the keys' counts (int64 [n_keys]); with ``pos`` (int64 [N]) writes each item's place in
    the order there."""
    n = key16_N.size
    size = -(-n // chunks)
    cnt_CK = np.zeros((chunks, n_keys), dtype=np.int64)
    for c in range(chunks):
        cnt_CK[c] = np.bincount(key16_N[c * size:(c + 1) * size], minlength=n_keys)
    cnt_KC = cnt_CK.T.ravel()
    dest_CK = (np.cumsum(cnt_KC) - cnt_KC).reshape(n_keys, chunks).T  # where block (c, k) starts
    # the j-th sorted item of chunk c, of key k, goes to dest[c, k] + j - (its key's first j in
    # the chunk): rel[c, k] + j
    rel_CK = dest_CK - (np.cumsum(cnt_CK, axis=1) - cnt_CK)
    ok = out is not None and out.shape == (n,) and out.dtype in (np.int64, np.int32)
    order = out if ok else np.empty(n, dtype=np.int64)
    dt = order.dtype  # (places < n: the places and their table in the order's dtype)
    rel_CK = rel_CK.astype(dt)
    j = np.arange(size, dtype=dt)
    at = np.empty(size, dtype=dt)  # the places of a chunk's sorted items
    ks = np.empty(size, dtype=key16_N.dtype)  # its sorted keys
    for c in range(chunks):
        lo, hi = c * size, min(n, (c + 1) * size)
        if hi > lo:
            m = hi - lo
            local = np.argsort(key16_N[lo:hi], kind="stable")
            np.take(key16_N[lo:hi], local, out=ks[:m], mode="clip")  # ("clip": an out= take is unbuffered)
            np.take(rel_CK[c], ks[:m], out=at[:m], mode="clip")
            at[:m] += j[:m]
            if pos is not None:
                pos[lo:hi][local] = at[:m]
            local += lo
            order[at[:m]] = local
    return (order, cnt_CK.sum(axis=0)) if counts else order


def segment_ranges(first_B: np.ndarray, lens_B: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """int64 [sum(lens_B)]: the ranges ``first_B[b], first_B[b] + 1, ..., first_B[b] + lens_B[b] - 1``
    of B segments, concatenated (``np.repeat(first_B - start_B, lens_B) + np.arange(total)``).

    Built in one array, no [total]-sized temporary (which at millions of rows costs as much as the
    arithmetic): segments of SEGMENT_LOOP_MIN rows or more on average are each written once, as
    one shared ``arange`` plus their first value; many short ones as ones, the jump at each
    segment's start, then a cumulative sum in place. ``out``: an int64 (or int32, the Plan's index
    dtype, where the values fit) [total] array to build it in (else a new int64 one).
    """
    first = np.asarray(first_B, dtype=np.int64)
    lens = np.asarray(lens_B, dtype=np.int64)
    total = int(lens.sum())
    if out is None or out.shape != (total,) or out.dtype not in (np.int64, np.int32):
        out = np.empty(total, dtype=np.int64)
    if total == 0:
        return out
    nz = lens > 0
    f, n = first[nz], lens[nz]
    if f.size * SEGMENT_LOOP_MIN <= total:
        base = np.arange(int(n.max()), dtype=np.int64)
        pos = 0
        for fb, nb in zip(f.tolist(), n.tolist()):  # loop over segments, not rows
            np.add(base[:nb], fb, out=out[pos:pos + nb])
            pos += nb
        return out
    out.fill(1)
    start = np.cumsum(n) - n
    # at a segment's start the value jumps from the previous segment's last value to its first
    jump = f.copy()
    jump[1:] -= f[:-1] + n[:-1] - 1
    out[start] = jump
    np.cumsum(out, out=out)
    return out


#: mean segment length from which :func:`segment_ranges` writes segment by segment (one pass,
#: a Python step per segment) rather than by a cumulative sum (three passes over the rows)
SEGMENT_LOOP_MIN = 512


def segment_mask(start_B: np.ndarray, lens_B: np.ndarray, n: int) -> np.ndarray:
    """bool [n]: True on ``[start_B[b], start_B[b] + lens_B[b])`` for each of B disjoint segments.

    One int8 array of +1/-1 marks at the segments' ends (B-sized scatter-adds), summed in place:
    no [n]-sized integer temporary.
    """
    start = np.asarray(start_B, dtype=np.int64)
    lens = np.asarray(lens_B, dtype=np.int64)
    nz = lens > 0
    d = np.zeros(int(n) + 1, dtype=np.int8)
    np.add.at(d, start[nz], 1)
    np.add.at(d, start[nz] + lens[nz], -1)  # (where one segment ends as the next starts, they cancel)
    np.cumsum(d, dtype=np.int8, out=d)  # 1 inside a segment, 0 outside (segments are disjoint)
    return d[:-1].view(bool)


def entry_token(entry_N: np.ndarray, top_k: int) -> np.ndarray:
    """Token of each flat entry id (``e // K``; a shift when K is a power of two)."""
    if top_k & (top_k - 1) == 0:
        return entry_N >> (top_k.bit_length() - 1)
    return entry_N // top_k


__all__ = ["entry_token", "key_counts", "segment_mask", "segment_ranges", "small_key_dtype", "stable_order",
           "stable_order_counts", "stable_order_positions"]
