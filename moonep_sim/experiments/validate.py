"""Fidelity: how close the simulator's ``local-gloo`` figures are to real gloo runs.

For every case (a shipped trace or generated routing) and every strategy, the same Plan is
replayed for real over gloo with N local processes and simulated on the calibrated ``local-gloo``
topology (both through :func:`moonep_sim.experiments.compare.compare`). Reported:

- the signed error per (case, strategy): ``simulated / measured - 1``;
- the median absolute error over all of them (target: <= 25%);
- whether the strategies rank in the same order (:mod:`moonep_sim.analysis.ranking`): all strategies
  of a case are replayed in one process group, interleaved step by step, so each iteration gives
  matched samples; a pair of strategies is ordered by the measurements when a sign test over the
  matched iterations resolves it (Holm-corrected over the case's pairs at 0.05), and the simulator
  agrees when it orders every resolved pair the same way (target: every case). Also reported: the exact order of the medians, whether it
  is identical, and Kendall's tau (strict figures that count measured ties as orders).

The measured layer time is the median over iterations of the slowest rank's time for the layer
(averaged over the case's layers), which is what the simulator's layer time describes.

The constants come from ``moonep-sim calibrate`` (microbenchmarks only: gloo all-to-all, a
SwiGLU matmul, memory copies and row gathers/scatter-adds, planning a synthetic layer); nothing is
fitted on the replay cases validated here. The report records the load average at the start and
the end (other jobs on the machine inflate the measured times).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from moonep_sim.experiments.compare import RealOptions, compare, load_topology, topology_info
from moonep_sim.io import load_average
from moonep_sim.strategies import available

QUICK_STRATEGIES = ("alltoall", "capacity", "hierarchical", "moonep")


def all_strategies() -> list[str]:
    """Every registered strategy (the registry is the one list)."""
    return list(available())


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


def summarise(cases: list[dict[str, Any]], per_case: list[dict[str, Any]]) -> dict[str, Any]:
    """Median absolute error and rank agreement from case records (``measured_ms``, ``simulated_ms``;
    per case the :func:`moonep_sim.analysis.ranking.agreement` fields)."""
    errs = [abs(c["error"]) for c in cases]
    taus = [c["kendall_tau"] for c in per_case]
    return {
        "cases": len(per_case),
        "points": len(cases),
        "median_abs_error": statistics.median(errs) if errs else None,
        "max_abs_error": max(errs) if errs else None,
        "within_25pct": sum(e <= 0.25 for e in errs) / len(errs) if errs else None,
        "resolved_pairs": sum(c["resolved_pairs"] for c in per_case),
        "resolved_agree": sum(c["resolved_agree"] for c in per_case),
        "pairs": sum(c["pairs"] for c in per_case),
        "uncorrected_pairs": sum(c.get("uncorrected_pairs", 0) for c in per_case),
        "uncorrected_agree": sum(c.get("uncorrected_agree", 0) for c in per_case),
        "rank_agree_cases": sum(bool(c["agrees"]) for c in per_case),
        "same_order_cases": sum(bool(c["same_order"]) for c in per_case),
        "mean_kendall_tau": statistics.mean(taus) if taus else None,
        "pass_error": bool(errs) and statistics.median(errs) <= 0.25,
        "pass_rank": bool(per_case) and all(c["agrees"] for c in per_case),
    }


@dataclass
class FidelityConfig:
    cases: list[Case]
    strategies: list[str] = field(default_factory=all_strategies)
    nproc: int = 4
    timeout_s: float = 600.0
    iters: int = 16  # timed interleaved iterations (after one warm-up): matched samples for the sign test


def validate(cfg: FidelityConfig, progress: Callable[[str, int, int], None] | None = None, *, jobs: int | None = 1,
             cluster: str | None = None) -> dict[str, Any]:
    """Replay and simulate every case; the simulated points run in ``jobs`` worker processes or on a
    Dask ``cluster`` (same report), the gloo replays one at a time (they are the measurement)."""
    from moonep_sim.experiments.scenario import Scenario
    from moonep_sim.experiments.spec import strategy_list

    t0 = time.perf_counter()
    load_start = load_average()
    strategies = strategy_list(list(cfg.strategies))
    topo = load_topology("local-gloo")
    resolved = []
    for case in cfg.cases:  # check every case before running anything
        sc = Scenario(routing=case.trace, cluster=(cfg.nproc, case.gpus_per_node or cfg.nproc), topology="local-gloo",
                      strategies=strategies, layers=list(case.layers) if case.layers else None)
        resolved.append(sc.resolved)
    points: list[dict[str, Any]] = []
    per_case: list[dict[str, Any]] = []
    reports = []
    n = len(cfg.cases)
    for i, (case, rs) in enumerate(zip(cfg.cases, resolved)):
        src = rs.source
        if progress:
            progress(case.name, i, n)
        rep = compare(rs, real=RealOptions(cfg.nproc, cfg.timeout_s, iters=cfg.iters), jobs=jobs, cluster=cluster)
        reports.append(rep)
        for name, _ in strategies:
            r = rep["real"]["strategies"][name]
            m, s = r["measured_ms"], r["simulated_ms"]
            points.append({"case": case.name, "strategy": name, "measured_ms": m, "simulated_ms": s,
                           "error": s / m - 1 if m > 0 else float("inf"), "correct": r.get("correct"),
                           "measured_ms_samples": r["measured_ms_samples"]})
        per_case.append({"case": case.name, "trace": case.trace, "layers": src.layer_ids,
                         "gpus_per_node": case.gpus_per_node or cfg.nproc, **rep["real"]["ranking"]})
    if progress:
        progress("done", n, n)
    return {"kind": "fidelity", "nproc": cfg.nproc, "iters": cfg.iters, "topology": topology_info(topo),
            "strategies": [nm for nm, _ in strategies], "cases": points, "per_case": per_case,
            "summary": summarise(points, per_case), "seconds": time.perf_counter() - t0,
            "load_average": {"start": load_start, "end": load_average()},
            "compare_reports": reports}
