"""Builders for plans whose tokens travel over several hops (Tutel 2DH, DeepEP) or carry padding rows.

Notation (as in :mod:`moonep_sim.plan.plan`): R ranks, T tokens (ranks concatenated), K top-k,
N = T*K entries (flat id ``e = t*K + k``), S slots, M messages of one hop, P padding rows.

A *route* gives, for every entry, the rank its token sits on after each hop: ``via_N[h]`` after
hop h (the source rank before hop 0, the entry's slot rank after the last hop). Each hop sends one
row per *message key*: ``(token, rank after the hop)`` when the hop deduplicates (a token crosses
a hop once per receiving rank), ``(entry, rank after the hop)`` otherwise. A rank's receive buffer
of each hop is ordered by (source rank, token, k), so messages come out sorted by (src, dst) as
:class:`~moonep_sim.plan.Hop` requires.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.plan.placement import ClusterShape
from moonep_sim.plan.plan import GlobalRouting, Hop, Plan, RowCosts, layout_slots


def route_hop(src_rank_N: np.ndarray, src_row_N: np.ndarray, dst_rank_N: np.ndarray, gid_N: np.ndarray,
              ranks: int, scope: str) -> tuple[Hop, np.ndarray]:
    """One hop of a route, vectorised over the (kept) entries that take part in it.

    src_rank_N, src_row_N: where each entry's token sits before the hop (rank, buffer row).
    dst_rank_N: the rank the entry's token must reach.  gid_N: message key within a destination
    (token id to deduplicate, entry id not to); entries with equal (dst, gid) share one message,
    whose source is the first such entry's (lowest entry order) -- equal tokens, so any is correct.
    Returns (hop, dst_row_N): the Hop and each entry's row in the hop's receive buffer.
    """
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
    """bool [N]: True for a kept entry whose token has an earlier kept entry at the same rank."""
    N = entry_rank_N.size
    kept = np.flatnonzero(entry_rank_N >= 0)
    dup = np.zeros(N, dtype=bool)
    if kept.size == 0:
        return dup
    R = int(entry_rank_N.max()) + 1
    key = (kept // top_k) * R + entry_rank_N[kept]
    order = np.argsort(key, kind="stable")
    ks = key[order]
    later = np.zeros(kept.size, dtype=bool)
    later[1:] = ks[1:] == ks[:-1]
    dup[kept[order[later]]] = True
    return dup


def assemble_plan(strategy: str, options: dict[str, Any], routing: GlobalRouting, cluster: ClusterShape,
                  costs: RowCosts, slot_rank_S: np.ndarray, slot_expert_S: np.ndarray, slot_home_S: np.ndarray,
                  entry_slot_N: np.ndarray, hops: Sequence[Hop], entry_buf_row_N: np.ndarray,
                  entry_dup_N: np.ndarray, *, token_padding: int = 1, min_rows_S: np.ndarray | None = None,
                  pad_slot_P: np.ndarray | None = None, pad_buf_row_P: np.ndarray | None = None,
                  capacity_R: np.ndarray | None = None, started: float | None = None, **extra) -> Plan:
    """A Plan from explicit hops and each entry's row in the last hop's buffer.

    entry_slot_N: int64 [N] slot of each entry (slots sorted by rank), -1 = dropped.
    entry_buf_row_N: int64 [N] row of the last buffer (on the entry's rank) holding its token.
    entry_dup_N: bool [N] duplicate flags (see :class:`Plan`).
    pad_slot_P / pad_buf_row_P: optional padding rows that *arrived* over the wire (zero rows sent
    with ``src_row == -1``) and are computed by slot ``pad_slot_P[p]``: they fill that slot's
    padding rows in order; padding rows beyond them read the local zero row (-1).
    """
    T, K = routing.topk_ids_TK.shape
    R = cluster.ranks
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    entry_slot = np.asarray(entry_slot_N, dtype=np.int64).ravel()
    slot_rows, padded, offset, entry_row = layout_slots(entry_slot, slot_rank_S, token_padding, min_rows_S)
    entry_rank = np.where(entry_slot >= 0, slot_rank_S[np.maximum(entry_slot, 0)], -1)
    rows_R = np.bincount(slot_rank_S, weights=padded, minlength=R).astype(np.int64)
    row_off = np.concatenate([[0], np.cumsum(rows_R)])
    W = int(row_off[-1])
    row_entry = np.full(W, -1, dtype=np.int64)
    expand = np.full(W, -1, dtype=np.int64)
    kept = np.flatnonzero(entry_slot >= 0)
    g = row_off[entry_rank[kept]] + entry_row[kept]
    row_entry[g] = kept
    expand[g] = np.asarray(entry_buf_row_N, dtype=np.int64)[kept]
    if pad_slot_P is not None and len(pad_slot_P):
        ps = np.asarray(pad_slot_P, dtype=np.int64)
        order = np.argsort(ps, kind="stable")
        ps_sorted = ps[order]
        cnt = np.bincount(ps, minlength=slot_rank_S.size)
        if (cnt > padded - slot_rows).any():
            s = int(np.argmax(cnt > padded - slot_rows))
            raise PlanError(f"padding rows of slot {s} ({int(cnt[s])}) must fit its padding "
                            f"({int(padded[s] - slot_rows[s])})")
        j = np.arange(ps.size) - (np.cumsum(cnt) - cnt)[ps_sorted]
        gp = row_off[slot_rank_S[ps_sorted]] + offset[ps_sorted] + slot_rows[ps_sorted] + j
        expand[gp] = np.asarray(pad_buf_row_P, dtype=np.int64)[order]
    return Plan(
        strategy=strategy, options=dict(options), cluster=cluster, num_experts=routing.num_experts, top_k=K,
        tokens_per_rank_R=routing.tokens_per_rank_R, costs=costs, token_padding=max(int(token_padding), 1),
        entry_rank_TK=entry_rank.reshape(T, K), entry_row_TK=entry_row.reshape(T, K),
        entry_dup_TK=np.asarray(entry_dup_N, dtype=bool).reshape(T, K), entry_weight_TK=routing.topk_weights_TK,
        slot_rank_S=slot_rank_S, slot_expert_S=np.asarray(slot_expert_S, dtype=np.int64),
        slot_home_S=np.asarray(slot_home_S, dtype=np.int64), slot_offset_S=offset, slot_rows_S=slot_rows,
        slot_padded_S=padded, row_entry_W=row_entry, expand_src_row_W=expand, hops=tuple(hops),
        capacity_R=capacity_R,
        plan_seconds=(time.perf_counter() - started) if started is not None else 0.0, **extra)


def plan_from_routes(strategy: str, options: dict[str, Any], routing: GlobalRouting, cluster: ClusterShape,
                     costs: RowCosts, slot_rank_S: np.ndarray, slot_expert_S: np.ndarray, slot_home_S: np.ndarray,
                     entry_slot_TK: np.ndarray, via_N: Sequence[np.ndarray], scopes: Sequence[str],
                     dedup: Sequence[bool], *, token_padding: int = 1, started: float | None = None,
                     **extra) -> Plan:
    """A multi-hop Plan: entry e's token goes src -> via_N[0][e] -> ... -> its slot's rank.

    entry_slot_TK: int64 [T, K] slot per entry (-1 dropped).  via_N: H-1 int64 [N] arrays, the
    intermediate rank of each entry after hops 0..H-2 (values at dropped entries are ignored).
    scopes / dedup: one per hop (H = len(scopes)); dedup[h] sends a token once per receiving rank.
    """
    T, K = routing.topk_ids_TK.shape
    R = cluster.ranks
    H = len(scopes)
    if len(via_N) != H - 1 or len(dedup) != H:
        raise PlanError(f"route ({len(via_N)} intermediate ranks, {len(dedup)} dedup flags) must match "
                        f"hops ({H}): H-1 intermediate ranks and H flags")
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    entry_slot = np.asarray(entry_slot_TK, dtype=np.int64).ravel()
    kept = np.flatnonzero(entry_slot >= 0)
    tok = kept // max(K, 1)
    src = routing.src_rank_T()[tok]
    pos = [src] + [np.asarray(v, dtype=np.int64).ravel()[kept] for v in via_N] + [slot_rank_S[entry_slot[kept]]]
    row = tok - routing.tok_off_R()[src]
    hops = []
    for h in range(H):
        gid = tok if dedup[h] else kept
        hop, row = route_hop(pos[h], row, pos[h + 1], gid, R, scopes[h])
        hops.append(hop)
    entry_buf_row = np.full(entry_slot.size, -1, dtype=np.int64)
    entry_buf_row[kept] = row
    entry_rank = np.where(entry_slot >= 0, slot_rank_S[np.maximum(entry_slot, 0)], -1)
    entry_dup = dup_flags(entry_rank, K) if dedup[-1] else np.zeros(entry_slot.size, dtype=bool)
    return assemble_plan(strategy, options, routing, cluster, costs, slot_rank_S, slot_expert_S, slot_home_S,
                         entry_slot, hops, entry_buf_row, entry_dup, token_padding=token_padding,
                         started=started, **extra)


def home_slots(placement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot_rank_S, slot_expert_S, slot_of_E): a placement's home slots only (replicas ignored),
    sorted by rank, and the index of each expert's home slot among them."""
    p = placement
    home = p.slot_rank_S == p.home_E[p.slot_expert_S]
    sr, se = p.slot_rank_S[home], p.slot_expert_S[home]
    slot_of = np.empty(p.num_experts, dtype=np.int64)
    slot_of[se] = np.arange(se.size)
    return sr, se, slot_of
