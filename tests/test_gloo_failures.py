"""Failure behaviour of the gloo executor: a stopped or dead rank is named, and configuration that differs.

Ranks are plain processes (no torchrun agent to kill the survivors), so the survivors must fail
by themselves, within the executor's timeout, naming the phase and the silent rank -- from its
heartbeat (moonep_sim.gloo.liveness), not only from how far it got.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from rank_spawner import spawn_ranks

pytestmark = pytest.mark.slow  # every test here starts gloo ranks in processes (-m "not slow" skips them)

HERE = str(Path(__file__).resolve().parent)
WORLD, TIMEOUT_S = 3, 2.0
# where the victim goes silent, by the phase the survivors are then stuck in
POINTS = ("build", "exchange", "hop", "combine", "next_step")
RUNS = 10
CONCURRENT = 5


def fault_worker(rank, world, victim, point, sig, timeout_s, mode="fault"):
    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.strategies import PlanContext, planner

    def maybe_die(here):
        if rank == victim and here and point == here:
            os.kill(os.getpid(), getattr(signal, sig))  # SIGSTOP: stopped; SIGKILL: dead

    maybe_die("build")
    top_k = 3 if (mode == "config" and rank == victim) else 2
    buf = Buffer(capacity=4, hidden=4, top_k=top_k, num_experts=6, planner=planner("alltoall", PlanContext.default(6, world)),
                 timeout_s=timeout_s)
    x = torch.randn(4, 4)
    ids = torch.tensor([[0, 5], [1, 4], [2, 3], [3, 0]])
    w = torch.ones(4, 2)
    for step in range(2):
        maybe_die("exchange" if step == 0 else "next_step")
        routing, w64 = buf.exchange_routing(ids, w)
        handle = buf.plan_handle(routing, w64)
        maybe_die("hop" if step == 0 else "")
        rows, row_w, _, _ = buf.dispatch(x, handle=handle)
        maybe_die("combine" if step == 0 else "")
        buf.combine(rows, handle, row_w)
    return {"finished": True}


def _named_silent(output: str) -> list[int]:
    m = re.search(r"silent peer ranks? (.*?)\)\): ", output)
    return [int(v) for v in re.findall(r"(?:^|, )(\d+) \(", m.group(1))] if m else []


def _fault_run(sig: str, i: int) -> str | None:
    """Run ``i``: victim and point in turn; returns what went wrong, or None."""
    victim, point = i % WORLD, POINTS[i % len(POINTS)]
    survivors = [r for r in range(WORLD) if r != victim]
    res = spawn_ranks("test_gloo_failures:fault_worker", WORLD,
                      dict(victim=victim, point=point, sig=sig, timeout_s=TIMEOUT_S),
                      timeout_s=90, pythonpath=[HERE], kill_on_failure=False, wait_for=survivors)
    want_victim = None if sig == "SIGSTOP" else -signal.SIGKILL  # a stopped victim is killed by the spawner
    problems = []
    if res[victim].returncode != want_victim:
        problems.append(f"victim exit {res[victim].returncode}")
    for r in survivors:
        out = res[r].output
        if res[r].returncode != 1 or not re.search(
                rf"CommError: \S+ \S+ (timed out|failed) after [\d.]+ s on rank {r} ", out):
            problems.append(f"rank {r} exit {res[r].returncode}: {out.strip()[-300:]}")
        elif _named_silent(out) != [victim]:
            problems.append(f"rank {r} named {_named_silent(out)}: {out.strip()[-300:]}")
    return f"run {i} ({sig} rank {victim} at {point}): " + "; ".join(problems) if problems else None


def _fault_runs(sig: str) -> list[str]:
    """RUNS runs, CONCURRENT at a time (each its own store and ranks: they share nothing; most of a
    run is waiting on timeouts); returns a description of every run that failed."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(CONCURRENT) as pool:
        return [b for b in pool.map(lambda i: _fault_run(sig, i), range(RUNS)) if b]


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_stopped_or_killed_rank_is_named_in_every_run(sig):
    t0 = time.monotonic()
    bad = _fault_runs(sig)
    print(f"{RUNS} {sig} runs in {time.monotonic() - t0:.1f} s")
    assert not bad, f"{len(bad)} of {RUNS} runs did not name the victim alone:\n" + "\n".join(bad)


def test_dead_rank_named_with_phase():
    """One quick run of each kind outside the slow suite: the victim dies after the exchange."""
    res = spawn_ranks("test_gloo_failures:fault_worker", WORLD,
                      dict(victim=2, point="hop", sig="SIGKILL", timeout_s=TIMEOUT_S),
                      timeout_s=90, pythonpath=[HERE], kill_on_failure=False, wait_for=[0, 1])
    assert res[2].returncode == -signal.SIGKILL
    for r in res[:2]:
        assert r.returncode == 1, r.output
        # the survivors fail in the first hop (the victim's sockets closed): phase, rank and victim named
        assert re.search(rf"CommError: dispatch\.0 (all_to_all|send/recv) failed after [\d.]+ s on rank {r.rank} "
                         r"\(silent peer rank 2 \(no heartbeat for [\d.]+ s: stopped or dead; "
                         r"last entered dispatch\.exchange\)\)", r.output), r.output


