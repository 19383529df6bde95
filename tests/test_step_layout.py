"""The step under a parallel layout (moonep_sim.step.layout_step, experiments.layout): closed forms
against today's step, the ring/link formulas, memory shards and bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.experiments.scenario import Scenario
from moonep_sim.models import get_model
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import collectives as coll
from moonep_sim.step.host import host_launch_cost
from moonep_sim.step.layout_step import (GRAD_BUFFER_ZERO_BYTES_PER_PARAM, GRAD_NORM_BYTES_PER_PARAM,
                                         OPTIMIZER_BYTES_PER_PARAM, chunk_params, stage_model, tp_comm_us)
from moonep_sim.step.parallel import Parallel
from moonep_sim.step.stack import StepShape

GEN = "gen:model=olmoe-1b-7b,maxvio=0.5,tokens-per-rank=128,seed=3"


def _model(layers: int):
    m = get_model("olmoe-1b-7b")
    return dataclasses.replace(m, name=f"olmoe-{layers}l", layers=layers, moe_layers=layers)


def _sc(ranks: int, layers: int = 1, G: int = 8):
    return Scenario(routing=GEN, model=_model(layers), cluster=(ranks, min(G, ranks)), topology="h800-cx7",
                    strategies="alltoall,moonep")


def test_ring_and_link_formulas():
    topo = load_topology("h800-cx7")
    nv, ni = coll.nvlink(topo), coll.nic(topo)
    S = 64e6
    assert coll.all_reduce_us(S, 8, nv, algorithm="ring") == pytest.approx(2 * 7 / 8 * S / nv.bytes_per_us + 14 * nv.latency_us)
    assert coll.reduce_scatter_us(S, 4, ni, algorithm="ring") == pytest.approx(3 / 4 * S / ni.bytes_per_us + 3 * ni.latency_us)
    assert coll.all_gather_us(S, 4, ni, "ring") == coll.reduce_scatter_us(S, 4, ni, "ring")
    assert coll.send_us(S, ni) == pytest.approx(S / ni.bytes_per_us + ni.latency_us)
    assert coll.all_reduce_us(S, 1, nv) == 0.0
    assert nv.bytes_per_us == topo.nvlink_bandwidth_GBps * topo.nvlink_efficiency * 1e3
    # a TP group of 8 consecutive ranks stays in the node; a DP group 8 apart leaves it
    assert coll.group_link(topo, 8, 1).name == "nvlink"
    assert coll.group_link(topo, 2, 8).name == "nic"
    # stages of 4 ranks on 8-GPU nodes: boundary 0 inside node 0, boundary 1 crosses to node 1, boundary 2 inside node 1
    assert [lk.name for lk in coll.stage_boundary_links(topo, 4, 4)] == ["nvlink", "nic", "nvlink"]


def test_tp_collectives_per_layer():
    topo = load_topology("h800-cx7")
    m = get_model("qwen3-30b-a3b")
    shape = StepShape("train", 512, 4096)
    p = Parallel(tp=4, dp=2, ep=8)
    f, b = tp_comm_us(m, 0, 3, p, shape, topo, 2048, 8)
    one = coll.all_reduce_us(2048 * m.hidden * 2, 4, coll.nvlink(topo), span=coll.group_shape(topo, 4))
    assert (f, b) == pytest.approx((2 * 3 * one, 2 * 3 * one))
    sp = Parallel(tp=4, dp=2, ep=8, sequence_parallel=True)
    f2, _ = tp_comm_us(m, 0, 3, sp, shape, topo, 2048, 8)
    rs = coll.reduce_scatter_us(2048 * m.hidden * 2, 4, coll.nvlink(topo), span=coll.group_shape(topo, 4))
    assert f2 == pytest.approx(2 * 3 * 2 * rs)


def test_stage_model_keeps_kinds_and_params_add_up():
    m = get_model("deepseek-v3")
    sub = stage_model(m, 2, 6)
    assert (sub.layers, sub.moe_layers, sub.dense_layers) == (4, 3, 1)
    assert [sub.attention_kind(i) for i in range(4)] == [m.attention_kind(l) for l in range(2, 6)]
    p = Parallel(pp=4)
    bounds, a = [], 0
    for n in p.stage_layers(m.layers):
        bounds.append((a, a + n))
        a += n
    whole = chunk_params(m, 0, m.layers, True, True)
    parts = [chunk_params(m, a, b, a == 0, b == m.layers) for a, b in bounds]
    assert sum(x[0] for x in parts) == pytest.approx(whole[0])
    assert sum(x[1] for x in parts) == pytest.approx(whole[1])


def test_one_moe_layer_without_tp_pp_dp_is_todays_step():
    # today's step does not model the host's launches: with them free the layout step is today's step
    # exactly, and with them priced it adds the host timeline's excess (moonep_sim.step.host) and nothing else
    sc = _sc(1)
    today = sc.step("train", tokens_per_rank=128, context=128)
    with host_launch_cost(0.0):
        lay = sc.step("train", parallel=Parallel(), context=128)
    host = sc.step("train", parallel=Parallel(), context=128)
    for n in today.figures:
        f = lay.figures[n]
        assert f["pipeline_ranks"][0]["pipeline_end_us"] == pytest.approx(today.figures[n]["step_time_us"], rel=1e-12)
        assert f["stages"][0]["host_bound_us"] == 0.0
        h = host.figures[n]
        assert h["stages"][0]["host_bound_us"] > 0   # 128 tokens: short kernels, the host's launches bind
        assert h["pipeline_ranks"][0]["pipeline_end_us"] == pytest.approx(
            today.figures[n]["step_time_us"] + h["stages"][0]["host_bound_us"], rel=1e-12)
        dense, expert = chunk_params(_model(1), 0, 1, True, True)
        topo = load_topology("h800-cx7")
        # Adam over the shard (all of it, dp 1), the gradient norm's read of it, the gradient buffer zeroed
        opt = (dense + expert) * (OPTIMIZER_BYTES_PER_PARAM + GRAD_NORM_BYTES_PER_PARAM + GRAD_BUFFER_ZERO_BYTES_PER_PARAM) \
            / (topo.gpu_mem_bandwidth_GBps * topo.gpu_mem_efficiency * 1e3)
        assert f["step_time_us"] == pytest.approx(today.figures[n]["step_time_us"] + opt, rel=1e-12)
        assert f["pipeline"]["bubble_fraction"] == 0.0


def test_pure_ep_layout_is_todays_step_plus_dp_and_optimizer():
    sc = _sc(4, layers=2)
    today = sc.step("train", tokens_per_rank=128, context=128)
    with host_launch_cost(0.0):   # today's step has no host timeline
        lay = sc.step("train", parallel=Parallel(dp=4, ep=4), context=128)
    topo = load_topology("h800-cx7")
    dense, expert = chunk_params(_model(2), 0, 2, True, True)
    link, span = coll.group_link(topo, 4, 1), coll.group_shape(topo, 4, 1)
    grad = coll.reduce_scatter_us(dense * 4, 4, link, span=span)
    gather = coll.all_gather_us(dense * 2, 4, link, span=span)
    opt = ((dense / 4 + expert / 4) * (OPTIMIZER_BYTES_PER_PARAM + GRAD_NORM_BYTES_PER_PARAM)
           + (dense + expert / 4) * GRAD_BUFFER_ZERO_BYTES_PER_PARAM) / (topo.gpu_mem_bandwidth_GBps * topo.gpu_mem_efficiency * 1e3)
    for n in today.figures:
        r0 = lay.figures[n]["pipeline_ranks"][0]
        assert r0["pipeline_end_us"] == pytest.approx(today.figures[n]["step_time_us"], rel=1e-12)
        assert (r0["dp_grad_us"], r0["param_gather_us"], r0["optimizer_us"]) == pytest.approx((grad, gather, opt))
    assert lay.to_dict()["setup"]["layout"] == "DP4 EP4"


def test_pipeline_layout_runs_and_zero_shards_memory():
    sc = _sc(8, layers=4)
    p0 = Parallel(pp=2, dp=4, ep=4, zero=0, global_batch_size=16)
    p1 = dataclasses.replace(p0, zero=1)
    r0 = sc.step("train", parallel=p0, context=128, distinct_layers=1)
    r1 = sc.step("train", parallel=p1, context=128, distinct_layers=1)
    for n in r0.figures:
        f0, f1 = r0.figures[n], r1.figures[n]
        assert f0["pipeline"]["micro_batches"] == 4 and len(f0["stages"]) == 2
        assert f0["memory"]["parts"]["optimizer"] > f1["memory"]["parts"]["optimizer"]
        # 1F1B keeps pp = 2 micro-batches alive on the first stage, 1 on the last
        assert f0["pipeline_ranks"][0]["pipeline_end_us"] > 0
        assert f0["tokens_per_step"] == 16 * 128
        # weights, gradients and optimizer state alone: a lower bound known before any simulation
        from moonep_sim.step import MemoryOptions, step_shape
        from moonep_sim.step.layout_step import static_memory_bytes
        st = static_memory_bytes(_model(4), p0, step_shape(_model(4), "train", 128, 128), MemoryOptions())
        parts = f0["memory"]["parts"]
        assert st == pytest.approx(parts["weights"] + parts["gradients"] + parts["optimizer"], rel=0.01)
        assert st < f0["peak_memory_bytes"]


@pytest.mark.parametrize("kw, match", [
    (dict(parallel=Parallel(tp=2, dp=2, ep=4)), r"tp x cp x dp x pp \(2 x 1 x 2 x 1 = 4\) must equal the GPUs \(8\)"),
    (dict(parallel=Parallel(pp=16, dp=1)), r"tp x cp x dp x pp"),
    (dict(parallel=Parallel(dp=8, ep=8), tokens_per_rank=64), r"tokens per rank \(64\) is set by the layout"),
    (dict(parallel=Parallel(pp=8)), r"pp x vpp \(8 x 1 = 8\) must be <= the layers \(4"),
    (dict(parallel=Parallel(dp=8, ep=8), context=100, mode="prefill"), r"tokens per rank \(128\) must be a multiple"),
])
def test_bad_layouts_are_one_line(kw, match):
    sc = _sc(8, layers=4)
    mode = kw.pop("mode", "train")
    if mode == "prefill":
        kw["parallel"] = Parallel(tp=8, dp=1, ep=8)
        kw["tokens_per_rank"] = 100
        match = r"tokens per rank \(100\) must be a multiple of tp x cp \(8 x 1\)"
    with pytest.raises(ConfigError, match=match):
        sc.step(mode, **kw)


def _v2lite(layers: int):
    m = get_model("deepseek-v2-lite")
    return dataclasses.replace(m, name=f"v2lite-{layers}l", layers=layers, moe_layers=layers - 1)


def test_a_stage_of_dense_layers_only():
    # deepseek-v2-lite's first layer is dense; a first stage of just that layer runs beside an MoE layer, less it
    sc = Scenario(routing="gen:model=deepseek-v2-lite,maxvio=2,tokens-per-rank=64", model=_v2lite(3), cluster=(4, 4),
                  topology="h800-cx7", strategies="alltoall")
    p = Parallel(pp=2, dp=2, ep=2, first_stage_layers=1, global_batch_size=4)
    f = sc.step("train", parallel=p, context=64).figures["alltoall"]
    assert [s["layers"] for s in f["stages"]] == [[0, 1], [1, 3]]
    assert 0 < f["stages"][0]["forward_us"] < f["stages"][1]["forward_us"]
    assert f["memory_per_pp_rank"][0] > 0


@pytest.mark.slow
def test_search_ranks_fitting_layouts():
    from moonep_sim.experiments.layout_search import enumerate_layouts

    m = _model(4)
    lays = enumerate_layouts(m, 8, 8, "train", seq=2048)
    # every valid layout multiplies to the GPUs, and pp, ep, tp divide what they split
    assert lays and all(p.world == 8 and m.num_experts % p.ep == 0 and m.heads % p.tp == 0 for p in lays)
    assert {(p.tp, p.pp) for p in lays} >= {(1, 1), (2, 2), (8, 1), (1, 4)}
    rep = _sc(8, layers=4).search_layouts(8, "train", seq=2048, top=3, zeros=(1,))
    assert rep["valid"] == len(lays)
    for rows in rep["ranked"].values():
        assert len(rows) == 3
        fits = [r["fits"] for r in rows]
        assert fits == sorted(fits, reverse=True)
        ok = [r["tokens_per_s_per_gpu"] for r in rows if r["fits"]]
        assert ok == sorted(ok, reverse=True)


@pytest.mark.slow
def test_search_price_matches_the_layout_step_on_one_routing():
    # priced from one layer per kind vs the full step with every MoE layer on the same routing: same figures
    sc = _sc(8, layers=4)
    p = Parallel(tp=2, pp=2, dp=2, ep=4, global_batch_size=8)
    full = sc.step("train", parallel=p, context=2048, distinct_layers=1).figures
    rep = sc.search_layouts(8, "train", seq=2048, top=100, zeros=(1,))
    row = {(r["strategy"], r["layout"]): r for r in rep["rows"]}
    for n, f in full.items():
        r = row[(n, "TP2 PP2 DP2 EP4 1f1b ZeRO1")]
        assert r["step_time_us"] == pytest.approx(f["step_time_us"], rel=0.02)
        assert r["peak_memory_bytes"] == pytest.approx(f["peak_memory_bytes"], rel=0.02)


def test_a_tp_or_cp_share_of_whole_sequences_attends_their_causal_mean():
    from moonep_sim.step.stack import StepShape as Shape

    assert Shape("train", 512, 4096, shards=8).attended() == pytest.approx(4097 / 2)
    assert Shape("train", 512, 4096).attended() == pytest.approx(4096 - 512 + 513 / 2)   # a chunk ending a prompt
    assert Shape("train", 4096, 4096, shards=1).attended() == Shape("train", 4096, 4096).attended()


def test_cp_ring_passes_each_chunk_around_the_ring():
    topo = load_topology("h800-cx7")
    m = get_model("qwen3-30b-a3b")          # gqa: 4 KV heads of 128
    p = Parallel(cp=4, dp=2, ep=8)
    f, b = tp_comm_us(m, 0, 2, p, StepShape("train", 1024, 4096, shards=4), topo, 1024, 8)
    kv = 1024 * 2 * 4 * 128 * 2              # the rank's 1024 tokens' K and V, bf16
    one = coll.send_us(kv, coll.nvlink(topo))
    assert (f, b) == pytest.approx((2 * 3 * one, 2 * 2 * 3 * one))   # 2 layers, cp-1 = 3 passes, twice backward
    k3 = get_model("kimi-k3")                 # layer 3 gated MLA (its latent, whole on every TP rank), 4 KDA
    f, b = tp_comm_us(k3, 3, 5, p, StepShape("train", 1024, 4096, shards=4), topo, 1024, 8)
    one = coll.send_us(1024 * (512 + 64) * 2, coll.nvlink(topo))   # a KDA layer's fixed state does not travel
    assert (f, b) == pytest.approx((3 * one, 2 * 3 * one))


def test_pp_send_is_the_link_formula():
    # 16 GPUs, stages of 8 (TP2 DP4): the boundary crosses from node 0 to node 1 over the NIC
    sc = _sc(16, layers=2)
    p = Parallel(tp=2, pp=2, dp=4, ep=8, global_batch_size=4)
    f = sc.step("train", parallel=p, context=2048, distinct_layers=1).figures["alltoall"]
    topo = load_topology("h800-cx7")
    act = 2048 * get_model("olmoe-1b-7b").hidden * 2          # one micro-batch: the TP group's 2048 tokens, bf16
    assert f["pp_send_links"] == ["nic"]
    assert f["pp_send_us"] == [pytest.approx(coll.send_us(act, coll.nic(topo)))]


def test_decode_with_attention_dp_is_todays_decode_step():
    sc = _sc(8, layers=2)
    today = sc.step("decode", tokens_per_rank=64)
    lay = sc.step("decode", parallel=Parallel(dp=8, ep=8, dp_attention=True), tokens_per_rank=64)
    for n, f in today.figures.items():
        assert lay.figures[n]["step_time_us"] == pytest.approx(f["step_time_us"], rel=1e-12)
        assert lay.figures[n]["tokens_per_step"] == 8 * 64


def test_zero3_gathers_hide_behind_compute():
    sc = _sc(8, layers=2)
    p = Parallel(dp=8, ep=8, zero=3, global_batch_size=16)
    f = sc.step("train", parallel=p, context=1024, distinct_layers=1).figures["alltoall"]
    r0 = f["pipeline_ranks"][0]
    topo = load_topology("h800-cx7")
    dense, expert = chunk_params(_model(2), 0, 2, True, True)
    ag = coll.all_gather_us(dense * 2, 8, coll.nvlink(topo), span=coll.group_shape(topo, 8)) + 0.0   # experts: edp = 1, no gather
    assert r0["zero3_gather_us"] == pytest.approx(2 * 2 * ag)        # 2 micro-batches, forward and backward
    busy = f["pipeline"]["busy_us"][0]
    assert r0["zero3_gather_exposed_us"] == pytest.approx(max(2 * 2 * ag - busy, 0.0))
    assert r0["param_gather_us"] == 0.0


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_decode_gemms_read_their_weight_shard(tp):
    """A TP rank's decode GEMMs run the TP group's rows through 1/tp of the weight: the FLOPs of the
    rank's share, 1/tp of the weight bytes, so a memory-bound decode GEMM takes 1/tp of the time."""
    from moonep_sim.step.costs import CostModel
    from moonep_sim.step.stack import head_ops, layer_ops, step_shape

    m = get_model("deepseek-v3")
    one = step_shape(m, "decode", 8, 4096)                      # 8 sequences, no TP
    split = dataclasses.replace(one, shards=tp, tp=tp)          # a TP rank's 8-sequence share of 8 x tp
    costs = CostModel(load_topology("h800-cx7"))
    dense, moe = layer_ops(m, 0, one), layer_ops(m, m.dense_layers, one)
    dense_t, moe_t = layer_ops(m, 0, split), layer_ops(m, m.dense_layers, split)
    pairs = [(a, b) for a, b in zip(dense.before + moe.before, dense_t.before + moe_t.before) if a.kind == "gemm"]
    pairs += [(moe.shared, moe_t.shared), (head_ops(m, one)[1][0], head_ops(m, split)[1][0])]
    names = {a.name for a, _ in pairs}
    assert {"attn_proj", "dense_ffn", "shared_expert", "lm_head"} <= names
    for a, b in pairs:
        if a.name == "latent_proj":
            continue
        assert b.flops == pytest.approx(a.flops) and b.rows == a.rows * tp
        assert b.bytes == pytest.approx(a.bytes / tp, rel=1e-6)
        # memory-bound at these rows: the roofline is the shard's bytes over the GEMM's bandwidth
        assert costs.roofline_op_us(a) == pytest.approx(a.bytes / costs.gemm_mem_bytes_per_us)
        assert costs.roofline_op_us(b) == pytest.approx(costs.roofline_op_us(a) / tp, rel=1e-6)
    # the router stays on the rank's own tokens (replicated weight): unchanged
    assert moe_t.router == moe.router


