"""A testbed killed outright (SIGKILL) leaves no process running, and ``testbed cleanup`` removes
its namespaces and temporary folders: nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moonep_sim.testbed.netns import namespace_pids
from test_testbed import needs_netns

REPO = Path(__file__).resolve().parents[1]

DRIVER = """
from moonep_sim.testbed.netns import TestbedSpec
from moonep_sim.testbed.run import LaunchSpec, run_testbed
run_testbed(TestbedSpec(nodes=2, rate_bps=10**9), LaunchSpec(2, module="msim_block_forever", timeout_s=600),
            probe_tcp=False)
"""


def _workers(tag: int) -> list[int]:
    """Processes running the blocking job (torchrun's workers on every node) inside testbed ``tag``'s
    namespaces: another testbed on the machine (a concurrent run of this test) is never counted."""
    mine = {p for i in range(2) for p in namespace_pids(f"msim{tag}n{i}")}
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) in mine:
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"msim_block_forever" in cmd and b"torch.distributed.run" not in cmd:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # polling an external state change (processes, namespaces), not a guess
    return True


@pytest.mark.root
@pytest.mark.slow
@needs_netns
def test_sigkilled_testbed_leaves_nothing_after_cleanup(tmp_path):
    (tmp_path / "msim_block_forever.py").write_text("import threading\nthreading.Event().wait()\n")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}", OMP_NUM_THREADS="1")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    tag = driver.pid
    try:
        assert _until(lambda: len(_workers(tag)) >= 4 or driver.poll() is not None, 120), \
            "the testbed job never started"
        jobs = sorted(_workers(tag))
        assert len(jobs) == 4 and driver.poll() is None
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"msim{tag}n0" in ns and f"msim{tag}n1" in ns
    finally:
        driver.send_signal(signal.SIGKILL)  # no teardown can run
        driver.wait()
    # the jobs die with the testbed process, before any cleanup
    assert _until(lambda: not any(_alive(p) for p in jobs), 30), [p for p in jobs if _alive(p)]
    pids = subprocess.run(["ip", "netns", "pids", f"msim{tag}n0"], capture_output=True, text=True).stdout.split()
    assert [p for p in pids if _alive(int(p))] == []
    folders = [p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(f"msim{tag}-")]
    assert folders  # the killed run's log folder is still there ...
    r = subprocess.run([sys.executable, "-m", "moonep_sim", "testbed", "cleanup"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # ... and cleanup removes it with the namespaces and their links
    assert not [p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(f"msim{tag}-")]
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"msim{tag}" not in ns and f"msim{tag}" not in links
