"""What a strategy's command path costs against its physical floor, in one fresh process each.

For each strategy, a fresh Python process (as ``bench_plan.py``'s first runs) times, in CPU
seconds (user + system):

- **plan** and **summary**: ``make_plan`` and ``Plan.summary()`` (which validates), as
  ``moonep-sim plan`` runs them once it has the layer;
- **write floor**: allocating and filling, once, fresh arrays of the shapes and dtypes the Plan
  holds (every hop's four message arrays, the per-entry, per-row and per-slot arrays): what
  holding its Plan costs before any computation (fresh pages, as the CLI's small pages);
- **sort floor**: the sorts any builder of such a Plan does: one stable sort of the N entries by
  slot (the expert-grouped layout, a 16-bit key) and, per hop, one stable sort of the N entries
  by the hop's destination inside each source rank's run (one-byte keys).

floor = write floor + sort floor + summary (the validation is part of the command; its own
floor is not measured here). The layer is ``bench_plan.py``'s (``--layer-file`` to share one);
``bench_plan.py --floor`` times the write floor beside every strategy's first run.

    python benchmarks/bench_plan_floor.py --strategies deepep,hierarchical,costaware --layer-file L.npz
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import cli_settings, load_layer, make_layer, save_layer  # noqa: E402

from moonep_sim.strategies import make_plan  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plan_arrays(plan) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every array the Plan holds."""
    out = []
    for h in plan.hops:
        out += [(a.shape, a.dtype) for a in (h.src_rank_M, h.src_row_M, h.dst_rank_M, h.dst_row_M)]
    for name in ("entry_rank_TK", "entry_row_TK", "entry_dup_TK", "row_entry_W", "expand_src_row_W", "slot_rank_S",
                 "slot_expert_S", "slot_home_S", "slot_offset_S", "slot_rows_S", "slot_padded_S"):
        a = getattr(plan, name)
        out.append((a.shape, a.dtype))
    return out


def child(name: str, layer: str) -> dict:
    cli_settings(False, False)  # what the CLI does before any command
    routing, ctx = load_layer(layer)
    gc.collect()
    c0 = cpu_s()
    plan = make_plan(name, routing, ctx)
    c1 = cpu_s()
    plan.summary()
    c2 = cpu_s()
    shapes, n_hops = plan_arrays(plan), len(plan.hops)
    S = plan.slot_rank_S.size
    del plan
    gc.collect()
    c3 = cpu_s()
    held = [np.full(shape, 1, dtype=dt) for shape, dt in shapes]
    c4 = cpu_s()
    del held
    ids = routing.topk_ids_TK.ravel()
    key = (ids % max(S, 1)).astype(np.uint16)  # a slot-sized key of the entries (the layout's sort)
    bound = routing.tok_off_R() * routing.top_k
    dst8 = (ids % ctx.cluster.ranks).astype(np.uint8)
    slot_s, hops_s = sort_floor(key, dst8, bound, n_hops)
    return {"strategy": name, "plan_s": c1 - c0, "summary_s": c2 - c1, "write_floor_s": c4 - c3,
            "sort_floor_s": slot_s + hops_s, "floor_s": (c4 - c3) + slot_s + hops_s + (c2 - c1), "command_s": c2 - c0}


def sort_floor(key_N: np.ndarray, dst_N: np.ndarray | None = None, bound_R: np.ndarray | None = None,
               n_hops: int = 0) -> tuple[float, float]:
    """CPU seconds of a Plan builder's sorts: one stable sort of the N entries by ``key_N`` (the
    slot: the expert-grouped layout) and, ``n_hops`` times, each source rank's run of entries
    (``bound_R``: R + 1 offsets) stable-sorted by its destination ``dst_N``."""
    gc.collect()
    c0 = cpu_s()
    np.argsort(key_N, kind="stable")
    c1 = cpu_s()
    for _ in range(n_hops):  # per hop, each source rank's run sorted by destination
        for r in range(bound_R.size - 1):
            np.argsort(dst_N[bound_R[r]:bound_R[r + 1]], kind="stable")
    return c1 - c0, cpu_s() - c1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="deepep,hierarchical,costaware")
    ap.add_argument("--layer-file", default="", help="read the layer from this .npz if it exists, else make and save it")
    ap.add_argument("--gen", default="model=kimi-k3,maxvio=10,tokens-per-rank=8192")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layer", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.layer)))
        return 0
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        layer = Path(a.layer_file) if a.layer_file else Path(tmp) / "layer.npz"
        if not layer.exists():
            routing, ctx = make_layer(a.gen, a.ranks, a.gpus_per_node)
            save_layer(layer, routing, ctx)
        print(f"{'strategy':14s} {'command':>8s} {'plan':>6s} {'summary':>8s} | {'floor':>6s} {'write':>6s} "
              f"{'sorts':>6s}   (CPU s, one fresh process each)")
        for name in [s for s in a.strategies.split(",") if s]:
            p = subprocess.run([sys.executable, __file__, "--child", name, "--layer", str(layer)],
                               capture_output=True, text=True, timeout=600)
            if p.returncode:
                print(f"{name:14s} failed: {p.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"{name:14s} {r['command_s']:8.2f} {r['plan_s']:6.2f} {r['summary_s']:8.2f} | {r['floor_s']:6.2f} "
                  f"{r['write_floor_s']:6.2f} {r['sort_floor_s']:6.2f}")
    load1 = os.getloadavg()
    print(f"load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, at end "
          f"{load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
