"""Pipeline schedules: micro-batches over pipeline stages, their bubbles as data.

Notation: p pipeline ranks (``pp``), v model chunks per rank (``vpp``), m micro-batches per
step. Times in microseconds.

A model is cut into *chunks* (the stages of :meth:`moonep_sim.step.parallel.Parallel.stage_layers`);
each chunk runs on one pipeline rank. A micro-batch's forward runs its path of chunks in order, its
backward in reverse: ``F(mb, c)`` needs ``F(mb, c')`` of the previous chunk c' of its path (plus
the activations' send between their ranks), ``B(mb, c)`` needs ``B`` of the next chunk (plus the
gradient's send) and, on the last chunk, its own ``F``. Each rank runs one op at a time; an
``FB`` op (DualPipe) is one forward and one backward chunk of different micro-batches run together,
the communication of each hidden behind the other's compute.

A schedule (one class per schedule, one module each, registered in
:data:`moonep_sim.step.pipelines.PIPELINE_SCHEDULES`: ``1f1b``, ``interleaved``, ``dualpipe``)
says which chunks there are, which rank runs each, the path of each micro-batch and the order in
which each rank runs its ops; :func:`run_schedule` times it (each op as early as its rank and its
inputs allow) and returns a :class:`PipelineRun`: every op's start and end, and per rank its busy
time, bubble, warm-up (until its first backward), steady and cool-down (after its last forward)
phases.

Closed forms (tests): p equal stages of forward F and backward B under 1F1B with free sends take
``(m + p - 1)(F + B)``, a bubble of ``(p-1)/(m+p-1)`` of the step; interleaved with v chunks per
rank (each F/v, B/v) ``(m + (p-1)/v)(F + B)``, a bubble of ``(p-1)/(v m + p - 1)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

from moonep_sim.errors import ConfigError, require


@dataclass(frozen=True)
class PipeOp:
    """One op of a rank: ``kind`` F (forward), B (backward) or FB (a forward of ``(mb, chunk)`` and
    a backward of ``(mb2, chunk2)`` run together)."""

    kind: str
    mb: int
    chunk: int
    mb2: int = -1
    chunk2: int = -1

    def parts(self) -> list[tuple[str, int, int]]:
        """The (F|B, micro-batch, chunk) this op completes."""
        if self.kind == "FB":
            return [("F", self.mb, self.chunk), ("B", self.mb2, self.chunk2)]
        return [(self.kind, self.mb, self.chunk)]


@dataclass(frozen=True)
class FBParts:
    """What an FB op of Megatron's combined 1F1B hides and what it cannot, per chunk id (forward
    ``f_*``, backward ``b_*``; us): ``*_comm_us`` the chunk's exposed EP dispatch/combine (on the
    communication stream, hidden behind the other half's compute), ``*_serial_us`` what stays on the
    compute stream beside the compute (TP collectives), ``*_host_us`` the host's launches of the
    chunk's kernels (one host thread launches both halves)."""

    f_comm_us: Sequence[float]
    b_comm_us: Sequence[float]
    f_serial_us: Sequence[float]
    b_serial_us: Sequence[float]
    f_host_us: Sequence[float]
    b_host_us: Sequence[float]


@dataclass(frozen=True)
class ChunkTimes:
    """What the schedule is timed on, per chunk id: forward and backward us (``f_us`` / ``b_us``)
    and the part of each that is compute (``f_compute_us`` / ``b_compute_us``: the rest is exposed
    communication, which an FB op hides behind the other half's compute); ``send_us(a, b)``: the
    activation (or gradient) send from chunk ``a``'s rank to chunk ``b``'s (0 on the same rank);
    ``fb``: the parts an FB op composes instead (:class:`FBParts`, Megatron's combined 1F1B)."""

    f_us: Sequence[float]
    b_us: Sequence[float]
    f_compute_us: Sequence[float] | None = None
    b_compute_us: Sequence[float] | None = None
    send_us: Callable[[int, int], float] = field(default=lambda a, b: 0.0)
    fb: FBParts | None = None

    def fb_us(self, cf: int, cb: int) -> float:
        """An FB op's time: ``max(compute F + compute B, exposed F + exposed B)``; with :attr:`fb`,
        ``max(max(compute F + compute B, comm F + comm B) + serial F + serial B, host F + host B)``."""
        fc = self.f_compute_us[cf] if self.f_compute_us is not None else self.f_us[cf]
        bc = self.b_compute_us[cb] if self.b_compute_us is not None else self.b_us[cb]
        if self.fb is None:
            return max(fc + bc, (self.f_us[cf] - fc) + (self.b_us[cb] - bc))
        o = self.fb
        gpu = max(fc + bc, o.f_comm_us[cf] + o.b_comm_us[cb]) + o.f_serial_us[cf] + o.b_serial_us[cb]
        return max(gpu, o.f_host_us[cf] + o.b_host_us[cb])


