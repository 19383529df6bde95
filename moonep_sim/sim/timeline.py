"""Layer and step timelines: any Plan timed on a topology, with the real executor's dependencies.

Notation: R ranks. Times in microseconds of simulated time.

The simulator reads only the Plan's data: ``plan.phases(direction)`` (per-phase [R, R] bytes with
a :class:`~moonep_sim.plan.kinds.PhaseKind`), its slots (rows per expert per rank, padding
included) and the copies. It never looks at the strategy's name. Per direction the phases are
grouped by kind (``moonep_sim.sim.program``):

- DISPATCH (forward ``dispatch.h``; backward ``combine_bwd.h``): the hops before expert compute;
- PREFETCH / MIGRATE: expert weights that must arrive before compute;
- COMBINE (forward ``combine.h``; backward ``dispatch_bwd.h``): the hops after compute;
- GRAD_REDUCE: the copies' weight gradients, sent home after the backward compute.

The modules: ``options`` (:class:`SimOptions`), ``program`` (a direction of a layer as a program
of phases and local work), ``engine`` (the simpy processes per rank and their dependencies),
``analysis`` (phase spans, straggler, busiest port, :class:`SimResult`). This module is the front:
:func:`simulate_layer` and :func:`simulate_layers` (several layers chained on each rank; with
``backward`` the backward runs after the last forward, layers reversed: a training step).
"""

from __future__ import annotations

import time
from typing import Sequence

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import Plan
from moonep_sim.sim.analysis import SimResult, sim_result
from moonep_sim.sim.engine import StepSim
from moonep_sim.sim.options import DEFAULT_TOL, SimOptions
from moonep_sim.sim.topology import Topology


def simulate_layers(plans: Sequence[Plan], topo: Topology, model: ModelSpec, opts: SimOptions | None = None) -> SimResult:
    """Time several layers back to back (a step): each rank starts layer l+1 when it finished
    layer l; with ``opts.backward`` the backward runs after the last forward, layers reversed."""
    opts = opts or SimOptions()
    require(len(plans) >= 1, "plans must hold at least one layer")
    t0 = time.perf_counter()
    sim = StepSim(list(plans), topo, model, opts)
    sim.build()
    sim.run()
    res = sim_result(sim, 0.0)
    res.sim_stats["wall_seconds"] = time.perf_counter() - t0
    return res


def simulate_layer(plan: Plan, topo: Topology, model: ModelSpec, opts: SimOptions | None = None) -> SimResult:
    """Time one layer of ``plan`` on ``topo`` (see ``moonep_sim.sim.engine`` for the dependencies)."""
    return simulate_layers([plan], topo, model, opts)


__all__ = ["DEFAULT_TOL", "SimOptions", "SimResult", "simulate_layer", "simulate_layers"]
