"""Attention kinds as records (``moonep_sim.step.attention``): the registry holds exactly the kinds a
model may name, each kind's weights, cache and core op equal the hand counts, and the step's
figures are pinned (the registry replaced branches on the kind's name bit for bit)."""

from __future__ import annotations

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.models import ATTENTION_KINDS, PRESETS, ModelSpec
from moonep_sim.step.attention import ATTENTION, AttentionKind, attention_kind
from moonep_sim.step.stack import StepShape, attention_params, layer_ops, step_shape


def test_the_registry_holds_the_kinds_a_model_may_name():
    assert ATTENTION.names() == ATTENTION_KINDS
    for name in ATTENTION_KINDS:
        k = attention_kind(name)
        assert isinstance(k, AttentionKind) and k.name == name
    assert [n for n in ATTENTION_KINDS if not attention_kind(n).has_op] == ["none"]


def test_an_unknown_kind_is_one_line_naming_the_kinds():
    with pytest.raises(ConfigError) as e:
        attention_kind("swa")
    msg = str(e.value)
    assert "\n" not in msg and "'swa'" in msg and all(k in msg for k in ATTENTION_KINDS)
    with pytest.raises(ConfigError, match="attention kind"):
        ModelSpec("x", 1, 1, 8, 2, 0, 64, 32, attention="gqa,swa", heads=2, head_dim=32)


def test_mla_weights_and_cache_by_hand():
    v3 = PRESETS["deepseek-v3"]  # q_lora 1536, kv_lora 512, nope 128, rope 64, v 128, 128 heads, H 7168
    q = 7168 * 1536 + 1536 * 128 * (128 + 64)
    kv = 7168 * (512 + 64) + 512 * 128 * (128 + 128)
    o = 128 * 128 * 7168
    assert attention_params(v3, "mla") == q + kv + o == 187_105_280
    assert attention_kind("mla").kv_elems_per_token(v3) == 576
    # decode absorbs the up-projections: QK width kv_lora + rope, V width kv_lora
    assert attention_kind("mla").dims(v3, "decode") == (576, 512)
    assert attention_kind("mla").dims(v3, "prefill") == (192, 128)


def test_gqa_sliding_and_linear_by_hand():
    q3 = PRESETS["qwen3-235b"]  # H 4096, 64 heads, 4 KV heads, head_dim 128
    assert attention_params(q3, "gqa") == 4096 * 64 * 128 * 2 + 2 * 4096 * 4 * 128
    assert attention_kind("gqa").kv_elems_per_token(q3) == 2 * 4 * 128
    # decode: 2 x T x n x C x (dqk + dv) FLOPs; q/o once per token, every sequence reads its cache
    T, C = 8, 1000
    op = attention_kind("gqa").core(q3, StepShape("decode", T, C))
    assert op.flops == 2.0 * T * 64 * C * 256
    assert op.bytes == T * 64 * 256 * 2 + T * C * 1024 * 2
    oss = PRESETS["gpt-oss-20b"]  # sliding window 128
    sl = attention_kind("sliding").core(oss, StepShape("decode", T, C))
    assert sl.flops == 2.0 * T * 64 * 128 * 128 and sl.shape == f"tokens={T},context=128,kind=sliding"
    assert attention_kind("sliding").cache_bytes(oss, StepShape("decode", T, C)) == T * 128 * (2 * 8 * 64) * 2
    assert attention_kind("gqa").cache_bytes(oss, StepShape("decode", T, C)) == T * C * (2 * 8 * 64) * 2
    k3 = PRESETS["kimi-k3"]
    lin = attention_kind("linear")
    assert lin.kv_elems_per_token(k3) == 0 and lin.state_bytes(k3) == k3.heads * k3.head_dim ** 2 * 4
    assert lin.cache_bytes(k3, StepShape("decode", T, C)) == T * lin.state_bytes(k3)  # independent of C
    assert lin.core(k3, StepShape("prefill", 64, 64)).flops == 4.0 * 64 * k3.heads * k3.head_dim ** 2


