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

The step model times pure expert parallelism with data-parallel attention over a worker's GPUs
(what main's step model runs); a worker with attention TP is priced as its ``tp`` GPUs sharing
its tokens (tokens / tp per GPU, no TP all-reduce), flagged.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.serve import steptime as st
from moonep_sim.serve.deployment import Deployment, Pool, kv_bytes_per_token
from moonep_sim.serve.engine import EngineConfig, Worker, cuda_graph_sizes, simulate
from moonep_sim.serve.metrics import serve_verdict, summarize
from moonep_sim.serve.requests import Requests

#: default skew of generated routing: MoonEP's lognormal popularity sigma (the step's noise floor
#: makes maxvio meaningless at decode's few tokens per rank)
DEFAULT_GEN = "sigma=0.5"


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What a serving run needs besides the requests and the deployment: model, topology (name or
    path), strategies (names), routing (``gen:K=V,...`` or a trace path), overlap, draws, the
    grid's distinct MoE layers per step, the step-time cache folder (None: no cache), direct
    (every iteration simulated), the SLO (seconds), price per GPU-hour, seed, held-out shapes."""

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


class _PerGPU:
    """A step-time model of a TP x DP worker priced on its GPUs: tokens of an attention rank of
    ``tp`` GPUs spread over them (ceil(n / tp) each)."""

    def __init__(self, inner: Any, tp: int) -> None:
        self.inner, self.tp, self.draws = inner, tp, getattr(inner, "draws", 1)

    def time_us(self, n_pre: int, c_pre: float, n_dec: int, c_dec: float, draw: int = 0) -> float:
        d = lambda n: -(-int(n) // self.tp)
        return self.inner.time_us(d(n_pre), c_pre, d(n_dec), c_dec, draw)


def step_simulator(model: ModelSpec, topology: Any, ranks: int, strategies: Sequence[str], routing: str,
                   overlap: str, distinct: int, seed: int) -> Callable[[str, int, int, int], dict[str, float]]:
    """``simulate(mode, T, C, d)`` -> {strategy: step time us}: one step of the step model on ``ranks``
    GPUs (pure EP, attention DP) on draw ``d`` (see the module docstring)."""
    from moonep_sim.experiments.routing import GeneratorSpec
    from moonep_sim.experiments.scenario import Scenario
    from moonep_sim.experiments.step import layer_source
    from moonep_sim.plan import GlobalRouting
    from moonep_sim.step import StepConfig, simulate_step, step_shape
    from moonep_sim.step.costs import step_cost_model

    is_gen = str(routing).startswith("gen:")
    sc = Scenario(routing if is_gen else str(routing), model=model, cluster=ranks, topology=topology,
                  strategies=list(strategies))
    rs = sc.resolved
    src = rs.source
    costs = step_cost_model(rs.topology)
    steps = None
    if not is_gen:
        from moonep_sim.experiments.step import trace_steps

        steps = trace_steps(src)
        layers = list(src.layer_ids)[:max(distinct, 1)]
        rows = {l: src.selected_layer(l) for l in layers}

    def simulate(mode: str, T: int, C: int, d: int) -> dict[str, float]:
        shape = step_shape(model, mode, int(T), int(C))
        cfg = StepConfig(model, rs.topology, rs.ctx, rs.strategies, shape, overlap, costs)
        if is_gen:
            g = dataclasses.replace(src.gen, tokens_per_rank=int(T), seed=seed * 101 + d)
            source = layer_source(dataclasses.replace(src, gen=g), ranks, int(T), model.moe_layers, max(distinct, 1))
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
                  progress: Callable[[str, int, int], None] | None = None) -> tuple[dict[str, Any], dict]:
    """One pool's step-time model per strategy and its held-out errors (from the cache when there)."""
    R = pool.layout.world
    g = grid_for(pool, req)
    key = st.cache_key({"role": pool.role, "model": dataclasses.asdict(model) if dataclasses.is_dataclass(model) else str(model),
                        "topology": repr(topo), "ranks": R, "strategies": list(opts.strategies),
                        "routing": str(opts.routing), "routing_mtime": _mtime(opts.routing), "overlap": opts.overlap,
                        "draws": opts.draws, "distinct": opts.distinct_layers, "seed": opts.seed, "grid": g,
                        "holdout": opts.holdout})
    folder = _cache_dir(opts)
    path = folder / f"{key}.npz" if folder else None
    info = {"cache_key": key, "cache": str(path) if path else None, "grid": g, "draws": opts.draws}
    if path is not None:
        got = st.load(path)
        if got is not None:
            info.update(cached=True, build_s=0.0)
            return got[0], dict(info, holdout=got[1])
    sim = step_simulator(model, topo, R, opts.strategies, opts.routing, opts.overlap, opts.distinct_layers, opts.seed)
    t0, c0 = time.perf_counter(), time.process_time()
    cb = (lambda a, b: progress(f"step-time grid, {pool.role} pool", a, b)) if progress else None
    models = st.build_grid(sim, opts.strategies, g["dec_T"], g["dec_C"], g["pre_T"], g["pre_C"], opts.draws, cb)
    hold = st.holdout_error(models, sim, st.holdout_points(next(iter(models.values())), opts.holdout, opts.seed))
    info.update(cached=False, build_s=time.perf_counter() - t0, build_cpu_s=time.process_time() - c0)
    if path is not None:
        st.save(path, models, hold)
    return models, dict(info, holdout=hold)


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
                           eplb_every=dep.eplb_every, eplb_us=eplb_us if dep.eplb_every else 0.0)
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
              progress: Callable[[str, int, int], None] | None = None, loads: Sequence[str] | None = None
              ) -> dict[str, Any]:
    """Every strategy's serving run on ``dep`` (see the module docstring), at each load (one
    :class:`Requests` each; the step-time grid comes from the first): the JSON document. Its
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
    t0, c0 = time.perf_counter(), time.process_time()
    pools: dict[str, tuple[dict, dict]] = {}
    for p in dep.pools:
        pools[p.role] = pool_steptime(p, reqs[0], model, topo, opts, progress)
    build_s, build_cpu = time.perf_counter() - t0, time.process_time() - c0
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
                times = {p.role: _Direct(model, topo, p.layout.world, s, opts) for p in dep.pools}
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


class _Direct:
    """Every distinct iteration shape simulated by the step model itself (``--direct``), memoised."""

    def __init__(self, model: ModelSpec, topo: Any, R: int, strategy: str, opts: ServeOptions) -> None:
        self.sim = step_simulator(model, topo, R, [strategy], opts.routing, opts.overlap, opts.distinct_layers,
                                  opts.seed)
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
    f = [("barrier", "step model: pure EP with data-parallel attention over each worker's GPUs; every rank charged the "
                     "busiest attention rank's shape (the barrier waits for it)"),
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
        if p.layout.tp > 1:
            f.append(("attention-tp", f"{p.role}: attention TP{p.layout.tp} priced as its GPUs sharing the tokens (no "
                                      "TP all-reduce)"))
        if p.layout.ep != p.layout.world:
            f.append(("ep-world", f"{p.role}: EP{p.layout.ep} of {p.layout.world} GPUs priced as EP over all "
                                  f"{p.layout.world}"))
    if dep.mtp_tokens:
        f.append(("mtp", f"MTP: {dep.mtp_tokens} draft token(s), acceptance {dep.mtp_accept:g}, draft pass = "
                         f"1/{model.layers} of a step (ASSUMED)"))
    if dep.eplb_every:
        f.append(("eplb-copy", f"EPLB every {dep.eplb_every} iterations: one expert slot per GPU and MoE layer copied "
                               "over the NIC (ASSUMED)"))
    return f


__all__ = ["DEFAULT_GEN", "ServeOptions", "default_cache", "grid_for", "kv_transfer", "pool_steptime", "run_serve",
           "step_simulator", "workers_for"]
