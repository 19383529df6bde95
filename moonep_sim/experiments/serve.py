"""Serving experiments: a deployment's workers, their step-time models and a request run per strategy.

Notation: R GPUs of a worker (its EP ranks), T tokens per rank, C context, D routing draws.

:func:`run_serve` does, per pool of the deployment (``moonep_sim.serve.deployment``):

1. the **step-time model** (``moonep_sim.serve.steptime``): the step simulator
   (``moonep_sim.step.run.simulate_step``) over a grid of (mode, T, C) the pool will meet (decode:
   T = 1 .. its running sequences per rank, C over the requests' contexts; prefill: T up to its
   token budget, C over the prompts), ``D`` routing draws each -- generated at ``--gen``'s skew
   with seed ``seed x 101 + d``, or resampled from a recorded trace's step ``d`` (tokens drawn
   with replacement from that step) -- cached on disk by everything that determines it, and checked
   against direct step simulations at held-out shapes (its error is reported beside every result);
2. the **engine** (``moonep_sim.serve.engine``) over the requests, each iteration priced for its
   shape on draw ``d`` (in order for a trace, resampled for a generator); with ``direct`` every
   distinct iteration shape is simulated by the step model itself instead (slow; for checking);
3. the **figures** (``moonep_sim.serve.metrics``) and the verdict on the SLO metric.

A worker of pure expert parallelism over data-parallel attention is priced by the pure-EP step
(``simulate_step`` over its GPUs); a worker with attention TP, expert TP or EP over fewer GPUs than
it has by the step model's layout step (``Scenario.step(parallel=...)``, generated routing only),
its grid's T counted per GPU (an attention rank's tokens over ``tp``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.models import ModelSpec
from moonep_sim.serve import steptime as st
from moonep_sim.serve.deployment import Deployment, Pool, kv_bytes_per_token
from moonep_sim.serve.engine import EngineConfig, Worker, cuda_graph_sizes, simulate
from moonep_sim.serve.metrics import serve_verdict, summarize
from moonep_sim.serve.policies import get_policy
from moonep_sim.serve.requests import Requests

#: default skew of generated routing: MoonEP's lognormal popularity sigma (the step's noise floor
#: makes maxvio meaningless at decode's few tokens per rank)
DEFAULT_GEN = "sigma=0.5"


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What a serving run needs besides the requests and the deployment: model, topology (name or
    path), strategies (names), routing (``gen:K=V,...`` or a trace path), overlap, draws, the
    grid's distinct MoE layers per step, the step-time cache folder (None: no cache), direct
    (every iteration simulated), the SLO (seconds), price per GPU-hour, seed, held-out shapes, the
    GEMM dtype of the step's compute (bf16 or fp8 peaks), the
    :class:`~moonep_sim.experiments.scenario.Scenario` whose routing, topology and strategies the
    step simulations take (its cluster replaced by each worker's GPUs), and the worker processes
    that build step-time models (``jobs``)."""

    model: str
    topology: str = "h800-cx7"
    strategies: tuple[str, ...] = ("alltoall", "deepep")
    routing: str = "gen:" + DEFAULT_GEN
    overlap: str = "none"
    draws: int = 3
    distinct_layers: int = 1
    cache: str | None = None
    direct: bool = False
    slo: Mapping[str, float] = dataclasses.field(default_factory=dict)
    price: float | None = None
    seed: int = 0
    holdout: int = 4
    gemm_dtype: str = "bf16"
    scenario: Any = dataclasses.field(default=None, compare=False)
    jobs: int = 1


