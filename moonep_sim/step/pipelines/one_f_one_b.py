"""1F1B (PipeDream-flush, Megatron-Core's default): p stages, one chunk per rank.

Rank r runs ``min(p - r - 1, m)`` warm-up forwards, then alternates one forward and one backward
until every forward is issued, then the cool-down backwards; so it keeps at most ``p - r``
micro-batches in flight. Equal stages with free sends: ``(m + p - 1)(F + B)``, a bubble of
``(p - 1)/(m + p - 1)`` of the step.
"""

from __future__ import annotations

from moonep_sim.step.pipelines import PIPELINE_SCHEDULES
from moonep_sim.step.pipelines.base import PipeOp, Schedule


@PIPELINE_SCHEDULES.register
class OneFOneB(Schedule):
    name = "1f1b"

    def orders(self, t=None) -> list[list[PipeOp]]:
        p, m = self.pp, self.m
        out = []
        for r in range(p):
            warm = min(p - r - 1, m)
            o = [PipeOp("F", i, r) for i in range(warm)]
            for i in range(m - warm):
                o += [PipeOp("F", warm + i, r), PipeOp("B", i, r)]
            o += [PipeOp("B", i, r) for i in range(m - warm, m)]
            out.append(o)
        return out


__all__ = ["OneFOneB"]
