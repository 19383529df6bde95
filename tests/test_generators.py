"""Synthetic generators: maxvio targets, determinism, Zipf/hot/drift/variation/groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.routing.generators import generate, generate_layer, inclusion_probs, sample_topk
from moonep_sim.routing.metrics import maxvio
from moonep_sim.routing.trace import Trace


@pytest.mark.parametrize("E,K,T,target", [(64, 8, 4096, 0.2), (64, 8, 4096, 1.0), (256, 8, 8192, 10.0),
                                          (256, 8, 8192, 20.0), (8, 2, 333, 0.5), (896, 16, 8192, 1.0)])
def test_maxvio_target_hit_within_5_percent(E, K, T, target):
    lr = generate_layer(E, K, T, seed=11, maxvio=target)
    c = lr.counts_E()
    assert abs(maxvio(c) / target - 1) <= 0.05
    s = np.sort(lr.topk_ids_TK, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all()                     # K distinct experts per token
    np.testing.assert_allclose(lr.topk_weights_TK.sum(axis=1), 1.0, rtol=1e-5)


def test_unreachable_targets_say_why():
    with pytest.raises(ConfigError, match=r"maxvio \(8\.0\) must be <= E/K - 1 \(7"):
        generate_layer(64, 8, 1000, seed=0, maxvio=8.0)
    with pytest.raises(ConfigError, match=r"maxvio \(0\.01\) must be >= the sampling-noise floor"):
        generate_layer(64, 8, 200, seed=0, maxvio=0.01)


def test_same_seed_identical_bytes_different_seed_differs(tmp_path):
    args = ["trace", "gen", "--num-experts", "32", "--top-k", "4", "--tokens", "500", "--layers", "2",
            "--maxvio", "1", "-o"]
    assert main(args + [str(tmp_path / "a.safetensors"), "--seed", "5"]) == 0
    assert main(args + [str(tmp_path / "b.safetensors"), "--seed", "5"]) == 0
    assert main(args + [str(tmp_path / "c.safetensors"), "--seed", "6"]) == 0
    a, b, c = ((tmp_path / f"{x}.safetensors").read_bytes() for x in "abc")
    assert a == b
    assert a != c
    tr = Trace(tmp_path / "a.safetensors")
    for i in range(2):
        assert abs(maxvio(tr.counts(i)) - 1.0) <= 0.05


def test_group_limited_respects_groups():
    E, K, G, M = 64, 8, 8, 3
    g = generate(E, K, 2000, seed=1, sigma=1.0, groups=G, topk_groups=M, with_logits=True)
    grp = g.topk_ids_LTK[0] // (E // G)
    s = np.sort(grp, axis=1)
    n_groups = 1 + (s[:, 1:] != s[:, :-1]).sum(axis=1)
    assert n_groups.max() <= M
    assert n_groups.max() == M                                  # the limit binds
    # the chosen groups are the top-M by sum of the two best scores
    lg = g.router_logits_LTE[0].reshape(2000, G, E // G)
    gs = np.sort(lg, axis=2)[:, :, -2:].sum(axis=2)
    top = np.argsort(-gs, axis=1)[:, :M]
    assert all(set(grp[t]) <= set(top[t]) for t in range(0, 2000, 97))


def test_drift_changes_popularity_and_zero_drift_does_not():
    kw = dict(sigma=1.0, steps=4)
    still = generate(64, 4, 4000, seed=2, drift=0.0, **kw)
    moving = generate(64, 4, 4000, seed=2, drift=0.8, **kw)

    def step_counts(g):
        ids = g.topk_ids_LTK[0]
        return [np.bincount(ids[g.step_T == s].ravel(), minlength=64) for s in range(4)]

    cs, cm = step_counts(still), step_counts(moving)
    corr = lambda a, b: np.corrcoef(a, b)[0, 1]
    assert corr(cs[0], cs[3]) > 0.9
    assert corr(cm[0], cm[3]) < corr(cs[0], cs[3]) - 0.3


def test_layer_variation():
    same = generate(64, 4, 3000, seed=3, sigma=1.0, layers=2)
    varied = generate(64, 4, 3000, seed=3, sigma=1.0, layers=2, layer_variation=1.0)
    c = lambda g, l: np.bincount(g.topk_ids_LTK[l].ravel(), minlength=64)
    assert np.corrcoef(c(same, 0), c(same, 1))[0, 1] > 0.9
    assert np.corrcoef(c(varied, 0), c(varied, 1))[0, 1] < 0.6


def test_zipf_and_hot_share():
    z = generate_layer(128, 8, 5000, seed=4, zipf=1.2).counts_E()
    zu = generate_layer(128, 8, 5000, seed=4, zipf=0.3).counts_E()
    assert maxvio(z) > maxvio(zu)
    g = generate(64, 8, 8000, seed=4, hot=4, hot_share=0.3)
    hot = g.report["hot_experts_layer0"]
    c = np.bincount(g.topk_ids_LTK[0].ravel(), minlength=64)
    assert c[hot].sum() / c.sum() == pytest.approx(0.3, abs=0.02)
    with pytest.raises(ConfigError, match=r"hot_share \(0\.9\) must be in"):
        generate(64, 8, 100, seed=0, hot=4, hot_share=0.9)          # 4 of K=8 can take at most 1/2


def test_sampler_matches_inclusion_probabilities():
    """Slow reference: the race's per-expert frequencies match the sequential-draw inclusion
    probabilities computed by brute-force simulation of draws without replacement."""
    rng = np.random.default_rng(0)
    logp = rng.normal(0, 1.0, 12)
    ids, _, _ = sample_topk(logp, 3, 20000, np.random.default_rng(1))
    freq = np.bincount(ids.ravel(), minlength=12) / 20000
    p = np.exp(logp) / np.exp(logp).sum()
    ref = np.zeros(12)
    r2 = np.random.default_rng(2)
    for _ in range(4000):                                          # sequential draws, slow reference
        chosen = r2.choice(12, 3, replace=False, p=p)
        ref[chosen] += 1
    ref /= 4000
    np.testing.assert_allclose(freq, ref, atol=0.03)
    np.testing.assert_allclose(inclusion_probs(logp, 3), ref, atol=0.05)


@settings(max_examples=25, deadline=None)
@given(E=st.integers(2, 48), K=st.integers(1, 6), T=st.integers(1, 300), seed=st.integers(0, 10**6),
       sigma=st.floats(0, 3))
def test_generated_routing_is_always_valid(E, K, T, seed, sigma):
    K = min(K, E)
    g = generate(E, K, T, seed, sigma=sigma)
    ids = g.topk_ids_LTK[0]
    assert ids.shape == (T, K) and ids.min() >= 0 and ids.max() < E
    s = np.sort(ids, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all()
    assert np.isfinite(g.topk_weights_LTK).all()
    np.testing.assert_allclose(g.topk_weights_LTK.sum(axis=2), 1.0, rtol=1e-5)
    g2 = generate(E, K, T, seed, sigma=sigma)
    np.testing.assert_array_equal(g.topk_ids_LTK, g2.topk_ids_LTK)


def test_model_preset_uses_its_groups(tmp_path, capsys):
    out = tmp_path / "d.safetensors"
    assert main(["trace", "gen", "--model", "deepseek-v3", "--tokens", "2x256", "--seed", "0", "--sigma", "0.5",
                 "-o", str(out), "--json"]) == 0
    tr = Trace(out)
    assert tr.meta.num_tokens == 512 and tr.meta.top_k == 8
    grp = tr.layer(0).topk_ids_TK // 32
    s = np.sort(grp, axis=1)
    assert (1 + (s[:, 1:] != s[:, :-1]).sum(axis=1)).max() <= 4
