"""Pipeline schedules: one class per schedule, one module per class, looked up by name.

:mod:`.base` holds what they share (the op record, the chunk times, the timing of a schedule's
per-rank orders, the timed run); the schedules:

- ``1f1b`` (:mod:`.one_f_one_b`): PipeDream-flush, Megatron-Core's default.
- ``interleaved`` (:mod:`.interleaved`): Megatron-Core's virtual pipeline, vpp chunks per rank.
- ``combined-1f1b`` (:mod:`.interleaved`): interleaved with Megatron-Core's EP all-to-all overlap
  (``overlap_moe_expert_parallel_comm``: steady forward-backward pairs as FB ops), chosen by that flag.
- ``dualpipe`` (:mod:`.dualpipe`): DeepSeek-V3's bidirectional schedule with overlapped chunk pairs.

Adding a schedule: a module here with a :class:`~.base.Schedule` subclass decorated
``@PIPELINE_SCHEDULES.register`` (its ``name``, chunks, ranks, paths and per-rank orders), and its
module name in the list below.
"""

from __future__ import annotations

from moonep_sim.registry import Registry
from moonep_sim.step.pipelines.base import Schedule

#: The pipeline schedules by ``--pp-schedule`` name (classes; :func:`get_schedule` makes one).
PIPELINE_SCHEDULES: Registry[type[Schedule]] = Registry("pp schedule", __name__,
                                                         ("one_f_one_b", "interleaved", "dualpipe"))


def get_schedule(name: str, pp: int, vpp: int, m: int) -> Schedule:
    """Schedule ``name`` for ``pp`` ranks, ``vpp`` chunks per rank and ``m`` micro-batches (one-line
    error for an unknown name or a shape it cannot run)."""
    return PIPELINE_SCHEDULES.get(name)(pp, vpp, m)


__all__ = ["PIPELINE_SCHEDULES", "Schedule", "get_schedule"]
