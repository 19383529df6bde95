"""Sweep one knob and time every strategy at each value: imbalance (maxvio), EP size, or a
topology constant.

- ``maxvio``: MoonEP's methodology -- expert popularity ``p_e ∝ exp(N(0, sigma))``, sigma found by
  bisection to hit each target maxvio (default targets: :func:`default_values`, 0.2, 1, 10, 20
  where the model allows them), K distinct experts per token
  (:mod:`moonep_sim.routing.generators`); ``tokens_per_rank`` tokens on each of R ranks.
- ``ep``: EP sizes (ranks); every rank keeps ``tokens_per_rank`` tokens, the imbalance is fixed
  (``maxvio``, default 1).
- any numeric topology field (``nic_bandwidth_GBps``, ``nvlink_bandwidth_GBps``,
  ``fabric_oversubscription``, ``gpu_tflops`` ...): the routing is fixed, the constant varies.

Every point plans each strategy on the same routing (its own Plan) and simulates it; the report
keeps, per strategy and point, the layer time, the phases, the lower bound and their ratio, and
the topology constants used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

from moonep_sim.analysis.verdict import figures, sweep_verdicts
from moonep_sim.errors import ConfigError, require
from moonep_sim.io import to_jsonable
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.experiments.compare import _short, load_topology, topology_info
from moonep_sim.experiments.parallel import check_jobs, run_points
from moonep_sim.experiments.spec import normalise_dtype, parse_cluster, strategy_list

MAXVIO_TARGETS = (0.2, 1.0, 10.0, 20.0)
_MAXVIO_FILL = (5.0, 2.0, 0.5)  # taken, in this order, when a model's E/K rules out some targets
EP_SIZES = (8, 16, 32, 64)


def maxvio_targets(model: ModelSpec) -> list[float]:
    """Four maxvio targets the model can reach: MAXVIO_TARGETS up to 0.8 x (E/K - 1) (an expert
    takes at most one selection per token, so maxvio <= E/K - 1, and targets close to it need
    every token to pick the hottest expert), filled with 5, 2, 0.5 when some are out of reach."""
    cap = 0.8 * (model.num_experts / model.top_k - 1)
    vals = [v for v in MAXVIO_TARGETS if v <= cap]
    for v in _MAXVIO_FILL:
        if len(vals) >= len(MAXVIO_TARGETS):
            break
        if v <= cap and v not in vals:
            vals.append(v)
    return sorted(vals)


def noise_floor(model: ModelSpec, tokens: int, seed: int = 0) -> float:
    """The maxvio of a uniform-popularity draw of ``tokens`` tokens (the sampling-noise floor: no
    generated target below it is reachable at this size)."""
    from moonep_sim.routing.generators import generate_layer
    from moonep_sim.routing.metrics import maxvio

    lr = generate_layer(model.num_experts, model.top_k, int(tokens), seed, uniform=True)
    return float(maxvio(lr.counts_E()))


def default_values(over: str, model: ModelSpec, topology: str | None = None, *, tokens: int | None = None,
                   left_out: list | None = None) -> list[float]:
    """The default values of a sweep over ``over`` (maxvio: :func:`maxvio_targets`, without those
    below the sampling-noise floor of ``tokens`` tokens -- appended to ``left_out`` with the
    reason; ep: the EP sizes that divide E); a topology constant has no default."""
    if over == "maxvio":
        vals = maxvio_targets(model)
        if tokens:
            floor = noise_floor(model, tokens)
            low = [v for v in vals if v <= 1.25 * floor]
            for v in low:
                if left_out is not None:
                    left_out.append({"value": v, "reason": f"below the sampling-noise floor (a uniform draw of {tokens} "
                                                           f"tokens already has maxvio {floor:.3g})"})
            vals = [v for v in vals if v not in low] or [round(2 * floor, 2)]
        return vals
    if over == "ep":
        return [float(v) for v in EP_SIZES if model.num_experts % v == 0] or [1.0]
    if topology is not None:
        params = topology_params(load_topology(topology))
        if over not in params:
            raise ConfigError(f"--over ({over!r}) must be maxvio, ep or a topology constant: {', '.join(params)}")
    raise ConfigError(f"--values must be given when sweeping a topology constant ({over})")


@dataclass(frozen=True)
class SweepAxis:
    """The knob a sweep varies and its values; everything else is the :class:`Scenario
    <moonep_sim.experiments.Scenario>` the sweep runs (see :func:`axis`).

    over: ``maxvio``, ``ep`` or a numeric topology constant.  values: the points.  maxvio: the
    imbalance held when ``over`` is not maxvio (None: the scenario's generator spec's, else 1).
    left_out: default values left out, each ``{"value", "reason"}``.
    """

    over: str
    values: tuple[float, ...]
    maxvio: float | None = None
    left_out: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Setup:
    """A generated sweep's scenario read once (:func:`setup`): the model, the generator spec, the
    loaded base topology, the parsed strategies, the cluster (``gpus_per_node`` 0: the topology's
    per point), row costs and placement, and the axis. What every point's task carries."""

    model: ModelSpec
    spec: Any
    topology: Any
    strategies: tuple[tuple[str, dict[str, Any]], ...]
    ranks: int
    gpus_per_node: int
    maxvio: float
    dispatch_dtype: str
    token_padding: int
    costs: RowCosts
    placement: str
    axis: SweepAxis


