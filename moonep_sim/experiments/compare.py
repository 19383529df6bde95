"""Compare dispatch strategies on one routing: every strategy planned on the same layers, each
plan timed on a simulated cluster, and (optionally) replayed for real over gloo.

Every strategy's figures come from its *own* Plan: ``make_plan(name, routing, ctx)`` is called once
per (strategy, layer), its ``summary()`` is stored verbatim in the report, and the simulator times
exactly that plan. A simulated figure is always stored with the topology (name and constants)
that produced it.

Notation: R ranks, E experts, K top-k, T tokens of all ranks; ``_RR`` [source, destination].

Routing sources: :mod:`moonep_sim.experiments.routing` (a trace file, whose tokens are split
evenly over the R ranks layer by layer, or a generator spec).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.io import to_jsonable
from moonep_sim.models import ModelSpec, custom_model
from moonep_sim.plan import ClusterShape, Placement, RowCosts
from moonep_sim.experiments.routing import RoutingSource, open_routing

# -- strategies -------------------------------------------------------------------------------------
def parse_strategies(text: str, opts: Sequence[str] | None = None) -> list[tuple[str, dict[str, str]]]:
    """``"alltoall,moonep"`` and ``["moonep.token_padding=128"]`` -> [(name, options)], all checked."""
    from moonep_sim.strategies import get_strategy

    names = [s.strip() for s in text.split(",") if s.strip()]
    require(len(names) > 0, "--strategies must name at least one strategy")
    require(len(set(names)) == len(names), f"--strategies ({text}) must not repeat a strategy")
    specs = {n: get_strategy(n) for n in names}
    per: dict[str, dict[str, str]] = {n: {} for n in names}
    for o in opts or []:
        if "=" not in o or "." not in o.split("=", 1)[0]:
            raise ConfigError(f"--opt ({o!r}) must look like STRATEGY.key=value, e.g. capacity.cf=1.25")
        k, v = o.split("=", 1)
        s, key = k.split(".", 1)
        require(s in per, f"--opt strategy ({s!r}) must be one of --strategies ({', '.join(names)})")
        per[s][key.strip().replace("-", "_")] = v.strip()
    for n in names:
        specs[n].parse_options(per[n])  # raises on an unknown option or a bad value
    return [(n, per[n]) for n in names]


# -- cluster ----------------------------------------------------------------------------------------
def check_cluster(source: RoutingSource, ranks: int, gpus_per_node: int) -> ClusterShape:
    require(ranks >= 1, f"--ranks ({ranks}) must be >= 1")
    require(source.num_experts % ranks == 0,
            f"--ranks ({ranks}) must divide the routing's expert count (E={source.num_experts}): each rank "
            f"owns E/R experts (try --ranks {_divisors_hint(source.num_experts)})")
    g = gpus_per_node or ranks
    require(ranks % g == 0, f"--ranks ({ranks}) must be divisible by --gpus-per-node ({g})")
    return ClusterShape(ranks, g)


def _divisors_hint(E: int) -> str:
    return ", ".join(str(d) for d in (2, 4, 8, 16, 32, 64, 128) if E % d == 0 and d <= E) or "1"


def plan_context(source: RoutingSource, cluster: ClusterShape, dispatch_dtype: str = "bf16",
                 token_padding: int = 1, topology=None):
    from moonep_sim.strategies import PlanContext

    costs = RowCosts.from_model(source.model, dispatch_dtype)
    return PlanContext(cluster, Placement.home_groups(source.num_experts, cluster.ranks), costs, token_padding,
                       topology)


# -- the simulator, through one narrow door -----------------------------------------------------------
def load_topology(name, cluster: ClusterShape | None = None):
    """A simulator topology preset, TOML path or Topology; with ``cluster``, its GPUs per node match
    the plan's."""
    from moonep_sim.sim.topology import Topology
    from moonep_sim.sim.topology import load_topology as _load

    g = cluster.gpus_per_node if cluster is not None else None
    if isinstance(name, Topology):
        return name.with_gpus_per_node(g)
    return _load(name, gpus_per_node=g)


