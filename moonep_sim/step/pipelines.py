"""The pipeline schedules' registry, filled: every shipped schedule imported
(:mod:`moonep_sim.step.pipeline` defines the base and the timing; one module per schedule)."""

from __future__ import annotations

from moonep_sim.errors import require
from moonep_sim.step import pipeline_1f1b, pipeline_dualpipe, pipeline_interleaved  # noqa: F401  (they register)
from moonep_sim.step.pipeline import SCHEDULES, Schedule


def get_schedule(name: str, pp: int, vpp: int, m: int) -> Schedule:
    """Schedule ``name`` for ``pp`` ranks, ``vpp`` chunks per rank and ``m`` micro-batches (one-line
    error for an unknown name or a shape it cannot run)."""
    require(name in SCHEDULES, f"pp schedule ({name!r}) must be one of {', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[name](pp, vpp, m)


__all__ = ["get_schedule"]
