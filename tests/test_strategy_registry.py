"""The strategy registry: make_plan stamps name, options and planning time; option schemas
convert strictly and reject bad values with one line naming the option, the value and the rule."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import random_routing
from moonep_sim.errors import ConfigError
from moonep_sim.plan import GlobalRouting, Slots, plan_from_slots
from moonep_sim.strategies import Option, PlanContext, available, get_strategy, make_plan


def _case(R=4, E=8, K=2, T=40):
    ids, w = random_routing(T, K, E, seed=3, skew=1.0)
    return GlobalRouting.split_evenly(ids, w, E, R), PlanContext.default(E, R, 2)


@pytest.mark.parametrize("name", sorted(available()))
def test_make_plan_stamps_name_options_and_time(name):
    routing, ctx = _case()
    spec = get_strategy(name)
    p = make_plan(name, routing, ctx)
    assert p.strategy == name and p.plan_seconds > 0
    # every declared option is stamped (defaults filled in), overlaid with what the planner resolved
    assert set(spec.options) <= set(p.options)
    raw = spec.plan_fn(routing, ctx, **spec.defaults())  # the bare planner leaves stamping to the registry
    assert raw.strategy == "" and raw.plan_seconds == 0.0
    assert p.options == {**spec.defaults(), **raw.options}


def test_builders_leave_the_stamp_to_the_registry():
    routing, ctx = _case()
    sr = np.repeat(np.arange(4), 2)
    p = plan_from_slots(routing, ctx.cluster, ctx.costs, Slots(sr, np.arange(8), sr), routing.topk_ids_TK, dedup=False,
                        options={"seen": 1})
    assert p.strategy == "" and p.options == {"seen": 1} and p.plan_seconds == 0.0


@pytest.mark.parametrize("name, opts, match", [
    ("alltoall", {"dedup": "flase"}, r"^option dedup \('flase'\) must be a boolean: one of 1/true/yes/on/0/false/no/off "
                                     r"\(strategy alltoall\)$"),
    ("moonep", {"dedup": 2}, r"^option dedup \(2\) must be a boolean \(true or false\) \(strategy moonep\)$"),
    ("eplb", {"num_redundant": -5}, r"^option num_redundant \(-5\) must be >= 0, or -1 for the default"),
    ("eplb", {"num_redundant": "2.5"}, r"^option num_redundant \('2.5'\) must be an integer \(strategy eplb\)$"),
    ("eplb", {"groups": -1}, r"^option groups \(-1\) must be >= 0 \(0: one group per node\) \(strategy eplb\)$"),
    ("eplb", {"choice": "hash"}, r"^option choice \('hash'\) must be 'round_robin' or 'contiguous' \(strategy eplb\)$"),
    ("capacity", {"cf": "inf"}, r"^option cf \(inf\) must be in \(0, 1024\]: the capacity factor"),
    ("capacity", {"cf": "x"}, r"^option cf \('x'\) must be a number \(strategy capacity\)$"),
    ("capacity", {"drop": "random"}, r"^option drop \('random'\) must be 'weight' or 'position' \(strategy capacity\)$"),
    ("deepep", {"max_nodes": -1}, r"^option max_nodes \(-1\) must be >= 0 \(0 = no limit\) \(strategy deepep\)$"),
    ("hierarchical", {"bogus": 1}, r"^option \('bogus'\) must be one of strategy 'hierarchical''s options: \['dedup'\]$"),
])
def test_bad_option_is_one_line_error(name, opts, match):
    routing, ctx = _case()
    with pytest.raises(ConfigError, match=match) as e:
        make_plan(name, routing, ctx, **opts)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, value", [("true", True), ("Yes", True), ("on", True), ("1", True),
                                         ("false", False), ("NO", False), ("off", False), ("0", False)])
def test_boolean_option_spellings(text, value):
    assert Option(bool, False, "").parse("s", "dedup", text) is value


def test_num_redundant_minus_one_is_the_default_and_zero_is_none():
    routing, ctx = _case()
    assert make_plan("eplb", routing, ctx, num_redundant=-1).options["num_redundant"] == 4  # R, rounded
    assert make_plan("eplb", routing, ctx, num_redundant=0).slot_rank_S.size == 8


def test_cli_bad_option_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "moonep_sim", "simulate", "--gen", "model=mixtral-8x7b,maxvio=2",
                        "--strategy", "alltoall", "--ranks", "4", "--opt", "dedup=flase"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "moonep-sim: error: option dedup ('flase') must be a boolean: one of 1/true/yes/on/0/false/no/off "
        "(strategy alltoall)"]


def test_planner_binds_a_strategy_for_an_executor():
    from moonep_sim.strategies import Planner, planner

    routing, ctx = _case()
    p = planner("alltoall", ctx, dedup="yes")
    assert isinstance(p, Planner) and p.name == "alltoall" and p.options == {"dedup": True}
    plan = p(routing)
    assert plan.strategy == "alltoall" and plan.options["dedup"] is True
    with pytest.raises(ConfigError, match=r"option dedup \('maybe'\)"):
        planner("alltoall", ctx, dedup="maybe")  # checked when bound, before any executor runs


def test_gloo_executor_modules_do_not_import_the_strategies():
    """The executor takes a planner callable; only the replay program above it
    (moonep_sim.experiments.ranks.replay_rank, its caller) binds strategies."""
    import ast
    from pathlib import Path

    import moonep_sim.gloo as gloo

    folder = Path(gloo.__file__).parent
    for f in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("moonep_sim.strategies") for n in names), f.name
