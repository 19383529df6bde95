"""Performance settings: where the compiled kernels and a second thread take over, as one typed value.

Each setting decides *how* a result is computed, never *what* it is: every path it picks between is
held equal to its reference (the same Plans, draws, records, bit for bit), so a caller may pass any
:class:`PerfConfig` and get the same result, sooner or later. Functions that branch on one take a
``perf`` argument defaulting to :data:`DEFAULT_PERF` (DeepEP's ``get_dispatch_config`` pattern:
documented defaults, overridden by passing a value, never by editing a module global); tests pass
``PerfConfig(...)`` to run a path at a size where the defaults would not take it.

The defaults were measured on the benchmarks named beside each field (docs/results/tiers.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from moonep_sim.errors import is_int, require


@dataclass(frozen=True)
class PerfConfig:
    """Size thresholds of the package's fast paths (counts of items, not bytes).

    plan_compiled_min: entries (tokens x top-k) from which the Plan builders and the planners' slot
        passes run the compiled kernels (``moonep_sim.plan.compiled``); below it the readable numpy
        builders run (the compiled module is imported only then: a fresh process pays numba's start,
        ~0.25 CPU s, at its first compiled call). 65536: below it the two cost the same within a
        few ms (benchmarks/bench_plan.py).
    thread_min: entries plus messages from which a Plan's independent pieces of work (validation's
        hop check; capacity's and allgather's hop beside their layout) run on a second thread. Below it a thread's start costs more than
        it saves. The CPU time is the same either way; the wall time falls on two cores.
    pair_rows_compiled_min: messages from which ``Hop.rows_RR`` counts rows per (source,
        destination) pair with its compiled pass (below: ``np.bincount``).
    pair_table_max: (sender, receiver) pairs up to which a flow network builds its per-port-map
        pair tables (each pair's block and latency, read by the compiled submission); above it
        submissions classify their transfers in numpy. 2**18: 512 ranks.
    validate_chunk: entries, messages or final rows per chunk of ``moonep_sim.plan.validate``'s
        walks (at least 1): each chunk's temporaries stay in cache and are reused, where
        whole-array temporaries cost fresh zeroed pages -- ~3 GiB per validate of an all-gather's
        hop (33.5M messages at K3 EP64), the bulk of a first run's system time.
    block_walk_min_mean: messages per (source, destination) block on average from which a sorted
        hop is walked block by block (each block's ranks scalars: an all-gather's hop ~3x faster).
    """

    plan_compiled_min: int = 1 << 16
    thread_min: int = 1 << 20
    pair_rows_compiled_min: int = 1 << 16
    pair_table_max: int = 1 << 18
    validate_chunk: int = 1 << 18
    block_walk_min_mean: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):  # every setting is a count
            v = getattr(self, f.name)
            require(is_int(v) and v >= 0, f"{f.name} ({v!r}) must be an integer >= 0")
        require(self.validate_chunk >= 1, f"validate_chunk ({self.validate_chunk}) must be >= 1: entries per chunk")


#: the settings every function uses unless given others
DEFAULT_PERF = PerfConfig()


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity set, else ``os.cpu_count()``): whether a
    step's second thread pays, the default number of worker processes, a calibration's ``cpu_cores``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


__all__ = ["DEFAULT_PERF", "PerfConfig", "host_cores"]
