"""Expert compute model: each rank's routed experts as one grouped GEMM, timed by a roofline.

Notation: R ranks, S slots (expert instances; a rank's slots are its local experts and copies).
D = the dispatched row width (``model.dispatch_hidden``), H' = expert FFN width.

For every slot with rows (padding rows included: they are computed too), one SwiGLU expert is
``gate, up: D x H'`` and ``down: H' x D``:

- FLOPs (forward) = ``2 * 3 * D * H'`` per row (``model.expert_flops_per_row()``);
- bytes (forward) = the expert's bf16 weights read once (``3 * D * H' * 2``) plus per row the
  input and output rows (``2 * D`` elements) and the three H'-wide intermediates written and
  read back (``6 * H'`` elements), all bf16;
- time = ``max(FLOPs / (peak * compute_efficiency), bytes / (mem_bw * mem_efficiency))``.

A rank's time is the sum over its slots plus one launch cost ``gpu_launch_us`` (per chunk when
the dispatch is pipelined in chunks), plus ``gpu_slot_us`` per slot with rows (0 on the GPU
presets: one grouped GEMM). ``gpu_padding_compute`` < 1 charges only that fraction of the
padding rows (an executor that skips them; 1 on the GPU presets). Backward: twice the FLOPs (input and weight gradients),
weights read again plus their fp32 gradient written (``3 * D * H' * (2 + 4)`` bytes), twice the
activation bytes. A slow GPU divides both peaks by its speed factor.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.models import ModelSpec
from moonep_sim.plan import Plan
from moonep_sim.sim.topology import Topology


def slot_work(plan: Plan, model: ModelSpec, backward: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot: (flops_S, fixed_bytes_S, bytes_per_row) -- padded rows included.

    fixed_bytes_S is the weight traffic (0 for slots without rows: an empty expert is skipped).
    """
    rows = plan.slot_padded_S.astype(np.float64)
    flops = rows * model.expert_flops_per_row() * (2.0 if backward else 1.0)
    wbytes, per_row = _expert_bytes(model, backward)
    return flops, np.where(rows > 0, wbytes, 0.0), per_row


def _expert_bytes(model: ModelSpec, backward: bool) -> tuple[float, float]:
    """(one expert's weight bytes -- read, and in backward read again with its fp32 gradient
    written --, the activation bytes per row): the module docstring's counts."""
    D, Hf = model.dispatch_hidden, model.expert_ffn
    return 3.0 * D * Hf * ((2 + 4) if backward else 2), 2.0 * (2 * D + 6 * Hf) * (2.0 if backward else 1.0)


def rank_compute_us(plan: Plan, model: ModelSpec, topo: Topology, backward: bool = False, chunks: int = 1,
                    speed_R: np.ndarray | None = None) -> np.ndarray:
    """float64 [R]: one chunk's grouped-GEMM time per rank (rows split evenly over ``chunks``).

    speed_R: optional per-rank speed factors (1 = nominal, 0.5 = half speed).
    """
    R = plan.ranks
    flops, fixed, per_row = slot_work(plan, model, backward)
    c = max(int(chunks), 1)
    rows = plan.slot_padded_S.astype(np.float64) / c
    pad = topo.gpu_padding_compute
    if pad < 1:  # an executor that skips (part of) the padding rows
        real = plan.slot_rows_S.astype(np.float64)
        eff = real + pad * (plan.slot_padded_S - real)
        scale = np.divide(eff, plan.slot_padded_S, out=np.zeros_like(eff), where=plan.slot_padded_S > 0)
        flops = flops * scale
        rows = rows * scale
        fixed = np.where(eff > 0, fixed, 0.0)
    t_flop = (flops / c) / topo.flops_per_us
    t_mem = (fixed + rows * per_row) / topo.mem_bytes_per_us
    t_slot = np.maximum(t_flop, t_mem)
    if topo.gpu_slot_us > 0:  # one matmul chain per expert slot with rows
        t_slot = t_slot + np.where(rows > 0, topo.gpu_slot_us, 0.0)
    t_R = np.bincount(plan.slot_rank_S, weights=t_slot, minlength=R)
    if speed_R is not None:
        t_R = t_R / np.asarray(speed_R, dtype=np.float64)
    return t_R + topo.gpu_launch_us


def compute_lower_bound_us(plan: Plan, model: ModelSpec, topo: Topology, backward: bool = False) -> float:
    """Total expert work of the plan's kept entries spread perfectly evenly over R GPUs.

    FLOPs of the real rows, and bytes of each expert with any row read once, over R times the
    achievable peak (roofline of the totals, which bounds every per-slot roofline sum), plus one
    launch.
    """
    real = plan.slot_rows_S.astype(np.float64)
    flops = float(real.sum()) * model.expert_flops_per_row() * (2.0 if backward else 1.0)
    used = np.zeros(plan.num_experts, dtype=bool)
    used[plan.slot_expert_S[plan.slot_rows_S > 0]] = True
    wbytes, per_row = _expert_bytes(model, backward)
    bytes_ = float(used.sum()) * wbytes + float(real.sum()) * per_row
    R = plan.ranks
    return max(flops / (R * topo.flops_per_us), bytes_ / (R * topo.mem_bytes_per_us)) + topo.gpu_launch_us


__all__ = ["compute_lower_bound_us", "rank_compute_us", "slot_work"]
