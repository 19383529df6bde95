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
- ``grad_R``: backward only, from the combine's end to the copies' gradients having reached home.

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
from moonep_sim.sim.engine import StepSim
from moonep_sim.sim.kernels import kernel_sms
from moonep_sim.sim.options import SimOptions
from moonep_sim.sim.topology import Topology
from moonep_sim.step.costs import CostModel


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


@dataclass(frozen=True)
class LayerComm:
    """A simulated MoE layer: forward, backward (None unless train), the straggler the layer
    simulator named, the SM share its communication kernels take from compute, and the plan's
    rows per rank (real / padded), copies, and the entries it dropped of the layer's entries."""

    forward: DirectionComm
    backward: DirectionComm | None
    straggler: dict
    sm_share: float
    rows_R: np.ndarray
    padded_rows_R: np.ndarray
    copies_R: np.ndarray
    sim_us: float
    plan_seconds: float
    dropped: int = 0
    entries: int = 0


def _direction(sim: StepSim, si: int, direction: Direction, rec: dict[str, np.ndarray]) -> DirectionComm:
    """Stage ``si`` of ``sim`` read back per rank (``rec``: the network's flow records)."""
    R = sim.R
    start = sim.stage_start[si]
    c0, c1 = sim.compute_start[si], sim.compute_end[si]
    comb_end = c1.copy()
    grad_end = np.zeros(R)
    plan_R = np.zeros(R)
    for s in sim.spans:
        if s.direction != direction:
            continue
        if s.end_us > comb_end[s.rank]:  # combine hops and the passes after them (a reduce, a copy)
            comb_end[s.rank] = s.end_us
        if s.kind in (PhaseKind.PLANNING, PhaseKind.ROUTING_GATHER):
            plan_R[s.rank] += s.end_us - s.start_us
    end = sim.stage_end[si]
    comb_end = np.maximum(comb_end, c1)
    if rec["end"].size:  # the copies' gradients of this stage: per rank, the last one it sends or receives
        tags = [sim.net.phase_tag(p) for p in range(sim.net.num_phases)]
        is_grad = np.array([t.kind == PhaseKind.GRAD_REDUCE and t.direction == direction for t in tags])
        m = is_grad[rec["phase"].astype(np.int64)]
        if m.any():
            for side in ("src", "dst"):
                np.maximum.at(grad_end, rec[side][m].astype(np.int64), rec["end"][m])
    grad_end = np.maximum(grad_end, comb_end)
    last = float(c1.max())
    return DirectionComm(pre_R=c0 - start, expert_R=c1 - c0, post_R=np.maximum(comb_end - last, 0.0),
                         grad_R=np.maximum(np.maximum(grad_end, end) - comb_end, 0.0), plan_R=plan_R,
                         layer_us=float(end.max() - start.min()))


def simulate_moe_layer(plan: Plan, model: ModelSpec, topo: Topology, costs: CostModel, train: bool,
                       tol: float | None = None) -> LayerComm:
    """Simulate ``plan`` (forward; backward too when ``train``) with the step's expert compute."""
    opts = SimOptions(backward=train) if tol is None else SimOptions(backward=train, tol=tol)
    sim = StepSim([plan], topo, model, opts)
    for si, (_, prog) in enumerate(sim.stages):  # the step's cost model prices the routed experts
        prog.compute_R = costs.expert_us_R(plan, model, backward=(prog.direction == Direction.BACKWARD))
    sim.build()
    sim.env.run()
    rec = sim.net.records()
    require(not np.isnan(rec["end"]).any(), "simulation ended with unfinished transfers (internal error)", ConfigError)
    fwd = _direction(sim, 0, Direction.FORWARD, rec)
    bwd = _direction(sim, 1, Direction.BACKWARD, rec) if train else None
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
                     plan.rows_R().astype(np.int64), copies.astype(np.int64), sim_us,
                     float(plan.plan_seconds), int(plan.dropped), int(plan.num_tokens * plan.top_k))


__all__ = ["DirectionComm", "LayerComm", "simulate_moe_layer"]