def replay_costs(hidden: int, ffn: int) -> RowCosts:
    """Byte sizes of a gloo replay: float32 rows of ``hidden`` and SwiGLU experts of hidden x ffn, as
    the gloo Buffer counts them."""
    return RowCosts(hidden * 4, hidden * 4, 3 * hidden * ffn * 4, 3 * hidden * ffn * 4)


def simulate(plan, topo, model: ModelSpec, **opts):
    from moonep_sim import sim

    return sim.simulate_layer(plan, topo, model, sim.SimOptions(**opts))


def topology_info(topo) -> dict[str, Any]:
    """Name and every constant of a topology (what a simulated figure is reported with)."""
    c = topo.constants() if hasattr(topo, "constants") else {"repr": repr(topo)}
    return {"name": getattr(topo, "name", "?"), "path": getattr(topo, "path", "") or None,
            "constants": to_jsonable(c, lenient=True)}


def _short(v: Any) -> str:
    """A one-line description of a straggler (``{rank, cause, detail}``) or busiest port record."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        if "rank" in v and "cause" in v:
            return f"rank {v['rank']}: {v['cause']}"
        if "name" in v and "utilisation" in v:
            return f"{v['name']} ({float(v['utilisation']) * 100:.0f}% busy)"
        for k in ("describe", "label", "name", "what"):
            if k in v and isinstance(v[k], str):
                return v[k]
        return ", ".join(f"{k}={v[k]}" for k in list(v)[:3])
    return str(v)


CRITICAL_PARTS = ("plan", "dispatch + wait", "compute", "combine")


def critical_breakdown(sim: dict[str, Any]) -> dict[str, float]:
    """Split a simulated layer time along its critical rank (the one whose expert compute ends
    last): planning, then dispatch and any wait for copied weights until its compute starts, its
    expert compute, and the combine until the layer ends. The parts sum to ``layer_time_us``."""
    total = float(sim["layer_time_us"])
    pr = sim.get("per_rank") or {}
    starts, durs = pr.get("compute_start_us"), pr.get("compute_us")
    if not starts or not durs:
        return {"plan": 0.0, "dispatch + wait": 0.0, "compute": 0.0, "combine": total}
    ends = np.asarray(starts, float) + np.asarray(durs, float)
    r = int(np.argmax(ends))
    pre = float(starts[r])
    plan = min(float(sim.get("phases_us", {}).get("plan", 0.0)), pre)
    comp = float(durs[r])
    return {"plan": plan, "dispatch + wait": pre - plan, "compute": comp, "combine": max(total - pre - comp, 0.0)}


# -- the comparison ---------------------------------------------------------------------------------
@dataclass
class CompareConfig:
    """A comparison run (see ``moonep-sim compare --help``)."""

    trace: str
    strategies: list[tuple[str, dict[str, str]]]
    topology: str
    ranks: int
    gpus_per_node: int = 0
    layers: list[int] | None = None
    model: str | None = None
    dispatch_dtype: str = "bf16"
    token_padding: int = 1
    real: bool = False
    nproc: int = 4
    real_timeout_s: float = 600.0
    real_hidden: int = 512
    real_ffn: int = 1024
    real_iters: int = 10
    real_args: list[str] = field(default_factory=list)

    def local_model(self, source: "RoutingSource") -> ModelSpec:
        """The expert shape the real replay runs (float32 SwiGLU of real_hidden x real_ffn)."""
        return custom_model(source.num_experts, source.top_k, self.real_hidden, self.real_ffn,
                            name=f"replay-H{self.real_hidden}-F{self.real_ffn}")

    def local_costs(self) -> RowCosts:
        """Byte sizes of the real replay (float32 rows and weights, as the gloo Buffer counts them)."""
        return replay_costs(self.real_hidden, self.real_ffn)


def _sum_dicts(acc: dict[str, float], d: dict[str, Any]) -> None:
    for k, v in d.items():
        if isinstance(v, (int, float, np.integer, np.floating)):
            acc[k] = acc.get(k, 0) + v


def _compare_point(task):
    """One (layer, strategy) of a comparison: plan, simulate (and the local-gloo simulation)."""
    from moonep_sim.strategies import make_plan

    cfg, routing, lid, name, opts, ctx, topo, local_topo, model, local_model = task
    plan = make_plan(name, routing, ctx, **opts)
    summ = plan.summary()
    res = simulate(plan, topo, model)
    sd = to_jsonable(res.to_dict(), lenient=True)
    entry = {"layer": int(lid), "plan": to_jsonable(summ, lenient=True), "sim": sd}
    from moonep_sim.experiments.verdict import figures
    entry["figures"] = figures(plan, sd, topo)  # what the verdict reads
    local_phases: dict[str, float] = {}
    if local_topo is not None:
        # the same plan, its bytes counted as the replay moves them (float32, H x F experts)
        lres = simulate(replace(plan, costs=cfg.local_costs()), local_topo, local_model)
        entry["sim_local"] = to_jsonable(lres.to_dict(), lenient=True)
        entry["sim_local_bytes"] = replace(plan, costs=cfg.local_costs()).bytes_summary()
        local_phases = dict(lres.phases_us)
    disp = np.zeros((plan.ranks, plan.ranks))
    for p in plan.phases("forward"):
        if p.kind == "dispatch":
            disp += p.bytes_RR
    return entry, summ["bytes"], dict(res.phases_us), local_phases, np.asarray(summ["recv_rows_per_rank"], float), disp


def compare(cfg: CompareConfig, progress: Callable[[str, int, int], None] | None = None,
            source: RoutingSource | None = None, ctx=None, *, jobs: int | None = 1,
            cluster: str | None = None) -> dict[str, Any]:
    """Plan, simulate (and replay) every strategy on the same layers; return the JSON report. The
    (layer, strategy) points run in ``jobs`` worker processes or on a Dask ``cluster``
    (:mod:`moonep_sim.experiments.parallel`), with the same report as serially."""
    address = cluster  # the Dask scheduler (``cluster`` below is the EP cluster shape)
    t_start = time.perf_counter()
    source = source or open_routing(cfg.trace, cfg.layers, cfg.model)
    cluster = check_cluster(source, cfg.ranks, cfg.gpus_per_node)
    topo = load_topology(cfg.topology, cluster)
    ctx = ctx or plan_context(source, cluster, cfg.dispatch_dtype, cfg.token_padding, topo)
    local_topo = load_topology("local-gloo", cluster) if cfg.real else None
    R = cluster.ranks
    rep: dict[str, Any] = {
        "kind": "compare",
        "routing": source.describe(),
        "model": source.model.to_dict(),
        "cluster": {"ranks": R, "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.num_nodes},
        "dispatch_dtype": cfg.dispatch_dtype,
        "token_padding": cfg.token_padding,
        "topology": topology_info(topo),
        # the parts of sim.critical_us_mean, in the order a layer runs them (report renders them so)
        "critical_parts": list(CRITICAL_PARTS),
        "strategies": {},
    }
    acc: dict[str, dict[str, Any]] = {}
    for name, opts in cfg.strategies:
        acc[name] = {"options": dict(opts), "layers": [], "bytes": {}, "phases": {}, "rows_R": np.zeros(R),
                     "dispatch_RR": np.zeros((R, R)), "local_phases": {}, "local_us": []}
    total_steps = len(source.layer_ids) * len(cfg.strategies)
    from moonep_sim.experiments.parallel import run_points

    tasks = []
    for lid in source.layer_ids:
        routing = source.global_routing(lid, R)
        for name, opts in cfg.strategies:
            tasks.append((cfg, routing, int(lid), name, dict(opts), ctx, topo, local_topo, source.model,
                          cfg.local_model(source) if local_topo is not None else None))
    results = run_points(_compare_point, tasks, jobs=jobs, cluster=address, progress=progress,
                         label=lambda t: f"layer {t[2]}: {t[3]}")
    for (_, _, _, name, _, _, _, _, _, _), (entry, summ_bytes, phases, local_phases, rows, disp) in zip(tasks, results):
        a = acc[name]
        if "sim_local" in entry:
            a["local_us"].append(float(entry["sim_local"]["layer_time_us"]))
            _sum_dicts(a["local_phases"], local_phases)
        a["layers"].append(entry)
        _sum_dicts(a["bytes"], summ_bytes)
        _sum_dicts(a["phases"], phases)
        _sum_dicts(a.setdefault("critical", {}), critical_breakdown(entry["sim"]))
        a["rows_R"] += rows
        a["dispatch_RR"] += disp
    if progress:
        progress("done", total_steps, total_steps)
    L = len(source.layer_ids)
    for name, _ in cfg.strategies:
        a = acc[name]
        times = [e["sim"]["layer_time_us"] for e in a["layers"]]
        lbs = [e["sim"]["lower_bound_us"] for e in a["layers"]]
        worst = int(np.argmax(times))
        mom = [e["plan"]["max_over_mean_rows"] for e in a["layers"]]
        rows_max = [max(e["plan"]["recv_rows_per_rank"]) for e in a["layers"]]
        rows_mean = [float(np.mean(e["plan"]["recv_rows_per_rank"])) for e in a["layers"]]
        b = {k: int(v) for k, v in a["bytes"].items()}
        rep["strategies"][name] = {
            "options": a["options"],
            "plan_bytes": b,
            "weight_bytes": int(b.get("prefetch", 0) + b.get("migrate", 0)),
            "dropped": int(sum(e["plan"]["dropped"] for e in a["layers"])),
            "padded": int(sum(e["plan"]["padded"] for e in a["layers"])),
            "weight_copies": int(sum(e["plan"]["weight_copies"] for e in a["layers"])),
            "rows_max": float(np.mean(rows_max)),
            "rows_mean": float(np.mean(rows_mean)),
            "rows_max_over_mean": float(np.mean(mom)),
            "rows_per_rank_mean": (a["rows_R"] / L).tolist(),
            "dispatch_bytes_RR": a["dispatch_RR"].astype(np.int64).tolist(),
            "plan_seconds": float(sum(e["plan"]["plan_seconds"] for e in a["layers"])),
            "invariant_violations": sum(len(e["plan"]["invariant_violations"]) for e in a["layers"]),
            "sim": {
                "topology": rep["topology"]["name"],
                "layer_time_us_mean": float(np.mean(times)),
                "layer_time_us_total": float(np.sum(times)),
                "phases_us_mean": {k: float(v) / L for k, v in a["phases"].items()},
                "critical_us_mean": {k: float(a["critical"].get(k, 0.0)) / L for k in CRITICAL_PARTS},
                "lower_bound_us_mean": float(np.mean(lbs)),
                "ratio_to_lower_bound": float(np.sum(times) / max(np.sum(lbs), 1e-12)),
                "straggler": _short(a["layers"][worst]["sim"].get("straggler")),
                "busiest_port": _short(a["layers"][worst]["sim"].get("busiest_port")),
                "slowest_layer": a["layers"][worst]["layer"],
            },
            "layers": a["layers"],
        }
        if local_topo is not None:
            rep["strategies"][name]["sim_local"] = {
                "topology": "local-gloo",
                "layer_time_us_mean": float(np.mean(a["local_us"])),
                "phases_us_mean": {k: float(v) / L for k, v in a["local_phases"].items()},
            }
    if cfg.real:
        rep["real"] = run_real(cfg, source, cluster, local_topo, rep, progress)
    from moonep_sim.experiments.flags import compare_flags
    from moonep_sim.experiments.verdict import compare_verdict
    rep["flags"] = compare_flags(rep)
    rep["verdict"] = compare_verdict(rep)
    rep["seconds"] = time.perf_counter() - t_start
    return rep


# -- real replay ----------------------------------------------------------------------------------------
def run_real(cfg: CompareConfig, source: RoutingSource, cluster: ClusterShape, local_topo, rep: dict[str, Any],
             progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Replay every strategy over gloo with ``cfg.nproc`` local processes; pair with the simulated
    time of the same plans on the calibrated local-gloo topology."""
    import tempfile

    from moonep_sim.experiments.ranking import agreement
    from moonep_sim.experiments.replay_rank import run_replay
    from moonep_sim.gloo.launcher import reports_by_strategy

    out: dict[str, Any] = {"nproc": cfg.nproc, "topology": topology_info(local_topo), "hidden": cfg.real_hidden,
                           "ffn": cfg.real_ffn, "dtype": "float32", "iters": cfg.real_iters, "strategies": {}}
    names = [name for name, _ in cfg.strategies]
    with tempfile.TemporaryDirectory(prefix="moonep-compare-") as tmp:
        trace_path = source.trace_file(Path(tmp), cluster.ranks)
        if progress:
            progress(f"gloo replay: {', '.join(names)} interleaved", 0, 1)
        # one process group replays every strategy, step by step in turn: matched samples
        res_all = run_replay(cfg.nproc, replay_argv(trace_path, cfg.strategies, source, cfg),
                             timeout_s=cfg.real_timeout_s)
        per = reports_by_strategy(res_all)
        for name in names:
            res = per[name]
            meas_ms = float(res["layer_ms_median"])
            sim_ms = rep["strategies"][name]["sim_local"]["layer_time_us_mean"] / 1e3
            # the replay planned the same routing with the same strategy: its bytes must be ours
            local_bytes = _local_bytes(rep["strategies"][name], cfg)
            theirs = [{k: v for k, v in e["bytes"].items() if k != "sent"} for e in res.get("per_layer", [])]
            out["strategies"][name] = {
                "measured_ms": meas_ms,
                "measured_ms_samples": res["layer_ms_samples"],
                "simulated_ms": sim_ms,
                "sim_over_measured": sim_ms / meas_ms if meas_ms > 0 else None,
                "measured_phases_ms_mean": {k: v["max_ms"] / max(len(source.layer_ids), 1)
                                            for k, v in res.get("phases", {}).items()},
                "correct": res.get("correct"),
                "same_plan_bytes": (theirs == local_bytes) if theirs else None,
                "replay": to_jsonable(res, lenient=True),
            }
        if progress:
            progress("gloo replay: done", 1, 1)
    out["ranking"] = agreement({n: out["strategies"][n]["measured_ms_samples"] for n in names},
                               {n: out["strategies"][n]["simulated_ms"] for n in names})
    return out


