"""The simulator's fast paths against the code they replace, run for run: the engine's AllOrAny
against simpy's AllOf / AnyOf, the step's read-back against a per-span loop, the dropped count."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from conftest import random_routing
from moonep_sim.models import custom_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.plan.kinds import Direction, PhaseKind
from moonep_sim.sim import SimOptions, Stall, load_topology
from moonep_sim.sim import engine
from moonep_sim.sim.analysis import sim_result
from moonep_sim.step import CostModel
from moonep_sim.step import layer_sim
from moonep_sim.step.layer_sim import simulate_moe_layer
from moonep_sim.strategies import PlanContext, make_plan

MODEL = custom_model(32, 4, hidden=512, expert_ffn=256, name="tiny")


def _plan(strategy, R=8, G=4, T_per=64, seed=0, skew=1.3, **opts):
    ids, w = random_routing(T_per * R, MODEL.top_k, MODEL.num_experts, seed, skew)
    g = GlobalRouting.split_evenly(ids, w, MODEL.num_experts, R)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(MODEL.num_experts, R), RowCosts.from_model(MODEL), 1)
    return make_plan(strategy, g, ctx, **opts)


def _run(plans, topo, opts):
    sim = engine.StepSim(plans, topo, MODEL, opts)
    sim.build()
    sim.env.run()
    res = sim_result(sim, 0.0).to_dict()
    res.pop("sim_wall_seconds")
    res["sim_stats"].pop("wall_seconds")
    return sim, res


def _simpy_conditions(env, events, need_all):
    """The reference: simpy's own conditions."""
    return env.all_of(events) if need_all else env.any_of(events)


CASES = [("alltoall", SimOptions(backward=True)), ("deepep", SimOptions(backward=True)),
         ("deepep", SimOptions(chunks=2, jitter=0.1, seed=4)), ("moonep", SimOptions(backward=True, chunks=3)),
         ("moonep", SimOptions(overlap_prefetch=False, faults=(Stall(1, 40.0, "dispatch"),))),
         ("hierarchical", SimOptions(backward=True))]


@pytest.mark.parametrize("strategy,opts", CASES)
def test_all_or_any_runs_as_simpy_conditions(strategy, opts, monkeypatch):
    topo = load_topology("h800-cx7", gpus_per_node=4)
    plans = [_plan(strategy, seed=1), _plan(strategy, seed=2)]
    fast, fast_res = _run(plans, topo, opts)
    monkeypatch.setattr(engine, "AllOrAny", _simpy_conditions)
    ref, ref_res = _run(plans, topo, opts)
    assert fast.spans == ref.spans
    assert fast.compute_gate == ref.compute_gate
    for a in ("stage_start", "stage_end", "compute_start", "compute_end"):
        np.testing.assert_array_equal(getattr(fast, a), getattr(ref, a))
    fr, rr = fast.net.records(), ref.net.records()
    for k in rr:
        np.testing.assert_array_equal(fr[k], rr[k])
    assert repr(fast_res) == repr(ref_res)


@pytest.mark.parametrize("make", [engine.AllOrAny, _simpy_conditions])
def test_all_or_any_fires_and_fails_as_simpy_does(make):
    """The same sequence through AllOrAny and simpy's conditions: what fires when, and a failure
    passed on to the process waiting."""
    env = simpy.Environment()
    a, b = env.event(), env.event()
    both, one, none = make(env, [a, b], True), make(env, [a, b], False), make(env, [], True)
    caught = []

    def waiter():
        try:
            yield both
        except ValueError as e:
            caught.append((env.now, str(e)))

    env.process(waiter())
    assert none.triggered and not both.triggered and not one.triggered
    a.succeed()
    env.run(until=1)
    assert one.triggered and one.ok and not both.triggered
    env.timeout(2).callbacks.append(lambda _e: b.fail(ValueError("lost")))
    env.run()
    assert both.triggered and not both.ok and caught == [(3, "lost")]


