"""Autograd for the gloo executor: dispatch, combine and prefetch as differentiable functions.

Notation: s tokens on this rank, K top-k, H hidden, W rows of this rank's expert-grouped layout,
X expert copies on this rank, Q elements of one expert's flattened weights.

- dispatch (x [s,H], topk_weights [s,K]) -> (rows [W,H], row_weights [W]). Backward: ONE combine on
  the same Plan, without routing weights, of ``[grad_rows | grad_row_weights one-hot at k]``
  ([W, H+K]): the first H columns sum into grad_x, the last K land exactly at each entry's
  (t, k) (an entry occupies one row), giving grad_topk_weights.
- combine (y [W,H], row_weights [W]) -> [s,H] = sum over a token's rows of weight * y. Backward: a
  dispatch of grad_out on the same Plan; grad_y = g * weight, grad_weight = <g, y> per row.
- prefetch (tie, home expert weights [epn_r, ...] per projection) -> (tie, copies [X, ...]).
  Plan copies are fetched each call; resident replicas' rows may come from the Buffer's cache
  (values fetched earlier from the same master weights). Backward: every fetched slot's gradient,
  cached or not, is reduced (summed) into its home expert's gradient, so gradients reach the master
  weights either way.

Backward collectives must run in the same order on every rank, and every rank must run them even
when its own part is empty (a rank without copies still takes part in the gradient reduce).
Autograd runs a node only if the loss reaches it, and orders independent nodes by creation, so
the layer chains them: prefetch passes ``tie`` (the dispatched rows) through, which makes the
order combine_bwd -> (expert backward, local) -> grad_reduce -> dispatch_bwd on every rank, and
reachable whenever the rows are used.
"""

from __future__ import annotations

import torch

from moonep_sim.gloo.handle import Handle
from moonep_sim.gloo.rows import flatten_rows, unflatten_rows


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, handle: Handle):
        ctx.buffer, ctx.handle = buffer, handle
        ctx.K = topk_weights.shape[1] if topk_weights.dim() == 2 else handle.top_k
        ctx.w_dtype = topk_weights.dtype
        rows = buffer.rows.dispatch_rows(handle, x, "dispatch", comm_dtype=buffer.dispatch_dtype)
        # a copy: an output of forward joins the graph, and the handle's own tensor must not (it
        # is reused by later steps and by combine's default weights)
        return rows, handle.layout.weights.to(x.dtype, copy=True)

    @staticmethod
    def backward(ctx, g_rows, g_w):
        buffer, handle, K = ctx.buffer, ctx.handle, ctx.K
        need_w = ctx.needs_input_grad[1]
        H = g_rows.shape[1]
        if need_w:
            real = handle.layout.k >= 0
            onehot = g_rows.new_zeros((handle.rows, K))
            onehot.scatter_(1, handle.layout.k.clamp(min=0)[:, None], (g_w * real.to(g_w.dtype))[:, None])
            payload = torch.cat([g_rows, onehot], dim=1)
        else:
            payload = g_rows
        out = buffer.rows.combine_rows(handle, payload.contiguous(), "dispatch_bwd")
        g_x = out[:, :H]
        g_tw = out[:, H:].to(ctx.w_dtype) if need_w else None
        return g_x, g_tw, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_weights, buffer, handle: Handle):
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(y, row_weights)
        return buffer.rows.combine_rows(handle, y.contiguous(), "combine", row_weights=row_weights)

    @staticmethod
    def backward(ctx, g_out):
        y, w = ctx.saved_tensors
        g = ctx.buffer.rows.dispatch_rows(ctx.handle, g_out.contiguous(), "combine_bwd")
        g_y = g * w[:, None].to(g.dtype) if ctx.needs_input_grad[0] else None
        g_w = (g * y).sum(dim=1).to(w.dtype) if ctx.needs_input_grad[1] else None
        return g_y, g_w, None, None


class _Prefetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, handle: Handle, cache_key, tie, *local):
        ctx.buffer, ctx.handle = buffer, handle
        ctx.shapes = [t.shape for t in local]
        # only the experts this rank sends are flattened (never all of its weights); resident
        # replicas come from the Buffer's cache when their placement is unchanged
        flat = buffer.rows.fetch_weights_flat(handle, local, cache_key)
        like = [t.new_empty((0,) + tuple(t.shape[1:])) for t in local]
        return (tie.view_as(tie),) + unflatten_rows(flat, like)

    @staticmethod
    def backward(ctx, g_tie, *g_copies):
        handle = ctx.handle
        n_home = int(handle.slots.home_experts.numel())
        flat = flatten_rows([g.contiguous() for g in g_copies], handle.num_copies)
        red = ctx.buffer.rows.reduce_flat(handle, flat, n_home)
        like = [g.new_empty((0,) + tuple(s[1:])) for g, s in zip(g_copies, ctx.shapes)]
        return (None, None, None, g_tie) + unflatten_rows(red, like)


def dispatch_fn(buffer, handle: Handle, x: torch.Tensor, topk_weights: torch.Tensor):
    return _Dispatch.apply(x, topk_weights, buffer, handle)


def combine_fn(buffer, handle: Handle, y: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    return _Combine.apply(y, row_weights, buffer, handle)


def prefetch_fn(buffer, handle: Handle, tie: torch.Tensor, *local: torch.Tensor, cache_key=None):
    """(tie passed through, copies...). The tie orders the backward: see the module docstring."""
    out = _Prefetch.apply(buffer, handle, cache_key, tie, *local)
    return out[0], tuple(out[1:])
