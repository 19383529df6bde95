"""The samplers' speed paths leave every draw as it was: the position-major weights, the skipped
"mostly chosen" test, and the inclusion-probability solver against an independent solve."""

from __future__ import annotations

import math

import numpy as np
import pytest

import sampling_reference
from moonep_sim.routing import sampling
from moonep_sim.routing.generators import generate, inclusion_probs
from moonep_sim.routing.sampling import sample_topk_grouped, sample_topk_pl


@pytest.mark.parametrize("K,N", [(1, 7), (3, 1000), (16, 5000)])
@pytest.mark.parametrize("block", [64, 1 << 15])
def test_position_major_weights_equal_the_token_major_ones(K, N, block):
    tau_KN = np.cumsum(np.random.default_rng(K).standard_exponential((K, N)), axis=0)
    w = sampling_reference._weights_KN(tau_KN, block)
    assert w.flags["C_CONTIGUOUS"] and w.dtype == np.float32 and w.shape == (N, K)
    assert np.array_equal(w, sampling._weights(tau_KN.T))


def _always_test(self):
    self.hard_R = (1.0 - sampling._REJECT_MASS) * self.span_R
    self.easy_k = 0


@pytest.mark.parametrize("case", ["lognormal", "one-dominant", "grouped", "heavy"])
def test_skipping_the_mostly_chosen_test_changes_no_draw(case, monkeypatch):
    rng = np.random.default_rng(9)
    logp = {"lognormal": 0.7 * rng.standard_normal(96), "one-dominant": np.log([0.9, 0.04, 0.03, 0.02, 0.01]),
            "grouped": 1.0 * rng.standard_normal(64), "heavy": 2.5 * rng.standard_normal(32)}[case]
    K = {"lognormal": 8, "one-dominant": 3, "grouped": 6, "heavy": 12}[case]

    def draw():
        if case == "grouped":
            return sample_topk_grouped(logp, K, 20000, np.random.default_rng(4), groups=8, topk_groups=3)
        return sample_topk_pl(logp, K, 20000, np.random.default_rng(4))

    ids, w = draw()
    monkeypatch.setattr(sampling._Races, "_set_hard_bound", _always_test)
    ids0, w0 = draw()
    assert np.array_equal(ids, ids0) and np.array_equal(w, w0)


def test_the_mostly_chosen_test_is_skipped_only_where_no_row_can_pass_it():
    p = np.exp(0.4 * np.random.default_rng(1).standard_normal(896))
    p /= p.sum()
    r = sampling._Races(p, sampling.InverseCDF(p), np.zeros(4, np.intp), 896, 16, np.random.default_rng(0),
                        np.random.default_rng(1))
    top = np.cumsum(np.sort(p)[::-1])
    assert r.easy_k > 16                          # a Kimi-K3-like layer never needs the test
    assert top[r.easy_k - 2] < 0.5 <= top[r.easy_k - 1] + 1e-9
    q = np.array([0.9, 0.04, 0.03, 0.02, 0.01])
    r = sampling._Races(q, sampling.InverseCDF(q), np.zeros(4, np.intp), 5, 3, np.random.default_rng(0),
                        np.random.default_rng(1))
    assert r.easy_k == 1                          # one pick may already hold 0.9 of the mass


def _tau_by_bisection(p, K):
    lo, hi = 0.0, 1.0
    while (-np.expm1(-p * hi)).sum() < K:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if (-np.expm1(-p * mid)).sum() < K else (lo, mid)
    return 0.5 * (lo + hi)


@pytest.mark.parametrize("E,K,sigma", [(8, 1, 0.5), (64, 8, 2.0), (256, 8, 0.2), (896, 16, 0.4), (896, 16, 8.0),
                                       (32, 31, 1.0), (5, 4, 0.0)])
def test_inclusion_probabilities_solve_their_equation(E, K, sigma):
    logp = sigma * np.random.default_rng(E + K).standard_normal(E)
    pi = inclusion_probs(logp, K)
    assert ((pi >= 0) & (pi <= 1)).all()
    assert abs(pi.sum() - K) <= 1e-9 * K
    p = np.exp(logp - logp.max())
    np.testing.assert_allclose(pi, -np.expm1(-p * _tau_by_bisection(p, K)), rtol=1e-10, atol=1e-13)


def test_every_expert_included_when_k_equals_e():
    pi = inclusion_probs(np.random.default_rng(0).standard_normal(12), 12)
    np.testing.assert_allclose(pi, 1.0, atol=1e-12)


def test_calibrated_counts_are_the_reported_ones():
    g = generate(64, 8, 20000, seed=3, maxvio=0.8)
    c = np.bincount(g.topk_ids_LTK[0].ravel(), minlength=64)
    assert g.report["blocks"][0]["maxvio"] == pytest.approx(c.max() / c.mean() - 1, rel=1e-12)
    assert math.isfinite(g.report["blocks"][0]["sigma"])


