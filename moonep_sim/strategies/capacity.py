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

import math
import time

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.plan import GlobalRouting, Hop, Plan
from moonep_sim.plan.multihop import assemble_plan, home_slots
from moonep_sim.strategies import PlanContext, register

# Notation: T tokens, K top-k, E experts, R ranks, S slots (home slots, one per expert),
# N = T*K entries, M messages.


def capacity_per_rank_R(tokens_per_rank_R: np.ndarray, top_k: int, num_experts: int, cf: float) -> np.ndarray:
    """int64 [R]: rows each source rank may send each expert, ``ceil(s_r*K/E*cf)``."""
    s = np.asarray(tokens_per_rank_R, dtype=np.int64)
    # exact ceil of s*K*cf/E, guarding float noise (e.g. 0.1*30 = 3.0000000000000004)
    x = s * top_k * float(cf) / num_experts
    return np.ceil(np.round(x, 9)).astype(np.int64)


def keep_mask_N(ids_N: np.ndarray, weights_N: np.ndarray, src_N: np.ndarray, cap_R: np.ndarray,
                num_experts: int, drop: str) -> np.ndarray:
    """bool [N]: which entries fit their (source rank, expert) capacity (vectorised).

    drop=weight keeps the highest weights (ties: earlier entry first); drop=position keeps the
    earliest entries (token order, then k).
    """
    n = ids_N.size
    group = src_N * num_experts + ids_N
    if drop == "weight":
        # lexsort is stable: equal (group, weight) keep entry order, so earlier entries win ties
        order = np.lexsort((-weights_N.astype(np.float64), group))
    else:
        order = np.argsort(group, kind="stable")
    gs = group[order]
    cnt = np.bincount(gs, minlength=int(cap_R.size) * num_experts) if n else np.zeros(0, np.int64)
    start = np.cumsum(cnt) - cnt
    rank_in_group = np.arange(n, dtype=np.int64) - start[gs]
    keep = np.empty(n, dtype=bool)
    keep[order] = rank_in_group < cap_R[gs // num_experts]
    return keep


@register("capacity", summary="capacity factor: at most ceil(s*K/E*cf) rows per (source rank, expert), "
                              "drop overflow, pad to capacity (Megatron drop-and-pad, GShard)",
          options={"cf": (float, 1.0, "capacity factor (> 0)"),
                   "drop": (str, "weight", "drop policy: weight (lowest weight first) or position (latest first)"),
                   "pad": (bool, True, "send and compute zero rows up to capacity (static shapes)")})
def plan(routing: GlobalRouting, ctx: PlanContext, cf: float = 1.0, drop: str = "weight", pad: bool = True) -> Plan:
    t0 = time.perf_counter()
    require(cf > 0 and math.isfinite(cf), f"cf ({cf:g}) must be > 0: the capacity factor scales the "
                                          "rows each expert takes")
    if drop not in ("weight", "position"):
        raise ConfigError(f"drop ({drop!r}) must be 'weight' or 'position'")
    T, K = routing.topk_ids_TK.shape
    E, R = routing.num_experts, ctx.cluster.ranks
    sr, se, slot_of = home_slots(ctx.placement)
    S = sr.size
    cap_R = capacity_per_rank_R(routing.tokens_per_rank_R, K, E, cf)
    ids = routing.topk_ids_TK.ravel()
    src = np.repeat(routing.src_rank_T(), K)
    keep = keep_mask_N(ids, routing.topk_weights_TK.ravel(), src, cap_R, E, drop)
    entry_slot = np.where(keep, slot_of[ids], -1)
    kept = np.flatnonzero(keep)
    tok = kept // max(K, 1)
    k_slot = entry_slot[kept]
    k_src = src[kept]
    k_dst = sr[k_slot]
    # receive buffer on each destination: blocks (src rank, slot in rank order), each C_src rows when
    # padding (kept rows first, zero rows after), or only the kept rows without padding
    per_rs = np.bincount(k_src * S + k_slot, minlength=R * S).reshape(R, S)  # kept rows per (src, slot)
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
    # position of each kept entry within its (src, slot) block: global order (layout order)
    b = k_src * S + k_slot
    ob = np.argsort(b, kind="stable")
    cnt_b = per_rs.ravel()
    pos = np.empty(kept.size, dtype=np.int64)
    pos[ob] = np.arange(kept.size) - (np.cumsum(cnt_b) - cnt_b)[b[ob]]
    e_buf_row = blk_off[b] + pos
    # messages: kept rows, plus zero rows (C_r - kept) of each block when padding
    m_src = [k_src]
    m_srow = [tok - routing.tok_off_R()[k_src]]
    m_dst = [k_dst]
    m_row = [e_buf_row]
    pad_slot = pad_row = np.zeros(0, np.int64)
    if pad:
        zeros = (block_RS - per_rs).ravel()
        zb = np.repeat(np.arange(R * S), zeros)
        zj = np.arange(zb.size) - np.repeat(np.cumsum(zeros) - zeros, zeros)
        pad_row = blk_off[zb] + cnt_b[zb] + zj
        pad_slot = zb % S
        m_src.append(zb // S)
        m_srow.append(np.full(zb.size, -1, np.int64))
        m_dst.append(dst_of_S[pad_slot])
        m_row.append(pad_row)
    ms, mr, md, mw = (np.concatenate(a) for a in (m_src, m_srow, m_dst, m_row))
    # (src, dst, dst_row) order; dst rows are unique per dst, so one int64 key sorts them
    om = np.argsort((ms * R + md) * (int(dst_rows_R.max()) + 1) + mw)
    hop = Hop("global", ms[om], mr[om], md[om], mw[om], dst_rows_R)
    entry_buf_row = np.full(T * K, -1, dtype=np.int64)
    entry_buf_row[kept] = e_buf_row
    # static capacity: per slot sum_r C_r rows, rounded up to token_padding
    tp = max(int(ctx.token_padding), 1)
    slot_cap = np.full(S, int(cap_R.sum()), dtype=np.int64)
    slot_cap = (slot_cap + tp - 1) // tp * tp
    capacity_R = np.bincount(sr, weights=slot_cap, minlength=R).astype(np.int64)
    return assemble_plan("capacity", {"cf": cf, "drop": drop, "pad": pad,
                                      "capacity_per_source_rank": int(cap_R.max()) if R else 0},
                         routing, ctx.cluster, ctx.costs, sr, se, sr, entry_slot, [hop], entry_buf_row,
                         np.zeros(T * K, dtype=bool), token_padding=tp,
                         min_rows_S=slot_cap if pad else None, pad_slot_P=pad_slot, pad_buf_row_P=pad_row,
                         capacity_R=capacity_R, started=t0)
