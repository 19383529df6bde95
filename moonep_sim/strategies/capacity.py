"""``capacity``: capacity factor with drop and pad (GShard, Switch, Megatron-Core drop-and-pad).

Anchor: Megatron-Core's ``alltoall`` dispatcher with ``moe_expert_capacity_factor`` and
``moe_pad_expert_input_to_capacity`` (after GShard / Switch). Capacity is per (source rank,
expert): rank r may send expert e at most ``C_r = ceil(s_r*K/E*cf)`` rows (s_r its tokens), so an
expert takes at most ``sum_r C_r`` (= ``ceil(T*K/E*cf)`` up to rounding when ranks hold equal
tokens) rows. Overflow is dropped by lowest routing weight (``drop=weight``, Megatron's ``probs``;
ties by position) or by position (``drop=position``: the earliest tokens stay).

With ``pad`` (the default) every rank sends a fixed ``[E, C_r]`` buffer: the unused rows travel as
zero rows (messages with ``src_row == -1``) and the expert computes them, so every shape is static
and no count exchange is needed; ``capacity_R`` is that static row count. ``pad=false`` sends only
the kept rows (drop without pad). There is no deduplication: each kept (token, k) is one row.
"""

from __future__ import annotations


import numpy as np

from moonep_sim.errors import require
from moonep_sim.limits import MAX_ELEMENTS
from moonep_sim.plan import (INDEX, Entries, GlobalRouting, Hop, Padding, Plan, Scope, SlotLayout, Slots,
                             assemble_plan, final_rows, home_slots, threads)
from moonep_sim.plan.assembly import slot_geometry
from moonep_sim.plan.kinds import require_index
from moonep_sim.plan.order import segment_mask, segment_ranges, small_key_dtype
from moonep_sim.strategies import Option, PlanContext, register

# Notation: T tokens, K top-k, E experts, R ranks, S slots (home slots, one per expert),
# N = T*K entries, M messages.


MAX_CF = 1024.0  # a capacity factor beyond any use (E/K is already every token)


def capacity_per_rank_R(tokens_per_rank_R: np.ndarray, top_k: int, num_experts: int, cf: float) -> np.ndarray:
    """int64 [R]: rows each source rank may send each expert, ``ceil(s_r*K/E*cf)``."""
    s = np.asarray(tokens_per_rank_R, dtype=np.int64)
    # exact ceil of s*K*cf/E, guarding float noise (e.g. 0.1*30 = 3.0000000000000004)
    x = s * top_k * float(cf) / num_experts
    return np.ceil(np.round(x, 9)).astype(np.int64)


def _desc_key_inplace(w_N: np.ndarray) -> np.ndarray:
    """uint32 [N]: a key that sorts float32 weights ``w_N`` (no -0.0 left: add +0.0 first, so the two
    tie) from highest to lowest, NaN last -- the float32 bit pattern made monotonic (sign bit
    flipped for >= 0, all bits for < 0), then complemented -- written over ``w_N``'s own memory
    (returned as its uint32 view): for a sign bit 0, ``~(u | 1 << 31) == 0x7FFFFFFF - u``;
    negative weights keep their bits; NaN becomes 0xFFFFFFFF."""
    nan = np.isnan(w_N)
    u = w_N.view(np.uint32)
    np.subtract(np.uint32(0x7FFFFFFF), u, out=u, where=u < np.uint32(0x80000000))
    u[nan] = np.uint32(0xFFFFFFFF)  # NaN ranks after every number (as in a float sort)
    return u


