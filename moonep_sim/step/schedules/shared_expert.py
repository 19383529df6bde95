"""``shared-expert`` (MoonEP issue #15): the dispatch (planning, dispatch, prefetch) runs on the
communication stream while the shared experts compute; in the backward the shared experts'
backward overlaps the gradients' dispatch the same way, and the gradient reduce runs on the
communication stream while the next layers' backward computes (the step ends when every reduce
has arrived)."""

from __future__ import annotations

import numpy as np

from moonep_sim.step.schedules import OVERLAP_SCHEDULES
from moonep_sim.step.schedules.base import LayerSchedule


@OVERLAP_SCHEDULES.register
class SharedExpertOverlap(LayerSchedule):
    name = "shared-expert"

    def dispatch_phase(self, p, l, i):
        p.run(p.layer(i, l).router, i, l)
        return p.dispatch(l, i)

    def expert_phase(self, p, l, i, pre_end):
        p.run(p.layer(i, l).shared, i, l)
        p.experts(l, i, pre_end)

    def backward_phase(self, p, l, i, pre_end):
        p.run(p.layer(i, l).shared, i, l, True)
        post, _ = p.experts_backward(l, i, pre_end)
        p.ready[i] = np.maximum(p.ready[i], post)  # the reduce holds only the communication stream


__all__ = ["SharedExpertOverlap"]
