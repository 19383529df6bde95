"""Recording routing from running transformers MoE models (tiny, randomly initialised, built from
small configs: no weights are downloaded). The recorded ids must be the router's own top-k."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from moonep_sim.errors import ConfigError  # noqa: E402
from moonep_sim.routing import record  # noqa: E402
from moonep_sim.routing.recorder import find_routers  # noqa: E402
from moonep_sim.routing.trace import Trace  # noqa: E402

E, K = 8, 2
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=64, intermediate_size=16)


def _configs():
    tf = transformers
    return {
        "mixtral": lambda: tf.MixtralConfig(**COMMON, num_local_experts=E, num_experts_per_tok=K),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                               num_experts=E, num_experts_per_tok=K),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, moe_intermediate_size=16, num_experts=E,
                                               num_experts_per_tok=K, head_dim=8),
        "olmoe": lambda: tf.OlmoeConfig(**COMMON, num_experts=E, num_experts_per_tok=K),
        "deepseek_v2": lambda: tf.DeepseekV2Config(**COMMON, moe_intermediate_size=16, n_routed_experts=E,
                                                   num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=0,
                                                   kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4,
                                                   qk_rope_head_dim=4, v_head_dim=8),
        "deepseek_v3": lambda: tf.DeepseekV3Config(**COMMON, moe_intermediate_size=16, n_routed_experts=E,
                                                   num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=0,
                                                   kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=4,
                                                   qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1),
        "gpt_oss": lambda: tf.GptOssConfig(**COMMON, num_local_experts=E, num_experts_per_tok=K, head_dim=8),
    }


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"]


def _model(family, seed=0):
    torch.manual_seed(seed)
    cfg = _configs()[family]()
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _own_topk(family, router, x_NH):
    """The router's top-k recomputed from its weights (independent of the router's forward), as
    sorted id sets; DeepSeek-V3's group-limited sigmoid routing is re-run through the module."""
    if family == "deepseek_v3":
        return np.sort(router(x_NH)[2].numpy(), axis=1)
    logits = x_NH.float() @ router.weight.float().T
    if getattr(router, "bias", None) is not None:
        logits = logits + router.bias.float()
    return np.sort(torch.topk(logits, K, dim=-1).indices.numpy(), axis=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_ids_are_the_routers_topk(family, tmp_path):
    model = _model(family)
    routers = find_routers(model)
    assert sorted(routers) == [0, 1]
    seen: dict[int, list] = {0: [], 1: []}                     # the router inputs, captured separately
    hs = [r.register_forward_pre_hook(lambda m, a, l=l: seen[l].append(a[0].detach().reshape(-1, 32).clone()))
          for l, r in routers.items()]
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    out = tmp_path / f"{family}.safetensors"
    with record(model, out) as rec, torch.no_grad():
        model(ids)                                             # a "prefill" of 2 x 5 rows
        model(ids[:, :1])                                      # a "decode" pass of 2 rows
    for h in hs:
        h.remove()
    tr = Trace(out)
    m = tr.meta
    assert (m.num_experts, m.top_k, m.layer_ids, m.num_tokens) == (E, K, [0, 1], 12)
    assert tr.steps().tolist() == [0] * 10 + [1] * 2
    assert m.model_spec is not None and m.model_spec["num_experts"] == E
    for li, layer in enumerate([0, 1]):
        x = torch.cat(seen[layer])
        with torch.no_grad():
            want = _own_topk(family, routers[layer], x)
        got = np.sort(tr.layer(li).topk_ids_TK, axis=1)
        np.testing.assert_array_equal(got, want)
        assert len({tuple(r) for r in got.tolist()}) > 1       # random weights: not one dummy-like set


def test_generate_gives_one_step_per_forward_call(tmp_path):
    model = _model("qwen3_moe", seed=3)
    ids = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(2))
    out = tmp_path / "g.safetensors"
    with record(model, out), torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    st = Trace(out).steps()
    assert np.bincount(st).tolist() == [12, 3, 3, 3]           # prefill 3 x 4, then 3 decode passes of 3 rows


def test_record_refuses_models_without_routers_and_writes_nothing_on_error(tmp_path):
    with pytest.raises(ConfigError, match="must have router modules"):
        record(torch.nn.Linear(4, 4))
    model = _model("mixtral")
    out = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError):
        with record(model, out):
            model(torch.randint(0, 64, (1, 3)))
            raise RuntimeError("user code failed")
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"layers \(\[5\]\) must be layers with a router"):
        record(model, layers=[5])
