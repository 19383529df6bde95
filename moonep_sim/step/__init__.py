"""The step model: a training iteration, a prefill chunk or a decode pass of a whole MoE model.

Above the per-layer simulator (``moonep_sim.sim``) and below ``experiments``: a model's layer stack
(``stack``) priced op by op (``costs``), each MoE layer's Plan simulated alone (``layer_sim``),
composed on two streams per rank (``schedule``, ``compose``) under an overlap schedule
(``schedules``: one class per schedule behind a registry), each layer's attention one of the kinds
of ``attention`` (one record per kind behind a registry), with a
per-rank memory account (``memory``); ``run.simulate_step`` is the front. ``docs/steps.md``
explains the model, its assumptions and its constants.
"""

from moonep_sim.step.costs import CostModel, Profile, flat_cost_model, read_profile
from moonep_sim.step.memory import MemoryOptions, memory_per_rank
from moonep_sim.step.run import StepConfig, simulate_step
from moonep_sim.step.schedules import OVERLAPS, get_overlap
from moonep_sim.step.stack import MODES, StepShape, step_shape

__all__ = ["CostModel", "MODES", "MemoryOptions", "OVERLAPS", "Profile", "StepConfig", "StepShape", "flat_cost_model",
           "get_overlap", "memory_per_rank", "read_profile", "simulate_step", "step_shape"]
