"""The two-stream timeline a step is composed on (the overlap schedules issue their ops on it:
``moonep_sim.step.schedules``), and its export as records and Perfetto events.

Notation: R ranks, M micro-batches. Times in microseconds.

Every rank has a **compute stream** and a **communication stream**; each runs its ops in program
order, an op starting once its stream is free and its inputs are ready (:class:`Timeline`).
Communication ops of a MoE layer are collectives: they start on every rank at once, when the
latest rank is ready. While a communication kernel holds its SMs it takes them from compute
(``KernelSpec.sms`` / the GPU's SM count): a compute op overlapping it progresses at ``1 - share``
of its rate (``share`` 1, e.g. the low-latency kernels on every SM: no progress) -- see
:meth:`Timeline.compute`. A kernel family that holds its SMs (normal kernels: their SMs move the
bytes) does so for the whole collective; one that frees them while its data is in flight
(``KernelSpec.holds_sms`` False: DeepEP's low-latency kernels in hook mode) only in its SM phases,
the launch and send issue at the start and the receive copy or reduce at the end
(:meth:`Timeline.comm` ``held``). Each event records what it cost the other stream: a comm op its
SM-held time (``sm_held_R``), a compute op the time it was slowed by comm kernels (``slowed_R``),
which is how the timeline explains an overlap's gain op by op (:func:`overlap_by_op`).
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
    sm_held_R: np.ndarray | None = None   # comm: us its kernels held their SMs (None: none)
    slowed_R: np.ndarray | None = None    # compute: us added by comm kernels holding SMs


@dataclass
class Timeline:
    """Two streams per rank, ops placed in program order (see the module docstring)."""

    R: int
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.compute_free = np.zeros(self.R)
        self.comm_free = np.zeros(self.R)
        # SM-holding comm intervals: (start_R, end_R, share, latest end) us
        self._comm_iv: list[tuple[np.ndarray, np.ndarray, float, float]] = []

    def _stretch(self, t: np.ndarray, rem: np.ndarray) -> np.ndarray:
        """End of ``rem`` us of compute started at ``t`` (float64 [R], not written), slowed where comm
        kernels run. An interval that ended on every rank before the op starts changes nothing and is skipped."""
        t0 = float(t.min()) if t.size else 0.0
        for a, b, f, b_max in self._comm_iv[-8:]:
            if f <= 0 or b_max <= t0:
                continue
            use = np.minimum(np.maximum(a - t, 0.0), rem)  # before the interval: full rate
            t, rem = t + use, rem - use
            busy = rem > 0
            t = np.where(busy, np.maximum(t, a), t)
            inside = np.maximum(b - t, 0.0) * busy
            if f >= 1:
                t = t + inside
            else:
                use = np.minimum(inside * (1 - f), rem)
                t, rem = t + use / (1 - f), rem - use
        return t + rem

    def compute(self, name: str, us, layer: int, direction: str, mb: int = 0,
                after: np.ndarray | None = None) -> np.ndarray:
        """Place a compute op of ``us`` (scalar or [R]) after ``after`` [R]; returns its end [R]."""
        dur = np.zeros(self.R) + us
        s = self.compute_free if after is None else np.maximum(self.compute_free, after)
        e = self._stretch(s, dur)
        self.compute_free = e
        self.events.append(Event(name, "compute", layer, direction, mb, s, e, slowed_R=np.maximum(e - s - dur, 0.0)))
        return e

    def comm(self, name: str, dur_R: np.ndarray, layer: int, direction: str, share: float, mb: int = 0,
             after: np.ndarray | None = None,
             held: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Place a collective of per-rank durations ``dur_R`` once every rank is ready; its
        kernels take ``share`` of the SMs from overlapping compute for the whole collective, or --
        ``held`` = (head_R, tail_R) us -- only in its first ``head_R`` and last ``tail_R`` us (a
        family that frees its SMs while data is in flight). Returns its end [R]."""
        ready = self.comm_free if after is None else np.maximum(self.comm_free, after)
        s = np.full(self.R, float(ready.max()))
        d = np.asarray(dur_R, np.float64)
        e = s + d
        self.comm_free = e
        if share <= 0:
            used = np.zeros(self.R)
        elif held is None:
            self._held(s, e, share)
            used = d.copy()
        else:
            head = np.minimum(np.asarray(held[0], np.float64), d)
            tail = np.minimum(np.asarray(held[1], np.float64), d - head)
            self._held(s, s + head, share)
            self._held(e - tail, e, share)
            used = head + tail
        self.events.append(Event(name, "comm", layer, direction, mb, s, e.copy(), sm_held_R=used))
        return e

    def _held(self, a: np.ndarray, b: np.ndarray, share: float) -> None:
        self._comm_iv.append((a, b, float(share), float(b.max()) if b.size else 0.0))

    def wait(self, ready_R: np.ndarray) -> None:
        """The compute stream waits for ``ready_R`` (a combine's result the next op consumes)."""
        self.compute_free = np.maximum(self.compute_free, ready_R)

    def end_R(self) -> np.ndarray:
        return np.maximum(self.compute_free, self.comm_free)


