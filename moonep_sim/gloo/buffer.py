"""The gloo executor: a MoonEP-style Buffer that carries out any Plan on real tensors.

Notation
--------
R ranks of the EP group; s tokens on this rank (``s <= capacity``); H hidden; K top-k; E experts;
W rows of this rank's expert-grouped layout (padding included); L slots on this rank; X expert
copies this rank computes; P elements of one expert's flattened weights.

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

Failure behaviour: every collective is issued asynchronously and waited on with ``timeout_s``;
a failed or timed-out collective raises :class:`~moonep_sim.errors.CommError` naming the phase
(``dispatch.0``, ``combine.1``, ``prefetch``, ...), this rank, and the peers that had not reached
the phase, or first of all the peer whose heartbeat stopped (a stopped or dead process); see
:mod:`moonep_sim.gloo.liveness`.
"""

from __future__ import annotations

import dataclasses
import datetime
import zlib
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from moonep_sim.errors import ConfigError, require
from moonep_sim.gloo.handle import Handle, HopIndex, build_handle, direct_index
from moonep_sim.gloo.liveness import PhaseTracker
from moonep_sim.plan import GlobalRouting, Placement, Plan, RowCosts, check
from moonep_sim.plan.direct import MAX_RUNS, MIN_RUN_BYTES
from moonep_sim.strategies import PlanContext, get_strategy, make_plan

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16)

# fields compared across ranks at build time, in this order
_FINGERPRINT_FIELDS = ("num_experts", "top_k", "hidden", "strategy", "options", "capacity", "gpus_per_node",
                       "token_padding", "dispatch_dtype", "world_size", "direct")
