"""Per-layer fidelity of the host-proxy kernel families on EFA against the p5.48xlarge rows.

Usage::

    python benchmarks/fidelity_efa.py             # the table, written to docs/results/fidelity-efa.md
    python benchmarks/fidelity_efa.py --no-write  # print only

The rows (``P5_ROWS``) are awslabs/awsome-distributed-ai@40e398b
``micro-benchmarks/expert-parallelism/ep-backend-comparison/RESULTS-p5.md``: DeepEP 567632d over
NVSHMEM 3.7.0's libfabric proxy (``deepep-nvshmem-efa``) and UCCL-EP at uccl 0dc87eb (``uccl-ep``) on
p5.48xlarge (``h100-efa``), each run through its repository's ``tests/test_internode.py`` (UCCL:
``ep/bench/test_internode.py``, derived from DeepEP's) at 4096 tokens per rank, hidden 7168, top-8 of
256 experts, ``min(nodes, 4)`` node groups, 24 SMs. The rows are per-layer figures, used here as a check
only: no constant is fitted on them.

Each point is simulated as that test measures it (both tests, read at those commits):

- **Time**: ``bench_kineto`` of the ``dispatch`` (``combine``) kernel alone, the count exchange
  (``notify``) timed apart and left out -- here ``SimOptions(isolate=...)``, each rank's own kernel time
  averaged over ranks (``fidelity_gpu.kernel_us``).
- **Bytes ("GB/s (RDMA)")**: ``num_rdma_token_sent * hidden * 2`` for BF16 dispatch and for combine: the
  rank's unique (token, destination node) pairs, its own node included, x 2H bytes -- not the bytes
  that cross the NIC (``fidelity_gpu.simulate``'s internode count). The collector
  (``collect_results.py``) takes the last "Best dispatch" line, which is BF16 (the test tunes FP8 first,
  then BF16), and the "Best combine" line.
- **Best chunk sizes**: the published figure is the best over the test's sweep of ``Config(24, nvl_chunk,
  nvl_buffer, rdma_chunk, rdma_buffer)``: dispatch ``nvl_chunk`` in 4, 8, ..., 44 x ``rdma_chunk`` in 4,
  8, ..., 32; combine ``nvl_chunk`` in 1..7 x ``rdma_chunk`` in 8, 12, ..., 32 (12.. at two nodes). The
  "swept" column runs the same grid (:data:`DISPATCH_GRID`, :data:`COMBINE_GRID`) and keeps the
  fastest; the "own table" column prices the family's default ``Config`` for the EP size (what a
  training step gets), which the test never runs.

The fitted host-proxy terms (``proxy_call_us``, ``proxy_GBps``, FITTED on development row 2) do not
enter: an isolated kernel has no host timeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import fidelity_gpu as fg  # noqa: E402
import fidelity_steps as fs  # noqa: E402

from moonep_sim.plan.kernel import RelayChunk  # noqa: E402
from moonep_sim.sim import SimOptions, load_topology, simulate_layer  # noqa: E402

SOURCE = ("awslabs/awsome-distributed-ai@40e398b micro-benchmarks/expert-parallelism/ep-backend-comparison/"
          "RESULTS-p5.md (2026-06-22, p5.48xlarge on EKS)")
#: (family, EP) -> published (dispatch, combine) GB/s, the RDMA leg of the test's best-config lines.
P5_ROWS = {("deepep-nvshmem-efa", 32): (43.7, 46.1), ("uccl-ep", 32): (38.2, 30.2),
           ("deepep-nvshmem-efa", 64): (39.6, 39.2), ("uccl-ep", 64): (29.9, 26.7)}
#: The tests' tuning sweep (deepseek-ai/DeepEP@567632d tests/test_internode.py, uccl@0dc87eb
#: ep/bench/test_internode.py, identical): (nvl_chunk, rdma_chunk) send tokens per channel.
DISPATCH_GRID = tuple((n, r) for n in range(4, 45, 4) for r in range(4, 33, 4))
COMBINE_GRID = tuple((n, r) for n in range(1, 8) for r in range(8, 33, 4))
TEST_SMS = 24
TOKENS = 4096
TOPOLOGY = "h100-efa"


def rdma_counted_bytes(plan) -> float:
    """Bytes per rank the tests count as "RDMA": unique (token, destination node) pairs of the rank's
    tokens, its own node included, x 2H (BF16 dispatch; combine counts the same)."""
    return plan.hops[0].src_rank_M.size / plan.ranks * 2 * fg.H


def with_chunk(plan, nvl: int, rdma: int):
    """``plan`` with its kernel's chunking replaced by one ``Config`` of the sweep (both directions)."""
    chunk = RelayChunk(plan.ranks, nvl, rdma, nvl, rdma)
    return dataclasses.replace(plan, kernel=dataclasses.replace(plan.kernel, chunks=(chunk,)))


