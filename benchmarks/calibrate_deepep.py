"""Simulated vs published DeepEP normal-kernel bandwidths on the ``h800-cx7`` topology.

Usage: ``python benchmarks/calibrate_deepep.py [--tokens 4096] [--seed 0] [--json OUT]``

DeepEP's published setup (../shared ANCHORS): 4096 tokens per rank, hidden 7168, 256 experts,
top-8 experts within the top-``min(nodes, 4)`` node groups (|N(0,1)| + 1 scores, one expert group
per node, as DeepEP's ``tests/test_internode.py`` draws them), FP8 dispatch, BF16 combine. Each kernel is timed alone (``SimOptions(isolate=...)``: all
ranks start together, no planning, no compute), and bandwidth is counted as DeepEP counts it:

- intranode (NVLink): rows each rank receives (its last-hop rows, its own included) x row bytes;
- internode (RDMA): unique (token, destination node) pairs of the rank's tokens, *local node
  included*, x row bytes;

with fp8 rows ``hidden * (1 + 4/128)`` bytes for dispatch and bf16 rows ``2 * hidden`` for combine,
averaged over ranks. The ``deepep`` strategy is used (``alltoall`` with dedup if it is missing).
Constants: see ``moonep-sim topologies``; ``nvlink.efficiency`` of h800-cx7 is FITTED on the
intranode dispatch row; the other three rows are checks. ``benchmarks/fidelity_gpu.py`` is the full
leave-one-out table (every anchor row, each constant fitted on one named row).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from moonep_sim.models import get_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.sim import SimOptions, load_topology, simulate_layer
from moonep_sim.strategies import PlanContext, available, make_plan

CHUNKS = 1  # DeepEP's relays forward rows as they arrive: the deepep Plan declares relayed hops (no chunk knob)

PUBLISHED = [  # (type, EP, dispatch GB/s, combine GB/s, counted link)
    ("intranode", 8, 153.0, 158.0, "NVLink"),
    ("internode", 16, 43.0, 43.0, "RDMA"),
]


def deepep_routing(R: int, tokens: int, seed: int, E: int = 256, K: int = 8, groups: int | None = None,
                   topk_groups: int | None = None):
    """DeepEP's test routing: scores |N(0,1)| + 1, top-`topk_groups` groups by max score, top-K inside;
    by default one group per node (8 GPUs) and ``min(nodes, 4)`` groups kept, as DeepEP's tests do
    (a single node: 8 groups, top 4, the intranode test's setting)."""
    nodes = max(R // 8, 1)
    groups = groups or (nodes if nodes > 1 else 8)
    topk_groups = topk_groups or (min(nodes, 4) if nodes > 1 else 4)
    rng = np.random.default_rng(seed)
    T = R * tokens
    scores = np.abs(rng.standard_normal((T, E)).astype(np.float32)) + 1
    gs = scores.reshape(T, groups, E // groups).max(axis=2)
    keep = np.argpartition(-gs, topk_groups - 1, axis=1)[:, :topk_groups]
    mask = np.zeros((T, groups), bool)
    np.put_along_axis(mask, keep, True, axis=1)
    masked = np.where(np.repeat(mask, E // groups, axis=1), scores, -np.inf)
    ids = np.argpartition(-masked, K - 1, axis=1)[:, :K].astype(np.int64)
    w = np.full((T, K), 1.0 / K, np.float32)
    return GlobalRouting.split_evenly(ids, w, E, R)


def simulate_row(kind: str, R: int, tokens: int = 4096, seed: int = 0, topology: str = "h800-cx7",
                 chunks: int = CHUNKS) -> dict:
    m = get_model("deepseek-v3")
    topo = load_topology(topology)
    routing = deepep_routing(R, tokens, seed)
    G = min(8, R)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(256, R), RowCosts.from_model(m, "fp8"), 1)
    strategy = "deepep" if "deepep" in available() else "alltoall"
    plan = make_plan(strategy, routing, ctx, **({} if strategy == "deepep" else {"dedup": True}))
    t_d = simulate_layer(plan, topo, m, SimOptions(isolate="dispatch", chunks=chunks)).layer_time_us
    t_c = simulate_layer(plan, topo, m, SimOptions(isolate="combine", chunks=chunks)).layer_time_us
    H = m.hidden
    fp8_row, bf16_row = H * (1 + 4 / 128), 2 * H
    if kind == "intranode":
        rows = plan.hops[-1].dst_rows_R.astype(float).mean()
    else:
        node = (np.arange(R) // G)[:, None]
        ids = routing.topk_ids_TK
        dst_node = (ids // (256 // R)) // G
        srt = np.sort(dst_node, axis=1)
        pairs = 1 + (srt[:, 1:] != srt[:, :-1]).sum(axis=1)      # unique nodes per token, local included
        rows = pairs.sum() / R
        del node
    return dict(type=kind, ep=R, strategy=strategy, dispatch_us=t_d, combine_us=t_c,
                dispatch_GBps=rows * fp8_row / t_d / 1e3, combine_GBps=rows * bf16_row / t_c / 1e3,
                counted_rows_per_rank=float(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunks", type=int, default=CHUNKS)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    topo = load_topology("h800-cx7")
    print(f"topology h800-cx7: NVLink {topo.nvlink_bandwidth_GBps:g} GB/s x {topo.nvlink_efficiency:g} (fitted), "
          f"NIC {topo.nic_bandwidth_GBps:g} GB/s x {topo.nic_efficiency:g} (assumed)")
    print(f"{'type':<10} {'EP':>3} {'link':<7} {'dispatch sim':>12} {'published':>9} {'err':>6}   "
          f"{'combine sim':>11} {'published':>9} {'err':>6}  strategy")
    out = []
    for kind, R, pd, pc, link in PUBLISHED:
        r = simulate_row(kind, R, a.tokens, a.seed, chunks=a.chunks)
        r.update(published_dispatch_GBps=pd, published_combine_GBps=pc, link=link)
        out.append(r)
        ed, ec = r["dispatch_GBps"] / pd - 1, r["combine_GBps"] / pc - 1
        print(f"{kind:<10} {R:>3} {link:<7} {r['dispatch_GBps']:>12.1f} {pd:>9.0f} {100 * ed:>+5.0f}%   "
              f"{r['combine_GBps']:>11.1f} {pc:>9.0f} {100 * ec:>+5.0f}%  {r['strategy']}")
    if a.json:
        from moonep_sim.io import write_text_atomic
        write_text_atomic(a.json, json.dumps(out, indent=2), what="--json")


if __name__ == "__main__":
    main()