def test_attention_dp_waits_for_the_rank_with_the_longest_context():
    """Data-parallel attention in decode: each rank's attention core at its own context; the MoE
    dispatch (a collective) starts once the slowest rank is ready. One rank with twice the context:
    its attention takes that context's time, every rank's first dispatch starts when it is ready --
    as if every rank had the long context -- and the step lies between all-short and all-long."""
    from moonep_sim.experiments.step import layer_source
    from moonep_sim.step import MemoryOptions, StepConfig, simulate_step
    from moonep_sim.step.costs import step_cost_model
    from moonep_sim.step.stack import layer_ops, step_shape

    sc = _sc(8, layers=2)
    rs = sc.resolved
    m = _model(2)
    short, long_ = 2048, 4096
    costs = step_cost_model(load_topology("h800-cx7"), "bf16", mode="decode")
    core = {c: costs.op_us(next(o for o in layer_ops(m, 0, step_shape(m, "decode", 64, c)).before
                                if o.kind == "attention")) for c in (short, long_)}
    assert core[long_] > core[short]

    def timelines(cs):
        shape = dataclasses.replace(step_shape(m, "decode", 64, max(cs)), contexts=tuple(cs))
        cfg = StepConfig(m, rs.topology, rs.ctx, rs.strategies, shape, "none", costs, MemoryOptions(), {})
        return simulate_step(cfg, layer_source(rs.source, 8, 64, m.moe_layers, 1), None, None, False)["_timelines"]

    mixed, alllong = timelines([short] * 7 + [long_]), timelines([long_] * 8)
    for n, tl in mixed.items():
        att = [e for e in tl.events if e.name == "attn_core" and e.layer == 0][0]
        assert att.end_R[7] - att.start_R[7] == pytest.approx(core[long_])
        assert att.end_R[0] - att.start_R[0] == pytest.approx(core[short])
        d_mixed = [e for e in tl.events if e.name == "dispatch" and e.layer == 0][0]
        d_long = [e for e in alllong[n].events if e.name == "dispatch" and e.layer == 0][0]
        assert d_mixed.start_R == pytest.approx(np.full(8, d_long.start_R[0]))
        assert d_mixed.start_R[0] >= att.end_R[7]
    # the layout step under attention-DP takes them per EP rank
    p = Parallel(dp=8, ep=8, dp_attention=True)
    step = {k: sc.step("decode", parallel=p, tokens_per_rank=64, contexts_R=cs, distinct_layers=1).figures
            for k, cs in (("mixed", [short] * 7 + [long_]), ("short", [short] * 8), ("long", [long_] * 8))}
    for n, f in step["mixed"].items():
        assert step["short"][n]["step_time_us"] < f["step_time_us"] <= step["long"][n]["step_time_us"] + 1e-9
    with pytest.raises(ConfigError, match=r"contexts per rank \(3 given, least 1\) must be one >= 1 per rank"):
        sc.step("decode", parallel=p, tokens_per_rank=64, contexts_R=[1, 2, 3])
    with pytest.raises(ConfigError, match=r"need a decode step under data-parallel attention"):
        sc.step("decode", parallel=Parallel(dp=8, ep=8), tokens_per_rank=64, contexts_R=[short] * 8)


