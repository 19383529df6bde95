"""How long a per-step comparison takes: a 100-step log compared across 6 strategies.

The log is the shipped OLMoE layer-0 trace (4,471 real tokens, E=64, K=8) cut into 100 consecutive
steps of 44-45 tokens (a decode-sized batch), written to a temporary trace; `compare` costs every
step as its own batch (the default) and, for reference, all of them merged into one batch.

    python benchmarks/bench_steps.py [--steps 100] [--jobs 1] [--json out.json]

Reports wall seconds, CPU seconds (user + sys of this process and its workers) and the load
average before and after, beside the machine's core count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from moonep_sim.experiments import Scenario
from moonep_sim.routing.trace import Trace, TraceMeta, write_trace

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "traces" / "olmoe-1b-7b_layer0.safetensors"
STRATEGIES = "alltoall,allgather,capacity,hierarchical,deepep,moonep"


def split_trace(src: Path, dest: Path, steps: int) -> Path:
    """``src``'s tokens cut into ``steps`` consecutive steps of (nearly) equal size."""
    tr = Trace(src)
    lr = tr.layer(0)
    T = lr.num_tokens
    step = (np.arange(T) * steps // T).astype(np.int32)
    meta = TraceMeta(kind="tokens", num_experts=tr.meta.num_experts, top_k=tr.meta.top_k, layer_ids=[0],
                     num_tokens=T, model=tr.meta.model, steps=f"{steps} consecutive slices of {src.name}",
                     source=f"benchmarks/bench_steps.py from {src.name}", attribution=tr.meta.attribution)
    return write_trace(dest, meta, {"topk_ids": lr.topk_ids_TK[None], "topk_weights": lr.topk_weights_TK[None],
                                    "step": step})


def cpu_s() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def timed(sc: Scenario, jobs: int) -> dict:
    c0, t0 = cpu_s(), time.perf_counter()
    rep = sc.compare(jobs=jobs).to_dict()
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    st = rep["steps"]
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "batches": len(st["costed_step_ids"]),
            "simulated_points": st["simulated_points"], "reused_points": st["reused_points"],
            "layer_time_us": {n: round(s["sim"]["layer_time_us_mean"], 1) for n, s in rep["strategies"].items()},
            "wins": st.get("wins")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--ranks", default="8/4")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = split_trace(SRC, Path(tmp) / "steps.safetensors", a.steps)
        sc = Scenario(routing=str(path), cluster=a.ranks, strategies=STRATEGIES)
        sc.resolved  # noqa: B018 -- open before timing
        per_step = timed(sc, a.jobs)
        merged = timed(Scenario(routing=str(path), cluster=a.ranks, strategies=STRATEGIES, steps="merged"), a.jobs)
    out = {"trace": f"{SRC.name} cut into {a.steps} steps", "strategies": STRATEGIES, "cluster": a.ranks,
           "topology": "h800-cx7", "jobs": a.jobs, "per_step": per_step, "merged": merged,
           "load_average": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]},
           "cores": os.cpu_count()}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
