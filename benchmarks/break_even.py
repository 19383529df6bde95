"""Where does exact balance stop paying? MoonEP's single-node benchmark shape, per topology preset.

Shape (MoonEP's benchmark): EP8 on one node, H=7168, K=8, E=384, H'=2048 (the ``kimi-k2`` preset),
bf16 rows, forward only (``--backward`` adds the backward: gradient reduce of the copies). For every
preset and tokens per rank S, routing is MoonEP's lognormal generator at each ``--maxvio`` (seed 0,
tokens split evenly), and three plans are simulated:

- ``exact``: ``moonep`` (every rank computes exactly S*K rows; hot experts' weights prefetched);
- ``none``: the same single-hop transport with no copy (``alltoall`` with ``dedup`` on MoonEP's
  kernel, 32 SMs: ``moonep`` minus its balancing);
- ``costaware``: ours (copies only where its cost model says they pay).

The break-even S* of a (preset, maxvio) is the smallest S from which exact balance is faster than
no balance at every larger S measured: below it, the weight copies cost more than the straggler
time they remove. Written as JSON (``--json PATH``) and printed as a Markdown table.

    python benchmarks/break_even.py --json docs/results/data/break_even.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from moonep_sim.io import write_text_atomic  # noqa: E402
from moonep_sim.models import get_model  # noqa: E402
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts  # noqa: E402
from moonep_sim.plan.kernel import KernelSpec  # noqa: E402
from moonep_sim.routing.generators import generate_layer  # noqa: E402
from moonep_sim.sim import SimOptions, load_topology, simulate_layer  # noqa: E402
from moonep_sim.strategies import PlanContext, get_strategy, make_plan  # noqa: E402

VARIANTS = (("exact", "moonep", {}), ("none", "alltoall", {"dedup": True}), ("costaware", "costaware", {}))


def break_even(tokens: list[int], exact_us: list[float], none_us: list[float]) -> int | None:
    """Smallest S from which exact beats none at every larger S measured (None: never)."""
    s_star = None
    for s, e, n in reversed(list(zip(tokens, exact_us, none_us))):
        if e < n:
            s_star = s
        else:
            break
    return s_star


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="h20,h200,h800-cx7,h100-cx7,b200")
    ap.add_argument("--tokens", default="128,256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--maxvio", default="1,10")
    ap.add_argument("--backward", action="store_true", help="simulate a training step (forward and backward)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = get_model("kimi-k2")
    E, K, R = m.num_experts, m.top_k, 8
    presets = [p for p in args.presets.split(",") if p]
    tokens = [int(t) for t in args.tokens.split(",")]
    vios = [float(v) for v in args.maxvio.split(",")]
    opts = SimOptions(backward=args.backward)
    t0 = time.perf_counter()
    rows = []
    for v in vios:
        routings = {}
        for S in tokens:
            lr = generate_layer(E, K, S * R, 0, maxvio=v)
            routings[S] = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, E, R)
        for name in presets:
            topo = load_topology(name).with_gpus_per_node(R)
            res = {k: [] for k, _, _ in VARIANTS}
            copies = []
            for S in tokens:
                ctx = PlanContext(ClusterShape(R, R), Placement.home_groups(E, R), RowCosts.from_model(m), 1, topo)
                for key, strat, o in VARIANTS:
                    if key == "costaware" and args.backward:
                        o = {"mode": "training"}
                    p = make_plan(strat, routings[S], ctx, **o)
                    if key == "none":  # moonep's kernel (its SM budget), without its copies
                        p = dataclasses.replace(p, kernel=KernelSpec(sms=int(get_strategy("moonep").defaults()["sms"])))
                    res[key].append(simulate_layer(p, topo, m, opts).layer_time_us)
                    if key == "costaware":
                        copies.append(p.weight_copies)
            s_star = break_even(tokens, res["exact"], res["none"])
            best = np.minimum(res["exact"], res["none"])
            rows.append({"preset": name, "maxvio": v, "tokens_per_rank": tokens, "exact_us": res["exact"],
                         "none_us": res["none"], "costaware_us": res["costaware"], "costaware_copies": copies,
                         "break_even_tokens": s_star,
                         "costaware_over_best": (np.asarray(res["costaware"]) / best).tolist()})
            print(f"{name} maxvio={v:g}: S*={s_star}  ca/best=" +
                  " ".join(f"{x:.3f}" for x in rows[-1]["costaware_over_best"]), flush=True)
    out = {"kind": "break_even", "model": m.to_dict(), "ranks": R, "backward": args.backward,
           "rows": rows, "seconds": time.perf_counter() - t0}
    print()
    print("| preset | maxvio | S* (exact balance pays from) | costaware / best of (exact, none), per S |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        per = ", ".join(f"{s}: {x:.3f}" for s, x in zip(r["tokens_per_rank"], r["costaware_over_best"]))
        print(f"| {r['preset']} | {r['maxvio']:g} | {r['break_even_tokens'] or 'never'} | {per} |")
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
