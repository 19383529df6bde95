"""The samplers' compiled kernels (routing/sampling_kernels.py) draw what their numpy reference
draws, bit for bit: the same ids, weights, counts and kept noise for the same generator, on the
plain path (one pass per token block, the stopped rows after), its counted redraws and replayed
weights, the grouped fast path and the race (tied keys and tied group scores included, which
the kernels leave to the reference)."""

from __future__ import annotations

import numpy as np
import pytest

import sampling_reference
from moonep_sim.routing import sampling
from moonep_sim.routing import sampling_kernels as kn


def _both(fn):
    """``fn(sampling)`` (the kernels), then ``fn(sampling_reference)`` (the numpy reference)."""
    return fn(sampling), fn(sampling_reference)


def _equal(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


# (E, K, T, sigma): a Kimi-K3-like spread, heavy skews (rows sent to their remainder, the "mostly
# chosen" test run from the first positions), K = E, one token, T not a multiple of a block
PLAIN = [(896, 16, 3000, 0.45), (64, 8, 2500, 2.5), (32, 12, 2100, 3.0), (5, 3, 1500, 1.5), (8, 8, 700, 0.5),
         (40, 1, 1100, 0.7), (16, 4, 1, 1.0), (256, 8, kn.BLOCK, 0.3)]


@pytest.mark.parametrize("E,K,T,sigma", PLAIN)
def test_the_plain_path_draws_what_the_reference_draws(E, K, T, sigma):
    logp = sigma * np.random.default_rng(E + K).standard_normal(E)
    out, ref = _both(lambda m: m.sample_topk_pl(logp, K, T, np.random.default_rng(T)))
    assert _equal(out, ref)


@pytest.mark.parametrize("E,K,T,sigma", PLAIN)
def test_counted_redraws_and_replayed_weights_equal_the_references(E, K, T, sigma):
    z = np.random.default_rng(E * K).standard_normal(E)

    def run(m):
        noise: dict = {}
        first = m.sample_topk_pl(sigma * z, K, T, np.random.default_rng(3), noise=noise)
        out = [first, np.asarray(noise["x"]), np.asarray(noise["u"])]
        for s in (0.5 * sigma, 2.0 * sigma):
            ids, counts = m.pl_ids_again(s * z, K, T, noise)
            out += [np.ascontiguousarray(ids), counts, m.pl_weights(s * z, ids, noise)]
        return out

    out, ref = _both(run)
    assert _equal(out, ref)


def test_the_first_draws_counts_are_its_experts_counts():
    z = np.random.default_rng(1).standard_normal(64)
    noise: dict = {}
    ids, _ = sampling.sample_topk_pl(1.5 * z, 8, 4000, np.random.default_rng(2), noise=noise)
    assert np.array_equal(noise["counts"], np.bincount(ids.ravel(), minlength=64))


@pytest.mark.parametrize("E,K,T,G,M,sigma", [(256, 8, 700, 8, 4, 0.4), (64, 6, 900, 8, 3, 2.0),
                                             (32, 4, 300, 4, 2, 0.0), (12, 3, 50, 6, 2, 1.0)])
def test_the_grouped_fast_path_draws_what_the_reference_draws(E, K, T, G, M, sigma):
    logp = sigma * np.random.default_rng(E).standard_normal(E)
    out, ref = _both(lambda m: m.sample_topk_grouped(logp, K, T, np.random.default_rng(5), groups=G, topk_groups=M))
    assert _equal(out, ref)


class _CoarseExponentials:
    """A generator whose exponentials come in steps of 1/4: many tied keys and group scores."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def standard_exponential(self, size=None, dtype=np.float64, out=None):
        x = (np.round(self.rng.standard_exponential(size, dtype=dtype) * 4) / 4).astype(dtype)
        if out is not None:
            out[...] = x
            return out
        return x

    def __getattr__(self, name):
        return getattr(self.rng, name)


@pytest.mark.parametrize("kw", [{}, {"groups": 8, "topk_groups": 4}, {"groups": 4, "topk_groups": 1},
                                {"groups": 16, "topk_groups": 5}])
@pytest.mark.parametrize("coarse", [False, True])
@pytest.mark.parametrize("sigma", [0.0, 0.8])
def test_the_race_draws_what_the_reference_draws(kw, coarse, sigma):
    E, K, T = 64, 6, 800
    logp = sigma * np.random.default_rng(7).standard_normal(E)
    rng = (lambda: _CoarseExponentials(9)) if coarse else (lambda: np.random.default_rng(9))

    def run(m):
        noise: dict = {}
        out = [m.sample_topk_race(logp, K, T, rng(), **kw)]
        for s in (1.0, 0.5, 2.0):                   # the calibration's redraws: the kept noise
            out.append(m.sample_topk_race(s * logp, K, T, rng(), noise=noise, **kw))
        return out

    out, ref = _both(run)
    assert _equal(out, ref)


def test_tied_rows_are_left_to_the_reference():
    T, E, K, G, M = 64, 32, 4, 4, 2
    m = np.zeros((T, E), np.float32)             # every score equal: every row ties
    ids, kv, ok = np.empty((T, K), np.int64), np.empty((T, K), np.float32), np.empty(T, np.bool_)
    kn.race_grouped(np.zeros(E, np.float32), np.ascontiguousarray(m.T), m, G, M, K, ids, kv, ok)
    assert not ok.any()
    m = np.random.default_rng(0).standard_exponential((T, E)).astype(np.float32)
    kn.race_plain(m, np.ones(E, np.float32), K, ids, kv, ok)
    assert ok.all() and np.array_equal(ids, np.argsort(m, axis=1, kind="stable")[:, :K])


@pytest.mark.parametrize("E,K,T", [(2, 1, 1), (9, 8, 40), (256, 8, 1), (16, 15, 33)])
def test_the_race_at_its_edges(E, K, T):
    logp = np.random.default_rng(E).standard_normal(E)
    out, ref = _both(lambda m: m.sample_topk_race(logp, K, T, np.random.default_rng(1)))
    assert _equal(out, ref)


def test_no_tokens():
    for fn in (lambda: sampling.sample_topk_race(np.zeros(8), 2, 0, np.random.default_rng(0)),
               lambda: sampling.sample_topk_pl(np.zeros(8), 2, 0, np.random.default_rng(0))):
        ids, w = fn()[:2]
        assert ids.shape == (0, 2) and w.shape == (0, 2)