def _local_bytes(strat: dict[str, Any], cfg: CompareConfig) -> list[dict[str, int]]:
    """Per layer, the plan's bytes counted with the replay's row sizes."""
    return [dict(e["sim_local_bytes"]) for e in strat["layers"] if "sim_local_bytes" in e]


def replay_argv(trace_path: Path, strategies: Sequence[tuple[str, dict[str, str]]], source: RoutingSource,
                cfg: CompareConfig) -> list[str]:
    """Arguments of ``moonep_sim.experiments.replay_rank`` for a comparison's real replay."""
    return replay_argv_for(trace_path, strategies, source.layer_ids, hidden=cfg.real_hidden, ffn=cfg.real_ffn,
                           iters=cfg.real_iters, gpus_per_node=cfg.gpus_per_node or cfg.nproc,
                           token_padding=cfg.token_padding) + list(cfg.real_args)


def replay_argv_for(trace_path: Path, strategies: Sequence[tuple[str, dict[str, Any]]], layer_ids: Sequence[int], *,
                    hidden: int, ffn: int, iters: int, gpus_per_node: int, token_padding: int = 1) -> list[str]:
    """Arguments of ``moonep_sim.experiments.replay_rank`` replaying ``strategies`` interleaved (layers given as
    layer ids; options as ``--opt STRATEGY.key=value``)."""
    argv = ["--trace", str(trace_path), "--strategy", ",".join(n for n, _ in strategies),
            "--layers", ",".join(map(str, layer_ids)), "--hidden", str(hidden), "--ffn", str(ffn),
            "--iters", str(iters), "--gpus-per-node", str(gpus_per_node), "--token-padding", str(token_padding),
            "--quiet"]
    for name, opts in strategies:
        for k, v in opts.items():
            argv += ["--opt", f"{name}.{k}={v}"]
    return argv
