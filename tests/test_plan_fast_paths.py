"""Fast paths of the planners' own algorithms equal their references at the boundaries where they
switch (the pinned suites draw small cases that may never reach them).

Notation: R ranks, T tokens, K top-k, N = T*K entries.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_sim.perf import PerfConfig
from moonep_sim.plan import reference
from moonep_sim.plan.multihop import dup_flags

COMPILED, READABLE = PerfConfig(plan_compiled_min=0), PerfConfig(plan_compiled_min=1 << 62)


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 63, 64, 65, 254, 255, 256, 300]),
       st.integers(1, 19), st.booleans())
def test_dup_flags_matches_reference_on_every_path(seed, R, K, drops):
    """The compiled pass (each entry against its token's earlier ones) equals the reference, with
    and without dropped entries (-1: never a duplicate, marks nothing), on ranks drawn from few
    values so that tokens repeat ranks often."""
    rng = np.random.default_rng(seed)
    T = int(rng.integers(0, 40))
    er = rng.integers(max(R - 4, 0), R, T * K)  # few distinct ranks: many duplicates
    if drops:
        er[rng.random(er.size) < 0.3] = -1
    for perf in (COMPILED, READABLE):
        got = dup_flags(er, K, perf=perf)
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(got, reference.dup_flags(er, K))


@pytest.mark.parametrize("perf", [COMPILED, READABLE], ids=["compiled", "readable"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_dup_flags_reads_any_integer_rank_dtype(dtype, perf):
    """The ranks may come narrowed (a Plan's index arrays need not be int64)."""
    er = np.array([[3, 3, -1, 5], [-1, -1, 2, 2], [0, 1, 0, 1]], dtype=dtype).ravel()
    want = np.array([[0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]], dtype=bool).ravel()
    np.testing.assert_array_equal(dup_flags(er, 4, perf=perf), want)


def _plan_arrays(p) -> dict:
    import dataclasses
    out = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if f.name == "hops":
            for i, h in enumerate(v):
                for g in dataclasses.fields(h):
                    if g.name != "scope":
                        out[f"hop{i}.{g.name}"] = getattr(h, g.name)
        elif isinstance(v, np.ndarray):
            out[f.name] = v
    return out


@pytest.mark.parametrize("name, opts", [("allgather", {}), ("deepep", {}), ("hierarchical", {}),
                                        ("hierarchical", {"dedup": True}), ("costaware", {}), ("alltoall", {}),
                                        ("capacity", {}), ("capacity", {"pad": False, "drop": "position"})])
@pytest.mark.parametrize("tp", [1, 4])
def test_strategies_plan_the_same_with_and_without_a_second_thread(name, opts, tp):
    """Every array of the Plan (values and dtypes) is the same whether the layout runs on a second
    thread beside the hops (``perf.thread_min`` 0) or after them on one thread; the one-thread
    path is pinned against the references in ``tests/test_planner_outputs_pinned.py``."""
    import dataclasses

    from conftest import random_routing
    from moonep_sim.perf import PerfConfig
    from moonep_sim.plan import GlobalRouting
    from moonep_sim.strategies import PlanContext, make_plan
    R, G, E, K = 8, 4, 32, 4
    ids, w = random_routing(160, K, E, seed=tp, skew=1.5)
    routing = GlobalRouting.split_evenly(ids, w, E, R)
    ctx = PlanContext.default(E, R, G, token_padding=tp)
    plans = []
    for thread_min in (1 << 62, 0):
        perf = PerfConfig(thread_min=thread_min, plan_compiled_min=1 << 62)
        plans.append(_plan_arrays(make_plan(name, routing, dataclasses.replace(ctx, perf=perf), **opts)))
    one, two = plans
    assert one.keys() == two.keys()
    for k in one:
        assert one[k].dtype == two[k].dtype and np.array_equal(one[k], two[k]), k
