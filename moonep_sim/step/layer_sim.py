"""One MoE layer's communication, simulated in isolation, read back as per-rank segments.

Notation: R ranks. Times in microseconds.

Each MoE layer's Plan runs through the layer simulator (``moonep_sim.sim.engine.StepSim``: the
flow-level network, planning, prefetch, relays, SM caps) with its routed-expert compute replaced
by the step's cost model, forward and -- in train -- backward. The run is read back per direction
as four segments per rank, which the step composition (``moonep_sim.step.schedule``) places on the
rank's streams:

- ``pre_R``: from the layer's start to the rank's expert compute starting (planning, the routing
  all-gather, the dispatch hops, the copies' weights);
- ``expert_R``: the rank's routed-expert compute;
- ``post_R``: from the *last* rank's expert compute ending to this rank holding its combined rows
  (the combine is a collective: it cannot end before every sender computed);
- ``grad_R``: backward only, from the combine's end to the copies' gradients having reached home;
- ``pre_held`` / ``post_held``: of ``pre_R`` / ``post_R``, the time the rank's SMs are busy with
  the layer's own work, as ``(head_R, tail_R)``: at the segment's start its kernels' fixed cost
  (launch, send issue) and planning, at its end its local passes (receive copy, reduce) -- what a
  kernel family that frees its SMs while data is in flight (``KernelSpec.holds_sms`` False,
  DeepEP's low-latency kernels in hook mode) takes from compute.

What the composition assumes (``docs/steps.md``): every layer's communication is timed alone on
the network (no two layers' transfers share a link at once; a rank's communication stream is
serial, so its own layers never overlap, but rank a's combine of layer l may in reality meet rank
b's dispatch of layer l+1); a layer's collectives start on every rank at once (a barrier at the
latest rank's readiness).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import Plan
from moonep_sim.plan.kinds import Direction, PhaseKind
from moonep_sim.sim.analysis import straggler
from moonep_sim.sim.engine import StepSim, collector_paused
from moonep_sim.sim.kernels import kernel_sms, proxy_host_us
from moonep_sim.sim.options import SimOptions
from moonep_sim.sim.topology import Topology
from moonep_sim.step.costs import CostModel
from moonep_sim.step.fused_moe import fuse_layer, is_fused
from moonep_sim.step.recompute import expert_recompute_R


@dataclass(frozen=True)
class DirectionComm:
    """One direction of one layer, per rank (see the module docstring); ``layer_us``: the layer
    simulator's own time for this direction (first start to last end)."""

    pre_R: np.ndarray
    expert_R: np.ndarray
    post_R: np.ndarray
    grad_R: np.ndarray
    plan_R: np.ndarray
    layer_us: float
    pre_held: tuple[np.ndarray, np.ndarray] | None = None
    post_held: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class LayerComm:
    """A simulated MoE layer: forward, backward (None unless train), the straggler the layer
    simulator named, the SM share its communication kernels take from compute (for the whole of
    each collective when ``holds_sms``, else in its SM phases only: ``pre_held`` /
    ``post_held``), and the plan's rows per rank (real / padded), copies, and the entries it
    dropped of the layer's entries; ``host_wait_us``: the host's wait for the count exchange before
    the forward dispatch (``KernelSpec.host_wait_us``); ``proxy_host_us``: the host's time per
    dispatch or combine call of a host-proxy family (``moonep_sim.sim.kernels.proxy_host_us``)."""

    forward: DirectionComm
    backward: DirectionComm | None
    straggler: dict
    sm_share: float
    rows_R: np.ndarray
    padded_rows_R: np.ndarray
    copies_R: np.ndarray
    sim_us: float
    dropped: int = 0
    entries: int = 0
    holds_sms: bool = True
    host_wait_us: float = 0.0
    proxy_host_us: float = 0.0


#: Span kinds that keep a rank's SMs busy (its own work, not data in flight): at the start of a
#: collective (launch and send issue, planning) and at its end (receive copy, reduce).
SM_HEAD_KINDS = frozenset({PhaseKind.KERNEL_FIXED, PhaseKind.PLANNING})
SM_TAIL_KINDS = frozenset({PhaseKind.COPY})


def _span_ends(sim: StepSim) -> dict[Direction, tuple[list[float], list[float], list[float], list[float]]]:
    """Per direction, per rank: the latest end of the rank's spans of that direction (-inf: none),
    its planning time (the sum of its PLANNING and ROUTING_GATHER spans, in span order), and its
    SM-busy time before its expert compute and after it, each as (head, tail) (:data:`SM_HEAD_KINDS`,
    :data:`SM_TAIL_KINDS`). One pass over the spans for both directions."""
    R = sim.R
    dirs = (Direction.FORWARD, Direction.BACKWARD)
    out = {d: ([-np.inf] * R, [0.0] * R, ([0.0] * R, [0.0] * R), ([0.0] * R, [0.0] * R)) for d in dirs}
    starts = {d: sim.compute_start[min(i, len(sim.compute_start) - 1)].tolist() for i, d in enumerate(dirs)}
    planning = (PhaseKind.PLANNING, PhaseKind.ROUTING_GATHER)
    for r, _, kind, d, t0, t1 in sim.spans:
        d = d if d in out else Direction(d)
        end_R, plan_R, pre_R, post_R = out[d]
        if t1 > end_R[r]:  # combine hops and the passes after them (a reduce, a copy)
            end_R[r] = t1
        if kind in planning:
            plan_R[r] += t1 - t0
        if kind in SM_HEAD_KINDS or kind in SM_TAIL_KINDS:
            seg = pre_R if t1 <= starts[d][r] + 1e-9 else post_R
            seg[kind in SM_TAIL_KINDS][r] += t1 - t0
    return out