def test_mtp_under_attention_dp_is_todays_mtp_decode_step():
    # one EP group, attention data-parallel, no TP / PP: the layout's MTP decode step is today's
    sc = _sc(8, layers=2)
    today = sc.step("decode", tokens_per_rank=64, mtp_depth=1, mtp_acceptance=0.7)
    lay = sc.step("decode", parallel=Parallel(dp=8, ep=8, dp_attention=True), tokens_per_rank=64, mtp_depth=1,
                  mtp_acceptance=0.7)
    assert lay.setup["mtp"]["tokens_per_step"] == pytest.approx(1.7)
    for n, f in today.figures.items():
        g = lay.figures[n]
        assert g["mtp"]["draft_layer_us"] == pytest.approx(f["mtp"]["draft_layer_us"], rel=1e-12)
        assert g["step_time_us"] == pytest.approx(f["step_time_us"], rel=1e-12)
        assert g["tokens_per_s_per_gpu"] == pytest.approx(f["tokens_per_s_per_gpu"], rel=1e-12)
        assert g["peak_memory_bytes"] - lay.figures[n]["mtp"]["draft_weight_bytes"] > 0
    with pytest.raises(ConfigError, match=r"--mtp-depth \(1\) needs --mode decode"):
        sc.step("train", parallel=Parallel(dp=8, ep=8, global_batch_size=8), context=128, mtp_depth=1)


