"""The two-stream timeline a step is composed on (the overlap schedules issue their ops on it:
``moonep_sim.step.schedules``), and its export as records and Perfetto events.

Notation: R ranks, M micro-batches. Times in microseconds.

Every rank has a **compute stream** and a **communication stream**; each runs its ops in program
order, an op starting once its stream is free and its inputs are ready (:class:`Timeline`).
Communication ops of a MoE layer are collectives: they start on every rank at once, when the
latest rank is ready. While a communication kernel runs it takes its SMs from compute
(``KernelSpec.sms`` / the GPU's SM count): a compute op overlapping it progresses at ``1 - share``
of its rate (``share`` 1, e.g. the low-latency kernels on every SM: no progress) -- see
:meth:`Timeline.compute`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class Event:
    """One op on one stream of every rank: start_R / end_R [R] us (NaN-free)."""

    name: str
    stream: str          # "compute" | "comm"
    layer: int           # -1 = embedding / head
    direction: str       # "forward" | "backward"
    micro_batch: int
    start_R: np.ndarray
    end_R: np.ndarray


@dataclass
class Timeline:
    """Two streams per rank, ops placed in program order (see the module docstring)."""

    R: int
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.compute_free = np.zeros(self.R)
        self.comm_free = np.zeros(self.R)
        self._comm_iv: list[tuple[np.ndarray, np.ndarray, float]] = []

    def _stretch(self, s: np.ndarray, work: np.ndarray) -> np.ndarray:
        """End of ``work`` us of compute started at ``s``, slowed where communication kernels run."""
        t, rem = s.copy(), work.astype(np.float64).copy()
        for a, b, f in self._comm_iv[-4:]:
            if f <= 0:
                continue
            use = np.minimum(np.clip(a - t, 0.0, None), rem)  # before the interval: full rate
            t, rem = t + use, rem - use
            busy = rem > 0
            t = np.where(busy, np.maximum(t, a), t)
            inside = np.clip(b - t, 0.0, None) * busy
            if f >= 1:
                t = t + inside
            else:
                use = np.minimum(inside * (1 - f), rem)
                t, rem = t + use / (1 - f), rem - use
        return t + rem

    def compute(self, name: str, us, layer: int, direction: str, mb: int = 0,
                after: np.ndarray | None = None) -> np.ndarray:
        """Place a compute op of ``us`` (scalar or [R]) after ``after`` [R]; returns its end [R]."""
        dur = np.broadcast_to(np.asarray(us, np.float64), (self.R,))
        s = self.compute_free if after is None else np.maximum(self.compute_free, after)
        e = self._stretch(s, dur)
        self.compute_free = e
        self.events.append(Event(name, "compute", layer, direction, mb, s.copy(), e.copy()))
        return e

    def comm(self, name: str, dur_R: np.ndarray, layer: int, direction: str, share: float, mb: int = 0,
             after: np.ndarray | None = None) -> np.ndarray:
        """Place a collective of per-rank durations ``dur_R`` once every rank is ready; its
        kernels take ``share`` of the SMs from overlapping compute. Returns its end [R]."""
        ready = self.comm_free if after is None else np.maximum(self.comm_free, after)
        s = np.full(self.R, float(ready.max()))
        e = s + np.asarray(dur_R, np.float64)
        self.comm_free = e
        self._comm_iv.append((s, e, float(share)))
        self.events.append(Event(name, "comm", layer, direction, mb, s, e.copy()))
        return e

    def wait(self, ready_R: np.ndarray) -> None:
        """The compute stream waits for ``ready_R`` (a combine's result the next op consumes)."""
        self.compute_free = np.maximum(self.compute_free, ready_R)

    def end_R(self) -> np.ndarray:
        return np.maximum(self.compute_free, self.comm_free)


def timeline_records(tl: Timeline, ranks: Sequence[int] | None = None) -> list[dict]:
    """Plain records ``{rank, stream, name, layer, direction, micro_batch, start_us, end_us}`` of
    every op on the given ranks (default all), what the renderers draw."""
    rs = list(range(tl.R)) if ranks is None else [int(r) for r in ranks]
    out = []
    for e in tl.events:
        for r in rs:
            out.append({"rank": r, "stream": e.stream, "name": e.name, "layer": e.layer, "direction": e.direction,
                        "micro_batch": e.micro_batch, "start_us": float(e.start_R[r]), "end_us": float(e.end_R[r])})
    return out


def perfetto_events(tl: Timeline, ranks: Sequence[int] | None = None) -> list[dict]:
    """Trace Event Format events (``moonep_sim.sim.perfetto.write_trace`` writes them): one track
    per rank and stream (``rank r compute`` / ``rank r comm``), one complete event per op."""
    rs = list(range(tl.R)) if ranks is None else [int(r) for r in ranks]
    ev: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "step"}}]
    for k, r in enumerate(rs):
        for j, stream in enumerate(("compute", "comm")):
            ev.append({"ph": "M", "pid": 1, "tid": 2 * k + j, "name": "thread_name",
                       "args": {"name": f"rank {r} {stream}"}})
    for rec in timeline_records(tl, rs):
        k = rs.index(rec["rank"])
        lab = f"L{rec['layer']}." if rec["layer"] >= 0 else ""
        ev.append({"ph": "X", "pid": 1, "tid": 2 * k + (rec["stream"] == "comm"), "name": lab + rec["name"],
                   "ts": rec["start_us"], "dur": max(rec["end_us"] - rec["start_us"], 0.0), "cat": rec["stream"],
                   "args": {"layer": rec["layer"], "direction": rec["direction"], "micro_batch": rec["micro_batch"]}})
    return ev


__all__ = ["Event", "Timeline", "perfetto_events", "timeline_records"]
