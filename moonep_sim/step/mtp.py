"""Multi-token prediction (MTP) / speculative decoding in a decode step: tokens per step and the
draft layers' cost.

With draft depth d, each decode step of a sequence verifies ``1 + d`` tokens in the main model
(the last accepted token and d drafts: the MoE layers route ``(1 + d)`` times the sequences'
tokens; the dense ops and attention are priced at the sequences, ASSUMED: decode's GEMMs are bound
by their weights and attention by the one read of each sequence's cache) and runs the draft module
d times, one position after another (DeepSeek-V3's MTP module:
one transformer block with its MoE, sharing the embedding and the output head). A draft is kept
only when every draft before it was, so with a per-draft acceptance rate a the step yields
``1 + a + a^2 + ... + a^d`` tokens per sequence (DeepSeek-V3 reports 85-90% acceptance for its one
draft token, about 1.8 tokens per step).

ASSUMED: one draft pass costs what one MoE layer of the main model costs in this step (decode is
bound by reading the layer's weights, which a draft pass reads as the verifying pass does) plus
the LM head over the sequences; its weights are one more MoE layer's share on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moonep_sim.errors import require

MAX_DEPTH = 8


@dataclass(frozen=True)
class MTP:
    """depth: draft tokens per step (0 = off).  acceptance: the chance a draft is accepted given
    the drafts before it were, in (0, 1]."""

    depth: int = 0
    acceptance: float = 0.8

    def __post_init__(self) -> None:
        require(isinstance(self.depth, int) and not isinstance(self.depth, bool) and 0 <= self.depth <= MAX_DEPTH,
                f"mtp depth ({self.depth!r}) must be an integer in [0, {MAX_DEPTH}] (0 = no drafts)")
        a = self.acceptance
        require(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 < float(a) <= 1,
                f"mtp acceptance ({a!r}) must lie in (0, 1]: the chance a draft token is accepted")

    @property
    def verify_tokens(self) -> int:
        """Tokens per sequence the main model runs in one step: ``1 + depth``."""
        return 1 + self.depth

    @property
    def tokens_per_step(self) -> float:
        """Tokens per sequence one step yields: ``sum_{i=0..d} a^i``."""
        a = float(self.acceptance)
        return float(sum(a ** i for i in range(self.depth + 1)))


def apply_mtp(fig: dict[str, Any], mtp: MTP, sequences: int, head_us: float, layer_weight_bytes: float) -> None:
    """Add the draft passes to one strategy's decode-step figures (in place): ``step_time_us`` +=
    ``depth x (mean MoE layer time + head_us)``; ``tokens_per_s_per_gpu`` the sequences' accepted
    tokens over that time; ``peak_memory_bytes`` += the draft layer's weights
    (``layer_weight_bytes``); the inputs and what they added under ``mtp``."""
    if not mtp.depth:
        return
    moe = [x["time_us"] for x in fig.get("layers", ()) if str(x.get("kind", "")).startswith("moe")]
    layer_us = sum(moe) / len(moe) if moe else 0.0
    draft_us = mtp.depth * (layer_us + head_us)
    t = float(fig["step_time_us"]) + draft_us
    fig["step_time_us"] = t
    fig["tokens_per_s_per_gpu"] = sequences * mtp.tokens_per_step / (t * 1e-6) if t > 0 else 0.0
    fig["peak_memory_bytes"] = float(fig["peak_memory_bytes"]) + layer_weight_bytes
    cap = fig.get("gpu_memory_bytes")
    if cap:
        fig["oom"] = fig["peak_memory_bytes"] > cap
    fig["mtp"] = {"depth": mtp.depth, "acceptance": float(mtp.acceptance), "verify_tokens": mtp.verify_tokens,
                  "tokens_per_step": mtp.tokens_per_step, "draft_us": draft_us, "draft_layer_us": layer_us,
                  "draft_weight_bytes": layer_weight_bytes,
                  "assumption": "a draft pass costs one MoE layer of this step plus the LM head (ASSUMED)"}


__all__ = ["MAX_DEPTH", "MTP", "apply_mtp"]
