"""Strategy-specific behaviour: capacity drops, all-gather volumes, 2DH and DeepEP hop counts
against slow references, node-limited routing, EPLB replication/packing/migration and drift."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from conftest import random_routing
from test_strategies_common import COSTS, check_properties
from moonep_sim.errors import ConfigError, PlanError
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts, validate
from moonep_sim.strategies import PlanContext, available, make_plan
from moonep_sim.strategies.capacity import capacity_per_rank_R
from moonep_sim.routing.metrics import distinct_per_token
from moonep_sim.strategies.deepep import deepep_rdma_bytes, node_limited_topk
from moonep_sim.strategies.eplb import (EPLBPlanner, balanced_packing, balancedness, migrations, rebalance,
                                        replicate_experts)


def _ctx(E, R, G, tp=1, costs=COSTS):
    return PlanContext(ClusterShape(R, G), Placement.home_groups(E, R), costs, tp)


def _routing(T=64, K=3, E=16, R=8, seed=0, skew=1.5, tpr=None):
    ids, w = random_routing(T, K, E, seed=seed, skew=skew)
    if tpr is None:
        return GlobalRouting.split_evenly(ids, w, E, R)
    return GlobalRouting(ids, w, tpr, E)


def test_property_checker_catches_a_wrong_expert():
    r = _routing()
    p = make_plan("alltoall", r, _ctx(16, 8, 4))
    check_properties("alltoall", p, r)
    se = p.slot_expert_S.copy()
    se[[0, 1]] = se[[1, 0]]  # same rank, experts swapped: validate() cannot tell, the routing can
    with pytest.raises(AssertionError):
        check_properties("alltoall", dataclasses.replace(p, slot_expert_S=se), r)


# -- capacity ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cf, match", [(0, r"cf \(0\) must be in \(0, 1024\]"),
                                       (-1.5, r"cf \(-1.5\) must be in \(0, 1024\]"),
                                       (float("nan"), r"cf \(nan\) must be in \(0, 1024\]"),
                                       (1e308, r"cf \(1e\+308\) must be in \(0, 1024\]")])
def test_capacity_factor_must_be_positive(cf, match):
    with pytest.raises(ConfigError, match=match):
        make_plan("capacity", _routing(), _ctx(16, 8, 4), cf=cf)


def test_capacity_bad_drop_policy():
    with pytest.raises(ConfigError, match=r"drop \('random'\) must be 'weight' or 'position'"):
        make_plan("capacity", _routing(), _ctx(16, 8, 4), drop="random")


def _slow_capacity_keep(r: GlobalRouting, cf: float, drop: str) -> set[tuple[int, int]]:
    """Obviously-correct reference: per (source rank, expert), keep C_r entries by the policy."""
    T, K = r.topk_ids_TK.shape
    E = r.num_experts
    src = r.src_rank_T()
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t in range(T):
        for k in range(K):
            groups.setdefault((int(src[t]), int(r.topk_ids_TK[t, k])), []).append((t, k))
    keep = set()
    for (s, e), ent in groups.items():
        cap = math.ceil(round(int(r.tokens_per_rank_R[s]) * K / E * cf, 9))
        if drop == "weight":
            ent = sorted(ent, key=lambda tk: (-float(r.topk_weights_TK[tk]), tk))
        keep.update(ent[:cap])
    return keep


@pytest.mark.parametrize("drop", ["weight", "position"])
@pytest.mark.parametrize("cf", [0.3, 1.0, 1.7])
def test_capacity_matches_slow_reference(drop, cf):
    r = _routing(T=60, K=3, E=8, R=4, seed=5, skew=2.0, tpr=[20, 5, 0, 35])
    p = make_plan("capacity", r, _ctx(8, 4, 2), cf=cf, drop=drop)
    assert validate(p) == []
    got = {(int(t), int(k)) for t, k in zip(*np.nonzero(p.entry_rank_TK >= 0))}
    assert got == _slow_capacity_keep(r, cf, drop)


def test_capacity_pads_to_static_shapes_over_the_wire():
    R, E, K = 4, 8, 2
    ctx = _ctx(E, R, 2, tp=4)
    plans = [make_plan("capacity", _routing(T=40, K=K, E=E, R=R, seed=s, skew=sk), ctx, cf=1.0)
             for s, sk in ((1, 0.0), (2, 3.0))]
    C = capacity_per_rank_R(plans[0].tokens_per_rank_R, K, E, 1.0)
    assert C.tolist() == [math.ceil(10 * K / E)] * R
    for p in plans:
        # every rank sends a fixed [E, C] buffer: real rows plus zero rows (src_row == -1)
        h = p.hops[0]
        assert h.src_rank_M.size == E * int(C.sum())
        assert int((h.src_row_M < 0).sum()) == E * int(C.sum()) - (p.num_tokens * K - p.dropped)
        np.testing.assert_array_equal(p.rows_R(), p.capacity_R)
        assert p.padded == int(p.rows_R().sum()) - int(p.real_rows_R().sum())
    np.testing.assert_array_equal(plans[0].rows_R(), plans[1].rows_R())  # routing-independent shapes
    np.testing.assert_array_equal(plans[0].hops[0].rows_RR(R), plans[1].hops[0].rows_RR(R))
    assert plans[1].dropped > plans[0].dropped  # the skewed routing overflows more


def test_capacity_without_pad_sends_only_kept_rows_and_large_cf_drops_nothing():
    r = _routing(T=40, K=2, E=8, R=4, skew=3.0)
    p = make_plan("capacity", r, _ctx(8, 4, 2), cf=0.5, pad=False)
    assert p.hops[0].src_rank_M.size == p.num_tokens * 2 - p.dropped
    assert (p.hops[0].src_row_M >= 0).all()
    assert (p.rows_R() <= p.capacity_R).all()
    q = make_plan("capacity", r, _ctx(8, 4, 2), cf=8.0)  # cf = E: any routing fits
    assert q.dropped == 0


# -- allgather --------------------------------------------------------------------------------

def test_allgather_moves_every_token_to_every_rank():
    r = _routing(T=30, K=2, E=8, R=4, tpr=[3, 10, 0, 17])
    p = make_plan("allgather", r, _ctx(8, 4, 2))
    assert validate(p) == []
    rr = p.hops[0].rows_RR(4)
    np.testing.assert_array_equal(rr, np.repeat(r.tokens_per_rank_R[:, None], 4, axis=1))
    fwd = {ph.name: ph for ph in p.phases("forward")}
    np.testing.assert_array_equal(fwd["combine.0"].msgs_RR, rr.T)  # reduce-scatter: one row per token back
    assert p.bytes_summary()["dispatch"] == (4 - 1) * 30 * COSTS.dispatch_row_bytes


# -- hierarchical and deepep against slow references -------------------------------------------

def _pairs(r, dst_of_entry):
    T, K = r.topk_ids_TK.shape
    return {(t, int(dst_of_entry[t, k])) for t in range(T) for k in range(K)}


@pytest.mark.parametrize("dedup", [False, True])
def test_hierarchical_hops_match_reference(dedup):
    R, G, E = 8, 4, 16
    r = _routing(T=50, K=3, E=E, R=R, seed=3)
    p = make_plan("hierarchical", r, _ctx(E, R, G), dedup=dedup)
    assert validate(p) == []
    assert [h.scope for h in p.hops] == ["intra_node", "inter_node"]
    src = r.src_rank_T()[:, None] + np.zeros((1, 3), np.int64)
    dst = r.topk_ids_TK // (E // R)
    via = (src // G) * G + dst % G
    if dedup:
        assert p.hops[0].src_rank_M.size == len(_pairs(r, via))
        assert p.hops[1].src_rank_M.size == len(_pairs(r, dst))
    else:
        assert p.hops[0].src_rank_M.size == p.hops[1].src_rank_M.size == 50 * 3
    # same inter-node rows as the flat all-to-all, but each GPU talks to one GPU per remote node
    flat = make_plan("alltoall", r, _ctx(E, R, G), dedup=dedup)
    assert p.bytes_summary()["inter_node"] == flat.bytes_summary()["inter_node"]
    inter = p.hops[1].rows_RR(R) * ~np.eye(R, dtype=bool)
    assert ((inter > 0).sum(axis=1) <= R // G - 1).all()


def test_deepep_hops_match_reference_and_dedup_per_node():
    R, G, E = 8, 2, 16
    r = _routing(T=50, K=4, E=E, R=R, seed=4)
    p = make_plan("deepep", r, _ctx(E, R, G))
    assert validate(p) == []
    assert [h.scope for h in p.hops] == ["inter_node", "intra_node"]
    dst = r.topk_ids_TK // (E // R)
    node_pairs = _pairs(r, dst // G)
    assert p.hops[0].src_rank_M.size == len(node_pairs)  # once per (token, node), local node included
    assert deepep_rdma_bytes(p) == len(node_pairs) * COSTS.dispatch_row_bytes
    assert p.hops[1].src_rank_M.size == len(_pairs(r, dst))  # once per (token, GPU)
    src_node = r.src_rank_T() // G
    remote = {(t, n) for t, n in node_pairs if n != src_node[t]}
    fwd = {ph.name: ph for ph in p.phases("forward")}
    assert fwd["dispatch.0"].split_bytes(p.cluster) == (0, len(remote) * COSTS.dispatch_row_bytes)
    flat = make_plan("alltoall", r, _ctx(E, R, G), dedup=True)
    assert p.bytes_summary()["inter_node"] < flat.bytes_summary()["inter_node"]
    npt = distinct_per_token(dst, np.arange(R) // G)
    assert p.options["max_nodes_per_token"] == int(npt.max())


def test_node_limited_routing_and_max_nodes_check():
    rng = np.random.default_rng(0)
    E, nodes, M, K = 32, 4, 2, 6
    logits = rng.normal(size=(200, E)) + rng.normal(0, 1.5, E)[None]
    ids, w = node_limited_topk(logits, K, nodes, M)
    assert (distinct_per_token(ids, np.arange(E) // (E // nodes)) <= M).all()
    assert (np.sort(ids, 1)[:, 1:] != np.sort(ids, 1)[:, :-1]).all()
    np.testing.assert_allclose(w.sum(1), 1, rtol=1e-5)
    # with every node allowed it is the plain top-k of the scores
    full, _ = node_limited_topk(logits, K, nodes, nodes)
    np.testing.assert_array_equal(np.sort(full, 1), np.sort(np.argsort(-logits, 1)[:, :K], 1))
    R, G = 8, 2
    ctx = _ctx(E, R, G)
    p = make_plan("deepep", GlobalRouting.split_evenly(ids, w, E, R), ctx, max_nodes=M)
    assert validate(p) == [] and p.options["max_nodes_per_token"] <= M
    unlimited = GlobalRouting.split_evenly(full, w, E, R)
    with pytest.raises(PlanError, match=r"nodes of token \d+ \([34]\) must be <= max_nodes \(2\)"):
        make_plan("deepep", unlimited, ctx, max_nodes=M)
    with pytest.raises(ConfigError, match=r"max_nodes \(5\) must lie in \[1, 4\]"):
        node_limited_topk(logits, K, nodes, 5)


# -- eplb -------------------------------------------------------------------------------------

def test_replicate_and_pack():
    load = np.array([100, 10, 10, 40, 0, 0, 20, 20], float)
    phy, cnt = replicate_experts(load, 12)
    assert cnt.tolist() == [4, 1, 1, 2, 1, 1, 1, 1] and phy[:8].tolist() == list(range(8))
    pack, rank = balanced_packing(load / cnt[np.arange(8)], 4)
    assert np.bincount(pack, minlength=4).tolist() == [2, 2, 2, 2]
    assert sorted(zip(pack.tolist(), rank.tolist())) == [(p, i) for p in range(4) for i in range(2)]
    with pytest.raises(ConfigError, match=r"items \(7\) must be divisible by packs \(4\)"):
        balanced_packing(np.ones(7), 4)


def test_rebalance_hierarchical_keeps_groups_on_nodes():
    cl = ClusterShape(8, 4)
    load = np.random.default_rng(1).pareto(1.0, 32) * 100
    slots, policy = rebalance(load, 40, 2, cl)
    assert policy == "hierarchical"
    assert sorted(set(slots.tolist())) == list(range(32))
    node_of_slot = np.arange(40) // 20
    for g in range(2):  # every replica of a group's experts sits on one node
        assert len(set(node_of_slot[(slots // 16) == g].tolist())) == 1
    _, policy = rebalance(load, 40, 3, cl)  # 32 experts do not split into 3 groups: global policy
    assert policy == "global"


def test_eplb_errors_name_the_constraint():
    r = _routing(T=40, K=2, E=16, R=8)
    with pytest.raises(ConfigError, match=r"num_redundant \(3\) must make num_experts \+ num_redundant \(19\) "
                                          r"divisible by ranks \(8\)"):
        make_plan("eplb", r, _ctx(16, 8, 4), num_redundant=3)
    with pytest.raises(ConfigError, match=r"history shape \(\[2, 15\]\) must be \[W, 16\]"):
        make_plan("eplb", r, _ctx(16, 8, 4), history=np.ones((2, 15)))
    with pytest.raises(ConfigError, match=r"choice \('hash'\) must be 'round_robin' or 'contiguous'"):
        make_plan("eplb", r, _ctx(16, 8, 4), choice="hash")


def _skewed(seed_pop, T, K, E, seed):
    """Tokens drawn from popularity exp(N(0, 1.5)) of a given seed (popularity drifts with it)."""
    pop = np.random.default_rng(seed_pop).normal(0, 1.5, E)
    rng = np.random.default_rng(seed)
    ids = np.argsort(-(pop[None] + rng.gumbel(size=(T, E))), 1)[:, :K]
    return ids, np.full((T, K), 1.0 / K, np.float32)


def test_eplb_current_window_balances_better_than_a_drifted_past_one():
    E, K, R, G, T = 64, 4, 16, 4, 4096
    past_ids, _ = _skewed(11, T, K, E, 1)
    cur_ids, w = _skewed(22, T, K, E, 2)  # a different popularity: the hot experts moved
    r = GlobalRouting.split_evenly(cur_ids, w, E, R)
    ctx = _ctx(E, R, G)
    on_past = make_plan("eplb", r, ctx, history=np.bincount(past_ids.ravel(), minlength=E)[None])
    on_cur = make_plan("eplb", r, ctx)  # planned on this window's own counts
    base = make_plan("alltoall", r, ctx)
    b_past, b_cur, b_base = (balancedness(p.real_rows_R()) for p in (on_past, on_cur, base))
    assert b_cur > b_past
    assert b_cur > b_base
    assert on_past.options["load_source"] == "history[1]" and on_cur.options["load_source"] == "current"


def test_eplb_migration_only_when_the_placement_changes():
    E, R, G = 16, 4, 2
    costs = RowCosts(7, 5, 1000, 2000)
    ctx = _ctx(E, R, G, costs=costs)
    r1 = _routing(T=200, K=2, E=E, R=R, seed=1, skew=2.0)
    planner = EPLBPlanner(window=2)
    planner.observe(r1.counts_E())
    p1 = planner.plan(r1, ctx)
    assert p1.migrate_expert_X.size > 0  # from the home groups to the EPLB placement
    # the migrated (rank, expert) pairs are exactly those the home groups lacked
    new = set(zip(p1.slot_rank_S.tolist(), p1.slot_expert_S.tolist()))
    home = set(zip(ctx.placement.slot_rank_S.tolist(), ctx.placement.slot_expert_S.tolist()))
    assert set(zip(p1.migrate_dst_X.tolist(), p1.migrate_expert_X.tolist())) == new - home
    assert p1.bytes_summary()["migrate"] == 1000 * int((p1.migrate_src_X != p1.migrate_dst_X).sum())
    p2 = planner.plan(r1, ctx)  # same history: same placement, nothing moves
    assert p2.migrate_expert_X.size == 0
    np.testing.assert_array_equal(p1.slot_expert_S, p2.slot_expert_S)
    r2 = _routing(T=200, K=2, E=E, R=R, seed=9, skew=2.0)
    planner.observe(r2.counts_E())
    planner.observe(r2.counts_E())  # the window now holds only the new load
    p3 = planner.plan(r2, ctx)
    assert validate(p3) == []
    e, s, d = migrations(p2.slot_rank_S, p2.slot_expert_S, p3.slot_rank_S, p3.slot_expert_S, E, ctx.cluster)
    np.testing.assert_array_equal(e, p3.migrate_expert_X)
    held = set(zip(p2.slot_rank_S.tolist(), p2.slot_expert_S.tolist()))
    assert all((int(a), int(b)) in held for a, b in zip(s, e))  # sourced from a rank that held it


# -- placements -------------------------------------------------------------------------------

# planners that plan per-step copies within home groups, and refuse any other placement
NEED_HOME_GROUPS = {"costaware", "llep", "moonep", "ultraep"}


@pytest.mark.parametrize("name", sorted(available()))
def test_strategies_with_a_custom_placement(name):
    E, R, G = 10, 4, 2  # E not divisible by R: round-robin homes via a custom map
    placement = Placement.round_robin(E, R)
    assert placement.home_E.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    ctx = PlanContext(ClusterShape(R, G), placement, COSTS, 2)
    r = _routing(T=37, K=3, E=E, R=R, seed=2, tpr=[10, 0, 20, 7])
    if name in NEED_HOME_GROUPS:  # planners of per-step copies need home groups: they say so in one line
        with pytest.raises(ConfigError, match=rf"^num_experts \(10\) must be divisible by ranks \(4\) "
                                              rf"for {name}'s home-group placement$"):
            make_plan(name, r, ctx)
        return
    check_properties(name, make_plan(name, r, ctx), r)


def test_the_home_group_planners_are_registered():
    """The refusal table above names registered planners only (a renamed one would skip its check)."""
    assert NEED_HOME_GROUPS <= set(available()), NEED_HOME_GROUPS - set(available())


def test_home_groups_reject_indivisible_experts_and_ranks():
    with pytest.raises(ConfigError, match=r"num_experts \(3\) must be >= ranks \(4\)"):
        Placement.round_robin(3, 4)
    with pytest.raises(ConfigError, match=r"num_experts \(10\) must be divisible by ranks \(4\)"):
        PlanContext.default(10, 4)
    with pytest.raises(ConfigError, match=r"ranks \(6\) must be divisible by gpus_per_node \(4\)"):
        PlanContext.default(12, 6, 4)
