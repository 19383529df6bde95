"""``Scenario``: one routing, one model, one cluster, some strategies -- and every way to run them.

Notation (docs/concepts.md): R ranks, G ranks (GPUs) per node, E experts, K top-k.

    from moonep_sim.experiments import Scenario

    sc = Scenario(routing="traces/mixtral-8x7b_humaneval.safetensors", cluster="8/4",
                  strategies=["alltoall", "moonep"], layers=[0, 1])
    sc.plans()                     # PlansResult: each strategy's Plan per layer
    sc.simulate(backward=True)     # SimulateResult: the layers chained as one step, per strategy
    sc.compare()                   # CompareResult: the compare report (sim; real=True adds gloo)
    sc.replay(nproc=4)             # ReplayResult: the gloo replay's report per strategy
    Scenario(routing="gen:model=olmoe-1b-7b,tokens-per-rank=64", cluster=16).sweep(over="maxvio",
                                                                                  values=[0.5, 2])

Every method checks the whole scenario first (:meth:`Scenario.check`), so bad input is one line
before any work. Results are frozen dataclasses with ``to_dict()`` (JSON-ready).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

from moonep_sim.errors import ConfigError, require
from moonep_sim.experiments.compare import (RealOptions, check_cluster, compare, load_topology, run_spec,
                                            topology_info)
from moonep_sim.experiments.results import (CompareResult, LayerPlans, PlansResult, ReplayResult, SimulateResult,
                                            SweepResult)
from moonep_sim.experiments.routing import GeneratorSpec, RoutingSource, open_routing
from moonep_sim.experiments.spec import normalise_dtype, parse_cluster, strategy_list
from moonep_sim.experiments.step import StepOptions, run_step
from moonep_sim.io import to_jsonable
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts

#: Defaults shared by every command and the Python API.
DEFAULT_STRATEGIES = ("alltoall", "capacity", "hierarchical", "moonep")
DEFAULT_TOPOLOGY = "h800-cx7"

Progress = Callable[[str, int, int], None]


def _with_progress(description: str):
    """A long method's ``progress=``: None draws its own bar on a terminal (nothing when piped),
    False none, a callback is used as given (:func:`moonep_sim.progress.resolve`)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, progress=None, **kw):
            from moonep_sim.progress import resolve

            with resolve(progress, description) as cb:
                return fn(self, *args, progress=cb, **kw)
        return wrapper
    return deco


