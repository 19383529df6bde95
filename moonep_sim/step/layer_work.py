"""How a step's layer work runs: one unit per distinct MoE-layer routing (:class:`LayerWork`), run
in this process one after another, on a worker pool (``simulate_step``'s ``map_fn``: the unit is
picklable and :func:`simulate_layer_work` module level), or with one job on two threads
(:func:`pipelined_layer_work`: routings and Plans made ahead on a second thread -- one
``ThreadPoolExecutor`` worker -- while this one simulates, the same results). The front that
chooses between them and composes the step is :mod:`moonep_sim.step.run`.

Notation: R ranks, M micro-batches, T tokens per rank. Times in seconds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import GlobalRouting
from moonep_sim.plan.ir import even_tokens_per_rank
from moonep_sim.step.costs import CostModel
from moonep_sim.step.layer_sim import LayerComm, simulate_moe_layer
from moonep_sim.step.memory import PlanFootprint


#: GlobalRouting's fields, in order: what :func:`trusted_routing` sets (a test pins them, so a new
#: field cannot be skipped silently).
ROUTING_FIELDS = ("topk_ids_TK", "topk_weights_TK", "tokens_per_rank_R", "num_experts")


def trusted_routing(topk_ids_TK: np.ndarray, topk_weights_TK: np.ndarray, num_experts: int,
                    ranks: "int | np.ndarray") -> GlobalRouting:
    """``GlobalRouting.split_evenly(...)`` (``ranks``: R) or ``GlobalRouting(...)`` (the tokens per rank
    [R]) of routing valid by construction, without re-checking it: ``GlobalRouting`` checks every
    token's ids are distinct and in ``[0, E)``, a K(K-1)/2-pass scan over T, 0.03-0.04 CPU s of a Kimi
    K3 EP64 layer (262,144 x 16). A step's generated layers (the samplers draw distinct experts of
    ``[0, E)``), their relabelled copies and the micro-batches and padded passes cut from checked
    routing skip it. The cheap checks stay: dtypes (int64 ids, float32 weights) and shapes."""
    ids, w = topk_ids_TK, topk_weights_TK
    require(ids.dtype == np.int64 and w.dtype == np.float32 and ids.ndim == 2 and w.shape == ids.shape,
            f"trusted routing ({ids.dtype} {list(ids.shape)} ids, {w.dtype} {list(w.shape)} weights) must be int64 "
            "[T, K] ids and float32 weights of the same shape, as the generator returns them")
    tpr = even_tokens_per_rank(ids.shape[0], ranks) if np.ndim(ranks) == 0 else ranks
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
        out.append(trusted_routing(r.topk_ids_TK[m], r.topk_weights_TK[m], r.num_experts, cut_R[i + 1] - cut_R[i]))
    return out


def pad_to_static(r: GlobalRouting, tokens: int) -> GlobalRouting:
    """``r`` with every rank padded to ``tokens`` tokens (a static Buffer's capacity): padding token j
    (counted over the ranks in order) selects experts ``(j*K + k) mod E`` (ASSUMED round-robin), weight 0."""
    n_R = r.tokens_per_rank_R.astype(np.int64)
    require(int(n_R.max()) <= tokens, f"static buffer tokens ({tokens}) must be >= the largest rank's tokens "
                                      f"({int(n_R.max())})")
    pad_R = tokens - n_R
    if not pad_R.any():
        return r
    K, R = r.top_k, r.ranks
    real_T = (np.arange(tokens)[None, :] < n_R[:, None]).ravel()   # [R x tokens]: each rank's own tokens first
    ids, w = np.empty((R * tokens, K), np.int64), np.zeros((R * tokens, K), np.float32)
    ids[real_T], w[real_T] = r.topk_ids_TK, r.topk_weights_TK
    ids[~real_T] = np.arange(int(pad_R.sum()) * K).reshape(-1, K) % r.num_experts
    return trusted_routing(ids, w, r.num_experts, np.full(R, tokens, np.int64))


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


class _Piece:
    """One piece of a pipelined step -- ``kind`` "R" (layer ``n``'s routing) or "P" (unit ``n``'s
    Plan) -- run once, by whichever thread claims it first; its value or error kept for the thread
    that needs it."""

    __slots__ = ("fn", "kind", "n", "queued", "value", "error", "ready", "_claim")

    def __init__(self, fn: Callable[[], Any], kind: str, n: int) -> None:
        self.fn, self.kind, self.n, self.queued = fn, kind, n, False
        self.value, self.error, self.ready, self._claim = None, None, threading.Event(), threading.Lock()

    def claim(self) -> bool:
        """Whether the calling thread is the first to claim it (and so runs it)."""
        return self._claim.acquire(blocking=False)

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # kept for the serial point that needs it
            self.error = e
        self.ready.set()

    def get(self) -> Any:
        """Its value (or its error raised): run here if unclaimed, else waited for."""
        if self.claim():
            self.run()
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self.value


class _Pipeline:
    """The shared state of :func:`pipelined_layer_work`: the pieces in the serial order (each layer's
    routing ``R``, then its Plans ``P`` in (strategy, micro-batch) order), of which this thread
    queues for the second thread (:meth:`feed`) those within the bound of the unit it simulates."""

    def __init__(self, work: list[LayerWork], ahead: int) -> None:
        self.work, self.ahead = work, ahead
        self.lock = threading.Lock()
        self.units = [(i, s, mb) for i, w in enumerate(work) for s in range(len(w.strategies))
                      for mb in range(w.micro_batches)]
        self.left = [len(w.strategies) * w.micro_batches for w in work]   # Plans of a layer not yet made
        self.R = [_Piece(lambda i=i: _layer_parts(work[i], time.thread_time), "R", i) for i in range(len(work))]
        self.P = [_Piece(lambda j=j: self._plan(j), "P", j) for j in range(len(self.units))]
        self.order, j = [], 0                   # the units are in layer order: each layer's Plans after its routing
        for r, n in zip(self.R, self.left):
            self.order += [r] + self.P[j:j + n]
            j += n
        self.fed = 0               # every piece before order[fed] is queued
        self.failed = False        # a piece failed on the second thread: it runs no more
        self.second_cpu_s = 0.0    # the second thread's CPU seconds running pieces
        self.second_busy_s = 0.0   # and its wall seconds doing so

    def _plan(self, j: int) -> tuple[Any, float, float]:
        i, s, mb = self.units[j]
        name, opts, static = self.work[i].strategies[s]
        out = _plan_part(self.work[i], name, opts, static, self.R[i].get()[0][mb], time.thread_time)
        with self.lock:
            self.left[i] -= 1
            if not self.left[i]:
                self.R[i].value = (None,) + self.R[i].value[1:]      # the layer's routing is done with
        return out

    def _second(self, t: _Piece) -> None:
        """The second thread's turn at a queued piece: run unless claimed already or a piece failed."""
        if self.failed or not t.claim():
            return
        w0, c0 = time.perf_counter(), time.thread_time()
        t.run()
        self.failed |= t.error is not None
        self.second_busy_s += time.perf_counter() - w0
        self.second_cpu_s += time.thread_time() - c0

    def _bound(self, j: int) -> tuple[int, int]:
        """(the last Plan, the last layer's routing) that may be made while unit ``j`` is simulated."""
        last = min(j + self.ahead, len(self.units) - 1)
        return last, self.units[last][0] + 1

    def feed(self, pool: Any, j: int) -> None:
        """Queue on ``pool`` (the second thread), in the serial order, every piece not queued yet that
        the bound of unit ``j`` allows."""
        last, top = self._bound(j)
        for t in self.order[self.fed:]:
            if t.kind == "R" and t.n > top:
                break
            if not t.queued and (t.kind == "R" or t.n <= last):
                t.queued = True
                pool.submit(self._second, t)
        while self.fed < len(self.order) and self.order[self.fed].queued:
            self.fed += 1

    def plan_for(self, j: int) -> tuple[tuple[Any, float, float], float, int]:
        """Unit ``j``'s Plan for this thread: made here if nobody started it; while the second
        thread makes it, a routing ahead built here (one queued and unclaimed that the second thread
        needs only after its next layer's). Returns the Plan's (plan, wall s, CPU s), the seconds
        spent waiting, and the routings built here."""
        t, waited, stole = self.P[j], 0.0, 0
        ahead = self.R[self.units[j][0] + 2:self._bound(j)[1] + 1]
        if t.claim():
            t.run()
        while not t.ready.is_set():
            r = None if self.failed else next((r for r in ahead if r.claim()), None)
            if r is None:
                w0 = time.perf_counter()
                t.ready.wait()
                waited += time.perf_counter() - w0
            else:
                r.run()
                stole += 1
        return t.get(), waited, stole


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
    the second thread's wall seconds outside its pieces (idle at the bound; not a piece's own waits)."""
    from concurrent.futures import ThreadPoolExecutor

    require(ahead >= 1, f"pipeline lookahead ({ahead}) must be >= 1 Plan")
    pipe = _Pipeline(work, ahead)
    done: list[dict] = [{} for _ in work]
    wait, stolen = 0.0, 0
    c0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moonep-step") as pool:
        try:
            for j, (i, s, mb) in enumerate(pipe.units):
                if progress and s == 0 and mb == 0:
                    progress(f"layer routing {i + 1} of {len(work)}", i, len(work))
                pipe.feed(pool, j)
                (plan, plan_s, plan_cpu_s), waited, stole = pipe.plan_for(j)
                wait, stolen = wait + waited, stolen + stole
                pipe.P[j].value = None                  # the Plan goes once simulated
                done[i][(work[i].strategies[s][0], mb)] = _simulate_plan(work[i], plan, plan_s, plan_cpu_s,
                                                                         time.thread_time)
                del plan
        finally:
            pool.shutdown(cancel_futures=True)          # what is still queued is not started
    out = [RoutingDone(d, *pipe.R[i].value[1:]) for i, d in enumerate(done)]
    return out, {"wait_s": wait, "routings_here": stolen, "layers_cpu_s": time.process_time() - c0,
                 "main_cpu_s": time.thread_time() - m0, "second_cpu_s": pipe.second_cpu_s,
                 "second_wait_s": time.perf_counter() - w0 - pipe.second_busy_s}


def pipeline_pays(units: int, entries: int, cores: int | None = None) -> bool:
    """Whether one job pipelines by default: two or more distinct layers of at least
    :data:`PIPELINE_MIN_ENTRIES` routed entries each, and two or more cores this process may run on
    (``cores``; default: its CPU affinity)."""
    if cores is None:
        from moonep_sim.perf import host_cores

        cores = host_cores()
    return units >= 2 and entries >= PIPELINE_MIN_ENTRIES and cores >= 2


__all__ = ["LayerWork", "LayerDone", "RoutingDone", "PIPELINE_AHEAD", "PIPELINE_MIN_ENTRIES", "ROUTING_FIELDS",
           "pad_to_static", "pipeline_pays", "pipelined_layer_work", "simulate_layer_work", "split_micro_batches",
           "trusted_routing"]
