"""Load metrics: maxvio, Gini, top share, rank/node loads, distinct ranks/nodes per token."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.routing.metrics import (EPLayout, distinct_per_token, estimated_distinct, gini, inspect_trace,
                                        maxvio, node_loads, rank_loads, top_share)

CASES = {  # name: (counts, maxvio, gini)
    "balanced": ([5, 5, 5, 5], 0.0, 0.0),
    "one_hot": ([0, 0, 0, 8], 3.0, 0.75),
    "hottest_twice_mean": ([2, 1, 1, 0], 1.0, 0.375),
    "all_zero": ([0, 0, 0], 0.0, 0.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_cases(name):
    c, mv, g = CASES[name]
    assert maxvio(np.array(c)) == pytest.approx(mv)
    assert gini(np.array(c)) == pytest.approx(g)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40))
def test_gini_matches_mean_absolute_difference(c):
    x = np.array(c, dtype=float)
    if x.sum() == 0:
        return
    ref = np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())   # the textbook definition
    assert gini(x) == pytest.approx(ref, abs=1e-12)


def test_loads_and_distinct():
    lay = EPLayout.home_groups(8, 4, 2)           # experts {0,1}->r0 ... {6,7}->r3; r0,r1 node 0
    c = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    assert rank_loads(c, lay).tolist() == [3, 7, 11, 15]
    assert node_loads(c, lay).tolist() == [10, 26]
    ids = np.array([[0, 1], [0, 2], [0, 7], [6, 7]])
    assert distinct_per_token(ids, lay.expert_rank_E).tolist() == [1, 2, 2, 1]
    assert distinct_per_token(ids, lay.expert_node_E).tolist() == [1, 1, 2, 1]
    assert top_share(c, 2) == pytest.approx(15 / 36)
    with pytest.raises(ConfigError, match=r"gpus_per_node \(3\) must divide ranks \(4\)"):
        EPLayout.home_groups(8, 4, 3)


def test_estimated_distinct_is_exact_for_top1_and_close_for_uniform():
    lay = EPLayout.home_groups(64, 8)
    assert estimated_distinct(np.arange(64) + 1, 1, lay.expert_rank_E, 8) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((20000, 64)), axis=1)[:, :8]
    real = distinct_per_token(ids, lay.expert_rank_E).mean()
    est = estimated_distinct(np.bincount(ids.ravel(), minlength=64), 8, lay.expert_rank_E, 8)
    assert est == pytest.approx(real, rel=0.05)


def test_inspect_shipped_mixtral_with_four_ranks():
    from conftest import TRACES
    path = TRACES / "mixtral-8x7b_humaneval.safetensors"
    res = inspect_trace(path, ranks=4, gpus_per_node=2, layers=[5])
    (p,) = res["per_layer"]
    assert sum(p["rank_loads"]) == res["tokens"] * 2 == p["selections"]
    assert 1.0 <= p["mean_distinct_ranks"] <= 2.0
    assert p["mean_distinct_nodes"] <= p["mean_distinct_ranks"]
