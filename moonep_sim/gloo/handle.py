"""One rank's view of a Plan: the index tensors the gloo executor moves rows with.

Everything here is pure (numpy in, torch index tensors out, no communication), so one process can
build every rank's :class:`Handle` from one Plan and check the data movement without spawning
ranks (``tests/test_gloo_buffer.py`` does).

Notation
--------
R ranks of the EP group; s tokens on this rank; K top-k; C columns of a payload (H for rows, H+K
when routing-weight gradients ride along); m rows sent or received by this rank in one hop; n rows
of a hop's buffer on this rank; W rows of this rank's expert-grouped layout (padding included);
S slots of this rank; X expert copies (slots whose weights are prefetched); Q elements of one
expert's flattened weights.

Conventions: a hop's split sizes are listed per member of the hop's scope group, members in
ascending EP rank (the order ``dist.new_group(sorted ranks)`` numbers them). A -1 row index is a
zero padding row (dispatch) or a row whose contribution is discarded (combine).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moonep_sim.errors import PlanError
from moonep_sim.gloo.rowmap import Placer, RowMap, as_index, csr_addmm_ok, csr_matrix
from moonep_sim.gloo.weights import WeightFetch, weight_fetch
from moonep_sim.plan import ClusterShape, Plan
from moonep_sim.plan.direct import MAX_RUNS, MIN_RUN_BYTES, last_hop_runs, runs_are_direct


def scope_members(scope: str, rank: int, ranks: int, gpus_per_node: int) -> np.ndarray:
    """int64 [g]: EP ranks ``rank`` may talk to in ``scope``, ascending (its group's members)."""
    cl = ClusterShape(ranks, gpus_per_node)
    r = np.arange(ranks, dtype=np.int64)
    if scope == "global":
        return r
    if scope == "intra_node":
        return r[cl.same_node(r, rank)]
    if scope == "inter_node":
        return r[cl.same_rail(r, rank)]
    raise PlanError(f"hop scope ({scope!r}) must be one of global, intra_node, inter_node")


@dataclass(frozen=True)
class HopIndex:
    """This rank's part of one dispatch hop.

    scope: ``global`` | ``intra_node`` | ``inter_node``; members: int64 [g] EP ranks of the scope
    group, ascending. send: gathers the m_send rows to send from the source buffer (in send order:
    by destination, then the Plan's message order). send_splits / recv_splits: rows per member.
    recv: places received rows (grouped by source member) into the next buffer.
    """

    scope: str
    members: tuple[int, ...]
    send: RowMap
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv: Placer


@dataclass(frozen=True)
class SplitReduce:
    """Combine's reduce of a direct last hop in two parts, so the rows a rank keeps for its own
    tokens are read where they lie (in the expert outputs) instead of first being copied into the
    receive list:

        out[t] = sum over t's kept rows r of w[r] * y[r]          (``local``, run while the
                                                                     messages travel)
               + sum over t's received rows p of w'[p] * recv[p]  (``add_remote``)

    each part one sparse-times-dense product (``torch.addmm`` of a CSR matrix of weights; the first
    overwrites, the second accumulates) into memory the caller reuses across calls: no fresh
    [s, C] tensor (a fresh one page-faults on first touch, a pass over the rows' worth of time).
    Builds without that product for the dtype (:func:`csr_addmm_ok`) use weighted bag sums.

    loc_rows: int64 [n_keep] layout rows of the kept rows, grouped by token (stable).
    loc_crow: int64 [s+1] CSR row pointers of each token's kept rows in ``loc_rows``.
    rem_crow: int64 [s+1] CSR row pointers of each token's received rows.
    rem_col: int64 [n_recv] send-list positions of the received rows, grouped by token (stable).
    tokens: s.  list_rows: m (rows of the receive list).
    """

    loc_rows: torch.Tensor
    loc_crow: torch.Tensor
    rem_crow: torch.Tensor
    rem_col: torch.Tensor
    tokens: int
    list_rows: int

    @classmethod
    def build(cls, list_src: np.ndarray, self_runs, n_tokens: int) -> "SplitReduce":
        """list_src: int64 [m] token of each send-list row; self_runs: (rank, 0, a, b, n) runs kept
        (layout rows a.., send-list rows b..). Vectorised over rows (a loop over runs only)."""
        m = int(list_src.size)
        keep_b = np.concatenate([np.arange(b, b + n, dtype=np.int64) for _, _, _, b, n in self_runs]) \
            if self_runs else np.zeros(0, dtype=np.int64)
        keep_a = np.concatenate([np.arange(a, a + n, dtype=np.int64) for _, _, a, _, n in self_runs]) \
            if self_runs else np.zeros(0, dtype=np.int64)
        kept = np.zeros(m, dtype=bool)
        kept[keep_b] = True
        tok_keep = list_src[keep_b]
        order = np.argsort(tok_keep, kind="stable")
        loc_crow = np.concatenate([[0], np.cumsum(np.bincount(tok_keep, minlength=n_tokens))])
        rem_b = np.flatnonzero(~kept)
        tok_rem = list_src[rem_b]
        rorder = np.argsort(tok_rem, kind="stable")
        rem_crow = np.concatenate([[0], np.cumsum(np.bincount(tok_rem, minlength=n_tokens))])
        return cls(as_index(keep_a[order]), as_index(loc_crow), as_index(rem_crow), as_index(rem_b[rorder]), int(n_tokens), m)

    def local(self, y: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """``out`` [s, C] := each token's weighted sum over its kept rows of ``y`` [W, C] (``weights``
        [W] in y's dtype, or None = 1); zero rows for tokens with none. Returns ``out``."""
        n = int(self.loc_rows.numel())
        if n == 0 or self.tokens == 0:
            return out.zero_()
        vals = torch.ones(n, dtype=y.dtype) if weights is None else weights.index_select(0, self.loc_rows)
        if csr_addmm_ok(y.dtype):  # beta=0: out is overwritten, rows without kept rows zeroed
            return torch.addmm(out, csr_matrix(self.loc_crow, self.loc_rows, vals, (self.tokens, int(y.shape[0]))), y,
                               beta=0, out=out)
        return out.copy_(torch.ops.aten._embedding_bag_forward_only(y, self.loc_rows, self.loc_crow[:-1], False, 0,
                                                                    False, vals, False, -1)[0])

    def add_remote(self, out: torch.Tensor, recv: torch.Tensor, recv_w: torch.Tensor | None) -> torch.Tensor:
        """``out`` [s, C] += each token's weighted sum over its received rows of ``recv`` [m, C]
        (``recv_w`` [m], or None = 1), in place; one pass over the received rows. Returns ``out``."""
        n = int(self.rem_col.numel())
        if n == 0 or self.tokens == 0:
            return out
        vals = torch.ones(n, dtype=recv.dtype) if recv_w is None else recv_w.index_select(0, self.rem_col)
        if csr_addmm_ok(recv.dtype):
            s = csr_matrix(self.rem_crow, self.rem_col, vals, (self.tokens, self.list_rows))
            return torch.addmm(out, s, recv, out=out)
        offs = self.rem_crow[:-1]
        return out.add_(torch.ops.aten._embedding_bag_forward_only(recv, self.rem_col, offs, False, 0, False, vals,
                                                                   False, -1)[0])


@dataclass(frozen=True)
class DirectIndex:
    """The last hop moved by point-to-point messages straight between the caller's rows and the
    expert-grouped layout (no receive buffer, no final gather; combine sends straight from the
    layout), for a hop whose rows map one-to-one onto the layout's real rows.

    Within a slot, rows are ordered by global entry, so the rows one source sends for one slot
    fill ONE contiguous block of the destination's layout: a *run*. A run is one message
    (``isend``/``irecv`` of a row range); a source's rows for itself are gathered straight into
    the layout. Every rank derives every run from the Plan alone, so both ends agree on them.

    Runs are tuples ``(peer, tag, a, b, n)`` of n rows:
      send_runs: this rank -> peer (a: offset in the remote-send workspace, b: offset in the hop's
        full send list, i.e. the combine receive buffer).
      recv_runs: peer -> this rank (a: layout row, b unused).
      self_runs: (a: layout row, b: offset in the send list) of rows this rank keeps.
    The send list is this rank's rows of the hop ordered by (destination, destination's layout
    row) -- not the Plan's message order.
    remote_send: gathers the remote rows, in send-list order, from the hop's source buffer.
    list_map: the whole send list as a map onto the source buffer (its adjoint reduces combine's
      received rows). list_src: int64 [m] source-buffer row of each row of the send list.
    pad_pos: int64 layout rows that are padding (zeroed).
    split: combine's reduce in two parts (kept rows read from the expert outputs, received rows
      from the receive list): :class:`SplitReduce`.
    """

    send_runs: tuple[tuple[int, int, int, int, int], ...]
    recv_runs: tuple[tuple[int, int, int, int, int], ...]
    self_runs: tuple[tuple[int, int, int, int, int], ...]
    remote_send: RowMap
    list_map: RowMap  # the send list -> source buffer rows (combine reduces the received list with it)
    list_src: torch.Tensor
    pad_pos: torch.Tensor
    rows: int  # W
    list_rows: int  # m
    split: SplitReduce | None = None


def direct_index(plan: Plan, rank: int, max_runs: int | None = MAX_RUNS, min_run_bytes: int = MIN_RUN_BYTES,
                 row_bytes: int = 1) -> DirectIndex | None:
    """This rank's :class:`DirectIndex` for ``plan``'s last hop, or None where it does not apply.

    Applies when the last hop has no zero rows and its message rows map one-to-one onto the
    layout's real rows (no expansion of a row into several); and, unless ``max_runs`` is None,
    when no rank sends or receives more than ``max_runs`` remote runs and the mean remote run
    carries at least ``min_run_bytes`` (``row_bytes`` per row): otherwise a single
    ``all_to_all_single`` plus a local gather is cheaper than many small messages. The decision
    depends on the Plan only, so every rank takes the same one (``moonep_sim.plan.direct``, which
    the simulator uses too). Vectorised over rows.
    """
    runs = last_hop_runs(plan)
    if runs is None or not runs_are_direct(runs, plan.ranks, max_runs, min_run_bytes, row_bytes):
        return None
    src, dst, srow = runs.src, runs.dst, runs.srow
    starts, lens, r_src, r_dst, r_pos, tag = runs.starts, runs.lens, runs.r_src, runs.r_dst, runs.r_pos, runs.tag
    remote = runs.remote
    row_off = plan.row_off_R()
    exp = plan.expand_src_row_W
    lo, hi = np.searchsorted(src, [rank, rank + 1])
    mine_remote = dst[lo:hi] != rank
    ws_off = np.cumsum(mine_remote) - mine_remote  # offset among remote rows of each send-list row
    sel = np.flatnonzero((r_src == rank) & remote)
    send_runs = tuple((int(r_dst[i]), int(tag[i]), int(ws_off[starts[i] - lo]), int(starts[i] - lo), int(lens[i]))
                      for i in sel)
    sel = np.flatnonzero((r_dst == rank) & remote)
    recv_runs = tuple((int(r_src[i]), int(tag[i]), int(r_pos[i] - row_off[rank]), 0, int(lens[i])) for i in sel)
    sel = np.flatnonzero((r_src == rank) & ~remote)
    self_runs = tuple((rank, 0, int(r_pos[i] - row_off[rank]), int(starts[i] - lo), int(lens[i])) for i in sel)
    n_prev = int(plan.hops[-2].dst_rows_R[rank]) if len(plan.hops) > 1 else int(plan.tokens_per_rank_R[rank])
    my_src = srow[lo:hi]
    local = exp[row_off[rank]:row_off[rank + 1]]
    return DirectIndex(send_runs, recv_runs, self_runs, RowMap.build(my_src[mine_remote], n_prev),
                       RowMap.build(my_src, n_prev), as_index(my_src), as_index(np.flatnonzero(local < 0)),
                       int(local.size), int(hi - lo), SplitReduce.build(my_src, self_runs, n_prev))


@dataclass(frozen=True)
class LayoutRows:
    """This rank's expert-grouped layout (W rows, padding included) and its tokens' routing weights.

    entry: int64 [W] global entry id (t*K + k) of each row, -1 padding.  k: int64 [W] k of each
    row's entry (-1 padding).  weights: [W] routing weight of each row (0 for padding; float64 if
    the weights were dispatched in float64, else float32).  token_weights: [s, K] this rank's
    routing weights (same dtype).  cu_seqlens: int64 [S+1] row offsets of this rank's slots.
    """

    entry: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    token_weights: torch.Tensor
    cu_seqlens: torch.Tensor


@dataclass(frozen=True)
class SlotWeights:
    """This rank's S slots and where their expert weights come from.

    expert / rows / is_copy: [S] expert, real rows and "weights fetched" flag of each slot (a Plan
    copy, or a resident replica whose master weights live on another rank).  weight_index: int64
    [S] index of the slot's weights: into the rank's home experts for a home slot, into the fetched
    copies (the copy list) for a fetched slot.  home_experts: int64 [epn_r] experts whose master
    weights live on this rank (ascending).
    """

    expert: torch.Tensor
    rows: torch.Tensor
    is_copy: torch.Tensor
    weight_index: torch.Tensor
    home_experts: torch.Tensor


@dataclass(frozen=True)
class Handle:
    """The result of one dispatch on one rank: the Plan and this rank's precomputed indices.

    Reusable: :meth:`Buffer.dispatch` with ``handle=`` and every backward pass move rows with it
    again without exchanging routing or re-planning (as MoonEP's backward does). Immutable; index
    tensors are CPU int64 and must not be modified.

    plan: the layer's Plan (all ranks).  rank: this rank's EP rank.  num_tokens: s.
    Row movement: hops, per dispatch hop, this rank's :class:`HopIndex`; expand, the final local
    gather from the last hop's buffer into the expert-grouped layout (W rows); final, ``expand``
    composed with the last hop's placement -- the expert-grouped rows gathered straight from the
    rows as they arrive (one index pass instead of two; None without hops); direct, the last hop as
    point-to-point runs straight into / out of the layout (:class:`DirectIndex`), or None
    (``all_to_all_single`` plus the ``final`` gather).
    layout: the layout's rows and routing weights (:class:`LayoutRows`).
    slots: the slots and their weights (:class:`SlotWeights`).
    weights: the weight exchanges that fill the fetched slots and reduce their gradients
      (:class:`~moonep_sim.gloo.weights.WeightFetch`: three
      :class:`~moonep_sim.gloo.weights.WeightExchange`\\ s and the resident replicas).
    """

    plan: Plan
    rank: int
    num_tokens: int
    hops: tuple[HopIndex, ...]
    expand: RowMap
    final: RowMap | None
    layout: LayoutRows
    slots: SlotWeights
    weights: WeightFetch
    direct: DirectIndex | None = None

    @property
    def rows(self) -> int:
        """W: rows of this rank's expert-grouped layout."""
        return self.expand.rows

    @property
    def num_copies(self) -> int:
        """X: this rank's fetched slots."""
        return int(self.slots.is_copy.sum())


def build_handle(plan: Plan, rank: int, home_E: np.ndarray, weights_TK: np.ndarray | None = None) -> Handle:
    """Rank ``rank``'s :class:`Handle` for ``plan`` (vectorised over messages and rows).

    home_E: int64 [E] the rank holding each expert's master weights (the weights the executor is
    given). A copy slot's weights are fetched from its ``slot_home``, which must hold the master
    weights; a non-copy slot must run an expert whose master weights are on its own rank.
    """
    R, K, E = plan.ranks, plan.top_k, plan.num_experts
    G = plan.cluster.gpus_per_node
    home_E = np.asarray(home_E, dtype=np.int64)
    if home_E.shape != (E,):
        raise PlanError(f"home_E length ({home_E.size}) must equal num_experts ({E})")
    s = int(plan.tokens_per_rank_R[rank])
    hops: list[HopIndex] = []
    n_src = s
    for i, h in enumerate(plan.hops):
        members = scope_members(h.scope, rank, R, G)
        lo, hi = np.searchsorted(h.src_rank_M, [rank, rank + 1])
        send_dst = h.dst_rank_M[lo:hi]
        pos = np.searchsorted(members, send_dst)
        if send_dst.size and ((pos >= members.size) | (members[np.minimum(pos, members.size - 1)] != send_dst)).any():
            raise PlanError(f"hop {i} ({h.scope}): rank {rank} sends outside its scope group {members.tolist()}")
        send_splits = np.bincount(pos, minlength=members.size)
        recv_mask = h.dst_rank_M == rank
        recv_src = h.src_rank_M[recv_mask]
        rpos = np.searchsorted(members, recv_src)
        if recv_src.size and ((rpos >= members.size) | (members[np.minimum(rpos, members.size - 1)] != recv_src)).any():
            raise PlanError(f"hop {i} ({h.scope}): rank {rank} receives from outside its scope group {members.tolist()}")
        recv_splits = np.bincount(rpos, minlength=members.size)
        n_dst = int(h.dst_rows_R[rank])
        hops.append(HopIndex(h.scope, tuple(int(m) for m in members), RowMap.build(h.src_row_M[lo:hi], n_src),
                             tuple(int(c) for c in send_splits), tuple(int(c) for c in recv_splits),
                             Placer.build(h.dst_row_M[recv_mask], n_dst)))
        n_src = n_dst
    row_off = plan.row_off_R()
    rows = slice(int(row_off[rank]), int(row_off[rank + 1]))
    expand = RowMap.build(plan.expand_src_row_W[rows], n_src)
    final = None
    if hops:
        last = plan.hops[-1]
        recv_rows = last.dst_row_M[last.dst_rank_M == rank]
        pos_in_recv = np.full(n_src, -1, dtype=np.int64)
        pos_in_recv[recv_rows] = np.arange(recv_rows.size, dtype=np.int64)
        exp = plan.expand_src_row_W[rows]
        final = RowMap.build(np.where(exp >= 0, pos_in_recv[np.maximum(exp, 0)], -1), int(recv_rows.size))
    row_entry = plan.row_entry_W[rows]
    real = row_entry >= 0
    w_TK = plan.entry_weight_TK if weights_TK is None else weights_TK
    w_flat = np.asarray(w_TK).ravel()
    row_w = np.where(real, w_flat[np.maximum(row_entry, 0)] if w_flat.size else 0.0, 0.0).astype(w_flat.dtype)
    lo_t = int(plan.tok_off_R()[rank])
    tok_w = np.ascontiguousarray(np.asarray(w_TK)[lo_t:lo_t + s])
    row_k = np.where(real, row_entry % max(K, 1), -1)

    # slots and weights
    sl = plan.rank_slots(rank)
    padded = plan.slot_padded_S[sl]
    cu = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    experts = plan.slot_expert_S[sl]
    # A slot needs fetched weights when the Plan calls it a copy (fetched every step), or when it
    # is a resident replica of an expert whose master weights live elsewhere (a static placement
    # such as EPLB's): the executor holds master weights on home ranks only, so a resident
    # replica's weights are fetched once and cached by the Buffer while the resident set stays the
    # same. Both kinds have their gradients reduced to the master in backward.
    fetch_S = plan.is_copy_S() | (home_E[plan.slot_expert_S] != plan.slot_rank_S)
    is_copy = fetch_S[sl]
    home_experts = np.flatnonzero(home_E == rank)
    local_of_E = np.full(E, -1, dtype=np.int64)
    local_of_E[home_experts] = np.arange(home_experts.size)
    weight_index = np.where(is_copy, np.cumsum(is_copy) - 1, local_of_E[experts])
    layout = LayoutRows(entry=as_index(row_entry), k=as_index(row_k), weights=torch.from_numpy(row_w),
                        token_weights=torch.from_numpy(tok_w), cu_seqlens=as_index(cu))
    slots = SlotWeights(expert=as_index(experts), rows=as_index(plan.slot_rows_S[sl]),
                        is_copy=torch.from_numpy(is_copy.copy()), weight_index=as_index(weight_index), home_experts=as_index(home_experts))
    return Handle(plan=plan, rank=rank, num_tokens=s, hops=tuple(hops), expand=expand, final=final, layout=layout,
                  slots=slots, weights=weight_fetch(plan, rank, home_E, fetch_S, local_of_E))