def generator_spec(sc) -> Any:
    """The scenario's generator spec (a sweep generates routing at every point)."""
    from moonep_sim.experiments.routing import GeneratorSpec

    r = sc.routing
    spec = r if isinstance(r, GeneratorSpec) else (
        GeneratorSpec.parse(r) if isinstance(r, str) and r.startswith("gen:") else None)
    require(spec is not None, f"sweep routing ({r!r}) must be a generator spec (gen:model=...): "
                              "a sweep generates routing at every point")
    return spec


def axis(sc, over: str, values: Sequence[float] | None = None, *, maxvio: float | None = None) -> SweepAxis:
    """The axis of a generated sweep of scenario ``sc`` over ``over`` (``ranks`` = ``ep``); default
    values: :func:`default_values` (those left out named)."""
    spec = generator_spec(sc)
    over = {"ranks": "ep"}.get(over, over)
    left_out: list = []
    R, _ = parse_cluster(sc.cluster)
    vals = list(values) if values is not None else default_values(
        over, spec.resolve_model(sc.model), sc.topology, tokens=spec.tokens_per_rank * (R or 64), left_out=left_out)
    return SweepAxis(over, tuple(float(v) for v in vals), None if maxvio is None else float(maxvio), tuple(left_out))


def setup(sc, ax: SweepAxis) -> Setup:
    """Scenario ``sc`` read once for a sweep along ``ax``: the strategies parsed, the topology
    loaded, the model resolved (default ranks: 64; GPUs per node: the scenario's, else the
    topology's at each point); checked (:func:`check`) before any work."""
    spec = generator_spec(sc)
    model = spec.resolve_model(sc.model)
    strategies = tuple((n, dict(o)) for n, o in strategy_list(sc.strategies, sc.options))
    R, G = parse_cluster(sc.cluster)
    topo = load_topology(sc.topology)
    mv = ax.maxvio if ax.maxvio is not None else float(spec.popularity().get("maxvio", 1.0))
    dtype = normalise_dtype(sc.dispatch_dtype)
    st = Setup(model, spec, topo, strategies, R or 64, G or 0, float(mv), dtype, int(sc.token_padding),
               sc.costs or RowCosts.from_model(model, dtype), sc.placement, ax)
    check(st)
    return st


def topology_params(topo) -> list[str]:
    """Numeric topology constants that ``--over`` may name."""
    return [f.name for f in fields(topo) if f.type in (float, int, "float", "int") and f.name != "nodes"]


