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
from moonep_sim.plan import GlobalRouting, Hop, Plan, Scope, assemble_plan, home_slots, stable_order
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


def _desc_weight_key_N(weights_N: np.ndarray) -> np.ndarray:
    """uint32 [N]: a key that sorts float32 weights from highest to lowest (NaN last).

    The float32 bit pattern, made monotonic (sign bit flipped for >= 0, all bits for < 0), then
    complemented; -0.0 is folded into +0.0 first so the two tie, as they compare equal.
    """
    w = np.asarray(weights_N, dtype=np.float32) + np.float32(0.0)  # -0.0 + 0.0 = +0.0
    u = w.view(np.uint32)
    neg = (u >> np.uint32(31)).astype(bool)
    key = np.where(neg, u, ~(u | np.uint32(0x80000000)))  # ~ascending key: descending order
    key[np.isnan(w)] = np.uint32(0xFFFFFFFF)  # NaN ranks after every number (as in a float sort)
    return key


def _keep_heaviest_A(A_N: np.ndarray, cnt_G: np.ndarray, cap_G: np.ndarray,
                     weights_N: np.ndarray) -> np.ndarray:
    """bool [N], in the order ``A_N`` (entries sorted stably by group): whether each entry is among
    the ``cap_G`` heaviest of its group (ties: earlier entry first) -- :func:`keep_mask_N`'s
    ``drop=weight`` without a sort of the entries by weight.

    One value sort of ``group << 32 | weight key`` over the groups above capacity (fast: no
    permutation to carry) gives each group's threshold, the cap-th heaviest weight; an entry stays if it is heavier, or if it ties
    the threshold and is among the first ties (in entry order) still within the capacity.
    """
    wkey = _desc_weight_key_N(weights_N)  # ascending = heaviest first
    w_A = wkey[A_N]
    del wkey
    start_G = np.cumsum(cnt_G) - cnt_G
    over = (cnt_G > cap_G) & (cap_G > 0)
    thr_G = np.full(cnt_G.size, 0xFFFFFFFF, dtype=np.int64)  # groups within capacity keep all
    if over.any():  # only the entries of groups over capacity are sorted (A_N keeps groups contiguous)
        cnt_O = cnt_G[over]
        packed = np.repeat(np.arange(cnt_O.size, dtype=np.int64) << 32, cnt_O)
        packed |= w_A[np.repeat(over, cnt_G)]
        packed.sort()
        thr_G[over] = packed[np.cumsum(cnt_O) - cnt_O + cap_G[over] - 1] & 0xFFFFFFFF
        del packed
    thr_G[(cnt_G > cap_G) & (cap_G <= 0)] = 0  # no capacity: only ties of key 0 compete, for 0 places
    thr_A = np.repeat(thr_G.astype(np.uint32), cnt_G)
    less = w_A < thr_A
    eq = w_A == thr_A
    del w_A, thr_A
    c_less = np.zeros(less.size + 1, dtype=np.int64)
    np.cumsum(less.view(np.uint8), dtype=np.int64, out=c_less[1:])
    n_less_G = c_less[start_G + cnt_G] - c_less[start_G]  # entries heavier than the threshold
    del c_less
    c_eq = np.cumsum(eq.view(np.uint8), dtype=np.int64)  # running count of ties, through each entry
    eq_before_G = np.concatenate([[0], c_eq])[start_G]
    # ties of group g kept: the first cap_g - n_less_g of them, i.e. running tie count <= that
    limit_G = eq_before_G + np.maximum(cap_G - n_less_G, 0)
    keep = c_eq <= np.repeat(limit_G, cnt_G)
    keep &= eq
    keep |= less
    return keep


