"""The two samplers of top-K without replacement: the fast sequential Plackett-Luce path against the
exponential race (the reference) and against plain sequential draws (``rng.choice`` without
replacement), in distribution; the guide-table inverse CDF against ``np.searchsorted`` element-wise."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.routing.sampling import InverseCDF, sample_topk, sample_topk_grouped, sample_topk_pl, sample_topk_race
from moonep_sim.routing import sampling

# named popularities (log scale); the regimes: equal, mild and strong lognormal skew, one expert
# holding most of the mass (rows go to the exact remainder draw), many negligible experts
CASES = {
    "uniform": np.zeros(8),
    "lognormal-0.5": np.random.default_rng(3).normal(0, 0.5, 8),
    "lognormal-2": np.random.default_rng(4).normal(0, 2.0, 8),
    "one-dominant": np.log([0.9, 0.04, 0.03, 0.02, 0.01]),
    "negligible-tail": np.log([0.5, 0.3, 0.2] + [1e-9] * 5),
}


def _sequential_reference(logp, K, n, seed):
    """Slow, obviously correct: n tokens of K sequential draws without replacement."""
    p = np.exp(logp - logp.max())
    p /= p.sum()
    r = np.random.default_rng(seed)
    return np.array([r.choice(p.size, K, replace=False, p=p) for _ in range(n)])


def _position_freq(ids, E):
    """Frequency of each expert at each position, [K, E]."""
    return np.stack([np.bincount(ids[:, k], minlength=E) / ids.shape[0] for k in range(ids.shape[1])])


def test_case_table_covers_its_regimes():
    p = {k: np.exp(v - v.max()) / np.exp(v - v.max()).sum() for k, v in CASES.items()}
    assert np.ptp(p["uniform"]) == 0
    assert p["one-dominant"].max() > 0.5                  # > _REJECT_MASS after one draw: remainder path
    assert p["negligible-tail"].min() < 1e-8
    assert p["lognormal-2"].max() / p["lognormal-2"].min() > 20


@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_path_matches_sequential_draws_and_race(name):
    logp = CASES[name]
    E, K = logp.size, 3
    fast, w_fast = sample_topk_pl(logp, K, 40000, np.random.default_rng(1))
    race, w_race, _ = sample_topk_race(logp, K, 40000, np.random.default_rng(2))
    ref = _sequential_reference(logp, K, 4000, 5)
    s = np.sort(fast, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all() and fast.min() >= 0 and fast.max() < E
    # the ordered draw: each position's expert frequencies
    np.testing.assert_allclose(_position_freq(fast, E), _position_freq(race, E), atol=0.012)
    np.testing.assert_allclose(_position_freq(fast, E), _position_freq(ref, E), atol=0.03)
    # the weights: per position, the same mean and spread as the race's
    np.testing.assert_allclose(w_fast.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(w_fast.mean(axis=0), w_race.mean(axis=0), atol=0.006)
    np.testing.assert_allclose(np.quantile(w_fast[:, 0], [0.1, 0.5, 0.9]),
                               np.quantile(w_race[:, 0], [0.1, 0.5, 0.9]), atol=0.012)
    assert (np.diff(w_fast, axis=1) <= 1e-7).all()        # drawn order = descending score


def test_every_expert_chosen_when_k_equals_e():
    logp = CASES["lognormal-2"]
    ids, w = sample_topk_pl(logp, 8, 3000, np.random.default_rng(0))
    assert (np.sort(ids, axis=1) == np.arange(8)).all()
    ref = _sequential_reference(logp, 8, 3000, 1)
    np.testing.assert_allclose(_position_freq(ids, 8)[:2], _position_freq(ref, 8)[:2], atol=0.04)
    assert np.isfinite(w).all()


def test_one_expert_and_one_token():
    ids, w = sample_topk_pl(np.zeros(1), 1, 5, np.random.default_rng(0))
    assert (ids == 0).all() and (w == 1).all()
    ids, w = sample_topk_pl(CASES["uniform"], 4, 1, np.random.default_rng(0))
    assert ids.shape == (1, 4) and len(set(ids[0].tolist())) == 4


def test_same_seed_same_draws_and_nearby_popularities_are_coupled():
    """The maxvio calibration bisects sigma on the realised statistic with one seed: draws at two
    close popularities must agree token by token almost everywhere."""
    z = np.random.default_rng(7).standard_normal(256)
    a, wa = sample_topk_pl(1.0 * z, 8, 5000, np.random.default_rng(9))
    b, wb = sample_topk_pl(1.0 * z, 8, 5000, np.random.default_rng(9))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(wa, wb)
    c, _ = sample_topk_pl(1.002 * z, 8, 5000, np.random.default_rng(9))
    assert (a[:, 0] == c[:, 0]).mean() > 0.98 and (a == c).mean() > 0.93
    d, _ = sample_topk_pl(1.0 * z, 8, 5000, np.random.default_rng(10))
    assert (a == d).mean() < 0.2


def test_dispatch_logits_take_the_race_and_groups_their_own_path():
    logp = np.random.default_rng(0).normal(0, 1, 16)
    ids, w, lg = sample_topk(logp, 2, 50, np.random.default_rng(1), with_logits=True)
    assert lg.shape == (50, 16)
    np.testing.assert_array_equal(np.argsort(-lg, axis=1, kind="stable")[:, :2], ids)
    # a layer of at most CHUNK_ELEMS token-expert pairs takes the race (coupled draws), grouped or not
    for kw in ({}, {"groups": 4, "topk_groups": 1}):
        small, ws, _ = sample_topk(logp, 2, 50, np.random.default_rng(1), **kw)
        race, wr, _ = sample_topk_race(logp, 2, 50, np.random.default_rng(1), **kw)
        np.testing.assert_array_equal(small, race)
        np.testing.assert_array_equal(ws, wr)
    T = sampling.CHUNK_ELEMS // 16 + 1                # a "large" layer: over one chunk of the race
    ids, w, lg = sample_topk(logp, 2, T, np.random.default_rng(1), groups=4, topk_groups=1)
    g, wg = sample_topk_grouped(logp, 2, T, np.random.default_rng(1), groups=4, topk_groups=1)
    assert lg is None and (ids // 4 == ids[:, :1] // 4).all()
    np.testing.assert_array_equal(ids, g)
    np.testing.assert_array_equal(w, wg)
    ids, w, lg = sample_topk(logp, 2, T, np.random.default_rng(1))
    fast, wf = sample_topk_pl(logp, 2, T, np.random.default_rng(1))
    assert lg is None
    np.testing.assert_array_equal(ids, fast)
    np.testing.assert_array_equal(w, wf)


# (E, K, G, M, sigma): groups of 4 keeping 1, 2 of 8 groups; groups of one expert; K = M * E/G (every
# kept expert chosen); strong skew (rows reach the remainder draw)
GROUP_CASES = [(16, 2, 4, 1, 1.0), (32, 4, 8, 2, 0.7), (8, 3, 8, 3, 1.0), (16, 8, 4, 2, 0.5), (12, 3, 3, 2, 3.0)]


@pytest.mark.parametrize("E,K,G,M,sigma", GROUP_CASES)
def test_grouped_fast_path_matches_the_race(E, K, G, M, sigma):
    logp = np.random.default_rng(E + K).normal(0, sigma, E)
    fast, w_fast = sample_topk_grouped(logp, K, 40000, np.random.default_rng(1), groups=G, topk_groups=M)
    race, w_race, _ = sample_topk_race(logp, K, 40000, np.random.default_rng(2), groups=G, topk_groups=M)
    s = np.sort(fast, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all() and fast.min() >= 0 and fast.max() < E
    grp = np.sort(fast // (E // G), axis=1)
    assert (1 + (grp[:, 1:] != grp[:, :-1]).sum(axis=1)).max() <= M       # at most M groups per token
    np.testing.assert_allclose(_position_freq(fast, E), _position_freq(race, E), atol=0.012)
    # the set of groups each token spans (a bitmask over G), its frequencies
    span = lambda ids: np.bincount(np.bitwise_or.reduce(1 << (ids // (E // G)), axis=1), minlength=1 << G) / len(ids)
    np.testing.assert_allclose(span(fast), span(race), atol=0.012)
    np.testing.assert_allclose(w_fast.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(w_fast.mean(axis=0), w_race.mean(axis=0), atol=0.006)
    assert (np.diff(w_fast, axis=1) <= 1e-7).all()


def _icdf_cases():
    """Each named popularity alone (guide ranges 1-5 wide: walked) and with 300 lognormal(3)
    experts beside it (ranges about 10 wide: bisected)."""
    out = {}
    for name, logp in CASES.items():
        for tail in (False, True):
            lp = np.concatenate([logp, np.random.default_rng(1).normal(0, 3, 300)]) if tail else logp
            p = np.exp(lp - lp.max())
            out[f"{name}{'+tail' if tail else ''}"] = p / p.sum()
    return out


def test_inverse_cdf_cases_walk_and_bisect():
    widths = [InverseCDF(p).width for p in _icdf_cases().values()]
    assert min(widths) <= 4 < max(widths)


def _icdf_draw(icdf: InverseCDF, u: np.ndarray) -> np.ndarray:
    """Expert ids, int32 [N], of uniforms ``u`` float64 [N] in [0, 1): the kernels' draw over every expert."""
    from moonep_sim.routing import sampling_kernels, sampling_records

    e, none = np.empty(u.size, np.int32), np.empty(0, np.intp)
    every = sampling_records.RowSpan(none, np.empty(0), np.empty(0), icdf.cum_E.size, False)
    sampling_kernels.draw(u, none, icdf.record, every, e)
    return e


