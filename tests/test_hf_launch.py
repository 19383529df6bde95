"""launch/train_hf.py end to end: local ranks, the check, the recorded trace, the step comparison
with the simulator, and one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "launch" / "train_hf.py")


def _run(args, timeout=600):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO), env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow  # 2 gloo ranks: check, record and compare-sim in one run
def test_check_record_and_compare_sim_in_one_run(tmp_path):
    from moonep_sim.routing.trace import Trace

    out, trace = tmp_path / "r.json", tmp_path / "r.safetensors"
    p = _run(["--model", "tiny-deepseek", "--nproc", "2", "--strategy", "alltoall,moonep", "--steps", "3",
              "--warmup", "1", "--check", "--check-steps", "2", "--generate", "2", "--record", str(trace),
              "--compare-sim", "--json", str(out)])
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    rep = json.loads(out.read_text())
    assert rep["check_ok"] and rep["dtype"] == "float32"
    for name in ("alltoall", "moonep"):
        c = rep["check"][name]
        assert c["ok"] and c["tokens_equal"] and c["grad_err"] <= c["tolerance"] == 1e-4
        assert len(rep["times_ms"][name]["step"]) == 3
    assert "check moonep: OK" in p.stdout and "measured vs simulated step time" in p.stdout
    # the trace: one step per timed forward, both ranks' rows in rank order
    tr = Trace(trace)
    assert tr.meta.num_experts == 8 and tr.meta.top_k == 2 and tr.meta.layer_ids == [0, 1]
    assert np.bincount(tr.steps()).tolist() == [2 * 2 * 16] * 3
    assert rep["record"]["tokens_per_rank"] == [32, 32]
    cs = rep["compare_sim"]
    assert cs["topology"]["name"] == "local-gloo"
    assert "moonep_sim.step" in cs["simulator"]["step"] and "simulate_layers" in cs["simulator"]["chain"]
    for name in ("alltoall", "moonep"):
        v = cs["strategies"][name]
        for kind in ("step", "chain"):
            k = v[kind]
            assert k["simulated_moe_ms"] > 0 and len(k["simulated_ms_samples"]) == 3
            # per step, the simulated step is the simulated MoE part plus the measured rest
            rest = [o + y + q for o, y, q in zip(*(rep["times_ms"][name][p] for p in ("other", "sync", "opt")))]
            assert all(s_ > r for s_, r in zip(k["simulated_ms_samples"], rest))
        assert v["simulated_ms"] == v["step"]["simulated_ms"]            # the headline is the step model's
        assert v["step_model_pure_ms"] > 0
    assert cs["ranking"]["pairs"] == 1 and cs["chain"]["ranking"]["pairs"] == 1


def test_bad_input_is_one_line_before_any_rank_starts(tmp_path):
    p = _run(["--model", "tiny-mixtral", "--nproc", "2", "--strategy", "nope"], timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "moonep-sim: error:" in p.stderr and "nope" in p.stderr
    p = _run(["--model", "tiny-mixtral", "--nproc", "2", "--steps", "0"], timeout=120)
    assert p.returncode == 2 and "--steps (0) must be >= 1" in p.stderr
    p = _run(["--model", "no-such.json", "--nproc", "2"], timeout=120)
    assert p.returncode == 2 and "model config (no-such.json) must exist" in p.stderr


def _cli(args, timeout=600):
    return subprocess.run([sys.executable, "-m", "moonep_sim", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


def test_validate_step_refuses_a_bad_model_in_one_line(tmp_path):
    p = _cli(["validate", "--level", "step", "--models", "nope", "--out", str(tmp_path / "v")], timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "model ('nope') must be one of" in p.stderr
    assert not (tmp_path / "v").exists()


@pytest.mark.slow  # 2 gloo ranks, 2 strategies, 2 steps
def test_validate_step_writes_points_for_every_strategy(tmp_path):
    out = tmp_path / "v"
    p = _cli(["validate", "--level", "step", "--models", "tiny-olmoe", "--strategies", "alltoall,moonep",
              "--iters", "2", "--nproc", "2", "--out", str(out)])
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    rep = json.loads((out / "fidelity-step.json").read_text())
    assert [(q["case"], q["strategy"]) for q in rep["points"]] == [("tiny-olmoe", "alltoall"), ("tiny-olmoe", "moonep")]
    for q in rep["points"]:
        assert q["measured_ms"] > 0 and q["simulated_ms"] > q["rest_ms"] and q["chain_ms"] > q["rest_ms"]
    assert rep["summary"]["step"]["pairs"] == 1 and rep["load_average"]["start"]
    assert (out / "routing-tiny-olmoe.safetensors").is_file()
    assert "median |error|" in p.stdout
