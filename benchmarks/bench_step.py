"""Step-model speed: CPU seconds for whole steps, per strategy (docs/results/steps.md).

Cases (the targets of the step model's issue):

- ``k3-train``: Kimi K3 EP64 (8 nodes of 8 on h800-cx7), train, 4096 tokens per rank, generated
  routing (maxvio 2) included, ``--overlap shared-expert``;
- ``v3-decode``: DeepSeek-V3 EP32 (4 nodes), decode, 32 sequences per rank, context 4096.

Each case runs at every ``--distinct-layers`` value given (0: every MoE layer its own generated
routing -- 92 for K3, 58 for V3 --; N > 0: the shortcut, N layers generated, planned and simulated,
the other MoE layers reusing them, flagged). By default each (case, strategy, distinct) runs in a
fresh ``Scenario``, its routing generated inside the timing (the per-strategy figure); with
``--together`` the strategies run in one step (one generation shared, the per-strategy split read
from the step's own ``cpu_seconds``). Every row gives the per-layer floor from the same run:
routing, planning and simulation CPU seconds per distinct layer. ``--jobs N`` runs the layers in N
worker processes (CPU seconds then count this process and its workers).

Reported: process CPU seconds (user + sys, children included) and wall seconds of that run, with
the 1-minute load average beside them (the reference machine is shared)::

    python benchmarks/bench_step.py --json OUT.json
    python benchmarks/bench_step.py --cases k3-train --distinct-layers 0 --together
    python benchmarks/bench_step.py --cases v3-decode --strategies alltoall --jobs 2
    python benchmarks/bench_step.py --cases k3-train --strategies alltoall --distinct-layers 0 --moe-layers 4
    python benchmarks/bench_step.py --routing-only      # each case's generation alone, per layer
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time

from moonep_sim.experiments import GeneratorSpec, Scenario

CASES = {
    "k3-train": dict(spec=dict(model="kimi-k3", maxvio=2.0, tokens_per_rank=4096, layers=92), cluster="64/8",
                     step=dict(mode="train", overlap="shared-expert")),
    "v3-decode": dict(spec=dict(model="deepseek-v3", maxvio=1.0, tokens_per_rank=32, layers=58), cluster="32/8",
                      step=dict(mode="decode", overlap="none", context=4096)),
}


def cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run(case: str, strategies: list[str], distinct: int, jobs: int, moe_layers: int = 0) -> list[dict]:
    c = CASES[case]
    sc = Scenario(routing=GeneratorSpec(**c["spec"]), cluster=c["cluster"], topology="h800-cx7",
                  strategies=strategies)
    extra = {}
    if moe_layers:  # a quick run: the model cut to its dense layers and its first N MoE layers
        m = sc.resolved.source.model
        extra["model"] = dataclasses.replace(m, layers=m.dense_layers + moe_layers, moe_layers=moe_layers)
    load0 = os.getloadavg()[0]
    c0, t0 = cpu_s(), time.perf_counter()
    res = sc.step(distinct_layers=distinct, jobs=jobs, **c["step"], **extra)
    cpu, wall = cpu_s() - c0, time.perf_counter() - t0
    rows = []
    for s in strategies:
        d = res.figures[s]
        n = d["distinct_layers_simulated"]
        k = d["cpu_seconds"]
        rows.append({
            "case": case + (f" (cut to {moe_layers} MoE layers)" if moe_layers else ""), "strategy": s, "together": strategies if len(strategies) > 1 else None,
            "distinct_layers": distinct, "layers_simulated": n, "jobs": jobs,
            "cpu_s": cpu, "wall_s": wall, "load_start": load0, "load_end": os.getloadavg()[0],
            # this strategy's own share: the (shared) routing, its planning, simulation and composition
            "strategy_cpu_s": k["routing"] + k["plan"] + k["simulate"] + k["compose"],
            "routing_cpu_s": k["routing"], "plan_cpu_s": k["plan"], "simulate_cpu_s": k["simulate"],
            "compose_cpu_s": k["compose"],
            "floor_per_layer_cpu_s": {"routing": k["routing"] / n, "plan": k["plan"] / n,
                                      "simulate": k["simulate"] / n},
            "step_time_us": d["step_time_us"]})
    return rows


def routing_only(case: str, moe_layers: int = 0) -> dict:
    """Only the step's routing: each MoE layer generated as the step generates it (the same
    builder, seed and split over the ranks), nothing planned: the per-layer generation floor,
    with the spread over layers (some need the realised-maxvio refinement)."""
    import moonep_sim.step.run  # noqa: F401  (imported by the step before it generates: not timed here)
    from moonep_sim.experiments.step import GeneratedLayer

    c = CASES[case]
    sc = Scenario(routing=GeneratorSpec(**c["spec"]), cluster=c["cluster"], topology="h800-cx7",
                  strategies=["alltoall"])
    rs = sc.resolved
    n = moe_layers or rs.source.model.moe_layers
    load0 = os.getloadavg()[0]
    per = []
    t0 = time.perf_counter()
    for i in range(n):
        c0 = cpu_s()
        GeneratedLayer(rs.source, i, rs.cluster.ranks)()
        per.append(cpu_s() - c0)
    return {"case": case + (f" (first {n} MoE layers)" if moe_layers else ""), "routing_only": True,
            "layers": n, "cpu_s": sum(per), "wall_s": time.perf_counter() - t0, "load_start": load0,
            "load_end": os.getloadavg()[0], "per_layer_cpu_s": {"mean": sum(per) / n, "min": min(per),
                                                                "max": max(per), "median": sorted(per)[n // 2]}}


def main() -> None:
    from moonep_sim.memory import prefer_small_pages, reuse_freed_memory

    prefer_small_pages()  # as the CLI does (moonep_sim/memory.py)
    reuse_freed_memory()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="k3-train,v3-decode")
    ap.add_argument("--strategies", default="alltoall,deepep,moonep")
    ap.add_argument("--distinct-layers", default="0,4", help="comma list; 0 = every layer its own")
    ap.add_argument("--together", action="store_true", help="all strategies in one step (routing shared)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--moe-layers", type=int, default=0, metavar="N",
                    help="cut the model to its first N MoE layers (a quick run, named in the row; 0 = all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--routing-only", action="store_true",
                    help="time only the step's routing (every MoE layer generated as the step does, none planned)")
    a = ap.parse_args()
    strategies = a.strategies.split(",")
    rows = []
    for case in a.cases.split(",") if a.routing_only else []:
        rows.append(routing_only(case, a.moe_layers))
        print(json.dumps(rows[-1]), flush=True)
    for case in a.cases.split(",") if not a.routing_only else []:
        for distinct in (int(x) for x in a.distinct_layers.split(",")):
            groups = [strategies] if a.together else [[s] for s in strategies]
            for g in groups:
                for r in run(case, g, distinct, a.jobs, a.moe_layers):
                    print(json.dumps(r), flush=True)
                    rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "load_end": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
