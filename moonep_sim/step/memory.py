"""Memory per rank: weights, communication buffers, activations, KV cache, optimizer state.

Notation: R ranks, L layers (L_moe MoE layers), T tokens per rank, K top-k, H hidden, D the
dispatched row width, H' the expert FFN width, epn = E / R home experts per rank. Bytes.

Parts (each a number per rank; ``peak`` is their sum on the rank where it is largest, since
every part below is live at the end of the forward in train, and at once in serving):

- ``weights``: the dense share (every non-expert weight: data-parallel attention, ASSUMED no
  tensor or pipeline parallelism), the rank's home experts of every MoE layer, and the static
  replicas a strategy keeps (a Plan's extra slots that are not copied per step: EPLB-style), all
  bf16.
- ``buffers``: the strategy's communication buffers as the real library sizes them, from the
  Plans: a static buffer (``Plan.capacity_R``: MoonEP's ``S x K`` rows -- ``S`` the Buffer's
  capacity in tokens --, DeepEP low-latency's ``[local experts, max tokens x ranks]``, a
  capacity factor's padded rows) is allocated once at its size; a dropless strategy's receive
  buffer holds the rows it is routed (the largest over layers); both hold dispatch and combine
  rows. A relayed-kernel Plan (DeepEP's normal kernels) adds its fixed NVLink and RDMA buffers
  (:data:`RELAY_FIXED_BUFFER_BYTES`, ASSUMED). Per-step copies (MoonEP's prefetch) hold the most
  copy slots a rank uses in any layer (MoonEP allocates ``epn`` of them), and in train as many fp32
  gradient slots.
- ``activations`` (train): what the forward saves for the backward, every layer: the layer
  input, attention's q/k/v and output (dropped with ``recompute``, which recomputes attention and
  norms in the backward), the FFN's input and intermediates, and the routed experts' received rows
  and their intermediates -- which grow with the rank's load under a dropless strategy; plus the
  fp32 logits.
- ``kv_cache`` (prefill / decode): K/V (or MLA latents, or a linear layer's fixed state) of every
  sequence on the rank at its context.
- ``gradients`` and ``optimizer`` (train): fp32 gradients of every weight the rank holds, and
  mixed-precision Adam's fp32 master weights and two moments (``optimizer_bytes_per_param``,
  default 12) -- the dense share's sharded over ``optimizer_shard`` ranks (Megatron's distributed
  optimizer over the data-parallel group; default R), the experts' not (one copy per expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import Plan
from moonep_sim.step.attention import attention_kind
from moonep_sim.step.stack import BF16, StepShape, dense_params

#: ASSUMED: DeepEP normal kernels' fixed buffers (NVLink + RDMA), the order of what its tests allocate (1 GB each).
RELAY_FIXED_BUFFER_BYTES = 2 * 10**9
#: Mixed-precision Adam: fp32 master weights, first and second moments (ZeRO's K = 12).
ADAM_BYTES_PER_PARAM = 12
GRAD_BYTES_PER_PARAM = 4


@dataclass(frozen=True)
class MemoryOptions:
    """optimizer_bytes_per_param: optimizer state per parameter (12 = mixed-precision Adam).
    optimizer_shard: ranks the dense share's optimizer state is sharded over (0 = R).
    recompute: recompute attention and norms in the backward instead of saving them."""

    optimizer_bytes_per_param: float = ADAM_BYTES_PER_PARAM
    optimizer_shard: int = 0
    recompute: bool = False

    def __post_init__(self) -> None:
        require(self.optimizer_bytes_per_param >= 0,
                f"optimizer bytes per param ({self.optimizer_bytes_per_param}) must be >= 0")
        require(self.optimizer_shard >= 0, f"optimizer shard ({self.optimizer_shard}) must be >= 0 (0 = ranks)")


@dataclass(frozen=True)
class PlanFootprint:
    """What the memory account reads from one Plan ([R] arrays): slots and per-step copies per
    rank, the static buffer rows (``Plan.capacity_R``, None = dropless), the rows received
    (padded), the dispatch + combine bytes of one row, and whether its kernels relay (DeepEP's
    normal kernels, with their fixed buffers). Small and picklable (worker processes return it)."""

    slots_R: np.ndarray
    copies_R: np.ndarray
    capacity_R: np.ndarray | None
    rows_R: np.ndarray
    row_bytes: int
    relay: bool

    @classmethod
    def of(cls, p: Plan) -> "PlanFootprint":
        R = p.ranks
        return cls(np.bincount(p.slot_rank_S, minlength=R).astype(np.float64),
                   np.bincount(p.slot_rank_S[p.is_copy_S()], minlength=R).astype(np.float64),
                   None if p.capacity_R is None else p.capacity_R.astype(np.float64),
                   p.rows_R().astype(np.float64), int(p.costs.dispatch_row_bytes + p.costs.combine_row_bytes),
                   bool(p.kernel is not None and p.kernel.relay))


def memory_per_rank(model: ModelSpec, shape: StepShape, plans: "Sequence[Plan | PlanFootprint]", R: int,
                    opts: MemoryOptions = MemoryOptions()) -> dict:
    """Every part (see the module docstring) per rank, their peak and the rank it is on.

    plans: the strategy's Plans (or their :class:`PlanFootprint`) of the step's MoE layers."""
    train = shape.mode == "train"
    H, T = model.hidden, shape.tokens
    D, F = model.dispatch_hidden, model.expert_ffn
    epn = model.num_experts / R
    dense = float(sum(dense_params(model).values()))
    expert_elems = 3.0 * D * F
    home = epn * model.moe_layers * expert_elems
    # per-step copies (prefetch slots) vs static replicas, and the buffers, from the plans
    copy_slots = np.zeros(R)
    replicas = np.zeros(R)
    buf = np.zeros(R)
    act_rows = np.zeros(R)
    fixed = 0.0
    for p in plans:
        f = p if isinstance(p, PlanFootprint) else PlanFootprint.of(p)
        extra = np.maximum(f.slots_R - f.copies_R - epn, 0.0)  # slots beyond the home group, not copied per step
        replicas = np.maximum(replicas, extra)
        copy_slots = np.maximum(copy_slots, f.copies_R)
        rows = f.capacity_R if f.capacity_R is not None else f.rows_R
        buf = np.maximum(buf, rows * f.row_bytes)
        act_rows = np.maximum(act_rows, f.rows_R)
        if f.relay:
            fixed = RELAY_FIXED_BUFFER_BYTES
    weight_bytes = np.full(R, (dense + home) * BF16) + replicas * model.moe_layers * expert_elems * BF16
    buffers = buf + fixed + copy_slots * expert_elems * (BF16 + (GRAD_BYTES_PER_PARAM if train else 0))
    parts: dict[str, np.ndarray] = {"weights": weight_bytes, "buffers": buffers}
    if train:
        kinds = [model.attention_kind(l) for l in range(model.layers)]
        per_tok = 0.0
        for l, kind in enumerate(kinds):
            per_tok += H * BF16  # the layer input
            if not opts.recompute:
                per_tok += attention_kind(kind).saved_per_token(model, shape.mode) + 2 * H * BF16  # + two norms' inputs
            if l < model.dense_layers:
                per_tok += (H + 3 * model.dense_ffn) * BF16
            else:
                per_tok += (H + model.num_experts * 2) * BF16 + model.shared_experts * 3 * F * BF16
        # routed experts: each received row's input and its three H'-wide intermediates, every MoE layer
        routed = act_rows * (D + 3 * F) * BF16 * model.moe_layers
        logits = float(T) * model.vocab * 4
        parts["activations"] = np.full(R, per_tok * T + logits) + routed
        params_R = dense / max(opts.optimizer_shard or R, 1) + home + replicas * model.moe_layers * expert_elems
        parts["gradients"] = np.full(R, (dense + home) * GRAD_BYTES_PER_PARAM) \
            + replicas * model.moe_layers * expert_elems * GRAD_BYTES_PER_PARAM
        parts["optimizer"] = params_R * opts.optimizer_bytes_per_param
    else:
        kv = 0.0
        for l in range(model.layers):  # each layer's cache as its attention kind keeps it
            kv += attention_kind(model.attention_kind(l)).cache_bytes(model, shape)
        parts["kv_cache"] = np.full(R, kv)
    total = sum(parts.values())
    r = int(np.argmax(total))
    return {"peak_bytes": float(total[r]), "peak_rank": r,
            "parts": {k: float(v[r]) for k, v in parts.items()},
            "parts_max": {k: float(v.max()) for k, v in parts.items()},
            "assumptions": ("data-parallel attention, no tensor/pipeline parallelism; optimizer "
                            f"{opts.optimizer_bytes_per_param:g} B/param sharded over "
                            f"{opts.optimizer_shard or R} ranks (dense share); recompute {opts.recompute}")}


__all__ = ["ADAM_BYTES_PER_PARAM", "MemoryOptions", "PlanFootprint", "RELAY_FIXED_BUFFER_BYTES", "memory_per_rank"]