def _sm(e: Event) -> np.ndarray:
    v = e.sm_held_R if e.stream == "comm" else e.slowed_R
    return np.zeros(len(e.end_R)) if v is None else v


def overlap_by_op(tl: Timeline, rank: int) -> list[dict]:
    """Per op name on rank ``rank``: its count, total us, and what overlap cost or saved -- a comm
    op's us hidden (beside a compute op, less the us its kernels held the SMs) and us its kernels
    held the SMs; a compute op's us lost to comm kernels holding SMs. The figures the step's
    overlap gain is explained by."""
    comp = sorted((float(e.start_R[rank]), float(e.end_R[rank])) for e in tl.events if e.stream == "compute")
    starts = np.array([a for a, _ in comp])
    ends = np.array([b for _, b in comp])
    reach = np.maximum.accumulate(ends)  # [i]: the latest end of compute ops 0..i (a comm op none overlaps adds 0)
    out: dict[tuple[str, str], dict] = {}
    for e in tl.events:
        a, b = float(e.start_R[rank]), float(e.end_R[rank])
        d = out.setdefault((e.stream, e.name), {"op": e.name, "stream": e.stream, "count": 0, "us": 0.0,
                                                 "hidden_us": 0.0, "sm_us": 0.0})
        d["count"] += 1
        d["us"] += b - a
        d["sm_us"] += float(_sm(e)[rank])
        if e.stream == "comm" and b > a and starts.size and reach[max(np.searchsorted(starts, b) - 1, 0)] > a:  # beside compute, outside its SM phases
            beside = float(np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0.0, None).sum())
            d["hidden_us"] += max(beside - float(_sm(e)[rank]), 0.0)
    return sorted(out.values(), key=lambda d: (d["stream"], -d["us"]))


def timeline_records(tl: Timeline, ranks: Sequence[int] | None = None) -> list[dict]:
    """Plain records ``{rank, stream, name, layer, direction, micro_batch, start_us, end_us,
    sm_us}`` of every op on the given ranks (default all), what the renderers draw; ``sm_us``: a
    comm op's SM-held us, a compute op's us lost to comm kernels holding SMs."""
    rs = list(range(tl.R)) if ranks is None else [int(r) for r in ranks]
    out = []
    for e in tl.events:
        for r in rs:
            out.append({"rank": r, "stream": e.stream, "name": e.name, "layer": e.layer, "direction": e.direction,
                        "micro_batch": e.micro_batch, "start_us": float(e.start_R[r]), "end_us": float(e.end_R[r]),
                        "sm_us": float(_sm(e)[r])})
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
                   "args": {"layer": rec["layer"], "direction": rec["direction"], "micro_batch": rec["micro_batch"],
                            "sm_us": rec["sm_us"]}})
    return ev


__all__ = ["Event", "Timeline", "overlap_by_op", "perfetto_events", "timeline_records"]
