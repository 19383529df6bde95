"""``linear``: a recurrent (linear-attention) kind with a fixed state per sequence, laid out as Kimi
Delta Attention (KDA: Kimi Linear, Kimi K3's linear layers).

Projections, with ``P = n x hd``: q, k, v and the full-rank output gate from the hidden state
(``4 x H x P``), the output (``P x H``), the decay's low-rank pair (``H x hd`` then ``hd x P``) and
the per-head beta (``H x n``), and the short depthwise convolution over q, k and v
(``3 x P x`` :data:`SHORT_CONV`) -- as fla's KDA layer and the K3 config (``linear_attn_config``:
``use_full_rank_gate``, ``short_conv_kernel_size`` 4) give them; per-head scalars are left out.
State: ``n x hd x hd`` fp32 per sequence (:meth:`Linear.state_bytes`), kept in serving instead of
a K/V cache. The core per token: the state update and readout, ``4 x n x hd x hd`` FLOPs; the
state read and written once per sequence, q, k, v and the output once per token. Saved for the
backward: q, k, v and the output per token."""

from __future__ import annotations

from moonep_sim.models import ModelSpec
from moonep_sim.step.attention import ATTENTION, AttentionKind, head_shards
from moonep_sim.step.ops import BF16, Op, StepShape


#: The short convolution's kernel width over q, k and v (Kimi K3 / Kimi Linear: short_conv_kernel_size).
SHORT_CONV = 4


class Linear(AttentionKind):
    name = "linear"

    def state_bytes(self, model: ModelSpec) -> int:
        """One sequence's fixed state: heads x head_dim x head_dim fp32."""
        return model.heads * model.head_dim * model.head_dim * 4

    def params(self, model: ModelSpec) -> int:
        H, n, hd = model.hidden, model.heads, model.head_dim
        P = n * hd
        return 4 * H * P + P * H + H * hd + hd * P + H * n + 3 * P * SHORT_CONV

    def cache_shards(self, model: ModelSpec, tp: int) -> float:
        return head_shards(model.heads, tp)  # each head's state lives with its head

    def cache_bytes(self, model: ModelSpec, shape: StepShape) -> float:
        return float(self.state_bytes(model) * shape.sequences)

    def core(self, model: ModelSpec, shape: StepShape) -> Op:
        T, n, dk = shape.tokens, model.heads, model.head_dim
        flops = 4.0 * T * n * dk * dk
        state = float(self.state_bytes(model)) * shape.sequences * 2
        return Op("attn_core", "attention", flops, state + 4.0 * T * n * dk * BF16, T, f"tokens={T},kind=linear")

    def saved_per_token(self, model: ModelSpec, mode: str) -> float:
        return 4.0 * model.heads * model.head_dim * BF16


ATTENTION.register(Linear())

__all__ = ["Linear", "SHORT_CONV"]
