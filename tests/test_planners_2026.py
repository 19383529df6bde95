"""The 2026 balancing planners (``llep``, ``ultraep``) and ours (``costaware``): the rules each one
states, on named cases and with hypothesis over random expert counts. (The invariants every
strategy holds -- valid plans, conservation, combine(dispatch(x)), determinism -- are checked for
them by tests/test_strategies_common.py; real gloo runs by tests/test_gloo_layer.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts, validate
from moonep_sim.strategies import PlanContext, make_plan
from moonep_sim.strategies.costaware import CostModel, Rates, costaware_assign, target_alloc
from moonep_sim.strategies.llep import HOST_SYNC_US, llep_assign
from moonep_sim.strategies.ultraep import quota_for, ultraep_assign

# Kimi K3-like byte sizes (3584-wide rows, 63 MiB experts) and a cheap-weights variant
K3 = RowCosts(7168, 7168, 66060288, 132120576)
CHEAP = RowCosts(7168, 7168, 1024, 2048)


def routing_from_counts(counts_E: np.ndarray, ranks: int, seed: int = 0) -> GlobalRouting:
    """A top-1 routing whose per-expert counts are exactly ``counts_E`` (tokens shuffled over ranks)."""
    ids = np.repeat(np.arange(counts_E.size), counts_E)
    ids = np.random.default_rng(seed).permutation(ids)[:, None]
    T = ids.shape[0]
    return GlobalRouting.split_evenly(ids, np.ones((T, 1), np.float32), counts_E.size, ranks)


def ctx_for(E: int, R: int, G: int, costs=K3, topology=None) -> PlanContext:
    return PlanContext(ClusterShape(R, G), Placement.home_groups(E, R), costs, 1, topology)


counts_st = st.integers(2, 8).flatmap(
    lambda R: st.tuples(st.just(R), st.integers(1, 3), st.lists(st.integers(0, 5000), min_size=R, max_size=3 * R)))


def _counts(R, epn, raw):
    c = np.array((raw * (R * epn))[: R * epn], dtype=np.int64)
    return c


# -- llep -------------------------------------------------------------------------------------------
def test_llep_falls_back_to_plain_ep_below_lambda():
    c = np.full(16, 1000, dtype=np.int64)
    c[0] = 1200  # rank 0's group: 2200 vs mean 2050 -> max/mean 1.07 < 1.3
    alloc, info = llep_assign(c, 8, lam=1.3)
    assert info["fallback"]
    np.testing.assert_array_equal(alloc.argmax(axis=1), np.arange(16) // 2)
    p = make_plan("llep", routing_from_counts(c, 8), ctx_for(16, 8, 4))
    assert p.weight_copies == 0 and p.host_plan_us == HOST_SYNC_US and validate(p) == []


def test_llep_spills_a_hot_expert_to_the_least_loaded_ranks():
    c = np.full(8, 100, dtype=np.int64)
    c[0] = 4000  # one hot expert on rank 0 (epn 2)
    alloc, info = llep_assign(c, 4, alpha=1.0, m=50, lam=1.3)
    assert not info["fallback"]
    cap = info["capacity"]
    assert cap == int(1.0 * (c.sum() // 4))
    np.testing.assert_array_equal(alloc.sum(axis=1), c)
    rows = alloc.sum(axis=0)
    assert rows.max() <= cap  # everyone fits: the excess found room
    assert (alloc[0] > 0).sum() == 4  # the hot expert spread over all four ranks
    p = make_plan("llep", routing_from_counts(c, 4), ctx_for(8, 4, 2), alpha=1.0, m=50)
    assert p.weight_copies == 3 and p.host_plan_us > HOST_SYNC_US and validate(p) == []


def test_llep_skips_spills_smaller_than_m_unless_last():
    """R=4, one expert per rank, counts [1000, 10, 10, 10], alpha 1: capacity 257; rank 0 keeps 257
    and must spill 743 while each helper has room 247 (its own 10 pending)."""
    c = np.array([1000, 10, 10, 10], dtype=np.int64)
    alloc, info = llep_assign(c, 4, alpha=1.0, m=100, lam=1.0)
    assert info["capacity"] == 257
    # chunks >= m; the last 2 forced onto the least effective load (ties: lowest rank, a stable sort)
    np.testing.assert_array_equal(alloc[0], [257, 249, 247, 247])
    alloc, _ = llep_assign(c, 4, alpha=1.0, m=300, lam=1.0)
    # every chunk (247) is smaller than m and not the last: all skipped, the least-loaded takes the rest
    np.testing.assert_array_equal(alloc[0], [257, 743, 0, 0])
    np.testing.assert_array_equal(alloc[1:].sum(axis=1), [10, 10, 10])


@settings(max_examples=30, deadline=None)
@given(counts_st, st.floats(1.0, 1.2), st.integers(0, 2000))
def test_llep_conserves_and_respects_capacity_when_room_exists(case, alpha, m):
    R, epn, raw = case
    c = _counts(R, epn, raw)
    alloc, info = llep_assign(c, R, alpha=alpha, m=m, lam=0.0)
    np.testing.assert_array_equal(alloc.sum(axis=1), c)
    assert (alloc >= 0).all()
    if not info["fallback"] and m == 0 and c.max() <= info["capacity"] and info["capacity"] * R >= 2 * c.sum():
        # with no minimum chunk and no expert above capacity, nobody is forced over capacity
        assert alloc.sum(axis=0).max() <= info["capacity"]


# -- ultraep ----------------------------------------------------------------------------------------
def test_ultraep_keeps_replicas_in_the_nvlink_domain_and_caps_them():
    rng = np.random.default_rng(1)
    c = (rng.lognormal(0, 1.5, 32) * 300).astype(np.int64)
    p = make_plan("ultraep", routing_from_counts(c, 8), ctx_for(32, 8, 4), replica_cap=200)
    assert validate(p) == []
    cp = p.is_copy_S()
    assert cp.any()
    assert ((p.slot_home_S[cp] // 4) == (p.slot_rank_S[cp] // 4)).all()  # same node (domain = node)
    assert (p.slot_rows_S[cp] <= 200).all()
    per_rank = np.bincount(p.slot_rank_S[cp], minlength=8)
    assert per_rank.max() <= 32 // 8  # at most E/R replicas per rank


@settings(max_examples=30, deadline=None)
@given(counts_st, st.sampled_from([0, 50, 400]))
def test_ultraep_threshold_is_feasible_and_near_the_smallest(case, cap):
    R, epn, raw = case
    c = _counts(R, epn, raw)
    G = 2 if R % 2 == 0 else 1
    alloc, info = ultraep_assign(c, R, G, G, cap, 0.01)
    np.testing.assert_array_equal(alloc.sum(axis=1), c)
    tau = info["threshold"]
    assert alloc.sum(axis=0).max() <= np.floor(tau) + 1e-9
    lower = tau * (1 - 0.03)
    if lower > c.sum() / R + 1:
        _, ok = quota_for(c, R, G, G, lower, cap, epn)
        assert not ok or np.floor(lower) >= np.floor(tau) - 1  # the search stopped within its tolerance


# -- costaware --------------------------------------------------------------------------------------
def test_costaware_reduces_to_deepep_on_balanced_routing():
    c = np.full(64, 2048, dtype=np.int64)
    r = routing_from_counts(c, 16)
    ctx = ctx_for(64, 16, 8)
    a, b = make_plan("costaware", r, ctx), make_plan("deepep", r, ctx)
    assert a.weight_copies == 0 and a.options["chosen"] == "none"
    assert a.kernel == b.kernel  # DeepEP's relayed kernel, same SM budget
    np.testing.assert_array_equal(a.entry_rank_TK, b.entry_rank_TK)
    np.testing.assert_array_equal(a.entry_row_TK, b.entry_row_TK)
    assert len(a.hops) == len(b.hops) == 2
    for ha, hb in zip(a.hops, b.hops):
        np.testing.assert_array_equal(ha.rows_RR(16), hb.rows_RR(16))


def test_costaware_approaches_exact_balance_under_heavy_skew():
    rng = np.random.default_rng(0)
    c = (rng.lognormal(0, 2.5, 64) * 500).astype(np.int64) + 10
    r = routing_from_counts(c, 16)
    p = make_plan("costaware", r, ctx_for(64, 16, 16, CHEAP))  # one node, copies nearly free: balance pays
    assert validate(p) == []
    rows = p.real_rows_R()
    native = c.reshape(16, 4).sum(axis=1)
    assert native.max() / native.mean() > 2
    assert rows.max() / rows.mean() < 1.05
    assert p.options["residual_max_over_mean"] == pytest.approx(rows.max() / rows.mean())


def test_costaware_does_not_copy_when_weights_cost_more_than_they_save():
    c = np.full(64, 500, dtype=np.int64)
    c[5] = 3000
    huge = RowCosts(7168, 7168, 10 ** 12, 2 * 10 ** 12)  # a copy takes seconds
    p = make_plan("costaware", routing_from_counts(c, 16), ctx_for(64, 16, 8, huge))
    assert p.weight_copies == 0 and "no copy" in p.options["why"]


@settings(max_examples=25, deadline=None)
@given(counts_st, st.integers(0, 3), st.booleans())
def test_costaware_keeps_moonep_structural_bound(case, ti, cross):
    R, epn, raw = case
    c = _counts(R, epn, raw)
    G = [1, 2, R, R][ti] if R % 2 == 0 else R
    load = c.reshape(R, epn).sum(axis=1)
    tau = int(np.ceil(load.mean())) + ti * 37
    alloc = target_alloc(c, R, G, tau, cross)
    np.testing.assert_array_equal(alloc.sum(axis=1), c)
    home = np.arange(R * epn) // epn
    remote = (alloc > 0) & (home[:, None] != np.arange(R)[None, :])
    for d in range(R):
        donors = np.unique(home[remote[:, d]])
        assert donors.size <= 1  # each receiver fed by one donor group ...
        assert remote[:, d].sum() <= epn  # ... so at most E/R copy slots
    if not cross:
        e, d = np.nonzero(remote)
        assert ((home[e] // G) == (d // G)).all()
    if tau == int(np.ceil(load.mean())) and (cross or G == R) and load.sum():
        assert alloc.sum(axis=0).max() <= tau  # at the mean, MoonEP's rule reaches exact balance


def test_costaware_cross_node_switch_and_report():
    rng = np.random.default_rng(3)
    c = (rng.lognormal(0, 2.0, 64) * 400).astype(np.int64)
    c[:4] *= 20  # node 0 much hotter than the others
    r = routing_from_counts(c, 16)
    p = make_plan("costaware", r, ctx_for(64, 16, 4, CHEAP), cross_node=False)
    cp = p.is_copy_S()
    assert ((p.slot_home_S[cp] // 4) == (p.slot_rank_S[cp] // 4)).all()
    assert p.options["copies_cross_node"] == 0
    q = make_plan("costaware", r, ctx_for(64, 16, 4, CHEAP))
    assert q.options["copies_cross_node"] > 0  # the node imbalance needs copies to other nodes
    assert q.real_rows_R().max() < p.real_rows_R().max()
    for k in ("why", "target_rows", "residual_max_over_mean", "estimate_us", "estimate_no_copy_us",
              "estimate_exact_us", "rates"):
        assert k in q.options
    with pytest.raises(ConfigError, match="mode"):
        make_plan("costaware", r, ctx_for(64, 16, 4), mode="both")


def test_costaware_prices_with_the_topology_rates():
    t = SimpleNamespace(name="t", nvlink_bandwidth_GBps=100.0, nvlink_efficiency=0.5, nic_bandwidth_GBps=50.0,
                        nic_efficiency=1.0, gpu_tflops=100.0, gpu_compute_efficiency=0.5,
                        gpu_mem_bandwidth_GBps=1000.0, gpu_mem_efficiency=1.0)
    r = Rates.of(t)
    assert r.nvlink == pytest.approx(50e3) and r.weight_nvlink == r.nvlink and r.weight_nic == pytest.approx(50e3)
    assert r.flops == pytest.approx(50e6) and r.source == "t"
    t.weights_nvlink_bytes_per_us = 20e3  # a topology with its own (slower) weight-copy rate
    assert Rates.of(t).weight_nvlink == pytest.approx(20e3)
    from moonep_sim.sim import load_topology

    h800 = load_topology("h800-cx7")
    assert Rates.of(h800).weight_nvlink == pytest.approx(h800.weights_nvlink_bytes_per_us)
    assert Rates.of(h800).weight_nic == pytest.approx(h800.weights_nic_bytes_per_us)
    assert "defaults" in Rates.of(None).source
    # slower weight copies make the same skew buy fewer copies
    rng = np.random.default_rng(5)
    c = (rng.lognormal(0, 2.0, 64) * 3000).astype(np.int64)
    fast = CostModel(Rates.of(None), 8, 66e6, 132e6, 7168, 7168, 0.0, 0.0, False)
    slow = CostModel(Rates(141e3, 45e3, 1e3, 1e3, 593e6, 2.68e6, "slow copies"), 8, 66e6, 132e6, 7168, 7168, 0.0, 0.0,
                     False)
    a_fast, _ = costaware_assign(c, 16, 8, fast)
    a_slow, _ = costaware_assign(c, 16, 8, slow)
    home = np.arange(64) // 4
    n = lambda a: int(((a > 0) & (home[:, None] != np.arange(16)[None, :])).sum())  # noqa: E731
    assert n(a_slow) < n(a_fast)


@settings(max_examples=30, deadline=None)
@given(counts_st, st.integers(0, 2), st.integers(0, 2 ** 16))
def test_costaware_split_entry_slots_equal_moonep_layout(case, ti, seed):
    """costaware's entry-to-slot assignment (``alloc_entry_slots``, both forms of its pass) equals
    the readable reference of moonep's split."""
    from conftest import ref_entry_slots
    from moonep_sim.perf import PerfConfig
    from moonep_sim.strategies.moonep import alloc_entry_slots, copy_slots

    R, epn, raw = case
    c = _counts(R, epn, raw)
    load = c.reshape(R, epn).sum(axis=1)
    alloc = target_alloc(c, R, R, int(np.ceil(load.mean())) + ti * 50, True)
    ids = np.random.default_rng(seed).permutation(np.repeat(np.arange(c.size), c))
    sr, se, _ = copy_slots(alloc, epn)
    for perf in (PerfConfig(plan_compiled_min=0), PerfConfig(plan_compiled_min=1 << 62)):
        np.testing.assert_array_equal(alloc_entry_slots(ids, alloc, sr, se, perf), ref_entry_slots(ids, alloc, sr, se))


@pytest.mark.parametrize("sms", [0, 24, -1])
def test_costaware_default_prices_are_the_default_presets(sms):
    """No topology in the plan context: the rates are the default preset's as the simulator loads
    it (derived from the shipped file, not copied), and that preset is the commands' default."""
    import dataclasses

    from moonep_sim.experiments import DEFAULT_TOPOLOGY
    from moonep_sim.sim import load_topology
    from moonep_sim.strategies.costaware import DEFAULT_PRESET

    assert DEFAULT_PRESET == DEFAULT_TOPOLOGY
    got, want = Rates.of(None, sms), Rates.of(load_topology(DEFAULT_PRESET), sms)
    for f in dataclasses.fields(Rates):
        if f.name != "source":
            assert getattr(got, f.name) == pytest.approx(getattr(want, f.name)), f.name
    assert DEFAULT_PRESET in got.source
