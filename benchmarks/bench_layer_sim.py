"""The step's layer simulation outside the network's ticks: CPU seconds per MoE layer, replayed.

``moonep_sim.step.layer_sim.simulate_moe_layer`` is everything between a Plan and the numbers the
step composes: the StepSim's setup (stage programs, each hop's per-pair rows, the port map and the
flow network), its simpy processes and events per rank, the flows they submit, the network's ticks
(``FlowNetwork._tick``: the rate solver, timed apart here) and the read-back (per-rank segments,
straggler). This bench builds a step's layers as the step does (``Scenario.step``, one job, every
layer its own generated routing), keeps each layer's Plan and inputs, then replays
``simulate_moe_layer`` on them ``--repeat`` times and reports the best run's CPU seconds per layer
(user + sys of this process, ``time.process_time``): in total, in the network's ticks, and the rest
(the non-tick part). Every replay must return the very result the step got (checked field by field).

Cases:

- ``k3-train``: Kimi K3 EP64 (8 nodes of 8, h800-cx7), train (forward and backward), 4096 tokens
  per rank, maxvio 2, ``--overlap shared-expert``, the model cut to ``--k3-layers`` MoE layers
  (default 2: a K3 layer's Plan holds ~150 MB);
- ``v3-decode``: DeepSeek-V3 EP32 (4 nodes of 8), decode, 32 sequences per rank, context 4096,
  all 58 MoE layers.

::

    python benchmarks/bench_layer_sim.py --json OUT.json
    python benchmarks/bench_layer_sim.py --cases v3-decode --strategies alltoall,deepep --repeat 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from moonep_sim.experiments import GeneratorSpec, Scenario
import moonep_sim.sim.network as network
import moonep_sim.step.layer_sim as layer_sim
import moonep_sim.step.layer_work as step_work

CASES = {
    "k3-train": dict(scenario=dict(routing=GeneratorSpec(model="kimi-k3", maxvio=2.0, tokens_per_rank=4096, layers=92),
                                   cluster="64/8", topology="h800-cx7"),
                     step=dict(mode="train", overlap="shared-expert")),
    "v3-decode": dict(scenario=dict(routing=GeneratorSpec(model="deepseek-v3", maxvio=1.0, tokens_per_rank=32, layers=58),
                                    cluster="32/8", topology="h800-cx7"),
                      step=dict(mode="decode", overlap="none", context=4096)),
}


def capture(case: str, strategy: str, k3_layers: int) -> list[tuple]:
    """Each MoE layer's ``simulate_moe_layer`` arguments and result, as the step ran them."""
    spec = CASES[case]
    sc = Scenario(strategies=[strategy], **spec["scenario"])
    extra = {}
    if case == "k3-train":
        m = sc.resolved.source.model
        extra["model"] = dataclasses.replace(m, layers=m.dense_layers + k3_layers, moe_layers=k3_layers)
    out = []
    inner = step_work.simulate_moe_layer

    def keep(*a, **k):
        r = inner(*a, **k)
        out.append((a, k, r))
        return r

    step_work.simulate_moe_layer = keep
    try:
        sc.step(distinct_layers=0, jobs=1, **spec["step"], **extra)
    finally:
        step_work.simulate_moe_layer = inner
    return out


def same(a, b, path="result") -> None:
    """Raise unless ``a`` and ``b`` are equal field by field (arrays element-wise, tuples and lists item by
    item, floats exactly)."""
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        if a.keys() != b.keys():
            raise AssertionError(f"{path}: keys differ")
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (tuple, list)) and any(isinstance(x, np.ndarray) for x in a):
        if len(a) != len(b):
            raise AssertionError(f"{path}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        if a.dtype != b.dtype or not np.array_equal(a, b, equal_nan=True):
            raise AssertionError(f"{path}: arrays differ")
    elif isinstance(a, (tuple, list)):
        if type(a) is not type(b) or len(a) != len(b):
            raise AssertionError(f"{path}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif a != b and not (isinstance(a, float) and np.isnan(a) and np.isnan(b)):
        raise AssertionError(f"{path}: {a!r} != {b!r}")


def replay(layers: list[tuple], repeat: int) -> dict:
    """Best of ``repeat`` replays (by non-tick CPU): total, tick and non-tick CPU s per layer."""
    tick_s = [0.0]
    inner = network.FlowNetwork._tick

    def timed(self, version):
        t = time.process_time()
        inner(self, version)
        tick_s[0] += time.process_time() - t

    network.FlowNetwork._tick = timed
    best = None
    try:
        for _ in range(repeat):
            tick_s[0] = 0.0
            t0 = time.process_time()
            for a, k, ref in layers:
                same(ref, layer_sim.simulate_moe_layer(*a, **k))
            total = time.process_time() - t0
            run = (total - tick_s[0], total, tick_s[0])
            best = run if best is None or run[0] < best[0] else best
    finally:
        network.FlowNetwork._tick = inner
    n = max(len(layers), 1)
    return dict(layers=len(layers), total_cpu_s_per_layer=best[1] / n, tick_cpu_s_per_layer=best[2] / n,
                nontick_cpu_s_per_layer=best[0] / n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="k3-train,v3-decode")
    ap.add_argument("--strategies", default="alltoall,deepep,moonep")
    ap.add_argument("--k3-layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    for case in a.cases.split(","):
        if case not in CASES:
            print(f"--cases ({case!r}) must be among {sorted(CASES)}", file=sys.stderr)
            return 2
        for strategy in a.strategies.split(","):
            layers = capture(case, strategy, a.k3_layers)
            load = os.getloadavg()[0]
            row = dict(case=case, strategy=strategy, **replay(layers, a.repeat), load_start=load,
                       load_end=os.getloadavg()[0])
            del layers
            rows.append(row)
            print(json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
