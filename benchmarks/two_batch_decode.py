"""Where two-batch overlap makes a low-latency decode step faster than the unsplit batch, and why.

Usage::

    python benchmarks/two_batch_decode.py [--topology h800-cx7] [--ranks 16,32,64,128]
        [--tokens 16,32,64,128,256] [--weights fp8,bf16] [--explain RANKS,TOKENS]

DeepSeek-V3's MoE layers (2, no dense layer or head: the layers the overlap changes), ``deepep-ll``
(DeepEP's low-latency kernels in hook mode), FP8 GEMMs, generated routing (seed 0, maxvio 1.5), the
same routing for both schedules; the step's default cost model (AIConfigurator's measured tables
where installed). Prints the unsplit step, the two-batch step and the change per (ranks, tokens,
weights); with ``--explain`` the per-op timeline of one point (``overlap_by_op``): each compute op's
time in both schedules and the communication two-batch hides.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decode(overlap: str, routing, ranks: int, tokens: int, topo, weights: str) -> dict:
    from moonep_sim.models import get_model
    from moonep_sim.plan import ClusterShape, Placement, RowCosts
    from moonep_sim.step import StepConfig, simulate_step, step_shape
    from moonep_sim.step.costs import step_cost_model
    from moonep_sim.step.dtypes import get_dtype
    from moonep_sim.strategies import PlanContext

    m = dataclasses.replace(get_model("deepseek-v3"), layers=2, moe_layers=2, vocab=0)
    ctx = PlanContext(ClusterShape(ranks, 8), Placement.home_groups(m.num_experts, ranks),
                      RowCosts.from_model(m, "fp8"), 1, topo)
    costs = step_cost_model(topo, "fp8", mode="decode", weight_bytes=get_dtype(weights).weight_bytes)
    cfg = StepConfig(m, topo, ctx, (("deepep-ll", {}),), step_shape(m, "decode", tokens, 4096), overlap, costs)
    return simulate_step(cfg, lambda i: (0, routing, "layer"))["strategies"]["deepep-ll"]


def routing(ranks: int, tokens: int, seed: int = 0, maxvio: float = 1.5):
    from moonep_sim.plan import GlobalRouting
    from moonep_sim.routing import generate_layer

    lr = generate_layer(256, 8, tokens * ranks, seed, maxvio=maxvio)
    return GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, 256, ranks)


def main(argv: list[str] | None = None) -> int:
    from moonep_sim.sim.topology import load_topology

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="h800-cx7")
    ap.add_argument("--ranks", default="16,32,64,128")
    ap.add_argument("--tokens", default="16,32,64,128,256")
    ap.add_argument("--weights", default="fp8,bf16")
    ap.add_argument("--explain", default="", help="RANKS,TOKENS: print that point's per-op timeline (fp8 weights)")
    a = ap.parse_args(argv)
    topo = load_topology(a.topology)
    print(f"{'ranks':>5} {'tokens':>6} {'weights':>7} {'none us':>10} {'two-batch us':>12} {'change':>8}")
    for R in (int(x) for x in a.ranks.split(",")):
        for w in a.weights.split(","):
            for T in (int(x) for x in a.tokens.split(",")):
                r = routing(R, T)
                n, t = decode("none", r, R, T, topo, w), decode("two-batch", r, R, T, topo, w)
                print(f"{R:5d} {T:6d} {w:>7} {n['step_time_us']:10.1f} {t['step_time_us']:12.1f} "
                      f"{t['step_time_us'] / n['step_time_us'] - 1:+8.1%}", flush=True)
    if a.explain:
        R, T = (int(x) for x in a.explain.split(","))
        r = routing(R, T)
        n, t = decode("none", r, R, T, topo, "fp8"), decode("two-batch", r, R, T, topo, "fp8")
        on = {(o["stream"], o["op"]): o for o in n["overlap_by_op"]}
        print(f"\nEP{R}, {T} tokens per rank, fp8: none {n['step_time_us']:.1f} us = compute {n['compute_us']:.1f} + "
              f"exposed {n['exposed_comm_us']:.1f}; two-batch {t['step_time_us']:.1f} us = compute "
              f"{t['compute_us']:.1f} + exposed {t['exposed_comm_us']:.1f}")
        print(f"{'op':14s} {'stream':7s} {'none us':>9} {'two us':>9} {'hidden':>8} {'SM us':>7}")
        for o in t["overlap_by_op"]:
            b = on.get((o["stream"], o["op"]), {})
            print(f"{o['op']:14s} {o['stream']:7s} {b.get('us', 0.0):9.1f} {o['us']:9.1f} {o['hidden_us']:8.1f} "
                  f"{o['sm_us']:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
