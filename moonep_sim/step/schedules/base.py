"""What an overlap schedule is: :class:`Schedule` (issues a whole step) and :class:`LayerSchedule`
(layer by layer, the MoE block's order left to the subclass). See ``moonep_sim.step.schedules``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moonep_sim.step.compose import Program


class Schedule(ABC):
    """An overlap schedule: the order a step's ops are issued in and what each waits for.

    name: its ``--overlap`` name.  micro_batches: how many micro-batches a rank's tokens are split
    into (the step's ``shapes``).  :meth:`issue` places every op of the step on ``p.tl`` through the
    primitives of :class:`~moonep_sim.step.compose.Program` (``run``, ``dispatch``, ``experts``,
    ``gradient_dispatch``, ``experts_backward``; ``p.ready`` and ``p.grad_end``).
    """

    name: str = ""
    micro_batches: int = 1

    @abstractmethod
    def issue(self, p: "Program") -> None:
        """Place every op of the step on ``p.tl``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, micro_batches={self.micro_batches})"


class LayerSchedule(Schedule):
    """A schedule that issues the step layer by layer (``moonep_sim.step.compose``'s program order):
    the embedding, then per layer every micro-batch's ops before its MoE block and the block's
    first phase (:meth:`dispatch_phase`, ending with the dispatch), then every micro-batch's second
    phase (:meth:`expert_phase`: the routed experts and the combine), then the head. In train the
    backward follows in reverse: per MoE layer every micro-batch's gradients' dispatch, then each
    one's :meth:`backward_phase` (the experts' backward and the gradient collectives, with the
    shared experts' backward where the schedule puts it), its router's and the layer's other ops'
    backward; the step ends once every gradient reduce has arrived. A subclass states the three
    phases."""

    @abstractmethod
    def dispatch_phase(self, p: "Program", l: int, i: int) -> np.ndarray:
        """Micro-batch ``i``'s MoE block of layer ``l`` up to its dispatch; returns the dispatch's end [R]."""

    @abstractmethod
    def expert_phase(self, p: "Program", l: int, i: int, pre_end: np.ndarray) -> None:
        """The rest of the block's forward, after the dispatch that ends at ``pre_end``."""

    @abstractmethod
    def backward_phase(self, p: "Program", l: int, i: int, pre_end: np.ndarray) -> None:
        """The block's backward after the gradients' dispatch (``pre_end``), up to the router's."""

    def issue(self, p: "Program") -> None:
        for i in range(p.M):
            p.run_all(p.ots[i].first, i, -1)
        for l in range(p.model.layers):
            self.forward_layer(p, l)
        for i in range(p.M):
            p.run_all(p.ots[i].last, i, -1)
        if not p.train:
            return
        for i in range(p.M):
            p.run_all(p.ots[i].last[::-1], i, -1, True)
        for l in reversed(range(p.model.layers)):
            self.backward_layer(p, l)
        for i in range(p.M):
            p.run_all(p.ots[i].first[::-1], i, -1, True)
        p.tl.wait(p.grad_end)  # the step ends once every gradient reduce has arrived

    def forward_layer(self, p: "Program", l: int) -> None:
        pre_end = {}
        for i in range(p.M):
            lo = p.layer(i, l)
            p.run_all(lo.before, i, l)
            if lo.moe:
                pre_end[i] = self.dispatch_phase(p, l, i)
        for i in pre_end:
            self.expert_phase(p, l, i, pre_end[i])

    def backward_layer(self, p: "Program", l: int) -> None:
        pre_end = {}
        for i in range(p.M):
            lo = p.layer(i, l)
            if not lo.moe:
                p.run_all(lo.before[::-1], i, l, True)
                continue
            pre_end[i] = p.gradient_dispatch(l, i)
        for i in pre_end:
            lo = p.layer(i, l)
            self.backward_phase(p, l, i, pre_end[i])
            p.run(lo.router, i, l, True)
            p.run_all(lo.before[::-1], i, l, True)


__all__ = ["LayerSchedule", "Schedule"]
