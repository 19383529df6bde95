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
from test_strategies_common import COSTS, check_properties
from moonep_sim import strategies
from moonep_sim.errors import PlanError
from moonep_sim.plan import (ClusterShape, GlobalRouting, Placement, Scope, home_slots, plan_from_hops, reference,
                             to_final, to_node_of_final, to_rail_of_final, via)
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
    args = (routing, ctx.cluster, ctx.costs, sr, se, sr, slot_of[routing.topk_ids_TK])
    got = plan_from_hops(*args, hops, token_padding=3)
    want = reference.plan_from_routes(*args, [table], ("global", "global"), dedup, token_padding=3, via_table=True)
    assert_same_plan(got, want)
    one = plan_from_hops(*args, [to_final(dedup=True)], token_padding=3)  # one global hop
    assert_same_plan(one, reference.plan_from_slots(*args, dedup=True, token_padding=3))


def test_a_route_must_end_at_the_final_rank():
    routing, ctx = _case()
    sr, se, slot_of = home_slots(ctx.placement)
    args = (routing, ctx.cluster, ctx.costs, sr, se, sr, slot_of[routing.topk_ids_TK])
    for hops in ([], [to_node_of_final(ctx.cluster)], [to_final(), to_final()]):
        with pytest.raises(PlanError, match=r"^hops \(\d\) must end with one to_final hop"):
            plan_from_hops(*args, hops)


# --- the table route's hop kernels against the general grouped kernel --------------------------

# name: (tokens per rank, K, via table, dedup of the last hop)
_TABLE_CASES = {
    "deepep's hop, even ranks": ([40] * 8, 4, "node", True),
    "rail-first hop, no dedup": ([40] * 8, 4, "rail", False),
    "a rank without tokens": ([30, 0, 50, 10, 40, 0, 20, 60], 8, "node", True),
    "random relays, one token per rank": ([1] * 8, 2, "random", True),
    "random relays, uneven": ([7, 90, 3, 0, 55, 12, 33, 1], 4, "random", False),
}


def _table_case(name):
    tpr, K, kind, dedup = _TABLE_CASES[name]
    R, G = 8, 4
    rng = np.random.default_rng(list(_TABLE_CASES).index(name))
    cl = ClusterShape(R, G)
    table = {"node": to_node_of_final(cl).via_RR, "rail": to_rail_of_final(cl).via_RR,
             "random": rng.integers(0, R, (R, R))}[kind].astype(np.uint8)
    N = int(sum(tpr)) * K
    dst8 = rng.integers(0, R, N).astype(np.uint8)
    bound = np.concatenate([[0], np.cumsum(tpr)]) * K
    src8 = np.empty(N, dtype=np.uint8)
    for r in range(R):
        src8[bound[r]:bound[r + 1]] = table[r][dst8[bound[r]:bound[r + 1]]]
    return R, K, table, dst8, bound, src8, dedup, rng


def _same_hop(a, b):
    for f in ("src_rank_M", "src_row_M", "dst_rank_M", "dst_row_M", "dst_rows_R"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f


def test_table_cases_cover_the_regimes():
    assert any(0 in c[0] for c in _TABLE_CASES.values()) and any(c[2] == "random" for c in _TABLE_CASES.values())
    assert {c[3] for c in _TABLE_CASES.values()} == {True, False}


@pytest.mark.parametrize("name", list(_TABLE_CASES))
def test_token_hop_equals_the_grouped_first_hop(name):
    from moonep_sim.plan.route import Messages, Sources, grouped_hop, token_hop, token_hop_fits

    R, K, table, dst8, bound, src8, _, _ = _table_case(name)
    shift = K.bit_length() - 1
    assert token_hop_fits(table, K)
    tok_off = bound >> shift
    want, want_row = grouped_hop(Sources.own_ranks(bound, tok_off), src8, Messages(True, shift=shift), R, "global")
    got, got_row = token_hop(bound, table, dst8, shift, R, "global", [np.zeros(dst8.size, np.int64)])
    _same_hop(got, want)
    assert got_row.dtype == want_row.dtype and np.array_equal(got_row, want_row)


@pytest.mark.parametrize("name", list(_TABLE_CASES))
def test_pair_hop_equals_the_grouped_last_hop(name):
    from moonep_sim.plan.route import Messages, Sources, grouped_hop, pair_hop

    R, K, table, dst8, bound, src8, dedup, rng = _table_case(name)
    shift = K.bit_length() - 1
    row = rng.integers(0, 1000, dst8.size).astype(np.int64)
    msg = Messages(dedup, shift=shift, dup_N=dst8.size if dedup else None)
    want = grouped_hop(Sources(src8, row), dst8, msg, R, "intra_node")
    got = pair_hop(bound, table, dst8, row, msg, R, "intra_node", [])
    _same_hop(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == w.dtype and np.array_equal(g, w)
