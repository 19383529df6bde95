"""The step model: a training iteration, a prefill chunk or a decode pass of a whole MoE model.

Above the per-layer simulator (``moonep_sim.sim``) and below ``experiments``: a model's layer stack
(``stack``) priced op by op (``costs``), each MoE layer's Plan simulated alone (``layer_sim``),
composed on two streams per rank (``schedule``, ``compose``) under an overlap schedule
(``schedules``: one class per schedule behind a registry), each layer's attention one of the kinds
of ``attention`` (one record per kind behind a registry), with a
per-rank memory account (``memory``); ``run.simulate_step`` is the front, ``layer_work`` how its
layers run (in order, on a worker pool, or pipelined on two threads). ``docs/steps.md``
explains the model, its assumptions and its constants.
"""

import importlib

#: What the package exports, by the module that defines it: imported on first use (PEP 562), so that
#: reading a registry of the step model (``moonep_sim.step.schedules``, ``.attention``) does not
#: import the simulator -- the command line builds its ``--overlap`` choices from the registry.
_EXPORTS = {"CostModel": "costs", "Profile": "costs", "flat_cost_model": "costs", "read_profile": "costs",
            "MemoryOptions": "memory", "memory_per_rank": "memory", "StepConfig": "run", "simulate_step": "run",
            "OVERLAPS": "schedules", "get_overlap": "schedules", "MODES": "stack", "StepShape": "stack",
            "step_shape": "stack"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