class Schedule(ABC):
    """A pipeline schedule (subclasses register in :data:`SCHEDULES`)."""

    name = ""

    def __init__(self, pp: int, vpp: int, m: int) -> None:
        require(pp >= 1 and vpp >= 1 and m >= 1, f"pipeline (pp {pp}, vpp {vpp}, micro-batches {m}) must be >= 1 each")
        self.pp, self.vpp, self.m = pp, vpp, m

    def chunks(self) -> int:
        """Chunk ids are ``0 .. chunks()-1``."""
        return self.pp * self.vpp

    def stage_of(self, chunk: int) -> int:
        """Model stage (index into ``stage_layers``) chunk ``chunk`` computes."""
        return chunk

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def path(self, mb: int) -> list[int]:
        """Chunks micro-batch ``mb`` runs forward, in order."""
        return list(range(self.chunks()))

    @abstractmethod
    def orders(self, t: "ChunkTimes | None" = None) -> list[list[PipeOp]]:
        """Each rank's ops, in the order it runs them (a schedule that orders by time reads ``t``)."""


@dataclass(frozen=True)
class PipelineRun:
    """A timed schedule. ``ops``: (rank, kind, mb, chunk, mb2, chunk2, start_us, end_us) in start
    order. ``makespan_us``: the last op's end. Per rank: ``busy_us`` (sum of its ops), ``bubble_us``
    (makespan - busy), ``warmup_us`` (until its first backward starts), ``cooldown_us`` (after its
    last forward ends), ``steady_us`` (the rest)."""

    schedule: str
    pp: int
    vpp: int
    micro_batches: int
    ops: list[tuple]
    makespan_us: float
    busy_us: list[float]
    bubble_us: list[float]
    warmup_us: list[float]
    steady_us: list[float]
    cooldown_us: list[float]

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of the idle share of the step (0 with no pipeline)."""
        if self.makespan_us <= 0:
            return 0.0
        return sum(self.bubble_us) / (len(self.bubble_us) * self.makespan_us)

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "pp": self.pp, "vpp": self.vpp, "micro_batches": self.micro_batches,
                "makespan_us": self.makespan_us, "bubble_fraction": self.bubble_fraction,
                "busy_us": self.busy_us, "bubble_us": self.bubble_us, "warmup_us": self.warmup_us,
                "steady_us": self.steady_us, "cooldown_us": self.cooldown_us}


def _deps(s: Schedule, paths: list[list[int]], kind: str, mb: int, chunk: int) -> list[tuple[str, int, int, int]]:
    """(kind, mb, chunk, from chunk) an op's part waits for (with the send from ``from chunk``)."""
    path = paths[mb]
    i = path.index(chunk)
    if kind == "F":
        return [("F", mb, path[i - 1], path[i - 1])] if i > 0 else []
    out = [("F", mb, chunk, chunk)]
    if i < len(path) - 1:
        out.append(("B", mb, path[i + 1], path[i + 1]))
    return out


def run_schedule(s: Schedule, t: ChunkTimes) -> PipelineRun:
    """Time schedule ``s`` on chunk times ``t``: each rank runs its ops in order, each as soon as the
    rank is free and its inputs have arrived. A schedule whose orders cannot all run (an op waiting
    on one that never comes first) is a :class:`ConfigError`."""
    orders = s.orders(t)
    P = len(orders)
    paths = [s.path(mb) for mb in range(s.m)]
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * P
    idx = [0] * P
    ops: list[tuple] = []
    total = sum(len(o) for o in orders)
    while len(ops) < total:
        moved = False
        for r in range(P):
            while idx[r] < len(orders[r]):
                op = orders[r][idx[r]]
                ready = 0.0
                ok = True
                for part in op.parts():
                    for dk, dmb, dc, src in _deps(s, paths, *part):
                        e = end.get((dk, dmb, dc))
                        if e is None:
                            ok = False
                            break
                        ready = max(ready, e + (t.send_us(src, part[2]) if s.rank_of(src) != r else 0.0))
                    if not ok:
                        break
                if not ok:
                    break
                if op.kind == "FB":
                    dur = t.fb_us(op.chunk, op.chunk2)
                elif op.kind == "F":
                    dur = t.f_us[op.chunk]
                else:
                    dur = t.b_us[op.chunk]
                start = max(free[r], ready)
                free[r] = start + dur
                for part in op.parts():
                    end[part] = free[r]
                ops.append((r, op.kind, op.mb, op.chunk, op.mb2, op.chunk2, start, free[r]))
                idx[r] += 1
                moved = True
        if not moved:
            raise ConfigError(f"pp schedule ({s.name}) cannot run: rank {next(r for r in range(P) if idx[r] < len(orders[r]))}"
                              " waits on an op no rank runs first")
    ops.sort(key=lambda o: (o[6], o[0]))
    mk = max((o[7] for o in ops), default=0.0)
    busy = [0.0] * P
    first_b = [mk] * P
    last_f = [0.0] * P
    for r, kind, *_, a, b in ops:
        busy[r] += b - a
        if "B" in kind:
            first_b[r] = min(first_b[r], a)
        if "F" in kind:
            last_f[r] = max(last_f[r], b)
    warm = first_b
    cool = [mk - x for x in last_f]
    steady = [max(mk - w - c, 0.0) for w, c in zip(warm, cool)]
    return PipelineRun(s.name, s.pp, s.vpp, s.m, ops, mk, busy, [mk - b for b in busy], warm, steady, cool)


__all__ = ["ChunkTimes", "FBParts", "PipeOp", "PipelineRun", "Schedule", "run_schedule"]
