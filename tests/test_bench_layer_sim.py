"""benchmarks/bench_layer_sim.py: the layers it replays are the step's, every replay equals the
step's result, and its split adds up. No timing is asserted (timings are the bench's output)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    mod = importlib.import_module("bench_layer_sim")
    from moonep_sim.experiments import GeneratorSpec
    monkeypatch.setitem(mod.CASES, "tiny-train", dict(
        scenario=dict(routing=GeneratorSpec(model="olmoe-1b-7b", maxvio=2.0, tokens_per_rank=32, layers=16),
                      cluster="8/4", topology="h800-cx7"),
        step=dict(mode="train", overlap="shared-expert")))
    return mod


def test_replays_the_steps_layers_and_splits_the_cpu(bench):
    layers = bench.capture("tiny-train", "deepep", 0)
    assert len(layers) == 16 and all(r.backward is not None for _, _, r in layers)   # train: every MoE layer
    row = bench.replay(layers, 2)
    assert row["layers"] == 16
    assert row["total_cpu_s_per_layer"] == pytest.approx(row["tick_cpu_s_per_layer"] + row["nontick_cpu_s_per_layer"])
    assert row["tick_cpu_s_per_layer"] > 0


def test_same_names_the_field_that_differs(bench):
    layers = bench.capture("tiny-train", "alltoall", 0)
    ref = layers[0][2]
    bench.same(ref, ref)
    moved = dataclasses.replace(ref, sim_us=ref.sim_us + 1e-9)
    with pytest.raises(AssertionError, match=r"result\.sim_us"):
        bench.same(ref, moved)
    fwd = dataclasses.replace(ref.forward, pre_R=ref.forward.pre_R + np.eye(1, ref.forward.pre_R.size)[0])
    with pytest.raises(AssertionError, match=r"result\.forward\.pre_R: arrays differ"):
        bench.same(ref, dataclasses.replace(ref, forward=fwd))


def test_unknown_case_is_one_line_and_exit_2(bench, capsys):
    assert bench.main(["--cases", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--cases ('nope') must be among" in err
