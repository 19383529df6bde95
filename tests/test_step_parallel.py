"""The parallel layout record: products, divisibility, stage splits (moonep_sim.step.parallel)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.models import get_model
from moonep_sim.step.parallel import Parallel, pure_ep


def test_deepseek_v3_pretraining_layout():
    # DeepSeek-V3's published pretraining layout: PP16 (DualPipe) x EP64 x ZeRO-1 DP, no TP, on 2048 GPUs
    p = Parallel(pp=16, dp=128, ep=64, pp_schedule="dualpipe", zero=1, micro_batch_size=1, global_batch_size=15360)
    p.check(2048, get_model("deepseek-v3"))
    assert (p.world, p.edp, p.micro_batches) == (2048, 2, 120)
    assert sum(p.stage_layers(61)) == 61 and len(p.stage_layers(61)) == 16


def test_megatron_expert_folding():
    # EP carved out of TP x DP: TP8 PP4 DP2 with EP16 (the Qwen3-30B-A3B development row's layout)
    p = Parallel(tp=8, pp=4, dp=2, ep=16, etp=1, micro_batch_size=4, global_batch_size=256)
    p.check(64, get_model("qwen3-30b-a3b"))
    assert (p.edp, p.micro_batches) == (1, 32)


def test_pure_ep_is_todays_layout():
    p = pure_ep(64)
    assert (p.world, p.tp, p.pp, p.dp, p.ep, p.edp) == (64, 1, 1, 64, 64, 1)
    assert p.label() == "DP64 EP64"


@pytest.mark.parametrize("kw, gpus, match", [
    (dict(tp=2, dp=2), 8, r"tp x cp x dp x pp \(2 x 1 x 2 x 1 = 4\) must equal the GPUs \(8\)"),
    (dict(dp=4, ep=8), 4, r"ep x etp \(8 x 1\) must divide tp x cp x dp"),
    (dict(pp=2, vpp=2, dp=2), 4, r"vpp \(2\) must be 1 unless the pp schedule is interleaved"),
    (dict(pp=2, vpp=1, pp_schedule="interleaved"), 2, r"needs vpp >= 2"),
    (dict(pp=3, pp_schedule="dualpipe"), 3, r"pp \(3\) must be even for dualpipe"),
    (dict(dp=4, micro_batch_size=2, global_batch_size=12), 4, r"global batch size \(12\) must be a multiple"),
    (dict(tp=1, sequence_parallel=True), 1, r"sequence parallel needs tp >= 2"),
    (dict(zero=4), 1, r"zero \(4\) must be one of 0, 1, 2, 3"),
    (dict(tp=0), 1, r"tp \(0\) must be an integer >= 1"),
    (dict(pp=2, dp=2, ep=2, overlap_moe_expert_parallel_comm=True), 4,
     r"overlap_moe_expert_parallel_comm needs the interleaved pp schedule with vpp >= 2 \(pp schedule 1f1b, vpp 1\)"),
    (dict(pp=2, vpp=2, pp_schedule="interleaved", dp=2, overlap_moe_expert_parallel_comm=True), 4,
     r"overlap_moe_expert_parallel_comm needs ep >= 2 \(ep 1\)"),
    (dict(overlap_moe_expert_parallel_comm=1), 1, r"overlap_moe_expert_parallel_comm \(1\) must be true or false"),
])
def test_bad_layouts_are_one_line(kw, gpus, match):
    with pytest.raises(ConfigError, match=match):
        Parallel(**kw).check(gpus)


def test_model_rules():
    m = get_model("deepseek-v3")
    with pytest.raises(ConfigError, match=r"tp \(3\) must divide the attention heads \(128"):
        Parallel(tp=3).check(3, m)
    with pytest.raises(ConfigError, match=r"ep \(72\) must divide the expert slots \(256"):
        Parallel(dp=72, ep=72).check(72, m)
    Parallel(dp=72, ep=72).check(72, m, expert_slots=288)   # 256 + 32 redundant over EP72
    with pytest.raises(ConfigError, match=r"pp x vpp \(64 x 1 = 64\) must be <= the layers \(61"):
        Parallel(pp=64).check(64, m)
    with pytest.raises(ConfigError, match=r"sequence length \(4097\) must be a multiple of 2 x cp"):
        Parallel(cp=2).check(2, seq_len=4097)


def test_uneven_first_and_last_stages():
    p = Parallel(pp=4, first_stage_layers=13, last_stage_layers=14)
    assert p.stage_layers(61) == (13, 17, 17, 14)
    with pytest.raises(ConfigError, match="must leave at least one layer"):
        Parallel(pp=4, first_stage_layers=30, last_stage_layers=30).stage_layers(61)


def test_from_dict_round_trip_and_unknown_keys():
    p = Parallel(tp=2, pp=2, dp=2, ep=4, zero=2)
    assert Parallel.from_dict(p.to_dict()) == p
    with pytest.raises(ConfigError, match="unknown layout key"):
        Parallel.from_dict({"tp": 2, "tensor": 4})


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 16), st.integers(1, 4), st.integers(1, 64),
       st.integers(1, 200))
def test_stage_split_partitions_the_layers(pp, vpp, dp, first, layers, last):
    sched = "interleaved" if vpp > 1 and pp > 1 else "1f1b"
    vpp = vpp if sched == "interleaved" else 1
    try:
        p = Parallel(pp=pp, vpp=vpp, dp=dp, pp_schedule=sched, first_stage_layers=first if pp > 1 else 0,
                     last_stage_layers=0)
        s = p.stage_layers(layers)
    except ConfigError:
        return
    assert len(s) == pp * vpp and sum(s) == layers and min(s) >= 1
    if pp > 1:
        assert s[0] == first
        assert max(s[1:]) - min(s[1:]) <= 1


def test_ep_a2a_overlap_is_named_and_round_trips():
    # development row 2's "overlap on" layout as its harness runs it (Megatron's flag with a virtual pipeline of 2)
    p = Parallel(tp=8, pp=4, vpp=2, pp_schedule="interleaved", dp=2, ep=16, micro_batch_size=4, global_batch_size=256,
                 overlap_moe_expert_parallel_comm=True).check(64)
    assert p.label() == "TP8 PP4x2 DP2 EP16 EP-a2a-overlap"
    assert Parallel.from_dict(p.to_dict()) == p
