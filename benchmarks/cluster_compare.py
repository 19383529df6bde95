"""The same Kimi K3 EP64 layer on several clusters: does the winner change, and why?

Usage::

    python benchmarks/cluster_compare.py                       # writes docs/results/clusters.{md,json}
    python benchmarks/cluster_compare.py --topologies h800-cx7,h200-efa --maxvio 1,10 --tokens-per-rank 2048

For every topology and maxvio, one generated K3 layer (MoonEP's method: lognormal expert popularity,
sigma bisected to the target maxvio; the same seed on every cluster, so the routing is the same) is
planned by each strategy and timed forward on the topology (``Scenario.simulate``). ``deepep`` runs
with the kernel family that runs on the cluster's transport (:data:`NATIVE`, ``impl=``): DeepEP V1
needs GPU-initiated RDMA (InfiniBand / RoCE), so on EFA the DeepEP-compatible UCCL-EP stands in,
and on AMD mori. The table gives each strategy's layer time, the winner and its margin, and for
each strategy the phase and the port that bind it -- the "why".

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

HERE = Path(__file__).resolve().parent

from moonep_sim.experiments import Scenario  # noqa: E402
from moonep_sim.sim import load_topology  # noqa: E402

#: The deepep kernel family that runs on each cluster's transport (see the module docstring).
NATIVE = {"h800-cx7": "deepep-v1", "h200-cx7": "deepep-v1", "h100-cx7": "deepep-v1", "h20": "deepep-v1",
          "h20-roce200": "deepep-v1", "b200": "deepep-v1", "gb200-nvl72": "deepep-v1", "h100-efa": "uccl-ep",
          "h200-efa": "uccl-ep", "mi300x-cx7": "mori", "mi350x": "mori"}
STRATEGIES = ("alltoall", "hierarchical", "deepep", "moonep", "costaware")


def run(topologies, maxvios, tokens, ranks, strategies, seed=0) -> list[dict]:
    out = []
    for mv in maxvios:
        for tn in topologies:
            topo = load_topology(tn)
            impl = NATIVE.get(tn, "deepep-v1")
            sc = Scenario(routing=f"gen:model=kimi-k3,maxvio={mv},tokens-per-rank={tokens},seed={seed}",
                          cluster=ranks, topology=tn, strategies=list(strategies),
                          options={"deepep": {"impl": impl}} if "deepep" in strategies else {})
            t0 = time.time()
            res = sc.simulate()
            rows = {}
            for s in strategies:
                d = res.per_strategy[s]
                st = d.get("straggler", {})
                rows[s] = dict(layer_us=float(res.layer_time_us[s]), phases=d.get("phases_us", {}),
                               straggler=st.get("detail", ""), busiest=d.get("busiest_port", {}).get("name", ""),
                               ratio_lb=float(d.get("ratio_to_lower_bound", 0.0)))
            v = res.verdict or {}  # the simulator's own verdict: ties, confidence and the mechanism
            order = sorted(rows, key=lambda s: rows[s]["layer_us"])
            w, ru = v.get("winner", order[0]), v.get("runner_up", order[1])
            G = sc.resolved.cluster.gpus_per_node
            out.append(dict(topology=tn, maxvio=mv, tokens=tokens, ranks=ranks, gpus_per_node=G, deepep_impl=impl,
                            nvlink_GBps=topo.nvlink_bytes_per_us / 1e3, nic_GBps=topo.nic_bytes_per_us / 1e3,
                            tflops=topo.gpu_tflops, rows=rows, winner=w, runner_up=ru,
                            margin=rows[ru]["layer_us"] / rows[w]["layer_us"] - 1,
                            tie=bool(v.get("tie")), mechanism=v.get("mechanism", ""), why=v.get("why", ""),
                            confidence=(v.get("confidence") or {}).get("level", ""),
                            wall_s=time.time() - t0))
            print(f"{tn:<12} maxvio {mv:<4} winner {order[0]:<12} "
                  + " ".join(f"{s} {rows[s]['layer_us'] / 1e3:.2f}ms" for s in strategies), flush=True)
    return out


def _call(r: dict) -> str:
    """The winner cell: a tie within the verdict's spread is named a tie, not a win."""
    if r.get("tie"):
        return f"tie: {r['winner']} / {r['runner_up']} (+{100 * r['margin']:.1f}%)"
    mech = "".join(f"; {x}" for x in (r.get("mechanism"), r.get("confidence") and f"confidence {r['confidence']}") if x)
    return f"**{r['winner']}** (+{100 * r['margin']:.1f}% to {r['runner_up']}{mech})"


