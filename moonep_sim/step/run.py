"""The step model's front: every strategy's step on one model, cluster and routing.

Notation: R ranks, M micro-batches, L layers, T tokens per rank. Times in microseconds.

:func:`simulate_step` plans each MoE layer of the step on its own routing (given by a
:data:`LayerSource`), simulates its communication alone (``moonep_sim.step.layer_sim``), composes
the step on two streams per rank under the chosen overlap (``moonep_sim.step.compose``) and
accounts its memory (``moonep_sim.step.memory``). Layers whose routing has the same key (a
source's layers that reuse one) are planned and simulated once per strategy. The unit of work is
one distinct routing (:class:`LayerWork`): built (generated) once where it runs, every strategy
planned and simulated on it, its Plans and routing dropped after; with a worker pool the units
run in parallel and only their small results come back; with one job a step of large layers is
pipelined on two threads (:func:`pipelined_layer_work`: routings and Plans made ahead on a second
thread while this one simulates, the same results).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import GlobalRouting
from moonep_sim.plan.ir import even_tokens_per_rank
from moonep_sim.step.compose import all_ops, compose, stack_ops
from moonep_sim.step.costs import CostModel
from moonep_sim.step.layer_sim import LayerComm, simulate_moe_layer
from moonep_sim.step.memory import MemoryOptions, PlanFootprint, memory_per_rank
from moonep_sim.step.schedule import Timeline, overlap_by_op
from moonep_sim.step.schedules import get_overlap
from moonep_sim.step.stack import StepShape

#: moe_index -> (key, routing or a picklable builder of it, provenance): layers with equal keys
#: share one routing (built once, planned once per strategy).
LayerSource = Callable[[int], tuple[Any, "GlobalRouting | Callable[[], GlobalRouting]", str]]


@dataclass(frozen=True)
class StepConfig:
    """One step's inputs besides the routing.

    model, topology, ctx (the strategies' PlanContext), strategies [(name, options)], shape
    (mode, tokens per rank, context), overlap (a schedule name), costs (the compute cost model),
    memory (optimizer / recompute options), static_tokens: strategy -> the tokens per rank its
    static Buffer is sized for (every pass padded to it; ASSUMED: padding tokens routed round-robin
    over the experts), tol: the network tolerance of the layer simulations.
    """

    model: ModelSpec
    topology: Any
    ctx: Any
    strategies: tuple[tuple[str, dict], ...]
    shape: StepShape
    overlap: str = "none"
    costs: CostModel | None = None
    memory: MemoryOptions = MemoryOptions()
    static_tokens: Mapping[str, int] = field(default_factory=dict)
    tol: float | None = None


#: GlobalRouting's fields, in order: what :func:`trusted_routing` sets (a test pins them, so a new
#: field cannot be skipped silently).
ROUTING_FIELDS = ("topk_ids_TK", "topk_weights_TK", "tokens_per_rank_R", "num_experts")


def trusted_routing(topk_ids_TK: np.ndarray, topk_weights_TK: np.ndarray, num_experts: int,
                    ranks: int) -> GlobalRouting:
    """``GlobalRouting.split_evenly(...)`` of routing the generator made, without re-checking what
    it guarantees. ``GlobalRouting`` checks every token's ids are distinct and in ``[0, E)``: a
    K(K-1)/2-pass scan over T, 0.03-0.04 CPU s of a Kimi K3 EP64 layer (262,144 x 16), about a
    fifth of generating it. The samplers (``moonep_sim.routing.sampling``) draw distinct experts of
    ``[0, E)`` by construction, so a step's generated layers (and only they) skip it. The cheap
    checks stay: dtypes (int64 ids and float32 weights, which the generator returns, so nothing is
    converted) and shapes."""
    ids, w = topk_ids_TK, topk_weights_TK
    require(ids.dtype == np.int64 and w.dtype == np.float32 and ids.ndim == 2 and w.shape == ids.shape,
            f"trusted routing ({ids.dtype} {list(ids.shape)} ids, {w.dtype} {list(w.shape)} weights) must be int64 "
            "[T, K] ids and float32 weights of the same shape, as the generator returns them")
    tpr = even_tokens_per_rank(ids.shape[0], ranks)
    r = object.__new__(GlobalRouting)
    for name, v in zip(ROUTING_FIELDS, (ids, w, tpr, int(num_experts))):
        object.__setattr__(r, name, v)
    return r


def split_micro_batches(r: GlobalRouting, M: int) -> list[GlobalRouting]:
    """Each rank's tokens cut into M consecutive micro-batches (rank order kept)."""
    if M == 1:
        return [r]
    n_R = r.tokens_per_rank_R.astype(np.int64)
    pos_T = np.arange(r.num_tokens) - np.repeat(r.tok_off_R()[:-1], n_R)
    cut_R = [(n_R * i) // M for i in range(M + 1)]
    out = []
    for i in range(M):
        lo, hi = np.repeat(cut_R[i], n_R), np.repeat(cut_R[i + 1], n_R)
        m = (pos_T >= lo) & (pos_T < hi)
        out.append(GlobalRouting(r.topk_ids_TK[m], r.topk_weights_TK[m], cut_R[i + 1] - cut_R[i], r.num_experts))
    return out


def pad_to_static(r: GlobalRouting, tokens: int) -> GlobalRouting:
    """``r`` with every rank padded to ``tokens`` tokens (a static Buffer's capacity): padding
    token j of a rank selects experts ``(j*K + k) mod E`` (ASSUMED round-robin), weight 0."""
    n_R = r.tokens_per_rank_R.astype(np.int64)
    require(int(n_R.max()) <= tokens, f"static buffer tokens ({tokens}) must be >= the largest rank's tokens "
                                      f"({int(n_R.max())})")
    pad_R = tokens - n_R
    if not pad_R.any():
        return r
    K, E = r.top_k, r.num_experts
    ids, w = [], []
    pos = 0
    for off, n, p in zip(r.tok_off_R()[:-1].tolist(), n_R.tolist(), pad_R.tolist()):
        ids.append(r.topk_ids_TK[off:off + n])
        w.append(r.topk_weights_TK[off:off + n])
        j = np.arange(p, dtype=np.int64)[:, None] * K + np.arange(K)[None, :] + pos
        ids.append(j % E)
        w.append(np.zeros((p, K), np.float32))
        pos += p * K
    return GlobalRouting(np.concatenate(ids), np.concatenate(w).astype(np.float32), np.full(r.ranks, tokens),
                         r.num_experts)


def _rank_sums(tl: Timeline, stream: str, layer: int | None = None) -> np.ndarray:
    out = np.zeros(tl.R)
    for e in tl.events:
        if e.stream == stream and (layer is None or e.layer == layer):
            out += e.end_R - e.start_R
    return out


def step_metrics(tl: Timeline, cfg: StepConfig, comms: Mapping[int, LayerComm], useful_flops: float,
                 real_tokens: float) -> dict:
    """The per-strategy figures of one composed step (the JSON contract of ``moonep-sim step``)."""
    end_R = tl.end_R()
    r = int(np.argmax(end_R))
    t = float(end_R[r])
    busy = _rank_sums(tl, "compute")
    comm = _rank_sums(tl, "comm")
    exposed = max(t - float(busy[r]), 0.0)
    peak = cfg.topology.gpu_tflops * 1e6
    layers = []
    span: dict[int, list] = {}
    for e in tl.events:
        if e.layer >= 0:
            s = span.setdefault(e.layer, [np.full(tl.R, np.inf), np.zeros(tl.R), np.zeros(tl.R),
                                          np.full(tl.R, np.inf), np.zeros(tl.R)])
            k = 0 if e.direction == "forward" else 3
            s[k] = np.minimum(s[k], e.start_R)
            s[k + 1] = np.maximum(s[k + 1], e.end_R)
            if e.stream == "compute":
                s[2] += e.end_R - e.start_R
    for l in range(cfg.model.layers):
        s = span[l]
        dur_R = (s[1] - s[0]) + np.where(np.isfinite(s[3]), s[4] - s[3], 0.0)
        slow = int(np.argmax(dur_R))
        c = comms.get(l)
        kind = ("moe" if l >= cfg.model.dense_layers else "dense") + f"/{cfg.model.attention_kind(l)}"
        st = dict(c.straggler) if c is not None else {"rank": slow, "cause": "compute", "phase": None,
                                                     "detail": "dense layer (same work on every rank)"}
        layers.append({"layer": l, "kind": kind, "time_us": float(dur_R[slow]),
                       "exposed_comm_us": float(max(dur_R[slow] - s[2][slow], 0.0)), "straggler": st})
    return {"step_time_us": t, "slowest_rank": r, "tokens_per_s_per_gpu": real_tokens / (t * 1e-6) if t > 0 else 0.0,
            "mfu": useful_flops / (t * peak) if t > 0 else 0.0, "exposed_comm_us": exposed,
            "comm_share": exposed / t if t > 0 else 0.0, "compute_us": float(busy[r]), "comm_us": float(comm[r]),
            "layers": layers, "overlap_by_op": overlap_by_op(tl, r)}


def useful_flops_per_rank(cfg: StepConfig) -> float:
    """Model FLOPs per rank of the step's real tokens (no padding): the stack's ops and the routed
    experts' T x K rows, with the backward's twice the GEMMs in train."""
    shape, m = cfg.shape, cfg.model
    ot = stack_ops(m, shape)
    ops = all_ops(ot, shape.mode == "train")
    f = sum(o.flops for o in ops)
    fwd_exp = shape.tokens * m.top_k * m.expert_flops_per_row() * m.moe_layers
    return f + fwd_exp * (3.0 if shape.mode == "train" else 1.0)


@dataclass(frozen=True)
class LayerWork:
    """One independent unit of a step: one distinct MoE-layer routing, built where it runs, then
    every strategy planned on it (each micro-batch, padded to the strategy's static tokens per rank
    when > 0) and simulated. Picklable: worker processes run it, and a routing builder (a picklable
    zero-argument callable returning the :class:`GlobalRouting`) travels instead of the routing,
    so a worker generates its own layer and no routing crosses a process boundary.

    routing: the layer's routing, or its builder.  strategies: ``(name, options, static tokens per
    rank of one micro-batch (0: none))`` in the step's order.  micro_batches: M.
    """

    routing: Any
    strategies: tuple[tuple[str, dict, int], ...]
    micro_batches: int
    ctx: Any
    model: ModelSpec
    topology: Any
    costs: CostModel
    train: bool
    tol: float | None


@dataclass(frozen=True)
class LayerDone:
    """One (strategy, micro-batch) of a layer: its communication, Plan footprint, and the wall and
    CPU (this process's user + sys) seconds of planning and simulating it."""

    comm: LayerComm
    footprint: PlanFootprint
    plan_s: float
    sim_s: float
    plan_cpu_s: float = 0.0
    sim_cpu_s: float = 0.0


@dataclass(frozen=True)
class RoutingDone:
    """A :class:`LayerWork`'s results: ``done[(strategy, micro-batch)]`` and the wall and CPU
    seconds its routing took to build (generate or read, split over the ranks and micro-batches)."""

    done: dict[tuple[str, int], LayerDone]
    routing_s: float
    routing_cpu_s: float = 0.0


def _layer_parts(w: LayerWork, cpu: Callable[[], float]) -> tuple[list[GlobalRouting], float, float]:
    """``w``'s routing built and split into its micro-batches; its wall and CPU (``cpu()``) seconds."""
    a, ac = time.perf_counter(), cpu()
    routing = w.routing if isinstance(w.routing, GlobalRouting) else w.routing()
    parts = split_micro_batches(routing, w.micro_batches)
    return parts, time.perf_counter() - a, cpu() - ac


def _plan_part(w: LayerWork, name: str, opts: dict, static: int, part: GlobalRouting,
               cpu: Callable[[], float]) -> tuple[Any, float, float]:
    """One (strategy, micro-batch) Plan of ``w`` (padded to ``static`` tokens per rank when > 0)."""
    from moonep_sim.strategies import make_plan  # looked up per call (benchmarks wrap it)

    if static:
        part = pad_to_static(part, static)
    a, ac = time.perf_counter(), cpu()
    plan = make_plan(name, part, w.ctx, **opts)
    return plan, time.perf_counter() - a, cpu() - ac


def _simulate_plan(w: LayerWork, plan: Any, plan_s: float, plan_cpu_s: float,
                   cpu: Callable[[], float]) -> LayerDone:
    a, ac = time.perf_counter(), cpu()
    comm = simulate_moe_layer(plan, w.model, w.topology, w.costs, w.train, w.tol)
    return LayerDone(comm, PlanFootprint.of(plan), plan_s, time.perf_counter() - a, plan_cpu_s, cpu() - ac)


def simulate_layer_work(w: LayerWork) -> RoutingDone:
    """Build one :class:`LayerWork`'s routing, plan and simulate every strategy on it (module
    level, so worker processes can run it). Each Plan is dropped once its layer is simulated (its
    footprint and communication kept), and the routing when the work returns."""
    cpu = time.process_time
    parts, routing_s, routing_cpu_s = _layer_parts(w, cpu)
    done = {}
    for name, opts, static in w.strategies:
        for mb, part in enumerate(parts):
            plan, plan_s, plan_cpu_s = _plan_part(w, name, opts, static, part, cpu)
            done[(name, mb)] = _simulate_plan(w, plan, plan_s, plan_cpu_s, cpu)
            del plan
    return RoutingDone(done, routing_s, routing_cpu_s)


#: Plans the pipeline may have made ahead of the one being simulated
PIPELINE_AHEAD = 1
#: entries (tokens x K over the ranks) of a layer from which one job pipelines by default: below
#: it a layer is milliseconds of many small numpy calls, which gain nothing beside a Python-bound
#: simulator (both need the GIL)
PIPELINE_MIN_ENTRIES = 1 << 20


class _Task:
    """One piece of a pipelined step, run once by whichever thread claims it first (under the
    pipeline's condition); its value or error kept for the thread that needs it."""

    __slots__ = ("fn", "kind", "n", "claimed", "done", "value", "error")

    def __init__(self, fn: Callable[[], Any], kind: str, n: int) -> None:
        """``kind``: "R" (layer ``n``'s routing) or "P" (unit ``n``'s Plan)."""
        self.fn, self.kind, self.n = fn, kind, n
        self.claimed, self.done, self.value, self.error = False, False, None, None


class _Pipeline:
    """The shared state of :func:`pipelined_layer_work`: tasks in the serial order (each layer's
    routing ``R``, then its Plans ``P`` in (strategy, micro-batch) order), the unit being simulated
    and the bound on what may be built ahead of it."""

    def __init__(self, work: list[LayerWork], ahead: int) -> None:
        import threading

        self.work, self.ahead = work, ahead
        self.cond = threading.Condition()
        self.units = [(i, s, mb) for i, w in enumerate(work) for s in range(len(w.strategies))
                      for mb in range(w.micro_batches)]
        self.left = [len(w.strategies) * w.micro_batches for w in work]   # Plans of a layer not yet made
        self.R = [_Task(lambda i=i: self._routing(i), "R", i) for i in range(len(work))]
        self.P = [_Task(lambda j=j: self._plan(j), "P", j) for j in range(len(self.units))]
        self.order, j = [], 0                   # the units are in layer order: each layer's Plans after its routing
        for r, n in zip(self.R, self.left):
            self.order += [r] + self.P[j:j + n]
            j += n
        self.current = 0           # the unit this thread simulates (or waits for)
        self.stop = False
        self.failed = False
        self.scan = 0              # every task before order[scan] is claimed
        self.second_cpu_s = 0.0    # the second thread's CPU seconds, when it returned
        self.second_wait_s = 0.0   # its seconds waiting at the bound (or for a piece this thread makes)

    def _routing(self, i: int) -> tuple[list[GlobalRouting], float, float]:
        return _layer_parts(self.work[i], time.thread_time)

    def _plan(self, j: int) -> tuple[Any, float, float]:
        i, s, mb = self.units[j]
        parts = self.get(self.R[i])[0]
        name, opts, static = self.work[i].strategies[s]
        out = _plan_part(self.work[i], name, opts, static, parts[mb], time.thread_time)
        with self.cond:
            self.left[i] -= 1
            if not self.left[i]:
                self.R[i].value = (None,) + self.R[i].value[1:]      # the layer's routing is done with
        return out

    def _allowed(self, t: _Task) -> bool:
        last = min(self.current + self.ahead, len(self.units) - 1)
        return t.n <= last if t.kind == "P" else t.n <= self.units[last][0] + 1

    def _run(self, t: _Task) -> None:
        """Run a task this thread claimed; its value or error kept, the waiters woken."""
        try:
            value, error = t.fn(), None
        except BaseException as e:  # kept for the serial point that needs it
            value, error = None, e
        with self.cond:
            t.value, t.error, t.done = value, error, True
            self.failed |= error is not None
            self.cond.notify_all()

    def get(self, t: _Task) -> Any:
        """``t``'s value (or its error raised): run here if unclaimed, else waited for."""
        with self.cond:
            mine = not t.claimed
            t.claimed = True
            while not mine and not t.done:
                self.cond.wait()
        if mine:
            self._run(t)
        if t.error is not None:
            raise t.error
        return t.value

    def _next(self, routing_only: bool) -> _Task | None:
        """The first unclaimed task allowed ahead (under the condition), claimed; None if none."""
        while self.scan < len(self.order) and self.order[self.scan].claimed:
            self.scan += 1
        for t in itertools.islice(self.order, self.scan, None):
            # this thread takes only a routing the second thread needs after its next layer's: one it
            # would otherwise wait for here would stall the second thread instead
            if not t.claimed and self._allowed(t) and (
                    not routing_only or (t.kind == "R" and t.n >= self.units[self.current][0] + 2)):
                t.claimed = True
                return t
            if t.kind == "R" and not self._allowed(t):
                break
        return None

    def builder(self) -> None:
        """The second thread: every task in the serial order, within the bound, until stopped or a
        task failed (this thread then claims the tasks it reaches itself)."""
        c0 = time.thread_time()
        try:
            while True:
                with self.cond:
                    t = None
                    while not self.stop and not self.failed and (t := self._next(False)) is None:
                        w0 = time.perf_counter()
                        self.cond.wait()
                        self.second_wait_s += time.perf_counter() - w0
                    if t is None:
                        return
                self._run(t)
        finally:
            self.second_cpu_s = time.thread_time() - c0

    def plan_for(self, j: int) -> tuple[tuple[Any, float, float], float, int]:
        """Unit ``j``'s Plan for this thread: made here if nobody started it; while the second
        thread makes it, a routing ahead built here (if one is allowed and unclaimed). Returns the
        Plan's (plan, wall s, CPU s), the seconds spent waiting, and the routings built here."""
        t, waited, stole = self.P[j], 0.0, 0
        with self.cond:
            self.current = j
            self.cond.notify_all()
        while True:
            with self.cond:
                if t.done or not t.claimed:
                    break
                r = None if self.failed else self._next(True)
                if r is None:
                    w0 = time.perf_counter()
                    while t.claimed and not t.done:
                        self.cond.wait()
                    waited += time.perf_counter() - w0
                    continue
            self._run(r)
            stole += 1
        return self.get(t), waited, stole

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


def pipelined_layer_work(work: list[LayerWork], progress: Callable[[str, int, int], None] | None = None,
                         ahead: int = PIPELINE_AHEAD) -> tuple[list[RoutingDone], dict[str, float]]:
    """:func:`simulate_layer_work` of every unit in ``work``, on two threads: a second thread (one
    :class:`~concurrent.futures.ThreadPoolExecutor` worker) generates the layers' routings and
    makes their Plans in the serial order, at most ``ahead`` Plans (and the routings of one more
    layer) ahead of the Plan this thread simulates; while this thread would wait for a Plan it
    generates a routing ahead itself (one the second thread needs only after its next layer's).
    Each routing and Plan is made once, by either thread: the same call on the same inputs as
    serially, so the results are the serial loop's (kept in its order).
    The first error in the serial order is the one raised: each piece's error is kept until this
    thread reaches it; the second thread stops at the first failure and is joined before the error
    propagates (nothing left running). CPU seconds per part are the thread's own that ran it
    (``time.thread_time``). Returns the results and the pipeline's figures: this thread's seconds
    waiting for Plans, the routings it built, the layers' process CPU (all threads), each
    thread's own CPU seconds over the layers (the larger is the wall time two free cores need) and
    the second thread's seconds waiting (at the bound, or for a routing this thread makes)."""
    from concurrent.futures import ThreadPoolExecutor

    require(ahead >= 1, f"pipeline lookahead ({ahead}) must be >= 1 Plan")
    pipe = _Pipeline(work, ahead)
    done: list[dict] = [{} for _ in work]
    wait, stolen = 0.0, 0
    c0, m0 = time.process_time(), time.thread_time()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moonep-step") as pool:
        second = pool.submit(pipe.builder)
        try:
            for j, (i, s, mb) in enumerate(pipe.units):
                if progress and s == 0 and mb == 0:
                    progress(f"layer routing {i + 1} of {len(work)}", i, len(work))
                (plan, plan_s, plan_cpu_s), waited, stole = pipe.plan_for(j)
                wait, stolen = wait + waited, stolen + stole
                pipe.P[j].value = None                  # the Plan goes once simulated
                done[i][(work[i].strategies[s][0], mb)] = _simulate_plan(work[i], plan, plan_s, plan_cpu_s,
                                                                         time.thread_time)
                del plan
        finally:
            pipe.close()
    second.result()  # the second thread's own failure (not a piece's: those are kept), if any
    out = [RoutingDone(d, *pipe.R[i].value[1:]) for i, d in enumerate(done)]
    return out, {"wait_s": wait, "routings_here": stolen, "layers_cpu_s": time.process_time() - c0,
                 "main_cpu_s": time.thread_time() - m0, "second_cpu_s": pipe.second_cpu_s,
                 "second_wait_s": pipe.second_wait_s}


def simulate_step(cfg: StepConfig, source: LayerSource, progress: Callable[[str, int, int], None] | None = None,
                  map_fn: Callable | None = None, pipeline: bool | None = None) -> dict:
    """Every strategy's step (see the module docstring). Returns ``{"strategies": {name: figures},
    "layers_routing": [...], ...}``; each strategy's ``timeline`` (a :class:`Timeline`) is kept
    under ``"_timelines"`` for the renderers. ``map_fn(fn, items)``: how the independent layers
    are computed (default in this process; ``experiments`` passes its worker pool). In this
    process, ``pipeline`` (None: when :func:`pipeline_pays`) builds the next routing and Plans on a
    second thread while this one simulates (:func:`pipelined_layer_work`; the same results).

    The source's routing of a layer may be a :class:`GlobalRouting` or a builder of one (see
    :class:`LayerWork`); either way each distinct key is built once and shared by every strategy."""
    m, shape = cfg.model, cfg.shape
    ov = get_overlap(cfg.overlap)
    costs = cfg.costs or CostModel(cfg.topology)
    train = shape.mode == "train"
    M = ov.micro_batches
    require(shape.tokens >= M, f"tokens per rank ({shape.tokens}) must be >= {M} for overlap {ov.name}")
    mb_shapes = [StepShape(shape.mode, (shape.tokens * (i + 1)) // M - (shape.tokens * i) // M,
                           shape.context, shape.shards) for i in range(M)]
    missing = costs.missing_ops(all_ops(stack_ops(m, mb_shapes[0]), train) + _expert_ops(train))
    require(not missing, f"--compute-profile ({costs.profile.path if costs.profile else ''}) must time every op "
                         f"of the step: missing {len(missing)}: {', '.join(missing[:6])}"
                         + (" ..." if len(missing) > 6 else ""))
    R = cfg.ctx.cluster.ranks
    routings: list[tuple[Any, Any, str]] = [source(i) for i in range(m.moe_layers)]
    layer_keys = [k for k, _, _ in routings]
    provenance = [p for _, _, p in routings]
    out: dict[str, Any] = {}
    timelines: dict[str, Timeline] = {}
    # every distinct routing is built once; every (strategy, micro-batch) planned and simulated on it
    strategies = tuple((name, dict(opts), -(-int(cfg.static_tokens[name]) // M) if name in cfg.static_tokens else 0)
                       for name, opts in cfg.strategies)
    first: dict[Any, Any] = {}
    for key, routing, _ in routings:
        first.setdefault(key, routing)
    del routings
    keys = list(first)
    work = [LayerWork(first.pop(k), strategies, M, cfg.ctx, m, cfg.topology, costs, train, cfg.tol) for k in keys]
    t0, c0 = time.perf_counter(), time.process_time()
    if map_fn is None and pipeline is None:
        pipeline = pipeline_pays(len(work), shape.tokens * R * m.top_k)
    piped = None
    if map_fn is None and pipeline and work:
        done, piped = pipelined_layer_work(work, progress)
        piped = {"threads": 2, "ahead_plans": PIPELINE_AHEAD, "wait_s": piped["wait_s"],
                 "routings_on_main": piped["routings_here"], "main_cpu_s": piped["main_cpu_s"],
                 "second_cpu_s": piped["second_cpu_s"], "second_wait_s": piped["second_wait_s"]}
    elif map_fn is None:
        done = []
        for i in range(len(work)):
            if progress:
                progress(f"layer routing {i + 1} of {len(keys)}", i, len(keys))
            done.append(simulate_layer_work(work[i]))
            work[i] = None                             # the routing goes once its layer is done
    else:
        done = map_fn(simulate_layer_work, work)
    del work
    if progress:
        progress("composing the step", len(keys), len(keys))
    wall, layers_cpu = time.perf_counter() - t0, (time.process_time() - c0 if map_fn is None else None)
    routing_s = sum(d.routing_s for d in done)
    routing_cpu_s = sum(d.routing_cpu_s for d in done)
    by_key = dict(zip(keys, done))
    for name, _ in cfg.strategies:
        cache = {(k, mb): d.done[(name, mb)] for k, d in by_key.items() for mb in range(M)}
        plans = [d.footprint for d in cache.values()]
        plan_s = sum(d.plan_s for d in cache.values())
        sim_s = sum(d.sim_s for d in cache.values())
        t0, c0 = time.perf_counter(), time.process_time()
        first_moe = m.dense_layers
        comm_of = lambda layer, mb, cache=cache: cache[(layer_keys[layer - first_moe], mb)].comm
        tl = compose(m, mb_shapes, costs, ov, comm_of, R, train)
        comms = {l: comm_of(l, 0) for l in range(first_moe, m.layers)}
        d = step_metrics(tl, cfg, comms, useful_flops_per_rank(cfg), float(shape.tokens))
        mem = memory_per_rank(m, shape, plans, R, cfg.memory)
        cap = cfg.topology.gpu_memory_GiB * 2**30
        d.update(peak_memory_bytes=mem["peak_bytes"], gpu_memory_bytes=cap, oom=(mem["peak_bytes"] > cap) if cap else None,
                 memory=mem, distinct_layers_simulated=len(cache),
                 static_tokens=int(cfg.static_tokens[name]) if name in cfg.static_tokens else None,
                 wall_seconds=dict(routing=routing_s, plan=plan_s, simulate=sim_s, layers_wall=wall,
                                   compose=time.perf_counter() - t0,
                                   pipeline_wait=piped["wait_s"] if piped else None),
                 # CPU seconds where they ran (workers' own with a pool; each thread's own when
                 # pipelined); routing: shared by the strategies; layers: this process's CPU over
                 # every layer, all threads (None with a pool)
                 cpu_seconds=dict(routing=routing_cpu_s, plan=sum(d.plan_cpu_s for d in cache.values()),
                                  simulate=sum(d.sim_cpu_s for d in cache.values()),
                                  compose=time.process_time() - c0, layers=layers_cpu),
                 rows_max_mean=_rows_ratio(comms),
                 padded_rows_per_rank=float(np.mean([c.padded_rows_R.max() for c in comms.values()])) if comms else 0.0,
                 real_rows_per_rank=float(np.mean([c.rows_R.max() for c in comms.values()])) if comms else 0.0,
                 copies_per_layer=float(np.mean([c.copies_R.sum() for c in comms.values()])) if comms else 0.0,
                 # entries the strategy dropped over the step's MoE layers (less work: it never wins)
                 dropped=int(sum(comm_of(l, mb).dropped for l in comms for mb in range(M))),
                 entries=int(sum(comm_of(l, mb).entries for l in comms for mb in range(M))))
        out[name] = d
        timelines[name] = tl
    return {"strategies": out, "mode": shape.mode, "tokens_per_rank": shape.tokens, "context": shape.context,
            "overlap": ov.name, "layers_routing": provenance, "pipeline": piped,
            "compute_sources": costs.sources(all_ops(stack_ops(m, mb_shapes[0]), train), train),
            "_timelines": timelines}



def pipeline_pays(units: int, entries: int, cores: int | None = None) -> bool:
    """Whether one job pipelines by default: two or more distinct layers of at least
    :data:`PIPELINE_MIN_ENTRIES` routed entries each, and two or more cores this process may run on
    (``cores``; default: its CPU affinity)."""
    if cores is None:
        import os

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return units >= 2 and entries >= PIPELINE_MIN_ENTRIES and cores >= 2


def _expert_ops(train: bool) -> list:
    from moonep_sim.step.stack import Op

    ops = [Op("expert", "gemm", 0.0, 0.0, 1, "rows=M")]
    return ops + ([Op("expert_bwd", "gemm", 0.0, 0.0, 1, "rows=M")] if train else [])


def _rows_ratio(comms: Mapping[int, LayerComm]) -> float:
    """Mean over MoE layers of the busiest rank's real rows over the mean rank's."""
    r = [float(c.rows_R.max()) / max(float(c.rows_R.mean()), 1e-9) for c in comms.values()]
    return float(np.mean(r)) if r else 0.0


__all__ = ["LayerSource", "PIPELINE_AHEAD", "PIPELINE_MIN_ENTRIES", "ROUTING_FIELDS", "StepConfig", "pad_to_static",
           "pipeline_pays", "pipelined_layer_work", "simulate_step", "split_micro_batches", "step_metrics",
           "trusted_routing", "useful_flops_per_rank"]
