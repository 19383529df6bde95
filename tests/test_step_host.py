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


def test_without_host_time_kernel_j_is_issued_at_exactly_j_h():
    """Without host time the issue times are j x h exactly (not a running sum of h): the closed form
    of one block, bit for bit, at a launch cost binary fractions do not hold."""
    for n, h in ((10, 0.1), (62, 7.3), (7, 5.6)):   # host-bound (no GPU time): the last issue, n x h
        assert host_timeline_us([Block("a", n, 0.0)], h) == n * h


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


def test_host_time_of_a_block_delays_its_launches():
    # a block's host time is spread over its launches: kernel j is issued at j (h + H / n)
    h = 10.0
    assert host_timeline_us([Block("moe", 4, 0.0, False, 100.0)], h) == pytest.approx(4 * h + 100.0)
    # GPU-bound: max(issue_1 + G, issue_n + g) = max(35 + 1000, 70 + 500)
    assert host_timeline_us([Block("moe", 2, 1000.0, False, 50.0)], h) == pytest.approx(1035.0)
    # after a host-bound block the next one starts later by the host time, even without a sync
    a, m = Block("a", 10, 10.0), Block("moe", 5, 10.0, False, 300.0)
    assert host_timeline_us([a, m], h) == pytest.approx(15 * h + 300.0 + 10.0 / 5)
    assert host_timeline_us([a, dataclasses.replace(m, host_us=0.0)], h) == pytest.approx(15 * h + 10.0 / 5)


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


def _stage_timeline(host_wait: bool):
    """Embedding, a dense layer, an MoE layer and the head, forward then backward, on 2 ranks."""
    import numpy as np

    from moonep_sim.step.schedule import Timeline

    tl = Timeline(2)
    t = lambda: np.maximum(tl.compute_free, tl.comm_free)
    tl.compute("embed", 5.0, -1, "forward")
    for name, us in (("norm", 10.0), ("attn_proj", 100.0), ("attn_core", 50.0), ("norm", 10.0), ("dense_ffn", 200.0)):
        tl.compute(name, us, 0, "forward")
    for name, us in (("norm", 10.0), ("attn_proj", 100.0), ("attn_core", 50.0), ("router", 20.0)):
        tl.compute(name, us, 1, "forward")
    if host_wait:
        tl.wait(tl.comm("host_wait", np.full(2, 20.0), 1, "forward", 0.0, after=t()))
    d = tl.comm("dispatch", np.full(2, 80.0), 1, "forward", 0.2, after=t())
    e = tl.compute("expert", np.array([300.0, 400.0]), 1, "forward", after=d)
    tl.wait(tl.comm("combine", np.full(2, 90.0), 1, "forward", 0.2, after=np.full(2, e.max())))
    tl.compute("lm_head", 60.0, -1, "forward")
    tl.compute("lm_head_bwd", 120.0, -1, "backward")
    d = tl.comm("combine_bwd", np.full(2, 90.0), 1, "backward", 0.2, after=t())
    e = tl.compute("expert_bwd", np.array([600.0, 800.0]), 1, "backward", after=d)
    tl.wait(tl.comm("dispatch_bwd", np.full(2, 80.0), 1, "backward", 0.2, after=np.full(2, e.max())))
    for name, us in (("router_bwd", 40.0), ("attn_core_bwd", 125.0), ("attn_proj_bwd", 200.0)):
        tl.compute(name, us, 1, "backward")
    for name, us in (("dense_ffn_bwd", 400.0), ("attn_core_bwd", 125.0), ("attn_proj_bwd", 200.0)):
        tl.compute(name, us, 0, "backward")
    tl.compute("embed_bwd", 10.0, -1, "backward")
    return tl


