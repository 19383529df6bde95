"""Hop.rows_RR (a compiled pass over the messages) against its numpy reference, pair_rows_reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.errors import PlanError
from moonep_sim.perf import PerfConfig
from moonep_sim.plan import INDEX, Hop
from moonep_sim.plan import ir
from moonep_sim.plan.ir import _ROWS_CHUNK, pair_rows_reference
from moonep_sim.plan.kinds import Scope


def _hop(src, dst) -> Hop:
    src, dst = np.asarray(src), np.asarray(dst)
    rows = np.arange(src.size)
    return Hop(Scope.GLOBAL, src, rows, dst, rows, np.array([src.size]))


#: every hop counted by the compiled pass (by default hops this small take the reference)
COMPILED = PerfConfig(pair_rows_compiled_min=0)


def _check(src, dst, R):
    got = _hop(src, dst).rows_RR(R, COMPILED)
    ref = pair_rows_reference(np.asarray(src, dtype=INDEX), np.asarray(dst, dtype=INDEX), R)
    assert got.dtype == np.int64 and got.shape == (R, R)
    np.testing.assert_array_equal(got, ref)
    assert int(got.sum()) == np.asarray(src).size
    return got


CASES = {
    "empty": ([], [], 4),
    "one message": ([2], [1], 3),
    "one rank, all local": ([0] * 5, [0] * 5, 1),
    "one pair, many messages": ([1] * 1000, [3] * 1000, 4),
    "all to all once": (np.repeat(np.arange(8), 8), np.tile(np.arange(8), 8), 8),
    "unsorted, duplicates": ([3, 0, 3, 1, 0, 3], [0, 3, 0, 1, 3, 2], 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_rr_cases(name):
    _check(*CASES[name])


def test_rows_rr_cases_cover_degenerate_regimes():
    sizes = {len(CASES[k][0]) for k in CASES}
    assert 0 in sizes and 1 in sizes and any(CASES[k][2] == 1 for k in CASES)


@settings(max_examples=60, deadline=None)
@given(R=st.integers(1, 40), m=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1))
def test_rows_rr_matches_reference_random(R, m, seed):
    rng = np.random.default_rng(seed)
    _check(rng.integers(0, R, m), rng.integers(0, R, m), R)


def test_rows_rr_matches_reference_over_chunks():
    """More messages than one chunk of the reference, int64 and int32 messages alike."""
    rng = np.random.default_rng(0)
    R, m = 64, 2 * _ROWS_CHUNK + 17
    src, dst = rng.integers(0, R, m), rng.integers(0, R, m)
    for dt in (np.int32, np.int64):
        h = Hop(Scope.GLOBAL, src.astype(dt), np.zeros(m, np.int32), dst.astype(dt), np.arange(m),
                np.array([m]))
        np.testing.assert_array_equal(h.rows_RR(R, COMPILED), pair_rows_reference(src, dst, R))


@pytest.mark.parametrize("src,dst,bad", [([0, 1, -1], [0, 1, 0], 2), ([0, 4, 1], [0, 0, 0], 1),
                                         ([0, 0], [1, -2], 1), ([1], [4], 0)])
def test_rows_rr_names_a_rank_out_of_range(src, dst, bad):
    with pytest.raises(PlanError, match=rf"hop message {bad}: src_rank \(-?\d+\) and dst_rank \(-?\d+\) "
                                        r"must lie in 0\.\.3"):
        _hop(src, dst).rows_RR(4, COMPILED)


def test_rows_rr_non_integer_messages_take_the_reference():
    """Messages that are not integers (a Plan the checks will name) are counted by the reference."""
    h = _hop(np.array([0.0, 1.0]), np.array([1.0, 1.0]))
    with pytest.raises(TypeError):
        h.rows_RR(2, COMPILED)


def test_rows_rr_small_hops_take_the_reference(monkeypatch):
    """Below ``perf.pair_rows_compiled_min`` messages the reference counts (the same matrix)."""
    monkeypatch.setattr(ir, "_pair_rows", None)   # a call would fail: the reference must count
    np.testing.assert_array_equal(_hop([0, 1, 1], [1, 1, 0]).rows_RR(2, PerfConfig(pair_rows_compiled_min=10)),
                                  [[0, 1], [1, 1]])
