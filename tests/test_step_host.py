"""The host timeline of an eager training step (moonep_sim.step.host) and its place in the layout
step: closed forms of the launch recurrence, syncs, and where the layout step charges it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.step.host import (HOST_LAUNCH_GAP_US, KERNELS, MEGATRON_HOST_LAUNCH_US, Block, host_launch_cost, host_timeline_us,
                                  launch_us, layer_blocks)
from moonep_sim.step.layout_step import moe_input_replicated
from moonep_sim.step.parallel import Parallel


def test_one_block_closed_form():
    # n kernels of g each issued every h: the GPU ends at max(h + n g, n h + g)
    for n, G, h in ((10, 50.0, 28.5), (10, 1000.0, 28.5), (1, 7.0, 3.0), (62, 4068.0, 28.5)):
        g = G / n
        assert host_timeline_us([Block("a", n, G)], h) == pytest.approx(max(h + n * g, n * h + g))


def test_without_launch_cost_it_is_the_gpu_time():
    bl = [Block("a", 62, 400.0), Block("moe", 25, 900.0, True), Block("a", 62, 410.0), Block("moe", 25, 880.0, True)]
    assert host_timeline_us(bl, 0.0) == pytest.approx(sum(b.gpu_us for b in bl))


def test_a_sync_serialises_host_and_gpu():
    # a host-bound block then a GPU-bound one: together the host runs ahead (max), across a sync they add up
    h = 10.0
    short, long_ = Block("a", 100, 100.0), Block("moe", 1, 5000.0)
    free = host_timeline_us([short, long_], h)
    synced = host_timeline_us([short, dataclasses.replace(long_, sync=True)], h)
    assert free == pytest.approx(max(h + 100 * 1.0 + 5000.0, 101 * h + 5000.0))
    assert synced == pytest.approx(host_timeline_us([short], h) + host_timeline_us([long_], h))
    assert synced > free


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 80), st.floats(0.0, 5000.0), st.booleans()), min_size=1, max_size=12),
       st.floats(0.0, 100.0))
def test_bounds(blocks, h):
    bl = [Block("b", n, g, s) for n, g, s in blocks]
    t = host_timeline_us(bl, h)
    gpu = sum(b.gpu_us for b in bl)
    launches = sum(b.kernels for b in bl) * h
    # never faster than the GPU's work or the host's launches; never slower than both in series
    assert t >= max(gpu, launches) - 1e-6
    assert t <= gpu + launches + 1e-6


def test_layer_blocks_sync_only_before_the_forward_moe_block():
    f = layer_blocks(300.0, 900.0, True, True, False)
    assert [(b.kind, b.kernels, b.sync) for b in f] == [("attention", KERNELS["attention"][0], False),
                                                        ("moe", KERNELS["moe"][0], True)]
    b = layer_blocks(600.0, 1800.0, True, True, True)
    assert [(x.kind, x.sync) for x in b] == [("moe", False), ("attention", False)]
    assert [x.kind for x in layer_blocks(1.0, 1.0, False, True, False)] == ["attention", "dense_ffn"]


def test_launch_cost_by_framework_and_its_override():
    assert launch_us("dualpipe") == HOST_LAUNCH_GAP_US            # DeepSeek's, measured in its trace
    assert launch_us("1f1b") == launch_us("interleaved") == MEGATRON_HOST_LAUNCH_US
    with host_launch_cost(7.0):
        assert launch_us() == launch_us("dualpipe") == 7.0
        assert host_timeline_us([Block("a", 10, 0.0)]) == pytest.approx(70.0)
    assert launch_us() == MEGATRON_HOST_LAUNCH_US
    with pytest.raises(ConfigError, match="host launch cost"):
        with host_launch_cost(-1.0):
            pass


def test_moe_input_replicated_only_for_serving_under_tp_attention():
    assert moe_input_replicated(Parallel(tp=8, ep=8), "decode")
    assert moe_input_replicated(Parallel(tp=8, etp=8), "prefill")
    assert not moe_input_replicated(Parallel(tp=8, ep=8), "train")            # Megatron splits over the dispatch
    assert not moe_input_replicated(Parallel(dp=8, ep=8, dp_attention=True), "decode")
    assert not moe_input_replicated(Parallel(tp=4, dp=2, ep=8), "decode")     # EP spans two TP groups