def test_host_blocks_read_a_stage_timeline():
    from moonep_sim.step.host import host_blocks

    fwd, bwd = host_blocks(_stage_timeline(False), sync=True)
    assert [(l, b.kind, b.sync) for l, b in fwd] == [(-1, "embed", False), (0, "attention", False),
                                                    (0, "dense_ffn", False), (1, "attention", False),
                                                    (1, "moe", True), (2, "head", False)]
    # spans on the rank that ends last (rank 1): dense layer 170 (norms, attention) + 200 (FFN), MoE layer 180 before the dispatch
    # and dispatch 80 + slowest experts 400 + combine 90 after it
    gpu = {(l, b.kind): b.gpu_us for l, b in fwd}
    assert gpu[(0, "attention")] == pytest.approx(170.0) and gpu[(0, "dense_ffn")] == pytest.approx(200.0)
    assert gpu[(1, "attention")] == pytest.approx(180.0) and gpu[(1, "moe")] == pytest.approx(570.0)
    assert [(l, b.kind) for l, b in bwd] == [(2, "head"), (1, "moe"), (1, "attention"), (0, "dense_ffn"),
                                             (0, "attention"), (-1, "embed")]
    assert all(not b.sync for _, b in bwd)
    assert {(l, b.kind): b.kernels for l, b in bwd}[(1, "moe")] == KERNELS["moe"][1]
    # a host-proxy family's host time per call: two calls (dispatch, combine) per micro-batch on each MoE block
    hf, hb = host_blocks(_stage_timeline(False), sync=True, call_us=300.0)
    assert {(l, b.kind): b.host_us for l, b in hf + hb if b.host_us} == {(1, "moe"): 600.0}
    assert sum(b.host_us for _, b in hb) == pytest.approx(600.0)
    assert all(b.host_us == 0.0 for _, b in fwd + bwd)
    # no sync without the library's device-to-host read, unless the timeline shows a host wait
    assert not any(b.sync for _, b in host_blocks(_stage_timeline(False), sync=False)[0])
    assert any(b.sync for _, b in host_blocks(_stage_timeline(True), sync=False)[0])


def test_decode_under_tp_attention_runs_no_dispatch():
    # the EP group inside the TP group: the step's exposed communication is its TP all-reduces alone
    from moonep_sim.experiments.scenario import Scenario
    from moonep_sim.models import get_model

    m = dataclasses.replace(get_model("olmoe-1b-7b"), name="olmoe-2l", layers=2, moe_layers=2)
    sc = Scenario(routing="gen:model=olmoe-1b-7b,uniform=1,tokens-per-rank=64,seed=3", model=m, cluster=(4, 4),
                  topology="h800-cx7", strategies="alltoall,deepep")
    tp = sc.step("decode", parallel=Parallel(tp=4, ep=4), tokens_per_rank=64)
    dpa = sc.step("decode", parallel=Parallel(dp=4, ep=4, dp_attention=True), tokens_per_rank=16)
    for n, f in tp.figures.items():
        st = f["stages"][0]
        assert st["host_bound_us"] == 0.0                                    # CUDA graphs in serving
        assert f["exposed_comm_us"] == pytest.approx(st["tp_cp_comm_us"], rel=1e-9)
        assert dpa.figures[n]["exposed_comm_us"] > 0                         # DP attention dispatches


def test_prefill_under_a_layout_pays_no_training_host_time():
    """The host timeline is a training framework's (Megatron's launches, autograd, syncs): a serving
    prefill under a layout keeps the cost model's own launch costs, so its stages carry no
    ``host_bound_us``, while the same layout in training does."""
    from moonep_sim.experiments.scenario import Scenario
    from moonep_sim.models import get_model

    m = dataclasses.replace(get_model("olmoe-1b-7b"), name="olmoe-2l", layers=2, moe_layers=2)
    sc = Scenario(routing="gen:model=olmoe-1b-7b,uniform=1,tokens-per-rank=64,seed=3", model=m, cluster=(4, 4),
                  topology="h800-cx7", strategies="alltoall")
    pre = sc.step("prefill", parallel=Parallel(tp=2, dp=2, ep=2), tokens_per_rank=64, context=64)
    train = sc.step("train", parallel=Parallel(tp=2, dp=2, ep=2), context=64)
    assert all(st["host_bound_us"] == 0.0 for f in pre.figures.values() for st in f["stages"])
    assert any(st["host_bound_us"] > 0.0 for f in train.figures.values() for st in f["stages"])
