"""Simulator speed: wall seconds to simulate one Kimi K3 MoE layer (forward) against EP size.

Usage::

    python benchmarks/bench_sim.py [--ranks 8,16,32,64,128,256,512,1024] [--strategy alltoall]
        [--tokens-per-rank 8192] [--max-tokens 2097152] [--tol 0.005] [--sigma 0.3] [--json OUT]

Routing: Gumbel top-k over a lognormal expert popularity (sigma), drawn in chunks of tokens so
memory stays bounded. Planning is timed separately from simulation. Tokens per rank are reduced
for the largest EP sizes so that R * tokens <= --max-tokens (the planner's [T, K] arrays must fit
in memory); the simulation's cost depends on R (flows per phase = R^2), not on tokens. Prints a
table of simulated layers per second and how the cost grows between sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from moonep_sim.models import get_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.sim import SimOptions, load_topology, simulate_layer
from moonep_sim.sim.timeline import DEFAULT_TOL
from moonep_sim.strategies import PlanContext, available, make_plan


def gumbel_topk(T: int, K: int, E: int, sigma: float, seed: int, chunk: int = 65536):
    """[T, K] distinct expert ids (Gumbel top-k over lognormal popularity) and weights."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(0.0, sigma, E)
    ids = np.empty((T, K), np.int64)
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        g = logp[None, :] + rng.gumbel(size=(b - a, E))
        ids[a:b] = np.argpartition(-g, K - 1, axis=1)[:, :K]
    w = np.full((T, K), 1.0 / K, np.float32)
    return ids, w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,16,32,64,128,256")
    ap.add_argument("--strategy", default="alltoall")
    ap.add_argument("--model", default="kimi-k3")
    ap.add_argument("--topology", default="h800-cx7")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=2 * 1024 * 1024)
    ap.add_argument("--sigma", type=float, default=0.3)
    ap.add_argument("--tol", type=float, default=DEFAULT_TOL)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    m = get_model(a.model)
    topo = load_topology(a.topology)
    rows = []
    print(f"strategy {a.strategy} ({'available' if a.strategy in available() else 'MISSING'}), model {m.name}, "
          f"topology {topo.name}, tol {a.tol}")
    print(f"{'EP':>5} {'tokens/rank':>11} {'flows':>8} {'ticks':>6} {'plan s':>7} {'sim s':>7} "
          f"{'layers/s':>9} {'sim us':>10} {'LB ratio':>8} {'cost x':>7}")
    prev = None
    for R in [int(x) for x in a.ranks.split(",")]:
        tpr = min(a.tokens_per_rank, a.max_tokens // R)
        ids, w = gumbel_topk(R * tpr, m.top_k, m.num_experts, a.sigma, seed=R)
        routing = GlobalRouting.split_evenly(ids, w, m.num_experts, R)
        # contiguous home groups; E need not divide by R (896 experts on 256 ranks: 3 or 4 each)
        home = np.arange(m.num_experts) * R // m.num_experts
        ctx = PlanContext(ClusterShape(R, min(8, R)), Placement.from_map(home, R),
                          RowCosts.from_model(m, "bf16"), 1)
        t0 = time.perf_counter()
        plan = make_plan(a.strategy, routing, ctx)
        plan_s = time.perf_counter() - t0
        del ids, w, routing
        best = math.inf
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            res = simulate_layer(plan, topo, m, SimOptions(tol=a.tol))
            best = min(best, time.perf_counter() - t0)
        growth = (best / prev) if prev else float("nan")
        prev = best
        rows.append(dict(ranks=R, tokens_per_rank=tpr, flows=res.sim_stats["flows"], ticks=res.sim_stats["ticks"],
                         plan_s=plan_s, sim_s=best, layers_per_s=1 / best, layer_time_us=res.layer_time_us,
                         ratio_to_lower_bound=res.ratio_to_lower_bound))
        print(f"{R:>5} {tpr:>11} {res.sim_stats['flows']:>8} {res.sim_stats['ticks']:>6} {plan_s:>7.2f} {best:>7.2f} "
              f"{1 / best:>9.2f} {res.layer_time_us:>10.1f} {res.ratio_to_lower_bound:>8.2f} {growth:>7.2f}", flush=True)
        del plan
    if a.json:
        from moonep_sim.io import write_text_atomic
        write_text_atomic(a.json, json.dumps(dict(strategy=a.strategy, model=m.name, topology=topo.name, tol=a.tol,
                                                  rows=rows), indent=2), what="--json")


if __name__ == "__main__":
    main()
