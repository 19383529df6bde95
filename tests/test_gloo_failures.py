"""Failure behaviour of the gloo executor: a dead or stalled rank, and configuration that differs.

Ranks are plain processes (no torchrun agent to kill the survivors), so the survivors must fail
by themselves, within the executor's timeout, naming the phase and the silent rank.
"""

from __future__ import annotations

import re

import os
import threading
from pathlib import Path

import torch

from moonep_sim.gloo.launcher import spawn_ranks

HERE = str(Path(__file__).resolve().parent)
WORLD, VICTIM, TIMEOUT_S = 3, 2, 3.0


def fail_worker(rank, world, mode, victim, timeout_s):
    from moonep_sim.gloo.buffer import Buffer

    top_k = 3 if (mode == "config" and rank == victim) else 2
    buf = Buffer(capacity=4, hidden=4, top_k=top_k, num_experts=6, strategy="alltoall", timeout_s=timeout_s)
    x = torch.randn(4, 4)
    ids = torch.tensor([[0, 5], [1, 4], [2, 3], [3, 0]])
    w = torch.ones(4, 2)
    if rank == victim and mode == "exit":
        buf.exchange_routing(ids, w)  # takes part in the exchange, then dies before the first hop
        os._exit(7)
    if rank == victim and mode == "stall":
        threading.Event().wait()  # never returns: a rank that stopped responding
    buf.dispatch(x, ids, w)
    return {"finished": True}


def run(mode):
    survivors = [r for r in range(WORLD) if r != VICTIM]
    return spawn_ranks("test_gloo_failures:fail_worker", WORLD, dict(mode=mode, victim=VICTIM, timeout_s=TIMEOUT_S),
                       timeout_s=90, pythonpath=[HERE], kill_on_failure=False, wait_for=survivors)


def test_dead_rank_makes_the_others_fail_naming_phase_and_rank():
    res = run("exit")
    assert res[VICTIM].returncode == 7
    for r in res:
        if r.rank == VICTIM:
            continue
        assert r.returncode == 1, r.output
        # the survivors fail in the exchange or in the first hop, depending on how far they got
        # before the victim's sockets closed; either way the phase and the victim are named
        assert re.search(r"CommError: dispatch\.(exchange all_gather|0 (all_to_all|send/recv)) failed", r.output), r.output
        # the victim is named among the silent peers (a survivor that is merely behind may be too)
        assert f"on rank {r.rank}" in r.output, r.output
        assert re.search(rf"peer ranks? (\d+ \([^)]*\), )*{VICTIM} \(last entered dispatch\.exchange\)", r.output), r.output


def test_stalled_rank_times_out_the_others_naming_phase_and_rank():
    res = run("stall")
    assert res[VICTIM].returncode is None  # still blocked: killed by the spawner once the others exited
    for r in res:
        if r.rank == VICTIM:
            continue
        assert r.returncode == 1, r.output
        assert f"CommError: dispatch.exchange all_gather timed out after {TIMEOUT_S:.1f} s" in r.output, r.output
        assert re.search(rf"peer ranks? (\d+ \([^)]*\), )*{VICTIM} \(last entered build\.check\)", r.output), r.output


def test_config_differing_across_ranks_is_detected_at_build():
    res = spawn_ranks("test_gloo_failures:fail_worker", WORLD, dict(mode="config", victim=VICTIM, timeout_s=10),
                      timeout_s=60, pythonpath=[HERE], kill_on_failure=False)
    for r in res:
        assert r.returncode == 2, r.output
        assert "ConfigError: Buffer top_k must be equal on every rank (ranks [0, 1] agree with rank 0, " \
               f"ranks [{VICTIM}] differ; values by rank [2, 2, 3])" in r.output, r.output
