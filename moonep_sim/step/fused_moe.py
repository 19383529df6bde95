"""A fused MoE kernel's layer time (``fused-moe``: DeepGEMM Mega MoE, Primus-Turbo MegaMoE).

Notation: R ranks. Times in microseconds.

The layer simulator runs the fused strategy's Plan as it runs the low-latency kernels' (its
movement is theirs) and reads back, per rank, the time before its expert compute (``pre_R``:
dispatch), the compute (``expert_R``: the step's grouped-GEMM cost) and after it (``post_R``:
combine). A fused kernel consumes the rows while they arrive and sends each result while the next
tile computes, so per rank (the closed form, :func:`fused_layer_R`)::

    fused_R = max(pre_R + post_R - fixed_R, expert_R) + floor_us

where ``fixed_R`` is the two kernels' fixed costs at their start (launch and send issue: the
fused kernel launches once, and its floor replaces them)

and since a token's combine needs every rank's results, the layer ends on every rank when the
slowest rank's kernel ends: the rank's wait for it is its new ``post_R``. The kernel is persistent
on every SM for the whole call (its SM use: the whole GPU; nothing of the step's compute runs
beside it), and it needs no host sync and no planning.

What it assumes: perfect overlap inside the kernel (neither the communication nor the GEMM slowed
by sharing the SMs and HBM -- an optimistic bound; DeepGEMM's own EP8 figures put its
interconnect at 182-529 GB/s, well under NVLink's); the per-call floor of the kernel
(:data:`moonep_sim.strategies.fused_moe.FUSED_KERNELS`, ASSUMED). The backward (train) is fused the
same way for Primus-Turbo's kernels (a training layer); DeepGEMM's Mega MoE is an inference
kernel, and a train step with it is refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.plan import Plan
from moonep_sim.strategies.fused_moe import FUSED_KERNELS, FusedKernel

#: GPU architecture of each shipped topology preset (by the preset's name prefix).
PRESET_ARCH = (("gb200", "blackwell"), ("gb300", "blackwell"), ("b200", "blackwell"), ("b300", "blackwell"),
               ("h100", "hopper"), ("h200", "hopper"), ("h800", "hopper"), ("h20", "hopper"), ("mi350", "gfx950"),
               ("mi355", "gfx950"), ("mi300", "gfx942"))


def arch_of(topology_name: str) -> str:
    """The GPU architecture of a topology preset by its name ("" = not known)."""
    n = topology_name.lower()
    return next((a for p, a in PRESET_ARCH if n.startswith(p)), "")


def is_fused(plan: Plan) -> bool:
    """True when ``plan`` runs as one fused MoE kernel (the ``fused-moe`` strategy)."""
    return plan.strategy == "fused-moe"


def kernel_of(plan: Plan) -> FusedKernel:
    """The fused kernel family of a ``fused-moe`` Plan (its ``kernel`` option)."""
    return FUSED_KERNELS[str(plan.options.get("kernel", "deepgemm-mega"))]


def check_gpu(plan: Plan, topology_name: str) -> None:
    """Refuse (ConfigError, one line) a fused kernel on a GPU its library does not run on."""
    fk = kernel_of(plan)
    arch = arch_of(topology_name)
    require(arch in fk.archs, f"topology ({topology_name}) must have a GPU of {', '.join(fk.archs)} for "
                              f"fused-moe.kernel={fk.name}: {fk.library} runs only there "
                              f"(this GPU: {arch or 'not known'})", ConfigError)


def fused_layer_R(pre_R: np.ndarray, expert_R: np.ndarray, post_R: np.ndarray, floor_us: float) -> np.ndarray:
    """float64 [R]: each rank's fused kernel time, ``max(pre_R + post_R, expert_R) + floor_us`` (us)."""
    return np.maximum(np.asarray(pre_R, dtype=np.float64) + np.asarray(post_R, dtype=np.float64),
                      np.asarray(expert_R, dtype=np.float64)) + float(floor_us)


def fuse_direction(d, floor_us: float):
    """A ``DirectionComm`` read back as one fused kernel: no time before the compute, the kernel as
    the rank's compute, the wait for the slowest rank's kernel after it; no planning and no held
    SM phases apart (the kernel is all of the rank's SMs for all of its time). The communication it
    hides is the dispatch and combine less their kernels' fixed costs at their start (the heads of
    ``pre_held`` / ``post_held``: launch and send issue), which the fused kernel's one floor
    replaces."""
    head_pre = d.pre_held[0] if d.pre_held is not None else 0.0
    head_post = d.post_held[0] if d.post_held is not None else 0.0
    k_R = fused_layer_R(d.pre_R - head_pre, d.expert_R, d.post_R - head_post, floor_us)
    zero = np.zeros_like(k_R)
    wait = float(k_R.max()) - k_R if k_R.size else zero
    return dataclasses.replace(d, pre_R=zero, expert_R=k_R, post_R=wait, plan_R=zero,
                               layer_us=float(k_R.max()) if k_R.size else 0.0,
                               pre_held=(zero, zero), post_held=(zero, zero.copy()))


def check_gemm_dtype(plan: Plan, gemm_dtype: str) -> None:
    """Refuse (ConfigError, one line) a step whose expert GEMMs are priced in another dtype than
    the fused kernel's activations (its GEMMs run in that dtype)."""
    want = str(plan.options.get("dtype", kernel_of(plan).dtypes[0]))
    name = kernel_of(plan).name
    require(gemm_dtype == want, f"gemm dtype ({gemm_dtype}) must be {want} for fused-moe.kernel={name}: "
                                f"its expert GEMMs run on {want} activations (pass --gemm-dtype {want})", ConfigError)


def fuse_layer(comm, plan: Plan, topology_name: str, gemm_dtype: str | None = None):
    """A ``LayerComm`` of a ``fused-moe`` Plan re-read as one fused kernel per direction (the
    kernel holds every SM: ``sm_share`` 1, no host wait). ``gemm_dtype``: the step's GEMM dtype,
    checked against the kernel's (None: not checked)."""
    check_gpu(plan, topology_name)
    fk = kernel_of(plan)
    require(comm.backward is None or fk.train,
            f"mode (train) must be decode or prefill for fused-moe.kernel={fk.name}: {fk.library} is an inference "
            "kernel (no backward)", ConfigError)
    if gemm_dtype is not None:
        check_gemm_dtype(plan, gemm_dtype)
    floor = float(plan.options.get("floor_us", kernel_of(plan).floor_us))
    bwd = fuse_direction(comm.backward, floor) if comm.backward is not None else None
    fwd = fuse_direction(comm.forward, floor)
    return dataclasses.replace(comm, forward=fwd, backward=bwd, sm_share=1.0, holds_sms=True, host_wait_us=0.0,
                               sim_us=fwd.layer_us + (bwd.layer_us if bwd is not None else 0.0))


__all__ = ["PRESET_ARCH", "arch_of", "check_gemm_dtype", "check_gpu", "fuse_direction", "fuse_layer", "fused_layer_R",
           "is_fused", "kernel_of"]
