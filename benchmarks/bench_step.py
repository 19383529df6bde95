"""Step-model speed: wall and CPU seconds for whole steps, per strategy (docs/results/steps.md).

Cases (the targets of the step model's issue):

- ``k3-train``: Kimi K3 EP64 (8 nodes of 8 on h800-cx7), train, 4096 tokens per rank, generated
  routing (maxvio 2) included, ``--overlap shared-expert``;
- ``v3-decode``: DeepSeek-V3 EP32 (4 nodes), decode, 32 sequences per rank, context 4096.

Each case runs at every ``--distinct-layers`` value given (0: every MoE layer its own generated
routing -- 92 for K3, 58 for V3 --; N > 0: the shortcut, N layers generated, planned and simulated,
the other MoE layers reusing them, flagged). By default each (case, strategy, distinct) runs in a
fresh ``Scenario``, its routing generated inside the timing (the per-strategy figure); with
``--together`` the strategies run in one step (one generation shared, the per-strategy split read
from the step's own ``cpu_seconds``). Every row gives the measured routing, planning and simulation
CPU seconds per distinct layer. ``--jobs N`` runs the layers in N worker processes (CPU seconds then
count this process and its workers).

``--floor`` (one job) also times, in the same run and right after the step, per distinct layer,
what any implementation of this step model must do at least (the physical floor, not a model of
ours; ``floor_of``), each part named:

- **routing**: the layer's ids ``[T, K]`` and weights written once (allocated and filled, on fresh
  pages), and the fewest random draws (one float32 uniform per entry, numpy's default generator);
- **plan**: the arrays this strategy's Plan holds written once (their shapes and dtypes recorded as
  the step made each Plan, ``bench_plan.plan_arrays``; written by ``bench_plan.write_floor`` on fresh
  pages) and one stable sort of the N entries by slot (``bench_plan_floor.sort_floor``, a key as
  narrow as the slot count allows);
- **simulate**: the simulator's input and output only -- each hop's ``[R, R]`` byte matrix read once
  per direction (its row and column sums: each rank's bytes out and in) and the per-rank records
  written (five ``[R]`` arrays per direction, three per layer; the copies' weight and gradient
  phases not counted: a lower bound). What the flow-level schedule computes between them has no
  implementation-independent lower bound this bench could measure, so it is taken as 0.

**The command's path.** By default (``--no-cli`` to skip; not with ``--moe-layers``, ``--floor`` or
``--jobs``) every run is also timed as the user runs it, right before the in-process run: ``moonep-sim
step ...`` (:func:`cli_argv`, the same case) in a fresh ``python -m moonep_sim`` process, with
``--json`` (whose step times must equal the in-process run's) and ``--quiet`` (with ``--repeat N``
the two alternate who goes first). Its wall and CPU
seconds sit beside the in-process figures in the row (``cli_wall_s``, ``cli_cpu_s``,
``cli_over_inprocess_wall``), and a table of both closes the run.

"Fresh pages": the process first hands its freed memory back (``malloc_trim(0)``), so the arrays
land on pages the kernel must zero, as a first allocation's do. Beside it, ``warm``: the same writes
into pages the process already holds (the bound if every layer reused the last layer's pages, as
the step under the CLI's allocator settings mostly does). Rows then carry the floor per part and in
total over the layers, the target, and measured / floor.

``--pipeline off,on`` runs each (case, strategy, distinct) once serially and once with one job's
two-thread pipeline (``moonep_sim.step.layer_work.pipelined_layer_work``; ``auto``, the default, as the
step decides), one right after the other (``--repeat N``: N such pairs, alternating), and prints,
per pair, the wall ratio and whether the step times are identical.

Reported: **wall seconds** of the run (the issue's target: one job on the 2-core reference machine)
beside its process CPU seconds (user + sys, children included) and the 1-minute load average at
start and end (the reference machine is shared: a wall figure at load > 0 had less than two cores);
the parts per thread -- routing, plan and simulate CPU seconds each as the thread that ran it
measured them (``time.thread_time`` when pipelined), the main thread's seconds waiting for Plans,
the routings it built itself -- and the layers' process CPU over every thread::

    python benchmarks/bench_step.py --json OUT.json
    python benchmarks/bench_step.py --cases k3-train --distinct-layers 0 --together
    python benchmarks/bench_step.py --cases v3-decode --strategies alltoall --jobs 2
    python benchmarks/bench_step.py --cases k3-train --strategies alltoall --distinct-layers 0 --moe-layers 4
    python benchmarks/bench_step.py --routing-only      # each case's generation alone, per layer
    python benchmarks/bench_step.py --cases k3-train --strategies alltoall --floor --moe-layers 4
    python benchmarks/bench_step.py --cases k3-train --strategies alltoall --distinct-layers 0 --pipeline off,on
    python benchmarks/bench_step.py --before /tmp/base --cases k3-train --distinct-layers 4 --rounds 2

``--before TREE`` (an unpacked ``git archive`` of an earlier commit) times the warm step of each
(case, strategy, distinct) in both trees, in turn, ``--rounds`` times: each run a fresh process of
that tree's package that makes the ``Scenario``, steps once to warm up (the kernels' load, the first
touch of its pages), then ``--warm`` more times, the least process CPU seconds of those kept (the
figure a second step of the same Scenario costs). Then the table of before, after and after /
before per row. Only the package's public ``Scenario`` API is used, so any tree with it works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import plan_arrays, write_floor  # noqa: E402
from bench_plan_floor import sort_floor  # noqa: E402
from _cli import time_command  # noqa: E402  (the shared fresh-process timing)

from moonep_sim.experiments import GeneratorSpec, Scenario  # noqa: E402

CASES = {
    "k3-train": dict(spec=dict(model="kimi-k3", maxvio=2.0, tokens_per_rank=4096, layers=92), cluster="64/8",
                     step=dict(mode="train", overlap="shared-expert")),
    "v3-decode": dict(spec=dict(model="deepseek-v3", maxvio=1.0, tokens_per_rank=32, layers=58), cluster="32/8",
                      step=dict(mode="decode", overlap="none", context=4096)),
}
#: the issue's targets: wall seconds per strategy on the 2-core reference machine with one job (the
#: floor's rows compare CPU seconds with them: what one core would need)
TARGET_S = {"k3-train": 20.0, "v3-decode": 2.0}
TARGET_CPU_S = TARGET_S
#: --pipeline's values: the step's own choice, off, on
PIPELINE = {"auto": None, "off": False, "on": True}


def cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class PlanProbe:
    """Records what the floor needs of every Plan the step makes, as it makes it: shapes, dtypes and
    counts, never the arrays (``moonep_sim.strategies.make_plan`` wrapped while the step runs; the
    step looks it up at each call, ``moonep_sim.step.layer_work.simulate_layer_work``). One job only: with
    workers the Plans are made in other processes. ``hook_cpu_s``: what the recording itself cost
    (inside the step's plan seconds)."""

    def __init__(self) -> None:
        self.plans: list[dict] = []
        self.hook_cpu_s = 0.0

    def __enter__(self) -> "PlanProbe":
        import moonep_sim.strategies as st

        self._mod, self._make = st, st.make_plan

        def make_plan(name, routing, ctx, **opts):
            plan = self._make(name, routing, ctx, **opts)
            c0 = time.process_time()
            self.plans.append({"strategy": name, "tokens": int(routing.num_tokens), "top_k": int(routing.top_k),
                               "routing_dtypes": [str(routing.topk_ids_TK.dtype), str(routing.topk_weights_TK.dtype)],
                               "arrays": plan_arrays(plan, routing), "slots": int(plan.slot_rank_S.size),
                               "entries": int(plan.num_tokens * plan.top_k), "hops": len(plan.hops),
                               "ranks": int(plan.ranks)})
            self.hook_cpu_s += time.process_time() - c0
            return plan

        st.make_plan = make_plan
        return self

    def __exit__(self, *exc) -> None:
        self._mod.make_plan = self._make


#: the warm step, in a fresh process of either tree (argv: case JSON, strategy, distinct, warm runs)
WARM_CHILD = """
import json, sys, time
from moonep_sim.experiments import GeneratorSpec, Scenario
c, s, distinct, warm = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sc = Scenario(routing=GeneratorSpec(**c["spec"]), cluster=c["cluster"], topology="h800-cx7", strategies=s)
sc.step(distinct_layers=distinct, **c["step"])
best = float("inf")
for _ in range(warm):
    c0 = time.process_time()
    sc.step(distinct_layers=distinct, **c["step"])
    best = min(best, time.process_time() - c0)
print(json.dumps({"cpu_s": best}))
"""


def warm_step(case: str, strategy: str, distinct: int, warm: int, tree: str = "") -> float:
    """The least CPU seconds of ``warm`` warm steps (see ``--before``) in a fresh process of ``tree``'s
    package (this PYTHONPATH's if empty)."""
    import subprocess

    env = dict(os.environ, **({"PYTHONPATH": str(Path(tree).resolve())} if tree else {}))
    out = subprocess.run([sys.executable, "-c", WARM_CHILD, json.dumps(CASES[case]), strategy, str(distinct),
                          str(warm)], env=env, cwd=tree or None, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["cpu_s"]


def before_after(a) -> list[dict]:
    """``--before``: each (case, strategy, distinct)'s warm step in the earlier tree and this one, in
    turn, ``a.rounds`` times; the least of each kept."""
    rows = []
    for case in a.cases.split(","):
        for distinct in (int(x) for x in a.distinct_layers.split(",")):
            for s in a.strategies.split(","):
                runs = {"before": [], "after": []}
                for _ in range(a.rounds):
                    runs["before"].append(warm_step(case, s, distinct, a.warm, a.before))
                    runs["after"].append(warm_step(case, s, distinct, a.warm))
                row = {"case": case, "strategy": s, "distinct_layers": distinct, "warm": a.warm,
                       "rounds": a.rounds, "before": a.before, "before_cpu_s": min(runs["before"]),
                       "after_cpu_s": min(runs["after"]), "runs": runs, "load_end": os.getloadavg()[0]}
                row["after_over_before"] = row["after_cpu_s"] / row["before_cpu_s"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"{'case':10s} {'strategy':12s} {'distinct':>8s} {'before s':>9s} {'after s':>9s} {'after/before':>12s}")
    for r in rows:
        print(f"{r['case']:10s} {r['strategy']:12s} {r['distinct_layers']:8d} {r['before_cpu_s']:9.3f} "
              f"{r['after_cpu_s']:9.3f} {r['after_over_before']:12.3f}")
    print(f"(warm steps, least of {a.warm} per run x {a.rounds} rounds, CPU s; load average at end "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    return rows


def fresh_pages() -> None:
    """Hand this process's freed memory back to the kernel (glibc ``malloc_trim(0)``; elsewhere
    nothing), so the next arrays land on fresh pages."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cpu(fn) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _written(sizes: list) -> tuple[float, float]:
    """(fresh, warm) CPU seconds of writing arrays of ``sizes`` once (``bench_plan.write_floor``)."""
    fresh_pages()
    fresh = write_floor(sizes)["cpu_s"]
    return fresh, write_floor(sizes)["cpu_s"]  # the same sizes again: the pages just freed


def floor_of(plans: list[dict], strategies: list[str], train: bool, seed: int = 0) -> dict:
    """The step's floor from the Plans recorded by :class:`PlanProbe` (see the module docstring):
    per strategy, each part's CPU seconds summed over its layers (the routing's shared by the
    strategies, counted for each, as the measured routing is), the total on fresh pages and warm."""
    rng = np.random.default_rng(seed)
    first = [p for p in plans if p["strategy"] == strategies[0]]  # one per distinct layer (M = 1)
    routing = {"write": 0.0, "write_warm": 0.0, "draws": 0.0}
    buf = np.zeros(max((p["tokens"] * p["top_k"] for p in first), default=0), np.float32)
    for p in first:
        n = p["tokens"] * p["top_k"]
        f, w = _written([(n, p["routing_dtypes"][0]), (n, p["routing_dtypes"][1])])
        routing["write"] += f
        routing["write_warm"] += w
        out = buf[:n]
        routing["draws"] += _cpu(lambda: rng.random(out=out, dtype=np.float32))  # one uniform per entry
    out = {}
    dirs = 2 if train else 1
    for s in strategies:
        mine = [p for p in plans if p["strategy"] == s]
        part = {"plan_write": 0.0, "plan_write_warm": 0.0, "plan_sort": 0.0, "simulate_io": 0.0}
        for p in mine:
            f, w = _written(p["arrays"])
            part["plan_write"] += f
            part["plan_write_warm"] += w
            key = rng.integers(0, max(p["slots"], 1), p["entries"],
                               dtype=np.uint16 if p["slots"] <= 2**16 else np.uint32)
            part["plan_sort"] += sort_floor(key)[0]  # the one stable sort of the N entries by slot
            del key
            R = p["ranks"]
            mats = [np.ones((R, R)) for _ in range(p["hops"] * dirs)]  # the simulator's input, given

            def io(mats=mats, R=R):
                for m in mats:  # each rank's bytes out and in (what a bandwidth bound needs)
                    m.sum(axis=1), m.sum(axis=0)
                for _ in range(5 * dirs + 3):  # pre, expert, post, grad, plan per direction; rows, padded, copies
                    np.empty(R).fill(0.0)

            part["simulate_io"] += _cpu(io)
        fl = {"layers": len(mine), "routing_write_cpu_s": routing["write"], "routing_draws_cpu_s": routing["draws"],
              "plan_write_cpu_s": part["plan_write"], "plan_sort_cpu_s": part["plan_sort"],
              "simulate_io_cpu_s": part["simulate_io"]}
        fl["routing_cpu_s"] = routing["write"] + routing["draws"]
        fl["plan_cpu_s"] = part["plan_write"] + part["plan_sort"]
        fl["simulate_cpu_s"] = part["simulate_io"]
        fl["total_cpu_s"] = fl["routing_cpu_s"] + fl["plan_cpu_s"] + fl["simulate_cpu_s"]
        fl["warm_total_cpu_s"] = (routing["write_warm"] + routing["draws"] + part["plan_write_warm"]
                                  + part["plan_sort"] + part["simulate_io"])
        fl["routing_write_warm_cpu_s"], fl["plan_write_warm_cpu_s"] = routing["write_warm"], part["plan_write_warm"]
        fl["plan_bytes_per_layer"] = (sum(n * np.dtype(d).itemsize for p in mine for n, d in p["arrays"])
                                      / max(len(mine), 1))
        out[s] = fl
    return out


def run(case: str, strategies: list[str], distinct: int, jobs: int, moe_layers: int = 0,
        floor: bool = False, pipeline: str = "auto") -> list[dict]:
    c = CASES[case]
    sc = Scenario(routing=GeneratorSpec(**c["spec"]), cluster=c["cluster"], topology="h800-cx7",
                  strategies=strategies)
    extra = {}
    if moe_layers:  # a quick run: the model cut to its dense layers and its first N MoE layers
        m = sc.resolved.source.model
        extra["model"] = dataclasses.replace(m, layers=m.dense_layers + moe_layers, moe_layers=moe_layers)
    load0 = os.getloadavg()[0]
    c0, t0 = cpu_s(), time.perf_counter()
    probe = PlanProbe()
    extra["pipeline"] = PIPELINE[pipeline]
    if floor:
        with probe:
            res = sc.step(distinct_layers=distinct, jobs=jobs, **c["step"], **extra)
    else:
        res = sc.step(distinct_layers=distinct, jobs=jobs, **c["step"], **extra)
    cpu, wall = cpu_s() - c0, time.perf_counter() - t0
    floors = {}
    if floor:
        f0 = cpu_s()
        floors = floor_of(probe.plans, strategies, c["step"]["mode"] == "train")
        floor_run_cpu = cpu_s() - f0
    rows = []
    for s in strategies:
        d = res.figures[s]
        n = d["distinct_layers_simulated"]
        k = d["cpu_seconds"]
        piped = res.setup.get("pipeline")
        rows.append({
            "case": case + (f" (cut to {moe_layers} MoE layers)" if moe_layers else ""), "strategy": s, "together": strategies if len(strategies) > 1 else None,
            "distinct_layers": distinct, "layers_simulated": n, "jobs": jobs,
            "pipeline": pipeline, "pipelined": piped is not None,
            "wall_s": wall, "cpu_s": cpu, "load_start": load0, "load_end": os.getloadavg()[0],
            "target_wall_s": TARGET_S[case] if not moe_layers else None,
            # the parts per thread (pipelined: routing and plan mostly the second thread's, simulate the
            # main thread's); the main thread's wait for Plans; the layers' CPU over every thread
            "main_wait_s": piped["wait_s"] if piped else None,
            "routings_on_main": piped["routings_on_main"] if piped else None,
            # each thread's own CPU seconds over the layers: the larger is what two free cores need
            "main_thread_cpu_s": piped["main_cpu_s"] if piped else None,
            "second_thread_cpu_s": piped["second_cpu_s"] if piped else None,
            "second_wait_s": piped["second_wait_s"] if piped else None,
            "layers_cpu_s": k.get("layers"), "layers_wall_s": d["wall_seconds"]["layers_wall"],
            # this strategy's own share: the (shared) routing, its planning, simulation and composition
            "strategy_cpu_s": k["routing"] + k["plan"] + k["simulate"] + k["compose"],
            "routing_cpu_s": k["routing"], "plan_cpu_s": k["plan"], "simulate_cpu_s": k["simulate"],
            "compose_cpu_s": k["compose"],
            "measured_per_layer_cpu_s": {"routing": k["routing"] / n, "plan": k["plan"] / n,
                                         "simulate": k["simulate"] / n},
            "step_time_us": d["step_time_us"]})
        if floor:
            fl = floors[s]
            # the figure the target is for: the run alone, or this strategy's share of a run together
            measured = cpu if len(strategies) == 1 else rows[-1]["strategy_cpu_s"]
            rows[-1].update(floor=fl, target_cpu_s=TARGET_CPU_S[case], measured_cpu_s=measured,
                            measured_over_floor=measured / fl["total_cpu_s"],
                            measured_over_warm_floor=measured / fl["warm_total_cpu_s"],
                            part_measured_over_floor={p: k[p] / fl[p + "_cpu_s"] if fl[p + "_cpu_s"] > 0 else None
                                                      for p in ("routing", "plan", "simulate")},
                            floor_run_cpu_s=floor_run_cpu, probe_hook_cpu_s=probe.hook_cpu_s)
    return rows


def floor_table(rows: list[dict]) -> str:
    """The rows with a floor, as a terminal table (CPU s)."""
    head = (f"{'case':34s} {'strategy':9s} {'layers':>6s} {'measured':>8s} | {'floor':>6s} {'routing':>7s} "
            f"{'plan':>6s} {'sim':>7s} {'warm':>6s} | {'target':>6s} {'meas/fl':>7s}  (CPU s)")
    out = [head]
    for r in rows:
        f = r.get("floor")
        if f:
            out.append(f"{r['case'][:34]:34s} {r['strategy']:9s} {f['layers']:6d} {r['measured_cpu_s']:8.3g} | "
                       f"{f['total_cpu_s']:6.3g} {f['routing_cpu_s']:7.3g} {f['plan_cpu_s']:6.3g} "
                       f"{f['simulate_cpu_s']:7.2g} {f['warm_total_cpu_s']:6.3g} | {r['target_cpu_s']:6.3g} "
                       f"{r['measured_over_floor']:7.3g}")
    return "\n".join(out)


def pipeline_table(rows: list[dict]) -> str:
    """Serial against pipelined runs of the same (case, strategy, distinct, repeat): wall, CPU, the
    load, wall serial / pipelined, and whether the step times are identical."""
    head = (f"{'case':34s} {'strategy':9s} {'rep':>3s} | {'serial wall':>11s} {'cpu':>6s} | {'piped wall':>10s} "
            f"{'cpu':>6s} {'main':>6s} {'2nd':>6s} {'wait':>5s} | {'ratio':>5s} {'load':>9s} {'same':>4s}")
    out = [head]
    key = lambda r: (r["case"], r["strategy"], r["distinct_layers"], r["repeat"])
    by: dict = {}
    for r in rows:
        by.setdefault(key(r), {})[r["pipelined"]] = r
    for k, pair in by.items():
        if False in pair and True in pair:
            a, b = pair[False], pair[True]
            load = f"{min(a['load_start'], b['load_start']):.1f}-{max(a['load_end'], b['load_end']):.1f}"
            out.append(f"{k[0][:34]:34s} {k[1]:9s} {k[3]:3d} | {a['wall_s']:11.2f} {a['cpu_s']:6.2f} | "
                       f"{b['wall_s']:10.2f} {b['cpu_s']:6.2f} {b['main_thread_cpu_s']:6.2f} "
                       f"{b['second_thread_cpu_s']:6.2f} {b['main_wait_s']:5.2f} | "
                       f"{a['wall_s'] / b['wall_s']:5.2f} {load:>9s} "
                       f"{'yes' if a['step_time_us'] == b['step_time_us'] else 'NO':>4s}")
    return "\n".join(out) + ("\n(wall and CPU seconds; main, 2nd: each thread's own CPU seconds over the layers, "
                             "the larger what two free cores need; wait: the main thread's seconds waiting for Plans)")


def routing_only(case: str, moe_layers: int = 0) -> dict:
    """Only the step's routing: each MoE layer generated as the step generates it (the same
    builder, seed and split over the ranks), nothing planned: the per-layer generation floor,
    with the spread over layers (some need the realised-maxvio refinement)."""
    import moonep_sim.step.run  # noqa: F401  (imported by the step before it generates: not timed here)
    from moonep_sim.experiments.step import GeneratedLayer

    c = CASES[case]
    sc = Scenario(routing=GeneratorSpec(**c["spec"]), cluster=c["cluster"], topology="h800-cx7",
                  strategies=["alltoall"])
    rs = sc.resolved
    n = moe_layers or rs.source.model.moe_layers
    load0 = os.getloadavg()[0]
    per = []
    t0 = time.perf_counter()
    for i in range(n):
        c0 = cpu_s()
        GeneratedLayer(rs.source, i, rs.cluster.ranks)()
        per.append(cpu_s() - c0)
    return {"case": case + (f" (first {n} MoE layers)" if moe_layers else ""), "routing_only": True,
            "layers": n, "cpu_s": sum(per), "wall_s": time.perf_counter() - t0, "load_start": load0,
            "load_end": os.getloadavg()[0], "per_layer_cpu_s": {"mean": sum(per) / n, "min": min(per),
                                                                "max": max(per), "median": sorted(per)[n // 2]}}


def cli_argv(case: str, strategies: list[str], distinct: int, pipeline: str = "auto") -> list[str]:
    """The ``moonep-sim step`` command a user types for this (case, strategies, distinct layers)."""
    c = CASES[case]
    spec, st = c["spec"], c["step"]
    R, G = c["cluster"].split("/")
    gen = f"model={spec['model']},maxvio={spec['maxvio']:g},tokens-per-rank={spec['tokens_per_rank']}"
    argv = ["step", "--gen", gen, "--ranks", R, "--gpus-per-node", G, "--topology", "h800-cx7",
            "--strategies", ",".join(strategies), "--mode", st["mode"], "--overlap", st["overlap"]]
    if st.get("context"):
        argv += ["--context", str(st["context"])]
    if distinct:
        argv += ["--distinct-layers", str(distinct)]
    if pipeline != "auto":
        argv += ["--pipeline", pipeline]
    return argv


def run_cli(case: str, strategies: list[str], distinct: int, pipeline: str = "auto") -> dict:
    """The command as a user runs it: a fresh ``python -m moonep_sim`` process (imports, parsing,
    checks, generation, the step, the JSON document), its wall and CPU seconds (user + sys, from the
    child's rusage) and its step times (``--json``: the figures must equal the in-process run's)."""
    argv = cli_argv(case, strategies, distinct, pipeline) + ["--json", "--quiet"]
    try:
        r = time_command(argv, env=dict(os.environ, MOONEP_SIM_QUIET="1"))
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    doc = json.loads(r["stdout"])
    run0 = r["runs"][0]
    return {"cli_command": r["command"], "cli_wall_s": run0["wall_s"], "cli_cpu_s": run0["cpu_s"],
            "cli_user_s": run0["user_s"], "cli_sys_s": run0["sys_s"], "cli_load_start": r["load_start"],
            "cli_step_time_us": {s: doc["strategies"][s]["step_time_us"] for s in strategies}}


def with_cli(rows: list[dict], cli: dict) -> list[dict]:
    """The in-process rows of one run, each with the CLI's figures beside it (same step times?)."""
    for r in rows:
        r.update(cli, cli_over_inprocess_wall=cli["cli_wall_s"] / r["wall_s"],
                 cli_over_inprocess_cpu=cli["cli_cpu_s"] / r["cpu_s"],
                 cli_same_step_time=cli["cli_step_time_us"].get(r["strategy"]) == r["step_time_us"])
    return rows


def cli_table(rows: list[dict]) -> str:
    """The CLI beside the in-process run, back to back: wall and CPU seconds and their ratios."""
    out = ["| case | strategy | CLI wall s | in-process wall s | CLI / in-process | CLI CPU s | in-process CPU s | "
           "CLI / in-process CPU | load | same step time |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "cli_wall_s" in r:
            out.append(f"| {r['case']} | {r['strategy']} | {r['cli_wall_s']:.1f} | {r['wall_s']:.1f} | "
                       f"{r['cli_over_inprocess_wall']:.2f}x | {r['cli_cpu_s']:.1f} | {r['cpu_s']:.1f} | "
                       f"{r['cli_over_inprocess_cpu']:.2f}x | "
                       f"{r['cli_load_start']:.1f}-{r['load_end']:.1f} | {r['cli_same_step_time']} |")
    out += ["", "commands timed (each in a fresh process):"]
    out += [f"  {c}" for c in dict.fromkeys(r["cli_command"] for r in rows if "cli_command" in r)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from moonep_sim.memory import prefer_small_pages, reuse_freed_memory

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="k3-train,v3-decode")
    ap.add_argument("--strategies", default="alltoall,deepep,moonep")
    ap.add_argument("--distinct-layers", default="0,4", help="comma list; 0 = every layer its own")
    ap.add_argument("--together", action="store_true", help="all strategies in one step (routing shared)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--moe-layers", type=int, default=0, metavar="N",
                    help="cut the model to its first N MoE layers (a quick run, named in the row; 0 = all)")
    ap.add_argument("--pipeline", default="auto", help="comma list of auto, off, on: one job's two-thread "
                                                       "pipeline (each value in turn, in the same minutes)")
    ap.add_argument("--repeat", type=int, default=1, help="run each --pipeline list N times, alternating its order")
    ap.add_argument("--json", default=None)
    ap.add_argument("--routing-only", action="store_true",
                    help="time only the step's routing (every MoE layer generated as the step does, none planned)")
    ap.add_argument("--floor", action="store_true",
                    help="also time, in the same run, each distinct layer's floor (routing, plan, simulator I/O)")
    ap.add_argument("--no-cli", action="store_true",
                    help="skip the command-line run (by default each run is also timed as `moonep-sim step` in a "
                         "fresh process, right before the in-process run)")
    ap.add_argument("--before", default="", metavar="TREE",
                    help="time the warm step here and in TREE (an earlier commit's unpacked tree), in turn: "
                         "before/after in one run (--rounds, --warm)")
    ap.add_argument("--rounds", type=int, default=2, help="with --before: runs per tree, alternated")
    ap.add_argument("--warm", type=int, default=4, help="with --before: warm steps per run (the least kept)")
    a = ap.parse_args(argv)
    if a.before:
        if a.rounds < 1 or a.warm < 1 or not Path(a.before, "moonep_sim").is_dir():
            ap.error(f"--before ({a.before}) must be a tree holding moonep_sim/, --rounds ({a.rounds}) and "
                     f"--warm ({a.warm}) >= 1")
        rows = before_after(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"rows": rows, "load_end": os.getloadavg()}, f, indent=1)
        return 0
    pipelines = a.pipeline.split(",")
    if any(p not in PIPELINE for p in pipelines) or a.repeat < 1:
        ap.error(f"--pipeline ({a.pipeline}) must be a comma list of {', '.join(PIPELINE)} and --repeat "
                 f"({a.repeat}) >= 1")
    if a.floor and (a.jobs != 1 or a.routing_only):
        ap.error(f"--floor times the Plans made in this process: it needs --jobs 1 (got {a.jobs}) and no "
                 "--routing-only")
    if a.floor:  # the floor's CPU seconds are one thread's: the step runs serially
        if "on" in pipelines:
            ap.error("--floor records the Plans and CPU seconds of one thread: it needs --pipeline off (or auto)")
        pipelines = ["off" if p == "auto" else p for p in pipelines]
    prefer_small_pages()  # as the CLI does (moonep_sim/memory.py)
    reuse_freed_memory()
    strategies = a.strategies.split(",")
    rows = []
    for case in a.cases.split(",") if a.routing_only else []:
        rows.append(routing_only(case, a.moe_layers))
        print(json.dumps(rows[-1]), flush=True)
    for case in a.cases.split(",") if not a.routing_only else []:
        for distinct in (int(x) for x in a.distinct_layers.split(",")):
            groups = [strategies] if a.together else [[s] for s in strategies]
            for g in groups:
                for rep in range(a.repeat):
                    modes = pipelines if rep % 2 == 0 else pipelines[::-1]  # alternate who goes first
                    for mode in modes:
                        cli = None
                        timed_cli = not (a.no_cli or a.moe_layers or a.floor or a.jobs != 1)
                        if timed_cli and rep % 2 == 0:  # back to back, who goes first alternating over --repeat
                            cli = run_cli(case, g, distinct, mode)
                        got = run(case, g, distinct, a.jobs, a.moe_layers, a.floor, mode)
                        if timed_cli and rep % 2 == 1:
                            cli = run_cli(case, g, distinct, mode)
                        for r in with_cli(got, cli) if cli else got:
                            r["repeat"] = rep
                            print(json.dumps(r), flush=True)
                            rows.append(r)
    if len(pipelines) > 1 and not a.routing_only:
        print(pipeline_table(rows))
    if any("cli_wall_s" in r for r in rows):
        print(cli_table(rows))
    if a.floor:
        print(floor_table(rows))
        print(f"load average (1/5/15 min) at end: {'/'.join(f'{x:.1f}' for x in os.getloadavg())} on "
              f"{os.cpu_count()} CPUs")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "load_end": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