def check(cfg: Setup) -> Any:
    """Validate everything before any work; returns the loaded base topology."""
    from moonep_sim.experiments.checks import check_axis_value, check_axis_values

    m, topo = cfg.model, cfg.topology
    hi = m.num_experts / m.top_k - 1
    check_axis_values(cfg.axis.over, cfg.axis.values, topo)  # each value as the flag it stands for
    check_axis_value("tokens-per-rank", cfg.spec.tokens_per_rank, flag="--tokens-per-rank")
    if cfg.axis.over == "maxvio":
        for v in cfg.axis.values:
            require(0 < v <= hi, f"maxvio ({v:g}) must lie in (0, E/K-1 = {hi:g}] for {m.name} (E={m.num_experts}, "
                                 f"K={m.top_k})")
        sizes = [cfg.ranks]
    elif cfg.axis.over == "ep":
        sizes = [int(v) for v in cfg.axis.values]
        for v in cfg.axis.values:
            require(v == int(v) and v >= 1, f"EP size ({v:g}) must be a positive integer")
    else:
        params = topology_params(topo)
        require(cfg.axis.over in params, f"--over ({cfg.axis.over!r}) must be maxvio, ep or a topology constant: "
                                    f"{', '.join(params)}")
        sizes = [cfg.ranks]
        for v in cfg.axis.values:
            replace(topo, **{cfg.axis.over: type(getattr(topo, cfg.axis.over))(v)})  # the topology checks the value
    for R in sizes:
        require(m.num_experts % R == 0,
                f"EP size ({R}) must divide {m.name}'s expert count (E={m.num_experts}): each rank owns E/R experts")
        g = cfg.gpus_per_node or topo.gpus_per_node_for(R)
        require(R % g == 0, f"EP size ({R}) must be divisible by gpus per node ({g})")
    if cfg.axis.over != "maxvio":
        require(0 < cfg.maxvio <= hi, f"--maxvio ({cfg.maxvio:g}) must lie in (0, {hi:g}] for {m.name}")
    return topo


def _routing(cfg: Setup, ranks: int, maxvio: float):
    from moonep_sim.routing.generators import generate_layer
    from moonep_sim.routing.metrics import maxvio as maxvio_of

    m = cfg.model
    extra = {"groups": m.n_groups, "topk_groups": m.topk_groups} if m.n_groups > 1 else {}
    lr = generate_layer(m.num_experts, m.top_k, cfg.spec.tokens_per_rank * ranks, cfg.spec.seed, maxvio=maxvio, **extra)
    gr = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, m.num_experts, ranks)
    return gr, float(maxvio_of(gr.counts_E()))


def routing_lower_bound(strategies: dict[str, dict[str, list]], points: int) -> list[float]:
    """Per point, the smallest lower bound among the strategies that drop no token (a strategy that
    drops tokens has less work to bound); all strategies if every one drops."""
    out = []
    for i in range(points):
        keep = [s["lower_bound_us"][i] for s in strategies.values() if s["dropped"][i] == 0]
        out.append(min(keep or [s["lower_bound_us"][i] for s in strategies.values()]))
    return out


def _point_setup(cfg: Setup, base, v: float, fixed):
    """One sweep value's ranks, topology, routing and plan context, and its report entry."""
    from moonep_sim.strategies import PlanContext

    m = cfg.model
    ranks = int(v) if cfg.axis.over == "ep" else cfg.ranks
    topo = replace(base, **{cfg.axis.over: type(getattr(base, cfg.axis.over))(v)}) if cfg.axis.over not in ("maxvio", "ep") else base
    routing, realised = fixed if fixed is not None else _routing(cfg, ranks, v if cfg.axis.over == "maxvio" else cfg.maxvio)
    g = cfg.gpus_per_node or topo.gpus_per_node_for(ranks)
    cluster = ClusterShape(ranks, g)
    topo_g = topo.with_gpus_per_node(g) if hasattr(topo, "with_gpus_per_node") else topo
    place = (Placement.home_groups(m.num_experts, ranks) if cfg.placement == "home"
             else Placement.round_robin(m.num_experts, ranks))
    ctx = PlanContext(cluster, place, cfg.costs, cfg.token_padding, topo_g)
    point = {"value": v, "ranks": ranks, "gpus_per_node": g, "tokens": routing.num_tokens,
             "realised_maxvio": realised, "topology": topology_info(topo_g)}
    return routing, ctx, topo_g, point


