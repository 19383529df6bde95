"""``fused-moe`` against DeepGEMM's published Mega MoE rows (docs/results/fused-moe.md).

DeepGEMM pull request 316 publishes its SM100 Mega MoE (FP8 activations x FP4 weights) on the
DeepSeek-V4-Flash MoE shape (256 experts, top-6, hidden 4096, expert FFN 2048) at EP8, per call,
averaged over the 8 ranks, at 1, 512 and 8192 tokens per rank. This script runs that shape through
the layer simulator on the ``b200`` preset (8 GPUs, one NVLink domain) with uniform routing, the
expert GEMMs at FP8 with MXFP4 weights (0.5 + 1/32 bytes per element), as ``fused-moe`` and as the
unfused ``deepep-ll`` chain, and prints each row's published time, the simulated one and the error.
No term was set on these rows: the figures are predictions (the floor is ASSUMED, 20 us).

    python benchmarks/fused_moe_rows.py
"""

from __future__ import annotations

from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.routing import generate_layer
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import CostModel
from moonep_sim.step.dtypes import get_dtype
from moonep_sim.step.layer_sim import simulate_moe_layer
from moonep_sim.strategies import PlanContext, make_plan

#: (tokens per rank, published us per call): DeepGEMM pull request 316, DeepSeek-V4-Flash, EP8.
ROWS = ((1, 56.5), (512, 146.5), (8192, 1283.1))
E, K, H, F, R = 256, 6, 4096, 2048, 8


def layer_us(strategy: str, tokens: int, topo, costs: CostModel) -> float:
    """The slowest rank's forward layer time (us) of ``strategy`` at ``tokens`` per rank."""
    m = ModelSpec("v4-flash-moe-shape", 1, 1, E, K, 0, H, F, attention="none", vocab=1000)
    lr = generate_layer(E, K, tokens * R, 0, uniform=1)
    r = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, E, R)
    ctx = PlanContext(ClusterShape(R, 8), Placement.home_groups(E, R), RowCosts.from_model(m), 1, topo)
    f = simulate_moe_layer(make_plan(strategy, r, ctx), m, topo, costs, False).forward
    return float((f.pre_R + f.expert_R + f.post_R).max())


def main() -> None:
    topo = load_topology("b200")
    costs = CostModel(topo, "fp8", weight_bytes=get_dtype("mxfp4").weight_bytes)
    print("| tokens/rank | published us | fused-moe us | error | deepep-ll chain us | chain / fused |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t, pub in ROWS:
        fu, ll = layer_us("fused-moe", t, topo, costs), layer_us("deepep-ll", t, topo, costs)
        print(f"| {t} | {pub} | {fu:.1f} | {100 * (fu / pub - 1):+.1f}% | {ll:.1f} | {ll / fu:.2f} |")


if __name__ == "__main__":
    main()
