"""Host CPU cores shared by the rank processes that run on them (processor sharing).

A cluster of CPU processes (``local-gloo``, the emulated testbed) runs several ranks on the same
few cores. A rank that is computing while the others wait in a collective has a core to itself;
when more ranks compute than there are cores, they share them evenly. :class:`HostCPU` models
exactly that: each job is an amount of work in microseconds *of one core*; while ``n`` jobs are
active on a host of ``c`` cores each progresses at ``min(1, c / n)`` (egalitarian processor
sharing). Ranks blocked in communication consume nothing, as gloo's waiting threads sleep.

The schedule is exact: on every arrival or completion the remaining work of the active jobs is
brought up to date and the next completion is scheduled (earlier schedules are discarded by a
version number), so the cost is O(active jobs) per event.
"""

from __future__ import annotations

import simpy

_EPS = 1e-6  # us of work: a job this close to done is done


class HostCPU:
    """``cores`` cores of one host, shared by the jobs submitted with :meth:`run`."""

    def __init__(self, env: simpy.Environment, cores: float):
        if cores <= 0:
            raise ValueError(f"cores ({cores}) must be > 0")
        self.env, self.cores = env, float(cores)
        self._left: dict[int, float] = {}   # job id -> remaining work (us of one core)
        self._done: dict[int, simpy.Event] = {}
        self._next_id = 0
        self._last = 0.0
        self._version = 0
        self.busy_core_us = 0.0             # integral of the cores in use over time

    def rate(self) -> float:
        """Progress per microsecond of each active job (1 = a core to itself)."""
        n = len(self._left)
        return min(1.0, self.cores / n) if n else 0.0

    def run(self, work_us: float) -> simpy.Event:
        """An event that fires when ``work_us`` microseconds of one core's work are done."""
        ev = self.env.event()
        if work_us <= 0:
            return ev.succeed()
        self._advance()
        jid = self._next_id
        self._next_id += 1
        self._left[jid] = float(work_us)
        self._done[jid] = ev
        self._schedule()
        return ev

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0 and self._left:
            r = self.rate()
            self.busy_core_us += dt * r * len(self._left)
            for j in self._left:
                self._left[j] -= dt * r
        self._last = now

    def _schedule(self) -> None:
        self._version += 1
        if not self._left:
            return
        v = self._version
        wait = max(min(self._left.values()), 0.0) / self.rate()
        self.env.timeout(wait).callbacks.append(lambda _ev: self._tick(v))

    def _tick(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later arrival or completion
        self._advance()
        finished = [j for j, w in self._left.items() if w <= _EPS]
        if not finished:  # rounding: the smallest job is a hair from done
            finished = [min(self._left, key=self._left.__getitem__)]
        for j in finished:
            del self._left[j]
            self._done.pop(j).succeed()
        self._schedule()


__all__ = ["HostCPU"]
