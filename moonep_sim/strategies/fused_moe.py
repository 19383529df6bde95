"""``fused-moe``: dispatch, expert GEMMs and combine in one fused kernel (the decode and small-batch
regime of a single NVLink domain).

Anchors: DeepGEMM's Mega MoE (``deep_gemm.fp8_fp4_mega_moe`` on SM100, FP8 activations x FP4
weights; ``fp8_mega_moe`` on SM90, FP8 x FP8, DeepGEMM pull requests 304, 316 and 383: one persistent
kernel over a symmetric-memory buffer that pulls each token's rows from its source rank, runs the
L1 grouped GEMM, SwiGLU and the L2 grouped GEMM on them as they arrive, and writes the weighted
results back to the token's rank) and AMD Primus-Turbo's MegaMoE (two fused kernels,
``dispatch_grouped_gemm`` and ``grouped_gemm_combine``; gfx950, bf16, EP-only: its documentation in
Primus' technical guides).

Movement: as the low-latency kernels move rows (one row per (token, expert) selection straight to
the expert's rank, NVLink for same-node peers, fixed ``[local experts, max tokens x ranks]``
buffers): this module plans it exactly as :mod:`moonep_sim.strategies.deepep_ll` does, with the
dispatch rows in the kernel's activation dtype. What differs is the time, which the step composes
(:mod:`moonep_sim.step.fused_moe`): the rows arrive while the expert GEMM consumes them, so a
rank's layer time is ``max(its communication, its expert GEMM) + the per-call floor`` rather than
their sum, on every SM of the GPU for the whole call.

The kernels, the GPUs (architectures) and activation dtypes each supports, and its per-call floor
are :data:`FUSED_KERNELS`; a dtype the kernel does not run is refused here, a GPU it does not run
on or a step GEMM dtype other than the kernel's is refused by the step
(``moonep_sim.step.fused_moe.check_gpu``, ``check_gemm_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moonep_sim.errors import require
from moonep_sim.plan import GlobalRouting, Plan
from moonep_sim.strategies import Option, PlanContext, register
from moonep_sim.strategies.deepep_ll import plan as ll_plan


@dataclass(frozen=True)
class FusedKernel:
    """One fused MoE kernel family.

    library: where it lives.  archs: GPU architectures it runs on (``hopper``, ``blackwell``,
    ``gfx950``).  dtypes: the activation (dispatch row) dtypes it runs.  floor_us: its per-call
    floor (us): launch, the symmetric buffer's barrier and the pipeline's fill and drain, paid once
    per layer call on top of ``max(comm, GEMM)``.  source: where each term comes from.
    train: whether it has a backward (a training kernel) or runs inference only.
    """

    name: str
    library: str
    archs: tuple[str, ...]
    dtypes: tuple[str, ...]
    floor_us: float
    source: str
    train: bool = False


#: The fused kernel families by option value.
FUSED_KERNELS: dict[str, FusedKernel] = {
    "deepgemm-mega": FusedKernel(
        "deepgemm-mega", "DeepGEMM Mega MoE (fp8_fp4_mega_moe on SM100, fp8_mega_moe on SM90)",
        ("hopper", "blackwell"), ("fp8",), 20.0,
        "archs and dtypes sourced (DeepGEMM pull requests 304, 383); floor ASSUMED 20 us, set below DeepGEMM "
        "pull request 316's batch-1 DeepSeek-V4-Flash EP8 call (56.5 us, which also reads the touched experts' "
        "weights)"),
    "primus-turbo": FusedKernel(
        "primus-turbo", "AMD Primus-Turbo MegaMoE (dispatch_grouped_gemm + grouped_gemm_combine)",
        ("gfx950",), ("bf16",), 2 * 20.0,
        "archs (gfx950), dtype (bf16) and two kernels per call sourced (Primus technical guide 'MegaMoE'); "
        "floor ASSUMED 20 us per kernel, two kernels", train=True),
}


@register("fused-moe",
          summary="one fused kernel per layer (DeepGEMM Mega MoE, Primus-Turbo MegaMoE): rows move as deepep-ll's, "
                  "the step charges max(comm, GEMM) + a per-call floor",
          options={"kernel": Option(str, "deepgemm-mega", "fused kernel family (strategies.fused_moe.FUSED_KERNELS)",
                                    choices=tuple(FUSED_KERNELS)),
                   "dtype": Option(str, "", "activation (dispatch row) dtype: fp8 or bf16 ('' = the kernel's own)",
                                   choices=("", "fp8", "bf16")),
                   "floor_us": Option(float, -1.0, "per-call floor in us (-1 = the kernel's own, ASSUMED)",
                                      check=lambda v: v >= 0 or v == -1.0,
                                      constraint="must be >= 0 or -1 (the kernel's)"),
                   "max_tokens": Option(int, 0, "tokens per rank the symmetric buffer holds (0 = the largest rank's)",
                                        check=lambda v: v >= 0,
                                        constraint="must be >= 0 (0 = the largest rank's count)")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, kernel: str, dtype: str, floor_us: float,
         max_tokens: int) -> Plan:
    fk = FUSED_KERNELS[kernel]
    dtype = dtype or fk.dtypes[0]
    require(dtype in fk.dtypes, f"dtype ({dtype}) must be one of {', '.join(fk.dtypes)}: {fk.library} runs "
                                f"only those activations")
    p = ll_plan(routing, ctx, dispatch_dtype=dtype, max_tokens=max_tokens, nvlink=True, sms=None,
                impl="deepep-v1-ll")
    floor = fk.floor_us if floor_us < 0 else floor_us
    p.options.update({"dtype": dtype, "floor_us": floor})  # the planner's resolved values
    return p
