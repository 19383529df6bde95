"""Planning speed and memory on the command's path: every registered strategy on one Kimi K3-scale layer.

What is timed is what ``moonep-sim plan`` computes once it has the layer's routing: the Plan
(``make_plan``) and its summary, which validates it (``Plan.summary()``: every named invariant,
the byte matrices). Each strategy is timed twice over:

- **first run**: in a fresh Python process of its own (one subprocess per strategy), as a user's
  single command runs it -- every large array lands on pages the kernel must hand out fresh
  (system time), no warmed allocator, no cached imports beyond the package;
- **best of repeats**: ``--repeats`` runs in this process (the figure earlier results quoted).

Both processes first do what the CLI does before any command (``moonep_sim.memory``): tell numpy
not to advise huge pages (``--numpy-hugepages`` keeps numpy's default, for comparison) and let the
C allocator reuse freed memory (``--default-malloc`` keeps glibc's default); a tree without those
settings is timed without them, as its command ran.

**The command itself** (unless ``--no-cli``): each strategy is also timed as the user types it,
``moonep-sim plan --trace gen:GEN --strategy S --ranks R --gpus-per-node G --json`` in fresh
processes (``--rounds`` of them, the median; ``benchmarks/_cli.py``) -- imports, the layer
generated, the Plan, its JSON -- beside the first run (or, without one, the best) with command /
that figure, and whether its Plan answers the same (rows, bytes, drops, duplicates).

``--floor`` also times, per strategy and in a fresh process of its own, the physical floor of its
Plan: allocating and writing once arrays of the sizes its Plan holds (every array the planner
made, the routing's own excluded) -- no planner can produce that Plan in less.

For both: wall seconds, CPU seconds (user and system apart), and the peak RSS while planning
(Linux: ``VmHWM`` after resetting it just before the timed call; the routing, ~0.1 GiB at this
size, is included). Default layer: ``gen:model=kimi-k3,maxvio=10,tokens-per-rank=8192`` on R=64
ranks (8 per node): 524,288 tokens, 8,388,608 (token, k) entries, the project's generator
(lognormal popularity bisected to the target maxvio), the default topology (``h800-cx7``) and
row sizes as ``moonep-sim plan`` resolves them (``Scenario``).

    python benchmarks/bench_plan.py                          # all strategies, first run + best of 3
    python benchmarks/bench_plan.py --strategies allgather,deepep --repeats 5
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_plan.py --json out.json   # another tree's planners
    python benchmarks/bench_plan.py --before /tmp/base --rounds 3 --floor   # before/after in one run, and floors

On a shared machine, compare CPU seconds (and ratios measured in one run), not wall seconds: the
load average at start and end is printed and stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import beside, report_line, time_command  # noqa: E402  (the shared fresh-process timing)

from moonep_sim.io import write_text_atomic
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.strategies import PlanContext, available, make_plan


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """This process's peak RSS since start or the last :func:`reset_peak_rss` (Linux VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def command_path(name: str, routing: GlobalRouting, ctx: PlanContext, keep: bool = False) -> dict:
    """One timed run of what ``moonep-sim plan`` computes: the Plan and its (validating) summary
    (``keep``: the Plan too, under ``plan``)."""
    gc.collect()
    can_reset = reset_peak_rss()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    plan = make_plan(name, routing, ctx)
    summary = plan.summary()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out = {"wall_s": wall, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
           "plan_seconds": plan.plan_seconds, "violations": len(summary["invariant_violations"]),
           "peak_rss_bytes": peak_rss_bytes() if can_reset else None, "answer": plan_answer(summary)}
    out["cpu_s"] = out["user_s"] + out["sys_s"]
    if keep:
        out["plan"] = plan
    del plan, summary
    return out


def plan_answer(summary: dict) -> dict:
    """What the Plan answers, from its summary (``moonep-sim plan --json`` prints the same summary):
    rows received per rank, bytes per hop and direction, dropped entries, duplicates avoided."""
    return {k: summary[k] for k in ("recv_rows_per_rank", "bytes", "dropped", "duplicates_avoided")}


def cli_argv(gen: str, name: str, ranks: int, gpus_per_node: int) -> list[str]:
    """The ``moonep-sim plan`` command a user types for this layer and strategy."""
    return ["plan", "--trace", f"gen:{gen}", "--strategy", name, "--ranks", str(ranks), "--gpus-per-node",
            str(gpus_per_node), "--json"]


