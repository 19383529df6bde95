"""A reference MoE layer over the gloo Buffer, and the dense single-process layer it must equal.

Notation: T tokens of all ranks, s tokens of this rank, H hidden, F expert intermediate width
(H'), E experts, K top-k, W rows of this rank's expert-grouped layout, S its slots, epn_r experts
homed on this rank, X its expert copies.

Expert e is a SwiGLU: ``y = (silu(x @ gate[e]) * (x @ up[e])) @ down[e]`` with gate, up
``[H, F]`` and down ``[F, H]``; no biases, so a zero padding row gives a zero output. The router
is ``softmax(x @ router_w.T)`` followed by top-K (the K probabilities are the routing weights, not
renormalised).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from moonep_sim.gloo.buffer import Buffer
from moonep_sim.gloo.handle import Handle


def route(x_TH: torch.Tensor, router_w_EH: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, K] int64, topk_weights [T, K]) from softmax router probabilities."""
    probs = torch.softmax(x_TH @ router_w_EH.t(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return ids, w


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate) * (x @ up)) @ down


def expert_forward(rows_WH: torch.Tensor, handle: Handle, home_w: Sequence[torch.Tensor],
                   copy_w: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each slot's SwiGLU over its rows (grouped by ``handle.layout.cu_seqlens``) -> [W, H].

    home_w: (gate [epn_r, H, F], up, down [epn_r, F, H]) of this rank's home experts.
    copy_w: the same for this rank's copies ([X, ...], from :meth:`Buffer.prefetch_weight`).
    Padding rows are zero and stay zero (no bias). One matmul chain per slot (not per token).
    """
    cu = handle.layout.cu_seqlens.tolist()
    real = handle.slots.rows.tolist()
    widx = handle.slots.weight_index.tolist()
    is_copy = handle.slots.is_copy.tolist()
    outs = [rows_WH[:0]]  # keeps the output attached to the rows even when this rank has none
    for i in range(len(cu) - 1):
        lo, hi, n = cu[i], cu[i + 1], real[i]
        ws = copy_w if is_copy[i] else home_w
        j = widx[i]
        if n:
            outs.append(swiglu(rows_WH[lo:lo + n], ws[0][j], ws[1][j], ws[2][j]))
        if hi - lo - n:
            outs.append(rows_WH.new_zeros((hi - lo - n, rows_WH.shape[1])))
    return torch.cat(outs)


def dense_moe(x_TH: torch.Tensor, router_w_EH: torch.Tensor | None, experts_w: Sequence[torch.Tensor], top_k: int,
              *, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
              keep_TK: torch.Tensor | np.ndarray | None = None) -> torch.Tensor:
    """The single-process reference: every token's weighted sum of its top-K experts' SwiGLU.

    experts_w: (gate [E, H, F], up [E, H, F], down [E, F, H]).  routing: (ids, weights) [T, K] to
    use instead of the router (trace replay).  keep_TK: bool [T, K], False for entries a dropping
    strategy dropped (they contribute nothing).
    """
    gate, up, down = experts_w
    ids, w = routing if routing is not None else route(x_TH, router_w_EH, top_k)
    ids = torch.as_tensor(ids, dtype=torch.int64)
    w = torch.as_tensor(w).to(x_TH.dtype)
    if keep_TK is not None:
        w = w * torch.as_tensor(np.asarray(keep_TK), dtype=torch.bool).to(w.dtype)
    out = x_TH.new_zeros(x_TH.shape)
    for e in range(gate.shape[0]):  # one matmul chain per expert
        t, k = torch.nonzero(ids == e, as_tuple=True)
        if t.numel():
            y = swiglu(x_TH[t], gate[e], up[e], down[e]) * w[t, k][:, None]
            out = out.index_add(0, t, y)
    return out


def init_experts(num_experts: int, hidden: int, ffn: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic expert weights (gate, up, down) of all E experts, same on every rank."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(num_experts, hidden, ffn, generator=g, dtype=dtype) / hidden ** 0.5
    up = torch.randn(num_experts, hidden, ffn, generator=g, dtype=dtype) / hidden ** 0.5
    down = torch.randn(num_experts, ffn, hidden, generator=g, dtype=dtype) / ffn ** 0.5
    return gate, up, down


class EPMoELayer(torch.nn.Module):
    """An expert-parallel MoE layer on one rank: router -> dispatch -> SwiGLU experts -> combine.

    Parameters: ``router_w`` [E, H] (replicated: its gradient is this rank's contribution; sum
    it over ranks as data parallelism would), ``gate``/``up`` [epn_r, H, F], ``down`` [epn_r, F, H]
    for the experts homed on this rank (``home_experts``). Copies of hot experts are prefetched per
    step from their homes (resident replicas once, then from the Buffer's cache: call
    ``buffer.invalidate_replicas()`` on every rank after an optimizer step); their gradients are
    reduced home in backward.

    forward(x [s, H], routing=None) -> [s, H]. ``routing`` (ids, weights) replaces the router
    (trace replay). ``last_handle`` keeps the latest dispatch's handle (for inspection).
    """

    def __init__(self, buffer: Buffer, ffn: int, *, router_w: torch.Tensor | None = None,
                 experts_w: Sequence[torch.Tensor] | None = None, seed: int = 0) -> None:
        super().__init__()
        self.buffer = buffer
        E, H = buffer.num_experts, buffer.hidden
        home_E = buffer.placement.home_E
        self.home_experts = torch.from_numpy(np.flatnonzero(home_E == buffer.rank))
        if experts_w is None:
            experts_w = init_experts(E, H, ffn, seed)
        if router_w is None:
            router_w = torch.randn(E, H, generator=torch.Generator().manual_seed(seed + 1)) / H ** 0.5
        self.router_w = torch.nn.Parameter(router_w.clone())
        self.gate = torch.nn.Parameter(experts_w[0][self.home_experts].clone())
        self.up = torch.nn.Parameter(experts_w[1][self.home_experts].clone())
        self.down = torch.nn.Parameter(experts_w[2][self.home_experts].clone())
        self.last_handle: Handle | None = None
        self.cache_key = object()  # this layer's entry in the Buffer's resident-replica cache

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        ids, w = routing if routing is not None else route(x, self.router_w, self.buffer.top_k)
        rows, row_w, _, handle = self.buffer.dispatch(x, ids, w)
        self.last_handle = handle
        home = (self.gate, self.up, self.down)
        copies, rows = self.buffer.prefetch_weight(handle, home, tie=rows, cache_key=self.cache_key)
        y = expert_forward(rows, handle, home, copies)
        return self.buffer.combine(y, handle, row_w)