def test_a_layer_of_kind_none_runs_no_attention_op():
    bare = ModelSpec("bare", 1, 1, 8, 2, 0, 64, 32, attention="none")
    lo = layer_ops(bare, 0, step_shape(bare, "prefill", 16, None))
    # only the MoE block's own input cast and router top-k: no norm, projection or core
    assert [o.name for o in lo.before] == ["quantize", "router_topk"] and lo.router is not None
    with pytest.raises(ConfigError, match="decode"):
        step_shape(bare, "decode", 16, None)


def test_tensor_parallel_splits_a_cache_by_its_heads():
    q3, v3, k3 = PRESETS["qwen3-235b"], PRESETS["deepseek-v3"], PRESETS["kimi-k3"]  # 4 KV heads; MLA; 96 KDA heads
    assert [attention_kind("gqa").cache_shards(q3, tp) for tp in (1, 2, 8)] == [1, 2, 4]
    assert attention_kind("sliding").cache_shards(q3, 8) == 4
    assert attention_kind("mla").cache_shards(v3, 8) == attention_kind("gated-mla").cache_shards(k3, 8) == 1
    assert attention_kind("linear").cache_shards(k3, 8) == 8 and attention_kind("none").cache_shards(k3, 8) == 1


def test_tp_past_or_across_the_kv_heads_sizes_every_cache_by_one_rule():
    """8 KV heads of 64 over TP16: each rank holds one head (copies beyond the heads, as vLLM and
    SGLang replicate KV heads), in the serving KV, a layout's memory and its CP ring alike; over TP3
    (3 does not divide 8) each rank holds 8 // 3 = 2 heads."""
    from moonep_sim.serve.deployment import kv_bytes_per_token
    from moonep_sim.sim.topology import load_topology
    from moonep_sim.step import collectives as coll
    from moonep_sim.step.layout_step import tp_comm_us
    from moonep_sim.step.memory import MemoryOptions, memory_for_layout
    from moonep_sim.step.parallel import Parallel

    m = ModelSpec("kv8", 2, 2, 16, 2, 0, 1024, 256, attention="gqa", heads=16, kv_heads=8, head_dim=64,
                  vocab=1000)
    head = 2 * 64 * 2                                          # one head's K and V of one token, bf16
    gqa, lin = attention_kind("gqa"), attention_kind("linear")
    assert (gqa.cache_shards(m, 16), gqa.cache_shards(m, 3), gqa.cache_shards(m, 4)) == (8, 4, 4)
    assert (lin.cache_shards(m, 32), lin.cache_shards(m, 3)) == (16, 16 / 5)   # 16 heads: 1, then 5 per rank
    assert kv_bytes_per_token(m, Parallel(tp=16, ep=16), 2) == 2 * head        # 2 layers, one head each
    assert kv_bytes_per_token(m, Parallel(tp=3), 2) == 2 * 2 * head            # 2 heads each (was 8/3)
    shape = step_shape(m, "decode", 4, 512)
    mem = memory_for_layout(m, shape, Parallel(tp=16, ep=16), [], MemoryOptions())
    assert mem["parts"]["kv_cache"] == 4 * 512 * 2 * head                      # 4 sequences x 512 keys x 2 layers
    topo, tokens = load_topology("h800-cx7"), 1024
    ring, plain = Parallel(tp=16, cp=2, ep=32), Parallel(tp=16, ep=16)
    f, _ = tp_comm_us(m, 0, 2, ring, StepShape("train", tokens, 2048, shards=2), topo, tokens, 8)
    f0, _ = tp_comm_us(m, 0, 2, plain, StepShape("train", tokens, 2048, shards=2), topo, tokens, 8)
    one = coll.send_us(tokens * head, coll.group_link(topo, 2, 16, 8))   # the chunk's one head (was half a head)
    assert f - f0 == pytest.approx(2 * one)                                    # 2 layers, cp - 1 = 1 pass
