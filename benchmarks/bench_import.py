"""Import speed of record logs as they come (`python benchmarks/bench_import.py [--records N]`).

Two synthetic logs are written to a temporary folder and imported; times are printed per phase
(parse = reading JSON lines, the one per-record Python step; the rest is vectorised):

- `vllm-batch`: a batch-level hook (constant `req_id`, `token_idx` restarting every forward pass),
  4 layers, three profiling passes of 2048 rows with one expert set and random non-uniform weights,
  graph-capture passes of 512..8 rows, then prefills of 1024 rows and decode passes of 64 rows;
- `requests`: per-request ids and growing positions, continuous batching (a new request joins
  every 4th pass, at most 64 running), 4 layers.

E=64, K=8. Prints `uptime` first: the machine is shared.

Unless ``--no-cli``, each log is also imported as a user imports it, in a fresh process
(``benchmarks/_cli.py``): ``moonep-sim trace import LOG --num-experts 64 -o OUT --json``, its wall and
CPU seconds beside the in-process ``load_source`` (which writes no file) and command / in-process,
and whether the command's import report keeps the same tokens and steps.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import beside, report_line, time_command  # noqa: E402  (the shared fresh-process timing)

from moonep_sim.routing.importers import load_source
from moonep_sim.routing.importers.records import parse_records

E, K, L = 64, 8, 4


def _write(path, passes, rng, constant_req):
    with open(path, "w") as f:
        for rows, dummy in passes:
            ids_L = []
            for _ in range(L):
                if dummy:
                    ids_L.append(np.tile(np.sort(rng.choice(E, K, replace=False)), (len(rows), 1)))
                else:
                    ids_L.append(np.argsort(rng.random((len(rows), E)), axis=1)[:, :K])
            for li in range(L):
                w = rng.random((len(rows), K)).round(4)
                for j, (req, pos) in enumerate(rows):
                    f.write(json.dumps({"type": "route", "req_id": "r0" if constant_req else f"r{req}",
                                        "token_idx": pos, "layer": li, "topk_ids": ids_L[li][j].tolist(),
                                        "topk_weights": w[j].tolist()}) + "\n")


def logs(records: int, rng):
    batch = [([(0, i) for i in range(n)], True) for n in (2048, 2048, 2048, 512, 256, 128, 64, 32, 16, 8)]
    n = sum(len(r) for r, _ in batch) * L
    while n < records:
        rows = [(0, i) for i in range(1024 if len(batch) % 40 == 10 else 64)]
        batch.append((rows, False))
        n += len(rows) * L
    req, running, nxt, p = [], {}, 0, 0
    n = 0
    while n < records:
        rows = [(r, running[r]) for r in sorted(running)]
        for r in running:
            running[r] += 1
        if p % 4 == 0:
            rows += [(nxt, i) for i in range(32)]
            running[nxt] = 32
            nxt += 1
            if len(running) > 64:
                running.pop(min(running))
        req.append((rows, False))
        n += len(rows) * L
        p += 1
    return {"vllm-batch": (batch, True), "requests": (req, False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--no-cli", action="store_true", help="skip the command timed in a fresh process")
    args = ap.parse_args()
    print("uptime:", os.popen("uptime").read().strip())
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        for name, (passes, constant) in logs(args.records, rng).items():
            path = os.path.join(d, f"{name}.jsonl")
            _write(path, passes, rng, constant)
            size = os.path.getsize(path) / 2**20
            t0 = time.perf_counter()
            r = parse_records(__import__("pathlib").Path(path))
            t1, c1 = time.perf_counter(), time.process_time()
            imp = load_source(path, num_experts=E)
            t2, c2 = time.perf_counter(), time.process_time()
            rep = imp.meta.import_report
            print(f"{name}: {len(r['ids_NK'])} records ({size:.1f} MiB), {rep['tokens']} tokens kept in "
                  f"{rep['steps']} steps (generated: {sum(1 for _, dm in passes if not dm)} real passes), "
                  f"dummy records dropped {rep['dummy_records_dropped']}; parse {t1 - t0:.2f} s, "
                  f"whole import {t2 - t1:.2f} s (steps, dummy blocks, checks: {t2 - t1 - (t1 - t0):.2f} s)")
            if not args.no_cli:  # beside the whole import in process (load_source: parse included)
                cli = time_command(["trace", "import", path, "--num-experts", str(E), "-o",
                                    os.path.join(d, f"{name}.safetensors"), "--json"])
                got = json.loads(cli["stdout"])["import_report"]
                same = got.get("tokens") == rep["tokens"] and got.get("steps") == rep["steps"]
                print("  " + report_line(beside(cli, t2 - t1, c2 - c1, "in-process load_source (no file written)"))
                      .replace("\n", "\n  ") + f"; {'same tokens and steps' if same else 'IMPORT DIFFERS'}")


if __name__ == "__main__":
    main()
