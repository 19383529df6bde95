"""Trace generation, import and inspect speeds (prints one line per measurement).

    python benchmarks/bench_generate.py [--tokens 64x8192] [--maxvio 1.0]

Default: a Kimi-K3-shaped layer (E=896, K=16) for 64 ranks x 8192 tokens = 524288 tokens
(8.4M (token, k) entries), MoonEP's method at maxvio 1; one sampling pass of the fast
Plackett-Luce path and of the exponential race (the reference sampler, which groups and logits
take) on the same popularity, in CPU seconds in the same run; then the imports of the real files
(when ../shared/traces/real exists) and `inspect` of the generated layer written to disk.

Unless ``--no-cli``, three of them are also timed as a user runs them, in a fresh process each
(``benchmarks/_cli.py``), each line giving the command, its wall and CPU seconds, the in-process
figure and command / in-process: ``moonep-sim trace gen`` beside ``generate_trace`` (the same
file: its arrays must be identical), ``moonep-sim trace inspect --json`` beside ``inspect_trace``,
and ``moonep-sim trace import -o`` of each real file beside ``load_source`` (which writes no file).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import beside, report_line, time_command  # noqa: E402  (the shared fresh-process timing)

from moonep_sim.routing.generators import generate, generate_trace
from moonep_sim.routing.sampling import sample_topk_grouped, sample_topk_pl, sample_topk_race
from moonep_sim.routing.importers import load_source
from moonep_sim.routing.metrics import inspect_trace

REAL = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real"


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def cpu_timed(fn):
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def both_timed(fn):
    """(result, wall s, CPU s) of ``fn()`` in this process."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def same_arrays(a: Path, b: Path) -> bool:
    """Whether two trace files hold the same tensors (names, dtypes, values)."""
    from safetensors.numpy import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64x8192")
    ap.add_argument("--maxvio", type=float, default=1.0)
    ap.add_argument("--no-cli", action="store_true", help="skip the commands timed in fresh processes")
    a = ap.parse_args()
    T = 1
    for p in a.tokens.split("x"):
        T *= int(p)
    E, K = 896, 16
    g, s = timed(lambda: generate(E, K, T, seed=0, maxvio=a.maxvio))
    b = g.report["blocks"][0]
    print(f"generate E={E} K={K} T={T} ({T * K / 1e6:.1f}M entries) maxvio={a.maxvio}: {s:.2f} s "
          f"(realised maxvio {b['maxvio']:.4f}, sigma {b['sigma']:.4f}, {b['calibration_samples']} sampling pass(es))")
    _, s = timed(lambda: generate(E, K, T, seed=0, sigma=b["sigma"]))
    print(f"generate same shape, fixed sigma (one sampling pass): {s:.2f} s")
    logp = b["sigma"] * np.random.default_rng(0).standard_normal(E)
    _, fast = cpu_timed(lambda: sample_topk_pl(logp, K, T, np.random.default_rng(1)))
    _, race = cpu_timed(lambda: sample_topk_race(logp, K, T, np.random.default_rng(1)))
    print(f"one sampling pass, CPU s: Plackett-Luce fast path {fast:.2f} s, exponential race (reference) "
          f"{race:.2f} s ({race / max(fast, 1e-9):.1f}x)")
    _, s = timed(lambda: generate(E, K, T, seed=0, sigma=b["sigma"], groups=8, topk_groups=4))
    print(f"generate same shape, group-limited 4 of 8 groups: {s:.2f} s")
    _, fast = cpu_timed(lambda: sample_topk_grouped(logp, K, T, np.random.default_rng(1), groups=8, topk_groups=4))
    _, race = cpu_timed(lambda: sample_topk_race(logp, K, T, np.random.default_rng(1), groups=8, topk_groups=4))
    print(f"one group-limited sampling pass, CPU s: per-group races {fast:.2f} s, exponential race (reference) "
          f"{race:.2f} s ({race / max(fast, 1e-9):.1f}x)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k3.safetensors"
        _, s = timed(lambda: generate_trace(path, E, K, T, seed=0, sigma=b["sigma"]))
        print(f"generate + write trace ({path.stat().st_size / 2**20:.0f} MiB): {s:.2f} s")
        _, s = timed(lambda: inspect_trace(path, ranks=64, gpus_per_node=8))
        print(f"inspect that trace with --ranks 64 --gpus-per-node 8: {s:.2f} s")
        if not a.no_cli:
            mine, theirs = Path(d) / "inproc.safetensors", Path(d) / "cli.safetensors"
            _, w, c = both_timed(lambda: generate_trace(mine, E, K, T, seed=0, maxvio=a.maxvio))
            cli = time_command(["trace", "gen", "--num-experts", str(E), "--top-k", str(K), "--tokens", a.tokens,
                                "--seed", "0", "--maxvio", f"{a.maxvio:g}", "-o", str(theirs)])
            print(report_line(beside(cli, w, c, "in-process generate_trace"))
                  + f"; {'same arrays' if same_arrays(mine, theirs) else 'ARRAYS DIFFER'}")
            _, w, c = both_timed(lambda: inspect_trace(mine, ranks=64, gpus_per_node=8))
            cli = time_command(["trace", "inspect", str(mine), "--ranks", "64", "--gpus-per-node", "8", "--json"])
            print(report_line(beside(cli, w, c, "in-process inspect_trace")))
    if REAL.is_dir():
        for f in sorted(REAL.glob("*.json*")):
            imp, s = timed(lambda: load_source(f))
            n = imp.meta.import_report.get("records", "")
            print(f"import {f.name} ({f.stat().st_size / 1e6:.1f} MB{', %s records' % n if n else ''}): {s:.3f} s")
            if not a.no_cli:
                _, w, c = both_timed(lambda: load_source(f))
                with tempfile.TemporaryDirectory() as d:
                    cli = time_command(["trace", "import", str(f), "-o", str(Path(d) / "t.safetensors")])
                print(report_line(beside(cli, w, c, "in-process load_source (no file written)")))


if __name__ == "__main__":
    main()