def _strategy_at(cfg: Setup, routing, ctx, topo, name: str, opts: dict) -> dict[str, Any]:
    """One strategy planned and simulated on one point's routing."""
    from moonep_sim.sim import simulate_layer
    from moonep_sim.strategies import make_plan

    t1 = time.perf_counter()
    plan = make_plan(name, routing, ctx, **opts)
    t2 = time.perf_counter()
    res = simulate_layer(plan, topo, cfg.model)
    t3 = time.perf_counter()
    real = plan.real_rows_R()
    wb = plan.weight_copies * plan.costs.weight_bytes + int(plan.migrate_expert_X.size) * plan.costs.weight_bytes
    return {"layer_time_us": float(res.layer_time_us), "lower_bound_us": float(res.lower_bound_us),
            "ratio_to_lower_bound": float(res.ratio_to_lower_bound),
            "phases_us": {k: float(x) for k, x in dict(res.phases_us).items()},
            "dropped": plan.dropped, "weight_bytes": int(wb),
            "rows_max_over_mean": float(real.max() / max(real.mean(), 1e-12)),
            "straggler": _short(to_jsonable(res.to_dict(), lenient=True).get("straggler")),
            "plan_seconds": t2 - t1, "sim_seconds": t3 - t2,
            "figures": figures(plan, to_jsonable(res.to_dict(), lenient=True), topo)}


def _point(task) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One sweep value: routing, then every strategy planned and simulated (one task: the serial
    and Dask paths)."""
    cfg, base, v, fixed = task
    routing, ctx, topo, point = _point_setup(cfg, base, v, fixed)
    return point, {name: _strategy_at(cfg, routing, ctx, topo, name, opts) for name, opts in cfg.strategies}


# The worker-process path runs in two stages: every value's routing (one task per value), then one
# task per (value, strategy). Routing generation costs differ a lot between values (a low maxvio
# target needs several calibration samples), so whole-value tasks leave one worker idle at the
# end; the finer second stage balances. Its workers are forked after the first stage and read the
# routings from this module (copy-on-write), so no routing is pickled per task.
_SETUPS: list = []


def _setup_task(task):
    cfg, base, v, fixed = task
    routing, _, _, point = _point_setup(cfg, base, v, fixed)
    return routing, point["realised_maxvio"]


def _strategy_task(task) -> dict[str, Any]:
    cfg, i, name, opts = task
    routing, ctx, topo, _ = _SETUPS[i]
    return _strategy_at(cfg, routing, ctx, topo, name, opts)


def _run_staged(cfg: Setup, base, fixed, jobs: int | None, progress) -> list:
    if fixed is None:
        routings = run_points(_setup_task, [(cfg, base, v, None) for v in cfg.axis.values], jobs=jobs,
                              progress=progress, label=lambda t: f"{cfg.axis.over}={t[2]:g} routing")
    else:
        routings = [fixed] * len(cfg.axis.values)
    _SETUPS[:] = [_point_setup(cfg, base, v, fixed) for v, fixed in zip(cfg.axis.values, routings)]
    try:
        tasks = [(cfg, i, name, opts) for i in range(len(cfg.axis.values)) for name, opts in cfg.strategies]
        per = run_points(_strategy_task, tasks, jobs=jobs, progress=progress,
                         label=lambda t: f"{cfg.axis.over}={cfg.axis.values[t[1]]:g} {t[2]}")
        n = len(cfg.strategies)
        return [(_SETUPS[i][3], {name: per[i * n + j] for j, (name, _) in enumerate(cfg.strategies)})
                for i in range(len(cfg.axis.values))]
    finally:
        _SETUPS.clear()


def sweep(sc, ax: SweepAxis, progress: Callable[[str, int, int], None] | None = None, *, jobs: int | None = 1,
          cluster: str | None = None) -> dict[str, Any]:
    """Sweep scenario ``sc`` (a :class:`~moonep_sim.experiments.Scenario` on generated routing)
    along ``ax``; its values are independent points, computed in ``jobs`` worker processes or on a
    Dask ``cluster`` (``moonep_sim.experiments.parallel``) with the same report as serially."""
    t0 = time.perf_counter()
    cfg = setup(sc, ax)
    base = cfg.topology
    out_s = {n: {"options": dict(o)} for n, o in cfg.strategies}   # then each series of _strategy_at, per point
    total = len(cfg.axis.values)
    fixed = _routing(cfg, cfg.ranks, cfg.maxvio) if cfg.axis.over not in ("maxvio", "ep") else None
    tasks = [(cfg, base, v, fixed) for v in cfg.axis.values]
    if cluster or check_jobs(jobs) == 1 or total * len(cfg.strategies) <= 1:
        results = run_points(_point, tasks, jobs=jobs, cluster=cluster, progress=progress,
                             label=lambda t: f"{cfg.axis.over}={t[2]:g}")
    else:
        results = _run_staged(cfg, base, fixed, jobs, progress)
    points = [pt for pt, _ in results]
    for _, per in results:
        for name in out_s:
            for k, x in per[name].items():
                out_s[name].setdefault(k, []).append(x)
    if progress:
        progress("done", total, total)
    rep = dict(head(cfg), points=points, lower_bound_us=routing_lower_bound(out_s, len(cfg.axis.values)), strategies=out_s)
    return finish(rep, t0)


def head(cfg: Setup) -> dict[str, Any]:
    """What a generated sweep's report (layer or step level) says of its setup, before its points."""
    return {"kind": "sweep", "over": cfg.axis.over, "values": [float(v) for v in cfg.axis.values],
            "left_out": list(cfg.axis.left_out), "model": cfg.model.to_dict(), "topology": topology_info(cfg.topology),
            "cluster": {"ranks": cfg.ranks if cfg.axis.over != "ep" else None,
                        "gpus_per_node": cfg.gpus_per_node or cfg.topology.gpus_per_node},
            "tokens_per_rank": cfg.spec.tokens_per_rank, "maxvio": cfg.maxvio if cfg.axis.over != "maxvio" else None,
            "seed": cfg.spec.seed, "dispatch_dtype": cfg.dispatch_dtype}


