"""Simulator speed: wall seconds to simulate one imbalanced MoE layer (forward) against EP size.

Usage (the figures in docs/results/scale.md)::

    python benchmarks/bench_sim.py --ranks 64,256,1024 --json OUT.json
    python benchmarks/bench_sim.py --ranks 64,128,256 --strategies alltoall --tol 0   # exact mode

Workload: a model of ``--experts`` experts (default 1024, at least the largest EP size), top-8,
hidden 7168, expert FFN 2048, bf16 rows, on ``h800-cx7``; routing from the project's generator
(``moonep_sim.routing.generators.generate``) with maxvio 1 on a block of up to 65,536 tokens, tiled
to ``ranks x tokens-per-rank`` tokens (tokens per rank: 8192, reduced so the total stays within
``--max-tokens``); experts homed in contiguous groups. Planning is timed apart (``plan_s``); the
row's ``sim_seconds`` is the best of ``--repeat`` (default 3) runs of ``simulate_layer`` (forward), which
includes the lower bound and result analysis. Each row also records the process CPU seconds of
that run and the 1-minute load average, since the machine may be shared.

**The command's path** (unless ``--no-cli``): each row is also run as a user runs it, in a fresh
process (``benchmarks/_cli.py``): the row's routing written once as an ``.npz`` and imported with
the model's shape (``moonep-sim trace import R.npz --model M.toml -o T.safetensors``, not timed),
then ``moonep-sim simulate --trace T.safetensors --strategy S --ranks R --gpus-per-node G
--topology TOPO --tol TOL --json`` timed: its wall and CPU seconds beside the in-process plan +
simulation (``plan_s`` + ``sim_seconds``, and their CPU seconds), command / in-process, and whether
its layer time is the in-process one.

The growth exponent is the least-squares slope of log(sim_seconds) against log(ranks) per
strategy, and per step between consecutive sizes.

``--step-layer`` times instead the step model's per-layer simulation
(``moonep_sim.step.layer_sim.simulate_moe_layer``: forward and backward, experts priced by the
step's cost model) of one Kimi K3 EP64 training layer (8 nodes of 8, 4096 tokens per rank,
generated routing at maxvio 2, seed 7, the scenario's placement and row costs) per strategy, best
of ``--repeat`` by CPU seconds (docs/results/simulator-speed.md)::

    python benchmarks/bench_sim.py --step-layer --strategies alltoall,deepep,moonep,deepep-ll,hierarchical
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moonep_sim.models import custom_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.routing.generators import generate
from moonep_sim.routing.metrics import maxvio
from moonep_sim.sim import SimOptions, load_topology, simulate_layer
from moonep_sim.sim.options import DEFAULT_TOL
from moonep_sim.strategies import PlanContext, make_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import beside, report_line, time_command  # noqa: E402  (the shared fresh-process timing)

BLOCK_TOKENS = 65536


def routing_for(R: int, tokens_per_rank: int, E: int, K: int, mv: float, seed: int) -> GlobalRouting:
    """maxvio-``mv`` routing of R x tokens_per_rank tokens (a generated block, tiled)."""
    T = R * tokens_per_rank
    g = generate(E, K, min(T, BLOCK_TOKENS), seed, maxvio=mv)
    ids, w = g.topk_ids_LTK[0], g.topk_weights_LTK[0]
    reps = -(-T // ids.shape[0])
    ids = np.tile(ids, (reps, 1))[:T]
    w = np.tile(w, (reps, 1))[:T]
    return GlobalRouting.split_evenly(ids, w, E, R)


def cli_trace(routing: GlobalRouting, m, folder: Path) -> Path:
    """The row's routing as a trace file a user could give ``moonep-sim simulate`` (its ids and
    weights in an ``.npz``, imported with the model's shape from a model file)."""
    npz, model, trace = folder / "routing.npz", folder / "model.toml", folder / "trace.safetensors"
    np.savez(npz, topk_ids=routing.topk_ids_TK, topk_weights=routing.topk_weights_TK)
    model.write_text(f'name = "{m.name}"\nnum_experts = {m.num_experts}\ntop_k = {m.top_k}\n'
                     f"hidden = {m.hidden}\nexpert_ffn = {m.expert_ffn}\n")
    trace.unlink(missing_ok=True)
    time_command(["trace", "import", str(npz), "--model", str(model), "-o", str(trace)])
    return trace


