"""Step-model speed: CPU seconds for whole steps, per strategy (docs/results/steps.md).

Cases (the targets of the step model's issue):

- ``k3-train``: Kimi K3 EP64 (8 nodes of 8 on h800-cx7), train, 4096 tokens per rank, generated
  routing (maxvio 2) included, ``--overlap shared-expert``; with ``--distinct-layers N`` (default
  4: N layers generated, planned and simulated, the other MoE layers reusing them, flagged) and the
  per-layer floor measured in the same run (one layer's generation, planning and simulation), from
  which every-layer-its-own (92 layers) is extrapolated;
- ``v3-decode``: DeepSeek-V3 EP32 (4 nodes), decode, 32 sequences per rank, context 4096, every
  one of its 58 MoE layers its own (and with ``--distinct-layers``).

Each (case, strategy) runs in a fresh ``Scenario`` (its routing generated inside the timing).
Reported: process CPU seconds (user + sys) and wall seconds of that run, with the 1-minute load
average beside them (the reference machine is shared)::

    python benchmarks/bench_step.py --json OUT.json
    python benchmarks/bench_step.py --cases v3-decode --strategies alltoall
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from moonep_sim.experiments import GeneratorSpec, Scenario


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn):
    c, t = cpu_s(), time.perf_counter()
    out = fn()
    return out, cpu_s() - c, time.perf_counter() - t


def k3_train(strategy: str, distinct: int) -> dict:
    sc = Scenario(routing=GeneratorSpec(model="kimi-k3", maxvio=2.0, tokens_per_rank=4096, layers=92),
                  cluster="64/8", topology="h800-cx7", strategies=[strategy])
    res, cpu, wall = timed(lambda: sc.step("train", "shared-expert", distinct_layers=distinct))
    d = res.figures[strategy]
    # the floor: one layer's routing, plan and simulation (what every distinct layer costs)
    one = Scenario(routing=GeneratorSpec(model="kimi-k3", maxvio=2.0, tokens_per_rank=4096, layers=92, seed=7),
                   cluster="64/8", topology="h800-cx7", strategies=[strategy])
    _, fcpu, fwall = timed(lambda: one.step("train", "shared-expert", distinct_layers=1))
    return {"case": "k3-train", "strategy": strategy, "distinct_layers": distinct, "cpu_s": cpu, "wall_s": wall,
            "step_time_us": d["step_time_us"], "floor_one_layer_cpu_s": fcpu, "floor_one_layer_wall_s": fwall,
            "every_layer_own_cpu_s_extrapolated": fcpu * 92, "plan_s": d["wall_seconds"]["plan"],
            "simulate_s": d["wall_seconds"]["simulate"], "load": os.getloadavg()[0]}


def v3_decode(strategy: str, distinct: int) -> dict:
    sc = Scenario(routing=GeneratorSpec(model="deepseek-v3", maxvio=1.0, tokens_per_rank=32, layers=58),
                  cluster="32/8", topology="h800-cx7", strategies=[strategy])
    res, cpu, wall = timed(lambda: sc.step("decode", "none", context=4096, distinct_layers=distinct))
    d = res.figures[strategy]
    return {"case": "v3-decode", "strategy": strategy, "distinct_layers": distinct, "cpu_s": cpu, "wall_s": wall,
            "step_time_us": d["step_time_us"], "plan_s": d["wall_seconds"]["plan"],
            "simulate_s": d["wall_seconds"]["simulate"], "load": os.getloadavg()[0]}


def main() -> None:
    from moonep_sim.memory import prefer_small_pages

    prefer_small_pages()  # as the CLI does (moonep_sim/memory.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="k3-train,v3-decode")
    ap.add_argument("--strategies", default="alltoall,deepep,moonep")
    ap.add_argument("--distinct-layers", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for case in a.cases.split(","):
        for s in a.strategies.split(","):
            new = [k3_train(s, a.distinct_layers)] if case == "k3-train" else \
                [v3_decode(s, 0), v3_decode(s, a.distinct_layers)]
            for r in new:
                print(json.dumps(r))
            rows += new
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "load_end": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
