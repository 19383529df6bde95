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

import tempfile
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from moonep_sim.errors import ConfigError, require
from moonep_sim.limits import MAX_TOKEN_PADDING
from moonep_sim.experiments.results import (CompareResult, LayerPlans, PlansResult, ReplayResult, SimulateResult,
                                            SweepResult)
from moonep_sim.experiments.routing import GeneratorSpec, RoutingSource, open_routing
from moonep_sim.io import to_jsonable
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts

#: Defaults shared by every command and the Python API.
DEFAULT_STRATEGIES = ("alltoall", "capacity", "hierarchical", "moonep")
DEFAULT_TOPOLOGY = "h800-cx7"
DISPATCH_DTYPES = ("bf16", "fp8")
_DTYPE_ALIASES = {"bfloat16": "bf16", "float8": "fp8", "fp8_e4m3": "fp8"}

Progress = Callable[[str, int, int], None]


def normalise_dtype(text: str) -> str:
    """``bf16`` / ``bfloat16`` -> ``bf16``; ``fp8`` -> ``fp8``; anything else is an error."""
    d = _DTYPE_ALIASES.get(text, text)
    require(d in DISPATCH_DTYPES, f"dispatch dtype ({text!r}) must be one of {', '.join(DISPATCH_DTYPES)} "
                                  "(bfloat16 is accepted for bf16)")
    return d


def parse_cluster(cluster: Any) -> tuple[int | None, int | None]:
    """``8``, ``"8"``, ``"8/4"`` (ranks / GPUs per node), ``(8, 4)`` or a ClusterShape -> (R, G)."""
    if cluster is None:
        return None, None
    if isinstance(cluster, ClusterShape):
        return cluster.ranks, cluster.gpus_per_node
    if isinstance(cluster, int):
        return cluster, None
    if isinstance(cluster, (tuple, list)):
        require(len(cluster) == 2, f"cluster ({cluster!r}) must be (ranks, gpus_per_node)")
        return int(cluster[0]), int(cluster[1]) or None
    text = str(cluster)
    r, sep, g = text.partition("/")
    try:
        return int(r), (int(g) if sep else None)
    except ValueError:
        raise ConfigError(f"cluster ({text!r}) must look like RANKS or RANKS/GPUS_PER_NODE, e.g. 16/8") from None