@dataclass(frozen=True)
class Resolved:
    """A checked scenario, the one typed description every way of running it takes: the opened
    routing (its layers and the batches of its steps), the cluster, the planning context, the
    topology, the strategies with their options, the dispatch dtype, and warnings about the run
    (e.g. steps merged into one batch)."""

    source: RoutingSource
    cluster: ClusterShape
    ctx: Any
    topology: Any
    strategies: tuple[tuple[str, dict[str, Any]], ...]
    dispatch_dtype: str = "bf16"
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scenario:
    """One experiment's inputs.

    routing: a trace path, a generator spec (``"gen:model=...,maxvio=..."`` or
      :class:`GeneratorSpec`), or a :class:`~moonep_sim.plan.GlobalRouting` (one layer, its own split).
    model: a preset name or ModelSpec for row and weight sizes (default: the trace's or the spec's).
    cluster: ``R``, ``"R/G"``, ``(R, G)`` or a ClusterShape (default R: 8 or the largest divisor of
      E up to 8; default G: the topology's GPUs per node, at most R).
    topology: a simulator preset or TOML path.  strategies: names (``"a,b"`` or a list).
    options: per-strategy options ``{"capacity": {"cf": 1.25}}``.
    layers: layer ids (default: all of a trace; 0..layers-1 of a spec).
    steps: a trace's steps, each costed as its own batch (default: every step; ``"0,2,5-7"``: those);
      ``"merged"`` / ``"merged:SEL"`` costs them as one concatenated batch (with a warning).
    dispatch_dtype: ``bf16`` or ``fp8`` rows.  token_padding: pad each slot to a multiple of this.
    placement: ``home`` (contiguous groups) or ``round-robin`` expert homes.
    redundant_experts: N extra expert slots (serving's redundant experts: ``E + N`` slots, the EP
      size dividing them, e.g. 256 + 32 over EP72): the homes spread as evenly as they go and
      replicas in the other slots (``Placement.redundant``); ``eplb`` places its N replicas from load.
    costs: row and weight byte sizes overriding the model's (e.g.
      :func:`~moonep_sim.experiments.compare.replay_costs` to simulate a gloo replay's plans).
    """

    routing: Any
    model: str | ModelSpec | None = None
    cluster: Any = None
    topology: Any = DEFAULT_TOPOLOGY
    strategies: Any = DEFAULT_STRATEGIES
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    layers: Sequence[int] | None = None
    steps: Any = None
    dispatch_dtype: str = "bf16"
    token_padding: int = 1
    placement: str = "home"
    costs: RowCosts | None = None
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        from moonep_sim.experiments.checks import check_scenario_args
        check_scenario_args(self)  # every argument's type and range, naming it (experiments/checks.py)

    # -- checking ---------------------------------------------------------------------------------
    @cached_property
    def resolved(self) -> Resolved:
        return self.check()

    def check(self) -> Resolved:
        """Open and check everything (routing, cluster, topology, strategies, options) before any work."""
        from moonep_sim.strategies import PlanContext

        dtype = normalise_dtype(self.dispatch_dtype)  # (token padding: checked when built, checks.py)
        require(self.placement in ("home", "round-robin"),
                f"placement ({self.placement!r}) must be home or round-robin")
        strategies = strategy_list(self.strategies, self.options)
        source = open_routing(self.routing, list(self.layers) if self.layers else None, self.model, self.steps)
        R, G = parse_cluster(self.cluster)
        if isinstance(self.routing, GlobalRouting):
            R = R or self.routing.ranks
        R = R or default_ranks(source.num_experts)
        base = load_topology(self.topology)
        G = G or base.gpus_per_node_for(R)
        N = self.redundant_experts
        require(N <= 16 * source.num_experts,
                f"redundant_experts ({N}) must be <= 16 x E = {16 * source.num_experts} (E = {source.num_experts})")
        require(not N or self.placement == "home", f"placement ({self.placement}) must be home with redundant "
                                                   "experts (their placement spreads the homes itself)")
        cluster = check_cluster(source, R, G, N)
        topo = load_topology(self.topology, cluster.gpus_per_node)
        costs = self.costs or RowCosts.from_model(source.model, dtype)
        place = (Placement.redundant(source.num_experts, R, N) if N else
                 Placement.home_groups(source.num_experts, R) if self.placement == "home"
                 else Placement.round_robin(source.num_experts, R))
        if N:  # eplb places the deployment's redundant slots unless told otherwise
            strategies = tuple((n, {**o, "num_redundant": N}) if n == "eplb" and o.get("num_redundant", -1) == -1
                               else (n, o) for n, o in strategies)
        warn = (f"steps merged: {source.trace_steps} recorded steps of the trace costed as one batch of "
                f"{source.tokens} tokens that never ran together (the default, --steps each, costs every "
                "step on its own)",) if source.merged else ()
        return Resolved(source, cluster, PlanContext(cluster, place, costs, self.token_padding, topo), topo,
                        strategies, dtype, warn)

    # -- plans --------------------------------------------------------------------------------------
    def plans(self, progress: Progress | None = None) -> PlansResult:
        """Every strategy's Plan of every (step, layer) (``make_plan`` once per (strategy, step, layer))."""
        from moonep_sim.strategies import make_plan

        rs = self.resolved
        src = rs.source
        out = []
        cells = [(b, lid) for b in range(src.num_batches) for lid in src.layer_ids]
        n, i = len(cells) * len(rs.strategies), 0
        for b, lid in cells:
            base = src.global_routing(lid, rs.cluster.ranks, b)
            if base.num_tokens == 0:
                continue  # this step has no token at this layer (a per-layer token mask)
            for name, opts in rs.strategies:
                if progress:
                    progress(f"layer {lid}: {name}", i, n)
                routing = src.routing_for(name, opts, lid, rs.cluster, b, base=base)
                out.append(LayerPlans(name, int(lid), make_plan(name, routing, rs.ctx, **opts), src.batches[b][0]))
                i += 1
        return PlansResult(tuple(out), src.describe(), src.model.name,
                           {"ranks": rs.cluster.ranks, "gpus_per_node": rs.cluster.gpus_per_node})

    # -- simulate ---------------------------------------------------------------------------------
    def simulate(self, progress: Progress | None = None, *, seeds: int = 1, **sim_options: Any) -> SimulateResult:
        """Each strategy's plans of the scenario's layers chained as one step on the topology, for
        every selected step of a trace on its own (:mod:`moonep_sim.analysis.stepstats`).

        sim_options: :class:`moonep_sim.sim.SimOptions` fields (``backward``, ``chunks``, ``faults``,
        ``jitter``, ``seed``, ``tol``, ``overlap_prefetch``, ``timeline``). ``layer_time_us``: the
        token-weighted mean over steps; ``per_strategy``: the simulator's result of the slowest step
        (the only one for a single step) with ``per_step`` and ``steps_aggregate`` beside it;
        ``verdict``: who wins and why, each chain read stage by stage
        (:func:`~moonep_sim.analysis.verdict.simulate_verdict`; one strategy: a stated
        single-strategy verdict; ``isolate``: none, a kernel timed alone is no comparison).
        ``seeds`` > 1 (generated routing only): the same at seeds ``seed, seed + 1, ...``, each its
        own draw; ``layer_time_us`` is then the mean over seeds, ``per_strategy`` the first seed's
        with ``seeds`` and ``seed_layer_time_us`` beside it, and the verdict rests on the spread
        over seeds.
        """
        from moonep_sim import sim
        from moonep_sim.analysis.stepstats import aggregate
        from moonep_sim.analysis.verdict import simulate_verdict

        rs = self.resolved
        try:
            opts = sim.SimOptions(**sim_options)
        except TypeError as e:
            raise ConfigError(f"simulator option must be a SimOptions field: {e}") from None
        spec = self.routing if isinstance(self.routing, GeneratorSpec) else (
            GeneratorSpec.parse(self.routing) if isinstance(self.routing, str) and self.routing.startswith("gen:")
            else None)
        require(isinstance(seeds, int) and 1 <= seeds <= 64, f"seeds ({seeds!r}) must be an integer in [1, 64]")
        require(seeds == 1 or spec is not None, f"seeds ({seeds}) apply to generated routing (gen:...): a trace's "
                                                "verdict rests on the spread over its steps")
        draws = [self] if seeds == 1 else [replace(self, routing=replace(spec, seed=spec.seed + k)) for k in range(seeds)]
        plans_D = [d.plans(progress) for d in draws]
        plans = plans_D[0]
        steps = list(dict.fromkeys(p.step for p in plans.items))
        tokens = [rs.source.batch_tokens[[b[0] for b in rs.source.batches].index(st)] for st in steps]
        per: dict[str, Any] = {}
        raw: dict[str, Any] = {}
        runs: dict[str, list] = {}
        for name, _ in rs.strategies:
            t0 = time.perf_counter()
            chains = [[p.plan for p in pl.items if p.strategy == name and p.step == st] for pl in plans_D for st in steps]
            res_S = [sim.simulate_layers(ch, rs.topology, rs.source.model, opts) for ch in chains]
            runs[name] = [(ch, _verdict_view(r)) for ch, r in zip(chains, res_S)]
            seed_t = [float(r.layer_time_us) for r in res_S]
            res_S = res_S[:len(steps)]  # the first draw's steps (the only draw without seeds)
            t_S = [float(r.layer_time_us) for r in res_S]
            worst = int(max(range(len(t_S)), key=t_S.__getitem__))
            d = to_jsonable(res_S[worst].to_dict(), lenient=True)
            series = {"step": steps, "tokens": tokens, "layer_time_us": t_S,
                      "lower_bound_us": [float(r.lower_bound_us) for r in res_S],
                      "phases_us": [{k: float(v) for k, v in r.phases_us.items()} for r in res_S]}
            d.update(model=rs.source.model.name, layers=list(rs.source.layer_ids), step=steps[worst],
                     sim_call_seconds=time.perf_counter() - t0, per_step=series,
                     steps_aggregate={k: aggregate(series[k], tokens, steps) for k in ("layer_time_us", "lower_bound_us")})
            if seeds > 1:
                d.update(seeds=[spec.seed + k for k in range(seeds)], seed_layer_time_us=seed_t)
            d["flags"] = _simulate_flags(rs, name, [p.plan for p in plans.items if p.strategy == name])
            per[name] = d
            raw[name] = res_S[worst]
        flags = [f for n in per for f in per[n]["flags"]]
        v = (simulate_verdict(runs, rs.topology, tokens * seeds, flags, unit="seed" if seeds > 1 else "step")
             if opts.isolate is None else None)
        t = {n: float(sum(per[n]["seed_layer_time_us"]) / seeds) if seeds > 1 else
             float(per[n]["steps_aggregate"]["layer_time_us"]["token_weighted_mean"]) for n in per}
        return SimulateResult(tuple(per), t, per, topology_info(rs.topology), raw,
                              dict(rs.source.steps_info(), warnings=list(rs.warnings)), v)

    # -- whole steps --------------------------------------------------------------------------------
    def step(self, mode: str = "train", overlap: str = "none", **options: Any):
        """Every strategy's whole step (train, prefill or decode) on this scenario's routing: the
        model's layer stack, compute, overlap and memory. ``options``: the fields of
        :class:`~moonep_sim.experiments.step.StepOptions` (tokens_per_rank, context, distinct_layers,
        compute_profile, ...; ``parallel`` a :class:`~moonep_sim.step.parallel.Parallel` layout over
        this scenario's GPUs), which they build, and :func:`~moonep_sim.experiments.step.run_step`'s
        own keywords (model, progress, jobs, cluster, pipeline). One
        :class:`~moonep_sim.experiments.step.StepResult`, or a list for a trace of several steps."""
        run = {k: options.pop(k) for k in ("model", "progress", "jobs", "cluster", "pipeline") if k in options}
        out = run_step(self, StepOptions(mode, overlap, **options), **run)
        return out[0] if len(out) == 1 else out

    # -- serving ---------------------------------------------------------------------------------------
    def serve(self, deployment: Any, requests: Any = None, **options: Any) -> dict:
        """Requests through a serving ``deployment`` (a :class:`~moonep_sim.serve.deployment.Deployment`,
        a TOML path or its dict) per strategy, each iteration timed by the step model on this
        scenario's routing (:func:`moonep_sim.experiments.serve.scenario_serve`; ``options``: rate,
        concurrency, n, isl, osl, slo, price, draws, cache, direct, seed, ...). The JSON document of
        ``moonep-sim serve``."""
        from moonep_sim.experiments.serve import scenario_serve

        return scenario_serve(self, deployment, requests, **options)

    def search_layouts(self, gpus: int, mode: str = "train", **options: Any) -> dict[str, Any]:
        """Every valid parallel layout of this scenario's model on ``gpus`` GPUs, priced, those that
        fit ranked per strategy by tokens/s per GPU
        (:func:`moonep_sim.experiments.layout_search.search_layouts`). ``options``: the fields of its
        :class:`~moonep_sim.experiments.layout_search.LayoutSpace` (micro_batch_size,
        global_batch_size, schedules, zeros, top), ``seq`` (the training sequence, default 4096),
        ``progress``, and the step options it prices with (overlap, gemm_dtype, recompute, ...)."""
        from moonep_sim.experiments.layout_search import LayoutSpace, search_layouts

        space = {k: options.pop(k) for k in ("micro_batch_size", "global_batch_size", "schedules", "zeros", "top")
                 if k in options}
        progress = options.pop("progress", None)
        step = StepOptions(mode, context=options.pop("seq", 4096), **options)
        return search_layouts(self, LayoutSpace(gpus, **space), step, progress=progress)

    # -- compare, replay, sweep ---------------------------------------------------------------------
    @_with_progress("compare")
    def compare(self, real: bool = False, *, nproc: int | None = None, iters: int = 10, hidden: int = 512,
                ffn: int = 1024, timeout_s: float = 600.0, progress: Progress | None = None, jobs: int | None = 1,
                cluster: str | None = None, level: str = "layer", step: Any = None) -> CompareResult:
        """Every strategy on the same steps and layers, simulated (each step its own batch, then
        aggregated over steps); with ``real``, also replayed over gloo by ``nproc`` local processes
        (= the scenario's ranks), interleaved. The simulated points run in ``jobs`` worker
        processes or on a Dask ``cluster``; the real replay always runs alone (timings).

        ``level="step"``: every strategy's whole step instead (``step``: a
        :class:`~moonep_sim.experiments.step.StepOptions`, default train without overlap), what
        :meth:`step` returns (:mod:`moonep_sim.experiments.step_levels`)."""
        opts = _step_level(level, step, real=real)
        if opts is not None:
            out = run_step(self, opts, progress=progress, jobs=jobs, cluster=cluster)
            return out[0] if len(out) == 1 else out
        rs = self.resolved
        opts = None
        if real:
            nproc = nproc or rs.cluster.ranks
            require(2 <= nproc <= 64, f"nproc ({nproc}) must lie in [2, 64]")
            require(iters >= 1, f"iters ({iters}) must be >= 1")
            require(rs.cluster.ranks == nproc,
                    f"ranks ({rs.cluster.ranks}) must equal nproc ({nproc}) for a real replay: each process is one EP rank")
            load_topology("local-gloo")
            opts = RealOptions(nproc, timeout_s, hidden, ffn, iters)
        return CompareResult.from_report(compare(rs, real=opts, progress=progress, jobs=jobs, cluster=cluster))

    def replay(self, nproc: int | None = None, *, iters: int = 3, warmup: int = 1, hidden: int = 64,
               ffn: int = 128, backward: bool = False, check: bool | None = None, timeout_s: float = 600.0,
               max_tokens: int = 0) -> ReplayResult:
        """Replay the strategies over gloo with ``nproc`` local processes (default: the scenario's
        ranks), interleaved step by step, each recorded step its own batch; the replay's JSON report
        per strategy, and ``verdict``: who won on the local machine and which measured phase made
        the margin (:mod:`~moonep_sim.analysis.measured_verdict`). The ranks receive this
        scenario as one typed spec (:class:`~moonep_sim.experiments.spec.ReplaySpec`, JSON written once)."""
        from moonep_sim.gloo.launcher import reports_by_strategy

        rs = self.resolved
        nproc = nproc or rs.cluster.ranks
        require(2 <= nproc <= 64, f"nproc ({nproc}) must lie in [2, 64]")
        require(rs.cluster.ranks == nproc, f"ranks ({rs.cluster.ranks}) must equal nproc ({nproc}) for a replay")
        rep = run_spec(rs, nproc, timeout_s, hidden=hidden, ffn=ffn, iters=iters, warmup=warmup, backward=backward,
                       check=check, max_tokens=max_tokens)
        per = reports_by_strategy(rep)
        if "verdict" not in rep:  # one strategy: a stated single-strategy verdict
            from moonep_sim.analysis.measured_verdict import measured_verdict, replay_where
            rep = dict(rep, verdict=measured_verdict(per, where=replay_where(rep)))
        return ReplayResult(tuple(per), {n: float(r["layer_ms_median"]) for n, r in per.items()},
                            {n: r.get("correct") for n, r in per.items()}, to_jsonable(rep, lenient=True))

    @_with_progress("sweep")
    def sweep(self, over: str, values: Sequence[float] | None = None, *, maxvio: float | None = None,
              progress: Progress | None = None, jobs: int | None = 1, cluster: str | None = None,
              seeds: int = 1, level: str = "layer", step: Any = None) -> SweepResult:
        """Vary ``over`` (``maxvio``, ``ep`` or a numeric topology constant) through ``values``
        (default: :func:`moonep_sim.experiments.sweep.default_values`); each point plans every
        strategy on generated routing (this scenario's generator spec, or the model's defaults) and
        simulates it on the topology. Points run in ``jobs`` worker processes (None: the cores) or on
        a Dask ``cluster`` address (:mod:`moonep_sim.experiments.parallel`), same report as serial.
        ``seeds`` > 1: the sweep at that many seeds; the verdicts rest on the spread over them
        (:mod:`moonep_sim.experiments.seeds`).

        On a trace (this scenario's routing is a trace file), the sweep runs on the recorded routing,
        each step its own batch: ``over`` a topology constant, ``ranks`` (``ep``), ``gpus_per_node``,
        ``tokens_per_rank`` or ``maxvio`` (re-weighted popularity), see
        :mod:`moonep_sim.experiments.trace_sweep` (the spread behind its verdicts is over steps).

        ``level="step"``: every point a whole step per strategy (``step``: a
        :class:`~moonep_sim.experiments.step.StepOptions`), the report's series the step figures
        and each point's verdict the step verdict (:mod:`moonep_sim.experiments.step_levels`)."""
        from moonep_sim.experiments.sweep import sweep_over_seeds

        run = {"progress": progress, "jobs": jobs, "cluster": cluster}
        opts = _step_level(level, step, seeds=seeds)
        if opts is not None:
            from moonep_sim.experiments.step_levels import step_sweep, trace_step_sweep

            rep = (trace_step_sweep(self, over, values, opts, **run) if self.is_trace() else
                   step_sweep(self, self.sweep_axis(over, values, maxvio=maxvio), opts, **run))
        elif self.is_trace():
            from moonep_sim.experiments.trace_sweep import trace_sweep

            rep = trace_sweep(self, over, values, **run)
        else:
            rep = sweep_over_seeds(self, self.sweep_axis(over, values, maxvio=maxvio), seeds, **run)
        return SweepResult.from_report(rep)

    @_with_progress("winner map")
    def winner_map(self, over: str, values: Sequence[float] | None, by: str, by_values: Sequence[float], *,
                   maxvio: float | None = None, progress: Progress | None = None, jobs: int | None = 1,
                   cluster: str | None = None, seeds: int = 1, level: str = "layer", step: Any = None) -> dict[str, Any]:
        """The fastest strategy per cell over two knobs: one :meth:`sweep` of ``over`` per value of
        ``by`` (``tokens-per-rank``, ``maxvio`` or ``ep``), combined by
        :func:`moonep_sim.analysis.winner.winner_map` (each cell: winner, margin over the
        runner-up, every strategy's time; ``sweeps`` holds the full reports). ``seeds`` > 1: every
        sweep at that many seeds, each cell's times the means and its verdict (tie, confidence) from
        the spread over seeds. ``level="step"``: each cell a whole step per strategy, its winner
        the step verdict's (``step``: a :class:`~moonep_sim.experiments.step.StepOptions`)."""
        from moonep_sim.experiments.sweep import at, check_rows, sweep_over_seeds, winner_of

        run = {"progress": progress, "jobs": jobs, "cluster": cluster}
        opts = _step_level(level, step, seeds=seeds)
        if opts is not None:
            from moonep_sim.experiments.step_levels import step_winner_map

            return step_winner_map(self, over, values, by, by_values, opts, maxvio=maxvio, **run)
        if self.is_trace():
            from moonep_sim.experiments.trace_sweep import trace_winner_map

            return trace_winner_map(self, over, values, by, by_values, **run)
        ax = self.sweep_axis(over, values, maxvio=maxvio)
        check_rows(self, ax, by, by_values)  # every input checked before any work
        return winner_of([(float(v), sweep_over_seeds(*at(self, ax, by, v), seeds, **run)) for v in by_values], by)

    def is_trace(self) -> bool:
        """True when the routing is a trace file (not a generator spec or routing in memory)."""
        return not isinstance(self.routing, (GeneratorSpec, GlobalRouting)) and not (
            isinstance(self.routing, str) and self.routing.startswith("gen:"))

    def sweep_axis(self, over: str, values: Sequence[float] | None = None, *, maxvio: float | None = None):
        """The :class:`~moonep_sim.experiments.sweep.SweepAxis` of :meth:`sweep` on generated routing
        (default values derived, those left out named); ``sweep.setup(scenario, axis)`` checks both."""
        from moonep_sim.experiments.sweep import axis

        return axis(self, over, values, maxvio=maxvio)