def _direction_reference(sim, si, direction, rec):
    """The per-span loop the read-back replaced (layer_sim._direction before one pass served both
    directions)."""
    R = sim.R
    c0, c1 = sim.compute_start[si], sim.compute_end[si]
    comb_end = c1.copy()
    plan_R = np.zeros(R)
    for s in sim.spans:
        if s.direction != direction:
            continue
        if s.end_us > comb_end[s.rank]:
            comb_end[s.rank] = s.end_us
        if s.kind in (PhaseKind.PLANNING, PhaseKind.ROUTING_GATHER):
            plan_R[s.rank] += s.end_us - s.start_us
    return np.maximum(comb_end, c1), plan_R


@pytest.mark.parametrize("strategy", ["alltoall", "deepep", "moonep"])
def test_read_back_matches_the_per_span_loop(strategy):
    topo = load_topology("h800-cx7", gpus_per_node=4)
    sim, _ = _run([_plan(strategy)], topo, SimOptions(backward=True))
    rec = sim.net.records()
    spans = layer_sim._span_ends(sim)
    for si, d in ((0, Direction.FORWARD), (1, Direction.BACKWARD)):
        comb_end, plan_R = _direction_reference(sim, si, d, rec)
        got = layer_sim._direction(sim, si, d, rec, spans)
        last = float(sim.compute_end[si].max())
        np.testing.assert_array_equal(got.post_R, np.maximum(comb_end - last, 0.0))
        np.testing.assert_array_equal(got.plan_R, plan_R)
        alone = layer_sim._direction(sim, si, d, rec)   # reading the spans itself
        for f in ("pre_R", "expert_R", "post_R", "grad_R", "plan_R"):
            np.testing.assert_array_equal(getattr(alone, f), getattr(got, f))
        assert alone.layer_us == got.layer_us
    assert (spans[Direction.FORWARD][1] != np.zeros(sim.R)).any()   # the case has planning to sum


@pytest.mark.parametrize("strategy,opts", [("capacity", {}), ("alltoall", {})])
def test_dropped_count_matches_the_plan(strategy, opts):
    plan = _plan(strategy, skew=2.5, **opts)
    assert layer_sim._dropped(plan) == plan.dropped
    topo = load_topology("h800-cx7", gpus_per_node=4)
    comm = simulate_moe_layer(plan, MODEL, topo, CostModel(topo), train=False)
    assert comm.dropped == plan.dropped


def test_capacity_case_drops_entries():
    """The table above covers a Plan that drops entries (the count's slow path) and one that does not."""
    assert _plan("capacity", skew=2.5).dropped > 0 and _plan("alltoall", skew=2.5).dropped == 0


@pytest.mark.parametrize("enabled", [True, False])
def test_run_pauses_the_collector_and_restores_it(enabled):
    import gc

    topo = load_topology("h800-cx7", gpus_per_node=4)
    sim = engine.StepSim([_plan("alltoall")], topo, MODEL, SimOptions())
    sim.build()
    seen = []
    sim.env.timeout(1.0).callbacks.append(lambda _e: seen.append(gc.isenabled()))
    (gc.enable if enabled else gc.disable)()
    try:
        sim.run()
        assert seen == [False] and gc.isenabled() == enabled
    finally:
        gc.enable()
    ref = engine.StepSim([_plan("alltoall")], topo, MODEL, SimOptions())
    ref.build()
    ref.env.run()
    assert ref.spans == sim.spans


def test_collector_paused_nests_and_restores():
    import gc

    gc.enable()
    try:
        with engine.collector_paused():
            assert not gc.isenabled()
            with engine.collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()   # the inner one found it paused: leaves it so
        assert gc.isenabled()
        with pytest.raises(ValueError):
            with engine.collector_paused():
                raise ValueError("inside")
        assert gc.isenabled()
    finally:
        gc.enable()
