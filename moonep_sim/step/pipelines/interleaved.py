"""Interleaved 1F1B (Megatron-Core's virtual pipeline): v model chunks per rank, chunk c on rank
``c mod p``, so each micro-batch passes every rank v times.

Rank r's ops follow Megatron's order over the ``v m`` virtual micro-batches: the k-th forward is
chunk ``(k // p) mod v`` of micro-batch ``(k // (p v)) p + k mod p``, the k-th backward the same
micro-batch on chunk ``v - 1 - (k // p) mod v``; ``min(2 (p - r - 1) + (v - 1) p, v m)`` warm-up
forwards, then one forward and one backward alternately, then the cool-down backwards. Needs m a
multiple of p (Megatron's rule). Equal stages with free sends: ``(m + (p - 1)/v)(F + B)``, a bubble
of ``(p - 1)/(v m + p - 1)``.
"""

from __future__ import annotations

from moonep_sim.errors import require
from moonep_sim.step.pipelines import PIPELINE_SCHEDULES
from moonep_sim.step.pipelines.base import PipeOp, Schedule


@PIPELINE_SCHEDULES.register
class Interleaved(Schedule):
    name = "interleaved"

    def __init__(self, pp: int, vpp: int, m: int) -> None:
        super().__init__(pp, vpp, m)
        require(m % pp == 0, f"micro-batches ({m}) must be a multiple of pp ({pp}) for the interleaved schedule "
                             "(Megatron's rule)")

    def _virtual(self, k: int, backward: bool) -> tuple[int, int]:
        p, v = self.pp, self.vpp
        local = (k // p) % v
        if backward:
            local = v - 1 - local
        return (k // (p * v)) * p + k % p, local

    def orders(self, t=None) -> list[list[PipeOp]]:
        p, v, m = self.pp, self.vpp, self.m
        total = v * m
        out = []
        for r in range(p):
            def op(kind: str, k: int) -> PipeOp:
                mb, local = self._virtual(k, kind == "B")
                return PipeOp(kind, mb, local * p + r)
            warm = min(2 * (p - r - 1) + (v - 1) * p, total)
            o = [op("F", k) for k in range(warm)]
            for i in range(total - warm):
                o += [op("F", warm + i), op("B", i)]
            o += [op("B", k) for k in range(total - warm, total)]
            out.append(o)
        return out


__all__ = ["Interleaved"]
