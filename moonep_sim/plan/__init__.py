"""The Plan data model, expert placement and invariants."""

from moonep_sim.plan.placement import ClusterShape, Placement
from moonep_sim.plan.plan import (CommPhase, GlobalRouting, Hop, Plan, RowCosts, check, layout_slots,
                                  plan_from_slots, single_hop_messages, validate)

__all__ = ["ClusterShape", "CommPhase", "GlobalRouting", "Hop", "Placement", "Plan", "RowCosts", "check",
           "layout_slots", "plan_from_slots", "single_hop_messages", "validate"]
