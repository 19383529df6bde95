"""A model's layer stack as compute operations: what one rank computes in one step, op by op.

Notation: T tokens on a rank in one pass (``tokens_per_rank``; in decode, T sequences of one
token each), C the context (keys a query attends to), H hidden, E routed experts, K top-k, V vocab.
Bytes are bf16 (2 per element) unless named otherwise; FLOPs count 2 per multiply-add.

Parallelism (an assumption the docs repeat): pure expert parallelism with data-parallel attention
-- every rank holds all attention, norm, router, shared-expert, dense-FFN, embedding and head
weights and runs them on its own T tokens (no tensor or pipeline parallelism); routed experts
are split over the ranks (the Plan). So every non-expert op has the same cost on every rank.

Ops of one layer, forward (:func:`layer_ops`), in program order:
``norm`` (attention input norm + residual), ``attn_proj`` (the attention's projections, a GEMM),
``attn_core`` (attention itself: FLOPs and the K/V bytes it reads; a linear kind reads its fixed
state instead), ``norm`` (FFN input norm + residual), then either ``dense_ffn`` (a dense layer) or
``router`` + ``shared_expert`` (an MoE layer; its routed experts are the Plan's, priced by
:mod:`moonep_sim.step.costs`). The stack adds ``embed`` first and ``lm_head`` (+ ``loss`` in
train) last. The backward of each op is the op named ``<op>_bwd`` (:func:`backward_op`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moonep_sim.errors import ConfigError, require
from moonep_sim.models import ModelSpec, model_label
from moonep_sim.step.attention import attention_kind
from moonep_sim.step.ops import BF16, Op, StepShape, gemm, tp_gemm

MODES = ("train", "prefill", "decode")
#: Default KV context of a decode step when none is given (assumed: a mid-length chat context).
DEFAULT_DECODE_CONTEXT = 4096


def step_shape(model: ModelSpec, mode: str, tokens: int, context: int | None) -> StepShape:
    """Check a step's mode, tokens and context against the model (one-line errors)."""
    require(mode in MODES, f"mode ({mode!r}) must be one of {', '.join(MODES)}")
    require(tokens >= 1, f"tokens per rank ({tokens}) must be >= 1")
    if context is None:
        context = DEFAULT_DECODE_CONTEXT if mode == "decode" else tokens
    require(context >= 1, f"context ({context}) must be >= 1")
    kinds = model.attention_kinds
    name = model_label(model)  # a model file is named by its path
    require(bool(kinds), f"model ({name}) must give its attention (the attention, heads, ... fields) for a "
                         "step: the step model needs the whole layer stack")
    attends = any(attention_kind(k).has_op for k in kinds)
    if attends:
        require(model.heads >= 1, f"model ({name}) heads ({model.heads}) must be >= 1 for its attention")
    if mode == "decode":
        require(attends,
                f"mode (decode) must be run by a model with attention: {name} has none, so there is no "
                "KV context to decode against")
    if model.max_context:
        require(context <= model.max_context, f"context ({context}) must be <= the model's max context "
                                              f"({model.max_context}, {name})")
    return StepShape(mode, int(tokens), int(context))


# ---------------------------------------------------------------------------------- parameters
def attention_params(model: ModelSpec, kind: str) -> int:
    """Weights of one layer's attention projections (elements): the kind's
    (``moonep_sim.step.attention``)."""
    return attention_kind(kind).params(model)


def dense_params(model: ModelSpec) -> dict[str, int]:
    """Non-expert weights of the whole model (elements), by part: what every rank holds."""
    H = model.hidden
    attn = sum(attention_params(model, model.attention_kind(l)) for l in range(model.layers))
    shared = model.moe_layers * model.shared_experts * 3 * H * model.expert_ffn
    router = model.moe_layers * H * model.num_experts
    dense = model.dense_layers * 3 * H * model.dense_ffn
    latent = model.moe_layers * latent_proj_params(model)
    norms = model.layers * 2 * H
    embed = 2 * model.vocab * H  # input embedding and LM head (untied)
    return dict(attention=attn, shared_experts=shared, router=router, dense_ffn=dense, latent_proj=latent, norms=norms,
                embedding=embed)


def latent_proj_params(model: ModelSpec) -> int:
    """A latent MoE layer's projections (Kimi K3's LatentMoE: the routed experts work in a
    ``dispatch_hidden``-wide latent): hidden -> latent before the dispatch and latent -> hidden
    after the combine, ``2 x H x D`` elements, held by every rank; 0 when the rows are ``hidden`` wide."""
    D, H = model.dispatch_hidden, model.hidden
    return 0 if D == H else 2 * H * D


def parameter_counts(model: ModelSpec) -> dict[str, int]:
    """The model's parameters (elements), as model cards count them.

    ``total``: every weight (:func:`dense_params`' parts and every routed expert of every MoE
    layer; no vision tower, no MTP / draft layers, biases and per-head scalars left out).
    ``active``: the weights one token's forward multiplies by -- every non-expert weight but the
    input embedding (a row lookup), and its top-k routed experts per MoE layer (DeepSeek's and
    Moonshot's convention). ``active_with_embedding``: the same with the input embedding (Qwen's,
    Mistral's and AI2's convention). ``routed_experts``: the routed experts' weights of the whole
    model; ``dense``: everything else."""
    dense = sum(dense_params(model).values())
    routed = model.moe_layers * model.num_experts * model.expert_weight_elems
    with_embedding = dense + model.moe_layers * model.top_k * model.expert_weight_elems
    return {"total": dense + routed, "active": with_embedding - model.vocab * model.hidden,
            "active_with_embedding": with_embedding, "routed_experts": routed, "dense": dense}


