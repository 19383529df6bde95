"""Compiled kernels: the loops numpy cannot express without one array pass per step.

A few paths of the project are sequences of many small steps, each cheap, whose cost in numpy is
the per-call overhead rather than the arithmetic (the simulator's progressive filling: tens of
steps per rate change, a few to a few hundred ports each; a counting sort of millions of entries
by a few thousand slots). Those are written as plain loops and compiled with numba
(:data:`kernel`: ``numba.njit`` with ``cache=True`` -- compiled once per machine and kept next to
the module under ``__pycache__`` -- and ``nogil=True``, so a step's second thread runs beside them).

Each kernel keeps the numpy code it replaces as its reference and is tested against it (the same
values, in the same order of floating-point operations where the result is a float). Setting
``NUMBA_DISABLE_JIT=1`` runs every kernel as the Python it is written in (slow; for debugging).
"""

from __future__ import annotations

import numba

#: the decorator of every compiled kernel: ``@kernel`` over a function of numpy arrays and scalars
kernel = numba.njit(cache=True, nogil=True)
#: a kernel's step inlined into its callers at numba's IR level (``inline="always"``): one copy of
#: a piece several kernels share, compiled into each hot loop. Measure before folding a piece that
#: takes arrays: the inlined call still counts the arrays' references on every iteration
#: (routing/sampling_kernels.py gives the figures).
inline = numba.njit(inline="always", cache=True, nogil=True)

__all__ = ["inline", "kernel"]
