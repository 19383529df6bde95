"""Interleaved 1F1B (Megatron-Core's virtual pipeline): v model chunks per rank, chunk c on rank
``c mod p``, so each micro-batch passes every rank v times.

Rank r's ops follow Megatron's order over the ``v m`` virtual micro-batches: the k-th forward is
chunk ``(k // p) mod v`` of micro-batch ``(k // (p v)) p + k mod p``, the k-th backward the same
micro-batch on chunk ``v - 1 - (k // p) mod v``; ``min(2 (p - r - 1) + (v - 1) p, v m)`` warm-up
forwards, then one forward and one backward alternately, then the cool-down backwards. Needs m a
multiple of p (Megatron's rule). Equal stages with free sends: ``(m + (p - 1)/v)(F + B)``, a bubble
of ``(p - 1)/(v m + p - 1)``.

:class:`CombinedInterleaved` (``combined-1f1b``) is the same order as Megatron-Core runs it under
``overlap_moe_expert_parallel_comm`` (``megatron/core/pipeline_parallel/schedules.py``,
``get_pp_rank_microbatches`` and ``combined_1f1b.py``): one more warm-up forward per rank (so the
forward and the backward of each steady step belong to different micro-batches and are
independent), then each steady step's forward and backward run as one ``FB`` op (the EP dispatch
and combine of each half on a communication stream beside the other half's compute,
:meth:`~moonep_sim.step.pipelines.base.ChunkTimes.fb_us`), then the cool-down backwards.
Megatron pairs the two halves layer by layer on a compute and a communication stream
(``TransformerLayerSchedulePlan.run`` in ``megatron/core/models/common/model_chunk_schedule_plan.py``):
backward combine beside forward attention, forward then backward dispatch beside backward then
forward expert MLP, forward combine beside backward attention. The op's time here pairs the
chunk's sums (compute with compute, EP communication with EP communication): ASSUMED, an upper
bound on what the per-layer phases hide.
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

    #: extra warm-up forwards per rank (Megatron's combined 1F1B adds one)
    extra_warmup = 0
    #: whether a steady step's forward and backward run as one FB op
    combined = False

    def orders(self, t=None) -> list[list[PipeOp]]:
        p, v, m = self.pp, self.vpp, self.m
        total = v * m
        out = []
        for r in range(p):
            def op(kind: str, k: int) -> PipeOp:
                mb, local = self._virtual(k, kind == "B")
                return PipeOp(kind, mb, local * p + r)
            warm = min(2 * (p - r - 1) + (v - 1) * p + self.extra_warmup, total)
            o = [op("F", k) for k in range(warm)]
            for i in range(total - warm):
                f, b = op("F", warm + i), op("B", i)
                o += [PipeOp("FB", f.mb, f.chunk, b.mb, b.chunk)] if self.combined else [f, b]
            o += [op("B", k) for k in range(total - warm, total)]
            out.append(o)
        return out


@PIPELINE_SCHEDULES.register
class CombinedInterleaved(Interleaved):
    """Interleaved 1F1B with Megatron-Core's EP all-to-all overlap (``combined 1F1B``, module
    docstring): chosen by ``Parallel.overlap_moe_expert_parallel_comm``, not a ``--pp-schedule``."""

    name = "combined-1f1b"
    extra_warmup = 1
    combined = True


__all__ = ["CombinedInterleaved", "Interleaved"]