def cli_beside(name: str, row: dict, a, same_layer: bool) -> dict:
    """``moonep-sim plan`` for ``name`` timed in fresh processes (``--rounds`` runs, the median),
    beside the row's fresh-process first run (or, without one, the in-process best); whether its
    Plan answers the same (only where the command's layer is the one timed: no other ``--layer-file``)."""
    cli = time_command(cli_argv(a.gen, name, a.ranks, a.gpus_per_node), repeat=a.rounds, timeout_s=a.timeout)
    ref, what = (row["first"], "fresh-process make_plan + summary") if "first" in row else (
        row["best"], "in-process make_plan + summary (best)")
    out = beside(cli, ref["wall_s"], ref["cpu_s"], what)
    out["cli_runs"] = cli["runs"]
    out["same_answer"] = plan_answer(json.loads(cli["stdout"])) == ref["answer"] if same_layer else None
    return out


def save_layer(path: Path, routing: GlobalRouting, ctx: PlanContext) -> None:
    """The layer and what its context is made of, for the fresh processes."""
    cl, c = ctx.cluster, ctx.costs
    np.savez(path, ids=routing.topk_ids_TK, w=routing.topk_weights_TK, tpr=routing.tokens_per_rank_R,
             meta=np.array(json.dumps({"E": routing.num_experts, "R": cl.ranks, "G": cl.gpus_per_node,
                                       "costs": [c.dispatch_row_bytes, c.combine_row_bytes, c.weight_bytes,
                                                 c.grad_bytes], "padding": ctx.token_padding,
                                       "topology": getattr(ctx.topology, "name", None)})))


def load_layer(path: str) -> tuple[GlobalRouting, PlanContext]:
    z = np.load(path)
    m = json.loads(str(z["meta"]))
    topo = None
    if m["topology"]:
        from moonep_sim.sim import load_topology
        topo = load_topology(m["topology"], gpus_per_node=m["G"])
    ctx = PlanContext(ClusterShape(m["R"], m["G"]), Placement.home_groups(m["E"], m["R"]), RowCosts(*m["costs"]),
                      m["padding"], topo)
    return GlobalRouting(z["ids"], z["w"], z["tpr"], m["E"]), ctx


def small_pages() -> bool:
    """What the CLI does before any command (``moonep_sim.memory.prefer_small_pages``); False where
    the package timed has no such setting (an older tree: its command did not do it)."""
    try:
        from moonep_sim.memory import prefer_small_pages
    except ImportError:
        return False
    return prefer_small_pages()


def reuse_memory() -> bool:
    """What the CLI does before any command (``moonep_sim.memory.reuse_freed_memory``); False where
    the package timed has no such setting (an older tree) or the C library is not glibc."""
    try:
        from moonep_sim.memory import reuse_freed_memory
    except ImportError:
        return False
    return reuse_freed_memory()


def cli_settings(hugepages: bool, default_malloc: bool) -> str:
    """Apply the CLI's process settings this bench times with; says which took effect."""
    pages = "small pages" if not hugepages and small_pages() else "numpy's huge-page advice"
    return pages + (", freed memory reused" if not default_malloc and reuse_memory() else ", glibc's default malloc")


def plan_arrays(plan, routing: GlobalRouting) -> list[tuple[int, str]]:
    """(size, dtype) of every distinct array ``plan`` holds that the planner made (views of one
    buffer counted once by their base, the routing's arrays excluded)."""
    arrays = [getattr(plan, f.name) for f in dataclasses.fields(plan)]
    arrays += [getattr(h, f.name) for h in plan.hops for f in dataclasses.fields(h)]
    given = [routing.topk_ids_TK, routing.topk_weights_TK, routing.tokens_per_rank_R]
    seen: dict[int, tuple[int, str]] = {}
    for a in arrays:
        if not isinstance(a, np.ndarray) or any(np.may_share_memory(a, g) for g in given):
            continue
        base = a if a.base is None else a.base
        if isinstance(base, np.ndarray):
            seen[id(base)] = (int(base.size), str(base.dtype))
        else:
            seen[id(a)] = (int(a.size), str(a.dtype))
    return sorted(seen.values(), reverse=True)


def write_floor(sizes: list) -> dict:
    """Allocate and write once arrays of the given ``(size, dtype)`` pairs in this process (their
    pages fresh in a fresh process); wall, user and system seconds and the bytes written."""
    gc.collect()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    keep = []
    for n, dt in sizes:
        a = np.empty(n, dtype=dt)
        a.fill(1)
        keep.append(a)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out = {"wall_s": wall, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
           "bytes": int(sum(a.nbytes for a in keep))}
    out["cpu_s"] = out["user_s"] + out["sys_s"]
    return out


def floor_child(spec: str) -> int:
    """``--floor-child``: :func:`write_floor` of the given sizes in this fresh process."""
    print(json.dumps(write_floor(json.loads(spec))))
    return 0


