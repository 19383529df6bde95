"""Measured (testbed) versus simulated layer times: the agreement table.

For each testbed shape (N nodes x G ranks) the testbed is built once; a gloo probe measures what
the shaped links deliver (that fixes ``nic.efficiency`` and ``nic.latency_us`` of the matching
topology, :mod:`moonep_sim.testbed.topology`); then every trace is replayed for real with
``moonep_sim.experiments.ranks.replay_rank``, all strategies in one process group, interleaved step by step (matched
samples per iteration), and the very same plans are simulated on that topology with the
replay's row and expert sizes (float32 rows of H, SwiGLU experts of H x F). A run with one node's
link slowed (``degrade``) checks that the slow node is the straggler in both: measured from the
tbf byte counters (the link with the longest busy time, bytes / rate) and simulated from the
result's ``busiest_port`` and ``straggler``.

Reported per row: measured ms per layer (the replay's ``layer_ms_median``: median over iterations
of the slowest rank's layer time), simulated ms per layer, ratio simulated / measured; per (shape,
trace) the rank agreement of :func:`moonep_sim.analysis.ranking.agreement` (every pair of strategies
a sign test over the matched iterations resolves must be simulated in the same order; also the
exact order and Kendall tau); overall the median absolute error.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.gloo.launcher import reports_by_strategy
from moonep_sim.io import load_average, write_text_atomic
from moonep_sim.analysis.ranking import agreement
from moonep_sim.testbed.netns import Testbed, TestbedSpec, format_rate
from moonep_sim.testbed.run import LaunchSpec, launch_nodes, measure_gloo, signals_raise

STRATEGIES = ("alltoall", "hierarchical", "deepep", "moonep")


@dataclass(frozen=True)
class AgreeCase:
    """One routing source: a trace file, the layer ids replayed, tokens used per layer."""

    label: str
    trace: str
    layers: tuple[int, ...] = (0,)
    max_tokens: int = 0


@dataclass
class AgreeConfig:
    shapes: Sequence[tuple[int, int]] = ((2, 2), (2, 4))
    cases: Sequence[AgreeCase] = ()
    strategies: Sequence[str] = STRATEGIES
    rate_bps: int = 200_000_000
    hidden: int = 512
    ffn: int = 64
    iters: int = 12
    degrade: tuple[int, int] | None = (1, 50_000_000)  # (node, rate) for the straggler run
    degrade_case: int = 0  # index into cases
    timeout_s: float = 600.0
    base_topology: str | None = None
    work_dir: str | None = None


def default_cases(work_dir: Path, repo: Path) -> list[AgreeCase]:
    """The shipped traces plus a skewed synthetic one (E=64, K=8, maxvio 4, written here)."""
    from moonep_sim.routing.generators import generate_trace

    syn = work_dir / "synthetic_e64_k8_maxvio4.safetensors"
    if not syn.exists():
        generate_trace(syn, 64, 8, 1024, seed=7, maxvio=4.0)
    return [AgreeCase("olmoe-1b-7b L0 (1024 tok)", str(repo / "traces/olmoe-1b-7b_layer0.safetensors"), (0,), 1024),
            AgreeCase("mixtral-8x7b humaneval L0,L31", str(repo / "traces/mixtral-8x7b_humaneval.safetensors"), (0, 31), 0),
            AgreeCase("synthetic E64 K8 maxvio 4", str(syn), (0,), 0)]


def replay_args(case: AgreeCase, strategies: str, gpus_per_node: int, hidden: int, ffn: int, iters: int,
                json_out: str) -> tuple[str, ...]:
    args = ["--trace", case.trace, "--strategy", strategies, "--layers", ",".join(map(str, case.layers)),
            "--hidden", str(hidden), "--ffn", str(ffn), "--gpus-per-node", str(gpus_per_node),
            "--iters", str(iters), "--no-check", "--quiet", "--json", json_out]
    if case.max_tokens:
        args += ["--max-tokens", str(case.max_tokens)]
    return tuple(args)


def simulate_case(case: AgreeCase, strategy: str, ranks: int, gpus_per_node: int, hidden: int, ffn: int,
                  topo, faults: tuple = ()) -> dict:
    """Simulate the replay's plans (same token split, placement and sizes) on ``topo``; ms per layer.
    Through :class:`moonep_sim.experiments.Scenario`, as every other command."""
    from moonep_sim.experiments import Scenario
    from moonep_sim.experiments.compare import replay_costs
    from moonep_sim.models import custom_model
    from moonep_sim.plan import GlobalRouting
    from moonep_sim.routing.trace import Trace

    tr = Trace(case.trace)
    E, K = tr.meta.num_experts, tr.meta.top_k
    T = int(tr.meta.num_tokens) if not case.max_tokens else min(int(tr.meta.num_tokens), case.max_tokens)
    model = custom_model(E, K, hidden, ffn, name=f"replay-H{hidden}-F{ffn}")
    times, straggler, busiest = [], [], []
    for lid in case.layers:
        lr = tr.layer(tr.layer_index(lid), 0, T)  # the replay's first T tokens of the layer
        routing = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, E, ranks)
        sc = Scenario(routing=routing, model=model, cluster=(ranks, gpus_per_node), topology=topo,
                      strategies=[strategy], costs=replay_costs(hidden, ffn))
        res = sc.simulate(faults=tuple(faults)).per_strategy[strategy]
        times.append(res["layer_time_us"] / 1e3)
        straggler.append(dict(res["straggler"]))
        busiest.append(dict(res["busiest_port"]))
    return {"ms_per_layer": float(np.mean(times)), "layers_ms": times, "straggler": straggler, "busiest_port": busiest}


def _qdisc_bytes(stats: dict[str, str]) -> dict[str, int]:
    return {k: int(m.group(1)) if (m := re.search(r"Sent (\d+) bytes", text)) else 0 for k, text in stats.items()}


def link_busy_ms(before: dict[str, int], after: dict[str, int], spec: TestbedSpec) -> dict[str, float]:
    """Per node link direction (``n<i>.egress`` / ``n<i>.ingress``): bytes through its tbf during the
    run over its rate, in ms -- how long that link was necessarily busy."""
    return {k: 8e3 * (after[k] - before.get(k, 0)) / spec.node_rate(int(k[1:].split(".")[0])) for k in after}


def _node_of_port(name: str, gpus_per_node: int) -> int | None:
    m = re.match(r"node(\d+)\.", str(name))  # a node link (nic.attach = "node")
    if m:
        return int(m.group(1))
    m = re.search(r"(\d+)", str(name))
    return int(m.group(1)) // gpus_per_node if m else None


def run_agreement(cfg: AgreeConfig, progress: Callable[[str], None] | None = None,
                  json_out: str | None = None) -> dict:
    from moonep_sim.testbed.topology import degraded_faults, testbed_topology

    say = progress or (lambda s: None)
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="msim-agree-"))
    work.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[2]
    cases = list(cfg.cases) or default_cases(work, repo)
    report: dict = {"config": {"shapes": [list(s) for s in cfg.shapes], "strategies": list(cfg.strategies),
                               "rate": format_rate(cfg.rate_bps), "hidden": cfg.hidden, "ffn": cfg.ffn,
                               "iters": cfg.iters, "cases": [c.__dict__ for c in cases],
                               "degrade": list(cfg.degrade) if cfg.degrade else None},
                    "shapes": [], "rows": [], "straggler": []}

    def save():
        if json_out:
            write_text_atomic(json_out, json.dumps(report, indent=2, default=str))

    t_start = time.perf_counter()
    report["load_average_start"] = load_average()
    with signals_raise():
        for (N, G) in cfg.shapes:
            spec = TestbedSpec(nodes=N, rate_bps=cfg.rate_bps)
            logs = work / f"logs-{N}x{G}"
            logs.mkdir(exist_ok=True)
            with Testbed(spec) as tb:
                say(f"{N}x{G}: probing the links with gloo")
                probes = {"gloo": measure_gloo(tb, G, logs, mbytes=8.0, reps=3)}
                topo = testbed_topology(spec, G, probes, cfg.base_topology)
                write_text_atomic(work / f"topology-{N}x{G}.toml", topo.to_toml())
                report["shapes"].append({"nodes": N, "gpus_per_node": G, "probe": probes["gloo"],
                                         "topology": str(work / f"topology-{N}x{G}.toml"),
                                         "topology_constants": topo.constants()})
                for ci, case in enumerate(cases):
                    say(f"{N}x{G} {case.label}: {', '.join(cfg.strategies)} interleaved")
                    out = work / f"replay-{N}x{G}-{ci}.json"
                    reps = _replay_all(tb, case, cfg, G, out, logs)
                    for strat in cfg.strategies:
                        rep = reps[strat]
                        meas = rep["layer_ms_median"]
                        sim = simulate_case(case, strat, N * G, G, cfg.hidden, cfg.ffn, topo)
                        report["rows"].append({
                            "nodes": N, "gpus_per_node": G, "case": case.label, "strategy": strat,
                            "measured_ms": meas, "measured_ms_samples": rep["layer_ms_samples"],
                            "simulated_ms": sim["ms_per_layer"], "ratio": sim["ms_per_layer"] / meas,
                            "measured_dispatch_ms": rep["dispatch_ms"] / len(rep["layers"]),
                            "measured_combine_ms": rep["combine_ms"] / len(rep["layers"]),
                            "bytes_sent": rep["bytes_sent"], "sim_busiest_port": sim["busiest_port"][0]})
                    save()
            if cfg.degrade and N >= 2:
                node, rate = cfg.degrade
                require(0 <= node < N, f"degrade node ({node}) must be in [0, {N})")
                dspec = TestbedSpec(nodes=N, rate_bps=cfg.rate_bps, node_rate_bps={node: rate})
                case = cases[cfg.degrade_case]
                with Testbed(dspec) as tb:
                    for strat in cfg.strategies:  # one at a time: the tbf byte counters are per run
                        say(f"{N}x{G} degraded node {node} {format_rate(rate)}: {case.label} {strat}")
                        out = work / f"replay-{N}x{G}-degraded-{strat}.json"
                        before = _qdisc_bytes(tb.qdisc_stats())
                        rep = _replay_all(tb, case, cfg, G, out, logs, (strat,))[strat]
                        busy = link_busy_ms(before, _qdisc_bytes(tb.qdisc_stats()), dspec)
                        sim = simulate_case(case, strat, N * G, G, cfg.hidden, cfg.ffn, topo,
                                            degraded_faults(dspec, G))
                        base = next((r for r in report["rows"] if r["nodes"] == N and r["gpus_per_node"] == G
                                     and r["case"] == case.label and r["strategy"] == strat), None)
                        meas = rep["layer_ms_median"]
                        busiest_link = max(busy, key=busy.get)
                        bp = sim["busiest_port"][0]
                        st = sim["straggler"][0]
                        report["straggler"].append({
                            "nodes": N, "gpus_per_node": G, "case": case.label, "strategy": strat,
                            "degraded_node": node, "degraded_rate": format_rate(rate),
                            "measured_ms": meas, "simulated_ms": sim["ms_per_layer"],
                            "measured_slowdown": meas / base["measured_ms"] if base else None,
                            "simulated_slowdown": sim["ms_per_layer"] / base["simulated_ms"] if base else None,
                            "measured_busiest_link": busiest_link,
                            "measured_busiest_node": int(busiest_link[1:].split(".")[0]),
                            "link_busy_ms": busy,
                            "sim_busiest_port": bp.get("name"),
                            "sim_busiest_node": _node_of_port(bp.get("name", ""), G),
                            "sim_straggler_rank": st.get("rank"),
                            "sim_straggler_node": (int(st["rank"]) // G) if st.get("rank") is not None else None,
                            "sim_straggler_cause": st.get("cause")})
                        save()
    report["summary"] = summarize(report)
    report["wall_s"] = time.perf_counter() - t_start
    report["load_average_end"] = load_average()
    save()
    return report


def _replay_all(tb, case: AgreeCase, cfg: AgreeConfig, G: int, out: Path, logs: Path,
                strategies: Sequence[str] | None = None) -> dict[str, dict]:
    """Replay ``strategies`` (default: all of ``cfg``) interleaved across the testbed's nodes;
    strategy -> its replay report."""
    names = list(strategies or cfg.strategies)
    launch_nodes(tb, LaunchSpec(G, module_args=replay_args(case, ",".join(names), G, cfg.hidden, cfg.ffn, cfg.iters,
                                                           str(out)), timeout_s=cfg.timeout_s), logs)
    return reports_by_strategy(json.loads(out.read_text()))


def summarize(report: dict) -> dict:
    rows = report["rows"]
    errs = [abs(r["ratio"] - 1) for r in rows]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["nodes"], r["gpus_per_node"], r["case"]), []).append(r)
    ranking = []
    for (N, G, case), rs in groups.items():
        ag = agreement({r["strategy"]: r["measured_ms_samples"] for r in rs},
                       {r["strategy"]: r["simulated_ms"] for r in rs})
        ranking.append({"nodes": N, "gpus_per_node": G, "case": case, **ag,
                        "same_fastest": ag["measured_order"][0] == ag["simulated_order"][0]})
    st = report.get("straggler", [])
    return {"rows": len(rows), "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None, "ranking": ranking,
            "same_order_groups": sum(g["same_order"] for g in ranking), "groups": len(ranking),
            "rank_agree_groups": sum(g["agrees"] for g in ranking),
            "resolved_pairs": sum(g["resolved_pairs"] for g in ranking),
            "resolved_agree": sum(g["resolved_agree"] for g in ranking),
            "pairs": sum(g["pairs"] for g in ranking),
            "straggler_agree": sum(1 for s in st if s["measured_busiest_node"] == s["degraded_node"]
                                   and s["sim_busiest_node"] == s["degraded_node"]),
            "straggler_runs": len(st)}


def markdown_table(report: dict) -> str:
    """The agreement table (and the straggler table) as Markdown."""
    lines = ["| nodes x ranks | routing | strategy | measured ms/layer | simulated ms/layer | sim / measured |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for r in report["rows"]:
        lines.append(f"| {r['nodes']}x{r['gpus_per_node']} | {r['case']} | {r['strategy']} | "
                     f"{r['measured_ms']:.1f} | {r['simulated_ms']:.1f} | {r['ratio']:.2f} |")
    s = report.get("summary") or summarize(report)
    lines += ["", "| nodes x ranks | routing | measured order (fastest first; ~ a measured tie) | simulated order | "
                  "resolved pairs agreeing | exact order | Kendall tau |",
              "| --- | --- | --- | --- | ---: | --- | ---: |"]
    for g in s["ranking"]:
        lines.append(f"| {g['nodes']}x{g['gpus_per_node']} | {g['case']} | {g['measured_order_text']} | "
                     f"{' < '.join(g['simulated_order'])} | {g['resolved_agree']}/{g['resolved_pairs']} | "
                     f"{'same' if g['same_order'] else 'different'} | {g['kendall_tau']:.2f} |")
    if report.get("straggler"):
        lines += ["", "| nodes x ranks | strategy | slow node | measured ms (slowdown) | simulated ms (slowdown) | "
                      "measured busiest link | simulated busiest port | simulated straggler |",
                  "| --- | --- | --- | ---: | ---: | --- | --- | --- |"]
        for t in report["straggler"]:
            ms = f"{t['measured_slowdown']:.2f}x" if t["measured_slowdown"] else "-"
            ss = f"{t['simulated_slowdown']:.2f}x" if t["simulated_slowdown"] else "-"
            lines.append(f"| {t['nodes']}x{t['gpus_per_node']} | {t['strategy']} | {t['degraded_node']} "
                         f"({t['degraded_rate']}) | {t['measured_ms']:.1f} ({ms}) | {t['simulated_ms']:.1f} ({ss}) | "
                         f"{t['measured_busiest_link']} (node {t['measured_busiest_node']}) | "
                         f"{t['sim_busiest_port']} (node {t['sim_busiest_node']}) | rank {t['sim_straggler_rank']} "
                         f"(node {t['sim_straggler_node']}, {t['sim_straggler_cause']}) |")
    med = s["median_abs_error"]
    lines += ["", f"Median absolute error {med:.1%} over {s['rows']} runs (max {s['max_abs_error']:.1%}); "
                  f"the simulated order agrees with every resolved measured pair in {s['rank_agree_groups']} of "
                  f"{s['groups']} groups ({s['resolved_agree']}/{s['resolved_pairs']} resolved pairs of "
                  f"{s['pairs']}; exact order in {s['same_order_groups']}); degraded node is the "
                  f"busiest link in both in {s['straggler_agree']} of {s['straggler_runs']} runs."
              if med is not None else "no rows"]
    if report.get("load_average_start") or report.get("load_average_end"):
        lines.append(f"Load average (1, 5, 15 min) at the start {report.get('load_average_start')}, "
                     f"at the end {report.get('load_average_end')}.")
    return "\n".join(lines)
