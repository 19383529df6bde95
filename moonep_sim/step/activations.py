"""What a training forward saves for its backward, per token and layer, and how many micro-batches
a pipeline schedule keeps alive.

Notation: h hidden, n attention heads, d head width, f a dense FFN's width, F an expert's, D the
dispatched row width, E routed experts, s keys a query attends to, t TP degree. Bytes per token of
one layer (a sequence of s tokens and micro-batch b multiply it by s*b).

The account follows Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), Sec. 4, tensor by tensor, so that a layer of their form (MHA, a 4h GeLU MLP,
dropout, attention scores materialised) gives their closed forms exactly: ``34 s b h + 5 a s^2 b``
per layer without parallelism; ``s b h (10 + 24 / t + 5 a s / (h t))`` with TP; ``s b h / t (34 +
5 a s / h)`` with TP and sequence parallelism; ``34 s b h / t`` with selective recompute; ``2 s b
h`` with full recompute. The tensors, as :func:`layer_saved` keeps them:

- ``sp`` part (split over t only with sequence parallelism): each norm's input (2h each), each
  norm's output that feeds a GEMM (the attention's and the FFN's inputs, 2h each), the dropout
  masks after attention and after the FFN (h each, with ``dropout``), and the router's fp32 logits
  (4E) of an MoE layer.
- ``tp`` part (split over t): attention's q, k, v (2 n d, 2 kv d each under GQA) and its output
  (the output projection's input, 2 n d_v); with ``flash`` its fp32 log-sum-exp (4n), otherwise the
  scores: softmax output (2 n s), dropout mask (n s) and output (2 n s) -- the ``5 a s`` term; a
  GeLU MLP's two 4h-wide tensors (2f each), a SwiGLU FFN's gate and up outputs and their product
  (3 x 2f); the shared experts' like a SwiGLU FFN of width F each.
- MLA (DeepSeek-V2/V3, Kimi): the query and KV latents (the up-projections' inputs; replicated
  over TP, Megatron duplicates the down-projections) plus the up-projected q, k, v that attention
  reads (recomputed from the latents with the ``mla_up_proj`` module).
- ``linear`` (KDA-like): q, k, v and output (4 x 2 n d, ASSUMED; the chunked state is recomputed).
- routed experts, per row a rank receives: its dispatched input (D wide) and the SwiGLU's gate, up
  and product (3F) -- :func:`routed_row_saved`; the rows come from the Plans (they grow with the
  rank's load under a dropless strategy).

A GEMM's input is saved in the GEMM's dtype (``gemm_bytes``): with fp8 GEMMs (Transformer Engine,
DeepSeek-V3) the backward's weight gradient reads the fp8 copy of the input, 1 + 4/128 bytes per
element, instead of bf16. Norm inputs, logits, scores and attention outputs stay bf16 / fp32.

Recompute (Megatron-Core's ``--recompute-granularity`` / ``--recompute-modules``): ``full`` keeps
only each layer's input (and, while a layer is recomputed, that one layer's activations);
``selective`` drops what its modules recompute: ``core_attn`` (the scores; nothing with flash
attention), ``mla_up_proj`` (the up-projected q/k/v), ``layernorm`` (the norms' outputs, recomputed
from their inputs), ``moe_act`` (the SwiGLU product of routed and shared experts, recomputed from
the gate and up outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec

BF16 = 2
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "moe_act")
#: Megatron-Core's default selective recompute: the attention core.
DEFAULT_SELECTIVE = ("core_attn",)


@dataclass(frozen=True)
class ActivationOptions:
    """recompute: ``none``, ``selective`` or ``full``.  modules: what selective recompute recomputes
    (:data:`RECOMPUTE_MODULES`).  flash: attention keeps its log-sum-exp, not its scores.
    dropout: dropout masks are saved (Megatron's GPT default; modern MoE recipes run none).
    ffn: ``swiglu`` (gate, up, product) or ``gelu`` (4h MLP of the paper).
    gemm_bytes: bytes per element of a saved GEMM input (2 bf16; fp8: 1 + 4/128)."""

    recompute: str = "none"
    modules: tuple[str, ...] = DEFAULT_SELECTIVE
    flash: bool = True
    dropout: bool = False
    ffn: str = "swiglu"
    gemm_bytes: float = BF16

    def __post_init__(self) -> None:
        require(self.recompute in RECOMPUTE, f"recompute ({self.recompute!r}) must be one of {', '.join(RECOMPUTE)}")
        bad = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        require(not bad, f"recompute module(s) ({', '.join(bad)}) must be among {', '.join(RECOMPUTE_MODULES)}")
        require(self.ffn in ("swiglu", "gelu"), f"ffn ({self.ffn!r}) must be swiglu or gelu")
        require(self.gemm_bytes > 0, f"gemm bytes ({self.gemm_bytes}) must be > 0")

    def drops(self, module: str) -> bool:
        """Whether selective recompute recomputes ``module`` (full recompute: everything)."""
        return self.recompute == "full" or (self.recompute == "selective" and module in self.modules)


@dataclass(frozen=True)
class Saved:
    """Bytes per token one layer saves: ``sp`` (split over TP only with sequence parallelism),
    ``tp`` (split over TP) and ``rep`` (replicated over TP)."""

    sp: float = 0.0
    tp: float = 0.0
    rep: float = 0.0

    def per_rank(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes per token on one rank of a TP group of ``tp``."""
        return (self.sp / tp if sequence_parallel else self.sp) + self.tp / tp + self.rep

    def __add__(self, o: "Saved") -> "Saved":
        return Saved(self.sp + o.sp, self.tp + o.tp, self.rep + o.rep)


def _ffn_saved(width: float, opts: ActivationOptions) -> float:
    """tp-part bytes per token of one FFN of ``width`` (its input counted by the caller)."""
    g = opts.gemm_bytes
    if opts.ffn == "gelu":  # GeLU input (the first GEMM's output, bf16) and output (the second's input)
        return width * BF16 + width * g
    prod = 0.0 if opts.drops("moe_act") else width * g  # the down projection's input
    return 2 * width * BF16 + prod  # gate and up outputs (the SwiGLU's backward reads both)


def attention_saved(model: ModelSpec, kind: str, keys: float, opts: ActivationOptions) -> Saved:
    """One layer's attention block (its norm included), bytes per token."""
    if kind in ("", "none"):
        return Saved()
    h, n, g = model.hidden, model.heads, opts.gemm_bytes
    d = model.head_dim or (h // max(n, 1))
    sp = h * BF16  # the norm's input (the layer input)
    sp += 0.0 if opts.drops("layernorm") else h * g  # the norm's output: the projections' input
    sp += h if opts.dropout else 0.0  # the dropout mask after the output projection
    tp = rep = 0.0
    if kind == "linear":
        tp += 3 * n * d * BF16 + n * d * g  # q, k, v and the output (the output projection's input)
    elif kind == "mla":
        dqk, dv = d + model.qk_rope_dim, model.v_head_dim or d
        rep += (model.q_lora_rank or 0) * g + model.kv_lora_rank * g + model.qk_rope_dim * BF16  # the latents
        if not opts.drops("mla_up_proj"):
            tp += n * dqk * BF16 * 2 + n * dv * BF16  # up-projected q, k and v
        tp += n * dv * g  # attention's output: the output projection's input
    else:
        kv = model.kv_heads or n
        tp += (n + kv) * d * BF16 + kv * d * BF16 + n * d * g  # q, k, v and the output
    if kind != "linear":
        if opts.flash:
            tp += 4.0 * n  # fp32 log-sum-exp per head
        elif not opts.drops("core_attn"):
            tp += 5.0 * n * keys  # softmax output (2), dropout mask (1), dropout output (2) per key
    return Saved(sp, tp, rep)


def ffn_saved(model: ModelSpec, dense: bool, opts: ActivationOptions) -> Saved:
    """One layer's FFN block (its norm included; an MoE layer's router and shared experts, not the
    routed experts -- :func:`routed_row_saved`), bytes per token."""
    h, g = model.hidden, opts.gemm_bytes
    sp = h * BF16 + (0.0 if opts.drops("layernorm") else h * g) + (h if opts.dropout else 0.0)
    if dense:
        return Saved(sp, _ffn_saved(model.dense_ffn, opts))
    sp += 4.0 * model.num_experts  # the router's fp32 logits
    return Saved(sp, model.shared_experts * _ffn_saved(model.expert_ffn, opts))


def layer_saved(model: ModelSpec, layer: int, keys: float, opts: ActivationOptions) -> Saved:
    """Bytes per token layer ``layer`` saves without recompute-all (see the module docstring)."""
    return attention_saved(model, model.attention_kind(layer), keys, opts) + \
        ffn_saved(model, layer < model.dense_layers, opts)


def routed_row_saved(model: ModelSpec, opts: ActivationOptions, etp: int = 1) -> float:
    """Bytes one received expert row saves on its rank: the dispatched input (D, the expert
    GEMMs' input) and the SwiGLU's tensors (F wide each, split over expert-TP)."""
    F = model.expert_ffn / etp
    return model.dispatch_hidden * opts.gemm_bytes + _ffn_saved(F, opts)


def full_recompute_saved(model: ModelSpec) -> Saved:
    """Per token and layer under full recompute: the layer input only (bf16)."""
    return Saved(sp=model.hidden * BF16)


# ---------------------------------------------------------------------------------- schedules
def chunks_in_flight(schedule: str, pp: int, vpp: int, rank: int, micro_batches: int) -> list[int]:
    """The model chunks (indices into ``Parallel.stage_layers``) whose forward activations pipeline
    rank ``rank`` holds at its peak, one entry per (micro-batch, chunk) alive.

    - ``1f1b``: ``min(pp - rank, m)`` micro-batches of its stage (the first stage holds pp).
    - ``interleaved`` (Megatron's warm-up): ``min(2 (pp - rank - 1) + (vpp - 1) pp + 1, m vpp)``
      (micro-batch, chunk) forwards, in Megatron's order (pp micro-batches of chunk 0, then of chunk
      1, ...): on the first rank ``L (1 + (pp - 1) / (pp vpp))`` layer-micro-batches
      (Korthikanti et al., Sec. 4.2.3).
    - ``dualpipe``: ``pp + 1`` micro-batches (DeepSeek-V3 report, Table 2), half of them through
      each of the rank's two chunks (its stage and the mirror stage ``pp - 1 - rank``).
    """
    m = max(int(micro_batches), 1)
    if schedule == "dualpipe":
        n = min(pp + 1, 2 * m)
        mine, mirror = rank, pp - 1 - rank
        return [mine if i % 2 == 0 else mirror for i in range(n)]
    if schedule == "interleaved":
        n = min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, m * vpp)
        return [((k // pp) % vpp) * pp + rank for k in range(n)]
    return [rank] * min(pp - rank, m)


def rank_chunks(schedule: str, pp: int, vpp: int, rank: int) -> list[int]:
    """The model chunks pipeline rank ``rank`` holds the weights of: chunk ``rank + c pp`` for each
    virtual stage c; with ``dualpipe`` its stage and the mirror stage (two copies of the model over
    the pipeline, DeepSeek-V3's "2x parameters")."""
    if schedule == "dualpipe":
        return sorted({rank, pp - 1 - rank})
    return [rank + c * pp for c in range(vpp)]


__all__ = ["ActivationOptions", "DEFAULT_SELECTIVE", "RECOMPUTE", "RECOMPUTE_MODULES", "Saved", "attention_saved",
           "chunks_in_flight", "ffn_saved", "full_recompute_saved", "layer_saved", "rank_chunks", "routed_row_saved"]
