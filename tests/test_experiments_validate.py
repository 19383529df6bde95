"""Fidelity summary and rank agreement (pure functions, checked against hand-worked cases and slow references)."""

from __future__ import annotations

import itertools

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_sim.experiments.validate import default_cases, summarise
from moonep_sim.analysis.ranking import agreement, holm, kendall_tau, order, order_text, resolved_pairs, sign_test_p


def _tau_reference(a, b):
    """Slow, obviously-correct Kendall tau-a: concordant minus discordant pairs over all pairs."""
    n = len(a)
    c = d = 0
    for i, j in itertools.combinations(range(n), 2):
        p = (a[i] - a[j]) * (b[i] - b[j])
        c += p > 0
        d += p < 0
    return (c - d) / (n * (n - 1) / 2)


@pytest.mark.parametrize("a, b, tau", [
    ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
    ([1, 2, 3, 4], [40, 30, 20, 10], -1.0),
    ([1, 2, 3], [1, 3, 2], 1 / 3),
    ([5.0], [1.0], 1.0),
])
def test_kendall_tau_cases(a, b, tau):
    assert kendall_tau(a, b) == pytest.approx(tau)
    assert kendall_tau(a, b) == pytest.approx(_tau_reference(a, b) if len(a) > 1 else 1.0)


def test_kendall_tau_matches_reference_on_random():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 8))
        a, b = rng.random(n).tolist(), rng.random(n).tolist()
        assert kendall_tau(a, b) == pytest.approx(_tau_reference(a, b))


def test_order():
    assert order(["a", "b", "c"], [3, 1, 2]) == ["b", "c", "a"]
    assert order(["a", "b"], [1, 1]) == ["a", "b"]  # ties keep the given order


@pytest.mark.parametrize("diffs, p", [
    ([1] * 10, 2 / 1024),                     # 10 of 10: 2 * 1/1024
    ([1] * 9 + [-1], 2 * 11 / 1024),          # 9 of 10: 2 * (1 + 10)/1024
    ([1] * 8 + [-1] * 2, 2 * 56 / 1024),      # 8 of 10: not below 0.05
    ([1, -1] * 5, 1.0),
    ([0, 0, 0], 1.0),                         # no nonzero difference
    ([1, 1, 0, 0, 1], 2 / 8),                 # zeros dropped: 3 of 3
])
def test_sign_test_hand_worked(diffs, p):
    assert sign_test_p(diffs) == pytest.approx(p)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 3.0]), min_size=0, max_size=30))
def test_sign_test_is_a_symmetric_probability(diffs):
    p = sign_test_p(diffs)
    assert 0.0 < p <= 1.0
    assert p == pytest.approx(sign_test_p([-d for d in diffs]))  # two-sided
    n = sum(d != 0 for d in diffs)
    k = min(sum(d > 0 for d in diffs), sum(d < 0 for d in diffs))
    brute = sum(math.comb(n, i) for i in range(n + 1) if min(i, n - i) <= k) / 2 ** n if n else 1.0
    assert p == pytest.approx(min(1.0, brute))  # P(split at least as lopsided), by enumeration


@pytest.mark.parametrize("ps, want", [
    ([0.01, 0.04, 0.03], [True, False, False]),     # 0.01 < 0.05/3; 0.03 >= 0.05/2: stop
    ([0.001, 0.02, 0.04], [True, True, True]),      # 0.001 < 0.05/3, 0.02 < 0.05/2, 0.04 < 0.05/1
    ([0.02, 0.001], [True, True]),                  # order of the input does not matter
    ([0.03, 0.001, 0.2], [False, True, False]),
    ([], []),
])
def test_holm_hand_worked(ps, want):
    assert holm(ps) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=25))
def test_holm_is_between_bonferroni_and_uncorrected(ps):
    got = holm(ps)
    for p, ok in zip(ps, got):
        if p < 0.05 / max(len(ps), 1):
            assert ok  # Bonferroni's rejections are Holm's
        if ok:
            assert p < 0.05  # and Holm rejects nothing the uncorrected test would keep
    # a rejected p-value rejects every smaller one
    for p, ok in zip(ps, got):
        assert all(o for q, o in zip(ps, got) if q < p) or not ok


def test_resolved_pairs_and_agreement():
    rng = np.random.default_rng(1)
    noise = lambda: rng.normal(0, 0.3, 16)  # noqa: E731
    samples = {"a": 10 + noise(), "b": 10 + noise(), "c": 14 + noise()}  # a ~ b < c
    pairs = {frozenset((p["faster"], p["slower"])): p for p in resolved_pairs(samples)}
    assert pairs[frozenset("ac")]["resolved"] and pairs[frozenset("ac")]["faster"] == "a"
    assert pairs[frozenset("bc")]["resolved"] and pairs[frozenset("bc")]["slower"] == "c"
    good = agreement(samples, {"a": 5.0, "b": 4.0, "c": 9.0})  # a/b swapped: a measured tie, allowed
    assert good["resolved_pairs"] >= 2 and good["agrees"] and not good["disagreements"]
    bad = agreement(samples, {"a": 5.0, "b": 4.0, "c": 4.5})  # c simulated faster than a: wrong
    assert not bad["agrees"] and any(d.startswith("a < c") for d in bad["disagreements"])
    assert bad["measured_order_text"].endswith("< c")


def test_order_text_marks_ties():
    pairs = [{"faster": "x", "slower": "z", "resolved": True}, {"faster": "x", "slower": "y", "resolved": False},
             {"faster": "y", "slower": "z", "resolved": True}]
    assert order_text(["z", "x", "y"], [3.0, 1.0, 2.0], pairs) == "x ~ y < z"


def test_agreement_rejects_mismatched_strategies():
    with pytest.raises(Exception, match="simulated strategies"):
        agreement({"a": [1.0], "b": [2.0]}, {"a": 1.0})


def test_summarise():
    pts = [{"error": e} for e in (0.1, -0.3, 0.2, -0.05)]
    per_case = [{"kendall_tau": 1.0, "same_order": True, "agrees": True, "pairs": 3, "resolved_pairs": 2,
                 "resolved_agree": 2},
                {"kendall_tau": 0.5, "same_order": False, "agrees": False, "pairs": 3, "resolved_pairs": 3,
                 "resolved_agree": 2}]
    s = summarise(pts, per_case)
    assert s["median_abs_error"] == pytest.approx(0.15)
    assert s["max_abs_error"] == pytest.approx(0.3)
    assert s["within_25pct"] == pytest.approx(0.75)
    assert s["same_order_cases"] == 1 and s["mean_kendall_tau"] == pytest.approx(0.75)
    assert s["rank_agree_cases"] == 1 and s["resolved_pairs"] == 5 and s["resolved_agree"] == 4
    assert s["pass_error"] and not s["pass_rank"]


def test_default_cases_cover_shipped_and_generated():
    full, quick = default_cases(False), default_cases(True)
    assert len(quick) < len(full)
    assert any(c.trace.startswith("gen:") for c in quick) and any(c.trace.endswith(".safetensors") for c in quick)
    assert any(c.gpus_per_node == 2 for c in full)  # one multi-node case (hierarchical paths differ)
