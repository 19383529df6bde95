"""Serving speed: the step-time model's build, a 1,000-request run and a deployment search
(docs/results/serve.md).

Cases:

- ``build``: DeepSeek-V3 on h800-cx7, disaggregated, one prefill and one decode worker of EP32
  (``examples/serve/deepseek-v3-disagg-ep32.toml``), strategies alltoall and deepep, generated
  routing (``sigma=0.5``) with 3 draws per grid point: the step-time model of both pools built
  afresh into an empty cache folder with ``--jobs 2`` (wall and CPU seconds of the command and its
  workers);
- ``serve``: 1,000 requests at ISL 1024 / OSL 1024, Poisson at 20 requests/s, every iteration on
  its own routing draw, both strategies, the model read from that cache (wall and CPU seconds of
  the engine runs alone, and of the whole command);
- ``search``: ``moonep-sim serve --search --gpus 64`` over 100 deployments x 2 strategies with
  ``--jobs 2``, 500 requests each (step-time models built afresh, then again from the cache).

Every case runs the command as a user types it, in a fresh process (``benchmarks/_cli.py``: wall
seconds and the child's own CPU seconds, the command printed); ``build`` and ``serve`` also give the
in-process figure the command's JSON reports of its own work (``timing``: the step-time model's
build, the engine runs) and command / in-process. The machine's load average is printed before and
after each case, and at the end the three figures against their targets (build <= 60 s, 1,000
requests <= 10 s, a search of 100 deployments <= 2 minutes).

    python benchmarks/bench_serve.py [--case build,serve,search] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEP = REPO / "examples" / "serve" / "deepseek-v3-disagg-ep32.toml"
sys.path.insert(0, str(REPO / "benchmarks"))
from _cli import beside, report_line, time_command  # noqa: E402  (the shared fresh-process timing)


def _load() -> float:
    return os.getloadavg()[0]


def _run(argv: list[str]) -> tuple[float, float, dict, str]:
    """``moonep-sim argv --json FILE --quiet`` in a fresh process: wall and CPU seconds, the JSON
    document, the command."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    r = time_command([*argv, "--json", out, "--quiet"], env=dict(os.environ, MOONEP_SIM_QUIET="1"))
    doc = json.loads(Path(out).read_text())
    os.unlink(out)
    return r["wall_s"], r["cpu_s"], doc, r


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
            "1024", "--slo", "ttft=2s,tpot=50ms", "--draws", "3", "--cache", cache, "--jobs", "2"]
    rows = {}
    if "build" in cases or "serve" in cases:
        l0 = _load()
        wall, cpu, doc, cli = _run(base)
        t = doc["timing"]
        rows["build"] = {"wall_s": t["steptime_build_s"], "cpu_s": t["steptime_build_cpu_s"],
                         **beside(cli, t["steptime_build_s"] + t["serve_s"],
                                  t["steptime_build_cpu_s"] + t["serve_cpu_s"], "the command's own build + engine timing"),
                         "load_before": l0,
                         "load_after": _load(), "target_s": 60,
                         "grid": {k: v["grid"] for k, v in doc["steptime"].items()},
                         "holdout_median_abs_rel_error": doc["steptime_model_error"]}
        print(report_line(rows["build"]), flush=True)
        l0 = _load()
        wall, cpu, doc, cli = _run(base)
        t = doc["timing"]
        rows["serve"] = {**beside(cli, t["serve_s"], t["serve_cpu_s"], "the command's own engine timing"),
                         "engine_wall_s": t["serve_s"], "engine_cpu_s": t["serve_cpu_s"], "command_wall_s": wall,
                         "command_cpu_s": cpu, "load_before": l0, "load_after": _load(), "target_s": 10,
                         "cached": all(v["cached"] for v in doc["steptime"].values()),
                         "iterations": {s: f["iterations"] for s, f in doc["strategies"].items()},
                         "requests": doc["setup"]["n_requests"], "strategies": list(doc["strategies"])}
        print(report_line(rows["serve"]), flush=True)
        print(json.dumps(rows, indent=1), flush=True)
    if "search" in cases:
        s_cache = tempfile.mkdtemp(prefix="moonep-serve-search-")
        argv = ["serve", "--model", "deepseek-v3", "--topology", "h800-cx7", "--gpus", "64", "--search",
                "--max-deployments", str(args.deployments), "--strategies", "alltoall,deepep", "--rate", "20",
                "--num-requests", "500", "--isl", "1024", "--osl", "1024", "--slo", "ttft=2s,tpot=50ms", "--draws",
                "2", "--jobs", "2", "--cache", s_cache]
        for label in ("search_cold", "search_cached"):
            l0 = _load()
            wall, cpu, doc, cli = _run(argv)
            rows[label] = {"cli_command": cli["command"], "wall_s": wall, "cpu_s": cpu, "load_before": l0, "load_after": _load(), "target_s": 120,
                           "deployments": doc["setup"]["deployments"], "points": doc["setup"]["points"],
                           "best": {s: doc["points"][i]["deployment"] for s, i in doc["best"].items()},
                           "differs": [d["text"] for d in doc["differs"]]}
            print(f"command: {cli['command']}\n  {wall:.1f} s wall, {cpu:.1f} CPU s (no in-process figure: the "
                  "search is only the command)")
            print(json.dumps({label: rows[label]}, indent=1), flush=True)
    print(summary(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def summary(rows: dict) -> str:
    """The three figures against their targets, with the machine's load (what the results page quotes)."""
    out = [f"serve speed on {os.cpu_count()} cores (wall and CPU seconds of the command and its workers):"]
    b, s, c = rows.get("build"), rows.get("serve"), rows.get("search_cold")
    if b:
        out.append(f"  step-time model build (both pools, both strategies, --jobs 2): {b['wall_s']:.1f} s wall, "
                   f"{b['cpu_s']:.1f} CPU s; target <= 60 s: {'met' if b['wall_s'] <= 60 else 'NOT met'} "
                   f"(whole command {b['cli_wall_s']:.1f} s; load {b['load_before']:.1f} -> {b['load_after']:.1f})")
    if s:
        out.append(f"  1,000 requests x 2 strategies from the built model (engine): {s['engine_wall_s']:.2f} s wall, "
                   f"{s['engine_cpu_s']:.2f} CPU s; target <= 10 s: {'met' if s['engine_wall_s'] <= 10 else 'NOT met'}"
                   f" (whole command {s['command_wall_s']:.1f} s; load {s['load_before']:.1f} -> {s['load_after']:.1f})")
    if c:
        out.append(f"  search of {c['deployments']} deployments x {c['points'] // max(c['deployments'], 1)} strategies, "
                   f"--jobs 2, models built afresh: {c['wall_s']:.1f} s wall, {c['cpu_s']:.1f} CPU s; target <= 120 s: "
                   f"{'met' if c['wall_s'] <= 120 else 'NOT met'} (load {c['load_before']:.1f} -> {c['load_after']:.1f})")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