def _step_level(level: str, step: Any, *, real: bool = False, seeds: int = 1):
    """At level step, the step options to run (``step``, default train without overlap; checked:
    typed, no layer-only option given); None at level layer."""
    from moonep_sim.experiments.step_levels import check_level

    if check_level(level) == "layer":
        require(step is None, "step options must be given with level='step' only (the layer level has none)")
        return None
    require(step is None or isinstance(step, StepOptions),
            f"step ({type(step).__name__}) must be a StepOptions (moonep_sim.experiments.step)")
    require(not real, "real replays run the layer level only (level='step' is simulated)")
    require(seeds == 1, f"seeds ({seeds}) must be 1 at level step (the spread over seeds is layer-level)")
    return step or StepOptions()


def _verdict_view(res) -> dict[str, Any]:
    """The parts of a simulator's result the verdict reads (:func:`~.verdict.chain_figures`)."""
    d = {"layer_time_us": float(res.layer_time_us), "per_rank": res.per_rank, "phases_us": res.phases_us}
    if len(res.stages) > 1:
        d["stages"] = res.stages
    return d


def _simulate_flags(rs: Resolved, name: str, plans: list) -> list[dict[str, Any]]:
    """The flags of one strategy's simulated layers (:mod:`moonep_sim.analysis.flags`)."""
    from moonep_sim.analysis.flags import model_flags, strategy_flags

    opts = dict(next(o for n, o in rs.strategies if n == name))
    out = strategy_flags(name, opts, rs.cluster.num_nodes, sum(p.dropped for p in plans), sum(p.padded for p in plans),
                         unit=f"{len(plans)} layer(s)")
    return [f for f in model_flags(rs.source.model.to_dict()) if rs.strategies[0][0] == name] + out


def default_ranks(num_experts: int) -> int:
    """The default EP size: 8, or the largest divisor of E below it."""
    return next(r for r in (8, 4, 2, 1) if num_experts % r == 0)


__all__ = ["Scenario", "Resolved", "DEFAULT_STRATEGIES", "DEFAULT_TOPOLOGY", "normalise_dtype", "parse_cluster",
           "strategy_list", "default_ranks"]