def render(res: list[dict], meta: dict) -> str:
    strategies = list(res[0]["rows"])
    L = ["# One K3 EP64 layer on four clusters: does the winner change, and why", "",
         f"Date {meta['date']}, commit `{meta['commit']}`, command `{meta['command']}`, machine load "
         f"`{meta['uptime']}` ({meta['wall_s']:.0f} s wall, {meta['cpu_s']:.0f} CPU s).", "",
         "Kimi K3 (896 experts, top-16, hidden 7168, expert FFN 3072), EP64, one generated layer per maxvio "
         f"(the same routing on every cluster), {res[0]['tokens']} tokens per rank, bf16 rows, forward; simulated "
         "with each preset's constants (`moonep-sim topologies`: sourced / fitted / assumed). `deepep` runs the "
         "kernel family native to the cluster's transport (impl column); families other than DeepEP V1 run on "
         "assumed terms. Times in ms; per strategy: the phase that ends last on the straggler rank and the "
         "busiest port.", "",
         "| cluster (G per node; NVLink / NIC GB/s per GPU, effective; TFLOP/s) | maxvio | deepep impl | "
         + " | ".join(strategies) + " | winner (margin) |",
         "| --- | --- | --- | " + " | ".join("---" for _ in strategies) + " | --- |"]
    for r in res:
        cells = [f"{r['rows'][s]['layer_us'] / 1e3:.2f}" for s in strategies]
        L.append(f"| {r['topology']} ({r['gpus_per_node']}; {r['nvlink_GBps']:.0f} / {r['nic_GBps']:.0f}; "
                 f"{r['tflops']:.0f}) | {r['maxvio']:g} | {r['deepep_impl']} | " + " | ".join(cells)
                 + f" | {_call(r)} |")
    multi = sorted({r["topology"] for r in res if r["gpus_per_node"] < r["ranks"]})
    if "moonep" in strategies and multi:  # the flag compare prints as outside-library, stated beside the table
        L += ["", f"Assumptions beside these figures: `moonep` on {', '.join(multi)} (EP{res[0]['ranks']} over several "
              "nodes) is a setting its real library does not support (MoonEP runs inside one NVLink domain only; "
              "`compare` flags it `outside-library`). `costaware` and `deepep` with a family other than DeepEP V1 "
              "rest on assumed kernel terms. One generated layer per maxvio, forward only: a layer figure, not a "
              "training or serving step."]
    L += ["", "## Does the winner change?", ""]
    for mv in dict.fromkeys(r["maxvio"] for r in res):
        at = [r for r in res if r["maxvio"] == mv]
        by = {}
        for r in at:
            by.setdefault(f"tie of {r['winner']} and {r['runner_up']}" if r.get("tie") else r["winner"],
                          []).append(r["topology"])
        L.append(f"- maxvio {mv:g}: " + "; ".join(f"**{w}** on {', '.join(ts)}" for w, ts in by.items())
                 + (" (the same winner on every cluster)" if len(by) == 1 else " (the winner changes with the cluster)")
                 + ". Runner-up margins: " + ", ".join(f"{r['topology']} +{100 * r['margin']:.1f}% ({r['runner_up']})"
                                                       for r in at) + ".")
    L += ["", "## The verdict's cause, per cluster (the simulator's verdict: `Scenario.simulate().verdict`)", ""]
    for r in res:
        if r.get("why"):
            L.append(f"- **{r['topology']}, maxvio {r['maxvio']:g}** ({r.get('mechanism') or '-'}): {r['why']}")
    L += ["", "## Why (per cluster and strategy: straggler; busiest port)", ""]
    for r in res:
        L.append(f"- **{r['topology']}, maxvio {r['maxvio']:g}**: " + "; ".join(
            f"{s}: {r['rows'][s]['straggler'] or '-'} ({r['rows'][s]['busiest']}, x{r['rows'][s]['ratio_lb']:.2f} LB)"
            for s in strategies))
    L.append("")
    return "\n".join(L)


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
    res = run(a.topologies.split(","), [float(v) for v in a.maxvio.split(",")], a.tokens_per_rank, a.ranks,
              a.strategies.split(","))
    c1 = os.times()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      cwd=HERE).stdout.strip(),
                command="python benchmarks/cluster_compare.py " + " ".join(sys.argv[1:]),
                uptime=os.popen("uptime").read().strip(), wall_s=time.time() - t0,
                cpu_s=(c1.user - c0.user) + (c1.system - c0.system) + (c1.children_user - c0.children_user)
                + (c1.children_system - c0.children_system))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "clusters.md").write_text(render(res, meta))
    (out / "clusters.json").write_text(json.dumps(dict(meta=meta, rows=res), indent=1, default=str))
    print(f"wrote {out / 'clusters.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