def finish(rep: dict[str, Any], t0: float) -> dict[str, Any]:
    """A layer-level sweep report completed: its flags, one verdict per point, and its seconds."""
    from moonep_sim.analysis.flags import sweep_flags

    rep["flags"] = sweep_flags(rep)
    rep["verdicts"] = sweep_verdicts(rep)
    rep["seconds"] = time.perf_counter() - t0
    return rep


# -- seeds and winner maps: the scenario varied, the engine unchanged ----------------------------------
#: the second knobs of a generated winner map
BY_KNOBS = ("tokens-per-rank", "maxvio", "ep")


def seeded(sc, k: int):
    """``sc`` with its generator spec's seed moved on by ``k``."""
    if not k:
        return sc
    spec = generator_spec(sc)
    return replace(sc, routing=replace(spec, seed=spec.seed + k))


def sweep_over_seeds(sc, ax: SweepAxis, seeds: int = 1, **kw: Any) -> dict[str, Any]:
    """:func:`sweep` at ``seeds`` consecutive seeds of the scenario's spec, combined
    (:func:`moonep_sim.experiments.seeds.combine_seeds`); ``kw``: :func:`sweep`'s keywords."""
    from moonep_sim.experiments.seeds import over_seeds

    return over_seeds(seeds, lambda k: sweep(seeded(sc, k), ax, **kw))


def at(sc, ax: SweepAxis, by: str, v: float):
    """The (scenario, axis) of a winner map's row ``by = v`` (tokens-per-rank, maxvio or ep)."""
    require(by in BY_KNOBS, f"by ({by!r}) must be tokens-per-rank, maxvio or ep")
    require(by != ax.over, f"by ({by}) must differ from over ({ax.over})")
    if by == "maxvio":
        return sc, replace(ax, maxvio=float(v))
    if by == "tokens-per-rank":
        return replace(sc, routing=replace(generator_spec(sc), tokens_per_rank=int(v))), ax
    _, G = parse_cluster(sc.cluster)
    return replace(sc, cluster=(int(v), G or 0)), ax


def check_rows(sc, ax: SweepAxis, by: str, by_values: Sequence[float]) -> None:
    """Every row of a winner map checked before any work."""
    for v in by_values:
        setup(*at(sc, ax, by, v))


def winner_of(reps: Sequence[tuple[float, dict[str, Any]]], by: str) -> dict[str, Any]:
    """The winner map of one sweep report per ``by`` value, the reports kept under ``sweeps``."""
    from moonep_sim.analysis.winner import winner_map

    m = winner_map(reps, by)
    m["sweeps"] = [r for _, r in reps]
    return m
