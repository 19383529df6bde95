"""Routes composed of hop builders (``moonep_sim.plan.hops``): the docs' two-hop example runs as
written, and the compositions the strategies use equal the routes they replaced."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import random_routing
from test_planner_outputs_pinned import assert_same_plan
import plan_reference as reference
from test_strategies_common import COSTS, check_properties
from moonep_sim import strategies
from moonep_sim.errors import PlanError
from moonep_sim.plan import (ClusterShape, GlobalRouting, Placement, Scope, home_slots, plan_from_hops,
                             Route, Slots, to_final, to_node_of_final, to_rail_of_final, via)
from moonep_sim.strategies import PlanContext, make_plan

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _example() -> str:
    m = re.search(r"<!-- example: rail-first -->\n```python\n(.*?)```\n<!-- end example -->", DOC.read_text(), re.S)
    assert m, "docs/extending.md lost its rail-first example"
    return m.group(1)


def _case(R=8, G=4, E=16, K=4, T=96, seed=3, tp=1):
    ids, w = random_routing(T, K, E, seed=seed, skew=1.5)
    return GlobalRouting.split_evenly(ids, w, E, R), PlanContext(ClusterShape(R, G), Placement.home_groups(E, R),
                                                                 COSTS, tp)


def test_the_docs_two_hop_strategy_runs_as_written(monkeypatch):
    monkeypatch.setattr(strategies, "_REGISTRY", strategies._REGISTRY.copy())  # the registration is undone
    exec(compile(_example(), str(DOC), "exec"), {"__name__": "rail_first"})
    for tp in (1, 4):
        routing, ctx = _case(tp=tp)
        p = make_plan("rail-first", routing, ctx)
        check_properties("rail-first", p, routing)
        assert [h.scope for h in p.hops] == [Scope.INTER_NODE, Scope.INTRA_NODE]
        assert not p.entry_dup_TK.any()  # NVLink once per entry
        # deduplicated on both hops it is deepep's route exactly
        q = make_plan("rail-first", routing, ctx, dedup_last=True)
        d = make_plan("deepep", routing, ctx)
        assert_same_plan(dataclasses.replace(q, strategy="deepep", options=d.options), d)
        assert q.hops[1].src_rank_M.size < p.hops[1].src_rank_M.size


@pytest.mark.parametrize("R, G", [(8, 4), (8, 2), (4, 4), (12, 3)])
def test_hop_builders_match_the_rule_of_the_cluster_geometry(R, G):
    cl = ClusterShape(R, G)
    s, d = np.meshgrid(np.arange(R), np.arange(R), indexing="ij")
    rail = to_node_of_final(cl).via_RR
    np.testing.assert_array_equal(cl.node_of(rail), d // G)
    np.testing.assert_array_equal(cl.local_index(rail), s % G)
    assert bool(cl.same_rail(rail, s).all()) and bool(cl.same_node(rail, d).all())
    local = to_rail_of_final(cl).via_RR
    np.testing.assert_array_equal(local, (s // G) * G + d % G)
    assert bool(cl.same_node(local, s).all()) and bool(cl.same_rail(local, d).all())
    assert cl.rail_of(5) == 5 % G and cl.node_of(5) == 5 // G and cl.rank_at(cl.node_of(5), cl.local_index(5)) == 5


@pytest.mark.parametrize("dedup", [(False, False), (True, False), (False, True), (True, True)])
def test_composed_routes_equal_their_reference(dedup):
    """Any table hop composed with any final hop: the Plan equals the reference builder's."""
    routing, ctx = _case(R=8, G=2, E=32, K=6, T=200, seed=7, tp=3)
    sr, se, slot_of = home_slots(ctx.placement)
    rng = np.random.default_rng(1)
    table = rng.integers(0, 8, (8, 8))
    hops = [via(table, Scope.GLOBAL, dedup=dedup[0]), to_final(Scope.GLOBAL, dedup=dedup[1])]
    args = (routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), slot_of[routing.topk_ids_TK])
    got = plan_from_hops(*args, hops, token_padding=3)
    want = reference.plan_from_routes(*args, Route([table], ("global", "global"), dedup, via_table=True), token_padding=3)
    assert_same_plan(got, want)
    one = plan_from_hops(*args, [to_final(dedup=True)], token_padding=3)  # one global hop
    assert_same_plan(one, reference.plan_from_slots(*args, dedup=True, token_padding=3))


def test_a_route_must_end_at_the_final_rank():
    routing, ctx = _case()
    sr, se, slot_of = home_slots(ctx.placement)
    args = (routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), slot_of[routing.topk_ids_TK])
    for hops in ([], [to_node_of_final(ctx.cluster)], [to_final(), to_final()]):
        with pytest.raises(PlanError, match=r"^hops \(\d\) must end with one to_final hop"):
            plan_from_hops(*args, hops)