def strategy_list(strategies: "str | Sequence[str] | Sequence[tuple[str, Mapping[str, Any]]]",
                  options: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Strategies and their options, checked against the registry: ``"a,b"``, ``["a", "b"]`` or
    ``[("a", {...})]``; ``options`` maps a strategy to its options (merged)."""
    from moonep_sim.strategies import get_strategy

    if isinstance(strategies, str):
        items: list = [s.strip() for s in strategies.split(",") if s.strip()]
    else:
        items = list(strategies)
    pairs = [(it, {}) if isinstance(it, str) else (it[0], dict(it[1])) for it in items]
    names = [n for n, _ in pairs]
    require(len(names) > 0, "strategies must name at least one strategy")
    require(len(set(names)) == len(names), f"strategies ({', '.join(names)}) must not repeat a strategy")
    for s in options or {}:
        require(s in names, f"option strategy ({s!r}) must be one of the strategies ({', '.join(names)})")
    out = []
    for n, o in pairs:
        merged = {**o, **dict((options or {}).get(n, {}))}
        get_strategy(n).parse_options(merged)  # unknown option or bad value: one line
        out.append((n, merged))
    return tuple(out)


@dataclass(frozen=True)
class Resolved:
    """A checked scenario: the opened routing, the cluster, the planning context and the topology."""

    source: RoutingSource
    cluster: ClusterShape
    ctx: Any
    topology: Any
    strategies: tuple[tuple[str, dict[str, Any]], ...]


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
    steps: a trace's steps to use, e.g. ``"0,2,5-7"`` (default: every token).
    dispatch_dtype: ``bf16`` or ``fp8`` rows.  token_padding: pad each slot to a multiple of this.
    placement: ``home`` (contiguous groups) or ``round-robin`` expert homes.
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

    # -- checking ---------------------------------------------------------------------------------
    @cached_property
    def resolved(self) -> Resolved:
        return self.check()

    def check(self) -> Resolved:
        """Open and check everything (routing, cluster, topology, strategies, options) before any work."""
        from moonep_sim.experiments.compare import check_cluster, load_topology
        from moonep_sim.strategies import PlanContext

        dtype = normalise_dtype(self.dispatch_dtype)
        require(1 <= self.token_padding <= MAX_TOKEN_PADDING,
                f"token padding ({self.token_padding}) must be in [1, {MAX_TOKEN_PADDING}]")
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
        cluster = check_cluster(source, R, G)
        topo = load_topology(self.topology, cluster)
        costs = self.costs or RowCosts.from_model(source.model, dtype)
        place = (Placement.home_groups(source.num_experts, R) if self.placement == "home"
                 else Placement.round_robin(source.num_experts, R))
        return Resolved(source, cluster, PlanContext(cluster, place, costs, self.token_padding, topo), topo,
                        strategies)

    # -- plans --------------------------------------------------------------------------------------
    def plans(self, progress: Progress | None = None) -> PlansResult:
        """Every strategy's Plan of every layer (``make_plan`` once per (strategy, layer))."""
        from moonep_sim.strategies import make_plan

        rs = self.resolved
        out = []
        n, i = len(rs.source.layer_ids) * len(rs.strategies), 0
        for lid in rs.source.layer_ids:
            for name, opts in rs.strategies:
                if progress:
                    progress(f"layer {lid}: {name}", i, n)
                routing = self._routing_for(name, opts, lid)
                out.append(LayerPlans(name, int(lid), make_plan(name, routing, rs.ctx, **opts)))
                i += 1
        return PlansResult(tuple(out), rs.source.describe(), rs.source.model.name,
                           {"ranks": rs.cluster.ranks, "gpus_per_node": rs.cluster.gpus_per_node})

    def _routing_for(self, name: str, opts: Mapping[str, Any], layer_id: int) -> GlobalRouting:
        """The layer's routing; deepep with ``max_nodes`` re-routes a trace's router logits node-limited."""
        rs = self.resolved
        src = rs.source
        if name == "deepep" and opts.get("max_nodes") and src._trace is not None and src._trace.has("router_logits"):
            from moonep_sim.strategies import get_strategy
            from moonep_sim.strategies.deepep import node_limited_topk

            m = int(get_strategy(name).parse_options(dict(opts))["max_nodes"])
            if m:
                idx = src._trace.layer_index(layer_id)
                ids, w = node_limited_topk(src._trace.router_logits(idx), src.top_k, rs.cluster.num_nodes, m,
                                           score=src.model.router)
                return GlobalRouting.split_evenly(ids, w, src.num_experts, rs.cluster.ranks)
        return src.global_routing(layer_id, rs.cluster.ranks)

    # -- simulate -----------------------------------------------------------------------------------
    def simulate(self, progress: Progress | None = None, **sim_options: Any) -> SimulateResult:
        """Each strategy's plans of the scenario's layers chained as one step on the topology.

        sim_options: :class:`moonep_sim.sim.SimOptions` fields (``backward``, ``chunks``, ``faults``,
        ``jitter``, ``seed``, ``tol``, ``overlap_prefetch``, ``timeline``).
        """
        from moonep_sim import sim

        rs = self.resolved
        try:
            opts = sim.SimOptions(**sim_options)
        except TypeError as e:
            raise ConfigError(f"simulator option must be a SimOptions field: {e}") from None
        plans = self.plans(progress)
        per: dict[str, Any] = {}
        raw: dict[str, Any] = {}
        for name, _ in rs.strategies:
            t0 = time.perf_counter()
            res = sim.simulate_layers([p.plan for p in plans.items if p.strategy == name], rs.topology,
                                      rs.source.model, opts)
            d = to_jsonable(res.to_dict(), lenient=True)
            d.update(model=rs.source.model.name, layers=list(rs.source.layer_ids),
                     sim_call_seconds=time.perf_counter() - t0)
            d["flags"] = _simulate_flags(rs, name, [p.plan for p in plans.items if p.strategy == name])
            per[name] = d
            raw[name] = res
        from moonep_sim.experiments.compare import topology_info

        return SimulateResult(tuple(per), {n: float(per[n]["layer_time_us"]) for n in per}, per,
                              topology_info(rs.topology), raw)

    # -- compare, replay, sweep ---------------------------------------------------------------------
    def compare(self, real: bool = False, *, nproc: int | None = None, iters: int = 10, hidden: int = 512,
                ffn: int = 1024, timeout_s: float = 600.0, progress: Progress | None = None, jobs: int | None = 1,
                cluster: str | None = None) -> CompareResult:
        """Every strategy on the same layers, simulated (per layer); with ``real``, also replayed
        over gloo by ``nproc`` local processes (= the scenario's ranks), interleaved. The simulated
        (layer, strategy) points run in ``jobs`` worker processes or on a Dask ``cluster``; the
        real replay always runs alone (timings)."""
        from moonep_sim.experiments.compare import CompareConfig, compare

        rs = self.resolved
        if real:
            nproc = nproc or rs.cluster.ranks
            require(2 <= nproc <= 64, f"nproc ({nproc}) must lie in [2, 64]")
            require(iters >= 1, f"iters ({iters}) must be >= 1")
            require(rs.cluster.ranks == nproc,
                    f"ranks ({rs.cluster.ranks}) must equal nproc ({nproc}) for a real replay: each process is one EP rank")
            from moonep_sim.experiments.compare import load_topology
            load_topology("local-gloo")
        cfg = CompareConfig("gen:" + self.routing.text() if isinstance(self.routing, GeneratorSpec) else str(self.routing),
                            [(n, dict(o)) for n, o in rs.strategies], self.topology, rs.cluster.ranks,
                            rs.cluster.gpus_per_node, list(rs.source.layer_ids), rs.source.model.name,
                            normalise_dtype(self.dispatch_dtype), self.token_padding, real=real, nproc=nproc or 4,
                            real_timeout_s=timeout_s, real_hidden=hidden, real_ffn=ffn, real_iters=iters)
        rep = compare(cfg, progress=progress, source=rs.source, ctx=rs.ctx, jobs=jobs, cluster=cluster)
        return CompareResult.from_report(rep)

    def replay(self, nproc: int | None = None, *, iters: int = 3, warmup: int = 1, hidden: int = 64,
               ffn: int = 128, backward: bool = False, check: bool | None = None, timeout_s: float = 600.0,
               max_tokens: int = 0, extra_args: Sequence[str] = ()) -> ReplayResult:
        """Replay the strategies over gloo with ``nproc`` local processes (default: the scenario's
        ranks), interleaved step by step; the replay's JSON report per strategy."""
        from moonep_sim.experiments.compare import replay_argv_for
        from moonep_sim.experiments.replay_rank import run_replay
        from moonep_sim.gloo.launcher import reports_by_strategy

        rs = self.resolved
        nproc = nproc or rs.cluster.ranks
        require(2 <= nproc <= 64, f"nproc ({nproc}) must lie in [2, 64]")
        require(rs.cluster.ranks == nproc, f"ranks ({rs.cluster.ranks}) must equal nproc ({nproc}) for a replay")
        with tempfile.TemporaryDirectory(prefix="moonep-replay-") as tmp:
            path = rs.source.trace_file(Path(tmp), nproc)
            argv = replay_argv_for(path, rs.strategies, rs.source.layer_ids, hidden=hidden, ffn=ffn, iters=iters,
                                   gpus_per_node=rs.cluster.gpus_per_node, token_padding=self.token_padding)
            argv += ["--warmup", str(warmup)]
            if backward:
                argv.append("--backward")
            if check is not None:
                argv.append("--check" if check else "--no-check")
            if max_tokens:
                argv += ["--max-tokens", str(max_tokens)]
            rep = run_replay(nproc, argv + list(extra_args), timeout_s=timeout_s)
        per = reports_by_strategy(rep)
        return ReplayResult(tuple(per), {n: float(r["layer_ms_median"]) for n, r in per.items()},
                            {n: r.get("correct") for n, r in per.items()}, to_jsonable(rep, lenient=True))

    def sweep(self, over: str, values: Sequence[float] | None = None, *, maxvio: float | None = None,
              progress: Progress | None = None, jobs: int | None = 1, cluster: str | None = None) -> SweepResult:
        """Vary ``over`` (``maxvio``, ``ep`` or a numeric topology constant) through ``values``
        (default: :func:`moonep_sim.experiments.sweep.default_values`); each point plans every
        strategy on generated routing (this scenario's generator spec, or the model's defaults) and
        simulates it on the topology. Points run in ``jobs`` worker processes (None: the cores) or on
        a Dask ``cluster`` address (:mod:`moonep_sim.experiments.parallel`), same report as serial."""
        from moonep_sim.experiments.sweep import sweep

        return SweepResult.from_report(sweep(self.sweep_config(over, values, maxvio=maxvio), progress=progress,
                                             jobs=jobs, cluster=cluster))

    def winner_map(self, over: str, values: Sequence[float] | None, by: str, by_values: Sequence[float], *,
                   maxvio: float | None = None, progress: Progress | None = None, jobs: int | None = 1,
                   cluster: str | None = None) -> dict[str, Any]:
        """The fastest strategy per cell over two knobs: one :meth:`sweep` of ``over`` per value of
        ``by`` (``tokens-per-rank``, ``maxvio`` or ``ep``), combined by
        :func:`moonep_sim.experiments.winner.winner_map` (each cell: winner, margin over the
        runner-up, every strategy's time; ``sweeps`` holds the full reports)."""
        from dataclasses import replace

        from moonep_sim.experiments.sweep import check, sweep
        from moonep_sim.experiments.winner import winner_map

        require(by in ("tokens-per-rank", "maxvio", "ep"), f"by ({by!r}) must be tokens-per-rank, maxvio or ep")
        require(by != over, f"by ({by}) must differ from over ({over})")
        base = self.sweep_config(over, values, maxvio=maxvio)
        field = {"tokens-per-rank": "tokens_per_rank", "maxvio": "maxvio", "ep": "ranks"}[by]
        cfgs = [replace(base, **{field: (float(v) if by == "maxvio" else int(v))}) for v in by_values]
        for c in cfgs:
            check(c)  # every input checked before any work
        reps = [(float(v), sweep(c, progress=progress, jobs=jobs, cluster=cluster)) for v, c in zip(by_values, cfgs)]
        m = winner_map(reps, by)
        m["sweeps"] = [r for _, r in reps]
        return m

    def sweep_config(self, over: str, values: Sequence[float] | None = None, *, maxvio: float | None = None):
        """The :class:`~moonep_sim.experiments.sweep.SweepConfig` of :meth:`sweep` (checked by ``check``)."""
        from moonep_sim.experiments.sweep import SweepConfig, default_values

        spec = self.routing if isinstance(self.routing, GeneratorSpec) else (
            GeneratorSpec.parse(self.routing) if isinstance(self.routing, str) and self.routing.startswith("gen:")
            else None)
        require(spec is not None, f"sweep routing ({self.routing!r}) must be a generator spec (gen:model=...): "
                                  "a sweep generates routing at every point")
        model = spec.resolve_model(self.model)
        strategies = strategy_list(self.strategies, self.options)
        R, G = parse_cluster(self.cluster)
        vals = list(values) if values is not None else default_values(over, model, self.topology)
        pop = spec.popularity()
        return SweepConfig(model, over, [float(v) for v in vals], [(n, dict(o)) for n, o in strategies], self.topology,
                          R or 64, G or 0, spec.tokens_per_rank,
                          float(maxvio if maxvio is not None else pop.get("maxvio", 1.0)), spec.seed,
                          normalise_dtype(self.dispatch_dtype), self.token_padding)


def _simulate_flags(rs: Resolved, name: str, plans: list) -> list[dict[str, Any]]:
    """The flags of one strategy's simulated layers (:mod:`moonep_sim.experiments.flags`)."""
    from moonep_sim.experiments.flags import model_flags, strategy_flags

    opts = dict(next(o for n, o in rs.strategies if n == name))
    out = strategy_flags(name, opts, rs.cluster.num_nodes, sum(p.dropped for p in plans), sum(p.padded for p in plans),
                         unit=f"{len(plans)} layer(s)")
    return [f for f in model_flags(rs.source.model.to_dict()) if rs.strategies[0][0] == name] + out


def default_ranks(num_experts: int) -> int:
    """The default EP size: 8, or the largest divisor of E below it."""
    for r in (8, 4, 2, 1):
        if num_experts % r == 0:
            return r
    return 1


__all__ = ["Scenario", "Resolved", "DEFAULT_STRATEGIES", "DEFAULT_TOPOLOGY", "normalise_dtype", "parse_cluster",
           "strategy_list", "default_ranks"]
