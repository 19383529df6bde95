"""Two independent pieces of a large Plan's work at once: one on a second thread, one on this one.

numpy releases the GIL inside its loops over arrays (ufuncs, sorts, gathers and scatters), so two
numpy-bound pieces that share no array being written overlap on two cores: the wall time falls,
the CPU time (all threads: ``getrusage(RUSAGE_SELF)``) does not. Used by ``validate`` (the hop check
beside the entry checks) and the ``capacity`` and ``allgather`` planners (their layout beside their
hop). Below ``perf.thread_min`` items (:class:`~moonep_sim.perf.PerfConfig`)
a thread's start costs more than it saves, and the work runs in order on this thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

class Beside:
    """``fn(*args)`` started on a second thread (a one-worker :class:`~concurrent.futures.ThreadPoolExecutor`
    of its own, shut down once the value is taken: nothing is left running, and a process forked
    later inherits no pool); :meth:`result` waits for it and returns its value (or raises what it
    raised). ``run=False``: nothing is started, :meth:`result` calls ``fn`` then, on the caller's
    thread (the order the work would run in without threads). As a context manager, the block is
    the work done beside it: an exception leaving the block discards the piece (waits for it, drops
    its value) before it propagates, so no thread outlives a failed build."""

    def __init__(self, fn: Callable[..., Any], *args: Any, run: bool = True) -> None:
        self._fn, self._args = fn, args
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moonep-plan") if run else None
        self._future = self._pool.submit(fn, *args) if self._pool is not None else None

    def __enter__(self) -> "Beside":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.discard()
        return False

    def result(self) -> Any:
        if self._future is None:
            return self._fn(*self._args)
        try:
            return self._future.result()
        finally:
            self._pool.shutdown(wait=True)

    def discard(self) -> None:
        """Wait for the thread (if any) and drop its value or error: the caller no longer needs it."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["Beside"]
