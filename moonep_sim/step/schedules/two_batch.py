"""``two-batch`` (DeepSeek's dual micro-batch overlap, SGLang's two-batch overlap): a rank's tokens
split into two micro-batches; each layer issues both micro-batches' dispatch, then both one's
experts and combine, so one's dispatch and combine run while the other computes; the shared
experts overlap as in ``shared-expert``."""

from __future__ import annotations

from moonep_sim.step.schedules import OVERLAP_SCHEDULES
from moonep_sim.step.schedules.shared_expert import SharedExpertOverlap


@OVERLAP_SCHEDULES.register
class TwoBatch(SharedExpertOverlap):
    name = "two-batch"
    micro_batches = 2


__all__ = ["TwoBatch"]
