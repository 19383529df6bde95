"""Serving speed: the step-time model's build, a 1,000-request run and a deployment search
(docs/results/serve.md).

Cases:

- ``build``: DeepSeek-V3 on h800-cx7, disaggregated, one prefill and one decode worker of EP32
  (``examples/serve/deepseek-v3-disagg-ep32.toml``), strategies alltoall and deepep, generated
  routing (``sigma=0.5``) with 3 draws per grid point: the step-time model of both pools built
  afresh into an empty cache folder (wall and CPU seconds);
- ``serve``: 1,000 requests at ISL 1024 / OSL 1024, Poisson at 20 requests/s, every iteration on
  its own routing draw, both strategies, the model read from that cache (wall and CPU seconds of
  the engine runs alone, and of the whole command);
- ``search``: ``moonep-sim serve --search --gpus 64`` over 100 deployments x 2 strategies with
  ``--jobs 2``, 500 requests each (step-time models built afresh, then again from the cache).

The machine's load average is printed before and after each case; timings are wall seconds of
this process and CPU seconds of it and its children.

    python benchmarks/bench_serve.py [--case build,serve,search] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEP = REPO / "examples" / "serve" / "deepseek-v3-disagg-ep32.toml"


def _cpu() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _load() -> float:
    return os.getloadavg()[0]


def _run(argv: list[str]) -> tuple[float, float, dict]:
    t0, c0 = time.perf_counter(), _cpu()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=str(REPO), MOONEP_SIM_QUIET="1")
    subprocess.run([sys.executable, "-m", "moonep_sim", *argv, "--json", out, "--quiet"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    doc = json.loads(Path(out).read_text())
    os.unlink(out)
    return time.perf_counter() - t0, _cpu() - c0, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="build,serve,search")
    ap.add_argument("--json", default=None)
    ap.add_argument("--deployments", type=int, default=100)
    args = ap.parse_args()
    cases = args.case.split(",")
    cache = tempfile.mkdtemp(prefix="moonep-serve-bench-")
    base = ["serve", "--model", "deepseek-v3", "--topology", "h800-cx7", "--gpus", "64", "--deployment", str(DEP),
            "--strategies", "alltoall,deepep", "--rate", "20", "--num-requests", "1000", "--isl", "1024", "--osl",
            "1024", "--slo", "ttft=2s,tpot=50ms", "--draws", "3", "--cache", cache]
    rows = {}
    if "build" in cases or "serve" in cases:
        l0 = _load()
        wall, cpu, doc = _run(base)
        t = doc["timing"]
        rows["build"] = {"wall_s": t["steptime_build_s"], "cpu_s": t["steptime_build_cpu_s"], "load_before": l0,
                         "load_after": _load(), "target_s": 60,
                         "grid": {k: v["grid"] for k, v in doc["steptime"].items()},
                         "holdout_median_abs_rel_error": doc["steptime_model_error"]}
        l0 = _load()
        wall, cpu, doc = _run(base)
        t = doc["timing"]
        rows["serve"] = {"engine_wall_s": t["serve_s"], "engine_cpu_s": t["serve_cpu_s"], "command_wall_s": wall,
                         "command_cpu_s": cpu, "load_before": l0, "load_after": _load(), "target_s": 10,
                         "cached": all(v["cached"] for v in doc["steptime"].values()),
                         "iterations": {s: f["iterations"] for s, f in doc["strategies"].items()},
                         "requests": doc["setup"]["n_requests"], "strategies": list(doc["strategies"])}
        print(json.dumps(rows, indent=1), flush=True)
    if "search" in cases:
        s_cache = tempfile.mkdtemp(prefix="moonep-serve-search-")
        argv = ["serve", "--model", "deepseek-v3", "--topology", "h800-cx7", "--gpus", "64", "--search",
                "--max-deployments", str(args.deployments), "--strategies", "alltoall,deepep", "--rate", "20",
                "--num-requests", "500", "--isl", "1024", "--osl", "1024", "--slo", "ttft=2s,tpot=50ms", "--draws",
                "2", "--jobs", "2", "--cache", s_cache]
        for label in ("search_cold", "search_cached"):
            l0 = _load()
            wall, cpu, doc = _run(argv)
            rows[label] = {"wall_s": wall, "cpu_s": cpu, "load_before": l0, "load_after": _load(), "target_s": 120,
                           "deployments": doc["setup"]["deployments"], "points": doc["setup"]["points"],
                           "best": {s: doc["points"][i]["deployment"] for s, i in doc["best"].items()},
                           "differs": [d["text"] for d in doc["differs"]]}
            print(json.dumps({label: rows[label]}, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
