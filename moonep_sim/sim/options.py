"""How to simulate: :class:`SimOptions` (validated when built) and the default network tolerance."""

from __future__ import annotations

from dataclasses import dataclass

from moonep_sim.errors import require
from moonep_sim.limits import MAX_CHUNKS, MAX_JITTER_CV
from moonep_sim.perf import DEFAULT_PERF, PerfConfig

DEFAULT_TOL = 0.002


@dataclass(frozen=True)
class SimOptions:
    """How to simulate.

    backward: also run the backward direction after the forward (a training step).
    overlap_prefetch: send copied weights at planning end, concurrently with dispatch (else after
        the home received its dispatch rows).
    chunks: pipeline dispatch, compute and combine in this many chunks (1 = no pipelining).
    seed: seeds the jitter draws.  jitter: coefficient of variation of the lognormal (mean 1)
        factor stretching every compute and transfer (0 = none).
    faults: SlowGPU / DegradedLink / Stall objects (``moonep_sim.sim.faults``).
    tol: network coalescing tolerance (``moonep_sim.sim.network``): 0 = exact flow-level model;
        the default 0.002 is much faster at large R and moves a layer's end by well under 1%
        (tested: within [1 - tol, 1 + 20 x tol] of exact on random and adversarial families; not
        a bound for every plan, since max-min sharing is not monotone: docs/simulator.md).
    isolate: ``"dispatch"`` or ``"combine"``: time only those phases, all ranks starting at 0,
        no planning and no compute (how DeepEP times a kernel alone).
    timeline: record per-rank spans and port utilisation counters for a Perfetto trace.
    planning: include the planning cost in the forward.
    perf: where the network's compiled submission runs (``PerfConfig.pair_table_max``): how the
        records are computed, not what they are (see :class:`~moonep_sim.sim.network.FlowNetwork`).
    """

    backward: bool = False
    overlap_prefetch: bool = True
    chunks: int = 1
    seed: int = 0
    faults: tuple = ()
    jitter: float = 0.0
    tol: float = DEFAULT_TOL
    isolate: str | None = None
    timeline: bool = False
    planning: bool = True
    perf: PerfConfig = DEFAULT_PERF

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults or ()))
        require(1 <= self.chunks <= MAX_CHUNKS, f"chunks ({self.chunks}) must be in [1, {MAX_CHUNKS}]")
        require(0 <= self.jitter <= MAX_JITTER_CV,
                f"jitter ({self.jitter}) must be in [0, {MAX_JITTER_CV:g}] (a coefficient of variation)")
        require(0 <= self.tol < 0.2, f"tol ({self.tol}) must lie in [0, 0.2)")
        require(self.isolate in (None, "dispatch", "combine"),
                f"isolate ({self.isolate!r}) must be None, 'dispatch' or 'combine'")


__all__ = ["DEFAULT_TOL", "SimOptions"]
