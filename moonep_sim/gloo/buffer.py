"""The gloo executor: a MoonEP-style Buffer that carries out any Plan on real tensors.

Public surface (DeepEP-like): :meth:`Buffer.dispatch`, :meth:`Buffer.combine`,
:meth:`Buffer.prefetch_weight`, :meth:`Buffer.reduce_grad`, :meth:`Buffer.invalidate_replicas`;
planning steps :meth:`Buffer.exchange_routing`, :meth:`Buffer.plan_handle`,
:meth:`Buffer.handle_for`. The Buffer plans with the ``planner`` callable it is given (routing ->
Plan; e.g. ``moonep_sim.strategies.planner("moonep", ctx)``) and never imports the strategies.
Its parts: ``comm`` (:class:`~moonep_sim.gloo.comm.GroupComm`: scope groups, timed collectives,
failure naming), ``rows`` (:class:`~moonep_sim.gloo.rows.RowEngine`: row and weight movement) and
its memory pool (:class:`~moonep_sim.gloo.pool.RowPool`).

Notation
--------
R ranks of the EP group; s tokens on this rank (``s <= capacity``); H hidden; K top-k; E experts;
W rows of this rank's expert-grouped layout (padding included); X expert copies this rank
computes; Q elements of one expert's flattened weights; epn_r home experts of this rank.

Data flow of one layer (``moonep_sim.plan.ir`` describes the Plan's data movement model)::

    dispatch: one all_gather of every rank's (s, topk_ids, topk_weights)  -> same Plan on every rank
              hop 0..H-1: index_select send rows, all_to_all_single(scope group), place rows
              expand: local gather into the expert-grouped layout
              (last hop "direct": per (source, slot) runs sent with isend/irecv straight into the
              layout -- no receive buffer, no expand gather; see DirectIndex)
    prefetch_weight: all_to_all_single of the copies' flattened weights (home -> copy rank)
    combine:  weight each row, scatter-add through expand, hops H-1..0 in reverse; the last
              reduction into the token rows is one weighted bag sum (embedding_bag's kernel)
              (last hop "direct": runs sent straight from the layout, their routing weights
              alongside, and the weighting done inside the receiver's reduction)
    reduce_grad: all_to_all_single of the copies' weight gradients (copy rank -> home), index_add_

Local passes over the rows are what this executor costs beyond the communication on CPUs (over
loopback TCP a byte sent costs about one memory copy): with a direct last hop a single-hop
dispatch + combine makes one gather of the token rows into send order and one weighted reduce
back into token rows, the least any executor starting from token-major rows can do.

The executor never looks at the strategy's name: it moves rows exactly as the Plan says.

Failure behaviour (``moonep_sim.gloo.comm``): every collective is issued asynchronously and
waited on with ``timeout_s``; a failed or timed-out collective raises
:class:`~moonep_sim.errors.CommError` naming the phase (``dispatch.0``, ``combine.1``,
``prefetch``, ...), this rank, and the peers that had not reached the phase, or first of all the
peer whose heartbeat stopped (a stopped or dead process); see :mod:`moonep_sim.gloo.liveness`.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from moonep_sim.errors import ConfigError, require
from moonep_sim.gloo.autograd import combine_fn, dispatch_fn, prefetch_fn
from moonep_sim.gloo.comm import GroupComm
from moonep_sim.gloo.teardown import register_at_exit
from moonep_sim.gloo.handle import Handle, build_handle, direct_index
from moonep_sim.gloo.pool import RowPool
from moonep_sim.gloo.rows import RowEngine, flatten_rows, unflatten_rows
from moonep_sim.plan import GlobalRouting, Placement, Plan, check
from moonep_sim.plan.direct import MAX_RUNS, MIN_RUN_BYTES

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16)

_DIRECT_MODES = ("auto", "on", "off")


def _code(v: Any) -> int:
    """A value as one int64: integers as themselves, anything else as a crc32 of its repr."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    return zlib.crc32(repr(v).encode()) | (1 << 40)