def test_ep_a2a_overlap_runs_megatrons_combined_1f1b():
    # the flag swaps the interleaved pipeline for the combined 1F1B (its order: tests/test_step_pipeline.py)
    sc = _sc(8, layers=4)
    off = Parallel(pp=2, vpp=2, pp_schedule="interleaved", dp=4, ep=4, global_batch_size=16)
    on = dataclasses.replace(off, overlap_moe_expert_parallel_comm=True)
    with host_launch_cost(0.0):
        r0 = sc.step("train", parallel=off, context=128, distinct_layers=1)
        r1 = sc.step("train", parallel=on, context=128, distinct_layers=1)
    for n in r0.figures:
        f0, f1 = r0.figures[n], r1.figures[n]
        assert f0["pipeline"]["schedule"] == "interleaved" and f1["pipeline"]["schedule"] == "combined-1f1b"
        assert f1["step_time_us"] <= f0["step_time_us"] + 1e-6
        assert f1["pipeline"]["makespan_us"] <= f0["pipeline"]["makespan_us"] + 1e-6
        # the stage programs are the same: the overlap only reorders and pairs them
        assert [s["forward_us"] for s in f1["stages"]] == [s["forward_us"] for s in f0["stages"]]
    assert r1.setup["parallel"]["overlap_moe_expert_parallel_comm"] is True
