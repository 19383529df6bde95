"""A deployment search: every deployment of a GPU budget that fits, simulated per strategy.

Notation: N GPUs, W GPUs of a worker, G GPUs per node.

:func:`enumerate_deployments` lists, for ``N`` GPUs: aggregated deployments of ``N / W`` workers
of ``W`` GPUs (W a power of two from G/2... N: data-parallel attention with EP over the worker,
and for one-node workers attention TP over the node as well), and disaggregated ones with a
prefill pool of a quarter, half or three quarters of the GPUs and the rest decoding; each with
running-sequence limits per rank of 8 to 256 and (prefill) chunk budgets of 4096 / 8192; those that do not
fit in memory are dropped, and at most ``max_deployments`` are kept (evenly spread over the list).

:func:`search` builds one step-time model per distinct worker size over the widest grid any
candidate needs (shared, cached), runs every (deployment, strategy) through the engine (``jobs``
worker processes or a Dask ``cluster``), and reports the Pareto front (tokens/s per user against
output tokens/s per GPU) and the best deployment under the SLO per strategy (the highest
goodput), with the command that reproduces each point; where the best deployments of two
strategies differ it says why (each strategy's decode step time on both deployments' shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from moonep_sim.errors import ConfigError
from moonep_sim.serve.deployment import Deployment, Pool
from moonep_sim.serve.metrics import pareto, summarize
from moonep_sim.serve.requests import Requests
from moonep_sim.step.parallel import Parallel

RUNNING = (8, 16, 32, 64, 128, 256)
BUDGETS = (4096, 8192)


def _layouts(W: int, G: int) -> list[Parallel]:
    out = [Parallel(dp=W, ep=W, dp_attention=True)]
    if W <= G and W > 1:
        out.append(Parallel(tp=W, ep=W))
    return out


def enumerate_deployments(model: Any, gpu_memory_GiB: float, gpus: int, gpus_per_node: int,
                          max_deployments: int = 100) -> list[Deployment]:
    """Deployments of ``gpus`` GPUs that fit (see the module docstring)."""
    G = gpus_per_node
    sizes = [w for w in (2 ** k for k in range(0, 12)) if max(G // 2, 1) <= w <= gpus and gpus % w == 0]
    cands: list[Deployment] = []
    for W in sizes:
        for lay in _layouts(W, G):
            for run in RUNNING:
                for bud in BUDGETS:
                    cands.append(Deployment((Pool("both", gpus // W, lay, run, bud),), source="search"))
    for frac in (0.25, 0.5, 0.75):
        P = int(gpus * frac)
        D = gpus - P
        for Wp in (w for w in sizes if P % w == 0 and w <= P):
            for Wd in (w for w in sizes if D % w == 0 and w <= D):
                for run, bud in ((r, b) for r in RUNNING for b in BUDGETS):
                    cands.append(Deployment((Pool("prefill", P // Wp, Parallel(dp=Wp, ep=Wp, dp_attention=True), 64,
                                                  bud),
                                             Pool("decode", D // Wd, Parallel(dp=Wd, ep=Wd, dp_attention=True), run,
                                                  max(8192, run))), source="search"))
    fit = []
    for d in cands:
        try:
            d.check(model, gpu_memory_GiB, gpus)
            fit.append(d)
        except ConfigError:
            continue
    if len(fit) > max_deployments:
        idx = np.unique(np.linspace(0, len(fit) - 1, max_deployments).round().astype(int))
        fit = [fit[i] for i in idx]
    return fit


def _pool_flags(p: Pool) -> str:
    lay = p.layout
    kv = [f"workers={p.workers}", f"tp={lay.tp}", f"dp={lay.dp}", f"ep={lay.ep}",
          f"dp_attention={'true' if lay.dp_attention else 'false'}", f"max_running={p.max_running}",
          f"token_budget={p.token_budget}"] + ([f"scheduler={p.scheduler}"] if p.scheduler != "mixed" else [])
    return ",".join(kv)


def command(dep: Deployment, strategy: str, argv: Sequence[str]) -> str:
    """The ``moonep-sim serve`` command that reproduces one search point."""
    base = [a.replace("{strategy}", strategy) for a in argv]
    if dep.disaggregated:
        base += ["--prefill", _pool_flags(dep.pools[0]), "--decode", _pool_flags(dep.pools[1])]
    else:
        base += ["--worker", _pool_flags(dep.pools[0])]
    base += ["--gpus", str(dep.gpus)]
    return " ".join(f"'{a}'" if any(c in a for c in " ,=") and not a.startswith("--") else a for a in base)


@dataclasses.dataclass(frozen=True)
class _Point:
    """One (deployment, strategy) run: picklable for worker processes."""

    dep: Deployment
    strategy: str
    req: Requests
    opts: Any
    models: dict                # role -> GridStepTime of this strategy
    kv: dict


def _run_point(pt: _Point) -> dict[str, Any]:
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.experiments.serve import kv_transfer, workers_for
    from moonep_sim.models import get_model
    from moonep_sim.serve.engine import simulate

    model, topo = get_model(pt.opts.model), load_topology(pt.opts.topology)
    ws = workers_for(pt.dep, pt.kv, pt.models, model, topo)
    run = simulate(pt.req, ws, kv_transfer_s=kv_transfer(pt.dep, model, topo), seed=pt.opts.seed,
                   draw_order="resample" if str(pt.opts.routing).startswith("gen:") else "in-order")
    f = summarize(run, pt.req.input_N, pt.req.output_N, pt.dep.gpus, pt.opts.slo, pt.opts.price)
    w = run.it_shape
    dec = w[(w[:, 0] == 0) & (w[:, 2] > 0)]
    f["median_decode_shape"] = [float(np.median(dec[:, 2])), float(np.median(dec[:, 3]))] if len(dec) else None
    return f


def search(req: Requests, gpus: int, opts: Any, *, max_deployments: int = 100, jobs: int | None = 1,
           cluster: str | None = None, progress: Callable[[str, int, int], None] | None = None,
           load: str = "", argv: Sequence[str] = ()) -> dict[str, Any]:
    """The search (see the module docstring): the JSON document."""
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.experiments.parallel import run_points
    from moonep_sim.experiments.serve import build_steptimes, grid_for
    from moonep_sim.models import get_model
    from moonep_sim.serve import steptime as st

    model, topo = get_model(opts.model), load_topology(opts.topology)
    deps = enumerate_deployments(model, topo.gpu_memory_GiB, gpus, topo.gpus_per_node, max_deployments)
    if not deps:
        raise ConfigError(f"--search: no deployment of {gpus} GPUs fits {model.name} on {topo.name} "
                          f"({topo.gpu_memory_GiB:g} GiB GPUs)")
    # one model per worker size, over the widest grid any pool of that size needs
    grids: dict[Parallel, dict[str, list[int]]] = {}
    for d in deps:
        for p in d.pools:
            g = grid_for(dataclasses.replace(p, role="both"), req)
            a = grids.setdefault(p.layout, {k: [] for k in g})
            for k, v in g.items():
                a[k] = sorted(set(a[k]) | set(v))
    wide = {lay: dict(g, dec_T=st.pow2_grid(1, max(g["dec_T"])), dec_C=sorted({min(g["dec_C"]), max(g["dec_C"])}),
                      pre_C=sorted({min(g["pre_C"]), max(g["pre_C"])})) for lay, g in grids.items()}
    # every layout's model built together, its pieces over the worker processes
    built = build_steptimes([(Pool("both", 1, lay), g) for lay, g in wide.items()], model, topo,
                            dataclasses.replace(opts, jobs=jobs or 1) if not cluster else opts, progress)
    models: dict[Parallel, tuple[dict, dict]] = dict(zip(wide, built))
    points = []
    for d in deps:
        kv = d.check(model, topo.gpu_memory_GiB, gpus)
        for s in opts.strategies:
            points.append(_Point(d, s, req, dataclasses.replace(opts, scenario=None),
                                 {p.role: models[p.layout][0][s] for p in d.pools}, kv))
    if progress:
        progress(f"simulating {len(points)} (deployment, strategy) points", 0, len(points))
    res = run_points(_run_point, points, jobs=jobs, cluster=cluster, progress=None)
    rows = []
    for pt, f in zip(points, res):
        rows.append({"deployment": pt.dep.label(), "disaggregated": pt.dep.disaggregated, "strategy": pt.strategy,
                     "decode_layout": pt.dep.pools[-1].layout,
                     "gpus": pt.dep.gpus, "toml": pt.dep.to_toml(), "command": command(pt.dep, pt.strategy, argv),
                     "figures": f, "tokens_per_s_per_user": f["tokens_per_s_per_user"],
                     "output_tokens_per_s_per_gpu": f["output_tokens_per_s_per_gpu"],
                     "goodput_tokens_per_s_per_gpu": f["goodput_tokens_per_s_per_gpu"],
                     "slo_attainment": f["slo_attainment"]})
    front = {}
    best = {}
    for s in opts.strategies:
        mine = [i for i, r in enumerate(rows) if r["strategy"] == s and r["tokens_per_s_per_user"] is not None]
        xy = [(rows[i]["tokens_per_s_per_user"], rows[i]["output_tokens_per_s_per_gpu"]) for i in mine]
        front[s] = [mine[j] for j in pareto(xy)]
        key = (lambda i: (rows[i]["goodput_tokens_per_s_per_gpu"] or 0.0, rows[i]["output_tokens_per_s_per_gpu"])) \
            if opts.slo else (lambda i: (rows[i]["output_tokens_per_s_per_gpu"], 0.0))
        if mine:
            best[s] = max(mine, key=key)
    err = [e["median_abs_rel_error"] for _, info in models.values() for e in info["holdout"].values()
           if e and e.get("median_abs_rel_error") is not None]
    differs = _differs(rows, best, models, opts)
    for r in rows:
        r["decode_layout"] = r["decode_layout"].label()
    return {"kind": "serve_search", "setup": {"model": model.name, "topology": topo.name, "gpus": gpus,
                                              "requests": req.source, "load": load, "strategies": list(opts.strategies),
                                              "slo": dict(opts.slo), "routing": str(opts.routing),
                                              "deployments": len(deps), "points": len(rows)},
            "points": rows, "pareto": front, "best": best, "differs": differs,
            "steptime": {lay.label(): info for lay, (_, info) in models.items()},
            "steptime_model_error": float(max(err)) if err else None}


def _differs(rows: list[dict], best: dict[str, int], models: dict, opts: Any) -> list[dict[str, Any]]:
    """Pairs of strategies whose best deployments differ, and why: each one's goodput on the
    other's best, and both strategies' decode step times at each best deployment's median shape."""
    out = []
    names = list(best)
    idx = {(r["deployment"], r["strategy"]): i for i, r in enumerate(rows)}
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            ra, rb = rows[best[a]], rows[best[b]]
            if ra["deployment"] == rb["deployment"]:
                continue
            why = []
            for r in (ra, rb):
                o = {s_: rows[idx[(r["deployment"], s_)]]["figures"] for s_ in (a, b) if (r["deployment"], s_) in idx}
                if len(o) == 2:
                    why.append(f"on {r['deployment']}: p99 TTFT {a} {o[a]['ttft_s']['p99'] * 1e3:.0f} ms / {b} "
                               f"{o[b]['ttft_s']['p99'] * 1e3:.0f} ms, p99 TPOT {a} {o[a]['tpot_s']['p99'] * 1e3:.1f} ms / "
                               f"{b} {o[b]['tpot_s']['p99'] * 1e3:.1f} ms, SLO met {a} {o[a]['slo_attainment'] or 0:.0%} / "
                               f"{b} {o[b]['slo_attainment'] or 0:.0%}")
                sh = r["figures"].get("median_decode_shape")
                lay = r["decode_layout"]
                W = lay.ep
                if sh and lay in models:
                    t = {s: models[lay][0][s].time_us(0, 0.0, int(sh[0]), sh[1], 0) for s in (a, b)}
                    pre = {s: models[lay][0][s].time_us(4096, 1024.0, 0, 0.0, 0) for s in (a, b)}
                    why.append(f"its EP{W} step model: a decode step ({sh[0]:.0f} sequences/rank, context {sh[1]:.0f}) "
                               f"{t[a] / 1e3:.1f} ms with {a}, {t[b] / 1e3:.1f} ms with {b}; a 4096-token prefill chunk "
                               f"{pre[a] / 1e3:.0f} ms with {a}, {pre[b] / 1e3:.0f} ms with {b}")
            ga = rows[idx[(rb["deployment"], a)]]["goodput_tokens_per_s_per_gpu"] if (rb["deployment"], a) in idx else None
            gb = rows[idx[(ra["deployment"], b)]]["goodput_tokens_per_s_per_gpu"] if (ra["deployment"], b) in idx else None
            m = "goodput" if opts.slo else "output tokens/s/GPU"
            ka = "goodput_tokens_per_s_per_gpu" if opts.slo else "output_tokens_per_s_per_gpu"
            out.append({"strategies": [a, b], "best": [ra["deployment"], rb["deployment"]],
                        "text": (f"{a}'s best is {ra['deployment']} ({m} {ra[ka] or 0:.1f}), {b}'s is {rb['deployment']} "
                                 f"({rb[ka] or 0:.1f}); {a} on {b}'s best: {ga or 0:.1f}, {b} on {a}'s best: "
                                 f"{gb or 0:.1f}. " + "; ".join(why))})
    return out


__all__ = ["command", "enumerate_deployments", "search"]
