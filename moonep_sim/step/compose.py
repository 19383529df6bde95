"""A step as a program of ops on the two-stream timeline: the layer stack, the MoE layers'
simulated communication, the overlap schedule.

Notation: R ranks, M micro-batches, L layers. Times in microseconds.

Program order (``moonep_sim.step.schedule`` explains the streams and the schedules): embedding;
per layer its ops before the MoE block (or the whole dense layer), then the MoE block (router,
shared experts, dispatch, routed experts, combine); the head (and loss in train). In train the
backward follows in reverse layer order: per MoE layer the gradients' dispatch (``combine_bwd``
of the Plan), the experts' backward, the gradients' combine (``dispatch_bwd``), the copies'
gradient reduce, then the shared experts', router's and attention's backward. The optimizer step
is not in the step (its memory is: ``moonep_sim.step.memory``).

With M micro-batches each layer is issued as: every micro-batch's first half (the ops before the
MoE block and its dispatch), then every micro-batch's second half (shared and routed experts and
the combine), so micro-batch A's dispatch and combine run while B computes. A kernel family whose
library waits on the host for the count exchange (``LayerComm.host_wait_us``: DeepEP's normal
kernels) puts a ``host_wait`` before each forward dispatch that also holds back every compute op
issued after it (the CPU cannot enqueue them until the counts arrived).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from moonep_sim.models import ModelSpec
from moonep_sim.step.costs import CostModel
from moonep_sim.step.layer_sim import LayerComm
from moonep_sim.step.schedule import Overlap, Timeline
from moonep_sim.step.stack import LayerOps, Op, StepShape, backward_op, head_ops, layer_ops


@dataclass(frozen=True)
class OpTimes:
    """The compute ops of one micro-batch's layers, priced: per layer ``before`` [(name, us)],
    ``router_us``, ``shared_us``; and the head ops."""

    layers: list[LayerOps]
    first: tuple[Op, ...]
    last: tuple[Op, ...]


def stack_ops(model: ModelSpec, shape: StepShape) -> OpTimes:
    layers = [layer_ops(model, l, shape) for l in range(model.layers)]
    first, last = head_ops(model, shape)
    return OpTimes(layers, first, last)


def all_ops(ot: OpTimes, train: bool) -> list[Op]:
    """Every op the step runs (what a profile must time), backward ones included in train."""
    ops = list(ot.first) + list(ot.last)
    for lo in ot.layers:
        ops += list(lo.before) + [o for o in (lo.router, lo.shared) if o is not None]
    if train:
        ops += [backward_op(o) for o in ops]
    return ops


def _held(c: LayerComm, seg):
    """``Timeline.comm``'s ``held`` for a segment: None (the whole collective) when the layer's
    kernels hold their SMs while data is in flight, else the segment's (head_R, tail_R)."""
    return None if c.holds_sms or seg is None else seg


def compose(model: ModelSpec, shapes: Sequence[StepShape], costs: CostModel, overlap: Overlap,
            comm_of: Callable[[int, int], LayerComm], R: int, train: bool) -> Timeline:
    """Place the step's ops on a :class:`Timeline` of ``R`` ranks. ``shapes[i]``: micro-batch i's
    shape; ``comm_of(layer, i)``: the simulated communication of MoE layer ``layer`` (an index
    into the model's layers) for micro-batch i."""
    M = len(shapes)
    tl = Timeline(R)
    ots = [stack_ops(model, s) for s in shapes]
    memo: dict[tuple, float] = {}

    def us(op: Op | None, bwd: bool = False) -> float:
        if op is None:
            return 0.0
        key = (op.name, op.shape, op.flops, op.bytes, bwd)
        if key not in memo:
            memo[key] = costs.op_us(backward_op(op) if bwd else op)
        return memo[key]

    ready = [np.zeros(R) for _ in range(M)]

    def run(op: Op, i: int, layer: int, bwd: bool = False) -> None:
        ready[i] = tl.compute(op.name + ("_bwd" if bwd else ""), us(op, bwd), layer, "backward" if bwd else "forward",
                              i, after=ready[i])

    for i in range(M):
        for op in ots[i].first:
            run(op, i, -1)
    # ---- forward
    for l in range(model.layers):
        pre_end = {}
        for i in range(M):
            lo = ots[i].layers[l]
            for op in lo.before:
                run(op, i, l)
            if not lo.moe:
                continue
            run(lo.router, i, l)
            if lo.shared is not None and not overlap.shared_overlap:
                run(lo.shared, i, l)
            c = comm_of(l, i)
            if c.host_wait_us > 0:  # the CPU waits for the counts: nothing issued after it starts sooner
                hw = tl.comm("host_wait", np.full(R, c.host_wait_us), l, "forward", 0.0, i, after=ready[i])
                tl.wait(hw)
                ready[i] = np.maximum(ready[i], hw)
            pre_end[i] = tl.comm("dispatch", c.forward.pre_R, l, "forward", c.sm_share, i, after=ready[i],
                                 held=_held(c, c.forward.pre_held))
        for i in pre_end:
            lo, c = ots[i].layers[l], comm_of(l, i)
            if lo.shared is not None and overlap.shared_overlap:
                run(lo.shared, i, l)
            e = tl.compute("expert", c.forward.expert_R, l, "forward", i, after=np.maximum(pre_end[i], ready[i]))
            post = tl.comm("combine", c.forward.post_R, l, "forward", c.sm_share, i, after=np.full(R, float(e.max())),
                           held=_held(c, c.forward.post_held))
            ready[i] = np.maximum(ready[i], post)
    for i in range(M):
        for op in ots[i].last:
            run(op, i, -1)
    if not train:
        return tl
    # ---- backward
    grad_end = np.zeros(R)
    for i in range(M):
        for op in reversed(ots[i].last):
            run(op, i, -1, True)
    for l in reversed(range(model.layers)):
        pre_end = {}
        for i in range(M):
            lo = ots[i].layers[l]
            if not lo.moe:
                for op in reversed(lo.before):
                    run(op, i, l, True)
                continue
            c = comm_of(l, i)
            pre_end[i] = tl.comm("combine_bwd", c.backward.pre_R, l, "backward", c.sm_share, i, after=ready[i],
                                 held=_held(c, c.backward.pre_held))
        for i in pre_end:
            lo, c = ots[i].layers[l], comm_of(l, i)
            if lo.shared is not None and overlap.shared_overlap:
                run(lo.shared, i, l, True)
            e = tl.compute("expert_bwd", c.backward.expert_R, l, "backward", i, after=np.maximum(pre_end[i], ready[i]))
            post = tl.comm("dispatch_bwd", c.backward.post_R, l, "backward", c.sm_share, i,
                           after=np.full(R, float(e.max())), held=_held(c, c.backward.post_held))
            g = post
            if c.backward.grad_R.max() > 0:
                g = tl.comm("grad_reduce", c.backward.grad_R, l, "backward", c.sm_share, i, after=post)
            grad_end = np.maximum(grad_end, g)
            ready[i] = np.maximum(ready[i], post if overlap.async_grad else g)
            if lo.shared is not None and not overlap.shared_overlap:
                run(lo.shared, i, l, True)
            run(lo.router, i, l, True)
            for op in reversed(lo.before):
                run(op, i, l, True)
    for i in range(M):
        for op in reversed(ots[i].first):
            run(op, i, -1, True)
    tl.wait(grad_end)  # the step ends once every gradient reduce has arrived
    return tl


__all__ = ["OpTimes", "all_ops", "compose", "stack_ops"]
