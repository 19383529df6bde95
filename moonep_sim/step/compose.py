"""A step as a program of ops on the two-stream timeline: the layer stack's ops priced, the MoE
layers' simulated communication, and the overlap schedule that orders them.

Notation: R ranks, M micro-batches, L layers. Times in microseconds.

:class:`Program` is the shared mechanism (each op's price, each micro-batch's ready time, the MoE
block's collectives as primitives) and :func:`compose` a small driver: it builds the program and
lets the schedule (``moonep_sim.step.schedules``: one class per schedule) issue the ops. The
built-in schedules issue layer by layer (``LayerSchedule``): embedding; per layer its ops before
the MoE block (or the whole dense layer), then the MoE block (router, shared experts, dispatch,
routed experts, combine); the head (and loss in train). In train the backward follows in reverse
layer order: per MoE layer the gradients' dispatch (``combine_bwd`` of the Plan), the experts'
backward, the gradients' combine (``dispatch_bwd``), the copies' gradient reduce, then the shared
experts', router's and attention's backward; under recompute each op's backward first runs what
it recomputes of the forward (``moonep_sim.step.recompute``). The optimizer step is not in the step (its memory
is: ``moonep_sim.step.memory``). A kernel family whose library waits on the host for the count
exchange (``LayerComm.host_wait_us``: DeepEP's normal kernels) puts a ``host_wait`` before each
forward dispatch that also holds back every compute op issued after it (the CPU cannot enqueue
them until the counts arrived).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.step.costs import CostModel
from moonep_sim.step.layer_sim import LayerComm
from moonep_sim.step.recompute import recompute_op_us
from moonep_sim.step.schedule import Timeline
from moonep_sim.step.stack import LayerOps, Op, StepShape, backward_op, head_ops, layer_ops


@dataclass(frozen=True)
class OpTimes:
    """The compute ops of one micro-batch: each layer's (:class:`LayerOps`), and the head ops before
    the first layer and after the last (:func:`head_ops`)."""

    layers: list[LayerOps]
    first: tuple[Op, ...]
    last: tuple[Op, ...]


def stack_ops(model: ModelSpec, shape: StepShape) -> OpTimes:
    built: dict[tuple, LayerOps] = {}  # one build per (attention kind, dense or MoE), shared by its layers
    keys = [(model.attention_kind(l), l >= model.dense_layers) for l in range(model.layers)]
    layers = [built[k] if k in built else built.setdefault(k, layer_ops(model, l, shape)) for l, k in enumerate(keys)]
    first, last = head_ops(model, shape)
    return OpTimes(layers, first, last)


def all_ops(ot: OpTimes, train: bool) -> list[Op]:
    """Every op the step runs (what a profile must time), backward ones included in train."""
    ops = list(ot.first) + list(ot.last)
    for lo in ot.layers:
        ops += list(lo.before) + [o for o in (lo.router, lo.shared) if o is not None]
    if train:  # one backward per distinct op (layers of a kind share theirs)
        bwd: dict[int, Op] = {}
        ops += [bwd.get(id(o)) or bwd.setdefault(id(o), backward_op(o)) for o in ops]
    return ops


def _held(c: LayerComm, seg):
    """``Timeline.comm``'s ``held`` for a segment: None (the whole collective) when the layer's
    kernels hold their SMs while data is in flight, else the segment's (head_R, tail_R)."""
    return None if c.holds_sms or seg is None else seg


