"""``sliding``: GQA over the last ``sliding_window`` keys (GPT-OSS's alternate layers): the core
attends to at most the window, and a sequence's cache keeps at most the window's tokens."""

from __future__ import annotations

from moonep_sim.models import ModelSpec
from moonep_sim.step.attention import ATTENTION
from moonep_sim.step.attention.gqa import GQA


class Sliding(GQA):
    name = "sliding"

    def window(self, model: ModelSpec) -> int:
        return model.sliding_window


ATTENTION.register(Sliding())

__all__ = ["Sliding"]
