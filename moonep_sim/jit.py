"""Compiled kernels: the loops numpy cannot express without one array pass per step.

A few paths of the project are sequences of many small steps, each cheap, whose cost in numpy is
the per-call overhead rather than the arithmetic (the simulator's progressive filling: tens of
steps per rate change, a few to a few hundred ports each; a counting sort of millions of entries
by a few thousand slots). Those are written as plain loops and compiled with numba
(:data:`kernel`: ``numba.njit`` with ``cache=True`` and ``nogil=True``, so a step's second thread
runs beside them).

Where the compiled code is kept: numba's own order -- ``NUMBA_CACHE_DIR`` when set, else the
package's ``__pycache__`` when it is writable, else the user's cache folder
(``$XDG_CACHE_HOME/numba``, ``~/.cache/numba``). Installed where none of them can be written (a
read-only site-packages and home, a container), the kernels are compiled in memory instead, once
per process (10-20 CPU s on first use), and one line on stderr says so and how to give them a
folder (:func:`njit`).

Each kernel keeps the numpy code it replaces as its reference and is tested against it (the same
values, in the same order of floating-point operations where the result is a float). Setting
``NUMBA_DISABLE_JIT=1`` runs every kernel as the Python it is written in (slow; for debugging).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numba
import numba.core.event

#: the one line a process prints when its kernels cannot be cached (see the module docstring)
NO_CACHE_NOTE = ("moonep-sim: note: no writable folder for compiled kernels (the package's __pycache__ and the user "
                 "cache folder are read-only): compiling them in memory for this run; set NUMBA_CACHE_DIR to a "
                 "writable folder to keep them")
_said = False
_uncached: set[int] = set()  # id() of the dispatchers compiled in memory


def _note_once() -> None:
    global _said
    if not _said:
        _said = True
        print(NO_CACHE_NOTE, file=sys.stderr, flush=True)


class _FirstCompile(numba.core.event.Listener):
    """Says :data:`NO_CACHE_NOTE` when one of the uncached kernels is first compiled (not when it is
    merely imported: ``--version`` compiles nothing and says nothing)."""

    def on_start(self, event) -> None:
        if id(event.data.get("dispatcher")) in _uncached:
            _note_once()

    def on_end(self, event) -> None:
        pass


_listener: _FirstCompile | None = None


def njit(**options: Any) -> Callable[[Callable], Callable]:
    """``numba.njit(cache=True, **options)``, falling back to ``cache=False`` (compiled in memory,
    :data:`NO_CACHE_NOTE` printed once per process, when the first such kernel compiles) when numba finds no writable folder for the
    function's cache -- numba refuses such a function at decoration with ``RuntimeError: cannot
    cache function ...: no locator available``."""
    cached, uncached = numba.njit(cache=True, **options), numba.njit(cache=False, **options)

    def decorate(fn: Callable) -> Callable:
        try:
            return cached(fn)
        except RuntimeError as e:
            if "cannot cache" not in str(e):
                raise
            global _listener
            if _listener is None:
                _listener = _FirstCompile()
                numba.core.event.register("numba:compile", _listener)
            disp = uncached(fn)
            _uncached.add(id(disp))
            return disp
    return decorate


#: the decorator of every compiled kernel: ``@kernel`` over a function of numpy arrays and scalars
kernel = njit(nogil=True)
#: a kernel's step inlined into its callers at numba's IR level (``inline="always"``): one copy of
#: a piece several kernels share, compiled into each hot loop. Measure before folding a piece that
#: takes arrays: the inlined call still counts the arrays' references on every iteration
#: (routing/sampling_kernels.py gives the figures).
inline = njit(inline="always", nogil=True)

__all__ = ["NO_CACHE_NOTE", "inline", "kernel", "njit"]