def step_layer_rows(strategies: list[str], topology: str, repeat: int, seed: int = 7) -> list[dict]:
    """CPU seconds of ``simulate_moe_layer`` (train) on one Kimi K3 EP64 layer per strategy."""
    from moonep_sim.experiments import GeneratorSpec, Scenario
    from moonep_sim.step.costs import CostModel
    from moonep_sim.step.layer_sim import simulate_moe_layer

    R, tpr = 64, 4096
    rs = Scenario(routing=GeneratorSpec(model="kimi-k3", maxvio=2.0, tokens_per_rank=tpr, layers=1, seed=seed),
                  cluster="64/8", topology=topology, strategies=strategies).resolved
    m, topo = rs.source.model, rs.topology
    g = generate(m.num_experts, m.top_k, R * tpr, seed, maxvio=2.0)
    routing = GlobalRouting.split_evenly(g.topk_ids_LTK[0], g.topk_weights_LTK[0], m.num_experts, R)
    costs = CostModel(topo)
    print(f"step layer: {m.name} EP{R} ({rs.ctx.cluster.gpus_per_node} per node), {tpr} tokens per rank, train, "
          f"topology {topo.name}, load {os.getloadavg()[0]:.2f}")
    print(f"{'strategy':>12} {'flows':>7} {'cpu s':>7} {'wall s':>7} {'layer us':>10} {'load':>5}")
    rows = []
    for s in strategies:
        plan = make_plan(s, routing, rs.ctx)
        best, wall, comm = math.inf, math.inf, None
        for _ in range(repeat):
            c0, t0 = time.process_time(), time.perf_counter()
            comm = simulate_moe_layer(plan, m, topo, costs, True)
            cpu = time.process_time() - c0
            if cpu < best:
                best, wall = cpu, time.perf_counter() - t0
        flows = sum(int((p.bytes_RR > 0).sum()) for d in ("forward", "backward") for p in plan.phases(d))
        load = os.getloadavg()[0]
        rows.append(dict(strategy=s, ranks=R, tokens_per_rank=tpr, flows=flows, cpu_seconds=best, wall_seconds=wall,
                         layer_time_us=comm.sim_us, load_1min=load))
        print(f"{s:>12} {flows:>7} {best:>7.3f} {wall:>7.2f} {comm.sim_us:>10.1f} {load:>5.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,256,1024", help="comma-separated EP sizes")
    ap.add_argument("--strategies", default="alltoall,moonep")
    ap.add_argument("--topology", default="h800-cx7")
    ap.add_argument("--experts", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--maxvio", type=float, default=1.0)
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=1 << 20)
    ap.add_argument("--tol", type=float, default=DEFAULT_TOL)
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the row keeps the fastest (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-cli", action="store_true",
                    help="skip the `moonep-sim simulate` run of each row in a fresh process")
    ap.add_argument("--step-layer", action="store_true",
                    help="time the step model's per-layer simulation of a Kimi K3 EP64 training layer instead")
    a = ap.parse_args()
    if a.step_layer:
        rows = step_layer_rows(a.strategies.split(","), a.topology, a.repeat)
        if a.json:
            from moonep_sim.io import write_text_atomic
            write_text_atomic(a.json, json.dumps(dict(case="kimi-k3 EP64 train layer", rows=rows), indent=2),
                              what="--json")
        return
    ranks = [int(x) for x in a.ranks.split(",")]
    strategies = a.strategies.split(",")
    E = a.experts
    if max(ranks) > E:
        raise SystemExit(f"moonep-sim: error: --experts ({E}) must be >= the largest EP size ({max(ranks)})")
    m = custom_model(E, a.top_k, hidden=7168, expert_ffn=2048, name=f"bench-e{E}-k{a.top_k}")
    topo = load_topology(a.topology)
    rows = []
    print(f"model {m.name} (E={E}, K={a.top_k}, hidden 7168, ffn 2048, bf16), topology {topo.name}, "
          f"maxvio {a.maxvio}, tol {a.tol}, load {os.getloadavg()[0]:.2f}")
    print(f"{'strategy':>9} {'EP':>5} {'tok/rank':>8} {'maxvio':>6} {'flows':>8} {'ticks':>6} {'steps':>6} "
          f"{'plan s':>7} {'sim s':>7} {'cpu s':>7} {'layer us':>10} {'load':>5}")
    tmp = tempfile.TemporaryDirectory(prefix="bench-sim-")
    for R in ranks:
        tpr = min(a.tokens_per_rank, a.max_tokens // R)
        routing = routing_for(R, tpr, E, a.top_k, a.maxvio, a.seed)
        trace = None if a.no_cli else cli_trace(routing, m, Path(tmp.name))
        mv = maxvio(np.bincount(routing.topk_ids_TK.ravel(), minlength=E))
        home = np.arange(E) * R // E
        ctx = PlanContext(ClusterShape(R, min(8, R)), Placement.from_map(home, R), RowCosts.from_model(m, "bf16"), 1)
        for s in strategies:
            t0, c0 = time.perf_counter(), time.process_time()
            plan = make_plan(s, routing, ctx)
            plan_s, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
            best, cpu, res = math.inf, math.inf, None
            for _ in range(a.repeat):
                c0, t0 = time.process_time(), time.perf_counter()
                res = simulate_layer(plan, topo, m, SimOptions(tol=a.tol))
                wall = time.perf_counter() - t0
                if wall < best:
                    best, cpu = wall, time.process_time() - c0
            load = os.getloadavg()[0]
            st = res.sim_stats
            rows.append(dict(strategy=s, ranks=R, tokens_per_rank=tpr, maxvio=mv, flows=st["flows"], ticks=st["ticks"],
                             fill_steps=st["fill_iterations"], plan_s=plan_s, sim_seconds=best, cpu_seconds=cpu,
                             layer_time_us=res.layer_time_us, load_1min=load))
            print(f"{s:>9} {R:>5} {tpr:>8} {mv:>6.2f} {st['flows']:>8} {st['ticks']:>6} {st['fill_iterations']:>6} "
                  f"{plan_s:>7.2f} {best:>7.2f} {cpu:>7.2f} {res.layer_time_us:>10.1f} {load:>5.2f}", flush=True)
            if trace is not None:
                cli = time_command(["simulate", "--trace", str(trace), "--strategy", s, "--ranks", str(R),
                                    "--gpus-per-node", str(min(8, R)), "--topology", a.topology, "--tol", f"{a.tol:g}",
                                    "--json"])
                c = beside(cli, plan_s + best, plan_cpu + cpu, "in-process make_plan + simulate_layer (its best run)")
                c["same_layer_time"] = json.loads(cli["stdout"])["layer_time_us"] == res.layer_time_us
                rows[-1]["cli"] = c
                print("  " + report_line(c).replace("\n", "\n  ")
                      + f"; {'same layer time' if c['same_layer_time'] else 'LAYER TIME DIFFERS'}", flush=True)
            del plan
        del routing
    tmp.cleanup()
    growth = {}
    for s in strategies:
        pts = [(r["ranks"], r["sim_seconds"]) for r in rows if r["strategy"] == s]
        if len(pts) >= 2:
            x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
            slope = float(np.polyfit(x, y, 1)[0])
            steps = {f"{pts[i][0]}->{pts[i + 1][0]}": float((y[i + 1] - y[i]) / (x[i + 1] - x[i]))
                     for i in range(len(pts) - 1)}
            growth[s] = dict(exponent=slope, steps=steps)
            print(f"{s}: sim_seconds grows as R^{slope:.2f} (" + ", ".join(f"{k}: {v:.2f}" for k, v in steps.items())
                  + ")")
    if a.json:
        from moonep_sim.io import write_text_atomic
        write_text_atomic(a.json, json.dumps(dict(model=m.name, experts=E, top_k=a.top_k, topology=topo.name,
                                                  maxvio_target=a.maxvio, tol=a.tol, rows=rows, growth=growth),
                                             indent=2), what="--json")


if __name__ == "__main__":
    main()