class _PerGPU:
    """A step-time model of a TP x DP worker priced on its GPUs: tokens of an attention rank of
    ``tp`` GPUs spread over them (ceil(n / tp) each)."""

    def __init__(self, inner: Any, tp: int) -> None:
        self.inner, self.tp, self.draws = inner, tp, getattr(inner, "draws", 1)

    def time_us(self, n_pre: int, c_pre: float, n_dec: int, c_dec: float, draw: int = 0) -> float:
        d = lambda n: -(-int(n) // self.tp)
        return self.inner.time_us(d(n_pre), c_pre, d(n_dec), c_dec, draw)


def layout_simulator(base: Any, layout: Any, strategies: Sequence[str], overlap: str, distinct: int, seed: int,
                     gemm_dtype: str = "bf16") -> Callable[[str, int, int, int], dict[str, float]]:
    """``simulate(mode, T, C, d)`` for a worker whose layout is not pure EP over data-parallel
    attention (attention TP, or EP over fewer GPUs than the worker): the step model's layout step
    (``Scenario.step(parallel=...)``: TP collectives, the dense part sharded, one EP group planned)
    at ``T x tp`` tokens per attention rank, i.e. ``T`` per GPU, on generated routing of seed
    ``seed x 101 + d``."""
    from moonep_sim.experiments.routing import GeneratorSpec

    require(base is not None, "a serving run needs its scenario (routing, topology, strategies) to simulate steps")
    r = base.routing
    spec = r if isinstance(r, GeneratorSpec) else GeneratorSpec.parse(str(r)[4:]) if str(r).startswith("gen:") else None
    require(spec is not None, f"a worker of layout {layout.label()} needs generated routing (--gen): a step under a "
                              "layout plans one EP group's generated tokens")

    def simulate(mode: str, T: int, C: int, d: int) -> dict[str, float]:
        n = int(T) * layout.tp
        g = dataclasses.replace(spec, tokens_per_rank=n, seed=seed * 101 + d)
        sc = dataclasses.replace(base, routing=g, cluster=layout.world, strategies=list(strategies))
        res = sc.step(mode, overlap, tokens_per_rank=n, context=int(C), distinct_layers=max(distinct, 1),
                      gemm_dtype=gemm_dtype, parallel=layout, pipeline=False)
        return {k: float(f["step_time_us"]) for k, f in res.figures.items()}
    return simulate


def step_simulator(base: Any, model: ModelSpec, ranks: int, strategies: Sequence[str], overlap: str, distinct: int,
                   seed: int, gemm_dtype: str = "bf16", layout: Any = None
                   ) -> Callable[[str, int, int, int], dict[str, float]]:
    """``simulate(mode, T, C, d)`` -> {strategy: step time us}: one step of the step model on ``ranks``
    GPUs (pure EP, attention DP) of the ``base`` scenario's routing and topology, on draw ``d`` (see
    the module docstring); a ``layout`` other than that goes to :func:`layout_simulator`."""
    if layout is not None and (layout.tp > 1 or layout.ep != layout.world or layout.etp > 1):
        return layout_simulator(base, layout, strategies, overlap, distinct, seed, gemm_dtype)
    from moonep_sim.experiments.step import layer_source
    from moonep_sim.plan import GlobalRouting
    from moonep_sim.step import StepConfig, simulate_step, step_shape
    from moonep_sim.step.costs import step_cost_model

    require(base is not None, "a serving run needs its scenario (routing, topology, strategies) to simulate steps")
    sc = dataclasses.replace(base, cluster=ranks, strategies=[s for s in strategies])
    rs = sc.resolved
    is_gen = rs.source.gen is not None
    src = rs.source
    # the step's one cost rule: measured GEMM tables where installed and the GPU has one, else the roofline
    costs = step_cost_model(rs.topology, gemm_dtype)
    steps = None
    last: dict[str, Any] = {}
    if not is_gen:
        from moonep_sim.experiments.step import trace_passes

        steps = [t for _, t in trace_passes(src)]
        layers = list(src.layer_ids)[:max(distinct, 1)]
        rows = {l: src.selected_layer(l) for l in layers}

    def simulate(mode: str, T: int, C: int, d: int) -> dict[str, float]:
        shape = step_shape(model, mode, int(T), int(C))
        cfg = StepConfig(model, rs.topology, rs.ctx, rs.strategies, shape, overlap, costs)
        if is_gen:
            if last.get("key") != (int(T), d):  # a grid walks C at one (T, draw): its routing is drawn once
                g = dataclasses.replace(src.gen, tokens_per_rank=int(T), seed=seed * 101 + d)
                last.update(key=(int(T), d), source=layer_source(dataclasses.replace(src, gen=g), ranks, int(T),
                                                                 model.moe_layers, max(distinct, 1)))
            source = last["source"]
        else:
            pick = steps[d % len(steps)]
            rng = np.random.default_rng(np.random.SeedSequence([seed, d, int(T), 77]))
            made = {}
            for l, lr in rows.items():
                ids, w = lr.topk_ids_TK, lr.topk_weights_TK
                if pick is not None:
                    ids, w = ids[pick], w[pick]
                j = rng.integers(0, len(ids), int(T) * ranks)
                made[l] = GlobalRouting.split_evenly(ids[j], w[j], src.num_experts, ranks)
            keys = list(made)
            source = lambda i: (("trace", keys[i % len(keys)]), made[keys[i % len(keys)]],
                                f"trace layer {keys[i % len(keys)]}, step draw {d}, resampled")
        res = simulate_step(cfg, source, pipeline=False)
        return {n: float(f["step_time_us"]) for n, f in res["strategies"].items()}
    return simulate


def grid_for(pool: Pool, req: Requests) -> dict[str, list[int]]:
    """The shapes a pool meets: decode T up to its running sequences per rank (at most the requests
    spread over its ranks), C over the contexts; prefill T up to its budget, C over the prompts. A
    prefill pool's decode grid and a decode pool's prefill grid (recomputation after preemption
    only) are one point at their smallest shape."""
    n_attn = pool.workers * pool.attn_ranks
    tp = pool.layout.tp
    most = max(1, min(pool.max_running, -(-req.n // n_attn)))
    lo = int(max(req.input_N.min(), 16))
    hi = int(max((req.input_N + req.output_N).max(), lo))
    p_hi = int(max(req.input_N.max(), lo))
    pre_hi = -(-min(pool.token_budget, int((req.input_N - req.hit_N).sum() // n_attn) + 1) // tp)
    g = {"dec_T": st.pow2_grid(1, -(-most // tp)), "dec_C": sorted({lo, int(np.sqrt(lo * hi)), hi}),
         "pre_T": [t for t in st.pow2_grid(16, max(pre_hi, 16)) if t == 16 or np.log2(t) % 2 == 0 or t >= pre_hi],
         "pre_C": sorted({lo, p_hi})}
    if pool.role == "prefill":
        g.update(dec_T=[1], dec_C=[lo])
    elif pool.role == "decode":
        g.update(pre_T=[max(16, min(pool.token_budget, p_hi) // tp)], pre_C=[p_hi])
    return g


def _cache_dir(opts: ServeOptions) -> Path | None:
    if opts.cache is None:
        return None
    return Path(opts.cache)


def default_cache() -> str:
    """``$MOONEP_SIM_CACHE`` or ``$XDG_CACHE_HOME/moonep-sim`` (``~/.cache/moonep-sim``), + ``/steptime``."""
    base = os.environ.get("MOONEP_SIM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moonep-sim")
    return os.path.join(base, "steptime")


def pool_steptime(pool: Pool, req: Requests, model: ModelSpec, topo: Any, opts: ServeOptions,
                  progress: Callable[[str, int, int], None] | None = None,
                  grid: Mapping[str, list[int]] | None = None) -> tuple[dict[str, Any], dict]:
    """One pool's step-time model per strategy and its held-out errors (from the cache when there);
    ``grid``: the shapes to build it over (default :func:`grid_for` the pool)."""
    g = dict(grid) if grid is not None else grid_for(pool, req)
    return build_steptimes([(pool, g)], model, topo, opts, progress)[0]


def _cache_path(pool: Pool, g: Mapping[str, list[int]], model: ModelSpec, topo: Any, opts: ServeOptions
                ) -> tuple[str, Path | None]:
    lay = {k: v for k, v in pool.layout.to_dict().items() if k in ("tp", "dp", "ep", "etp", "dp_attention")}
    key = st.cache_key({"role": pool.role, "layout": lay, "model": dataclasses.asdict(model) if
                        dataclasses.is_dataclass(model) else str(model),
                        "topology": repr(topo), "ranks": pool.layout.world, "strategies": list(opts.strategies),
                        "routing": str(opts.routing), "routing_mtime": _mtime(opts.routing), "overlap": opts.overlap,
                        "draws": opts.draws, "distinct": opts.distinct_layers, "seed": opts.seed, "grid": dict(g),
                        "holdout": opts.holdout, "gemm_dtype": opts.gemm_dtype, "measured": _measured_key(topo)})
    folder = _cache_dir(opts)
    return key, (folder / f"{key}.npz" if folder else None)


_SIMS: dict[str, Callable] = {}


def _grid_job(job: tuple) -> Any:
    """One piece of a step-time model (a worker process's job): ``(spec, mode, (Ts, Cs, d))`` -> that
    mode's grid on draw d per strategy; ``(spec, "holdout", points)`` -> the direct step times there.
    ``spec``: :func:`step_simulator`'s arguments."""
    spec, what, arg = job
    k = repr(spec)
    if k not in _SIMS:      # one simulator per pool in a process (its resolved scenario, its last routing)
        _SIMS.clear()
        _SIMS[k] = step_simulator(*spec)
    sim = _SIMS[k]
    if what == "holdout":
        return [sim(m, t, c, 0) for m, t, c in arg]
    Ts, Cs, d = arg
    return st.grid_piece(sim, spec[3], Ts, Cs, what, d)


def build_steptimes(items: Sequence[tuple[Pool, Mapping[str, list[int]]]], model: ModelSpec, topo: Any,
                    opts: ServeOptions, progress: Callable[[str, int, int], None] | None = None
                    ) -> list[tuple[dict[str, Any], dict]]:
    """Each (pool, grid)'s step-time model per strategy and its held-out errors, from the cache when
    there; the rest built in pieces -- one per (pool, mode, draw) and the held-out shapes of each
    pool -- in ``opts.jobs`` processes (every piece's step simulations are independent)."""
    from moonep_sim.experiments.parallel import run_points

    out: list[Any] = [None] * len(items)
    todo, jobs = [], []
    for n, (pool, g) in enumerate(items):
        key, path = _cache_path(pool, g, model, topo, opts)
        info = {"cache_key": key, "cache": str(path) if path else None, "grid": dict(g), "draws": opts.draws}
        got = st.load(path) if path is not None else None
        if got is not None:
            out[n] = (got[0], dict(info, cached=True, build_s=0.0, holdout=got[1]))
            continue
        spec = (opts.scenario, model, pool.layout.world, tuple(opts.strategies), opts.overlap, opts.distinct_layers,
                opts.seed, opts.gemm_dtype, pool.layout)
        zero = lambda Ts, Cs: {s: np.zeros((len(Ts), len(Cs))) for s in opts.strategies}
        shape = st.assemble(opts.strategies, g["dec_T"], g["dec_C"], g["pre_T"], g["pre_C"],
                            [zero(g["dec_T"], g["dec_C"])], [zero(g["pre_T"], g["pre_C"])])
        points = st.holdout_points(next(iter(shape.values())), opts.holdout, opts.seed)
        first = len(jobs)
        for d in range(opts.draws):
            jobs += [(spec, "decode", (g["dec_T"], g["dec_C"], d)), (spec, "prefill", (g["pre_T"], g["pre_C"], d))]
        jobs.append((spec, "holdout", points))
        todo.append((n, path, info, g, points, first))
    if not todo:
        return out
    require(opts.scenario is not None, "a serving run needs its scenario (routing, topology, strategies) to "
                                       "simulate steps")
    t0, c0, ch0 = time.perf_counter(), time.process_time(), os.times()
    cb = (lambda label, a, b: progress("step-time grid pieces", a, b)) if progress else None
    res = run_points(_grid_job, jobs, jobs=max(int(opts.jobs), 1), progress=cb,
                     label=lambda j: f"{j[1]} grid of {j[0][8].label() if j[0][8] is not None else j[0][2]} GPUs")
    ch1 = os.times()
    build_s = time.perf_counter() - t0
    build_cpu = time.process_time() - c0 + (ch1.children_user - ch0.children_user) + (ch1.children_system -
                                                                                       ch0.children_system)
    for n, path, info, g, points, first in todo:
        D = opts.draws
        models = st.assemble(opts.strategies, g["dec_T"], g["dec_C"], g["pre_T"], g["pre_C"],
                             [res[first + 2 * d] for d in range(D)], [res[first + 2 * d + 1] for d in range(D)])
        hold = st.holdout_error(models, None, points, direct=res[first + 2 * D])
        info.update(cached=False, build_s=build_s, build_cpu_s=build_cpu, built_with=len(todo))
        if path is not None:
            try:
                st.save(path, models, hold)
            except (OSError, ConfigError) as e:  # a read-only home or cache folder: the run goes on, uncached
                import sys

                why = str(e) if isinstance(e, ConfigError) else f"{path.parent}: {e.strerror}"
                print(f"moonep-sim: warning: step-time cache not written ({why}); set MOONEP_SIM_CACHE or --cache to "
                      "a writable folder to keep it", file=sys.stderr, flush=True)
                info["cache"] = None
        out[n] = (models, dict(info, holdout=hold))
    return out


def _measured_key(topo: Any) -> str | None:
    """Which measured GEMM tables the step model reads for ``topo`` (part of the cache key)."""
    from moonep_sim.step.measured import load_measured

    m = load_measured(topo)
    return None if m is None else f"{m.system}:{m.how}"


def _mtime(routing: str) -> float | None:
    if str(routing).startswith("gen:"):
        return None
    try:
        return os.stat(routing).st_mtime
    except OSError:
        return None


def workers_for(dep: Deployment, kv: Mapping[str, int], times: Mapping[str, Any], model: ModelSpec,
                topo: Any) -> list[Worker]:
    """The deployment's workers, each with its pool's step-time model (``times[role]``)."""
    out = []
    expert_bytes = 3.0 * model.dispatch_hidden * model.expert_ffn * dep.weight_bytes
    # EPLB: every redundant slot (one per GPU and MoE layer) copied over the NIC (ASSUMED: every slot moves)
    eplb_us = model.moe_layers * expert_bytes / (topo.nic_bandwidth_GBps * topo.nic_efficiency * 1e3)
    for p in dep.pools:
        graphs = cuda_graph_sizes(p.max_running) if p.cuda_graphs and p.role != "prefill" else ()
        cfg = EngineConfig(max_running=p.max_running, token_budget=max(p.token_budget, p.max_running *
                                                                       (1 + dep.mtp_tokens)),
                           kv_tokens=int(kv[p.role]), block=p.block, cuda_graphs=graphs, mtp_tokens=dep.mtp_tokens,
                           mtp_accept=dep.mtp_accept, mtp_draft_share=1.0 / model.layers,
                           eplb_every=dep.eplb_every, eplb_us=eplb_us if dep.eplb_every else 0.0,
                           policy=p.scheduler)
        tm = times[p.role] if p.layout.tp == 1 else _PerGPU(times[p.role], p.layout.tp)
        for j in range(p.workers):
            out.append(Worker(p.role, p.attn_ranks, p.layout.world, cfg, tm, f"{p.role}{j}"))
    return out


def kv_transfer(dep: Deployment, model: ModelSpec, topo: Any) -> Callable[[int], float]:
    """Seconds one prompt's KV takes from a prefill to a decode GPU: its bytes over one GPU's NIC
    at the topology's efficiency, plus the NIC latency."""
    per = kv_bytes_per_token(model, dep.pools[-1].layout, dep.kv_bytes)
    bw = topo.nic_bandwidth_GBps * topo.nic_efficiency * 1e9
    lat = topo.nic_latency_us * 1e-6
    return lambda n: n * per / bw + lat


def run_serve(reqs: Requests | Sequence[Requests], dep: Deployment, opts: ServeOptions,
              progress: Callable[[str, int, int], None] | None = None, loads: Sequence[str] | None = None,
              pools: Mapping[str, tuple[dict, dict]] | None = None) -> dict[str, Any]:
    """Every strategy's serving run on ``dep`` (see the module docstring), at each load (one
    :class:`Requests` each; the step-time grid comes from the first; ``pools``: role -> step-time
    models and their info built already, as a search shares them): the JSON document. Its
    ``strategies`` and ``verdict`` are the first load's; ``loads`` has every load's;
    ``points`` every (load, strategy) for the Pareto front; ``cdf`` the first load's latency
    quantiles."""
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.models import get_model

    reqs = [reqs] if isinstance(reqs, Requests) else list(reqs)
    loads = list(loads or [r.source for r in reqs])
    model = get_model(opts.model)
    topo = load_topology(opts.topology)
    kv = dep.check(model, topo.gpu_memory_GiB)
    t0, c0, ch0 = time.perf_counter(), time.process_time(), os.times()
    pools = dict(pools or {})
    need = [p for p in dep.pools if p.role not in pools]
    for p, got in zip(need, build_steptimes([(p, grid_for(p, reqs[0])) for p in need], model, topo, opts,
                                            progress)):
        pools[p.role] = got
    ch1 = os.times()
    build_s = time.perf_counter() - t0
    build_cpu = time.process_time() - c0 + (ch1.children_user - ch0.children_user) + (ch1.children_system -
                                                                                       ch0.children_system)
    err = [e["median_abs_rel_error"] for _, info in pools.values() for e in info["holdout"].values()
           if e and e.get("median_abs_rel_error") is not None]
    model_err = float(max(err)) if err else None
    out_loads, points, cdf = [], [], {}
    sim_s = sim_cpu = 0.0
    xfer = kv_transfer(dep, model, topo)
    for li, (req, load) in enumerate(zip(reqs, loads)):
        figs, runs = {}, {}
        for s in opts.strategies:
            times = {role: m[s] for role, (m, _) in pools.items()}
            if opts.direct:
                times = {p.role: _Direct(model, topo, p.layout.world, s, opts, p.layout) for p in dep.pools}
            ws = workers_for(dep, kv, times, model, topo)
            a, ac = time.perf_counter(), time.process_time()
            cb = (lambda i, n, s=s, load=load: progress(f"serving {s} at {load}", i, n)) if progress else None
            run = simulate(req, ws, kv_transfer_s=xfer, seed=opts.seed,
                           draw_order="resample" if str(opts.routing).startswith("gen:") else "in-order", progress=cb)
            sim_s += time.perf_counter() - a
            sim_cpu += time.process_time() - ac
            f = summarize(run, req.input_N, req.output_N, dep.gpus, opts.slo, opts.price)
            f["steptime_error"] = {role: {k: v for k, v in (info["holdout"].get(s) or {}).items() if k != "points"}
                                   for role, (_, info) in pools.items()}
            figs[s], runs[s] = f, run
            points.append({"load": load, "strategy": s, "deployment": dep.label(),
                           "output_tokens_per_s_per_gpu": f["output_tokens_per_s_per_gpu"],
                           "tokens_per_s_per_user": f["tokens_per_s_per_user"],
                           "slo_attainment": f["slo_attainment"], "ttft_p99_s": f["ttft_s"]["p99"],
                           "tpot_p99_s": f["tpot_s"]["p99"]})
            if li == 0:
                cdf[s] = _quantiles(run, req)
        v = serve_verdict(figs, opts.slo, _mechanism(runs, pools, opts), model_err)
        out_loads.append({"load": load, "requests": req.source, "strategies": figs, "verdict": v})
    return {"kind": "serve",
            "setup": {"model": model.name, "topology": topo.name, "gpus": dep.gpus, "deployment": dep.to_dict(),
                      "deployment_label": dep.label(), "requests": reqs[0].source, "n_requests": reqs[0].n,
                      "loads": loads, "routing": str(opts.routing), "overlap": opts.overlap, "draws": opts.draws,
                      "distinct_layers": opts.distinct_layers, "direct": opts.direct,
                      "kv_tokens_per_rank": dict(kv), "seed": opts.seed, "slo": dict(opts.slo),
                      "gpu_hour_price": opts.price},
            "strategies": out_loads[0]["strategies"], "verdict": out_loads[0]["verdict"], "loads": out_loads,
            "points": points, "cdf": cdf, "steptime_model_error": model_err,
            "steptime": {role: info for role, (_, info) in pools.items()},
            "timing": {"steptime_build_s": build_s, "steptime_build_cpu_s": build_cpu, "serve_s": sim_s,
                       "serve_cpu_s": sim_cpu},
            "flags": [{"code": c, "text": t} for c, t in _flags(dep, opts, model)]}


def _quantiles(run: Any, req: Requests, q: int = 101) -> dict[str, list[float]]:
    """TTFT, TPOT and E2E at ``q`` evenly spaced quantiles (the CDF the report plots)."""
    ps = np.linspace(0, 100, q)
    fin = ~np.isnan(run.finish_s)
    multi = fin & (req.output_N > 1)
    tpot = ((run.finish_s - run.first_s) / np.maximum(req.output_N - 1, 1))[multi]
    out = {"percent": ps.tolist()}
    for k, v in (("ttft_s", (run.first_s - run.arrival_s)[fin]), ("tpot_s", tpot),
                 ("e2e_s", (run.finish_s - run.arrival_s)[fin])):
        out[k] = np.percentile(v, ps).tolist() if v.size else []
    return out


def scenario_serve(sc: Any, deployment: Any, requests: Requests | str | None = None, *, rate: float | None = None,
                   concurrency: int = 0, n: int = 1000, isl: Any = 1024, osl: Any = 1024, slo: Any = None,
                   price: float | None = None, progress: Callable[[str, int, int], None] | None = None,
                   **options: Any) -> dict[str, Any]:
    """:meth:`Scenario.serve`: the scenario's model, topology, strategies and routing (a generator
    spec or a trace path); ``requests`` (a :class:`Requests` or a JSONL path) or ``n`` generated at
    ``rate`` / ``concurrency``; ``slo`` as ``"ttft=200ms,tpot=50ms"`` or a dict in seconds;
    ``options``: the other :class:`ServeOptions` fields."""
    from moonep_sim.experiments.routing import GeneratorSpec
    from moonep_sim.serve.deployment import deployment_from_dict, read_deployment
    from moonep_sim.serve.metrics import parse_slo
    from moonep_sim.serve.requests import read_request_trace, synthetic

    rs = sc.resolved
    dep = deployment if isinstance(deployment, Deployment) else (
        deployment_from_dict(deployment) if isinstance(deployment, Mapping) else read_deployment(deployment))
    if isinstance(requests, Requests):
        req = requests
    elif requests is not None:
        req = read_request_trace(requests)
    else:
        req = synthetic(n, isl, osl, options.get("seed", 0), rate=rate if not concurrency else None,
                        concurrency=concurrency)
    r = sc.routing
    routing = ("gen:" + r.text() if isinstance(r, GeneratorSpec) else str(r))
    names = tuple(n_ for n_, _ in rs.strategies)
    opts = ServeOptions(model=rs.source.model.name, topology=rs.topology.name if not str(sc.topology).endswith(".toml")
                        else str(sc.topology), strategies=names, routing=routing,
                        slo=parse_slo(slo) if isinstance(slo, str) or slo is None else dict(slo), price=price,
                        scenario=sc, **options)
    return run_serve(req, dep, opts, progress)


class _Direct:
    """Every distinct iteration shape simulated by the step model itself (``--direct``), memoised."""

    def __init__(self, model: ModelSpec, topo: Any, R: int, strategy: str, opts: ServeOptions, layout: Any = None
                 ) -> None:
        self.sim = step_simulator(opts.scenario, model, R, [strategy], opts.overlap, opts.distinct_layers, opts.seed,
                                  opts.gemm_dtype, layout)
        self.s, self.draws, self.memo = strategy, opts.draws, {}

    def _t(self, mode: str, T: int, C: int, d: int) -> float:
        k = (mode, T, int(C), d)
        if k not in self.memo:
            self.memo[k] = self.sim(mode, T, max(int(C), 1), d)[self.s]
        return self.memo[k]

    def time_us(self, n_pre: int, c_pre: float, n_dec: int, c_dec: float, draw: int = 0) -> float:
        if n_pre > 0:
            return self._t("prefill", n_pre + n_dec, max(int(c_pre), n_pre + n_dec), draw)
        return self._t("decode", n_dec, c_dec, draw)


def _mechanism(runs: Mapping[str, Any], pools: Mapping[str, Any], opts: ServeOptions) -> dict[str, str]:
    """Per strategy, why it differs: its step time at the run's typical decode shape (the busiest
    rank's median decoding sequences and context) against the others'."""
    out = {}
    role = "decode" if "decode" in pools else "both"
    models = pools[role][0]
    any_run = next(iter(runs.values()))
    w = any_run.it_shape
    dec = w[(w[:, 0] == 0) & (w[:, 2] > 0)]
    if not len(dec):
        return out
    n, c = float(np.median(dec[:, 2])), float(np.median(dec[:, 3]))
    t = {s: models[s].time_us(0, 0.0, int(n), c, 0) for s in opts.strategies}
    for s in opts.strategies:
        others = ", ".join(f"{o} {t[o] / 1e3:.1f} ms" for o in opts.strategies if o != s)
        out[s] = (f"its decode iteration at the run's median shape ({n:.0f} sequences/rank, context {c:.0f}) takes "
                  f"{t[s] / 1e3:.1f} ms against {others} (step model, draw 0)")
    return out


def _flags(dep: Deployment, opts: ServeOptions, model: ModelSpec) -> list[tuple[str, str]]:
    f = [("barrier", "every rank of a worker charged the busiest attention rank's shape (the barrier waits for it); "
                     "pure-EP workers priced by the pure-EP step over their GPUs"),
         ("mixed-iteration", "mixed prefill/decode iterations: the prefill step of all tokens + the decodes' extra KV "
                             "reads (ASSUMED)"),
         ("memory", f"weights at {dep.weight_bytes:g} B/element, KV at {dep.kv_bytes:g} B/element, "
                    f"{dep.mem_fraction:g} of HBM (ASSUMED)"),
         ("steptime-model", "iterations priced by an interpolated step-time model; its held-out error is under "
                            "steptime_error" if not opts.direct else
                            "--direct: every iteration shape simulated by the step model (no interpolation)")]
    if opts.distinct_layers <= 1:
        f.append(("shared-layer-draw", "every MoE layer of a step shares its routing draw (--distinct-layers 1): the "
                                       "per-iteration skew is exaggerated against independent layers"))
    for p in dep.pools:
        if p.layout.tp > 1 or p.layout.ep != p.layout.world or p.layout.etp > 1:
            f.append(("layout-step", f"{p.role}: {p.layout.label()} priced by the step model's layout step (TP "
                                     "collectives exposed, one EP group planned; docs/steps.md)"))
    for p in dep.pools:
        if p.role == "both":
            pol = get_policy(p.scheduler)
            f.append(("scheduler", f"{p.scheduler} scheduler ({pol.engines}): " + (
                "prompt chunks ride in decode iterations" if pol.mixes else
                "an iteration runs prompt chunks or decodes, never both; decodes wait for each prefill step")))
    if dep.mtp_tokens:
        f.append(("mtp", f"MTP: {dep.mtp_tokens} draft token(s), acceptance {dep.mtp_accept:g}, draft pass = "
                         f"1/{model.layers} of a step (ASSUMED)"))
    if dep.eplb_every:
        f.append(("eplb-copy", f"EPLB every {dep.eplb_every} iterations: one expert slot per GPU and MoE layer copied "
                               "over the NIC (ASSUMED)"))
    return f


__all__ = ["DEFAULT_GEN", "ServeOptions", "build_steptimes", "default_cache", "grid_for", "kv_transfer", "pool_steptime",
           "run_serve",
           "scenario_serve",
           "step_simulator", "workers_for"]