def _keep_heaviest_A(A_N: np.ndarray, cnt_G: np.ndarray, cap_G: np.ndarray,
                     weights_N: np.ndarray, weights_A: np.ndarray | None = None) -> np.ndarray:
    """bool [N], in the order ``A_N`` (entries sorted stably by group): whether each entry is among
    the ``cap_G`` heaviest of its group (ties: earlier entry first): ``drop=weight`` without a sort
    of the entries by weight.

    A group within its capacity keeps every entry, one without capacity none. For the groups above
    capacity (their entries only): one value sort of ``group << 32 | weight key`` (fast: no
    permutation to carry, and groups arrive in order) gives each group's threshold, the cap-th
    heaviest key, and how many entries are heavier (where the threshold first appears); an entry
    stays if it is heavier, or if it ties the threshold and is among the first ties (in entry
    order) still within the capacity. ``weights_A``: the weights already in the order ``A_N``
    (float32 [N], where the caller's sort gathered them), else gathered here.
    """
    over = (cnt_G > cap_G) & (cap_G > 0)
    keep = np.repeat(cnt_G <= cap_G, cnt_G)  # groups within capacity keep all, groups without none
    if not over.any():
        return keep
    sel = np.repeat(over, cnt_G)  # entries (in A order) of the groups above capacity
    w_O = (np.asarray(weights_N, dtype=np.float32)[A_N[sel]] if weights_A is None
           else np.asarray(weights_A, dtype=np.float32)[sel])
    w_O += np.float32(0.0)  # -0.0 + 0.0 = +0.0
    key_O = _desc_key_inplace(w_O)  # ascending = heaviest first
    cnt_O, cap_O = cnt_G[over], cap_G[over]
    g_O = np.arange(cnt_O.size, dtype=np.int64) << 32
    packed = np.repeat(g_O, cnt_O)
    packed |= key_O
    # a value sort: equal values are identical, so any kind gives this array; numpy's SIMD quicksort
    # sorts it ~3x faster than the stable kind (4M int64 keys: 0.04 against 0.11 s, 2026-12-02)
    packed.sort()
    seg_O = np.cumsum(cnt_O) - cnt_O  # each group's first position among the selected entries
    thr_O = packed[seg_O + cap_O - 1] & 0xFFFFFFFF  # the cap-th heaviest key of each group
    n_less_O = np.searchsorted(packed, g_O | thr_O) - seg_O  # entries heavier than the threshold
    del packed
    thr_x = np.repeat(thr_O.astype(np.uint32), cnt_O)
    keep_O = key_O < thr_x
    tie = np.flatnonzero(key_O == thr_x)  # ties of the threshold (few), in entry order per group
    del thr_x, key_O, w_O
    g_tie = np.searchsorted(seg_O, tie, side="right") - 1
    rank_tie = np.arange(tie.size, dtype=np.int64) - np.searchsorted(tie, seg_O)[g_tie]
    keep_O[tie[rank_tie < (cap_O - n_less_O)[g_tie]]] = True  # the first cap - n_less ties stay
    keep[sel] = keep_O
    return keep


