"""Fidelity summary: error and rank agreement (pure functions, checked against hand-worked cases)."""

from __future__ import annotations

import itertools

import pytest

from moonep_sim.report.fidelity import default_cases, kendall_tau, same_order, summarise


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
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 8))
        a, b = rng.random(n).tolist(), rng.random(n).tolist()
        assert kendall_tau(a, b) == pytest.approx(_tau_reference(a, b))


def test_same_order():
    assert same_order([3, 1, 2], [30, 10, 20])
    assert not same_order([3, 1, 2], [30, 20, 10])


def test_summarise():
    pts = [{"error": e} for e in (0.1, -0.3, 0.2, -0.05)]
    per_case = [{"kendall_tau": 1.0, "same_order": True}, {"kendall_tau": 0.5, "same_order": False}]
    s = summarise(pts, per_case)
    assert s["median_abs_error"] == pytest.approx(0.15)
    assert s["max_abs_error"] == pytest.approx(0.3)
    assert s["within_25pct"] == pytest.approx(0.75)
    assert s["same_order_cases"] == 1 and s["mean_kendall_tau"] == pytest.approx(0.75)
    assert s["pass_error"] and not s["pass_rank"]


def test_default_cases_cover_shipped_and_generated():
    full, quick = default_cases(False), default_cases(True)
    assert len(quick) < len(full)
    assert any(c.trace.startswith("gen:") for c in quick) and any(c.trace.endswith(".safetensors") for c in quick)
    assert any(c.gpus_per_node == 2 for c in full)  # one multi-node case (hierarchical paths differ)
