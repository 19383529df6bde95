"""The same Kimi K3 EP64 layer on several clusters: does the winner change, and why?

Usage::

    python benchmarks/cluster_compare.py                       # writes docs/results/clusters.{md,json}
    python benchmarks/cluster_compare.py --topologies h800-cx7,h200-efa --maxvio 1,10 --tokens-per-rank 2048

For every topology and maxvio, one generated K3 layer (MoonEP's method: lognormal expert popularity,
sigma bisected to the target maxvio; the same seed on every cluster, so the routing is the same) is
planned by each strategy and timed forward on the topology: each cluster's own ``Scenario.compare``
(:func:`moonep_sim.experiments.clusters.compare_clusters`, what ``moonep-sim compare --topology
a,b,...`` runs for one point). ``deepep`` runs with the kernel family that runs on the cluster's
transport (``moonep_sim/data/native-kernels.toml``, ``impl=``): DeepEP V1 needs GPU-initiated RDMA
(InfiniBand / RoCE), so on EFA the DeepEP-compatible UCCL-EP stands in, and on AMD mori. The table
gives each strategy's layer time and each cluster's verdict (ties named, margin, mechanism,
confidence), then its sentence, and for each strategy the phase and the port that bind it.

Every figure is a simulation with the presets' constants (``moonep-sim topologies``: sourced,
fitted or assumed, each named); the non-V1 kernel families run on assumed terms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent

from moonep_sim.experiments import Scenario  # noqa: E402
from moonep_sim.experiments.clusters import compare_clusters  # noqa: E402
from moonep_sim.report.clusters import (_call, _marks, change_line, cluster_cell, flag_lines,  # noqa: E402
                                        impl_cell)

STRATEGIES = ("alltoall", "hierarchical", "deepep", "moonep", "costaware")
INTRO = ("Kimi K3 (896 experts, top-16, hidden 7168, expert FFN 3072), EP{ranks}, one generated layer per maxvio "
         "(the same routing on every cluster), {tokens} tokens per rank, bf16 rows, forward; simulated with each "
         "preset's constants (`moonep-sim topologies`: sourced / fitted / assumed). `deepep` runs the kernel family "
         "native to the cluster's transport (impl column, `moonep_sim/data/native-kernels.toml`); families other than "
         "DeepEP V1 run on assumed terms (flagged below). Times in ms. The same table for one maxvio: `moonep-sim "
         "compare --trace gen:model=kimi-k3,maxvio=10,tokens-per-rank={tokens} --ranks {ranks} --topology {topos} "
         "--strategies {strategies}`. One generated layer per maxvio, forward only: a layer figure, not a training or "
         "serving step.")


def clusters_markdown(doc: dict[str, Any], meta: dict[str, Any], intro: Sequence[str] = ()) -> str:
    """The document as markdown (docs/results/clusters.md): table, winner changes, causes, flags."""
    strategies = doc["strategies"]
    L = [f"# {meta.get('title', 'The same layer on several clusters: does the winner change, and why')}", "",
         f"Date {meta['date']}, commit `{meta['commit']}`, command `{meta['command']}`, machine load "
         f"`{meta['uptime']}` ({meta['wall_s']:.0f} s wall, {meta['cpu_s']:.0f} CPU s).", "", *intro]
    multi = len(doc["points"]) > 1
    L += ["| cluster (G per node; NVLink / NIC GB/s per GPU, effective; TFLOP/s) | " + ("point | " if multi else "")
          + "deepep impl | " + " | ".join(strategies) + " | winner (margin) |",
          "| --- | " + ("--- | " if multi else "") + "--- | " + " | ".join("---" for _ in strategies) + " | --- |"]
    for p in doc["points"]:
        for r in p["clusters"]:
            cells = [f"{r['layer_time_us'][s] / 1e3:.2f}{_marks(doc, r, s)}" for s in strategies]
            v = _call(r)
            v = v if r["verdict"].get("tie") else f"**{r['verdict']['winner']}**" + v[len(r["verdict"]["winner"]):]
            L.append(f"| {cluster_cell(r)} | " + (f"{p['label']} | " if multi else "") + f"{impl_cell(r)} | "
                     + " | ".join(cells) + f" | {v} |")
    L += ["", "Flags beside these figures (`*` in the table):", ""] + [f"- {x}" for x in flag_lines(doc)]
    L += ["", "## Does the winner change?", ""] + [f"- {change_line(p, bold=True)}" for p in doc["points"]]
    L += ["", "## The verdict's cause, per cluster (each cluster's compare verdict)", ""]
    for p in doc["points"]:
        for r in p["clusters"]:
            if r["verdict"].get("why"):
                L.append(f"- **{r['topology']}, {p['label']}** ({r['verdict'].get('mechanism') or '-'}): "
                         f"{r['verdict']['why']}")
    L += ["", "## Why (per cluster and strategy: straggler; busiest port)", ""]
    for p in doc["points"]:
        for r in p["clusters"]:
            L.append(f"- **{r['topology']}, {p['label']}**: " + "; ".join(
                f"{s}: {d['straggler'] or '-'} ({d['busiest_port']}, x{d['ratio_to_lower_bound']:.2f} LB)"
                for s, d in r["strategies"].items()))
    L.append("")
    return "\n".join(L)


def run(topologies, maxvios, tokens, ranks, strategies, seed=0) -> dict:
    scs = [Scenario(routing=f"gen:model=kimi-k3,maxvio={mv},tokens-per-rank={tokens},seed={seed}", cluster=ranks,
                    topology=topologies[0], strategies=list(strategies)) for mv in maxvios]
    return compare_clusters(scs, topologies, labels=[f"maxvio {mv:g}" for mv in maxvios],
                            progress=lambda m, i, n: m.endswith(": done") and print(m, flush=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topologies", default="h800-cx7,h200-efa,mi300x-cx7,gb200-nvl72")
    ap.add_argument("--maxvio", default="1,10")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "results"))
    a = ap.parse_args()
    t0, c0 = time.time(), os.times()
    doc = run(a.topologies.split(","), [float(v) for v in a.maxvio.split(",")], a.tokens_per_rank, a.ranks,
              a.strategies.split(","))
    c1 = os.times()
    meta = dict(title=f"One K3 EP{a.ranks} layer on {len(doc['topologies'])} clusters: does the winner change, and why",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      cwd=HERE).stdout.strip(),
                command="python benchmarks/cluster_compare.py " + " ".join(sys.argv[1:]),
                uptime=os.popen("uptime").read().strip(), wall_s=time.time() - t0,
                cpu_s=(c1.user - c0.user) + (c1.system - c0.system) + (c1.children_user - c0.children_user)
                + (c1.children_system - c0.children_system))
    intro = [INTRO.format(ranks=a.ranks, tokens=a.tokens_per_rank, topos=a.topologies, strategies=a.strategies), ""]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "clusters.md").write_text(clusters_markdown(doc, meta, intro))
    (out / "clusters.json").write_text(json.dumps(dict(meta=meta, **doc), indent=1, default=str))
    print(f"wrote {out / 'clusters.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
