"""``mla``: multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

Projections: the query through its latent (``H x q_lora + q_lora x n x (hd + rope)``, or directly
``H x n x (hd + rope)`` without one), the KV latent and decoupled RoPE key (``H x (kv_lora +
rope)``), the latent's up-projection to keys and values (``kv_lora x n x (hd + v)``), the output
(``n x v x H``). The cache keeps the latent and the RoPE key: ``kv_lora + rope`` elements per
token. The core: heads of QK width ``hd + rope`` and V width ``v``; in decode the up-projections
are absorbed, so queries attend the latent directly (QK ``kv_lora + rope``, V ``kv_lora``). Saved
for the backward: q, the latent and RoPE key, the up-projected k and v, the output and the softmax
statistics.
"""

from __future__ import annotations

from moonep_sim.models import ModelSpec
from moonep_sim.step.attention import ATTENTION
from moonep_sim.step.attention.gqa import GQA
from moonep_sim.step.ops import BF16


class MLA(GQA):
    name = "mla"
    measured_gqa = False

    def dims(self, model: ModelSpec, mode: str) -> tuple[int, int]:
        if mode == "decode":  # absorbed: queries attend the latent directly
            return model.kv_lora_rank + model.qk_rope_dim, model.kv_lora_rank
        return model.head_dim + model.qk_rope_dim, model.v_head_dim or model.head_dim

    def gemm_parts(self, model: ModelSpec) -> tuple[tuple[int, int], ...]:
        H, n, hd = model.hidden, model.heads, model.head_dim
        rope, v, ql, kl = model.qk_rope_dim, model.v_head_dim or hd, model.q_lora_rank, model.kv_lora_rank
        q = ((ql, H), (n * (hd + rope), ql)) if ql else ((n * (hd + rope), H),)
        return (*q, (kl + rope, H), (n * (hd + v), kl), (H, n * v))

    def kv_elems_per_token(self, model: ModelSpec) -> int:
        return model.kv_lora_rank + model.qk_rope_dim

    def cache_shards(self, model: ModelSpec, tp: int) -> float:
        return 1  # one latent per token, shared by every head: every TP rank holds it

    def saved_per_token(self, model: ModelSpec, mode: str) -> float:
        n = model.heads
        dqk, dv = self.dims(model, mode)
        return (n * dqk + model.kv_lora_rank + model.qk_rope_dim + n * (dqk + dv) + n * dv) * BF16 + n * 4.0


ATTENTION.register(MLA())

__all__ = ["MLA"]
