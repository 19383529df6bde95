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

MODES = ("train", "prefill", "decode")
#: Default KV context of a decode step when none is given (assumed: a mid-length chat context).
DEFAULT_DECODE_CONTEXT = 4096
BF16 = 2


@dataclass(frozen=True)
class Op:
    """One compute operation of one rank.

    name: the op (``attn_proj``, ``attn_core``, ``router`` ...; ``_bwd`` suffix in backward).
    kind: ``gemm`` (FLOPs at the GEMM rate, with the rows-per-GEMM efficiency curve), ``attention``
        (FLOPs and bytes, roofline) or ``bytes`` (memory-bound: elementwise, norm, gather).
    flops / bytes: per rank.  rows: the GEMM's M dimension (tokens), for the efficiency curve.
    shape: the profile key of this op's shape (``tokens=4096`` or ``tokens=32,context=4096``).
    """

    name: str
    kind: str
    flops: float
    bytes: float
    rows: int
    shape: str


@dataclass(frozen=True)
class StepShape:
    """What one rank runs in a step: the mode, its tokens and the context per sequence.

    tokens: T per rank (decode: sequences, one new token each).  context: keys per sequence
    (train / prefill: the sequence length, default T; decode: the KV context, default
    :data:`DEFAULT_DECODE_CONTEXT`).  sequences: sequences on the rank.
    """

    mode: str
    tokens: int
    context: int

    @property
    def sequences(self) -> int:
        if self.mode == "decode":
            return self.tokens
        return max(1, self.tokens // self.context) if self.context <= self.tokens else 1

    def attended(self) -> float:
        """Mean keys one query token attends to (causal in train / prefill)."""
        if self.mode == "decode":
            return float(self.context)
        if self.context <= self.tokens:  # whole sequences of `context` tokens
            return (self.context + 1) / 2.0
        prior = self.context - self.tokens  # one chunk at the end of a longer sequence
        return prior + (self.tokens + 1) / 2.0


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
    if any(k != "none" for k in kinds):
        require(model.heads >= 1, f"model ({name}) heads ({model.heads}) must be >= 1 for its attention")
    if mode == "decode":
        require(any(k != "none" for k in kinds),
                f"mode (decode) must be run by a model with attention: {name} has none, so there is no "
                "KV context to decode against")
    if model.max_context:
        need = context if mode == "decode" else max(context, 1)
        require(need <= model.max_context, f"context ({need}) must be <= the model's max context "
                                           f"({model.max_context}, {name})")
    return StepShape(mode, int(tokens), int(context))


# ---------------------------------------------------------------------------------- parameters
def attention_params(model: ModelSpec, kind: str) -> int:
    """Weights of one layer's attention projections (elements)."""
    H, n, hd = model.hidden, model.heads, model.head_dim
    if kind == "none":
        return 0
    if kind == "mla":
        rope, v = model.qk_rope_dim, model.v_head_dim or hd
        q = (H * model.q_lora_rank + model.q_lora_rank * n * (hd + rope)) if model.q_lora_rank else H * n * (hd + rope)
        return q + H * (model.kv_lora_rank + rope) + model.kv_lora_rank * n * (hd + v) + n * v * H
    if kind == "linear":  # q, k, v, o and the output gate (ASSUMED, KDA-like: 5 H x (heads x head_dim))
        return 5 * H * n * hd
    kv = model.kv_heads or n
    return H * n * hd + 2 * H * kv * hd + n * hd * H


def dense_params(model: ModelSpec) -> dict[str, int]:
    """Non-expert weights of the whole model (elements), by part: what every rank holds."""
    H = model.hidden
    attn = sum(attention_params(model, model.attention_kind(l)) for l in range(model.layers))
    shared = model.moe_layers * model.shared_experts * 3 * H * model.expert_ffn
    router = model.moe_layers * H * model.num_experts
    dense = model.dense_layers * 3 * H * model.dense_ffn
    norms = model.layers * 2 * H
    embed = 2 * model.vocab * H  # input embedding and LM head (untied)
    return dict(attention=attn, shared_experts=shared, router=router, dense_ffn=dense, norms=norms, embedding=embed)


def kv_elems_per_token(model: ModelSpec, kind: str) -> int:
    """K/V cache elements one token of one layer keeps (0 for linear / none)."""
    if kind == "mla":
        return model.kv_lora_rank + model.qk_rope_dim
    if kind in ("gqa", "sliding"):
        return 2 * (model.kv_heads or model.heads) * model.head_dim
    return 0


def linear_state_bytes(model: ModelSpec) -> int:
    """A linear-attention layer's fixed state per sequence: heads x head_dim x head_dim fp32."""
    return model.heads * model.head_dim * model.head_dim * 4


def _attn_dims(model: ModelSpec, kind: str, mode: str) -> tuple[int, int]:
    """(QK width, V width) per head of the attention core."""
    if kind == "mla":
        if mode == "decode":  # absorbed: queries attend the latent directly
            return model.kv_lora_rank + model.qk_rope_dim, model.kv_lora_rank
        return model.head_dim + model.qk_rope_dim, model.v_head_dim or model.head_dim
    return model.head_dim, model.head_dim


# ---------------------------------------------------------------------------------- ops
def _gemm(name: str, tokens: int, weights: int) -> Op:
    """A GEMM of ``tokens`` rows through ``weights`` elements (weights read once, rows in/out)."""
    return Op(name, "gemm", 2.0 * tokens * weights, float(weights) * BF16, tokens, f"tokens={tokens}")


def attention_core(model: ModelSpec, kind: str, shape: StepShape) -> Op:
    T, n = shape.tokens, model.heads
    if kind == "linear":  # state update + readout per token; the state read and written once per sequence
        dk = model.head_dim
        flops = 4.0 * T * n * dk * dk
        state = float(linear_state_bytes(model)) * shape.sequences * 2
        return Op("attn_core", "attention", flops, state + 4.0 * T * n * dk * BF16, T, f"tokens={T},kind=linear")
    dqk, dv = _attn_dims(model, kind, shape.mode)
    keys = shape.attended()
    if kind == "sliding" and model.sliding_window:
        keys = min(keys, float(model.sliding_window))
    flops = 2.0 * T * n * keys * (dqk + dv)
    qo = float(T) * n * (dqk + dv) * BF16
    if shape.mode == "decode":  # every sequence reads its whole K/V cache
        kv = float(shape.sequences) * keys * kv_elems_per_token(model, kind) * BF16
    else:  # flash attention: K/V of each sequence read once per query block (ASSUMED: once)
        kv = float(T) * kv_elems_per_token(model, kind) * BF16
    ctx = shape.context if kind != "sliding" or not model.sliding_window else min(shape.context, model.sliding_window)
    return Op("attn_core", "attention", flops, qo + kv, T, f"tokens={T},context={ctx},kind={kind}")


def _norm(T: int, H: int) -> Op:
    # read the input and the residual, write the sum and the normalised output (ASSUMED 4 passes)
    return Op("norm", "bytes", 0.0, 4.0 * T * H * BF16, T, f"tokens={T}")


@dataclass(frozen=True)
class LayerOps:
    """One layer's forward ops: ``before`` the MoE block (or the whole dense layer), the MoE
    block's ``router`` and ``shared`` ops (None for a dense layer). ``moe`` says which."""

    index: int
    attention: str
    moe: bool
    before: tuple[Op, ...]
    router: Op | None
    shared: Op | None


def layer_ops(model: ModelSpec, layer: int, shape: StepShape) -> LayerOps:
    """The forward ops of layer ``layer`` (dense layers first, ``model.dense_layers`` of them)."""
    T, H = shape.tokens, model.hidden
    kind = model.attention_kind(layer)
    ops: list[Op] = []
    if kind != "none":
        ops += [_norm(T, H), _gemm("attn_proj", T, attention_params(model, kind)), attention_core(model, kind, shape)]
    moe = layer >= model.dense_layers
    if not moe:
        require(model.dense_ffn >= 1, f"model ({model.name}) dense_ffn must be given: it has "
                                      f"{model.dense_layers} dense layer(s)", ConfigError)
        ops += [_norm(T, H), _gemm("dense_ffn", T, 3 * H * model.dense_ffn)]
        return LayerOps(layer, kind, False, tuple(ops), None, None)
    if kind != "none":
        ops.append(_norm(T, H))
    router = Op("router", "gemm", 2.0 * T * H * model.num_experts, float(H * model.num_experts) * BF16, T,
                f"tokens={T}")
    shared = _gemm("shared_expert", T, 3 * H * model.expert_ffn * model.shared_experts) if model.shared_experts else None
    return LayerOps(layer, kind, True, tuple(ops), router, shared)


def head_ops(model: ModelSpec, shape: StepShape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """(ops before the first layer, ops after the last): embedding; LM head (and loss in train).
    Serving computes the head for the last token of each sequence only."""
    if not model.vocab:
        return (), ()
    T, H, V = shape.tokens, model.hidden, model.vocab
    first = (Op("embed", "bytes", 0.0, 2.0 * T * H * BF16, T, f"tokens={T}"),)
    rows = T if shape.mode == "train" else shape.sequences
    last = [_gemm("lm_head", rows, H * V)]
    if shape.mode == "train":  # fp32 logits: softmax read + write, and its gradient
        last.append(Op("loss", "bytes", 0.0, 3.0 * T * V * 4, T, f"tokens={T}"))
    return first, tuple(last)


def backward_op(op: Op) -> Op:
    """The backward of ``op``: GEMMs twice the FLOPs (input and weight gradients) and their
    weights read plus the gradient written; attention 2.5x the FLOPs (FlashAttention's backward
    runs 5 matmuls to the forward's 2) and twice the bytes; memory-bound ops twice the bytes."""
    f = {"gemm": 2.0, "attention": 2.5, "bytes": 0.0}[op.kind]
    return replace(op, name=op.name + "_bwd", flops=op.flops * f, bytes=op.bytes * 2.0)


__all__ = ["DEFAULT_DECODE_CONTEXT", "LayerOps", "MODES", "Op", "StepShape", "attention_core", "attention_params",
           "backward_op", "dense_params", "head_ops", "kv_elems_per_token", "layer_ops", "linear_state_bytes",
           "step_shape"]