def _direction(sim: StepSim, si: int, direction: Direction, rec: dict[str, np.ndarray],
               spans: dict | None = None) -> DirectionComm:
    """Stage ``si`` of ``sim`` read back per rank (``rec``: the network's flow records;
    ``spans``: :func:`_span_ends`, if already read)."""
    R = sim.R
    start = sim.stage_start[si]
    c0, c1 = sim.compute_start[si], sim.compute_end[si]
    span_end_R, plan_l, pre_held, post_held = (spans if spans is not None else _span_ends(sim))[direction]
    comb_end = np.maximum(c1, np.array(span_end_R, dtype=np.float64))
    grad_end = np.zeros(R)
    plan_R = np.array(plan_l, dtype=np.float64)
    end = sim.stage_end[si]
    if rec["end"].size:  # the copies' gradients of this stage: per rank, the last one it sends or receives
        is_grad = np.array([t.kind == PhaseKind.GRAD_REDUCE and t.direction == direction
                            for t in (sim.net.phase_tag(p) for p in range(sim.net.num_phases))])
        m = is_grad[rec["phase"].astype(np.int64)]
        if m.any():
            for side in ("src", "dst"):
                np.maximum.at(grad_end, rec[side][m].astype(np.int64), rec["end"][m])
    grad_end = np.maximum(grad_end, comb_end)
    last = float(c1.max())
    pre_R, post_R = c0 - start, np.maximum(comb_end - last, 0.0)
    return DirectionComm(pre_R=pre_R, expert_R=c1 - c0, post_R=post_R,
                         grad_R=np.maximum(np.maximum(grad_end, end) - comb_end, 0.0), plan_R=plan_R,
                         layer_us=float(end.max() - start.min()),
                         pre_held=_held(pre_held, pre_R), post_held=_held(post_held, post_R))


def _held(ht: tuple[list[float], list[float]], dur_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(head_R, tail_R) SM-busy us of a segment, capped so that head + tail <= its duration."""
    head = np.minimum(np.array(ht[0], dtype=np.float64), dur_R)
    return head, np.minimum(np.array(ht[1], dtype=np.float64), dur_R - head)


def simulate_moe_layer(plan: Plan, model: ModelSpec, topo: Topology, costs: CostModel, train: bool,
                       tol: float | None = None) -> LayerComm:
    """Simulate ``plan`` (forward; backward too when ``train``) with the step's expert compute
    (with Python's cyclic collector paused: ``moonep_sim.sim.engine.collector_paused``)."""
    with collector_paused():
        comm = _simulate(plan, model, topo, costs, train, tol)
    return fuse_layer(comm, plan, topo.name, costs.gemm_dtype) if is_fused(plan) else comm  # one fused MoE kernel


def _simulate(plan: Plan, model: ModelSpec, topo: Topology, costs: CostModel, train: bool,
              tol: float | None) -> LayerComm:
    opts = SimOptions(backward=train) if tol is None else SimOptions(backward=train, tol=tol)
    sim = StepSim([plan], topo, model, opts)
    for si, (_, prog) in enumerate(sim.stages):  # the step's cost model prices the routed experts
        bwd = prog.direction == Direction.BACKWARD
        prog.compute_R = costs.expert_us_R(plan, model, backward=bwd) + \
            (expert_recompute_R(costs, plan, model) if bwd else 0.0)   # what the backward recomputes first
    sim.build()
    sim.run()
    rec = sim.net.records()
    require(not np.isnan(rec["end"]).any(), "simulation ended with unfinished transfers (internal error)", ConfigError)
    spans = _span_ends(sim)
    fwd = _direction(sim, 0, Direction.FORWARD, rec, spans)
    bwd = _direction(sim, 1, Direction.BACKWARD, rec, spans) if train else None
    # the two figures of the layer simulator's result the step reads (its end and straggler), as
    # ``sim_result`` computes them, without the result's lower bound and phase tables (a third of
    # a K3 EP64 layer's simulation time, unused by the step)
    end_R = sim.stage_end[-1].copy()
    sim_us = float(max(end_R.max() if end_R.size else 0.0, rec["end"].max() if rec["end"].size else 0.0))
    strag = straggler(sim, rec, end_R)
    sms = kernel_sms(topo, plan.kernel)
    share = min(1.0, sms / topo.sm_count) if topo.sm_count > 0 and sms > 0 else 0.0
    copies = np.bincount(plan.slot_rank_S[plan.is_copy_S()], minlength=plan.ranks)
    return LayerComm(fwd, bwd, strag, share, plan.real_rows_R().astype(np.int64),
                     plan.rows_R().astype(np.int64), copies.astype(np.int64), sim_us, _dropped(plan),
                     int(plan.num_tokens * plan.top_k),
                     holds_sms=plan.kernel is None or plan.kernel.holds_sms or costs.legacy,
                     host_wait_us=float(plan.kernel.host_wait_us) if plan.kernel is not None and not costs.legacy
                     else 0.0, proxy_host_us=0.0 if costs.legacy else proxy_host_us(plan))


def _dropped(plan: Plan) -> int:
    """``plan.dropped`` (entries of rank -1), reading the entries once when none is (the minimum
    of K3 EP64's 4M entries: 0.6 ms, against 1.0 ms for the count's mask)."""
    e = plan.entry_rank_TK
    if e.size == 0 or int(e.min()) >= 0:
        return 0
    return int(plan.dropped)


__all__ = ["DirectionComm", "LayerComm", "SM_HEAD_KINDS", "SM_TAIL_KINDS", "simulate_moe_layer"]
