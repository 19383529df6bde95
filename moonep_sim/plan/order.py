"""Index primitives the Plan builders, ``validate`` and the planners share.

Notation: N items (entries of a layer, flat id ``e = t*K + k``), K top-k.
"""

from __future__ import annotations

import numpy as np


def small_key_dtype(n_keys: int) -> type:
    """Smallest unsigned dtype holding ``n_keys`` distinct keys (int64 beyond 16 bits)."""
    return np.uint8 if n_keys <= 1 << 8 else np.uint16 if n_keys <= 1 << 16 else np.int64


def segment_ranges(first_B: np.ndarray, lens_B: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """int64 [sum(lens_B)]: the ranges ``first_B[b], first_B[b] + 1, ..., first_B[b] + lens_B[b] - 1``
    of B segments, concatenated (``np.repeat(first_B - start_B, lens_B) + np.arange(total)``).

    Built in one array, no [total]-sized temporary (which at millions of rows costs as much as the
    arithmetic): ones, the jump at each segment's start, then a cumulative sum in place. ``out``:
    an int64 (or int32, the Plan's index dtype, where the values fit) [total] array to build it in
    (else a new int64 one).
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
    out.fill(1)
    start = np.cumsum(n) - n
    # at a segment's start the value jumps from the previous segment's last value to its first
    jump = f.copy()
    jump[1:] -= f[:-1] + n[:-1] - 1
    out[start] = jump
    np.cumsum(out, out=out)
    return out


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


__all__ = ["entry_token", "segment_mask", "segment_ranges", "small_key_dtype"]
