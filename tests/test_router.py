"""Router replay: top-k (softmax/sigmoid), bias, quantile balancing, group-limited."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.routing.generators import generate_trace
from moonep_sim.routing.router import (aux_free_bias, quantile_offsets, replay_layer, route_group,
                                       route_quantile, route_topk, synthetic_logits)
from moonep_sim.routing.trace import Trace


def test_topk_matches_slow_reference():
    x = synthetic_logits(50, 12, seed=0)
    for score in ("softmax", "sigmoid"):
        r = route_topk(x, 3, score=score)
        for t in range(50):                                   # obviously-correct per-token reference
            s = np.exp(x[t] - x[t].max()) / np.exp(x[t] - x[t].max()).sum() if score == "softmax" \
                else 1 / (1 + np.exp(-x[t].astype(np.float64)))
            ref = sorted(range(12), key=lambda e: -s[e])[:3]
            assert r.topk_ids_TK[t].tolist() == ref
            np.testing.assert_allclose(r.topk_weights_TK[t], s[ref] / s[ref].sum(), rtol=1e-5)


def test_bias_affects_selection_only():
    x = synthetic_logits(200, 8, seed=1)
    bias = np.zeros(8, np.float32)
    bias[5] = 10.0                                            # forces expert 5 into every token
    r = route_topk(x, 2, score="sigmoid", bias_E=bias)
    assert (r.topk_ids_TK == 5).any(axis=1).all()
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    w = np.take_along_axis(s, r.topk_ids_TK, axis=1)
    np.testing.assert_allclose(r.topk_weights_TK, w / w.sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("T,E,K,skew", [(4096, 64, 8, 1.0), (2048, 8, 2, 2.0), (1000, 64, 6, 3.0), (333, 8, 2, 1.0)])
def test_quantile_balancing_on_calibration_batch(T, E, K, skew):
    x = synthetic_logits(T, E, seed=2, skew=skew)
    before = route_topk(x, K).counts_E()
    beta, info = quantile_offsets(x, K)
    c = route_quantile(x, K, beta).counts_E()
    assert before.max() / before.mean() > 1.5                 # the raw router is imbalanced
    assert c.max() / c.mean() <= 1.05
    assert info["max_over_mean"] == pytest.approx(c.max() / c.mean())


def test_aux_free_bias_reduces_imbalance():
    x = synthetic_logits(2000, 16, seed=3, skew=0.5)
    b = aux_free_bias(x, 2, score="sigmoid", rounds=200, update=2e-3)
    c0 = route_topk(x, 2, score="sigmoid").counts_E()
    c1 = route_topk(x, 2, score="sigmoid", bias_E=b).counts_E()
    assert c1.max() / c1.mean() < 0.8 * (c0.max() / c0.mean())


def test_group_limited_route():
    x = synthetic_logits(300, 32, seed=4)
    r = route_group(x, 4, groups=8, topk_groups=2)
    g = r.topk_ids_TK // 4
    assert all(len(set(row)) <= 2 for row in g.tolist())
    with pytest.raises(ConfigError, match=r"top_k \(9\) must be <= topk_groups \* E/groups \(8\)"):
        route_group(x, 9, groups=8, topk_groups=2)


def test_replay_cli_on_generated_logits(tmp_path, capsys):
    src, out = tmp_path / "g.safetensors", tmp_path / "q.safetensors"
    generate_trace(src, 32, 4, 1024, seed=0, sigma=1.0, steps=2, with_logits=True)
    assert main(["trace", "route", str(src), "-o", str(out), "--mode", "quantile", "--calib-tokens", "1024",
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["per_layer"][0]["calib_max_over_mean"] <= 1.05
    tr = Trace(out)
    c = np.bincount(tr.layer(0).topk_ids_TK[:1024].ravel(), minlength=32)
    assert c.max() / c.mean() <= 1.05
    np.testing.assert_array_equal(tr.steps(), Trace(src).steps())
    # plain top-k on the generator's logits reproduces the generator's choice of experts
    assert main(["trace", "route", str(src), "-o", str(tmp_path / "t.safetensors"), "--mode", "topk"]) == 0
    np.testing.assert_array_equal(Trace(tmp_path / "t.safetensors").layer(0).topk_ids_TK,
                                  Trace(src).layer(0).topk_ids_TK)


def test_replay_synthetic_and_missing_logits(tmp_path, capsys):
    out = tmp_path / "s.safetensors"
    assert main(["trace", "route", "--synthetic", "500", "--num-experts", "16", "--top-k", "2", "--mode", "bias",
                 "--score", "sigmoid", "-o", str(out)]) == 0
    assert Trace(out).meta.num_tokens == 500
    src = tmp_path / "n.safetensors"
    generate_trace(src, 8, 2, 100, seed=0, uniform=True)
    capsys.readouterr()
    assert main(["trace", "route", str(src), "-o", str(tmp_path / "x.safetensors")]) == 2
    assert "router_logits: expected for router replay, missing" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_replay_layer_reports_both_batches():
    x = synthetic_logits(800, 16, seed=5, skew=1.5)
    r, info = replay_layer(x, 2, "quantile", calib_tokens=400)
    assert info["calib_max_over_mean"] <= 1.05
    assert info["max_over_mean"] >= 1.0 and r.num_tokens == 800
