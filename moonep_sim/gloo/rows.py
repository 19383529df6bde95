"""The gloo executor's row engine: moves rows and expert weights exactly as a handle says.

Notation: s tokens on this rank; W rows of this rank's expert-grouped layout (padding included);
C columns of a row; X expert copies this rank computes; P elements of one expert's flattened
weights; epn_r home experts of this rank.

- dispatch: hops forward (``index_select`` the send rows, ``all_to_all_single`` in the hop's
  scope group, place the received rows), then the expand gather into the expert-grouped layout
  (last hop "direct": per (source, slot) runs sent with isend/irecv straight into the layout --
  no receive buffer, no expand gather; see ``moonep_sim.gloo.handle.DirectIndex``);
- combine: weight each row, scatter-add through expand, hops in reverse; the last reduction into
  the token rows is one weighted bag sum (last hop "direct": runs sent straight from the layout,
  their routing weights alongside, the weighting done inside the receiver's reduction; the rows
  a rank keeps for its own tokens are summed straight from the layout while the messages travel,
  and the received rows added by one sparse accumulate: see ``handle.SplitReduce``);
- weights: one ``all_to_all_single`` of the copies' flattened weights (home -> copy rank), resident
  replicas cached per key; gradients: the reverse, ``index_add_`` at the home.

No autograd here: ``moonep_sim.gloo.autograd`` wraps these. Memory comes from a
:class:`~moonep_sim.gloo.pool.RowPool`; collectives from a :class:`~moonep_sim.gloo.comm.GroupComm`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from moonep_sim.errors import require
from moonep_sim.gloo.comm import GroupComm
from moonep_sim.gloo.handle import Handle, HopIndex, csr_addmm_ok
from moonep_sim.gloo.pool import RowPool

_WEIGHT_TAG = 1 << 20  # tag of the routing-weight message that rides with a peer's combine runs


class RowEngine:
    """Row and weight movement of one Buffer (see the module docstring).

    Counters: ``fetch_calls`` (prefetch all_to_alls issued; a step with Plan copies counts one),
    ``replica_fetches`` (of those, fetches that (re)filled the resident replicas' cache),
    ``fetched_experts`` (experts' weights received, all calls together), ``last_fetched``
    (experts' weights received in the latest prefetch).
    """

    def __init__(self, comm: GroupComm, pool: RowPool | None = None) -> None:
        self.comm = comm
        self.pool = pool or RowPool()
        # resident replicas' fetched weights per cache key: (resident_key, experts, [X_res, Q] rows)
        self._replicas: dict[Any, tuple[bytes, torch.Tensor, torch.Tensor]] = {}
        self.fetch_calls = 0
        self.replica_fetches = 0
        self.fetched_experts = 0
        self.last_fetched = 0

    def invalidate_replicas(self) -> None:
        """Forget the cached weights of resident replicas: the next prefetch fetches them again."""
        self._replicas.clear()

    def dispatch_rows(self, handle: Handle, x: torch.Tensor, phase: str = "dispatch",
                      comm_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[s, C] -> [W, C]: hops forward, then the expand gather (rows travel in ``comm_dtype``).

        The last hop's rows land in the expert-grouped layout directly (``handle.direct``: runs
        received straight into it) or through one gather from the receive buffer (``handle.final``).
        """
        buf = x if comm_dtype is None or comm_dtype == x.dtype else x.to(comm_dtype)
        n = len(handle.hops)
        if n == 0:
            out = self.pool.owned(handle.expand.gather(buf), x)
        for i, hop in enumerate(handle.hops):
            if i == n - 1 and handle.direct is not None:
                out = self._dispatch_direct(handle, hop, buf, f"{phase}.{i}")
                break
            send = hop.send.gather(buf, out=self.pool.workspace("send", hop.send.rows, buf))
            recv = self.comm.all_to_all(f"{phase}.{i}", hop.scope, hop.members, send, hop.send_splits, hop.recv_splits,
                                    out=self.pool.workspace(f"recv{i % 2}", int(sum(hop.recv_splits)), buf))
            if i < n - 1:
                buf = hop.recv.place(recv)
            elif handle.final.identity:
                out = self.pool.owned(recv, x)
            else:
                out = handle.final.gather(recv, out=self.pool.result(phase, (handle.final.rows,) + tuple(recv.shape[1:]),
                                                                 recv.dtype))
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _dispatch_direct(self, handle: Handle, hop: HopIndex, buf: torch.Tensor, phase: str) -> torch.Tensor:
        """The last hop as runs: remote rows gathered once into a send workspace and sent, each
        received run written straight into its block of the layout, own rows gathered into it."""
        d = handle.direct
        out = self.pool.result(phase.split(".")[0], (d.rows,) + tuple(buf.shape[1:]), buf.dtype)
        ops: list[tuple[Any, Any, int, int]] = [("recv", out[a:a + m], p, tag) for p, tag, a, _, m in d.recv_runs]
        rs = d.remote_send
        if rs.identity or rs.n_src == 0 or rs.pad_pos.numel():
            send = rs.gather(buf, out=self.pool.workspace("send", rs.rows, buf)) if d.send_runs else buf
            ops += [("send", send[a:a + m], p, tag) for p, tag, a, _, m in d.send_runs]
        else:  # each run gathered just before it is sent: the first messages leave while the rest gather
            send = self.pool.workspace("send", rs.rows, buf)
            for p, tag, a, _, m in d.send_runs:
                ops.append((lambda a=a, m=m: torch.index_select(buf, 0, rs.safe_idx[a:a + m], out=send[a:a + m]),
                            None, p, tag))
                ops.append(("send", send[a:a + m], p, tag))

        def local():
            for _, _, a, b, m in d.self_runs:
                torch.index_select(buf, 0, d.list_src[b:b + m], out=out[a:a + m])
            if d.pad_pos.numel():
                out.index_fill_(0, d.pad_pos, 0)

        self.comm.p2p(phase, hop.scope, ops, local)
        return out

    def combine_rows(self, handle: Handle, y: torch.Tensor, phase: str = "combine",
                     row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """[W, C] -> [s, C]: the adjoint of :meth:`dispatch_rows` (sums; rows first multiplied by
        ``row_weights`` [W] when given, fused into the first gather where the layout allows)."""
        n = len(handle.hops)
        direct = handle.direct is not None and n > 0
        first = handle.final if n else handle.expand
        # single direct hop: rows travel unweighted, their weights with them (one small message
        # per peer), and the receiver weights them inside its reduction (no pass of its own)
        w_at_dst = direct and n == 1 and row_weights is not None
        if direct:
            src = y if row_weights is None or w_at_dst else torch.mul(y, row_weights[:, None].to(y.dtype),
                                                                       out=self.pool.workspace("cbuf", y.shape[0], y))
        elif row_weights is not None and first.inverse is not None:
            buf = torch.index_select(y, 0, first.inverse, out=self.pool.workspace("cbuf", y.shape[0], y))
            buf.mul_(row_weights.index_select(0, first.inverse).to(buf.dtype)[:, None])
        else:
            yw = y if row_weights is None else y * row_weights[:, None].to(y.dtype)
            buf = first.scatter_add(yw)
        for i in reversed(range(n)):
            hop: HopIndex = handle.hops[i]
            recv_w = None
            if i == n - 1 and direct:
                d = handle.direct
                split = d.split is not None and src.dim() == 2 and src.is_contiguous() and csr_addmm_ok(src.dtype)
                recv, recv_w, part = self._combine_direct(
                    handle, hop, src, f"{phase}.{i}", f"recv{i % 2}",
                    row_weights.to(y.dtype).contiguous() if w_at_dst else None,
                    self.pool.result(phase, (d.split.tokens,) + tuple(src.shape[1:]), src.dtype) if split else None)
                if part is not None:  # kept rows already summed from src: add the received ones
                    buf = d.split.add_remote(part, recv, recv_w)
                    continue
                back = d.list_map
            else:
                send = buf if i == n - 1 else hop.recv.gather_back.gather(
                    buf, out=self.pool.workspace("send", hop.recv.gather_back.rows, buf))
                recv = self.comm.all_to_all(f"{phase}.{i}", hop.scope, hop.members, send, hop.recv_splits,
                                        hop.send_splits, out=self.pool.workspace(f"recv{i % 2}", int(sum(hop.send_splits)), buf))
                back = hop.send
            if i == 0 and (not back.identity or recv_w is not None):
                buf = back.reduce(recv, recv_w, self.pool.result(phase, (back.n_src,) + tuple(recv.shape[1:]),
                                                                 recv.dtype))
            else:
                buf = back.scatter_add(recv)
        return self.pool.owned(buf, y)

    def _combine_direct(self, handle: Handle, hop: HopIndex, src: torch.Tensor, phase: str, ws: str,
                        weights: torch.Tensor | None = None, split_out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The adjoint of :meth:`_dispatch_direct`: layout runs sent straight from ``src`` [W, C],
        received into the send list's order (reduced by ``handle.direct.list_map``); ``weights``
        [W] (optional) travel alongside, one message per peer. Returns (rows, their weights, None).

        With ``split_out`` ([s, C] memory, see :class:`~moonep_sim.gloo.handle.SplitReduce`) the
        rows this rank keeps are not copied into the receive list: while the messages travel they
        are summed into ``split_out`` straight from ``src``, returned third (the caller adds the
        received rows)."""
        d = handle.direct
        recv = self.pool.workspace(ws, d.list_rows, src)
        ops = [("recv", recv[b:b + m], p, tag) for p, tag, _, b, m in d.send_runs]
        ops += [("send", src[a:a + m], p, tag) for p, tag, a, _, m in d.recv_runs]
        recv_w = None
        if weights is not None:
            # one weight message per peer: a peer's runs are contiguous in the send list and
            # ordered by layout row at both ends, so the runs' weights concatenate in the same order
            recv_w = self.pool.workspace("cw", d.list_rows, weights)
            got: dict[int, list[int]] = {}
            for p, _, _, b, m in d.send_runs:
                got.setdefault(p, [b, b])[1] = b + m
            ops += [("recv", recv_w[b0:b1], p, _WEIGHT_TAG) for p, (b0, b1) in got.items()]
            sent: dict[int, list[torch.Tensor]] = {}
            for p, _, a, _, m in d.recv_runs:
                sent.setdefault(p, []).append(weights[a:a + m])
            ops += [("send", w[0] if len(w) == 1 else torch.cat(w), p, _WEIGHT_TAG) for p, w in sent.items()]

        part: list[torch.Tensor] = []

        def local():
            if split_out is not None:
                part.append(d.split.local(src, weights, split_out))
                return
            for _, _, a, b, m in d.self_runs:
                recv[b:b + m].copy_(src[a:a + m])
                if recv_w is not None:
                    recv_w[b:b + m].copy_(weights[a:a + m])

        self.comm.p2p(phase, hop.scope, ops, local)
        return recv, recv_w, part[0] if part else None

    def fetch_weights_flat(self, handle: Handle, local: Sequence[torch.Tensor], cache_key: Any = None,
                           phase: str = "prefetch") -> torch.Tensor:
        """[X, Q] flattened weights of this rank's fetched slots (slot order) from ``local``
        ([epn_r, ...] home experts per projection). Plan copies are fetched every call; resident
        replicas are served from the cache entry ``cache_key`` when its resident set equals the
        handle's (``handle.weights.residents.key``), else fetched with the copies and cached. Every rank
        decides alike from the Plan and its cache, so the collectives match."""
        wf, res = handle.weights, handle.weights.residents
        X, n_res = handle.num_copies, int(res.pos.numel())
        entry = self._replicas.get(cache_key)
        hit = entry is not None and entry[0] == res.key
        if (hit and X == n_res and wf.plan_copies.total == 0 and torch.equal(entry[1], res.expert)
                and torch.equal(res.pos, torch.arange(X))):
            # no rank fetches anything and every slot here is a cached resident replica in the cached
            # order: no collective and no copy (callers must not modify the returned weights in place)
            self.last_fetched = 0
            return entry[2]
        ex = wf.plan_copies if hit else wf.fetch   # cached residents: only the Plan copies travel
        send_flat = flatten_rows([t.index_select(0, ex.send_pos) for t in local], int(ex.send_pos.numel()))
        if ex.total == 0 or self.comm.world_size == 1:
            recv = send_flat
        else:
            recv = self.comm.all_to_all(phase, "global", range(self.comm.world_size), send_flat, ex.send_splits,
                                        ex.recv_splits)
            self.fetch_calls += 1
            self.replica_fetches += int(not hit and wf.fetch.total > wf.plan_copies.total)
        self.last_fetched = int(recv.shape[0])
        self.fetched_experts += self.last_fetched
        out = recv.new_empty((X,) + tuple(recv.shape[1:]))
        if recv.shape[0]:
            out.index_copy_(0, ex.recv_pos, recv)
        relay = wf.relay
        if relay.total and self.comm.world_size > 1:  # stage 1: relays forward their copies
            fwd = out.index_select(0, relay.send_pos).contiguous()
            got = self.comm.all_to_all(phase + ".1", "global", range(self.comm.world_size), fwd,
                                       relay.send_splits, relay.recv_splits)
            self.fetch_calls += 1
            self.fetched_experts += int(got.shape[0])
            if got.shape[0]:
                out.index_copy_(0, relay.recv_pos, got)
        if hit:
            if n_res:
                _, experts, rows = entry
                require(rows.shape[1:] == out.shape[1:] and rows.dtype == out.dtype,
                        f"weights ({list(out.shape[1:])} {out.dtype}) must match the cached resident replicas' "
                        f"({list(rows.shape[1:])} {rows.dtype}) for cache key {cache_key!r}: "
                        "use one cache key per set of weights")
                order = torch.argsort(experts, stable=True)
                at = order.index_select(0, torch.searchsorted(experts.index_select(0, order), res.expert))
                out.index_copy_(0, res.pos, rows.index_select(0, at))
        else:
            # cache the resident replicas' rows in this handle's order (experts distinct per rank)
            rows = out.index_select(0, res.pos).detach()
            self._replicas[cache_key] = (res.key, res.expert.clone(), rows)
        return out

    def reduce_flat(self, handle: Handle, copy_flat: torch.Tensor, n_home: int, phase: str = "grad_reduce") -> torch.Tensor:
        """[X, Q] copies' gradients -> [epn_r, Q] their sums at the home experts (zeros elsewhere)."""
        out = copy_flat.new_zeros((n_home,) + tuple(copy_flat.shape[1:]))
        fetch, relay = handle.weights.fetch, handle.weights.relay
        if fetch.total == 0:
            return out
        if relay.total and self.comm.world_size > 1:  # adjoint of stage 1: into the relays first
            back = copy_flat.index_select(0, relay.recv_pos).contiguous()
            got = self.comm.all_to_all(phase + ".1", "global", range(self.comm.world_size), back,
                                       relay.recv_splits, relay.send_splits)
            if got.shape[0]:
                copy_flat = copy_flat.clone().index_add_(0, relay.send_pos, got)
        send = copy_flat.index_select(0, fetch.recv_pos) if copy_flat.shape[0] else copy_flat
        recv = self.comm.all_to_all(phase, "global", range(self.comm.world_size), send.contiguous(), fetch.recv_splits,
                                fetch.send_splits) if self.comm.world_size > 1 else send
        if recv.shape[0]:
            out.index_add_(0, fetch.send_pos, recv)
        return out


def flatten_rows(tensors: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """[rows, Q]: each tensor [rows, ...] flattened per row and concatenated."""
    if not tensors:
        return torch.zeros(rows, 0)
    return torch.cat([t.reshape(rows, int(np.prod(t.shape[1:]))) for t in tensors], dim=1).contiguous()


def unflatten_rows(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Split [n, Q] back into tensors shaped like ``like[i]`` (with n rows)."""
    n = flat.shape[0]
    sizes = [int(np.prod(t.shape[1:])) for t in like]
    return tuple(p.reshape((n,) + tuple(t.shape[1:])) for p, t in zip(torch.split(flat, sizes, dim=1), like))


__all__ = ["RowEngine", "flatten_rows", "unflatten_rows"]
