"""Overlap schedules: one class per schedule, one module per class, looked up by name.

A schedule (:class:`Schedule`) issues a step's ops on the two-stream
:class:`~moonep_sim.step.schedule.Timeline` through the primitives of
:class:`~moonep_sim.step.compose.Program` (the shared mechanism: op prices, each micro-batch's
ready time, the MoE blocks' collectives); ``compose()`` builds the program and calls
``schedule.issue``. :class:`LayerSchedule` is the layer-by-layer program every built-in schedule
shares; a subclass states only its MoE block's order:

- ``none`` (:mod:`.none`): everything in series.
- ``shared-expert`` (:mod:`.shared_expert`, MoonEP issue #15): the shared experts beside the
  dispatch and the gradients' dispatch; the gradient reduce off the compute stream.
- ``two-batch`` (:mod:`.two_batch`, DeepSeek's dual micro-batch overlap, SGLang's two-batch
  overlap): ``shared-expert`` on two micro-batches, one's communication beside the other's compute.

Adding a schedule: a module ``moonep_sim/step/schedules/<name>.py`` with a class decorated
``@OVERLAP_SCHEDULES.register`` (a :class:`LayerSchedule` stating its three phases, or a
:class:`Schedule` issuing the whole step), and its module name in the list below. The same
:class:`~moonep_sim.registry.Registry` pattern serves any other family of schedules or policies
(pipeline schedules, serving policies): a registry of its own, one module per record.
"""

from __future__ import annotations

from moonep_sim.registry import Registry
from moonep_sim.step.schedules.base import LayerSchedule, Schedule

#: The overlap schedules by ``--overlap`` name (classes; :func:`get_overlap` makes one).
OVERLAP_SCHEDULES: Registry[type[Schedule]] = Registry("overlap", __name__, ("none", "shared_expert", "two_batch"))


def get_overlap(name: str) -> Schedule:
    """The overlap schedule called ``name`` (one-line ConfigError naming the schedules otherwise)."""
    return OVERLAP_SCHEDULES.get(name)()


#: The built-in schedules' names, in the order of the module list (the CLI's ``--overlap`` choices).
OVERLAPS = OVERLAP_SCHEDULES.names()

__all__ = ["LayerSchedule", "OVERLAPS", "OVERLAP_SCHEDULES", "Schedule", "get_overlap"]