class Buffer:
    """Dispatch / combine / prefetch / gradient reduce over one EP process group (gloo).

    Create once per EP group, on every rank, with the same configuration (checked: one small
    all_gather of a fingerprint; a differing field raises :class:`ConfigError` naming the field
    and the ranks).

    group: the EP process group (None = the default group); its ranks are EP ranks 0..R-1 in
      ascending global rank order. The Buffer creates its own gloo subgroups with
      ``dist.new_group``, which every rank of the default group must call: build the Buffer on all
      ranks of the default group, in the same order as any other group creation.
    capacity: S, the most tokens one rank passes to :meth:`dispatch`.  hidden: H.
    top_k: K.  num_experts: E, homed in contiguous groups (rank h owns ``[h*E/R, (h+1)*E/R)``)
      unless ``placement`` is given.
    planner: ``planner(routing: GlobalRouting) -> Plan``, called identically on every rank with
      the exchanged global routing (``moonep_sim.strategies.planner(name, ctx, **options)`` makes
      one: a strategy bound to its context -- ranks, placement, row costs, padding -- and options).
      Its ``name`` and ``options`` attributes, when present, are checked equal across ranks.
      placement: the experts' home ranks the handles use (default: home groups); must be the one
      the planner plans with.
    gpus_per_node: ranks per node for ``intra_node`` / ``inter_node`` hops (0 = one node).
    timeout_s: limit on every collective (seconds).
    dispatch_dtype: the dtype rows travel in during dispatch (combine and gradients travel in the
      input's dtype).
    validate_plans: check every Plan's invariants before executing it (cheap; on by default).
    direct: how the last hop moves rows. ``"auto"`` (default): point-to-point runs straight into
      and out of the expert-grouped layout (:class:`~moonep_sim.gloo.handle.DirectIndex`) when the
      Plan allows it (its last hop maps rows one-to-one onto the layout) and the runs are few and
      large (at most 16 remote runs per rank, 64 KiB per run on average); otherwise one
      ``all_to_all_single`` into a receive buffer plus a local gather. ``"on"``: runs whenever
      the Plan allows, whatever their size. ``"off"``: always ``all_to_all_single``. Decided from
      the Plan alone, identically on every rank; results are identical either way.

    Results (dispatch's rows, combine's outputs) are fresh tensors to the caller, but their
    memory is recycled: once nothing references a result any more (no tensor, view or autograd
    record), a later call of the same kind may write its result into the same memory instead of
    allocating (large fresh CPU tensors page-fault on first touch, which costs as much as a pass
    over the rows). A result still referenced is never reused.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, capacity: int, hidden: int, top_k: int,
                 num_experts: int, planner: Callable[[GlobalRouting], Plan], gpus_per_node: int = 0,
                 timeout_s: float = 60.0, dispatch_dtype: torch.dtype = torch.float32,
                 placement: Placement | None = None, validate_plans: bool = True, direct: str = "auto") -> None:
        require(dist.is_available() and dist.is_initialized(),
                "torch.distributed (not initialised) must be initialised (dist.init_process_group('gloo')) "
                "before building a Buffer")
        require(capacity >= 1, f"capacity ({capacity}) must be >= 1")
        require(hidden >= 1, f"hidden ({hidden}) must be >= 1")
        require(1 <= top_k <= num_experts, f"top_k ({top_k}) must lie in [1, num_experts={num_experts}]")
        require(timeout_s > 0, f"timeout_s ({timeout_s}) must be > 0")
        require(dispatch_dtype in _FLOAT_DTYPES, f"dispatch_dtype ({dispatch_dtype}) must be one of {_FLOAT_DTYPES}")
        require(direct in _DIRECT_MODES, f"direct ({direct!r}) must be one of {_DIRECT_MODES}")
        require(callable(planner), f"planner ({planner!r}) must be callable: routing -> Plan "
                                   "(moonep_sim.strategies.planner(name, ctx, **options) makes one)")
        self.planner = planner
        self.direct = direct
        self.comm = GroupComm(group, timeout_s)
        register_at_exit()  # a job that never shuts down still ends in the safe order (gloo.teardown)
        self.group, self.members = self.comm.group, self.comm.members
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.capacity, self.hidden, self.top_k, self.num_experts = int(capacity), int(hidden), int(top_k), int(num_experts)
        self.gpus_per_node = int(gpus_per_node) or self.world_size
        self.timeout_s = float(timeout_s)
        self.dispatch_dtype = dispatch_dtype
        self.validate_plans = validate_plans
        self.rows = RowEngine(self.comm, RowPool())
        self.comm.mark("build.check")
        self._check_config()
        # after the check every rank agrees on the values below, so group creation is aligned
        require(self.world_size % self.gpus_per_node == 0,
                f"world size ({self.world_size}) must be divisible by gpus_per_node ({self.gpus_per_node})")
        if placement is None:
            require(num_experts % self.world_size == 0,
                    f"num_experts ({num_experts}) must be divisible by the world size ({self.world_size}) "
                    "for home-group placement")
            placement = Placement.home_groups(num_experts, self.world_size)
        self.placement = placement
        self.comm.make_scopes(self.gpus_per_node)

    # -- setup --------------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        """The fields compared across ranks at build time, in this order."""
        p = self.planner
        return dict(num_experts=self.num_experts, top_k=self.top_k, hidden=self.hidden,
                    planner=getattr(p, "name", None) or getattr(p, "__qualname__", type(p).__name__),
                    options=sorted(getattr(p, "options", {}).items()), capacity=self.capacity,
                    gpus_per_node=self.gpus_per_node, dispatch_dtype=str(self.dispatch_dtype),
                    world_size=self.world_size, direct=self.direct)

    def _check_config(self) -> None:
        vals = self._fingerprint()
        mine = torch.tensor([_code(v) for v in vals.values()], dtype=torch.int64)
        allfp = torch.stack(self.comm.all_gather("build.check", mine))
        for j, (f, mine_v) in enumerate(vals.items()):
            col = allfp[:, j]
            if (col != col[0]).any():
                differ = torch.nonzero(col != col[0]).flatten().tolist()
                same = torch.nonzero(col == col[0]).flatten().tolist()
                shown = col.tolist() if f in ("num_experts", "top_k", "hidden", "capacity", "gpus_per_node",
                                              "world_size") else None
                detail = (f"values by rank {shown}" if shown is not None else f"this rank has {mine_v!r}")
                raise ConfigError(f"Buffer {f} must be equal on every rank (ranks {same} agree with rank 0, ranks "
                                  f"{differ} differ; {detail}): build the Buffer with one configuration")

    # -- planning -----------------------------------------------------------------------------
    def check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Shapes, dtypes, ranges and s <= capacity, checked locally before any communication."""
        H, K, E, S = self.hidden, self.top_k, self.num_experts, self.capacity
        require(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == H,
                f"x shape ({list(getattr(x, 'shape', []))}) must be [s, {H}] (hidden)")
        require(x.dtype in _FLOAT_DTYPES, f"x dtype ({x.dtype}) must be floating point")
        s = x.shape[0]
        require(s <= S, f"tokens ({s}) must be <= capacity ({S}): build the Buffer with a larger capacity")
        require(isinstance(topk_ids, torch.Tensor) and tuple(topk_ids.shape) == (s, K),
                f"topk_ids shape ({list(getattr(topk_ids, 'shape', []))}) must be [{s}, {K}] (tokens, top_k)")
        require(topk_ids.dtype in _INT_DTYPES, f"topk_ids dtype ({topk_ids.dtype}) must be int64, int32 or int16")
        require(isinstance(topk_weights, torch.Tensor) and tuple(topk_weights.shape) == (s, K),
                f"topk_weights shape ({list(getattr(topk_weights, 'shape', []))}) must be [{s}, {K}]")
        require(topk_weights.dtype in _FLOAT_DTYPES, f"topk_weights dtype ({topk_weights.dtype}) must be floating point")
        if s:
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            require(lo >= 0 and hi < E, f"topk_ids value ({lo if lo < 0 else hi}) must lie in [0, {E}) (num_experts)")
            if K > 1:
                srt = torch.sort(topk_ids, dim=1).values
                dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
                if bool(dup.any()):
                    t = int(torch.nonzero(dup)[0])
                    raise ConfigError(f"topk_ids of token {t} ({topk_ids[t].tolist()}) must be distinct experts")

    def exchange_routing(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[GlobalRouting, np.ndarray]:
        """ONE all_gather of every rank's (s, ids, weights), padded to capacity.

        Each rank packs ``[s, wide, ids (S*K), weight bits (S*K)]`` as int64: weights travel as
        their exact bits (float64 when ``wide``, else float32). Returns the global routing (for the
        planner, float32 weights) and the weights at full precision (float64 [T, K]).
        """
        S, K, R = self.capacity, self.top_k, self.world_size
        s = topk_ids.shape[0]
        buf = torch.zeros(2 + 2 * S * K, dtype=torch.int64)
        buf[0] = s
        wide = topk_weights.dtype == torch.float64
        buf[1] = int(wide)
        buf[2:2 + s * K] = topk_ids.reshape(-1).to(torch.int64)
        w = topk_weights.detach().contiguous()
        bits = w.view(torch.int64) if wide else w.to(torch.float32).view(torch.int32).to(torch.int64)
        buf[2 + S * K:2 + S * K + s * K] = bits.reshape(-1)
        if R > 1:
            self.comm.mark("dispatch.exchange")
            allb = torch.stack(self.comm.all_gather("dispatch.exchange", buf, self.comm.scopes["global"])).numpy()
        else:
            allb = buf.numpy()[None]
        s_R = allb[:, 0].astype(np.int64)
        keep = np.arange(S)[None, :] < s_R[:, None]
        ids = allb[:, 2:2 + S * K].reshape(R, S, K)[keep]
        raw = allb[:, 2 + S * K:].reshape(R, S, K)
        f64_R = allb[:, 1].astype(bool)  # a rank's weights travel as float64 bits, else float32 bits
        w64 = np.empty(raw.shape, np.float64)  # each rank decoded one way only (no garbage decoded)
        w64[f64_R] = raw[f64_R].view(np.float64)
        w64[~f64_R] = raw[~f64_R].astype(np.int32).view(np.float32).astype(np.float64)
        w64 = w64[keep]
        return GlobalRouting(ids, w64.astype(np.float32), s_R, self.num_experts), w64

    def plan_handle(self, routing: GlobalRouting, weights_TK: np.ndarray | None = None) -> Handle:
        """Plan ``routing`` with the planner (identically on every rank) and build this rank's handle."""
        return self.handle_for(self.planner(routing), weights_TK)

    def handle_for(self, plan: Plan, weights_TK: np.ndarray | None = None) -> Handle:
        """This rank's handle for a given Plan (every rank must pass the same Plan)."""
        require(plan.ranks == self.world_size and plan.num_experts == self.num_experts and plan.top_k == self.top_k,
                f"plan shape (ranks {plan.ranks}, experts {plan.num_experts}, top_k {plan.top_k}) must match the "
                f"Buffer ({self.world_size}, {self.num_experts}, {self.top_k})")
        require(plan.cluster.gpus_per_node == self.gpus_per_node,
                f"plan gpus_per_node ({plan.cluster.gpus_per_node}) must equal the Buffer's ({self.gpus_per_node})")
        if self.validate_plans:
            check(plan)
        handle = build_handle(plan, self.rank, self.placement.home_E, weights_TK)
        if self.direct != "off" and plan.hops:
            elem = torch.tensor([], dtype=self.dispatch_dtype).element_size()
            # direct="auto": the point-to-point thresholds of moonep_sim.plan.direct (measured there)
            d = direct_index(plan, self.rank, None if self.direct == "on" else MAX_RUNS, MIN_RUN_BYTES,
                             self.hidden * elem)
            if d is not None:
                handle = dataclasses.replace(handle, direct=d)
        return handle

    # -- public API -----------------------------------------------------------------------------
    def invalidate_replicas(self) -> None:
        """Forget the cached weights of resident replicas: the next prefetch fetches them again.

        Call it on every rank (each rank decides from its own cache whether a fetch collective
        runs) whenever master weights change, e.g. after an optimizer step.
        """
        self.rows.invalidate_replicas()

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 *, handle: Handle | None = None):
        """Send each token to where the Plan computes its experts.

        x: [s, H] float, 0 <= s <= capacity.  topk_ids: [s, K] int, experts in [0, E), distinct per
        token.  topk_weights: [s, K] float routing weights (differentiable: their gradient flows
        back when :meth:`combine` is given ``recv_weights``).  handle: reuse a previous dispatch's
        Plan (no exchange, no planning); ``topk_ids`` / ``topk_weights`` are then ignored and
        the handle's weights are used.

        Returns ``(recv_x [W, H], recv_weights [W], cu_seqlens [S+1] int64, handle)``: rows
        grouped by slot (slot i owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``, the first
        ``handle.slots.rows[i]`` real, the rest zero padding), each row's routing weight (0 for
        padding). Differentiable in ``x`` and ``topk_weights``.
        """
        if handle is None:
            require(topk_ids is not None and topk_weights is not None,
                    "topk_ids and topk_weights (None) must be given unless a handle is reused")
            self.check_inputs(x, topk_ids, topk_weights)
            handle = self.plan_handle(*self.exchange_routing(topk_ids, topk_weights))
            w = topk_weights
        else:
            require(tuple(x.shape) == (handle.num_tokens, self.hidden),
                    f"x shape ({list(x.shape)}) must be [{handle.num_tokens}, {self.hidden}] (the handle's tokens)")
            w = handle.layout.token_weights
        recv_x, recv_w = dispatch_fn(self, handle, x, w)
        return recv_x, recv_w, handle.layout.cu_seqlens, handle

    def combine(self, y: torch.Tensor, handle: Handle, weights: torch.Tensor | None = None) -> torch.Tensor:
        """[W, H] expert outputs -> [s, H]: each token's sum of ``weight * output`` over its rows.

        weights: [W] per-row routing weights (``recv_weights`` from :meth:`dispatch`, to let their
        gradient flow); None = the handle's weights (no gradient to them).
        """
        require(y.dim() == 2 and y.shape[0] == handle.rows,
                f"y shape ({list(y.shape)}) must be [{handle.rows}, C] (the handle's rows)")
        w = handle.layout.weights.to(y.dtype) if weights is None else weights
        require(tuple(w.shape) == (handle.rows,), f"weights shape ({list(w.shape)}) must be [{handle.rows}]")
        return combine_fn(self, handle, y, w)

    def prefetch_weight(self, handle: Handle, local_weights, *, tie: torch.Tensor | None = None,
                        cache_key: Any = None):
        """The weights of this rank's copy slots, fetched from their home ranks.

        local_weights: a tuple/list of tensors ``[epn_r, ...]`` (one per projection, e.g. gate
        ``[epn_r, H, H']``, up, down) or a dict of them, row i = ``handle.slots.home_experts[i]``.
        Returns the same structure with ``[X, ...]`` tensors, row j = this rank's j-th copy slot
        (``handle.slots.weight_index`` of a copy slot). Differentiable: the backward reduces the
        copies' gradients to their homes.

        Plan copies are fetched on every call. Resident replicas (fetched slots the Plan does not
        call copies, e.g. EPLB's static replicas) are fetched once and cached under ``cache_key``
        (any hashable, the same on every rank; one key per set of weights, e.g. the layer index)
        until the set of resident (rank, expert) pairs changes or :meth:`invalidate_replicas` is
        called -- which must follow any change of the master weights (an optimizer step).

        tie: when training, pass ``recv_x`` (the dispatched rows) and use the rows returned with the
        copies -- ``copies, recv_x = buffer.prefetch_weight(handle, w, tie=recv_x)``: this chains the
        gradient reduce before dispatch's backward on every rank (backward collectives must run in
        one order everywhere, including on ranks without copies). Without ``tie`` only the copies
        are returned.
        """
        keys, tensors = _unpack(local_weights)
        n_home = int(handle.slots.home_experts.numel())
        for k, t in zip(keys, tensors):
            require(t.shape[0] == n_home, f"local weight {k} rows ({t.shape[0]}) must equal this rank's home "
                                          f"experts ({n_home})")
        t = tie if tie is not None else torch.zeros(0)
        t_out, copies = prefetch_fn(self, handle, t, *tensors, cache_key=cache_key)
        packed = _pack(local_weights, keys, copies)
        return (packed, t_out) if tie is not None else packed

    def reduce_grad(self, handle: Handle, copy_grads, local_grads):
        """``local_grads`` plus the sum of every copy's gradient of each home expert (new tensors).

        copy_grads: same structure as :meth:`prefetch_weight`'s result ([X, ...] per projection).
        local_grads: same structure as its input ([epn_r, ...]).
        """
        ckeys, ctensors = _unpack(copy_grads)
        lkeys, ltensors = _unpack(local_grads)
        require(ckeys == lkeys, f"copy_grads keys ({ckeys}) must match local_grads keys ({lkeys})")
        flat = flatten_rows(ctensors, handle.num_copies)
        red = self.rows.reduce_flat(handle, flat, int(handle.slots.home_experts.numel()))
        parts = unflatten_rows(red, ltensors)
        return _pack(local_grads, lkeys, tuple(lg + p for lg, p in zip(ltensors, parts)))


def _unpack(obj) -> tuple[list, tuple[torch.Tensor, ...]]:
    if isinstance(obj, dict):
        return list(obj.keys()), tuple(obj.values())
    require(isinstance(obj, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in obj),
            "weights must be a tuple/list or dict of tensors")
    return list(range(len(obj))), tuple(obj)


def _pack(like, keys, tensors):
    if isinstance(like, dict):
        return dict(zip(keys, tensors))
    return tuple(tensors)


__all__ = ["Buffer"]
