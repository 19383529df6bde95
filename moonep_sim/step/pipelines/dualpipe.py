"""DualPipe-style bidirectional pipeline (DeepSeek-V3's training schedule).

The model's p stages are fed from both ends: half the micro-batches enter at rank 0 and run
stages 0 .. p-1 on ranks 0 .. p-1 (direction 0), the other half enter at rank p-1 and run the same
stages on ranks p-1 .. 0 (direction 1); so rank r holds stages r and p-1-r (twice a 1F1B rank's
weights) and does the same work as a 1F1B rank. Where a rank has a forward of one direction and a
backward of the other ready, it runs them as one FB op (DualPipe's overlapped chunk pair: each
half's communication hidden behind the other's compute, :meth:`ChunkTimes.fb_us`).

The order (ASSUMED, the rule DualPipe's figure follows, not its code): ranks take ops as early as
their inputs allow, a backward before a forward, and a forward of direction d only while fewer than
``p - s`` of that direction's micro-batches are in flight on a rank at stage s of it (1F1B's bound
per direction, ``p + 1`` in all per rank, DualPipe's activation count). The weight-gradient split
(zero-bubble W ops) is not modelled: a backward includes its weight gradients.
"""

from __future__ import annotations

from moonep_sim.errors import ConfigError, require
from moonep_sim.step.pipelines import PIPELINE_SCHEDULES
from moonep_sim.step.pipelines.base import ChunkTimes, PipeOp, Schedule


@PIPELINE_SCHEDULES.register
class DualPipe(Schedule):
    name = "dualpipe"

    def __init__(self, pp: int, vpp: int, m: int) -> None:
        super().__init__(pp, vpp, m)
        require(pp % 2 == 0, f"pp ({pp}) must be even for dualpipe (its two directions pair the stages)")
        require(vpp == 1, f"vpp ({vpp}) must be 1 for dualpipe")
        require(m % 2 == 0, f"micro-batches ({m}) must be even for dualpipe (half enter at each end)")

    def chunks(self) -> int:
        return 2 * self.pp          # (direction d, stage s) -> d * pp + s

    def stage_of(self, chunk: int) -> int:
        return chunk % self.pp

    def rank_of(self, chunk: int) -> int:
        d, s = divmod(chunk, self.pp)
        return s if d == 0 else self.pp - 1 - s

    def direction(self, mb: int) -> int:
        return 0 if mb < self.m // 2 else 1

    def path(self, mb: int) -> list[int]:
        base = self.direction(mb) * self.pp
        return [base + s for s in range(self.pp)]

    def orders(self, t: ChunkTimes | None = None) -> list[list[PipeOp]]:
        p, m = self.pp, self.m
        if t is None:
            t = ChunkTimes([1.0] * self.chunks(), [2.0] * self.chunks())
        mbs = [[mb for mb in range(m) if self.direction(mb) == d] for d in (0, 1)]
        chunk = [[d * p + (r if d == 0 else p - 1 - r) for d in (0, 1)] for r in range(p)]
        cap = [[p - (chunk[r][d] % p) for d in (0, 1)] for r in range(p)]
        nxt = [[0, 0] for _ in range(p)]          # next forward (index into mbs[d]) per rank, direction
        inflight = [[0, 0] for _ in range(p)]
        fend: dict[tuple[int, int], float] = {}   # (mb, chunk) -> forward end
        bend: dict[tuple[int, int], float] = {}
        free = [0.0] * p
        out: list[list[PipeOp]] = [[] for _ in range(p)]
        left = 2 * m * p

        def send(a: int, b: int) -> float:
            return t.send_us(a, b) if self.rank_of(a) != self.rank_of(b) else 0.0

        def f_ready(r: int, d: int) -> tuple[float, int] | None:
            if nxt[r][d] >= len(mbs[d]) or inflight[r][d] >= cap[r][d]:
                return None
            mb, c = mbs[d][nxt[r][d]], chunk[r][d]
            if c % p == 0:
                return 0.0, mb
            e = fend.get((mb, c - 1))
            return None if e is None else (e + send(c - 1, c), mb)

        def b_ready(r: int, d: int) -> tuple[float, int] | None:
            c = chunk[r][d]
            best = None
            for mb in mbs[d]:
                if (mb, c) in bend or (mb, c) not in fend:
                    continue
                e = fend[(mb, c)] if c % p == p - 1 else (bend[(mb, c + 1)] + send(c + 1, c)
                                                        if (mb, c + 1) in bend else None)
                if e is not None and (best is None or e < best[0]):
                    best = (e, mb)
            return best

        while left:
            pick = None
            for r in range(p):
                cands = [(x[0], "F", d, x[1]) for d in (0, 1) if (x := f_ready(r, d))] + \
                        [(x[0], "B", d, x[1]) for d in (0, 1) if (x := b_ready(r, d))]
                if not cands:
                    continue
                t0 = max(free[r], min(c[0] for c in cands))
                if pick is None or t0 < pick[0]:
                    pick = (t0, r, [c for c in cands if c[0] <= t0])
            if pick is None:
                raise ConfigError(f"pp schedule (dualpipe) cannot run {m} micro-batches on pp {p}: no rank can "
                                  "take an op")
            t0, r, ready = pick
            bs = sorted((c for c in ready if c[1] == "B"), key=lambda c: c[0])
            fs = sorted((c for c in ready if c[1] == "F"), key=lambda c: c[0])
            if bs and any(f[2] != bs[0][2] for f in fs):
                b = bs[0]
                f = next(f for f in fs if f[2] != b[2])
                cf, cb = chunk[r][f[2]], chunk[r][b[2]]
                op, dur = PipeOp("FB", f[3], cf, b[3], cb), t.fb_us(cf, cb)
            elif bs:
                b = bs[0]
                op, dur = PipeOp("B", b[3], chunk[r][b[2]]), t.b_us[chunk[r][b[2]]]
            else:
                f = fs[0]
                op, dur = PipeOp("F", f[3], chunk[r][f[2]]), t.f_us[chunk[r][f[2]]]
            free[r] = t0 + dur
            for kind, mb, c in op.parts():
                d = c // p
                if kind == "F":
                    fend[(mb, c)] = free[r]
                    nxt[r][d] += 1
                    inflight[r][d] += 1
                else:
                    bend[(mb, c)] = free[r]
                    inflight[r][d] -= 1
                left -= 1
            out[r].append(op)
        return out


__all__ = ["DualPipe"]
