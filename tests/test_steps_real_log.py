"""Whole steps on the shipped vLLM route log (Qwen1.5-MoE-A2.7B, layer 0 recorded, 18 passes of
11-16 tokens): stand-ins drawn at the whole trace's pooled skew, never a pass's own; the per-step
aggregate for any selection; passes with fewer tokens than ranks; merged passes."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from moonep_sim.experiments import Scenario
from moonep_sim.experiments.step import StepOptions, run_step, steps_document
from moonep_sim.routing.metrics import maxvio

TRACE = Path(__file__).resolve().parents[1] / "traces" / "qwen1.5-moe-a2.7b_layer0.safetensors"


def _cut(sc, moe_layers=3):
    m = sc.resolved.source.model
    return dataclasses.replace(m, layers=m.dense_layers + moe_layers, moe_layers=moe_layers)


def _whole_trace_maxvio() -> tuple[float, int]:
    from moonep_sim.routing.steps import read_layer
    lr = read_layer(str(TRACE), 0)
    return maxvio(np.bincount(lr.topk_ids_TK.ravel(), minlength=60)), lr.topk_ids_TK.shape[0]


def test_every_pass_runs_with_stand_ins_at_the_whole_trace_s_pooled_skew():
    """Each pass's own maxvio (1.5-5.8 over 11-16 tokens) was the stand-ins' target and failed as
    unreachable; now every pass runs and every stand-in is drawn at the pooled skew."""
    sc = Scenario(routing=str(TRACE), cluster=4, strategies="alltoall,moonep")
    res = run_step(sc, StepOptions("train"), model=_cut(sc))
    mv, n = _whole_trace_maxvio()
    assert len(res) == 18 and n == 246
    for r in res:
        assert r.setup["standin_skew"] == {"maxvio": pytest.approx(mv), "tokens": 246, "layers": 1}
        assert r.setup["stand_ins"] == 2
        assert all(f"pooled maxvio {mv:.3g}" in p for p in r.setup["layers_routing"][1:])
    assert sorted(r.setup["step_tokens"] for r in res)[0] == 11 and sum(r.setup["step_tokens"] for r in res) == 246
    # the same stand-in popularity for every pass, drawn at each pass's own tokens (the same seed)
    from moonep_sim.experiments.step import layer_source

    src = sc.resolved.source
    a = layer_source(src, 4, 3, 3, pass_tokens=12, skew=res[0].setup["standin_skew"])(1)[1]
    b = layer_source(src, 4, 3, 3, pass_tokens=12, skew=res[0].setup["standin_skew"])(1)[1]
    assert a.num_tokens == 12 and np.array_equal(a.topk_ids_TK, b.topk_ids_TK)


def test_the_per_step_aggregate_is_printed_for_any_selection():
    sc = Scenario(routing=str(TRACE), cluster=4, strategies="alltoall,moonep", steps="0,3,17")
    res = run_step(sc, StepOptions("train"), model=_cut(sc, 2))
    doc = steps_document(res)
    agg = doc["aggregate"]
    tok = [r.setup["step_tokens"] for r in res]
    assert agg["step_ids"] == [0, 3, 17] and agg["tokens"] == tok
    for s in ("alltoall", "moonep"):
        t = [r.figures[s]["step_time_us"] for r in res]
        a = agg["strategies"][s]["step_time_us"]
        assert a["token_weighted_mean"] == pytest.approx(np.average(t, weights=tok))
        assert a["median"] == pytest.approx(np.median(t)) and a["worst"] == max(t)
        assert a["worst_step"] == [0, 3, 17][int(np.argmax(t))]
    assert sum(agg["wins"].values()) == 3
    one = steps_document(run_step(Scenario(routing=str(TRACE), cluster=4, strategies="alltoall", steps="5"),
                                  StepOptions("train"),
                                  model=_cut(sc, 1)))
    assert one["aggregate"]["steps"] == 1 and one["aggregate"]["step_ids"] == [5]  # one step: still there


def test_a_pass_with_fewer_tokens_than_ranks_runs_with_zero_token_ranks():
    sc = Scenario(routing=str(TRACE), cluster=12, strategies="alltoall,deepep,moonep", steps="17")
    (r,) = run_step(sc, StepOptions("train"), model=_cut(sc, 1))
    assert r.setup["step_tokens"] == 11 and r.setup["zero_token_ranks"] == 1 and r.setup["tokens_per_rank"] == 1
    assert all(math.isfinite(r.figures[s]["step_time_us"]) for s in r.strategies)


def test_a_ranks_sweep_may_go_past_the_smallest_pass():
    """12 and 20 ranks on passes of 11-16 tokens: accepted (zero-token ranks), where it was refused
    ("must be <= the smallest step's tokens (11)")."""
    from moonep_sim.experiments.trace_sweep import valid_values

    vals, _ = valid_values(Scenario(routing=str(TRACE), cluster=4, strategies="alltoall"), "ranks", [4.0, 12.0, 20.0])
    assert vals == [4.0, 12.0, 20.0]


def test_merged_passes_keep_a_pass_s_sequence_length():
    sc = Scenario(routing=str(TRACE), cluster=4, strategies="alltoall", steps="merged")
    assert any("steps merged" in w for w in sc.resolved.warnings)
    (r,) = run_step(sc, StepOptions("train"), model=_cut(sc, 1))
    # 246 tokens as one batch: 61 per rank, in sequences of the longest pass's 16 / 4 ranks, not of 61
    assert (r.setup["tokens_per_rank"], r.setup["context"], r.setup["merged"]) == (61, 4, True)
    assert "aggregate" not in steps_document([r])


def test_the_stand_in_spread_meets_the_pooled_skew_in_expectation():
    from moonep_sim.routing import generators as G

    E, K, T, seed = 60, 4, 4096, 7
    s = G.sigma_for_maxvio(E, K, T, 1.5, seed)
    z = G._rng(seed, 0).standard_normal(E)
    noise = G._rng(seed, 2, 0, 0).standard_normal((16, E))
    assert G._expected_maxvio(s * z, K, T, noise) == pytest.approx(1.5, rel=1e-6)
    # under the sampling-noise floor of 246 tokens: uniform popularity, never an error
    assert G.sigma_for_maxvio(E, K, 246, 0.05, seed) == pytest.approx(G.SIGMA_MIN)