def point(impl: str, ep: int, what: str, topo, seed: int = 0) -> dict:
    """One published point simulated as the test measures it: at the family's own chunk table and
    swept over the test's grid; GB/s as the test counts them, the best chunk pair, the bound."""
    plan, m = fg._normal_plan(topo, ep, TOKENS, TEST_SMS, "bf16", seed, impl)
    counted = rdma_counted_bytes(plan)

    def run(p):
        res = simulate_layer(p, topo, m, SimOptions(isolate=what))
        return fg.kernel_us(res), res.busiest_port["name"]

    own_us, own_bound = run(plan)
    grid = DISPATCH_GRID if what == "dispatch" else COMBINE_GRID
    times = [run(with_chunk(plan, n, r)) for n, r in grid]
    best = int(np.argmin([t for t, _ in times]))
    return dict(own=counted / own_us / 1e3, own_bound=own_bound, swept=counted / times[best][0] / 1e3,
                chunk=grid[best], bound=times[best][1])


def table(seed: int = 0) -> tuple[list[str], list[float], list[float]]:
    """Markdown rows of every published point and the signed errors (own table, swept)."""
    topo = load_topology(TOPOLOGY)
    lines = ["| family | EP | kernel | published | own chunk table | error | swept (best nvl, rdma chunk) | error "
             "| bound |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    own_err, swept_err = [], []
    for (impl, ep), pub in P5_ROWS.items():
        for what, p in zip(("dispatch", "combine"), pub):
            r = point(impl, ep, what, topo, seed)
            own_err.append(r["own"] / p - 1)
            swept_err.append(r["swept"] / p - 1)
            lines.append(f"| {impl} | {ep} | {what} | {p:g} | {r['own']:.1f} | {own_err[-1]:+.1%} | {r['swept']:.1f} "
                         f"({r['chunk'][0]}, {r['chunk'][1]}) | {swept_err[-1]:+.1%} | {r['bound']} |")
    return lines, own_err, swept_err


def order_lines(swept: dict) -> list[str]:
    """Whether the swept figures put NVSHMEM ahead of UCCL-EP per (EP, kernel), as published."""
    out = []
    for ep in (32, 64):
        for i, what in enumerate(("dispatch", "combine")):
            pub = P5_ROWS[("deepep-nvshmem-efa", ep)][i] > P5_ROWS[("uccl-ep", ep)][i]
            sim = swept[("deepep-nvshmem-efa", ep, what)] > swept[("uccl-ep", ep, what)]
            out.append(f"- EP{ep} {what}: published {'NVSHMEM' if pub else 'UCCL-EP'} faster; simulated "
                       f"{'NVSHMEM' if sim else 'UCCL-EP'} faster ({'same order' if pub == sim else 'ORDER DIFFERS'})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only (no docs/results/fidelity-efa.md)")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    t0, load0 = time.perf_counter(), os.getloadavg()
    lines, own_err, swept_err = table()
    swept = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        swept[(cells[0], int(cells[1]), cells[2])] = float(cells[6].split()[0])
    body = lines + ["", f"Median |error|: own chunk table {np.median(np.abs(own_err)):.1%}, swept as the test "
                    f"{np.median(np.abs(swept_err)):.1%} ({len(swept_err)} points).", ""] + order_lines(swept)
    print("\n".join(body))
    if not args.no_write:
        head = fs.page_head("Host-proxy kernels on EFA against the p5.48xlarge per-layer rows",
                            "python benchmarks/fidelity_efa.py", t0, load0, commit) + [
                f"- published: {SOURCE}; DeepEP's internode test, {TOKENS} tokens per rank, hidden 7168, top-8 of "
                f"256, BF16, {TEST_SMS} SMs, GB/s = unique (token, node) pairs (own node included) x 2H over the "
                "kernel's time, best over the test's chunk sweep",
                f"- simulated: `{TOPOLOGY}`, DeepEP's test routing (seed 0), each kernel alone; how and why: "
                "this script's docstring; the analysis: docs/results/host-proxies.md", ""]
        (ROOT / "docs" / "results" / "fidelity-efa.md").write_text("\n".join(head + body) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
