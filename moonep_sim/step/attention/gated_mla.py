"""``gated-mla``: MLA with an output gate (Kimi K3's full-attention layers, ``mla_use_output_gate``
in its config): a sigmoid gate ``H x (n x v)`` computed from the layer's input multiplies the
attention output per head before the output projection. Everything else is :mod:`.mla`'s; the gate
adds its weights (priced in the projections' GEMM) and the gate values saved for the backward."""

from __future__ import annotations

from moonep_sim.models import ModelSpec
from moonep_sim.step.attention import ATTENTION
from moonep_sim.step.attention.mla import MLA
from moonep_sim.step.ops import BF16


class GatedMLA(MLA):
    name = "gated-mla"

    def params(self, model: ModelSpec) -> int:
        return super().params(model) + model.hidden * model.heads * (model.v_head_dim or model.head_dim)

    def saved_per_token(self, model: ModelSpec, mode: str) -> float:
        return super().saved_per_token(model, mode) + model.heads * (model.v_head_dim or model.head_dim) * BF16


ATTENTION.register(GatedMLA())

__all__ = ["GatedMLA"]
