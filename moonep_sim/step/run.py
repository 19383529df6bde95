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
pipelined on two threads (the units, the pool's function and the pipeline:
:mod:`moonep_sim.step.layer_work`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import GlobalRouting
from moonep_sim.step.compose import all_ops, compose, stack_ops
from moonep_sim.step.costs import EXPERT_OPS, CostModel
from moonep_sim.step.layer_sim import LayerComm
from moonep_sim.step.layer_work import (PIPELINE_AHEAD, LayerWork, pipeline_pays, pipelined_layer_work,
                                      simulate_layer_work)
from moonep_sim.step.memory import MemoryOptions, memory_per_rank
from moonep_sim.step.memory_fit import attach_fits
from moonep_sim.step.schedule import Timeline, overlap_by_op
from moonep_sim.step.schedules import get_overlap
from moonep_sim.step.stack import Op, StepShape

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


def step_metrics(tl: Timeline, cfg: StepConfig, comms: Mapping[int, LayerComm], useful_flops: float,
                 real_tokens: float) -> dict:
    """The per-strategy figures of one composed step (the JSON contract of ``moonep-sim step``)."""
    end_R = tl.end_R()
    r = int(np.argmax(end_R))
    t = float(end_R[r])
    ev, R, L = tl.events, tl.R, cfg.model.layers
    start_NR, end_NR = np.array([e.start_R for e in ev]).reshape(-1, R), np.array([e.end_R for e in ev]).reshape(-1, R)
    dur_NR = end_NR - start_NR
    comp_N = np.array([e.stream == "compute" for e in ev], bool)
    # [R] each stream's busy us, summed in issue order
    busy, comm = (np.cumsum(np.vstack([np.zeros(R), dur_NR[m]]), axis=0)[-1] for m in (comp_N, ~comp_N))
    exposed = max(t - float(busy[r]), 0.0)
    peak = cfg.topology.gpu_tflops * 1e6
    layers = []
    # per layer l (forward) and L + l (backward) [2L, R]: the first start and the last end; compute us [L, R]
    layer_N = np.array([e.layer for e in ev], int)
    own = layer_N >= 0
    g_N = np.where([e.direction == "forward" for e in ev], layer_N, layer_N + L)[own]
    o = np.argsort(g_N, kind="stable")
    g, at = np.unique(g_N[o], return_index=True)
    first, last, compute = np.full((2 * L, R), np.inf), np.zeros((2 * L, R)), np.zeros((L, R))
    first[g], last[g] = np.minimum.reduceat(start_NR[own][o], at), np.maximum.reduceat(end_NR[own][o], at)
    np.add.at(compute, layer_N[comp_N & own], dur_NR[comp_N & own])   # in issue order
    for l in range(L):
        dur_R = (last[l] - first[l]) + np.where(np.isfinite(first[L + l]), last[L + l] - first[L + l], 0.0)
        slow = int(np.argmax(dur_R))
        c = comms.get(l)
        kind = ("moe" if l >= cfg.model.dense_layers else "dense") + f"/{cfg.model.attention_kind(l)}"
        st = dict(c.straggler) if c is not None else {"rank": slow, "cause": "compute", "phase": None,
                                                     "detail": "dense layer (same work on every rank)"}
        layers.append({"layer": l, "kind": kind, "time_us": float(dur_R[slow]),
                       "exposed_comm_us": float(max(dur_R[slow] - compute[l, slow], 0.0)), "straggler": st})
    return {"step_time_us": t, "slowest_rank": r, "tokens_per_s_per_gpu": real_tokens / (t * 1e-6) if t > 0 else 0.0,
            "mfu": useful_flops / (t * peak) if t > 0 else 0.0, "exposed_comm_us": exposed,
            "comm_share": exposed / t if t > 0 else 0.0, "compute_us": float(busy[r]), "comm_us": float(comm[r]),
            "layers": layers, "overlap_by_op": overlap_by_op(tl, r)}


def useful_flops_per_rank(cfg: StepConfig) -> float:
    """Model FLOPs per rank of the step's real tokens (no padding): the stack's ops and the routed
    experts' T x K rows, with the backward's twice the GEMMs in train."""
    shape, m = cfg.shape, cfg.model
    f = sum(o.flops for o in all_ops(stack_ops(m, shape), shape.mode == "train"))
    fwd_exp = shape.tokens * m.top_k * m.expert_flops_per_row() * m.moe_layers
    return f + fwd_exp * (3.0 if shape.mode == "train" else 1.0)


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
    if train and cfg.memory.recompute != "none":   # the backward recomputes what the memory account dropped
        costs = dataclasses.replace(costs, recompute=cfg.memory.activations())
    M = ov.micro_batches
    require(shape.tokens >= M, f"tokens per rank ({shape.tokens}) must be >= {M} for overlap {ov.name}")
    mb_shapes = [dataclasses.replace(shape, tokens=(shape.tokens * (i + 1)) // M - (shape.tokens * i) // M)
                 for i in range(M)]
    ops = all_ops(stack_ops(m, mb_shapes[0]), train)
    missing = costs.missing_ops(ops + _expert_ops(train))
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
    done, piped = _run_layer_work(work, map_fn, bool(pipeline), progress)
    del work
    if progress:
        progress("composing the step", len(keys), len(keys))
    wall, layers_cpu = time.perf_counter() - t0, (time.process_time() - c0 if map_fn is None else None)
    routing_s = sum(d.routing_s for d in done)
    routing_cpu_s = sum(d.routing_cpu_s for d in done)
    by_key = dict(zip(keys, done))
    fps_of: dict[str, list] = {}
    useful_flops = useful_flops_per_rank(cfg)
    for name, _ in cfg.strategies:
        cache = {(k, mb): d.done[(name, mb)] for k, d in by_key.items() for mb in range(M)}
        plans = fps_of[name] = [d.footprint for d in cache.values()]
        t0, c0 = time.perf_counter(), time.process_time()
        first_moe = m.dense_layers
        comm_of = lambda layer, mb, cache=cache: cache[(layer_keys[layer - first_moe], mb)].comm
        tl = compose(m, mb_shapes, costs, ov, comm_of, R, train)
        comms = {l: comm_of(l, 0) for l in range(first_moe, m.layers)}
        d = step_metrics(tl, cfg, comms, useful_flops, float(shape.tokens))
        mem = memory_per_rank(m, shape, plans, R, cfg.memory, cfg.ctx.placement.num_slots)
        cap = cfg.topology.gpu_memory_GiB * 2**30
        d.update(peak_memory_bytes=mem["peak_bytes"], gpu_memory_bytes=cap, oom=(mem["peak_bytes"] > cap) if cap else None,
                 memory=mem, distinct_layers_simulated=len(cache),
                 static_tokens=int(cfg.static_tokens[name]) if name in cfg.static_tokens else None,
                 wall_seconds=dict(routing=routing_s, plan=sum(d.plan_s for d in cache.values()),
                                   simulate=sum(d.sim_s for d in cache.values()), layers_wall=wall,
                                   compose=time.perf_counter() - t0,
                                   pipeline_wait=piped["wait_s"] if piped else None),
                 # CPU seconds where they ran (workers' own with a pool; each thread's own when
                 # pipelined); routing: shared by the strategies; layers: this process's CPU over
                 # every layer, all threads (None with a pool)
                 cpu_seconds=dict(routing=routing_cpu_s, plan=sum(d.plan_cpu_s for d in cache.values()),
                                  simulate=sum(d.sim_cpu_s for d in cache.values()),
                                  compose=time.process_time() - c0, layers=layers_cpu),
                 # means over the MoE layers: the busiest rank's real rows over the mean rank's, ...
                 rows_max_mean=_layer_mean(comms, lambda c: float(c.rows_R.max()) / max(float(c.rows_R.mean()), 1e-9)),
                 padded_rows_per_rank=_layer_mean(comms, lambda c: c.padded_rows_R.max()),
                 real_rows_per_rank=_layer_mean(comms, lambda c: c.rows_R.max()),
                 copies_per_layer=_layer_mean(comms, lambda c: c.copies_R.sum()),
                 proxy_host_us=_layer_mean(comms, lambda c: c.proxy_host_us),
                 # entries the strategy dropped over the step's MoE layers (less work: it never wins)
                 dropped=int(sum(comm_of(l, mb).dropped for l in comms for mb in range(M))),
                 entries=int(sum(comm_of(l, mb).entries for l in comms for mb in range(M))))
        out[name] = d
        timelines[name] = tl
    attach_fits(cfg, out, fps_of)
    return {"strategies": out, "mode": shape.mode, "tokens_per_rank": shape.tokens, "context": shape.context,
            "overlap": ov.name, "layers_routing": provenance, "pipeline": piped,
            "compute_sources": costs.sources(ops, train),
            "_timelines": timelines, "_footprints": fps_of}


def _run_layer_work(work: list, map_fn: Callable | None, pipeline: bool,
                    progress: Callable[[str, int, int], None] | None) -> tuple[list, dict | None]:
    """Every unit of ``work`` run: by ``map_fn`` (a worker pool), pipelined on two threads, or in
    order here (each unit's routing dropped once done). Returns the units' results in order and the
    pipeline's figures (None unless pipelined)."""
    if map_fn is not None:
        return map_fn(simulate_layer_work, work), None
    if pipeline and work:
        done, piped = pipelined_layer_work(work, progress)
        return done, {"threads": 2, "ahead_plans": PIPELINE_AHEAD, "wait_s": piped["wait_s"],
                      "routings_on_main": piped["routings_here"], "main_cpu_s": piped["main_cpu_s"],
                      "second_cpu_s": piped["second_cpu_s"], "second_wait_s": piped["second_wait_s"]}
    done = []
    for i in range(len(work)):
        if progress:
            progress(f"layer routing {i + 1} of {len(work)}", i, len(work))
        done.append(simulate_layer_work(work[i]))
        work[i] = None                             # the routing goes once its layer is done
    return done, None


def _expert_ops(train: bool) -> list[Op]:
    """The routed experts' GEMMs as ops (what a profile must time: ``rows=M`` curves)."""
    return [Op(name, "gemm", 0.0, 0.0, 1, "rows=M") for name in EXPERT_OPS[:1 + train]]


def _layer_mean(comms: Mapping[int, LayerComm], f: Callable[[LayerComm], float]) -> float:
    """Mean over the MoE layers of ``f(layer's communication)`` (0 without any)."""
    return float(np.mean([f(c) for c in comms.values()])) if comms else 0.0


__all__ = ["LayerSource", "StepConfig", "simulate_step", "step_metrics", "useful_flops_per_rank"]