def child(name: str, layer: str, hugepages: bool, default_malloc: bool) -> int:
    """``--child``: one first run in this (fresh) process; its figures as one JSON line."""
    cli_settings(hugepages, default_malloc)
    routing, ctx = load_layer(layer)
    out = command_path(name, routing, ctx, keep=True)
    plan = out.pop("plan")
    out["plan_arrays"] = plan_arrays(plan, routing)
    print(json.dumps(out))
    return 0


def _fresh(args: list[str], what: str, timeout_s: float, tree: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=tree) if tree else None  # (``tree``: time that tree's package)
    p = subprocess.run([sys.executable, __file__] + args, capture_output=True, text=True, timeout=timeout_s, env=env)
    if p.returncode:
        raise RuntimeError(f"fresh process for {what} failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def first_run(name: str, layer: Path, timeout_s: float, hugepages: bool, default_malloc: bool, tree: str = "") -> dict:
    """A first run of ``name`` in a fresh Python process (same interpreter; the package of ``tree``
    if given, else of this PYTHONPATH)."""
    return _fresh(["--child", name, "--layer", str(layer)] + (["--numpy-hugepages"] if hugepages else [])
                  + (["--default-malloc"] if default_malloc else []), name, timeout_s, tree)


def floor_run(arrays: list, timeout_s: float, hugepages: bool, default_malloc: bool) -> dict:
    """The floor of a Plan holding ``arrays`` ((size, dtype) pairs), in a fresh Python process."""
    return _fresh(["--floor-child", json.dumps(arrays)] + (["--numpy-hugepages"] if hugepages else [])
                  + (["--default-malloc"] if default_malloc else []), "the floor", timeout_s)


def make_layer(gen: str, ranks: int, gpus_per_node: int) -> tuple[GlobalRouting, PlanContext]:
    """The layer ``moonep-sim plan --trace gen:<gen> --ranks R --gpus-per-node G`` plans."""
    from moonep_sim.experiments import Scenario

    rs = Scenario(routing=f"gen:{gen}", cluster=(ranks, gpus_per_node), strategies="alltoall").resolved
    return rs.source.global_routing(rs.source.layer_ids[0], ranks), rs.ctx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", default="model=kimi-k3,maxvio=10,tokens-per-rank=8192",
                    help="generator spec of the layer (as `moonep-sim plan --trace gen:...`)")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="runs in this process (0: first runs only)")
    ap.add_argument("--no-fresh", action="store_true", help="skip the first runs in fresh processes")
    ap.add_argument("--strategies", default="", help="comma-separated (default: every registered strategy)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to one fresh process")
    ap.add_argument("--layer-file", default="", help="read the layer from this .npz if it exists, else generate "
                                                     "it and save it there (two trees timed on one layer)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--numpy-hugepages", action="store_true",
                    help="keep numpy's huge-page advice (the CLI turns it off: moonep_sim.memory)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's default allocator settings (the CLI lets it reuse freed memory: moonep_sim.memory)")
    ap.add_argument("--floor", action="store_true", help="also time each Plan's floor (allocating and writing its "
                                                         "arrays once) in a fresh process")
    ap.add_argument("--before", default="", metavar="TREE",
                    help="also time each strategy's first run with the package of this source tree (e.g. a "
                         "`git worktree` of an earlier commit), just before this tree's: before/after in one run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="fresh first runs per strategy (with --before and --floor, in turn); the least CPU is shown")
    ap.add_argument("--no-cli", action="store_true",
                    help="skip the command-line runs (by default each strategy is also timed as `moonep-sim plan "
                         "--trace gen:GEN ...` in fresh processes, --rounds of them, beside its first run)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--floor-child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layer", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child, a.layer, a.numpy_hugepages, a.default_malloc)
    if a.floor_child:
        cli_settings(a.numpy_hugepages, a.default_malloc)
        return floor_child(a.floor_child)
    pages = cli_settings(a.numpy_hugepages, a.default_malloc)

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    same_layer = not (a.layer_file and Path(a.layer_file).exists())  # else the file's layer, maybe another gen
    if not same_layer:
        routing, ctx = load_layer(a.layer_file)
    else:
        routing, ctx = make_layer(a.gen, a.ranks, a.gpus_per_node)
        if a.layer_file:
            save_layer(Path(a.layer_file), routing, ctx)
    counts = routing.counts_E()
    mv = float(counts.max() / counts.mean() - 1.0)
    n = routing.num_tokens * routing.top_k
    print(f"layer: gen:{a.gen} on R={a.ranks} (G={a.gpus_per_node}/node): {routing.num_tokens} tokens, {n} entries, "
          f"E={routing.num_experts} K={routing.top_k}, maxvio {mv:.2f}, topology "
          f"{getattr(ctx.topology, 'name', None)} (ready in {time.perf_counter() - t0:.0f} s); memory: {pages}")
    names = [s for s in a.strategies.split(",") if s] or list(available())
    rows = []
    hdr = (f"{'strategy':14s} | {'first: wall':>11s} {'cpu':>6s} {'(user':>6s} {'+ sys)':>6s} {'RSS GiB':>7s} | "
           f"{'floor: cpu':>10s} {'GiB':>5s} | {'best: wall':>10s} {'cpu':>6s} {'(user':>6s} {'+ sys)':>6s} {'RSS GiB':>7s}")
    print(hdr)
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        layer = Path(tmp) / "layer.npz"
        if not a.no_fresh:
            save_layer(layer, routing, ctx)
        for name in names:
            row: dict = {"strategy": name}
            try:
                if not a.no_fresh:
                    least = lambda rs: min(rs, key=lambda r: r["cpu_s"])  # noqa: E731 (the least CPU)
                    befores, firsts, floors = [], [], []
                    for _ in range(a.rounds):  # (before, after, floor) in turn: the same load for each
                        if a.before:
                            befores.append(first_run(name, layer, a.timeout, a.numpy_hugepages, a.default_malloc,
                                                     a.before))
                            befores[-1].pop("plan_arrays", None)
                        firsts.append(first_run(name, layer, a.timeout, a.numpy_hugepages, a.default_malloc))
                        if a.floor:
                            floors.append(floor_run(firsts[-1]["plan_arrays"], a.timeout, a.numpy_hugepages,
                                                    a.default_malloc))
                    row["first"], row["first_runs"] = least(firsts), firsts
                    if befores:
                        row["before"], row["before_runs"] = least(befores), befores
                    if floors:
                        row["floor"], row["floor_runs"] = least(floors), floors
                runs = [command_path(name, routing, ctx) for _ in range(a.repeats)]
            except Exception as e:  # a strategy that fails is reported, the others still run
                row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                print(f"{name:14s} error: {row['error'][:100]}")
                continue
            if runs:
                row["best"] = min(runs, key=lambda r: r["cpu_s"])
                row["best_wall_s"] = min(r["wall_s"] for r in runs)
                row["runs"] = runs
            rows.append(row)
            f, b = row.get("first"), row.get("best")
            first = (f"{f['wall_s']:11.2f} {f['cpu_s']:6.2f} {f['user_s']:6.2f} {f['sys_s']:6.2f} "
                     f"{gib(f['peak_rss_bytes']):>7s}") if f else f"{'-':>11s} {'':6s} {'':6s} {'':6s} {'':7s}"
            best = (f"{row['best_wall_s']:10.2f} {b['cpu_s']:6.2f} {b['user_s']:6.2f} {b['sys_s']:6.2f} "
                    f"{gib(b['peak_rss_bytes']):>7s}") if b else "-"
            fl = row.get("floor")
            floor = f"{fl['cpu_s']:10.2f} {fl['bytes'] / 2**30:5.2f}" if fl else f"{'-':>10s} {'':5s}"
            print(f"{name:14s} | {first} | {floor} | {best}")
            if row.get("before"):
                bf = row["before"]
                print(f"{'  before':14s} | {bf['wall_s']:11.2f} {bf['cpu_s']:6.2f} {bf['user_s']:6.2f} {bf['sys_s']:6.2f} "
                      f"{gib(bf['peak_rss_bytes']):>7s} | after / before (cpu): {f['cpu_s'] / bf['cpu_s']:.2f}")
            if not a.no_cli:
                row["cli"] = c = cli_beside(name, row, a, same_layer)
                same = {True: "same Plan", False: "PLAN DIFFERS", None: "(layer from --layer-file: not compared)"}
                print("  " + report_line(c).replace("\n", "\n  ") + f"; {same[c['same_answer']]}")
            if (f or b)["violations"]:
                print(f"  {name}: {(f or b)['violations']} invariant violation(s)")
    load1 = os.getloadavg()
    print(f"first: one run in a fresh process (the least CPU of {a.rounds}); best: the run of least CPU of "
          f"{a.repeats} in this process (wall: the least); cpu = user + sys seconds; RSS: peak while planning "
          "(routing included); floor: CPU s to allocate and write once, in a fresh process, the arrays the Plan "
          "holds (GiB: their size)")
    print(f"load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, at end "
          f"{load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} on {os.cpu_count()} CPUs (other processes inflate the wall times)")
    if a.json:
        import moonep_sim
        result = {"memory": pages, "before": a.before, "rounds": a.rounds, "gen": a.gen, "ranks": a.ranks, "gpus_per_node": a.gpus_per_node, "entries": n, "maxvio": mv,
                  "topology": getattr(ctx.topology, "name", None), "package": str(Path(moonep_sim.__file__).parent),
                  "repeats": a.repeats, "loadavg_start": list(load0), "loadavg_end": list(load1), "strategies": rows}
        write_text_atomic(a.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
