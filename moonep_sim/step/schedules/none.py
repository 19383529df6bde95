"""``none``: every op of a MoE block in series -- router, shared experts, the dispatch (planning,
dispatch, prefetch), the routed experts, the combine; in the backward the copies' gradient reduce
holds the compute stream too."""

from __future__ import annotations

import numpy as np

from moonep_sim.step.schedules import OVERLAP_SCHEDULES
from moonep_sim.step.schedules.base import LayerSchedule


@OVERLAP_SCHEDULES.register
class Serial(LayerSchedule):
    name = "none"

    def dispatch_phase(self, p, l, i):
        lo = p.layer(i, l)
        p.run(lo.router, i, l)
        p.run(lo.shared, i, l)
        return p.dispatch(l, i)

    def expert_phase(self, p, l, i, pre_end):
        p.experts(l, i, pre_end)

    def backward_phase(self, p, l, i, pre_end):
        post, reduced = p.experts_backward(l, i, pre_end)
        p.ready[i] = np.maximum(p.ready[i], reduced)
        p.run(p.layer(i, l).shared, i, l, True)


__all__ = ["Serial"]