@pytest.mark.parametrize("kw", [{}, {"groups": 4, "topk_groups": 2}, {"with_logits": True},
                                {"groups": 4, "topk_groups": 2, "with_logits": True}])
def test_the_race_reusing_its_noise_draws_what_a_fresh_race_draws(kw):
    z = np.random.default_rng(2).standard_normal(16)
    noise: dict = {}
    for sigma in (0.3, 1.2, 0.3):
        fresh = sampling.sample_topk_race(sigma * z, 3, 500, np.random.default_rng(8), **kw)
        kept = sampling.sample_topk_race(sigma * z, 3, 500, np.random.default_rng(8), noise=noise, **kw)
        for a, b in zip(fresh, kept):
            assert (a is None and b is None) or np.array_equal(a, b)
    assert set(noise) >= {"x"}


def test_the_race_keeps_no_noise_over_several_chunks():
    T = sampling.CHUNK_ELEMS // 16 + 1                # two chunks of the race
    noise: dict = {}
    a = sampling.sample_topk_race(np.zeros(16), 2, T, np.random.default_rng(1), noise=noise)
    assert noise == {} and np.array_equal(a[0], sampling.sample_topk_race(np.zeros(16), 2, T,
                                                                          np.random.default_rng(1))[0])


@pytest.mark.parametrize("n", [2, 3, 32])
def test_group_scores_equal_a_partitions(n):
    g = np.random.default_rng(n).standard_normal((50, 8, n)).astype(np.float32)
    g[::3, :, 0] = g[::3, :, 1]                   # ties at the top
    g[1::3, :, -1] = g[1::3, :, 0]
    ref = np.partition(g, n - 2, axis=2)[:, :, -2:].sum(axis=2)
    assert np.array_equal(sampling._top2_sum(g), ref)


def test_counting_redraws_find_the_whole_draws_experts_and_weights():
    z = np.random.default_rng(5).standard_normal(40)
    noise: dict = {}
    sample_topk_pl(0.5 * z, 6, 3000, np.random.default_rng(11), noise=noise)
    for sigma in (0.2, 0.9, 2.5):                   # the last one sends rows to the remainder draw
        ids, w = sample_topk_pl(sigma * z, 6, 3000, np.random.default_rng(11))
        again, counts = sampling.pl_ids_again(sigma * z, 6, 3000, noise)
        assert np.array_equal(again.T, ids) and np.array_equal(counts, np.bincount(ids.ravel(), minlength=40))
        assert np.array_equal(sampling.pl_weights(sigma * z, again, noise), w)


def test_a_refined_calibration_returns_a_whole_draw(monkeypatch):
    # plain fast path (T x E above one race chunk) with a target the first guess misses by > 2%
    from moonep_sim.routing import generators

    T = sampling.CHUNK_ELEMS // 32 + 1
    replayed = []
    monkeypatch.setattr(generators, "pl_weights", lambda *a: replayed.append(1) or sampling.pl_weights(*a))
    g = generate(32, 4, T, seed=23, maxvio=1.0)
    assert g.report["blocks"][0]["calibration_samples"] > 1 and replayed == [1]   # the best was a counted draw
    ids, w = g.topk_ids_LTK[0], g.topk_weights_LTK[0]
    sigma = g.report["blocks"][0]["sigma"]
    from moonep_sim.routing.generators import _rng

    z = _rng(23, 0).standard_normal(32)
    ref_ids, ref_w = sample_topk_pl(sigma * z, 4, T, _rng(23, 1, 0, 0))
    assert ids.dtype == np.int64 and ids.flags["C_CONTIGUOUS"]
    assert np.array_equal(ids, ref_ids) and np.array_equal(w, ref_w)


@pytest.mark.parametrize("n,E,K", [(1, 2, 1), (300, 256, 8), (50, 896, 16), (40, 12, 12), (64, 9, 8)])
@pytest.mark.parametrize("ties", [False, True])
def test_the_k_smallest_equal_the_partitions_row_for_row(n, E, K, ties):
    rng = np.random.default_rng(n + E + K)
    key = rng.standard_exponential((n, E)).astype(np.float32)
    if ties:                                      # coarse values: most rows tie somewhere near the top
        key = np.round(key * 8) / 8
    key[::4, : E // 2] = np.inf                   # masked groups
    ids, kv = sampling.smallest_k(key, K)
    ref_ids, ref_kv = sampling._smallest_k_by_partition(key, K)
    assert ids.dtype == np.int64 and np.array_equal(ids, ref_ids) and np.array_equal(kv, ref_kv)
