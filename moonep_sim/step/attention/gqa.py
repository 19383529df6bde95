"""``gqa``: grouped-query softmax attention (MHA when kv_heads == heads), the base of the other
softmax kinds (``sliding``, ``mla``).

Per layer: projections ``H x n x hd`` (q) + ``2 x H x kv x hd`` (k, v) + ``n x hd x H`` (o);
K/V cache ``2 x kv x hd`` elements per token. The core op: ``2 x T x n x keys x (dqk + dv)`` FLOPs
(``keys`` the mean keys a query attends to, causal in train / prefill); it reads q and writes o,
and reads K/V once per sequence in decode (every sequence its whole cache) or once per token in
train / prefill (flash attention, ASSUMED: K/V read once). Saved for the backward: q, k, v, the
output and the softmax statistics (fp32 per head).
"""

from __future__ import annotations

from moonep_sim.models import ModelSpec
from moonep_sim.step.attention import ATTENTION, AttentionKind, head_shards
from moonep_sim.step.ops import BF16, Op, StepShape


class GQA(AttentionKind):
    name = "gqa"
    #: whether AIConfigurator's GQA attention tables time this kind's core (MLA's latent: no)
    measured_gqa = True

    def window(self, model: ModelSpec) -> int:
        """Keys a query may attend to at most (0: the whole context)."""
        return 0

    def dims(self, model: ModelSpec, mode: str) -> tuple[int, int]:
        """(QK width, V width) per head of the core."""
        return model.head_dim, model.head_dim

    def gemm_parts(self, model: ModelSpec) -> tuple[tuple[int, int], ...]:
        H, n, hd = model.hidden, model.heads, model.head_dim
        return ((n * hd + 2 * (model.kv_heads or n) * hd, H), (H, n * hd))

    def kv_elems_per_token(self, model: ModelSpec) -> int:
        return 2 * (model.kv_heads or model.heads) * model.head_dim

    def cache_shards(self, model: ModelSpec, tp: int) -> float:
        return head_shards(model.kv_heads or model.heads, tp)  # KV heads split; beyond them, replicated

    def cache_bytes(self, model: ModelSpec, shape: StepShape) -> float:
        ctx = min(shape.context, self.window(model) or shape.context)   # every mode: the sequence's keys
        return float(shape.sequences) * ctx * self.kv_elems_per_token(model) * BF16

    def core(self, model: ModelSpec, shape: StepShape) -> Op:
        T, n = shape.tokens, model.heads
        dqk, dv = self.dims(model, shape.mode)
        keys = shape.attended()
        w = self.window(model)
        if w:
            keys = min(keys, float(w))
        flops = 2.0 * T * n * keys * (dqk + dv)
        qo = float(T) * n * (dqk + dv) * BF16
        if shape.mode == "decode":  # every sequence reads its whole K/V cache
            kv = float(shape.sequences) * keys * self.kv_elems_per_token(model) * BF16
        else:  # flash attention: K/V of each sequence read once per query block (ASSUMED: once)
            kv = float(T) * self.kv_elems_per_token(model) * BF16
        ctx = min(shape.context, w) if w else shape.context
        # (mode, sequences, context, heads, kv heads, head dim, window): what a measured GQA table is
        # read at (a kind with other widths, MLA, has none)
        dims = (shape.mode, shape.sequences, shape.context, n, model.kv_heads or n, model.head_dim, w) \
            if (dqk, dv) == (model.head_dim, model.head_dim) and self.measured_gqa else ()
        return Op("attn_core", "attention", flops, qo + kv, T, f"tokens={T},context={ctx},kind={self.name}",
                  attn=dims)

    def saved_per_token(self, model: ModelSpec, mode: str) -> float:
        n = model.heads
        dqk, dv = self.dims(model, mode)
        kv = model.kv_heads or n
        return (n * dqk + 2 * kv * dqk + n * dv) * BF16 + n * 4.0  # q, k, v, out + softmax stats (fp32)


ATTENTION.register(GQA())

__all__ = ["GQA"]
