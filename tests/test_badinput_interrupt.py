"""Ctrl-C during start-up: exit status 130 and the one line ``moonep-sim: interrupted``, never a
``KeyboardInterrupt`` traceback -- while the commands are imported, and in the HF launcher while
torch is imported (before any rank exists)."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moonep_sim import cli

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize("module", ["moonep_sim.cli.simulate", "moonep_sim.cli.step", "moonep_sim.cli.testbed"])
def test_ctrl_c_while_the_commands_are_imported_is_one_line(module, monkeypatch, capsys):
    real = importlib.import_module

    def interrupted(name, *a, **k):
        if name == module:
            raise KeyboardInterrupt
        return real(name, *a, **k)
    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["simulate", "--gen", "maxvio=1", "--strategy", "alltoall", "--ranks", "2"]) == 130
    assert capsys.readouterr().err == "moonep-sim: interrupted\n"


def _mapped(pid: int, needle: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return needle in f.read()
    except OSError:
        return False


def _interrupt_once_loaded(argv: list[str], needle: str) -> subprocess.CompletedProcess:
    """Start ``argv``; once the child has mapped a library whose name holds ``needle`` (it is in the
    middle of its imports: start-up, not the interpreter's own), send SIGINT; wait for it."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                         stdin=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 120
    while not _mapped(p.pid, needle) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # polling the child's state, not waiting for time to pass
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_ctrl_c_while_the_command_imports_numpy_is_one_line():
    p = _interrupt_once_loaded([sys.executable, "-m", "moonep_sim", "simulate", "--gen", "maxvio=1",
                                "--strategy", "alltoall", "--ranks", "2"], "_multiarray_umath")
    assert (p.returncode, p.stderr) == (130, "moonep-sim: interrupted\n"), p.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_ctrl_c_while_the_hf_launcher_imports_torch_is_one_line():
    pytest.importorskip("transformers")
    p = _interrupt_once_loaded([sys.executable, str(REPO / "launch" / "train_hf.py"), "--model", "tiny-mixtral",
                                "--nproc", "2"], "libtorch")
    assert (p.returncode, p.stderr) == (130, "moonep-sim: interrupted\n"), p.stderr[-2000:]


def _sigint_disposition(_):
    return signal.getsignal(signal.SIGINT)


def test_worker_processes_leave_ctrl_c_to_the_parent():
    """--jobs workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group): the parent
    stops them and prints the one line; no worker prints a KeyboardInterrupt traceback."""
    from moonep_sim.experiments.parallel import run_points

    assert run_points(_sigint_disposition, [0, 1, 2], jobs=2) == [signal.SIG_IGN] * 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's own is untouched
