"""Fidelity: how close the simulator's ``local-gloo`` figures are to real gloo runs.

For every case (a shipped trace or generated routing) and every strategy, the same Plan is
replayed for real over gloo with N local processes and simulated on the calibrated ``local-gloo``
topology (both through :func:`moonep_sim.report.compare.compare`). Reported:

- the signed error per (case, strategy): ``simulated / measured - 1``;
- the median absolute error over all of them (target: <= 25%);
- whether the strategies rank in the same order: per case, Kendall's tau between measured and
  simulated times and whether the order is exactly the same; overall, the share of cases with the
  same order and the mean tau.

The constants come from ``moonep-sim calibrate`` (microbenchmarks only: gloo all-to-all, a
SwiGLU matmul, memory copies and row gathers/scatter-adds, planning a synthetic layer); nothing is
fitted on the replay cases validated here. The report records the load average at the start and
the end (other jobs on the machine inflate the measured times).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from moonep_sim.errors import require

ALL_STRATEGIES = ("alltoall", "capacity", "allgather", "hierarchical", "deepep", "eplb", "moonep")
QUICK_STRATEGIES = ("alltoall", "capacity", "hierarchical", "moonep")


@dataclass(frozen=True)
class Case:
    """One validation case: a routing source (``--trace`` syntax), the layers and a label."""

    name: str
    trace: str
    layers: tuple[int, ...] | None = None
    gpus_per_node: int = 0


def default_cases(quick: bool, traces_dir: str = "traces") -> list[Case]:
    """Shipped traces and generated routings (a balanced and a skewed one)."""
    cases = [
        Case("mixtral humaneval L0-3", f"{traces_dir}/mixtral-8x7b_humaneval.safetensors", (0, 1, 2, 3)),
        Case("gen e64 k8 maxvio=4", "gen:experts=64,top_k=8,model=olmoe-1b-7b,maxvio=4,tokens-per-rank=256,layers=2,seed=1"),
    ]
    if not quick:
        cases += [
            Case("mixtral humaneval L16-19 (2 nodes)", f"{traces_dir}/mixtral-8x7b_humaneval.safetensors",
                 (16, 17, 18, 19), gpus_per_node=2),
            Case("synthetic e64 k8 maxvio=1", f"{traces_dir}/synthetic_e64_k8_maxvio1.safetensors", (0,)),
            Case("gen e64 k8 maxvio=0.5", "gen:model=olmoe-1b-7b,maxvio=0.5,tokens-per-rank=512,layers=2,seed=2"),
        ]
    return cases


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a between two equally long sequences (1 = same order, -1 = reversed)."""
    n = len(a)
    require(n == len(b), "kendall_tau needs sequences of equal length")
    if n < 2:
        return 1.0
    s = 0
    for i, j in itertools.combinations(range(n), 2):
        x, y = a[i] - a[j], b[i] - b[j]
        s += (x > 0) - (x < 0) if y > 0 else -((x > 0) - (x < 0)) if y < 0 else 0
    return s / (n * (n - 1) / 2)


def same_order(a: Sequence[float], b: Sequence[float]) -> bool:
    return sorted(range(len(a)), key=lambda i: a[i]) == sorted(range(len(b)), key=lambda i: b[i])


def summarise(cases: list[dict[str, Any]], per_case: list[dict[str, Any]]) -> dict[str, Any]:
    """Median absolute error and rank agreement from case records (``measured_ms``, ``simulated_ms``)."""
    errs = [abs(c["error"]) for c in cases]
    taus = [c["kendall_tau"] for c in per_case]
    return {
        "cases": len(per_case),
        "points": len(cases),
        "median_abs_error": statistics.median(errs) if errs else None,
        "max_abs_error": max(errs) if errs else None,
        "within_25pct": sum(e <= 0.25 for e in errs) / len(errs) if errs else None,
        "same_order_cases": sum(bool(c["same_order"]) for c in per_case),
        "mean_kendall_tau": statistics.mean(taus) if taus else None,
        "pass_error": bool(errs) and statistics.median(errs) <= 0.25,
        "pass_rank": bool(per_case) and all(c["same_order"] for c in per_case),
    }


@dataclass
class FidelityConfig:
    cases: list[Case]
    strategies: list[str] = field(default_factory=lambda: list(ALL_STRATEGIES))
    nproc: int = 4
    timeout_s: float = 600.0
    iters: int = 5  # timed replay iterations per strategy (after one warm-up): small layers are noisy


def validate(cfg: FidelityConfig, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    from moonep_sim.report.compare import (CompareConfig, check_cluster, compare, load_topology, open_source,
                                           parse_strategies)

    t0 = time.perf_counter()
    load_start = _loadavg()
    strategies = parse_strategies(",".join(cfg.strategies))
    topo = load_topology("local-gloo")
    sources = []
    for case in cfg.cases:  # check every case before running anything
        src = open_source(case.trace, list(case.layers) if case.layers else None)
        check_cluster(src, cfg.nproc, case.gpus_per_node or cfg.nproc)
        sources.append(src)
    points: list[dict[str, Any]] = []
    per_case: list[dict[str, Any]] = []
    reports = []
    n = len(cfg.cases)
    for i, (case, src) in enumerate(zip(cfg.cases, sources)):
        if progress:
            progress(case.name, i, n)
        cc = CompareConfig(case.trace, strategies, "local-gloo", cfg.nproc, case.gpus_per_node or cfg.nproc,
                           src.layer_ids, src.model.name, real=True, nproc=cfg.nproc, real_timeout_s=cfg.timeout_s,
                           real_iters=cfg.iters)
        rep = compare(cc, source=src)
        reports.append(rep)
        meas, sim = [], []
        for name, _ in strategies:
            r = rep["real"]["strategies"][name]
            m, s = r["measured_ms_mean"], r["simulated_ms_mean"]
            points.append({"case": case.name, "strategy": name, "measured_ms": m, "simulated_ms": s,
                           "error": s / m - 1 if m > 0 else float("inf"), "correct": r.get("correct")})
            meas.append(m)
            sim.append(s)
        names = [nm for nm, _ in strategies]
        per_case.append({"case": case.name, "trace": case.trace, "layers": src.layer_ids,
                         "gpus_per_node": case.gpus_per_node or cfg.nproc,
                         "measured_order": [names[j] for j in sorted(range(len(meas)), key=meas.__getitem__)],
                         "simulated_order": [names[j] for j in sorted(range(len(sim)), key=sim.__getitem__)],
                         "kendall_tau": kendall_tau(meas, sim), "same_order": same_order(meas, sim)})
    if progress:
        progress("done", n, n)
    from moonep_sim.report.compare import topology_info

    return {"kind": "fidelity", "nproc": cfg.nproc, "iters": cfg.iters, "topology": topology_info(topo),
            "strategies": [nm for nm, _ in strategies], "cases": points, "per_case": per_case,
            "summary": summarise(points, per_case), "seconds": time.perf_counter() - t0,
            "load_average": {"start": load_start, "end": _loadavg()},
            "compare_reports": reports}


def _loadavg() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (other jobs inflate measured times)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None