_DIRECT_MODES = ("auto", "on", "off")
# direct="auto": the executor's point-to-point thresholds (moonep_sim.plan.direct: measured there)
_DIRECT_MAX_RUNS = MAX_RUNS
_DIRECT_MIN_RUN_BYTES = MIN_RUN_BYTES
_WEIGHT_TAG = 1 << 20  # tag offset of the routing-weight message that rides with each combine run


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
    strategy / options: the planner (``moonep_sim.strategies``) and its options.
    gpus_per_node: ranks per node for ``intra_node`` / ``inter_node`` hops (0 = one node).
    timeout_s: limit on every collective (seconds).
    dispatch_dtype: the dtype rows travel in during dispatch (combine and gradients travel in the
      input's dtype).  token_padding: pad each slot's rows to a multiple of this.
    expert_ffn: H', used only for the byte counts of weight prefetch / gradient reduce.
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
                 num_experts: int, strategy: str = "moonep", options: dict[str, Any] | None = None,
                 gpus_per_node: int = 0, timeout_s: float = 60.0, dispatch_dtype: torch.dtype = torch.float32,
                 token_padding: int = 1, expert_ffn: int = 0, placement: Placement | None = None,
                 validate_plans: bool = True, direct: str = "auto") -> None:
        require(dist.is_available() and dist.is_initialized(),
                "torch.distributed (not initialised) must be initialised (dist.init_process_group('gloo')) "
                "before building a Buffer")
        require(capacity >= 1, f"capacity ({capacity}) must be >= 1")
        require(hidden >= 1, f"hidden ({hidden}) must be >= 1")
        require(1 <= top_k <= num_experts, f"top_k ({top_k}) must lie in [1, num_experts={num_experts}]")
        require(timeout_s > 0, f"timeout_s ({timeout_s}) must be > 0")
        require(dispatch_dtype in _FLOAT_DTYPES, f"dispatch_dtype ({dispatch_dtype}) must be one of {_FLOAT_DTYPES}")
        require(token_padding >= 1, f"token_padding ({token_padding}) must be >= 1")
        require(direct in _DIRECT_MODES, f"direct ({direct!r}) must be one of {_DIRECT_MODES}")
        self.direct = direct
        self._results: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self.group = group if group is not None else dist.group.WORLD
        self.members = list(dist.get_process_group_ranks(self.group))
        self.world_size = len(self.members)
        self.rank = dist.get_rank(self.group)
        spec = get_strategy(strategy)  # ConfigError before any communication
        self.strategy = strategy
        self.options = spec.parse_options(dict(options or {}))
        self.capacity, self.hidden, self.top_k, self.num_experts = int(capacity), int(hidden), int(top_k), int(num_experts)
        self.gpus_per_node = int(gpus_per_node) or self.world_size
        self.timeout_s = float(timeout_s)
        self.dispatch_dtype = dispatch_dtype
        self.token_padding = int(token_padding)
        self.validate_plans = validate_plans
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        self._workspace: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        # resident replicas' fetched weights per cache key: (resident_key, experts, [X_res, P] rows)
        self._replicas: dict[Any, tuple[bytes, torch.Tensor, torch.Tensor]] = {}
        self.fetch_calls = 0  # prefetch all_to_alls issued (a step with Plan copies only counts one)
        self.replica_fetches = 0  # of those, fetches that (re)filled the resident replicas' cache
        self.fetched_experts = 0  # experts' weights received by this rank, all calls together
        self.last_fetched = 0  # experts' weights received by this rank in the latest prefetch
        # progress records and heartbeats in the store: a failure names the silent peer
        self._tracker = PhaseTracker(f"moonep_sim/ep{self.members[0]}x{self.world_size}/", self.rank, self.members,
                                     self.timeout_s)
        self._mark("build.check")
        self._check_config()
        # after the check every rank agrees on the values below, so group creation is aligned
        require(self.world_size % self.gpus_per_node == 0,
                f"world size ({self.world_size}) must be divisible by gpus_per_node ({self.gpus_per_node})")
        if placement is None:
            require(num_experts % self.world_size == 0,
                    f"num_experts ({num_experts}) must be divisible by the world size ({self.world_size}) "
                    "for home-group placement")
        elem = torch.tensor([], dtype=dispatch_dtype).element_size()
        costs = RowCosts(hidden * elem, hidden * 4, 3 * hidden * expert_ffn * 4, 3 * hidden * expert_ffn * 4)
        default = PlanContext.default(num_experts, self.world_size, self.gpus_per_node, costs, self.token_padding)
        self.ctx = default if placement is None else PlanContext(default.cluster, placement, costs, self.token_padding)
        self._groups = self._make_groups()

    # -- setup --------------------------------------------------------------------------------
    def _fingerprint(self) -> list[int]:
        vals = dict(num_experts=self.num_experts, top_k=self.top_k, hidden=self.hidden, strategy=self.strategy,
                    options=sorted(self.options.items()), capacity=self.capacity,
                    gpus_per_node=self.gpus_per_node, token_padding=self.token_padding,
                    dispatch_dtype=str(self.dispatch_dtype), world_size=self.world_size, direct=self.direct)
        self._fp_values = vals
        return [_code(vals[f]) for f in _FINGERPRINT_FIELDS]

    def _check_config(self) -> None:
        mine = torch.tensor(self._fingerprint(), dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run("build.check", "all_gather", lambda: dist.all_gather(out, mine, group=self.group, async_op=True),
                  range(self.world_size))
        allfp = torch.stack(out)
        for j, f in enumerate(_FINGERPRINT_FIELDS):
            col = allfp[:, j]
            if (col != col[0]).any():
                differ = torch.nonzero(col != col[0]).flatten().tolist()
                same = torch.nonzero(col == col[0]).flatten().tolist()
                mine_v = self._fp_values[f]
                shown = col.tolist() if f in ("num_experts", "top_k", "hidden", "capacity", "gpus_per_node",
                                              "token_padding", "world_size") else None
                detail = (f"values by rank {shown}" if shown is not None else f"this rank has {mine_v!r}")
                raise ConfigError(f"Buffer {f} must be equal on every rank (ranks {same} agree with rank 0, ranks "
                                  f"{differ} differ; {detail}): build the Buffer with one configuration")

    def _new_group(self, ep_ranks: Sequence[int]):
        return dist.new_group([self.members[r] for r in ep_ranks], timeout=self._timeout, backend="gloo")

    def _make_groups(self) -> dict[str, Any]:
        """Process groups with this Buffer's timeout: global, this rank's node, this rank's rail.

        ``dist.new_group`` is collective over the default group: every rank creates every group, in
        the same order (nodes ascending, then local indices ascending). A scope whose group has one
        member is executed locally (None).
        """
        R, G = self.world_size, self.gpus_per_node
        glob = self._new_group(range(R)) if R > 1 else None
        intra = inter = None
        n_nodes = R // G
        for n in range(n_nodes):
            ranks = list(range(n * G, (n + 1) * G))
            if G == R:
                g = glob
            elif G > 1:
                g = self._new_group(ranks)
            else:
                g = None
            if self.rank in ranks:
                intra = g
        for loc in range(G):
            ranks = list(range(loc, R, G))
            if n_nodes == R:
                g = glob
            elif n_nodes > 1:
                g = self._new_group(ranks)
            else:
                g = None
            if self.rank in ranks:
                inter = g
        return {"global": glob, "intra_node": intra, "inter_node": inter}

    # -- failure handling ---------------------------------------------------------------------
    @property
    def _seq(self) -> int:
        """Collectives this rank has entered (phase progress)."""
        return self._tracker.seq

    def _mark(self, phase: str) -> None:
        """Record that this rank enters a phase (see :class:`~moonep_sim.gloo.liveness.PhaseTracker`)."""
        self._tracker.mark(phase)

    def _suspects(self, peers: Sequence[int], focus: int | None = None) -> str:
        return self._tracker.suspects(peers, focus)

    def _run(self, phase: str, op: str, issue: Callable[[], Any], peers: Sequence[int],
             focus: int | None = None) -> None:
        self._tracker.run(phase, op, issue, peers, focus)

    def _all_to_all(self, phase: str, scope: str, members: Sequence[int], send: torch.Tensor,
                    send_splits: Sequence[int], recv_splits: Sequence[int],
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``send`` split per member -> rows received, grouped by member (``all_to_all_single``)."""
        self._mark(phase)
        group = self._groups[scope] if len(members) > 1 else None
        if group is None:  # a one-member scope: the only message is to oneself
            return send
        send = send.contiguous()
        if out is None or out.data_ptr() == send.data_ptr():
            out = send.new_empty((int(sum(recv_splits)),) + tuple(send.shape[1:]))
        self._run(phase, "all_to_all", lambda: dist.all_to_all_single(
            out, send, list(recv_splits), list(send_splits), group=group, async_op=True), members)
        return out

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
            out = [torch.empty_like(buf) for _ in range(R)]
            self._mark("dispatch.exchange")
            self._run("dispatch.exchange", "all_gather",
                      lambda: dist.all_gather(out, buf, group=self._groups["global"], async_op=True), range(R))
            allb = torch.stack(out).numpy()
        else:
            allb = buf.numpy()[None]
        s_R = allb[:, 0].astype(np.int64)
        keep = np.arange(S)[None, :] < s_R[:, None]
        ids = allb[:, 2:2 + S * K].reshape(R, S, K)[keep]
        raw = allb[:, 2 + S * K:].reshape(R, S, K)
        w64 = np.where(allb[:, 1].astype(bool)[:, None, None], raw.view(np.float64),
                       raw.astype(np.int32).view(np.float32).astype(np.float64))[keep]
        return GlobalRouting(ids, w64.astype(np.float32), s_R, self.num_experts), w64

    def plan_handle(self, routing: GlobalRouting, weights_TK: np.ndarray | None = None) -> Handle:
        """Plan ``routing`` (identically on every rank) and build this rank's handle."""
        return self.handle_for(make_plan(self.strategy, routing, self.ctx, **self.options), weights_TK)

    def handle_for(self, plan: Plan, weights_TK: np.ndarray | None = None) -> Handle:
        """This rank's handle for a given Plan (every rank must pass the same Plan)."""
        require(plan.ranks == self.world_size and plan.num_experts == self.num_experts and plan.top_k == self.top_k,
                f"plan shape (ranks {plan.ranks}, experts {plan.num_experts}, top_k {plan.top_k}) must match the "
                f"Buffer ({self.world_size}, {self.num_experts}, {self.top_k})")
        require(plan.cluster.gpus_per_node == self.gpus_per_node,
                f"plan gpus_per_node ({plan.cluster.gpus_per_node}) must equal the Buffer's ({self.gpus_per_node})")
        if self.validate_plans:
            check(plan)
        handle = build_handle(plan, self.rank, self.ctx.placement.home_E, weights_TK)
        if self.direct != "off" and plan.hops:
            elem = torch.tensor([], dtype=self.dispatch_dtype).element_size()
            d = direct_index(plan, self.rank, None if self.direct == "on" else _DIRECT_MAX_RUNS,
                             _DIRECT_MIN_RUN_BYTES, self.hidden * elem)
            if d is not None:
                handle = dataclasses.replace(handle, direct=d)
        return handle

    # -- row movement (no autograd; the autograd functions call these) ---------------------------
    def _ws(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable workspace [rows, C] (grown when needed) for rows consumed inside one call.

        Intermediate send / receive buffers live here, so a layer does not fault in fresh pages
        for them on every call (MoonEP sizes its buffers once). Never returned to the caller.
        """
        cols = int(np.prod(like.shape[1:]))
        key = (name, like.dtype)
        t = self._workspace.get(key)
        if t is None or t.numel() < rows * cols:
            t = torch.empty(rows * cols, dtype=like.dtype)
            self._workspace[key] = t
        return t[: rows * cols].view((rows,) + tuple(like.shape[1:]))

    def _result(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor to return to the caller, in recycled memory when possible.

        Memory from an earlier result of this kind is reused only when nothing references it any
        more (its storage's only owner is this pool); the tensor returned is a new tensor object,
        not a view, so autograd treats it as any fresh output.
        """
        shape = tuple(int(v) for v in shape)
        numel = int(np.prod(shape)) if shape else 1
        pool = self._results.setdefault((name, dtype), [])
        base = None
        for b in pool:
            if b.numel() >= numel and _unreferenced(b):
                base = b
                break
        if base is None:
            base = torch.empty(numel, dtype=dtype)
            pool.append(base)
            if len(pool) > 3:  # forget the oldest (still-referenced memory stays with its users)
                pool.pop(0)
        return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), 0, shape)

    def _p2p(self, phase: str, scope: str, ops: Sequence[tuple[Any, Any, int, int]],
             local: Callable[[], None] | None = None) -> None:
        """Issue every ``(op, tensor, ep_peer, tag)`` (``send`` / ``recv``; an ``op`` that is a
        callable is local work run at that point, e.g. filling the next send), run ``local``
        meanwhile, then wait for each with the Buffer's timeout."""
        self._mark(phase)
        group = self._groups[scope]
        works: list[tuple[Any, int]] = []
        members = range(self.world_size) if scope == "global" else \
            sorted({o[2] for o in ops if not callable(o[0])} | {self.rank})
        # a failed message names its peer when that peer is behind (else every member is checked:
        # the peer may have exited after a failure of its own)
        for op, t, p, tag in ops:
            if callable(op):  # local work between messages (e.g. filling the next send)
                op()
                continue
            fn = dist.isend if op == "send" else dist.irecv
            self._run(phase, "send/recv", lambda fn=fn, t=t, p=p, tag=tag: works.append(
                (fn(t, self.members[p], group=group, tag=tag), p)), members, p)
        if local is not None:
            local()
        for w, p in works:
            self._run(phase, "send/recv", lambda w=w: w, members, p)

    def _owned(self, t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``t``, copied if it lives in a workspace or is the caller's ``source`` (results never alias)."""
        if t.numel() and t.data_ptr() == source.data_ptr():
            return t.clone()
        for ws in self._workspace.values():
            if t.numel() and ws.numel() and t.untyped_storage().data_ptr() == ws.untyped_storage().data_ptr():
                return t.clone()
        return t

    def dispatch_rows(self, handle: Handle, x: torch.Tensor, phase: str = "dispatch",
                      comm_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[s, C] -> [W, C]: hops forward, then the expand gather (rows travel in ``comm_dtype``).

        The last hop's rows land in the expert-grouped layout directly (``handle.direct``: runs
        received straight into it) or through one gather from the receive buffer (``handle.final``).
        """
        buf = x if comm_dtype is None or comm_dtype == x.dtype else x.to(comm_dtype)
        n = len(handle.hops)
        if n == 0:
            out = self._owned(handle.expand.gather(buf), x)
        for i, hop in enumerate(handle.hops):
            if i == n - 1 and handle.direct is not None:
                out = self._dispatch_direct(handle, hop, buf, f"{phase}.{i}")
                break
            send = hop.send.gather(buf, out=self._ws("send", hop.send.rows, buf))
            recv = self._all_to_all(f"{phase}.{i}", hop.scope, hop.members, send, hop.send_splits, hop.recv_splits,
                                    out=self._ws(f"recv{i % 2}", int(sum(hop.recv_splits)), buf))
            if i < n - 1:
                buf = hop.recv.place(recv)
            elif handle.final.identity:
                out = self._owned(recv, x)
            else:
                out = handle.final.gather(recv, out=self._result(phase, (handle.final.rows,) + tuple(recv.shape[1:]),
                                                                 recv.dtype))
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _dispatch_direct(self, handle: Handle, hop: HopIndex, buf: torch.Tensor, phase: str) -> torch.Tensor:
        """The last hop as runs: remote rows gathered once into a send workspace and sent, each
        received run written straight into its block of the layout, own rows gathered into it."""
        d = handle.direct
        out = self._result(phase.split(".")[0], (d.rows,) + tuple(buf.shape[1:]), buf.dtype)
        ops: list[tuple[Any, Any, int, int]] = [("recv", out[a:a + m], p, tag) for p, tag, a, _, m in d.recv_runs]
        rs = d.remote_send
        if rs.identity or rs.n_src == 0 or rs.pad_pos.numel():
            send = rs.gather(buf, out=self._ws("send", rs.rows, buf)) if d.send_runs else buf
            ops += [("send", send[a:a + m], p, tag) for p, tag, a, _, m in d.send_runs]
        else:  # each run gathered just before it is sent: the first messages leave while the rest gather
            send = self._ws("send", rs.rows, buf)
            for p, tag, a, _, m in d.send_runs:
                ops.append((lambda a=a, m=m: torch.index_select(buf, 0, rs.safe_idx[a:a + m], out=send[a:a + m]),
                            None, p, tag))
                ops.append(("send", send[a:a + m], p, tag))

        def local():
            for _, _, a, b, m in d.self_runs:
                torch.index_select(buf, 0, d.list_src[b:b + m], out=out[a:a + m])
            if d.pad_pos.numel():
                out.index_fill_(0, d.pad_pos, 0)

        if ops:
            self._p2p(phase, hop.scope, ops, local)
        else:
            self._mark(phase)
            local()
        return out

    def combine_rows(self, handle: Handle, y: torch.Tensor, phase: str = "combine",
                     row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """[W, C] -> [s, C]: the adjoint of :meth:`dispatch_rows` (sums; rows first multiplied by
        ``row_weights`` [W] when given, fused into the first gather where the layout allows)."""
        n = len(handle.hops)
        direct = handle.direct is not None and n > 0
        first = handle.final if n else handle.expand
        # single direct hop: rows travel unweighted, their weights with them (one small message
        # per run), and the receiver weights them inside its reduction (no pass of its own)
        w_at_dst = direct and n == 1 and row_weights is not None
        if direct:
            src = y if row_weights is None or w_at_dst else torch.mul(y, row_weights[:, None].to(y.dtype),
                                                                       out=self._ws("cbuf", y.shape[0], y))
        elif row_weights is not None and first.inverse is not None:
            buf = torch.index_select(y, 0, first.inverse, out=self._ws("cbuf", y.shape[0], y))
            buf.mul_(row_weights.index_select(0, first.inverse).to(buf.dtype)[:, None])
        else:
            yw = y if row_weights is None else y * row_weights[:, None].to(y.dtype)
            buf = first.scatter_add(yw)
        for i in reversed(range(n)):
            hop: HopIndex = handle.hops[i]
            recv_w = None
            if i == n - 1 and direct:
                recv, recv_w = self._combine_direct(handle, hop, src, f"{phase}.{i}", f"recv{i % 2}",
                                                    row_weights.to(y.dtype).contiguous() if w_at_dst else None)
                back = handle.direct.list_map
            else:
                send = buf if i == n - 1 else hop.recv.gather_back.gather(
                    buf, out=self._ws("send", hop.recv.gather_back.rows, buf))
                recv = self._all_to_all(f"{phase}.{i}", hop.scope, hop.members, send, hop.recv_splits,
                                        hop.send_splits, out=self._ws(f"recv{i % 2}", int(sum(hop.send_splits)), buf))
                back = hop.send
            if i == 0 and (not back.identity or recv_w is not None):
                buf = back.reduce_into(recv, self._result(phase, (back.n_src,) + tuple(recv.shape[1:]), recv.dtype),
                                       recv_w)
            else:
                buf = back.scatter_add(recv)
        return self._owned(buf, y)

    def _combine_direct(self, handle: Handle, hop: HopIndex, src: torch.Tensor, phase: str, ws: str,
                        weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The adjoint of :meth:`_dispatch_direct`: layout runs sent straight from ``src`` [W, C],
        received into the send list's order (reduced by ``handle.direct.list_map``); ``weights``
        [W] (optional) travel alongside, one message per run. Returns (rows, their weights)."""
        d = handle.direct
        recv = self._ws(ws, d.list_rows, src)
        ops = [("recv", recv[b:b + m], p, tag) for p, tag, _, b, m in d.send_runs]
        ops += [("send", src[a:a + m], p, tag) for p, tag, a, _, m in d.recv_runs]
        recv_w = None
        if weights is not None:
            recv_w = self._ws("cw", d.list_rows, weights)
            ops += [("recv", recv_w[b:b + m], p, tag + _WEIGHT_TAG) for p, tag, _, b, m in d.send_runs]
            ops += [("send", weights[a:a + m], p, tag + _WEIGHT_TAG) for p, tag, a, _, m in d.recv_runs]

        def local():
            for _, _, a, b, m in d.self_runs:
                recv[b:b + m].copy_(src[a:a + m])
                if recv_w is not None:
                    recv_w[b:b + m].copy_(weights[a:a + m])

        if ops:
            self._p2p(phase, hop.scope, ops, local)
        else:
            self._mark(phase)
            local()
        return recv, recv_w

    def prefetch_flat(self, handle: Handle, send_flat: torch.Tensor, phase: str = "prefetch") -> torch.Tensor:
        """[x_send, P] flattened weights of the home experts this rank sends (``pf_send_local``
        order) -> [X, P] this rank's copies (slot order). No collective when no rank fetches."""
        if handle.num_fetched_global == 0 or self.world_size == 1:
            recv = send_flat
        else:
            recv = self._all_to_all(phase, "global", range(self.world_size), send_flat, handle.pf_send_splits,
                                    handle.pf_recv_splits)
        out = recv.new_empty(recv.shape)
        if recv.shape[0]:
            out.index_copy_(0, handle.pf_recv_pos, recv)
        return out

    def invalidate_replicas(self) -> None:
        """Forget the cached weights of resident replicas: the next prefetch fetches them again.

        Call it on every rank (each rank decides from its own cache whether a fetch collective
        runs) whenever master weights change, e.g. after an optimizer step.
        """
        self._replicas.clear()

    def fetch_weights_flat(self, handle: Handle, local: Sequence[torch.Tensor], cache_key: Any = None,
                           phase: str = "prefetch") -> torch.Tensor:
        """[X, P] flattened weights of this rank's fetched slots (slot order) from ``local``
        ([epn_r, ...] home experts per projection). Plan copies are fetched every call; resident
        replicas are served from the cache entry ``cache_key`` when its resident set equals the
        handle's (``handle.resident_key``), else fetched with the copies and cached. Every rank
        decides alike from the Plan and its cache, so the collectives match."""
        X, n_res = handle.num_copies, int(handle.resident_pos.numel())
        entry = self._replicas.get(cache_key)
        hit = entry is not None and entry[0] == handle.resident_key
        if (hit and X == n_res and handle.num_plan_copies_global == 0 and torch.equal(entry[1], handle.resident_expert)
                and torch.equal(handle.resident_pos, torch.arange(X))):
            # no rank fetches anything and every slot here is a cached resident replica in the cached
            # order: no collective and no copy (callers must not modify the returned weights in place)
            self.last_fetched = 0
            return entry[2]
        if hit:
            sent, n_glob = handle.pfc_send_local, handle.num_plan_copies_global
            splits = (handle.pfc_send_splits, handle.pfc_recv_splits)
            pos = handle.pfc_recv_pos
        else:
            sent, n_glob = handle.pf_send_local, handle.num_fetched_global
            splits = (handle.pf_send_splits, handle.pf_recv_splits)
            pos = handle.pf_recv_pos
        send_flat = _flatten([t.index_select(0, sent) for t in local], int(sent.numel()))
        if n_glob == 0 or self.world_size == 1:
            recv = send_flat
        else:
            recv = self._all_to_all(phase, "global", range(self.world_size), send_flat, *splits)
            self.fetch_calls += 1
            self.replica_fetches += int(not hit and handle.num_fetched_global > handle.num_plan_copies_global)
        self.last_fetched = int(recv.shape[0])
        self.fetched_experts += self.last_fetched
        out = recv.new_empty((X,) + tuple(recv.shape[1:]))
        if recv.shape[0]:
            out.index_copy_(0, pos, recv)
        if hit:
            if n_res:
                _, experts, rows = entry
                require(rows.shape[1:] == out.shape[1:] and rows.dtype == out.dtype,
                        f"weights ({list(out.shape[1:])} {out.dtype}) must match the cached resident replicas' "
                        f"({list(rows.shape[1:])} {rows.dtype}) for cache key {cache_key!r}: "
                        "use one cache key per set of weights")
                order = torch.argsort(experts, stable=True)
                at = order.index_select(0, torch.searchsorted(experts.index_select(0, order), handle.resident_expert))
                out.index_copy_(0, handle.resident_pos, rows.index_select(0, at))
        else:
            # cache the resident replicas' rows in this handle's order (experts distinct per rank)
            rows = out.index_select(0, handle.resident_pos).detach()
            self._replicas[cache_key] = (handle.resident_key, handle.resident_expert.clone(), rows)
        return out

    def reduce_flat(self, handle: Handle, copy_flat: torch.Tensor, n_home: int, phase: str = "grad_reduce") -> torch.Tensor:
        """[X, P] copies' gradients -> [epn_r, P] their sums at the home experts (zeros elsewhere)."""
        out = copy_flat.new_zeros((n_home,) + tuple(copy_flat.shape[1:]))
        if handle.num_fetched_global == 0:
            return out
        send = copy_flat.index_select(0, handle.pf_recv_pos) if copy_flat.shape[0] else copy_flat
        recv = self._all_to_all(phase, "global", range(self.world_size), send.contiguous(), handle.pf_recv_splits,
                                handle.pf_send_splits) if self.world_size > 1 else send
        if recv.shape[0]:
            out.index_add_(0, handle.pf_send_local, recv)
        return out

    # -- public API -----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 *, handle: Handle | None = None):
        """Send each token to where the Plan computes its experts.

        x: [s, H] float, 0 <= s <= capacity.  topk_ids: [s, K] int, experts in [0, E), distinct per
        token.  topk_weights: [s, K] float routing weights (differentiable: their gradient flows
        back when :meth:`combine` is given ``recv_weights``).  handle: reuse a previous dispatch's
        Plan (no exchange, no planning); ``topk_ids`` / ``topk_weights`` are then ignored and
        the handle's weights are used.

        Returns ``(recv_x [W, H], recv_weights [W], cu_seqlens [L+1] int64, handle)``: rows
        grouped by slot (slot i owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``, the first
        ``handle.slot_rows[i]`` real, the rest zero padding), each row's routing weight (0 for
        padding). Differentiable in ``x`` and ``topk_weights``.
        """
        from moonep_sim.gloo.autograd import dispatch_fn

        if handle is None:
            require(topk_ids is not None and topk_weights is not None,
                    "topk_ids and topk_weights (None) must be given unless a handle is reused")
            self.check_inputs(x, topk_ids, topk_weights)
            handle = self.plan_handle(*self.exchange_routing(topk_ids, topk_weights))
            w = topk_weights
        else:
            require(tuple(x.shape) == (handle.num_tokens, self.hidden),
                    f"x shape ({list(x.shape)}) must be [{handle.num_tokens}, {self.hidden}] (the handle's tokens)")
            w = handle.token_weights
        recv_x, recv_w = dispatch_fn(self, handle, x, w)
        return recv_x, recv_w, handle.cu_seqlens, handle

    def combine(self, y: torch.Tensor, handle: Handle, weights: torch.Tensor | None = None) -> torch.Tensor:
        """[W, H] expert outputs -> [s, H]: each token's sum of ``weight * output`` over its rows.

        weights: [W] per-row routing weights (``recv_weights`` from :meth:`dispatch`, to let their
        gradient flow); None = the handle's weights (no gradient to them).
        """
        from moonep_sim.gloo.autograd import combine_fn

        require(y.dim() == 2 and y.shape[0] == handle.rows,
                f"y shape ({list(y.shape)}) must be [{handle.rows}, C] (the handle's rows)")
        w = handle.row_weights.to(y.dtype) if weights is None else weights
        require(tuple(w.shape) == (handle.rows,), f"weights shape ({list(w.shape)}) must be [{handle.rows}]")
        return combine_fn(self, handle, y, w)

    def prefetch_weight(self, handle: Handle, local_weights, *, tie: torch.Tensor | None = None,
                        cache_key: Any = None):
        """The weights of this rank's copy slots, fetched from their home ranks.

        local_weights: a tuple/list of tensors ``[epn_r, ...]`` (one per projection, e.g. gate
        ``[epn_r, H, H']``, up, down) or a dict of them, row i = ``handle.home_experts[i]``.
        Returns the same structure with ``[X, ...]`` tensors, row j = this rank's j-th copy slot
        (``handle.slot_weight_index`` of a copy slot). Differentiable: the backward reduces the
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
        from moonep_sim.gloo.autograd import prefetch_fn

        keys, tensors = _unpack(local_weights)
        n_home = int(handle.home_experts.numel())
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
        flat = _flatten(ctensors, handle.num_copies)
        red = self.reduce_flat(handle, flat, int(handle.home_experts.numel()))
        parts = _unflatten(red, ltensors)
        return _pack(local_grads, lkeys, tuple(lg + p for lg, p in zip(ltensors, parts)))


def _unreferenced(t: torch.Tensor) -> bool:
    """True when ``t`` (held only by the caller) is the sole owner of its storage: no other tensor,
    view or autograd record shares it. Conservative: False when the count cannot be read."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    try:
        # owners: t itself and the temporary storage object made here
        return t._use_count() == 1 and count(t.untyped_storage()._cdata) <= 2
    except Exception:
        return False


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


def _flatten(tensors: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """[rows, P]: each tensor [rows, ...] flattened per row and concatenated."""
    if not tensors:
        return torch.zeros(rows, 0)
    return torch.cat([t.reshape(rows, int(np.prod(t.shape[1:]))) for t in tensors], dim=1).contiguous()


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Split [n, P] back into tensors shaped like ``like[i]`` (with n rows)."""
    n = flat.shape[0]
    sizes = [int(np.prod(t.shape[1:])) for t in like]
    return tuple(p.reshape((n,) + tuple(t.shape[1:])) for p, t in zip(torch.split(flat, sizes, dim=1), like))
