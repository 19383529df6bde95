"""The compiled passes of the Plan builders (``moonep_sim.plan.fused``) give the numpy builders' Plans:
every array equal, of the same dtype, on random and edge layers (no entries, one rank, every entry
on one slot, dropped entries, capacity padding, uneven ranks), and the kernels refuse indices out of
range instead of writing through them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_routing
from moonep_sim.errors import PlanError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts, Slots, fused, reference, runs
from moonep_sim.strategies import PlanContext, make_plan
from test_planner_outputs_pinned import assert_same_plan

COSTS = RowCosts(dispatch_row_bytes=7, combine_row_bytes=5, weight_bytes=11, grad_bytes=13)

# (strategy, options) pairs whose builders have a compiled path, and some whose builders do not
# (they must not change either)
STRATEGIES = [("alltoall", {}), ("alltoall", {"dedup": True}), ("moonep", {}), ("moonep", {"dedup": False}),
              ("capacity", {}), ("capacity", {"cf": 0.5, "drop": "position"}), ("capacity", {"cf": 2.0, "pad": False}),
              ("eplb", {}), ("eplb", {"choice": "contiguous", "dedup": True}), ("llep", {}), ("deepep-ll", {}),
              ("ultraep", {}), ("costaware", {}), ("deepep", {}), ("hierarchical", {}),
              ("hierarchical", {"dedup": True}), ("allgather", {})]


#: the readable builders everywhere, the compiled kernels everywhere
NUMPY, COMPILED = PerfConfig(plan_compiled_min=1 << 62), PerfConfig(plan_compiled_min=0)


def _plans(name, routing, ctx, **opts):
    """(numpy Plan, compiled Plan) of one strategy on one layer, or None where the strategy refuses
    the layer (the same refusal both ways)."""
    out = []
    for perf in (NUMPY, COMPILED):
        try:
            out.append(make_plan(name, routing, dataclasses.replace(ctx, perf=perf), **opts))
        except Exception as e:  # noqa: BLE001 -- a refusal must be the same on both paths
            out.append(e)
    a, b = out
    if isinstance(a, Exception) or isinstance(b, Exception):
        assert type(a) is type(b) and str(a) == str(b), (a, b)
        return None
    return a, b


def _layer(tpr, K, E, seed, skew=1.0):
    tpr = np.asarray(tpr, dtype=np.int64)
    ids, w = random_routing(int(tpr.sum()), K, E, seed, skew)
    return GlobalRouting(ids, w.astype(np.float32), tpr, E)


def _ctx(E, R, G, tp=1):
    return PlanContext(ClusterShape(R, G), Placement.home_groups(E, R), COSTS, tp)


EDGE = {
    "no_tokens": (_layer([0, 0, 0, 0], 2, 8, 1), _ctx(8, 4, 2, 2)),
    "one_rank": (_layer([37], 3, 6, 2, 2.0), _ctx(6, 1, 1, 1)),
    "one_rank_pad": (_layer([37], 3, 6, 2, 2.0), _ctx(6, 1, 1, 4)),
    "one_token": (_layer([1, 0], 2, 4, 3), _ctx(4, 2, 1, 1)),
    "uneven_pad": (_layer([0, 7, 31, 3], 3, 12, 4, 2.0), _ctx(12, 4, 2, 4)),
    "even_R8": (_layer([40] * 8, 4, 32, 5, 1.5), _ctx(32, 8, 4, 1)),
    "even_R8_pad8": (_layer([40] * 8, 4, 32, 6, 1.5), _ctx(32, 8, 4, 8)),
    "K16_R16": (_layer([64] * 16, 16, 64, 7, 2.0), _ctx(64, 16, 8, 1)),
}
_same = np.tile(np.array([5, 1, 2]), (30, 1))  # every token on the same experts: all on few slots
EDGE["same_experts"] = (GlobalRouting(_same, np.full((30, 3), 0.5, np.float32), np.array([10, 10, 5, 5]), 8),
                        _ctx(8, 4, 2, 1))
_one = np.zeros((50, 1), dtype=np.int64)  # top-1, every entry to expert 0: one slot holds them all
EDGE["all_one_slot"] = (GlobalRouting(_one, np.ones((50, 1), np.float32), np.array([20, 0, 30, 0]), 8),
                        _ctx(8, 4, 2, 4))


@pytest.mark.parametrize("case", sorted(EDGE))
@pytest.mark.parametrize("name, opts", STRATEGIES, ids=[f"{n}{o or ''}" for n, o in STRATEGIES])
def test_edge_layers_plan_the_same_compiled_and_in_numpy(name, opts, case):
    routing, ctx = EDGE[case]
    pair = _plans(name, routing, ctx, **opts)
    if pair is not None:
        assert_same_plan(pair[1], pair[0])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 3, 8, 12]), st.sampled_from([1, 2, 4, 6]),
       st.sampled_from([1, 3, 4]), st.sampled_from(range(len(STRATEGIES))))
def test_random_layers_plan_the_same_compiled_and_in_numpy(seed, R, K, tp, which):
    rng = np.random.default_rng(seed)
    lo = -(-K // R)  # experts per rank: at least K experts in all
    E = R * int(rng.integers(lo, lo + 4))
    G = R if R < 4 else 4
    tpr = rng.integers(0, 30, size=R)
    routing = _layer(tpr, K, E, seed, float(rng.uniform(0, 2.5)))
    name, opts = STRATEGIES[which]
    pair = _plans(name, routing, _ctx(E, R, G, tp), **opts)
    if pair is not None:
        assert_same_plan(pair[1], pair[0])


def test_a_layer_above_the_threshold_takes_the_compiled_passes_by_default(monkeypatch):
    """At ``plan_compiled_min`` entries or more the builders use the kernels without being told (the
    Plan is the numpy one), and the layout's arrays are the Plan's index dtype."""
    R, K, E = 8, 8, 64
    routing = _layer([DEFAULT_PERF.plan_compiled_min // (R * K) + 3] * R, K, E, 11, 1.2)
    ctx = _ctx(E, R, 4, 1)
    called = []
    real = fused.single_hop_plan
    monkeypatch.setattr(fused, "single_hop_plan", lambda *a, **k: called.append(1) or real(*a, **k))
    p = make_plan("alltoall", routing, ctx)
    assert called == [1]
    q = make_plan("alltoall", routing, dataclasses.replace(ctx, perf=NUMPY))
    assert called == [1]
    assert_same_plan(p, q)


def test_layout_by_slot_equals_the_numpy_layout_with_drops_and_minimum_rows():
    rng = np.random.default_rng(3)
    S, N = 9, 500
    slot = rng.integers(-1, S, size=N)
    slot[rng.random(N) < 0.3] = -1
    slot_rank = np.array([0, 0, 1, 1, 1, 3, 3, 4, 4])
    min_rows = rng.integers(0, 90, size=S)
    for tp, with_ranks in ((1, True), (4, True), (1, False), (4, False)):
        a = fused.layout_by_slot(slot.astype(np.int16), slot_rank, tp, min_rows, 6, with_ranks=with_ranks)
        b = reference.slot_layout(slot, slot_rank, tp, min_rows, 6, with_ranks)
        for f in ("slot_rows_S", "slot_padded_S", "slot_offset_S", "entry_row_N", "order_N", "rows_R", "grow_K",
                  "entry_rank_N"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), f
            if x is not None:
                assert x.dtype == y.dtype and np.array_equal(x, y), f
        assert a.n_drop == b.n_drop == int((slot < 0).sum())


def test_kernels_refuse_indices_out_of_range():
    slot_rank = np.array([0, 1])
    for layout in (fused.layout_by_slot, reference.slot_layout):  # both forms, the same refusal
        with pytest.raises(PlanError, match=r"entry slot \(must be in \[-1, 2\)\) at position 2"):
            layout(np.array([0, 1, 2, 0]), slot_rank)
        with pytest.raises(PlanError, match=r"entry slot \(must be in \[-1, 2\)\) at position 1"):
            layout(np.array([0, -2, 1, 0]), slot_rank)
    tok = np.array([0, 1, 2])
    with pytest.raises(PlanError, match="entry slot"):
        fused.single_hop_plan(np.array([0, 1, 2, 0]), slot_rank, tok, 2, 2, False)
    with pytest.raises(PlanError, match="slot ranks"):
        fused.single_hop_plan(np.array([0, 1, 1, 0]), np.array([0, 2]), tok, 2, 2, False)
    with pytest.raises(PlanError, match="token offsets"):
        fused.single_hop_plan(np.array([0, 1, 1, 0]), slot_rank, np.array([0, 1, 3]), 2, 2, False)
    with pytest.raises(PlanError, match="token offsets"):
        fused.single_hop_plan(np.array([0, 1, 1, 0]), slot_rank, np.array([0, 3, 2]), 2, 2, False)
    from moonep_sim.plan import fused_routes

    via = np.zeros((2, 2), dtype=np.int64)
    with pytest.raises(PlanError, match="token offsets"):
        fused_routes.two_hop_plan(np.array([0, 1, 1, 0]), slot_rank, via, np.array([0, 3, 2]), 2, 2, ["global"] * 2,
                                  [True, True])
    with pytest.raises(PlanError, match="via table"):
        fused_routes.two_hop_plan(np.array([0, 1, 1, 0]), slot_rank, via + 2, tok, 2, 2, ["global"] * 2, [True, True])
    with pytest.raises(PlanError, match="every entry kept"):
        fused_routes.two_hop_plan(np.array([0, -1, 1, 0]), slot_rank, via, tok, 2, 2, ["global"] * 2, [True, True])
    with pytest.raises(PlanError, match="pieces"):
        fused.split_runs(np.array([0, 0, 1]), 2, np.array([0, 1]), np.array([1, 1]), np.array([0, 1]))


@pytest.mark.parametrize("R, relays, K", [(70, 70, 4), (12, 3, 4), (8, 1, 4), (12, 5, 3), (9, 9, 6), (300, 300, 3)])
@pytest.mark.parametrize("dedup", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("tp", [1, 4])
def test_two_hop_table_routes_plan_the_same_compiled_and_in_numpy(R, relays, K, dedup, tp):
    """Random [R, R] relay tables (more than 64 relays per source takes the entry-by-entry hop 0,
    one relay per source makes hop 0 a funnel), every pairing of the two hops' dedup flags, K not a
    power of two and more than 256 ranks (the compiled route covers them all)."""
    from moonep_sim.plan import Scope, plan_from_hops, to_final, via

    rng = np.random.default_rng(R * 7 + relays + tp + K)
    E = 2 * R
    routing = _layer(rng.integers(0, 9, size=R), K, E, R + tp, 1.3)
    ctx = _ctx(E, R, 1, tp)
    table = rng.integers(0, R, size=(R, R)) if relays == R else rng.integers(0, R, size=(R, relays))[
        :, rng.integers(0, relays, size=R)]
    hops = [via(table, Scope.GLOBAL, dedup=dedup[0]), to_final(Scope.GLOBAL, dedup=dedup[1])]
    sr = ctx.placement.slot_rank_S
    ids = routing.topk_ids_TK
    plans = []
    for perf in (NUMPY, COMPILED):
        plans.append(plan_from_hops(routing, ctx.cluster, COSTS, Slots(sr, ctx.placement.slot_expert_S, sr), ids,
                                    hops, token_padding=tp, perf=perf))
    assert_same_plan(plans[1], plans[0])


@pytest.mark.parametrize("T, K, X, hi", [(0, 4, 5, 3), (1, 1, 3, 1), (300, 16, 896, 8), (200, 6, 70, 64)])
def test_distinct_per_token_equals_deepep_nodes_per_token(T, K, X, hi):
    from moonep_sim.routing.metrics import distinct_per_token

    rng = np.random.default_rng(T + K + X)
    key = rng.integers(0, X, size=(T, K))
    value = rng.integers(0, hi, size=X)
    got = fused.distinct_per_token(key, value)
    assert got.dtype == np.int64 and np.array_equal(got, distinct_per_token(key, value))
    with pytest.raises(PlanError, match="must lie in"):
        fused.distinct_per_token(key, np.full(X, 64))
    if key.size:
        with pytest.raises(PlanError, match="key"):
            fused.distinct_per_token(key + X, value)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 5, 9]), st.sampled_from([1, 3, 8]), st.booleans(),
       st.sampled_from([1, 4]), st.floats(0, 1), st.booleans())
def test_plan_from_slots_with_drops_and_minimum_rows_is_the_same_compiled(seed, R, K, dedup, tp, drop, min_rows):
    """The single-hop builder on its own: any slot per entry (replicas: several slots per rank),
    dropped entries (-1, up to all of them), capacity padding by ``min_rows_S``, uneven ranks."""
    from moonep_sim.plan import plan_from_slots

    rng = np.random.default_rng(seed)
    tpr = rng.integers(0, 12, size=R)
    T = int(tpr.sum())
    S = int(rng.integers(1, 3 * R + 1))
    slot_rank = np.sort(rng.integers(0, R, size=S))
    slot = rng.integers(0, S, size=(T, K))
    slot[rng.random((T, K)) < drop] = -1
    routing = _layer(tpr, K, 8, seed)
    cluster = ClusterShape(R, 1)
    mins = rng.integers(0, 6, size=S) if min_rows else None
    plans = [plan_from_slots(routing, cluster, COSTS, Slots(slot_rank, slot_rank % 4, slot_rank), slot,
                             dedup=dedup, token_padding=tp, min_rows_S=mins, perf=perf) for perf in (NUMPY, COMPILED)]
    assert_same_plan(plans[1], plans[0])


@pytest.mark.parametrize("dedup, tp, drop", [(False, 1, 0.0), (True, 4, 0.2), (False, 4, 0.6)])
def test_plan_from_slots_over_several_blocks_is_the_same_compiled(dedup, tp, drop):
    """More entries than one block of the compiled pass (``fused._BLOCK``: 10,000 tokens of K = 16
    are three blocks of 4,096 tokens and a part, their ends inside ranks): the runs each block writes
    out meet the next block's, with dropped entries, padding and minimum rows."""
    from moonep_sim.plan import plan_from_slots

    rng = np.random.default_rng(int(drop * 10) + tp)
    K, tpr = 16, np.array([3000, 1, 0, 4500, 2499])
    S = 23
    assert tpr.sum() * K > 2 * fused._BLOCK
    slot_rank = np.sort(rng.integers(0, tpr.size, size=S))
    slot = rng.integers(0, S, size=(int(tpr.sum()), K))
    slot[rng.random(slot.shape) < drop] = -1
    mins = rng.integers(0, 3000, size=S)
    plans = [plan_from_slots(_layer(tpr, K, 32, 5), ClusterShape(tpr.size, 1), COSTS,
                             Slots(slot_rank, slot_rank % 4, slot_rank), slot, dedup=dedup, token_padding=tp,
                             min_rows_S=mins, perf=perf) for perf in (NUMPY, COMPILED)]
    assert_same_plan(plans[1], plans[0])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 200), st.integers(1, 9), st.integers(1, 4))
