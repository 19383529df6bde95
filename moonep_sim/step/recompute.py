"""Recompute priced in the step's time: the forward a training backward runs again.

Activation recompute (Megatron-Core's ``--recompute-granularity full|selective``,
``--recompute-modules``) trades memory (:mod:`moonep_sim.step.activations`) for compute: before a
layer's backward its dropped activations are recomputed by running part of its forward again.
The step prices that forward inside the backward, on the same cost model as every other op
(:class:`~moonep_sim.step.costs.CostModel`, whose ``recompute`` the step sets from its memory
options: :func:`moonep_sim.step.run.simulate_step`):

- ``full``: every compute op of the layer's forward again before its backward -- the norms,
  casts, projections, attention core, router, shared experts, dense FFN and the routed experts'
  GEMMs (:func:`expert_recompute_R`): exactly one more forward of the layer's compute. ASSUMED:
  the MoE dispatch and combine are not run again (the recomputed experts read the rows the
  forward received); Megatron's full recompute of a whole layer repeats them, so for an MoE
  layer this is a lower bound.
- ``selective``: the recomputed modules' ops only: ``core_attn`` the attention core,
  ``layernorm`` the norms, ``mla_up_proj`` MLA's query and KV up-projections (a GEMM of the
  ``q_b`` and ``kv_b`` weights, :func:`mla_up_proj_op`), ``moe_act`` the SwiGLU product of the
  shared and routed experts (an elementwise pass: gate and up read, product written).

The recomputed forward runs on the compute stream just before the op's backward (added to the
backward op's time), so it delays what waits on that backward, as it does on a GPU.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.models import ModelSpec
from moonep_sim.step.ops import BF16, Op, gemm

#: Attention kinds whose projections include MLA's up-projections.
MLA_KINDS = ("mla", "gated-mla")


def mla_up_proj_op(model: ModelSpec, proj: Op, tp: int = 1) -> Op | None:
    """MLA's up-projections (queries from the query latent, keys and values from the KV latent) of
    the projection op ``proj`` on one rank of a ``tp``-way group (heads split): a GEMM of
    ``proj.rows`` rows; None for a model without latents."""
    n, hd = model.heads, model.head_dim
    if not (n and hd and model.kv_lora_rank):
        return None
    rope, v, ql, kl = model.qk_rope_dim, model.v_head_dim or hd, model.q_lora_rank, model.kv_lora_rank
    nt = max(n // max(tp, 1), 1)
    parts = ((nt * (hd + rope), ql),) if ql else ()
    parts += ((nt * (hd + v), kl),)
    return gemm("mla_up_proj", proj.rows, sum(a * b for a, b in parts), kl, parts)


def recompute_op_us(costs, model: ModelSpec, op: Op, layer: int, tp: int = 1) -> float:
    """Microseconds the backward of forward op ``op`` of layer ``layer`` (>= 0; the embedding and
    head, -1, are never recomputed) pays to recompute it first under ``costs.recompute`` (an
    :class:`~moonep_sim.step.activations.ActivationOptions`, None = no recompute)."""
    a = getattr(costs, "recompute", None)
    if a is None or a.recompute == "none" or layer < 0 or op is None:
        return 0.0
    if a.recompute == "full":
        return costs.op_us(op)
    # selective: the modules the memory account drops (ActivationOptions.drops), one rule for both
    if op.kind == "attention":
        return costs.op_us(op) if a.drops("core_attn") else 0.0
    if op.name == "norm":
        return costs.op_us(op) if a.drops("layernorm") else 0.0
    if op.name == "attn_proj" and a.drops("mla_up_proj") and model.attention_kind(layer) in MLA_KINDS:
        up = mla_up_proj_op(model, op, tp)
        return costs.op_us(up) if up is not None else 0.0
    if op.name == "shared_expert" and a.drops("moe_act"):
        width = model.expert_ffn * model.shared_experts / max(tp, 1)
        return _act_bytes(op.rows, width) / costs.topo.mem_bytes_per_us
    return 0.0


def _act_bytes(rows: float, width: float) -> float:
    """The SwiGLU product of ``rows`` rows of ``width``: gate and up read, product written (bf16)."""
    return 3.0 * rows * width * BF16


def expert_recompute_R(costs, plan, model: ModelSpec) -> np.ndarray | float:
    """[R] microseconds each rank's routed-expert backward pays first to recompute: under full
    recompute the experts' forward (``costs.expert_us_R``); under selective ``moe_act`` the SwiGLU
    product of every row it received; else 0."""
    a = getattr(costs, "recompute", None)
    if a is None or a.recompute == "none":
        return 0.0
    if a.recompute == "full":
        return costs.expert_us_R(plan, model, backward=False)
    if a.drops("moe_act"):
        return _act_bytes(plan.rows_R().astype(np.float64), model.expert_ffn) / costs.topo.mem_bytes_per_us
    return 0.0


__all__ = ["MLA_KINDS", "expert_recompute_R", "mla_up_proj_op", "recompute_op_us"]
