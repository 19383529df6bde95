"""Write the shipped `recorded-random_*` traces: routing recorded with `moonep_sim.routing.record`
from tiny transformers MoE models with the expert counts and top-k of real models but RANDOMLY
INITIALISED weights (nothing is downloaded). They are not real routing (a random router's load
says nothing about a trained one's); they show what a recording holds: one step per forward call of `generate()` (a
prefill of 4 x 32 rows, then decode passes of 4 rows), several layers, the router's own ids and
weights. Run from the repository root: `python traces/make_recorded.py` (needs `transformers`)."""

from __future__ import annotations

import torch
import transformers as tf

from moonep_sim.routing import record

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             max_position_embeddings=256, intermediate_size=64)
SHAPES = {  # name: (config, the real model whose E and K it borrows)
    "qwen1.5-moe-shape_e60k4": (lambda: tf.Qwen2MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=60,
                                                           num_experts_per_tok=4, shared_expert_intermediate_size=128,
                                                           norm_topk_prob=False), "Qwen1.5-MoE-A2.7B"),
    "deepseek-v2-lite-shape_e64k6": (lambda: tf.DeepseekV2Config(**SMALL, moe_intermediate_size=32, n_routed_experts=64,
                                                                 num_experts_per_tok=6, n_shared_experts=2,
                                                                 first_k_dense_replace=0, kv_lora_rank=16,
                                                                 q_lora_rank=None, qk_nope_head_dim=8,
                                                                 qk_rope_head_dim=8, v_head_dim=16), "DeepSeek-V2-Lite"),
    "gpt-oss-20b-shape_e32k4": (lambda: tf.GptOssConfig(**SMALL, num_local_experts=32, num_experts_per_tok=4,
                                                        head_dim=16), "GPT-OSS-20B"),
}


def main() -> None:
    for name, (cfg, real) in SHAPES.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg()).eval()
        prompts = torch.randint(1, 256, (4, 32), generator=torch.Generator().manual_seed(1))
        out = f"traces/recorded-random_{name}.safetensors"
        attribution = (f"synthetic: recorded from a tiny {type(model).__name__} with {real}'s expert count and "
                       "top-k and RANDOM weights (seed 0); not real routing")
        with record(model, out, attribution=attribution), torch.no_grad():
            model.generate(prompts, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
        print("wrote", out)


if __name__ == "__main__":
    main()
