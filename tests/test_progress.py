"""Progress of long work (moonep_sim.progress): a bar on a terminal, nothing when piped or quiet.

The end-to-end checks run ``moonep-sim step`` under a pseudo-terminal (``os.openpty``: what a user's
terminal gives the process) and through pipes, and compare what each prints."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import types

import pytest

from moonep_sim import progress as P

STEP = [sys.executable, "-m", "moonep_sim", "step", "--gen", "model=olmoe-1b-7b,maxvio=2,tokens-per-rank=512",
        "--ranks", "8", "--strategies", "alltoall,moonep", "--pipeline", "off"]


def test_off_a_terminal_a_tracker_is_a_no_op(capsys, monkeypatch):
    monkeypatch.delenv("MOONEP_SIM_PROGRESS", raising=False)
    with P.tracker("work", 3) as cb:
        for i in range(3):
            cb(f"piece {i}", i, 3)
    assert capsys.readouterr() == ("", "")


def test_quiet_wins_over_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert P.enabled()
    P.set_quiet(True)
    try:
        assert not P.enabled()
    finally:
        P.set_quiet(False)
    monkeypatch.setenv("MOONEP_SIM_QUIET", "1")
    assert not P.enabled()


def test_nested_trackers_share_one_live_display(monkeypatch):
    """An inner tracker (a sweep point's step) adds its bar to the live one and removes it after:
    rich refuses two live displays, so a second Progress would raise."""
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    with P.tracker("outer", 2, show=True) as outer:
        live = P._live[0]
        outer("point 1", 0, 2)
        with P.tracker("inner", 4) as inner:  # decided by the outer one being live
            assert len(live.tasks) == 2 and P._live == [live]
            inner("layer 1", 1, 4)
            assert live.tasks[1].completed == 1 and live.tasks[1].total == 4
        assert len(live.tasks) == 1
        outer("point 2", 1, 2)
        assert live.tasks[0].completed == 1
    assert P._live == []


def test_an_api_call_resolves_its_progress_argument():
    calls = []
    with P.resolve(lambda *a: calls.append(a), "x") as cb:
        cb("m", 1, 2)
    with P.resolve(False, "x") as cb:
        cb("m", 1, 2)
    assert calls == [("m", 1, 2)]


def _run_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """``argv`` with stdout and stderr on a pseudo-terminal: its exit status and everything it wrote."""
    master, slave = os.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS="120")
    env.pop("MOONEP_SIM_QUIET", None)
    env.pop("MOONEP_SIM_PROGRESS", None)
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            b = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    return p.wait(timeout=600), b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_a_long_step_shows_progress_on_a_terminal_and_nothing_extra_when_piped():
    rc, tty = _run_on_a_terminal(STEP)
    assert rc == 0, tty
    assert "layer routing" in tty and " of 16" in tty, tty[-2000:]  # the bar: layers done of OLMoE's 16
    assert "step time" in tty                                         # and the table after it
    piped = subprocess.run(STEP, capture_output=True, text=True, timeout=600,
                           env={k: v for k, v in os.environ.items() if k not in ("MOONEP_SIM_PROGRESS",)})
    assert piped.returncode == 0 and piped.stderr == ""  # no progress, no control codes
    assert "layer routing" not in piped.stdout and "\x1b[" not in piped.stdout
    quiet = subprocess.run(STEP + ["--quiet"], capture_output=True, text=True, timeout=600)
    assert quiet.stdout == piped.stdout and quiet.stderr == ""  # piped is exactly --quiet
    rc, tty_quiet = _run_on_a_terminal(STEP + ["--quiet"])
    assert rc == 0 and "layer routing" not in tty_quiet


def test_work_in_another_process_is_followed_through_a_file(tmp_path, monkeypatch):
    """launch/train_hf.py: rank 0 reports to the file the launcher names, the launcher's bar reads it."""
    import threading

    monkeypatch.delenv(P.FILE_ENV, raising=False)
    assert P.to_file() is P._noop  # nothing named: nothing written
    seen, got = [], threading.Event()

    def cb(msg, done, total):
        seen.append((msg, done, total))
        if done == total:
            got.set()
    # the clock stands still between the reports: the second falls within min_interval_s however
    # long a loaded machine takes between the calls (the throttle is what is tested, not the machine)
    monkeypatch.setattr(P, "time", types.SimpleNamespace(monotonic=lambda: 1000.0))
    with P.followed(tmp_path / "progress", cb, poll_s=0.01):
        report = P.to_file()          # what a child started in the block finds in its environment
        report("training step 1 of 2", 0, 2)
        report("training step 2 of 2", 1, 2)  # within min_interval_s: skipped
        assert (tmp_path / "progress").read_text() == "0\t2\ttraining step 1 of 2"
        report("done", 2, 2)                  # the last piece is always written
        assert got.wait(10)
    assert seen[-1] == ("done", 2, 2) and ("training step 2 of 2", 1, 2) not in seen
    assert P.FILE_ENV not in os.environ


def test_an_in_process_quiet_command_leaves_no_trace(monkeypatch, capsys):
    from moonep_sim.cli import main

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("MOONEP_SIM_QUIET", raising=False)
    assert main(["simulate", "--gen", "model=olmoe-1b-7b,tokens-per-rank=16,maxvio=3", "--ranks", "2", "--strategy",
                 "alltoall", "--quiet"]) == 0
    assert P.enabled()
