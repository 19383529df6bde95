"""The one seam between the readable builders and the compiled kernels of :mod:`moonep_sim.plan`.

Every builder with a compiled form asks :func:`covers` once, at its top, whether the compiled kernels
run its layer; the kernels themselves live in ``fused`` (the slot layout, one global hop and its
final rows; the planners' slot passes) and ``fused_routes`` (two hops over [R, R] route tables),
imported only when they run (a fresh process pays numba's start, ~0.25 CPU s, at its first compiled
call). The answer depends on the layer's size and the caller's
:class:`~moonep_sim.perf.PerfConfig` alone, never on the result: every kernel gives its readable
builder's arrays, values and dtypes (``tests/test_plan_fused.py``), so a test passes
``PerfConfig(plan_compiled_min=0)`` to run the kernels on a small layer and
``PerfConfig(plan_compiled_min=1 << 62)`` to run the readable builders on a large one.

Both forms check their inputs alike: :func:`key_starts` (pieces or replicas given by key) and
:func:`check_at` (the refusal naming the first entry out of range) are shared by them.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig


def covers(n_entries: int, perf: PerfConfig = DEFAULT_PERF) -> bool:
    """Whether a layer of ``n_entries`` entries (tokens x top-k) takes the compiled kernels."""
    return int(n_entries) >= perf.plan_compiled_min


def key_starts(key_P, n_keys: int, what: str) -> np.ndarray:
    """int64 [n_keys + 1] each key's first place among ``key_P`` (int [P], non-decreasing keys in
    [0, n_keys): else :class:`PlanError` naming the ``what`` keys), the end last."""
    pk = np.asarray(key_P, dtype=np.int64)
    X = int(n_keys)
    if pk.size and (bool((pk[1:] < pk[:-1]).any()) or int(pk[0]) < 0 or int(pk[-1]) >= X):
        raise PlanError(f"{what} keys must be non-decreasing in [0, {X})")
    return np.searchsorted(pk, np.arange(X + 1))


def check_at(at: int, what: str) -> None:
    """Raise the kernels' refusal: ``what`` at entry ``at`` (>= 0; -1 = all in range)."""
    if at >= 0:
        raise PlanError(f"{what} at position {at} must lie in range")


__all__ = ["check_at", "covers", "key_starts"]
