"""``none``: no attention op at all (a bare MoE stack): no norm, projections, core or cache."""

from __future__ import annotations

from moonep_sim.step.attention import ATTENTION, AttentionKind


class NoAttention(AttentionKind):
    name = "none"
    has_op = False


ATTENTION.register(NoAttention())

__all__ = ["NoAttention"]
