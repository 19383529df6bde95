"""Fault test: a rank killed (SIGKILL) or stopped (SIGSTOP) during start-up, and after it, is named.

Each run starts 3 gloo ranks (``tests/rank_spawner.spawn_ranks``, no torchrun agent); the
victim (rotating over the ranks) sends itself the signal at a point (rotating):

- during start-up: ``starting`` (before the process group is set up, through the
  ``MOONEP_SIM_FAULT`` hook of ``moonep_sim.gloo.liveness``);
- after start-up: before the Buffer is built, before the routing exchange, before the first hop,
  before the combine.

A run counts as named when the spawner (which knows its children's pids) names the victim as lost
while starting (start-up runs), and every survivor exits 1 with one line naming the victim alone as
the silent peer, with the phase (``starting`` for start-up runs). For each run the survivors' exit
time is taken against the timeout: (last survivor's exit - the fault) / the timeout the survivors
wait on (the process-group set-up's for start-up runs, the collectives' after), the fault being the
spawner's note of it (start-up) or the moment the victim signalled itself (after).

    python benchmarks/fault_startup.py                 # 10 + 10 runs per signal, three rounds
    python benchmarks/fault_startup.py --runs 4 --rounds 1

Prints one line per (round, signal, stage) and a JSON summary with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))  # the tests' rank spawner

from rank_spawner import spawn_ranks  # noqa: E402

WORLD = 3
AFTER_POINTS = ("build", "exchange", "hop", "combine")
START_TIMEOUT_S = 20.0  # process-group set-up limit (above 3 processes' torch-import skew on 2 loaded cores)
COLLECTIVE_TIMEOUT_S = 2.0


def worker(rank, world, victim, point, sig, timeout_s, fault_file=None):
    """After start-up: the Buffer steps of a small layer; the victim signals itself at ``point``
    (first writing the moment, CLOCK_MONOTONIC, to ``fault_file``)."""
    import torch

    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.strategies import PlanContext, planner

    def maybe(here):
        if rank == victim and point == here:
            if fault_file:
                Path(fault_file).write_text(repr(time.monotonic()))
            os.kill(os.getpid(), getattr(signal, sig))

    maybe("build")
    buf = Buffer(capacity=4, hidden=4, top_k=2, num_experts=6, planner=planner("alltoall", PlanContext.default(6, world)),
                 timeout_s=timeout_s)
    x, w = torch.randn(4, 4), torch.ones(4, 2)
    ids = torch.tensor([[0, 5], [1, 4], [2, 3], [3, 0]])
    maybe("exchange")
    routing, w64 = buf.exchange_routing(ids, w)
    handle = buf.plan_handle(routing, w64)
    maybe("hop")
    rows, row_w, _, _ = buf.dispatch(x, handle=handle)
    maybe("combine")
    buf.combine(rows, handle, row_w)
    return {"finished": True}


def _named_silent(line: str) -> list[int]:
    m = re.search(r"silent peer ranks? (.*?)\)\)", line)
    return [int(v) for v in re.findall(r"(?:^|, )(\d+) \(", m.group(1))] if m else []


def one_run(sig: str, stage: str, i: int, tmp: Path) -> dict:
    victim = i % WORLD
    fault_file = tmp / f"{sig}-{stage}-{i}.t"
    survivors = [r for r in range(WORLD) if r != victim]
    if stage == "start":
        point, env, timeout = "starting", {"MOONEP_SIM_FAULT": f"{victim}:starting:{sig[3:]}"}, START_TIMEOUT_S
        kwargs = dict(victim=-1, point="", sig=sig, timeout_s=COLLECTIVE_TIMEOUT_S)
    else:
        point, env, timeout = AFTER_POINTS[i % len(AFTER_POINTS)], {}, COLLECTIVE_TIMEOUT_S
        kwargs = dict(victim=victim, point=point, sig=sig, timeout_s=COLLECTIVE_TIMEOUT_S, fault_file=str(fault_file))
    t_spawn = time.monotonic()
    res = spawn_ranks("fault_startup:worker", WORLD, kwargs, timeout_s=150, pythonpath=[str(HERE)],
                      kill_on_failure=False, wait_for=survivors, pg_timeout_s=START_TIMEOUT_S, env=env)
    problems = []
    if stage == "start" and "while starting" not in res[victim].launcher_note:
        problems.append(f"spawner note {res[victim].launcher_note!r}")
    for r in survivors:
        lines = [ln for ln in res[r].output.splitlines() if "moonep-sim: error:" in ln]
        phase_ok = (" starting: " in lines[0]) if (lines and stage == "start") else True
        if res[r].returncode != 1 or len(lines) != 1 or not phase_ok or _named_silent(lines[0]) != [victim]:
            problems.append(f"rank {r} exit {res[r].returncode}: {res[r].output.strip()[-240:]}")
    # seconds from the spawn: start-up, when the spawner saw the victim lost; after, when it signalled itself
    t_fault = res[victim].noted_s if stage == "start" else (
        float(fault_file.read_text()) - t_spawn if fault_file.exists() else None)
    ends = [res[r].exit_s for r in survivors if res[r].exit_s is not None]
    ratio = (max(ends) - t_fault) / timeout if ends and t_fault is not None else None
    return {"sig": sig, "stage": stage, "run": i, "victim": victim, "point": point, "named": not problems,
            "problems": problems, "survivor_exit_over_timeout": ratio}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    t0 = time.monotonic()
    c0 = os.times()
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="fault-startup-"))
    for rnd in range(a.rounds):
        for sig in ("SIGKILL", "SIGSTOP"):
            for stage in ("start", "after"):
                with ThreadPoolExecutor(a.concurrent) as pool:
                    runs = list(pool.map(lambda i: one_run(sig, stage, i, tmp), range(a.runs)))
                named = sum(r["named"] for r in runs)
                ratios = [r["survivor_exit_over_timeout"] for r in runs if r["survivor_exit_over_timeout"] is not None]
                rows.append({"round": rnd + 1, "sig": sig, "stage": stage, "named": named, "runs": a.runs,
                             "max_exit_over_timeout": max(ratios) if ratios else None,
                             "problems": [p for r in runs for p in r["problems"]]})
                worst = f"{max(ratios):.2f}" if ratios else "n/a"
                print(f"round {rnd + 1} {sig} {stage:5s}: named in {named} of {a.runs}; survivors' exit / timeout "
                      f"at most {worst}", flush=True)
                for p in rows[-1]["problems"]:
                    print(f"    {p}", flush=True)
    c1 = os.times()
    summary = {"rows": rows, "wall_s": round(time.monotonic() - t0, 1),
               "cpu_s_children": round((c1.children_user + c1.children_system) - (c0.children_user + c0.children_system), 1),
               "load": os.getloadavg(), "start_timeout_s": START_TIMEOUT_S, "collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    print(f"wall {summary['wall_s']} s, children CPU {summary['cpu_s_children']} s, load {summary['load']}")
    if a.json:
        print(json.dumps(summary, indent=1))
    return 0 if all(r["named"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
