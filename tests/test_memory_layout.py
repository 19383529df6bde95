"""The memory account under a parallel layout: Korthikanti et al.'s closed forms, hand counts of
every part under every ZeRO stage and pipeline schedule, the published DeepSeek-V3 layout, and the
smallest change that fits."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.models import ModelSpec, get_model
from moonep_sim.step.activations import (ActivationOptions, chunks_in_flight, full_recompute_saved, layer_saved,
                                         routed_row_saved)
from moonep_sim.step.dtypes import check_supported, get_dtype
from moonep_sim.step.memory import (MemoryOptions, PlanFootprint, deepep_ll_buffer_bytes, deepep_normal_buffer_bytes,
                                    memory_for_layout, memory_per_rank)
from moonep_sim.step.memory_fit import smallest_fit
from moonep_sim.step.parallel import Parallel, pure_ep
from moonep_sim.step.stack import attention_params, step_shape

GiB = 2**30
# one dense MHA layer of Korthikanti et al.'s form (a = 16 heads, h = 1024, 4h MLP) + one MoE layer
H, A = 1024, 16
GPT = ModelSpec("gpt", 2, 1, 8, 2, 0, H, 256, attention="gqa", heads=A, kv_heads=A, head_dim=H // A,
                vocab=1000, dense_ffn=4 * H)
PAPER = ActivationOptions(flash=False, dropout=True, ffn="gelu")
SMALL = ModelSpec("small", 4, 3, 8, 2, 1, 256, 128, attention="gqa", heads=4, kv_heads=2, head_dim=64,
                  vocab=1000, dense_ffn=512)


@pytest.mark.parametrize("s", [512, 2048])
def test_a_dense_layer_is_korthikantis_34sbh_plus_5as2b(s):
    per_tok = layer_saved(GPT, 0, s, PAPER)
    assert per_tok.per_rank(1, False) * s == 34 * s * H + 5 * A * s * s
    for t in (2, 4, 8):
        assert per_tok.per_rank(t, False) * s == pytest.approx(s * H * (10 + 24 / t + 5 * A * s / (H * t)))
        assert per_tok.per_rank(t, True) * s == pytest.approx(s * H / t * (34 + 5 * A * s / H))
        sel = layer_saved(GPT, 0, s, dataclasses.replace(PAPER, recompute="selective", modules=("core_attn",)))
        assert sel.per_rank(t, True) * s == pytest.approx(34 * s * H / t)
    assert full_recompute_saved(GPT).per_rank(1, False) * s == 2 * s * H


def test_gqa_and_flash_change_only_their_tensors():
    g = dataclasses.replace(GPT, kv_heads=4)
    s = 1024
    # k and v shrink from 2h to 2 h kv/a bytes per token each
    assert (layer_saved(GPT, 0, s, PAPER).tp - layer_saved(g, 0, s, PAPER).tp) == 2 * 2 * H * (1 - 4 / A)
    flash = dataclasses.replace(PAPER, flash=True)
    assert layer_saved(GPT, 0, s, PAPER).tp - layer_saved(GPT, 0, s, flash).tp == 5 * A * s - 4 * A
    # fp8 GEMMs save their inputs in fp8 (1 + 4/128 bytes): the four GEMM inputs of the dense layer
    f8 = dataclasses.replace(PAPER, gemm_bytes=1 + 4 / 128)
    diff = layer_saved(GPT, 0, s, PAPER) .per_rank(1, False) - layer_saved(GPT, 0, s, f8).per_rank(1, False)
    assert diff == pytest.approx((H + H + H + 4 * H) * (2 - (1 + 4 / 128)))


def test_mla_up_projection_recompute_keeps_only_the_latents():
    m = get_model("deepseek-v3")
    base = ActivationOptions()
    up = ActivationOptions(recompute="selective", modules=("mla_up_proj",))
    n, dqk, dv = m.heads, m.head_dim + m.qk_rope_dim, m.v_head_dim
    assert layer_saved(m, 5, 4096, base).tp - layer_saved(m, 5, 4096, up).tp == n * (2 * dqk + dv) * 2
    assert layer_saved(m, 5, 4096, up).rep == (m.q_lora_rank + m.kv_lora_rank) * 2 + m.qk_rope_dim * 2
    # a routed row: its D-wide input and the SwiGLU's gate, up and product
    assert routed_row_saved(m, base) == (m.dispatch_hidden + 3 * m.expert_ffn) * 2


@given(p=st.integers(1, 8), m=st.integers(1, 40))
@settings(max_examples=40, deadline=None)
def test_1f1b_keeps_pp_minus_rank_micro_batches(p, m):
    for r in range(p):
        assert chunks_in_flight("1f1b", p, 1, r, m) == [r] * min(p - r, m)


@given(p=st.integers(2, 8), v=st.integers(2, 4), k=st.integers(1, 6))
@settings(max_examples=40, deadline=None)
def test_interleaved_first_rank_holds_korthikantis_share(p, v, k):
    m = k * p + 2 * p * v  # enough micro-batches for the warm-up
    alive = chunks_in_flight("interleaved", p, v, 0, m)
    # every chunk of L / (p v) layers: L (1 + (p - 1) / (p v)) layer-micro-batches on the first rank
    per_chunk = 1.0
    L = p * v * per_chunk
    assert len(alive) * per_chunk == pytest.approx(L * (1 + (p - 1) / (p * v)))
    assert all(c % p == 0 for c in alive)  # rank 0's chunks


def test_dualpipe_keeps_pp_plus_one_over_its_two_chunks():
    assert sorted(chunks_in_flight("dualpipe", 8, 1, 2, 100)) == sorted([2] * 5 + [5] * 4)
    assert len(chunks_in_flight("dualpipe", 16, 1, 0, 100)) == 17


def _fp(ep, slots, rows):
    import numpy as np

    return PlanFootprint(np.full(ep, float(slots)), np.zeros(ep), None, np.full(ep, float(rows)), 10, False)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved", 2), ("dualpipe", 1)])
def test_every_part_by_hand_under_every_zero_stage_and_schedule(zero, schedule, vpp):
    m = SMALL
    par = Parallel(tp=2, pp=2, vpp=vpp, dp=4, ep=4, zero=zero, pp_schedule=schedule, sequence_parallel=True,
                   global_batch_size=32)
    T = 64
    shape = step_shape(m, "train", T, None)
    rows = 50
    mem = memory_for_layout(m, shape, par, [_fp(4, 2, rows)])
    H_, D, F, V = m.hidden, m.dispatch_hidden, m.expert_ffn, m.vocab
    counts = par.stage_layers(m.layers)
    off = [0, *__import__("itertools").accumulate(counts)]
    edp = par.edp
    assert edp == 2
    for s in range(2):
        chunks = [s, 1 - s] if schedule == "dualpipe" else [s + c * 2 for c in range(vpp)]
        layers = [l for c in chunks for l in range(off[c], off[c + 1])]
        moe = sum(l >= 1 for l in layers)
        embed, head = 0 in chunks, (len(counts) - 1) in chunks
        dense_p = 0.0
        for l in layers:
            dense_p += attention_params(m, "gqa") / 2 + 2 * H_
            dense_p += 3 * H_ * m.dense_ffn / 2 if l == 0 else 3 * H_ * F / 2 + H_ * 8
        dense_p += V * H_ / 2 * (embed + head)
        exp_p = 2 * moe * 3 * D * F
        g = 4 if zero >= 3 else 1
        eg = 2 if zero >= 3 else 1
        w = dense_p * 2 / g + exp_p * 2 / eg
        if zero >= 3:  # the largest layer gathered whole, and one layer's experts
            big = max((attention_params(m, "gqa") / 2 + 2 * H_
                       + (3 * H_ * m.dense_ffn / 2 if l == 0 else 3 * H_ * F / 2 + H_ * 8)) * 2 for l in layers)
            w += big + (2 * 3 * D * F * 2 if moe else 0)
        st_ = mem["stages"][s]
        assert st_["parts"]["weights"] == pytest.approx(w), (s, zero)
        grad_div, egrad = (4, 2) if zero >= 2 else (1, 1)
        assert st_["parts"]["gradients"] == pytest.approx(dense_p * 4 / grad_div + exp_p * 4 / egrad)
        opt_div, eopt = (4, 2) if zero >= 1 else (1, 1)
        assert st_["parts"]["optimizer"] == pytest.approx(dense_p * 12 / opt_div + exp_p * 12 / eopt)
        # activations: the schedule's chunks alive, each layer's saved tensors (SP over tp 2) + rows
        alive = chunks_in_flight(schedule, 2, vpp, s, par.micro_batches)
        opts = MemoryOptions().activations()
        act = 0.0
        n_moe = 0
        for c in alive:
            for l in range(off[c], off[c + 1]):
                act += layer_saved(m, l, shape.attended(), opts).per_rank(2, True) * T
                n_moe += l >= 1
        act += rows * routed_row_saved(m, opts) * n_moe + (T * V * 4 / 2 if head else 0)
        assert st_["parts"]["activations"] == pytest.approx(act)
        assert st_["parts"]["buffers"] == pytest.approx(rows * 10 + 4 * T * H_ * 2 / 2)


def test_pure_ep_is_the_default_account():
    m = SMALL
    shape = step_shape(m, "decode", 16, 512)
    a = memory_per_rank(m, shape, [_fp(4, 2, 30)], 4)
    b = memory_for_layout(m, shape, pure_ep(4), [_fp(4, 2, 30)])
    assert a["peak_bytes"] == b["peak_bytes"] and a["parts"] == b["parts"]
    # KV: 16 sequences x 512 keys x (K and V of 2 heads x 64) x bf16, every layer; fp8 halves it (+ scales)
    assert a["parts"]["kv_cache"] == 4 * 16 * 512 * 2 * 2 * 64 * 2
    c = memory_per_rank(m, shape, [_fp(4, 2, 30)], 4, MemoryOptions(kv_dtype="fp8"))
    assert c["parts"]["kv_cache"] == pytest.approx(a["parts"]["kv_cache"] / 2 * (1 + 4 / 128))


def test_weight_dtype_prices_the_stored_bytes_with_their_scales():
    assert get_dtype("fp8").weight_bytes == 1 + 4 / 16384
    assert get_dtype("mxfp4").weight_bytes == 0.5 + 1 / 32
    assert get_dtype("fp4").weight_bytes == get_dtype("nvfp4").weight_bytes == 0.5 + 1 / 16
    m = SMALL
    shape = step_shape(m, "decode", 8, 128)
    a = memory_per_rank(m, shape, [_fp(4, 2, 30)], 4)["parts"]["weights"]
    b = memory_per_rank(m, shape, [_fp(4, 2, 30)], 4, MemoryOptions(weight_dtype="fp8"))["parts"]["weights"]
    gemm = sum(attention_params(m, "gqa") for _ in range(4)) + 3 * 256 * 512 + 3 * 3 * 256 * 128 \
        + 3 * 2 * 3 * 256 * 128 + 1000 * 256  # attention, dense FFN, shared experts, home experts, head
    assert a - b == pytest.approx(gemm * (2 - (1 + 4 / 16384)))


def test_a_dtype_the_gpu_lacks_is_one_line():
    from moonep_sim.sim.topology import load_topology

    with pytest.raises(ConfigError, match=r"weight dtype \(nvfp4\) needs FP4 support: topology h800-cx7"):
        check_supported(get_dtype("fp4"), load_topology("h800-cx7"), "weight dtype")
    assert check_supported(get_dtype("fp4"), load_topology("b200")).name == "nvfp4"
    with pytest.raises(ConfigError, match=r"weight dtype \('int3'\) must be one of"):
        MemoryOptions(weight_dtype="int3")
    with pytest.raises(ConfigError, match=r"recompute \('some'\) must be one of none, selective, full"):
        MemoryOptions(recompute="some")


def test_deepep_buffers_follow_its_config():
    # EP8, one node: NVLink only; 10 channels x 8 ranks x (2 + 3) ints + 10 x 8 x 256 tokens x per-token bytes
    per_tok = 2 * 7168 + 8 + 128 * 12 + 128 * 4
    nvl = 10 * 8 * 5 * 4 + 10 * 8 * 256 * per_tok
    assert deepep_normal_buffer_bytes(8, 2 * 7168) == (float(-(-nvl // 128) * 128), "")
    b64, note = deepep_normal_buffer_bytes(64, 2 * 7168)
    assert b64 > deepep_normal_buffer_bytes(8, 2 * 7168)[0] and note == ""
    assert "EP72" in deepep_normal_buffer_bytes(72, 2 * 7168)[1]
    # LL: 2 x (send + receive + signalling); receive = experts x max tokens x the larger message
    E, T, h = 256, 128, 7168
    combine = h // 128 * 4 + 2 * h  # bf16 row + per-128 min/max: larger than a dispatch message (16 + 2h)
    sig = -(-(E * 8 + 8 * 4) // 128) * 128
    assert deepep_ll_buffer_bytes(T, h, 32, E) == 2 * (E * T * combine + E * T * combine + sig)


def test_deepseek_v3_published_pretraining_layout_fits_in_80_gb():
    """PP16 DualPipe x EP64 x ZeRO-1 DP on 2048 GPUs, no TP, fp8 GEMMs, bf16 weights with fp32
    master and gradients, bf16 Adam moments (8 B/param of optimizer state), RMSNorm and MLA
    up-projections recomputed and the SwiGLU output recomputed from its cached input (DeepSeek-V3
    report, Sec. 3.2-3.3); one 4096-token sequence per micro-batch (ASSUMED). Capacity: the H800
    topology's 80 GiB, and the 79.6 GiB nvidia-smi reports on an 80 GB card."""
    from moonep_sim.sim.topology import load_topology

    m = get_model("deepseek-v3")
    par = Parallel(pp=16, dp=128, ep=64, zero=1, pp_schedule="dualpipe", global_batch_size=15360).check(2048, m)
    shape = step_shape(m, "train", 4096, None)
    opts = MemoryOptions(gemm_dtype="fp8", optimizer_bytes_per_param=8, recompute="selective",
                         recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
    mem = memory_for_layout(m, shape, par, [], opts)
    assert mem["peak_bytes"] < min(load_topology("h800-cx7").gpu_memory_GiB, 79.6) * GiB
    assert len(mem["stages"]) == 16 and all(s["chunks_alive"] == 17 for s in mem["stages"])
    assert mem["stages"][0]["embedding"] and mem["stages"][0]["head"]  # DualPipe: stages 0 and 15 on rank 0
    # the same layout with bf16 GEMMs, 12-byte Adam and nothing recomputed does not fit
    assert memory_for_layout(m, shape, par, [], MemoryOptions())["peak_bytes"] > 80 * GiB


def test_kimi_k3_layouts_fit_on_h800s():
    m = get_model("kimi-k3")
    cap = 80 * GiB
    # serving: 64 and 256 GPUs, TP attention inside a node, experts EP64 / EP128 (896 experts), fp8
    # weights and KV
    for gpus, ep in ((64, 64), (256, 128)):
        par = Parallel(tp=8, dp=gpus // 8, ep=ep).check(gpus, m)
        mem = memory_for_layout(m, step_shape(m, "decode", 64, 8192), par, [],
                                MemoryOptions(weight_dtype="fp8", kv_dtype="fp8"))
        assert mem["peak_bytes"] < cap, gpus
    # training on 1024: PP16 x EP64 with full recompute
    par = Parallel(pp=16, dp=64, ep=64, global_batch_size=4096).check(1024, m)
    mem = memory_for_layout(m, step_shape(m, "train", 4096, None), par, [], MemoryOptions(recompute="full"))
    assert mem["peak_bytes"] < cap


def test_smallest_fit_is_found_by_rerunning_the_account():
    m = get_model("kimi-k3")
    par = Parallel(pp=16, dp=64, ep=64, global_batch_size=4096)
    shape = step_shape(m, "train", 4096, None)
    cap = 80 * GiB
    assert memory_for_layout(m, shape, par, [], MemoryOptions())["peak_bytes"] > cap
    fit = smallest_fit(m, shape, par, [], MemoryOptions(), cap)
    assert fit is not None and fit["peak_bytes"] <= cap
    again = memory_for_layout(m, shape, Parallel.from_dict(fit["layout"]), [], MemoryOptions(recompute="full"))
    assert fit["change"] == "full recompute" and again["peak_bytes"] == fit["peak_bytes"]
    # 2.7T parameters on 64 GPUs: nothing fits
    assert smallest_fit(m, shape, Parallel(pp=4, dp=16, ep=16, global_batch_size=4096), [], MemoryOptions(), cap) is None


def test_kv_cache_by_tp_and_pipeline_stage_by_hand():
    """GQA K/V heads split over TP (2 KV heads over tp 2: one each), MLA latents replicated, a
    linear layer's fp32 state split over TP; each pipeline stage holds its layers' caches."""
    m = ModelSpec("kv", 4, 3, 8, 2, 0, 256, 128, attention="gqa,mla,linear,gqa", heads=4, kv_heads=2, head_dim=64,
                  kv_lora_rank=32, qk_rope_dim=16, v_head_dim=64, vocab=1000, dense_ffn=512)
    par = Parallel(tp=2, pp=2, dp=2, ep=4)
    shape = step_shape(m, "decode", 8, 512)
    mem = memory_for_layout(m, shape, par, [_fp(4, 2, 8)], MemoryOptions(kv_dtype="fp8"))
    kvb = 1 + 4 / 128
    gqa = 8 * 512 * (2 * 1 * 64) * kvb          # 8 sequences x 512 keys x K and V of one head per TP rank
    mla = 8 * 512 * (32 + 16) * kvb             # the latent and the rope key, whole on every TP rank
    lin = 8 * 4 * 64 * 64 * 4 / 2               # heads x hd x hd fp32 per sequence, over tp
    assert mem["stages"][0]["parts"]["kv_cache"] == pytest.approx(gqa + mla)   # layers 0, 1
    assert mem["stages"][1]["parts"]["kv_cache"] == pytest.approx(lin + gqa)   # layers 2, 3