def kv_elems_per_token(model: ModelSpec, kind: str) -> int:
    """K/V cache elements one token of one layer keeps (0 for a kind with a fixed state, or none)."""
    return attention_kind(kind).kv_elems_per_token(model)


def _norm(T: int, H: int) -> Op:
    # read the input and the residual, write the sum and the normalised output (ASSUMED 4 passes)
    return Op("norm", "bytes", 0.0, 4.0 * T * H * BF16, T, f"tokens={T}")


@dataclass(frozen=True)
class LayerOps:
    """One layer's forward ops: ``before`` the MoE block (or the whole dense layer), the MoE
    block's ``router`` and ``shared`` ops (None for a dense layer). ``moe`` says which."""

    moe: bool
    before: tuple[Op, ...]
    router: Op | None
    shared: Op | None


def layer_ops(model: ModelSpec, layer: int, shape: StepShape) -> LayerOps:
    """The forward ops of layer ``layer`` (dense layers first, ``model.dense_layers`` of them)."""
    T, H = shape.tokens, model.hidden
    kind = model.attention_kind(layer)
    att = attention_kind(kind)
    ops: list[Op] = []
    if att.has_op:
        parts = att.gemm_parts(model)
        # one cast per distinct FP8 GEMM input (the layer input once, each intermediate projection's input)
        width = sum({k for _, k in parts}) if parts else H
        ops += [_norm(T, H), _cast(T, width), tp_gemm("attn_proj", T, att.params(model), H, parts, shape.tp),
                att.core(model, shape)]
    moe = layer >= model.dense_layers
    if not moe:
        require(model.dense_ffn >= 1, f"model ({model.name}) dense_ffn must be given: it has "
                                      f"{model.dense_layers} dense layer(s)", ConfigError)
        ops += [_norm(T, H), tp_gemm("dense_ffn", T, 3 * H * model.dense_ffn, H,
                                     ((2 * model.dense_ffn, H), (H, model.dense_ffn)), shape.tp)]
        return LayerOps(False, tuple(ops), None, None)
    if att.has_op:
        ops.append(_norm(T, H))
    # the MoE input cast once (dispatch payload and shared experts) and the shared experts'
    # intermediate rows; the router's top-k pass
    ops += [_cast(T, H + model.expert_ffn * model.shared_experts),
            Op("router_topk", "bytes", 0.0, 3.0 * T * model.num_experts * 4, T, f"tokens={T}")]
    if latent_proj_params(model):  # into the experts' latent and back (one GEMM of both)
        ops.append(gemm("latent_proj", T, latent_proj_params(model), H))
    router = Op("router", "gemm", 2.0 * T * H * model.num_experts, float(H * model.num_experts) * BF16, T,
                f"tokens={T}", H)
    shared = tp_gemm("shared_expert", T, 3 * H * model.expert_ffn * model.shared_experts, H,
                     ((2 * model.expert_ffn * model.shared_experts, H), (H, model.expert_ffn * model.shared_experts)),
                     shape.tp) if model.shared_experts else None
    return LayerOps(True, tuple(ops), router, shared)


def _cast(T: int, width: int) -> Op:
    """FP8 quantise of T rows of ``width`` (read bf16, write fp8 and one fp32 scale per 128: DeepSeek's
    per-token cast); priced only when the GEMMs are FP8 (``CostModel``), twice in the backward (the
    transposed casts of the input and of the output gradient the weight gradient reads)."""
    return Op("quantize", "cast", 0.0, float(T) * width * (BF16 + 1 + 4 / 128), T, f"tokens={T},width={width}")


def head_ops(model: ModelSpec, shape: StepShape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """(ops before the first layer, ops after the last): embedding; LM head (and loss in train).
    Serving computes the head for the last token of each sequence only."""
    if not model.vocab:
        return (), ()
    T, H, V = shape.tokens, model.hidden, model.vocab
    first = (Op("embed", "bytes", 0.0, 2.0 * T * H * BF16, T, f"tokens={T}"),)
    rows = T if shape.mode == "train" else shape.sequences
    last = [tp_gemm("lm_head", rows, H * V, H, (), shape.tp)]
    if shape.mode == "train":  # fp32 logits: softmax read + write, and its gradient
        last.append(Op("loss", "bytes", 0.0, 3.0 * T * V * 4, T, f"tokens={T}"))
    return first, tuple(last)


def backward_op(op: Op) -> Op:
    """The backward of ``op``: GEMMs twice the FLOPs (input and weight gradients: Narayanan et al.,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, the
    backward pass is 2x the forward's matmul FLOPs) and their weights read plus the gradient written;
    attention 2.5x the FLOPs (Dao, "FlashAttention-2", 2023: the backward runs 5 matmuls to the
    forward's 2) and twice the bytes; memory-bound ops (and casts) twice the bytes."""
    f = {"gemm": 2.0, "attention": 2.5, "bytes": 0.0, "cast": 0.0}[op.kind]
    return replace(op, name=op.name + "_bwd", flops=op.flops * f, bytes=op.bytes * 2.0)


__all__ = ["BF16", "DEFAULT_DECODE_CONTEXT", "LayerOps", "MODES", "Op", "StepShape",
           "attention_params", "backward_op", "dense_params", "head_ops", "kv_elems_per_token", "latent_proj_params",
           "layer_ops", "parameter_counts", "step_shape"]
