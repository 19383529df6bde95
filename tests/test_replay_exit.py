"""The replay launcher's contract: bad input exits 2 with the failing rank's one line, Ctrl-C exits
130 with one line and no rank left running, and the rendezvous store listens on loopback only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moonep_sim.gloo.launcher import _rank_env, loopback_store
from moonep_sim.routing.generators import generate_trace

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay_exit") / "t.safetensors"
    generate_trace(path, 8, 2, 64, 4, layers=2, maxvio=1.0)
    return path


def _replay(*args, **kw):
    return subprocess.run([sys.executable, str(REPO / "launch" / "replay.py"), *map(str, args)],
                          capture_output=True, text=True, env=ENV, timeout=300, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing_trace", "bad_layers", "layer_range", "bad_strategy", "json_dir"])
def test_bad_input_exits_2_with_the_ranks_one_line(trace, tmp_path, case):
    args = {"missing_trace": ["--trace", tmp_path / "nope.safetensors"],
            "bad_layers": ["--trace", trace, "--layers", "a"],
            "layer_range": ["--trace", trace, "--layers", "0,7"],
            "bad_strategy": ["--trace", trace, "--strategy", "nope"],
            "json_dir": ["--trace", trace, "--json", tmp_path]}[case]
    want = {"missing_trace": "nope.safetensors", "bad_layers": "--layers ('a')", "layer_range": "layer (7) must be one of the trace's layers",
            "bad_strategy": "strategy ('nope')", "json_dir": "--json ("}[case]
    p = _replay("--nproc", 2, *args, "--iters", 1, "--warmup", 0, "--hidden", 8, "--ffn", 8)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("moonep-sim: error: ") and want in lines[0], p.stderr
    assert "Traceback" not in p.stdout + p.stderr and "ChildFailedError" not in p.stdout + p.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_bad_argument_is_one_line_without_starting_ranks(tmp_path):
    p = _replay("--nproc", 2, "--trace", tmp_path / "t", "--iters", "x")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "moonep-sim: error: launch/replay.py: argument --iters: invalid int value: 'x'"]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line_and_no_rank_left(trace):
    p = subprocess.Popen([sys.executable, str(REPO / "launch" / "replay.py"), "--nproc", "2", "--trace", str(trace),
                          "--iters", "10000", "--warmup", "0", "--hidden", "8", "--ffn", "8", "--no-check"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while len(_children(p.pid)) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the ranks to exist, not a synchronisation guess
    ranks = _children(p.pid)
    assert len(ranks) == 2, "ranks never started"
    p.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.strip().splitlines() == ["moonep-sim: interrupted"], err
    for r in ranks:
        assert not Path(f"/proc/{r}").exists() or "zombie" in Path(f"/proc/{r}/status").read_text()


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


def test_rendezvous_store_listens_on_loopback_only():
    store, port = loopback_store(2, 10.0)
    try:
        assert _listening(port) == ["0100007F"]  # 127.0.0.1, and nothing on any other address
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
    env = _rank_env(1, 2, port)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        assert env["GLOO_SOCKET_IFNAME"] == "lo"


def test_interrupt_during_rank_start_is_delivered_after_every_rank_is_listed():
    """A Ctrl-C that lands while the ranks are being started waits until the list of started ranks
    is complete (so the cleanup kills every one), then arrives as usual."""
    from moonep_sim.gloo.launcher import _interrupts_deferred
    started = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupts_deferred():
            for r in range(3):
                started.append(r)
                if r == 0:
                    os.kill(os.getpid(), signal.SIGINT)
    assert started == [0, 1, 2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