def keep_mask_N(ids_N: np.ndarray, weights_N: np.ndarray, src_N: np.ndarray, cap_R: np.ndarray,
                num_experts: int, drop: str) -> np.ndarray:
    """bool [N]: which entries fit their (source rank, expert) capacity (vectorised).

    drop=weight keeps the highest weights (ties: earlier entry first); drop=position keeps the
    earliest entries (token order, then k).
    """
    ids_N = np.asarray(ids_N, dtype=np.int64)
    src_N = np.asarray(src_N, dtype=np.int64)
    cap_R = np.asarray(cap_R, dtype=np.int64)
    n = ids_N.size
    n_groups = int(cap_R.size) * num_experts
    group = src_N * num_experts + ids_N
    A = stable_order(group, n_groups)  # (group, entry) order
    cnt = np.bincount(group, minlength=n_groups).astype(np.int64) if n else np.zeros(n_groups, np.int64)
    cap_G = np.repeat(cap_R, num_experts)
    keep = np.empty(n, dtype=bool)
    if drop == "weight":
        keep[A] = _keep_heaviest_A(A, cnt, cap_G, weights_N)
    else:  # the sorted entries of group g sit at [start_g, start_g + cnt_g); the first cap_g stay
        keep[A] = np.arange(n, dtype=np.int64) < np.repeat(np.cumsum(cnt) - cnt + cap_G, cnt)
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
    # per expert -- but numbered in message order. A: entries sorted by (src, slot, entry).
    n_groups = R * S
    if n_groups <= 1 << 16:  # 16-bit group ids: no [N] int64 temporaries, and the radix sort's own key
        group = np.repeat((routing.src_rank_T() * S).astype(np.uint16), K)
        group += np.take(slot_of.astype(np.uint16), ids)
    else:
        group = np.repeat(routing.src_rank_T() * S, K)
        group += slot_of[ids]
    A = stable_order(group, n_groups)
    cnt_G = np.bincount(group, minlength=n_groups).astype(np.int64)  # entries per (src, slot)
    cap_G = np.repeat(cap_R, S)
    start_G = np.cumsum(cnt_G) - cnt_G
    if drop == "weight":  # keep the cap_G heaviest of each group (ties: earlier entry first)
        keep_A = _keep_heaviest_A(A, cnt_G, cap_G, routing.topk_weights_TK.ravel())
        keep = np.empty(N, dtype=bool)
        keep[A] = keep_A
    else:  # keep the first cap_G of each group in entry order
        keep_A = np.arange(N, dtype=np.int64) < np.repeat(start_G + cap_G, cnt_G)
        keep = np.empty(N, dtype=bool)
        keep[A] = keep_A
    del group
    entry_slot = np.where(keep, slot_of[ids], -1)
    del keep
    ke = A[keep_A]  # kept entries in (src, slot, entry) order: the hop's order of kept rows
    del A, keep_A
    kc_G = np.minimum(cnt_G, cap_G)  # kept rows per (src, slot) block
    per_rs = kc_G.reshape(R, S)
    # the layout's (slot, entry) order, dropped entries first: the kept entries are ke with its
    # (src, slot) blocks moved to (slot, src) order (tokens are in rank order), no sort needed
    n_kept = ke.size
    order_N = np.empty(N, dtype=np.int64)
    order_N[:N - n_kept] = np.flatnonzero(entry_slot < 0)
    kc_SR = np.ascontiguousarray(per_rs.T)
    to_SR = np.cumsum(kc_SR.ravel()) - kc_SR.ravel()  # block start in (slot, src) order
    move = np.repeat(to_SR.reshape(S, R).T.ravel() - (np.cumsum(kc_G) - kc_G), kc_G)
    move += np.arange(n_kept, dtype=np.int64)
    order_N[N - n_kept:][move] = ke
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
    # messages in (src, slot, row in block) order = (src, dst, dst_row) order, as slots are sorted
    # by rank and a (src, dst) pair's blocks lie in slot order in the destination's buffer
    M = int(blk_len.sum())
    m_start = np.cumsum(blk_len) - blk_len
    m_src = np.repeat(np.arange(R, dtype=np.int64), blk_len.reshape(R, S).sum(axis=1))
    m_dst = np.repeat(np.tile(dst_of_S, R), blk_len)
    m_row = np.repeat(blk_off - m_start, blk_len)
    m_row += np.arange(M, dtype=np.int64)
    # source row of a kept entry: its token's row on its own rank
    K1 = max(K, 1)
    k_row = ke >> (K1.bit_length() - 1) if K1 & (K1 - 1) == 0 else ke // K1
    k_row -= np.repeat(routing.tok_off_R()[:-1], per_rs.sum(axis=1))
    buf_row_K = np.empty(n_kept, dtype=np.int64)  # receive row of each kept entry, in layout order
    pad_slot = pad_row = np.zeros(0, np.int64)
    if pad:  # each block: its kept rows, then C_src - kept zero rows (src_row -1)
        is_kept_M = np.arange(M, dtype=np.int64) < np.repeat(m_start + kc_G, blk_len)
        m_srow = np.full(M, -1, dtype=np.int64)
        m_srow[is_kept_M] = k_row
        buf_row_K[move] = m_row[is_kept_M]
        np.logical_not(is_kept_M, out=is_kept_M)
        pad_row = m_row[is_kept_M]
        pad_slot = np.repeat(np.tile(np.arange(S, dtype=np.int64), R), blk_len - kc_G)
        del is_kept_M
    else:
        m_srow = k_row
        buf_row_K[move] = m_row
    del ke, k_row
    hop = Hop(Scope.GLOBAL, m_src, m_srow, m_dst, m_row, dst_rows_R)
    # static capacity: per slot sum_r C_r rows, rounded up to token_padding
    tp = max(int(ctx.token_padding), 1)
    slot_cap = np.full(S, int(cap_R.sum()), dtype=np.int64)
    slot_cap = (slot_cap + tp - 1) // tp * tp
    capacity_R = np.bincount(sr, weights=slot_cap, minlength=R).astype(np.int64)
    return assemble_plan(routing, ctx.cluster, ctx.costs, sr, se, sr, entry_slot, [hop], None,
                         np.zeros(T * K, dtype=bool), token_padding=tp,
                         min_rows_S=slot_cap if pad else None, pad_slot_P=pad_slot, pad_buf_row_P=pad_row,
                         capacity_R=capacity_R, options={"capacity_per_source_rank": int(cap_R.max()) if R else 0},
                         slot_order=(order_N, N - n_kept, kc_SR.sum(axis=1), buf_row_K))