def test_slot_passes_of_the_runs_are_the_same_compiled_and_in_numpy(seed, N, X, pieces):
    """``runs.split_runs`` / ``cycle_runs`` / ``distinct_per_token``: the numpy body and the compiled
    pass give the same array (values and dtype), and refuse the same bad key with the same words."""
    rng = np.random.default_rng(seed)
    key = rng.integers(0, X, size=N)
    cnt = np.bincount(key, minlength=X)
    pk = np.repeat(np.arange(X), pieces)
    exact = np.concatenate([np.diff(np.sort(np.r_[0, rng.integers(0, c + 1, size=pieces - 1), c])) for c in cnt])
    ln = exact + (rng.integers(0, 2, size=exact.size) if rng.random() < 0.3 else 0)  # pieces may hold more
    ps = rng.permutation(pk.size)
    for fn, args in ((runs.split_runs, (pk, ln, ps)), (runs.cycle_runs, (pk, ps))):
        a, b = (fn(key, X, *args, perf=p) for p in (NUMPY, COMPILED))
        assert a.dtype == b.dtype and np.array_equal(a, b)
        if N:
            bad = key.copy()
            bad[int(rng.integers(0, N))] = X
            errs = []
            for p in (NUMPY, COMPILED):
                with pytest.raises(PlanError) as e:
                    fn(bad, X, *args, perf=p)
                errs.append(str(e.value))
            assert errs[0] == errs[1]
    short = exact.copy()
    if N:
        short[int(np.flatnonzero(short)[0])] -= 1   # one key's pieces one entry short
        errs = []
        for p in (NUMPY, COMPILED):
            with pytest.raises(PlanError, match="pieces") as e:
                runs.split_runs(key, X, pk, short, ps, perf=p)
            errs.append(str(e.value))
        assert errs[0] == errs[1]
    node = rng.integers(0, 9, size=X)
    T = N // 3
    a, b = (runs.distinct_per_token(key[:T * 3].reshape(T, 3), node, perf=p) for p in (NUMPY, COMPILED))
    assert a.dtype == b.dtype and np.array_equal(a, b)
