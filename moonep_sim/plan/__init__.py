"""The Plan: its IR, typed phase vocabulary, named invariant checks, builders and placement.

Modules, bottom-up: ``kinds`` (PhaseKind, Scope, Direction; INDEX, the dtype of the Plan's index arrays), ``order`` (sorting primitives),
``placement`` (ClusterShape, Placement), ``validate`` (the named checks), ``ir`` (RowCosts,
GlobalRouting, Hop, CommPhase, Plan), ``build`` (the single-hop builder API, ``assemble_plan``),
``assembly`` (the named records the builders take: Slots, Route, Entries, Padding),
``multihop`` (routes over several hops), ``hops`` (hop builders a strategy composes into a
route: ``to_final``, ``to_node_of_final``, ``to_rail_of_final``, ``via``; ``plan_from_hops``),
``reference`` (the readable primitives: the builders' form below the compiled threshold and what the
compiled kernels are tested against), ``compiled`` (the one seam: whether the compiled kernels of ``fused`` /
``fused_routes`` run a layer), ``runs`` (each entry's slot from its key's run: the planners' slot passes), ``threads`` (Beside: one piece of a large Plan's work on a second thread), ``kernel`` (KernelSpec: the GPU kernels behind a Plan,
for the simulator), ``direct`` (the executors' point-to-point decision). Module map:
docs/architecture.md.
Strategies (``moonep_sim.strategies``) use the builders exported here, never private helpers.
"""

from moonep_sim.plan.assembly import Entries, Padding, Route, Slots
from moonep_sim.plan.build import SlotLayout, assemble_plan, final_rows, plan_from_slots, slot_layout
from moonep_sim.plan.hops import HopSpec, plan_from_hops, to_final, to_node_of_final, to_rail_of_final, via
from moonep_sim.plan.ir import CommPhase, GlobalRouting, Hop, Plan, RowCosts
from moonep_sim.plan.kinds import INDEX, SCOPES, Direction, PhaseKind, Scope
from moonep_sim.plan.multihop import dup_flags, home_slots, plan_from_routes
from moonep_sim.plan.order import entry_token
from moonep_sim.plan.placement import ClusterShape, Placement
from moonep_sim.plan.reference import route_hop, single_hop_messages
from moonep_sim.plan.validate import CHECKS, Violation, check, validate, violations

__all__ = ["CHECKS", "ClusterShape", "CommPhase", "Direction", "Entries", "GlobalRouting", "Hop", "HopSpec", "INDEX", "PhaseKind",
           "Padding", "Placement", "Route", "Slots", "plan_from_hops", "to_final", "to_node_of_final", "to_rail_of_final", "via",
           "Plan", "RowCosts", "SCOPES", "Scope", "SlotLayout", "Violation", "assemble_plan",
           "check", "dup_flags", "entry_token", "final_rows", "home_slots",
           "plan_from_routes", "plan_from_slots", "route_hop", "single_hop_messages", "slot_layout",
           "validate", "violations"]