@pytest.mark.parametrize("name", sorted(_icdf_cases()))
def test_inverse_cdf_equals_searchsorted(name):
    p = _icdf_cases()[name]
    icdf = InverseCDF(p)
    u = np.concatenate([np.random.default_rng(2).random(20000), icdf.cum_E[:-1], [0.0, np.nextafter(1.0, 0)]])
    want = np.minimum(np.searchsorted(icdf.cum_E, u, side="right"), p.size - 1)
    np.testing.assert_array_equal(_icdf_draw(icdf, u), want)


class _ZeroExponentials:
    """A generator whose exponentials are exact zeros (float32 draws can be): the rest delegated."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def standard_exponential(self, size=None, dtype=np.float64, out=None):
        if out is not None:                       # the plain path draws into its [K, T] array
            out[...] = 0
            return out
        return np.zeros(size, dtype)

    def __getattr__(self, name):
        return getattr(self.rng, name)


def test_an_exact_zero_exponential_gives_finite_weights():
    logp = CASES["lognormal-0.5"]
    ids, w = sample_topk_pl(logp, 3, 100, _ZeroExponentials(0))
    assert np.isfinite(w).all() and np.allclose(w.sum(axis=1), 1.0)
    ids, w = sample_topk_grouped(np.zeros(8), 2, 100, _ZeroExponentials(0), groups=4, topk_groups=2)
    assert np.isfinite(w).all() and np.allclose(w.sum(axis=1), 1.0)