@register("capacity", summary="capacity factor: at most ceil(s*K/E*cf) rows per (source rank, expert), "
                              "drop overflow, pad to capacity (Megatron drop-and-pad, GShard)",
          options={"cf": Option(float, 1.0, "capacity factor (> 0)", check=lambda v: 0 < v <= MAX_CF,
                                constraint=f"must be in (0, {MAX_CF:g}]: the capacity factor scales the rows each "
                                           "expert takes"),
                   "drop": Option(str, "weight", "drop policy: weight (lowest weight first) or position (latest first)",
                                  choices=("weight", "position")),
                   "pad": Option(bool, True, "send and compute zero rows up to capacity (static shapes)")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, cf: float, drop: str, pad: bool) -> Plan:
    T, K = routing.topk_ids_TK.shape
    E, R = routing.num_experts, ctx.cluster.ranks
    sr, se, slot_of = home_slots(ctx.placement)
    S = sr.size
    cap_R = capacity_per_rank_R(routing.tokens_per_rank_R, K, E, cf)
    rows = int(cap_R.sum()) * E  # padded rows of the whole layer, before anything is allocated
    require(rows <= MAX_ELEMENTS, f"option cf ({cf:g}) must give at most {MAX_ELEMENTS} padded rows per layer, "
                                  f"found {rows} (strategy capacity)")
    ids = routing.topk_ids_TK.ravel()
    N = ids.size
    # group = (source rank, home slot): the same groups as (source rank, expert) -- one home slot
    # per expert -- but numbered in message order. A: entries sorted by (src, slot, entry). Tokens
    # are in rank order, so each source rank's entries are one run: a stable sort of each run by
    # slot (a small radix sort whose scratch stays in cache) orders them all
    slot_key = np.take(slot_of.astype(small_key_dtype(S)), ids)  # [N] each entry's home slot, narrow
    bound = routing.tok_off_R() * K  # entries of source rank r: [bound[r], bound[r + 1])
    A = np.empty(N, dtype=INDEX)
    cnt_RS = np.zeros((R, S), dtype=np.int64)
    w_TK = routing.topk_weights_TK  # (its rows per source: no [N] copy where it is not C-ordered)
    w_A = np.empty(N, dtype=np.float32) if drop == "weight" else None  # the weights in A order
    for r in range(R):  # loop over source ranks, not entries
        lo, hi = int(bound[r]), int(bound[r + 1])
        if hi > lo:
            k = slot_key[lo:hi]
            cnt_RS[r] = np.bincount(k, minlength=S)
            local = np.argsort(k, kind="stable")
            if w_A is not None:  # (the run's weights are in cache here)
                np.take(w_TK[lo // K:hi // K].ravel(), local, out=w_A[lo:hi], mode="clip")
            np.add(local, lo, out=A[lo:hi])
    cnt_G = cnt_RS.ravel()  # entries per (src, slot)
    cap_G = np.repeat(cap_R, S)
    kc_G = np.minimum(cnt_G, cap_G)  # kept rows per (src, slot) block
    if drop == "weight":  # keep the cap_G heaviest of each group (ties: earlier entry first)
        keep_A = _keep_heaviest_A(A, cnt_G, cap_G, w_TK, w_A)
    else:  # keep the first cap_G of each group in entry order
        keep_A = segment_mask(np.cumsum(cnt_G) - cnt_G, kc_G, N)
    ke = A[keep_A]  # kept entries in (src, slot, entry) order: the hop's order of kept rows
    drop_N = np.ones(N, dtype=bool)
    drop_N[ke] = False
    del A, keep_A, w_A
    entry_rank = np.take(sr.astype(INDEX), slot_key)  # INDEX [N] the Plan's entry_rank (-1 dropped)
    np.copyto(entry_rank, -1, where=drop_N)
    del slot_key
    per_rs = kc_G.reshape(R, S)
    # the layout's (slot, entry) order, dropped entries first: the kept entries are ke with its
    # (src, slot) blocks moved to (slot, src) order (tokens are in rank order), no sort needed
    n_kept = ke.size
    order_N = np.empty(N, dtype=INDEX)
    order_N[:N - n_kept] = np.flatnonzero(drop_N)
    del drop_N
    kc_SR = np.ascontiguousarray(per_rs.T)
    kstart_RS = (np.cumsum(kc_G) - kc_G).reshape(R, S)  # block starts within ke
    np.take(ke, segment_ranges(kstart_RS.T.ravel(), kc_SR.ravel()), out=order_N[N - n_kept:], mode="clip")
    # receive buffer on each destination: blocks (src rank, slot in rank order), each C_src rows when
    # padding (kept rows first, zero rows after), or only the kept rows without padding
    block_RS = np.broadcast_to(cap_R[:, None], (R, S)) if pad else per_rs
    # offset of block (r, s) within its destination buffer: blocks ordered by (src r, slot s)
    dst_of_S = sr
    blk_dst = np.broadcast_to(dst_of_S[None, :], (R, S)).ravel()
    blk_len = np.ascontiguousarray(block_RS).ravel().astype(np.int64)
    blk_key = blk_dst * (R * S) + np.arange(R * S)  # (dst, src, slot) order
    o = np.argsort(blk_key, kind="stable")
    lens = blk_len[o]
    cum = np.cumsum(lens) - lens
    dst_start = np.concatenate([[0], np.cumsum(np.bincount(blk_dst, weights=blk_len, minlength=R))]).astype(np.int64)
    blk_off = np.empty(R * S, dtype=np.int64)
    blk_off[o] = cum - dst_start[blk_dst[o]]
    dst_rows_R = np.bincount(blk_dst, weights=blk_len, minlength=R).astype(np.int64)
    # receive row of each kept entry in layout (slot, src, entry) order: block (r, s) holds its
    # kept rows first, at blk_off[r, s] + j
    blk_off_SR = blk_off.reshape(R, S).T.ravel()
    buf_row_K = segment_ranges(blk_off_SR, kc_SR.ravel(), out=np.empty(n_kept, dtype=INDEX))
    # static capacity: per slot sum_r C_r rows, rounded up to token_padding
    tp = max(int(ctx.token_padding), 1)
    slot_cap = np.full(S, int(cap_R.sum()), dtype=np.int64)
    slot_cap = (slot_cap + tp - 1) // tp * tp
    min_rows = slot_cap if pad else None
    # the layout needs only the slot order and the kept rows: on a second thread beside the hop
    layout = threads.Beside(_layout, order_N, N - n_kept, kc_SR.sum(axis=1), sr, tp, min_rows, R, buf_row_K,
                            run=N >= ctx.perf.thread_min)
    # source row of a kept entry: its token's row on its own rank (written in place by _hop)
    K1 = max(K, 1)
    k_row = ke >> (K1.bit_length() - 1) if K1 & (K1 - 1) == 0 else ke // K1
    del ke
    with layout:
        hop, pad_slot, pad_row = _hop(routing, k_row, kc_G, per_rs, blk_len, blk_off, blk_off_SR, kc_SR, dst_of_S,
                                      dst_rows_R, pad, N)
    capacity_R = np.bincount(sr, weights=slot_cap, minlength=R).astype(np.int64)
    entries = Entries(None, None, np.zeros(T * K, dtype=bool), rank_N=entry_rank)
    return assemble_plan(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), entries, [hop],
                         padding=Padding(tp, min_rows, pad_slot, pad_row), capacity_R=capacity_R,
                         options={"capacity_per_source_rank": int(cap_R.max()) if R else 0}, layout=layout.result(),
                         perf=ctx.perf)


def _layout(order_N: np.ndarray, n_drop: int, slot_rows_S: np.ndarray, slot_rank_S: np.ndarray, tp: int,
            min_rows_S: np.ndarray | None, R: int, buf_row_K: np.ndarray) -> tuple:
    """The layout of capacity's slot order (``order_N``: the ``n_drop`` dropped entries, then the kept
    ones by (slot, entry), ``slot_rows_S`` of each: the stable sort by slot, known here without one)
    and the final rows, what ``assemble_plan`` takes as ``layout``; ``buf_row_K``: the kept entries'
    receive rows in that order. The j-th kept entry of slot s gets row ``offset[s] + j`` of its
    rank, final row ``cum[s] + j`` (capacity's own numpy: no compiled kernel to start)."""
    padded, cum, offset, rows_R = slot_geometry(slot_rows_S, slot_rank_S, tp, min_rows_S, R)
    require_index(int(padded.sum()), "final rows")
    kept, dropped = order_N[n_drop:], order_N[:n_drop]
    entry_row = np.empty(order_N.size, dtype=INDEX)
    entry_row[kept] = segment_ranges(offset, slot_rows_S, out=np.empty(kept.size, dtype=INDEX))
    entry_row[dropped] = -1
    grow = None if int(padded.sum()) == kept.size else segment_ranges(cum, slot_rows_S, out=np.empty(kept.size, INDEX))
    lay = SlotLayout(slot_rows_S, padded, offset, entry_row, order_N, n_drop, rows_R, grow)
    return (lay,) + final_rows(lay, kept, None, buf_row_K)


def _hop(routing: GlobalRouting, k_row: np.ndarray, kc_G: np.ndarray, per_rs: np.ndarray, blk_len: np.ndarray,
         blk_off: np.ndarray, blk_off_SR: np.ndarray, kc_SR: np.ndarray, dst_of_S: np.ndarray,
         dst_rows_R: np.ndarray, pad: bool, N: int) -> tuple[Hop, np.ndarray, np.ndarray]:
    """capacity's hop from its kept entries' tokens ``k_row`` (in (src, slot, entry) order; each
    made its row on its source rank here, in place) and its blocks
    (``blk_len``/``blk_off`` per (src, slot), src-major): (hop, pad_slot, pad_row), the zero rows
    that arrive, by (slot, src)."""
    R, S = per_rs.shape
    # messages in (src, slot, row in block) order = (src, dst, dst_row) order, as slots are sorted
    # by rank and a (src, dst) pair's blocks lie in slot order in the destination's buffer
    M = int(blk_len.sum())
    require_index(max(M, N), "messages of capacity's hop (padded rows) and entries")
    m_start = np.cumsum(blk_len) - blk_len
    m_src = np.repeat(np.arange(R, dtype=INDEX), blk_len.reshape(R, S).sum(axis=1))
    m_dst = np.repeat(np.tile(dst_of_S.astype(INDEX), R), blk_len)
    m_row = segment_ranges(blk_off, blk_len, out=np.empty(M, dtype=INDEX))
    k_bound = np.concatenate([[0], np.cumsum(per_rs.sum(axis=1))])
    tok_off = routing.tok_off_R()
    for r in range(R):  # k_row is in source-rank order: subtract each rank's first token in place
        k_row[k_bound[r]:k_bound[r + 1]] -= tok_off[r]
    pad_slot = pad_row = np.zeros(0, np.int64)
    if pad:  # each block: its kept rows, then C_src - kept zero rows (src_row -1)
        m_srow = np.full(M, -1, dtype=INDEX)
        m_srow[segment_mask(m_start, kc_G, M)] = k_row
        # the zero rows by (slot, src): the order assemble_plan lays them out in (no sort needed)
        npad_SR = (blk_len - kc_G).reshape(R, S).T.ravel()
        pad_row = segment_ranges(blk_off_SR + kc_SR.ravel(), npad_SR)
        pad_slot = np.repeat(np.arange(S, dtype=np.int64), npad_SR.reshape(S, R).sum(axis=1))
    else:
        m_srow = k_row
    del k_row
    return Hop(Scope.GLOBAL, m_src, m_srow, m_dst, m_row, dst_rows_R), pad_slot, pad_row
