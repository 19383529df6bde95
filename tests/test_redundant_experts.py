"""Redundant expert slots: E + N slots over an EP size that divides them (EP72 / EP144 for
DeepSeek-V3's 256 + 32), the placement, the strategies on it, the memory it holds, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.experiments import Scenario
from moonep_sim.models import get_model
from moonep_sim.plan import Placement
from moonep_sim.step.memory import PlanFootprint, memory_per_rank
from moonep_sim.step.stack import step_shape


def test_256_plus_32_over_72_ranks_by_hand():
    p = Placement.redundant(256, 72, 32)
    assert p.num_slots == 288 and (np.bincount(p.slot_rank_S) == 4).all()
    homes = np.bincount(p.home_E, minlength=72)
    assert (homes[:40] == 4).all() and (homes[40:] == 3).all()  # 256 = 72 x 3 + 40
    # the 32 spare slots (one on each of ranks 40..71) replicate experts 0..31, none on its own home
    rep = p.slot_rank_S != p.home_E[p.slot_expert_S]
    assert sorted(p.slot_expert_S[rep].tolist()) == list(range(32))
    assert (p.slot_rank_S[rep] >= 40).all()
    assert (np.bincount(Placement.redundant(256, 144, 32).slot_rank_S) == 2).all()


@given(E=st.integers(4, 64), R=st.integers(2, 24), extra=st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_every_rank_holds_the_same_slots_and_no_expert_twice(E, R, extra):
    N = (-E) % R + extra * R
    if (E + N) // R < -(-E // R) or (E + N) // R > E:
        with pytest.raises(ConfigError, match="expert slots per rank"):
            Placement.redundant(E, R, N)
        return
    p = Placement.redundant(E, R, N)
    assert p.num_slots == E + N and (np.bincount(p.slot_rank_S, minlength=R) == (E + N) // R).all()
    pairs = set(zip(p.slot_rank_S.tolist(), p.slot_expert_S.tolist()))
    assert len(pairs) == E + N  # no rank holds an expert twice
    assert np.abs(np.diff(np.bincount(p.home_E, minlength=R))).max() <= 1 or R > E


def test_a_slot_count_the_ranks_do_not_divide_is_one_line():
    with pytest.raises(ConfigError, match=r"ranks \(72\) must divide the expert slots \(286 = 256 experts \+ 30 "
                                          r"redundant\)"):
        Placement.redundant(256, 72, 30)


@pytest.mark.parametrize("ranks", [72, 144])
def test_strategies_run_on_ep_sizes_that_divide_the_slots(ranks):
    sc = Scenario(routing="gen:model=deepseek-v3,maxvio=2,tokens-per-rank=16", cluster=f"{ranks}/8",
                  redundant_experts=32, strategies="eplb,alltoall,deepep-ll", layers=[0])
    rs = sc.resolved
    assert rs.ctx.placement.num_slots == 288
    assert dict(rs.strategies)["eplb"]["num_redundant"] == 32
    plans = sc.plans()
    eplb = plans.plan("eplb")
    assert eplb.slot_rank_S.size == 288 and (np.bincount(eplb.slot_rank_S, minlength=ranks) == 288 // ranks).all()
    a2a = plans.plan("alltoall")  # a home-only strategy routes to the homes, every rank holding some
    assert (np.bincount(a2a.slot_rank_S, minlength=ranks) >= 1).all()


def test_resident_slots_are_held_by_every_strategy():
    m = get_model("deepseek-v3")
    shape = step_shape(m, "decode", 8, 1024)
    homes = PlanFootprint(np.full(72, 256 / 72), np.zeros(72), None, np.full(72, 8.0), 10, False)
    a = memory_per_rank(m, shape, [homes], 72)
    b = memory_per_rank(m, shape, [homes], 72, expert_slots=288)
    # 4 resident slots per rank instead of 256/72, every MoE layer, bf16
    assert b["parts"]["weights"] - a["parts"]["weights"] == pytest.approx(
        (4 - 256 / 72) * m.moe_layers * 3 * m.dispatch_hidden * m.expert_ffn * 2)


@pytest.mark.parametrize("argv,want", [
    (["--ranks", "72", "--redundant-experts", "30"], "--ranks (72) must divide the expert slots (286 = 256 experts + "
                                                      "30 --redundant-experts)"),
    (["--ranks", "72"], "--ranks (72) must divide the routing's expert count (E=256)"),
    (["--ranks", "8", "--redundant-experts", "-8"], "redundant_experts (-8) must be an integer >= 0"),
    (["--ranks", "8", "--redundant-experts", "100000"], "redundant_experts (100000) must be <= 16 x E = 4096"),
])
def test_bad_redundant_experts_are_one_line(argv, want, capsys):
    code = main(["step", "--gen", "model=deepseek-v3,maxvio=2,tokens-per-rank=16", "--gpus-per-node", "8",
                 "--mode", "decode", "--strategies", "alltoall", "--distinct-layers", "1", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and want in err[0], err