def test_config_differing_across_ranks_is_detected_at_build():
    res = spawn_ranks("test_gloo_failures:fault_worker", WORLD,
                      dict(victim=2, point="", sig="", timeout_s=10, mode="config"),
                      timeout_s=60, pythonpath=[HERE], kill_on_failure=False)
    for r in res:
        assert r.returncode == 2, r.output
        assert "ConfigError: Buffer top_k must be equal on every rank (ranks [0, 1] agree with rank 0, " \
               "ranks [2] differ; values by rank [2, 2, 3])" in r.output, r.output


# ------------------------------------------------------------------------ lost while starting
START_TIMEOUT_S = 20.0  # process-group set-up limit: above the start-up skew of 3 processes importing torch


def start_worker(rank, world):
    """Nothing to do once the group is up: the fault happens before (MOONEP_SIM_FAULT)."""
    return {"started": True}


def _start_fault_run(sig: str, victim: int) -> str | None:
    """A rank sends itself SIG before the process group is set up (the liveness hook); returns what
    went wrong, or None: the spawner names it as lost while starting, and every survivor names it
    as the silent peer with the phase "starting"."""
    survivors = [r for r in range(WORLD) if r != victim]
    res = spawn_ranks("test_gloo_failures:start_worker", WORLD, timeout_s=120, pythonpath=[HERE],
                      kill_on_failure=False, wait_for=survivors, pg_timeout_s=START_TIMEOUT_S,
                      env={"MOONEP_SIM_FAULT": f"{victim}:starting:{sig}"})
    problems = []
    want = "died while starting (killed by SIGKILL)" if sig == "KILL" else "stopped while starting"
    if want not in res[victim].launcher_note:
        problems.append(f"spawner's note on rank {victim}: {res[victim].launcher_note!r}")
    for r in survivors:
        out = res[r].output
        lines = [ln for ln in out.splitlines() if "moonep-sim: error:" in ln]
        if res[r].returncode != 1 or len(lines) != 1 or not re.search(
                rf"CommError: starting: process group set-up .* on rank {r} of {WORLD} \(silent peer rank {victim} "
                r"\((no heartbeat for [\d.]+ s: stopped or dead|never started)\)\)", lines[0]):
            problems.append(f"rank {r} exit {res[r].returncode}: {out.strip()[-300:]}")
    return f"{sig} rank {victim} while starting: " + "; ".join(problems) if problems else None


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_rank_lost_while_starting_is_named_by_the_spawner_and_the_survivors(sig):
    bad = _start_fault_run(sig, victim=1)
    assert bad is None, bad


def test_replay_launcher_names_a_rank_lost_while_starting(tmp_path):
    """launch/replay.py --nproc: a rank killed before the group is up is named by the launcher in
    one line with the phase, exit 1, and no rank is left running."""
    import subprocess
    import sys

    repo = Path(HERE).parent
    p = subprocess.run([sys.executable, str(repo / "launch" / "replay.py"), "--nproc", "2", "--trace",
                        str(repo / "traces" / "mixtral-8x7b_humaneval.safetensors"), "--strategy", "alltoall",
                        "--layers", "0", "--timeout", str(START_TIMEOUT_S), "--quiet"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(repo), MOONEP_SIM_FAULT="1:starting:KILL"))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0] == ("moonep-sim: error: starting: rank 1 of 2 died while starting (killed by SIGKILL) before the "
                        "process group was up; the launcher stopped the other rank (0)"), lines[0]


# ------------------------------------------------------------------------ Ctrl-C at any moment
def _processes_naming(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


@pytest.mark.parametrize("delay_s", [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0])
def test_ctrl_c_at_any_moment_of_the_replay_is_exit_130_and_one_line(delay_s, tmp_path):
    """SIGINT to launch/replay.py at a spread of moments: while torch is imported, while the ranks
    start, while they run. The delay is the input (the moment of the interrupt), not a
    synchronisation: every moment must give exit 130, the one line, no rank left. (Before the
    script's first line runs -- the interpreter's own start-up, tens of ms -- Python itself handles
    SIGINT: docs/failures.md.)"""
    import shutil
    import subprocess
    import sys

    repo = Path(HERE).parent
    trace = tmp_path / f"ctrl-c-{os.getpid()}-{delay_s}.safetensors"
    shutil.copy(repo / "traces" / "mixtral-8x7b_humaneval.safetensors", trace)
    p = subprocess.Popen([sys.executable, str(repo / "launch" / "replay.py"), "--nproc", "2", "--trace", str(trace),
                          "--strategy", "alltoall", "--layers", "0", "--iters", "9000", "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(repo)))
    time.sleep(delay_s)  # the moment of the interrupt (see the docstring)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert lines == ["moonep-sim: interrupted"], err[-2000:]
    assert _processes_naming(str(trace)) == []