class Program:
    """A step being composed: the shared mechanism every schedule issues its ops through.

    tl: the :class:`Timeline` of ``R`` ranks.  M: micro-batches (``len(shapes)``).  ots[i]:
    micro-batch i's ops.  ready[i] [R]: when micro-batch i's next op may start.  grad_end [R]: when
    the last gradient reduce issued so far ends.  train: whether the backward is issued. The
    primitives below place one op (or one MoE block's fixed sequence of communication and expert
    compute) and keep ``ready`` and ``grad_end``; a schedule decides their order.
    """

    def __init__(self, model: ModelSpec, shapes: Sequence[StepShape], costs: CostModel,
                 comm_of: Callable[[int, int], LayerComm], R: int, train: bool) -> None:
        self.model, self.costs, self.comm_of, self.R, self.train = model, costs, comm_of, R, train
        self.M = len(shapes)
        self.tl = Timeline(R)
        self.ots = [stack_ops(model, s) for s in shapes]
        # data-parallel attention: each rank's attention core priced at its own context
        self.contexts = tuple(shapes[0].contexts) if shapes else ()
        require(not self.contexts or len(self.contexts) == R,
                f"contexts per rank ({len(self.contexts)}) must be one per rank of the step ({R})")
        self.ctx_ots = {c: [stack_ops(model, dataclasses.replace(s, context=int(c), contexts=())) for s in shapes]
                        for c in sorted(set(self.contexts))}
        self.ready = [np.zeros(R) for _ in range(self.M)]
        self.grad_end = np.zeros(R)
        self._memo: dict[tuple, float] = {}
        self.tp = shapes[0].tp if shapes else 1

    def us(self, op: Op, bwd: bool = False) -> float:
        """The op's time (its backward's with ``bwd``), priced once per distinct op."""
        key = (op.name, op.shape, op.flops, op.bytes, bwd)
        if key not in self._memo:
            self._memo[key] = self.costs.op_us(backward_op(op) if bwd else op)
        return self._memo[key]

    def layer(self, i: int, l: int) -> LayerOps:
        """Micro-batch ``i``'s ops of layer ``l``."""
        return self.ots[i].layers[l]

    def run(self, op: Op | None, i: int, layer: int, bwd: bool = False) -> None:
        """Micro-batch ``i``'s compute op (its backward with ``bwd``), after its previous op; an
        attention core under per-rank contexts takes each rank's own time ([R])."""
        if op is None:   # a layer without it (no shared experts)
            return
        us = self.us(op, bwd)
        if bwd and self.costs.recompute is not None:   # the forward it recomputes first
            key = ("recompute", op.name, op.shape, op.flops, op.bytes, layer)
            if key not in self._memo:
                self._memo[key] = recompute_op_us(self.costs, self.model, op, layer, self.tp)
            us = us + self._memo[key]
        if self.contexts and op.kind == "attention":
            own = {c: self.us(next(o for o in self.ctx_ots[c][i].layers[layer].before if o.name == op.name), bwd)
                   for c in self.ctx_ots}
            us = np.array([own[c] for c in self.contexts])
        self.ready[i] = self.tl.compute(op.name + ("_bwd" if bwd else ""), us, layer,
                                        "backward" if bwd else "forward", i, after=self.ready[i])

    def run_all(self, ops: Sequence[Op], i: int, layer: int, bwd: bool = False) -> None:
        for op in ops:
            self.run(op, i, layer, bwd)

    def dispatch(self, l: int, i: int) -> np.ndarray:
        """MoE layer ``l``'s dispatch (planning, dispatch, prefetch) of micro-batch ``i`` on the
        communication stream, once ``i`` is ready; returns its end [R]."""
        c = self.comm_of(l, i)
        if c.host_wait_us > 0:  # the CPU waits for the counts: nothing issued after it starts sooner
            hw = self.tl.comm("host_wait", np.full(self.R, c.host_wait_us), l, "forward", 0.0, i, after=self.ready[i])
            self.tl.wait(hw)
            self.ready[i] = np.maximum(self.ready[i], hw)
        return self.tl.comm("dispatch", c.forward.pre_R, l, "forward", c.sm_share, i, after=self.ready[i],
                            held=_held(c, c.forward.pre_held))

    def expert_compute(self, l: int, i: int, pre_end: np.ndarray) -> np.ndarray:
        """The routed experts of MoE layer ``l``, micro-batch ``i``, after the dispatch ending at
        ``pre_end`` and ``i``'s previous op; returns their end [R] (``ready`` unchanged)."""
        c = self.comm_of(l, i)
        return self.tl.compute("expert", c.forward.expert_R, l, "forward", i, after=np.maximum(pre_end, self.ready[i]))

    def combine(self, l: int, i: int, expert_end: np.ndarray) -> np.ndarray:
        """The combine, once the slowest rank's experts end; returns its end [R] (``ready`` unchanged)."""
        c = self.comm_of(l, i)
        return self.tl.comm("combine", c.forward.post_R, l, "forward", c.sm_share, i,
                            after=np.full(self.R, float(expert_end.max())), held=_held(c, c.forward.post_held))

    def experts(self, l: int, i: int, pre_end: np.ndarray) -> None:
        """:meth:`expert_compute` then :meth:`combine`; micro-batch ``i`` is ready once the combine arrives."""
        post = self.combine(l, i, self.expert_compute(l, i, pre_end))
        self.ready[i] = np.maximum(self.ready[i], post)

    def gradient_dispatch(self, l: int, i: int) -> np.ndarray:
        """The backward's first collective of MoE layer ``l`` (the gradients' dispatch: the Plan's
        ``combine_bwd``); returns its end [R]."""
        c = self.comm_of(l, i)
        return self.tl.comm("combine_bwd", c.backward.pre_R, l, "backward", c.sm_share, i, after=self.ready[i],
                            held=_held(c, c.backward.pre_held))

    def experts_backward(self, l: int, i: int, pre_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts' backward, the gradients' combine (``dispatch_bwd``) and the copies'
        gradient reduce (when any); returns (the combine's end, the reduce's end) [R] and keeps
        ``grad_end``. ``ready`` is the schedule's to advance (to either end)."""
        c = self.comm_of(l, i)
        e = self.tl.compute("expert_bwd", c.backward.expert_R, l, "backward", i,
                            after=np.maximum(pre_end, self.ready[i]))
        post = self.tl.comm("dispatch_bwd", c.backward.post_R, l, "backward", c.sm_share, i,
                            after=np.full(self.R, float(e.max())), held=_held(c, c.backward.post_held))
        g = post
        if c.backward.grad_R.max() > 0:
            g = self.tl.comm("grad_reduce", c.backward.grad_R, l, "backward", c.sm_share, i, after=post)
        self.grad_end = np.maximum(self.grad_end, g)
        return post, g


def compose(model: ModelSpec, shapes: Sequence[StepShape], costs: CostModel, schedule: Any,
            comm_of: Callable[[int, int], LayerComm], R: int, train: bool) -> Timeline:
    """Place the step's ops on a :class:`Timeline` of ``R`` ranks in the order ``schedule`` (an
    overlap schedule of ``moonep_sim.step.schedules``) issues them. ``shapes[i]``: micro-batch i's
    shape; ``comm_of(layer, i)``: the simulated communication of MoE layer ``layer`` (an index into
    the model's layers) for micro-batch i."""
    p = Program(model, shapes, costs, comm_of, R, train)
    schedule.issue(p)
    return p.tl


__all__ = ["OpTimes", "Program", "all_ops", "compose", "stack_ops"]
