"""The readable Plan primitives: the forms below ``perf.plan_compiled_min`` entries, and what the
compiled kernels of ``fused`` / ``fused_routes`` are held equal to.

Each function returns the arrays its public caller needs (values and dtypes: per-entry and
per-message arrays as the Plan holds them, :data:`~moonep_sim.plan.kinds.INDEX`, converted once at
the end; the rest int64), computing in int64, each stable ``argsort`` over its key in the narrowest
dtype that holds it (``small_key_dtype``: a radix sort up to 16 bits). The tests check every compiled
form against them element-wise (``tests/test_plan_fused.py``, ``tests/test_plan_builders.py``,
``tests/test_planner_outputs_pinned.py``: named cases, hypothesis-drawn routings, a medium layer,
more than 256 ranks); ``tests/plan_reference.py`` composes them into the builders' references.

Notation as in :mod:`moonep_sim.plan.ir`: R ranks, T tokens (ranks concatenated), K top-k,
N = T*K entries (flat id ``e = t*K + k``), S slots, M messages of one hop, W final rows.

- :func:`slot_layout`: an entry's row is its slot's offset plus its position among the slot's
  entries in entry order.
- :func:`single_hop_messages` / :func:`route_hop`: sort entries by (destination, message key); the
  first of each run is a message; receive buffers are numbered in (source, key) order; messages
  are listed in (source, destination, key) order.
- :func:`dup_flags`: a later entry of an equal (token, rank) pair is a duplicate.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.plan.assembly import SlotLayout, slot_geometry
from moonep_sim.plan.compiled import check_at
from moonep_sim.plan.ir import Hop
from moonep_sim.plan.kinds import INDEX, Scope, require_index
from moonep_sim.plan.order import small_key_dtype


def slot_layout(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int = 1,
                min_rows_S: np.ndarray | None = None, ranks: int | None = None,
                with_ranks: bool = False) -> SlotLayout:
    """The :class:`~moonep_sim.plan.assembly.SlotLayout` of :func:`moonep_sim.plan.slot_layout`: the
    entries (slot int [N], -1 = dropped) sorted stably by slot, dropped ones first; the j-th entry
    of slot s gets row ``offset[s] + j`` of its rank and global final row ``cum[s] + j``."""
    slot = np.asarray(entry_slot_N).ravel().astype(np.int64)
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    S, N = slot_rank_S.size, slot.size
    require_index(N, "entries (tokens x top-k)")
    bad = (slot < -1) | (slot >= S)
    check_at(int(np.argmax(bad)) if bool(bad.any()) else -1, f"entry slot (must be in [-1, {S}))")
    order = np.argsort((slot + 1).astype(small_key_dtype(S + 1)), kind="stable")  # dropped first, then by slot
    n_drop = int(np.count_nonzero(slot < 0))
    kept = order[n_drop:]
    slot_rows = np.bincount(slot[kept], minlength=S).astype(np.int64)
    padded, cum, offset, rows_R = slot_geometry(slot_rows, slot_rank_S, token_padding, min_rows_S, ranks)
    require_index(int(padded.sum()), "final rows")
    j = np.arange(kept.size, dtype=np.int64) - np.repeat(np.cumsum(slot_rows) - slot_rows, slot_rows)
    entry_row = np.full(N, -1, dtype=np.int64)
    entry_row[kept] = offset[slot[kept]] + j
    grow = None if int(padded.sum()) == kept.size else (cum[slot[kept]] + j).astype(INDEX)
    entry_rank = None
    if with_ranks:
        entry_rank = np.where(slot >= 0, slot_rank_S[np.maximum(slot, 0)], -1).astype(INDEX)
    return SlotLayout(slot_rows, padded, offset, entry_row.astype(INDEX), order.astype(INDEX), n_drop, rows_R, grow,
                      entry_rank)


def single_hop_messages(entry_rank_N: np.ndarray, src_rank_T: np.ndarray, tok_off_R: np.ndarray,
                        top_k: int, ranks: int, dedup: bool) -> tuple[Hop, np.ndarray, np.ndarray]:
    """(hop, entry_buf_row_N, entry_dup_N) of :func:`moonep_sim.plan.single_hop_messages`."""
    entry_rank_N = np.asarray(entry_rank_N, dtype=np.int64)
    src_rank_T = np.asarray(src_rank_T, dtype=np.int64)
    tok_off_R = np.asarray(tok_off_R, dtype=np.int64)
    N = entry_rank_N.size
    kept = np.flatnonzero(entry_rank_N >= 0)
    dst = entry_rank_N[kept]
    tok = kept // max(int(top_k), 1)
    order = np.argsort(dst.astype(small_key_dtype(ranks)), kind="stable")  # (dst, entry) order
    d_s, t_s = dst[order], tok[order]
    first = np.ones(order.size, dtype=bool)
    if dedup:  # a token's later entries bound for the same destination share its message
        first[1:] = (d_s[1:] != d_s[:-1]) | (t_s[1:] != t_s[:-1])
    msg_of_sorted = np.cumsum(first) - 1
    msg_dst, msg_tok = d_s[first], t_s[first]
    per_dst = np.bincount(msg_dst, minlength=ranks)
    dst_start = np.cumsum(per_dst) - per_dst
    msg_row = np.arange(msg_dst.size, dtype=np.int64) - dst_start[msg_dst]
    entry_buf_row = np.full(N, -1, dtype=np.int64)
    entry_buf_row[kept[order]] = msg_row[msg_of_sorted]
    entry_dup = np.zeros(N, dtype=bool)
    entry_dup[kept[order]] = ~first
    msg_src = src_rank_T[msg_tok]
    o2 = np.argsort(msg_src.astype(small_key_dtype(ranks)), kind="stable")  # (src, dst, token): were (dst, token)
    hop = Hop(Scope.GLOBAL, msg_src[o2], (msg_tok - tok_off_R[msg_src])[o2], msg_dst[o2], msg_row[o2],
              per_dst.astype(np.int64))
    return hop, entry_buf_row.astype(INDEX), entry_dup


def route_hop(src_rank_N: np.ndarray, src_row_N: np.ndarray, dst_rank_N: np.ndarray, gid_N: np.ndarray,
              ranks: int, scope: str) -> tuple[Hop, np.ndarray]:
    """(hop, dst_row_N) of :func:`moonep_sim.plan.route_hop`: entries with equal (dst, gid) share
    one message, whose source is the first such entry's."""
    src_rank_N, src_row_N, dst_rank_N, gid_N = (np.asarray(a, dtype=np.int64)
                                                for a in (src_rank_N, src_row_N, dst_rank_N, gid_N))
    n = dst_rank_N.size
    if n == 0:
        z = np.zeros(0, np.int64)
        return Hop(scope, z, z, z, z, np.zeros(ranks, np.int64)), z
    G = int(gid_N.max()) + 1
    key = dst_rank_N * G + gid_N
    order = np.argsort(key, kind="stable")
    ks = key[order]
    first = np.ones(n, dtype=bool)
    first[1:] = ks[1:] != ks[:-1]
    msg_of_sorted = np.cumsum(first) - 1
    lead = order[first]  # one representative entry per message
    m_dst, m_gid = dst_rank_N[lead], gid_N[lead]
    m_src, m_srow = src_rank_N[lead], src_row_N[lead]
    # receive buffer order on each destination: (src, gid); messages sorted by (src, dst, gid)
    o2 = np.argsort((m_dst * ranks + m_src) * G + m_gid, kind="stable")
    per_dst = np.bincount(m_dst, minlength=ranks).astype(np.int64)
    dst_start = np.cumsum(per_dst) - per_dst
    m_row = np.empty(lead.size, dtype=np.int64)
    m_row[o2] = np.arange(lead.size, dtype=np.int64) - dst_start[m_dst[o2]]
    o3 = np.argsort((m_src * ranks + m_dst) * G + m_gid, kind="stable")
    hop = Hop(scope, m_src[o3], m_srow[o3], m_dst[o3], m_row[o3], per_dst)
    dst_row = np.empty(n, dtype=np.int64)
    dst_row[order] = m_row[msg_of_sorted]
    return hop, dst_row


def dup_flags(entry_rank_N: np.ndarray, top_k: int) -> np.ndarray:
    """bool [N] of :func:`moonep_sim.plan.dup_flags`: a kept entry whose token has an earlier kept
    entry at the same rank."""
    entry_rank_N = np.asarray(entry_rank_N, dtype=np.int64)
    N = entry_rank_N.size
    kept = np.flatnonzero(entry_rank_N >= 0)
    dup = np.zeros(N, dtype=bool)
    if kept.size == 0:
        return dup
    R = int(entry_rank_N.max()) + 1
    key = (kept // max(int(top_k), 1)) * R + entry_rank_N[kept]
    order = np.argsort(key, kind="stable")
    ks = key[order]
    later = np.zeros(kept.size, dtype=bool)
    later[1:] = ks[1:] == ks[:-1]
    dup[kept[order[later]]] = True
    return dup


__all__ = ["dup_flags", "route_hop", "single_hop_messages", "slot_layout"]
