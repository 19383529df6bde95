"""Model presets: the MoE shapes of ../ANCHORS (Kimi K3/K2, DeepSeek-V3, Qwen3, Mixtral, ...), and
``resolve_model``: a preset name, a TOML/JSON model file, a Hugging Face config.json or a mapping of
fields -> a :class:`ModelSpec` (every command that costs rows or weights takes its model through it).

Row-size conventions (DeepEP's):
- bf16 row: ``dispatch_hidden * 2`` bytes.
- fp8 row: ``dispatch_hidden + dispatch_hidden / 128 * 4`` bytes (1 byte per element plus one fp32
  scale per 128 elements).
- One expert's weights: gate, up and down projections, ``3 * dispatch_hidden * expert_ffn``
  elements (bf16: 2 bytes each); its weight gradient is reduced in fp32 (4 bytes each).
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from moonep_sim.errors import ConfigError, is_int, require


def check_spec_fields(m) -> None:
    """Types and upper bounds of a :class:`ModelSpec`'s sizes, before any arithmetic on them: each an
    integer (not a bool, a float, NaN), at most its limit (``moonep_sim.limits``), shared experts >= 0;
    the text fields strings. One line naming the field."""
    from moonep_sim.limits import MAX_LAYERS, MAX_NUM_EXPERTS, MAX_TOP_K, MAX_WIDTH

    for field, lo, hi in (("layers", 1, MAX_LAYERS), ("moe_layers", 1, MAX_LAYERS), ("num_experts", 1, MAX_NUM_EXPERTS),
                          ("top_k", 1, MAX_TOP_K), ("shared_experts", 0, MAX_NUM_EXPERTS), ("hidden", 1, MAX_WIDTH),
                          ("expert_ffn", 1, MAX_WIDTH), ("dispatch_hidden", 0, MAX_WIDTH),
                          ("n_groups", 1, MAX_NUM_EXPERTS), ("topk_groups", 1, MAX_NUM_EXPERTS)):
        v = getattr(m, field)
        require(is_int(v), f"{field} ({v!r}) must be an integer")
        require(lo <= v <= hi, f"{field} ({v}) must lie in [{lo}, {hi}]")
    for field in ("name", "router", "note", "source", "stack_source"):
        require(isinstance(getattr(m, field), str), f"{field} ({getattr(m, field)!r}) must be a string")
    check_stack_fields(m)


def model_label(m) -> str:
    """How an error names model ``m``: its name, and the file it was read from when it came from one
    (``m (from /path/m.json)``), so a refusal of a model file's content names the file."""
    src = getattr(m, "source", "")
    if src and "://" not in src and os.path.isfile(src):
        return f"{m.name} (from {src})"
    return m.name


def check_stack_fields(m) -> None:
    """The layer-stack fields of a :class:`ModelSpec` (0 = not given): each an integer within its
    limit, and consistent where given -- KV heads at most the heads and dividing them (GQA groups),
    a head width wherever there are heads, MLA's KV latent width and RoPE width for an ``mla``
    layer, a window for a ``sliding`` one. One line naming the field (the file, from a model file)."""
    from moonep_sim.limits import MAX_CONTEXT, MAX_HEADS, MAX_VOCAB, MAX_WIDTH

    for field, hi, what in (("heads", MAX_HEADS, "attention heads"), ("kv_heads", MAX_HEADS, "KV heads"),
                            ("head_dim", MAX_WIDTH, "the per-head width"), ("q_lora_rank", MAX_WIDTH, "MLA's query latent width"),
                            ("kv_lora_rank", MAX_WIDTH, "MLA's KV latent width"), ("qk_rope_dim", MAX_WIDTH, "the RoPE width"),
                            ("v_head_dim", MAX_WIDTH, "the value head width"),
                            ("sliding_window", MAX_CONTEXT, "tokens a sliding layer attends to"),
                            ("max_context", MAX_CONTEXT, "the longest context"), ("vocab", MAX_VOCAB, "embedding rows"),
                            ("dense_ffn", MAX_WIDTH, "the dense layers' FFN width")):
        v = getattr(m, field)
        require(is_int(v), f"{field} ({v!r}) must be an integer")
        require(0 <= v <= hi, f"{field} ({v}) must lie in [0, {hi}]: {what} (0 = not given)")
    require(isinstance(m.attention, str), f"attention ({m.attention!r}) must be a string")
    kinds = {k.strip() for k in m.attention.split(",") if k.strip()}
    if m.kv_heads:
        require(m.heads >= 1 and m.kv_heads <= m.heads and m.heads % m.kv_heads == 0,
                f"kv_heads ({m.kv_heads}) must divide heads ({m.heads}): each KV head serves a whole group of "
                "query heads (kv_heads = heads is MHA)")
    if m.heads and kinds - {"none"}:
        require(m.head_dim >= 1, f"head_dim ({m.head_dim}) must be >= 1: the {m.heads} heads need a width")
    if "mla" in kinds:
        for field in ("kv_lora_rank", "qk_rope_dim"):
            require(getattr(m, field) >= 1, f"{field} ({getattr(m, field)}) must be >= 1 for attention 'mla': "
                                            "multi-head latent attention caches the KV latent and its RoPE part "
                                            "(q_lora_rank may be 0: a direct query projection)")
    if "sliding" in kinds:
        require(m.sliding_window >= 1, f"sliding_window ({m.sliding_window}) must be >= 1 for attention 'sliding': "
                                       "the tokens a sliding layer attends to")


@dataclass(frozen=True)
class ModelSpec:
    """One MoE model's shape, as far as expert parallelism cares.

    name: preset name (lower-case, dashes).
    layers / moe_layers: transformer layers and how many of them are MoE.
    num_experts (E): routed experts per MoE layer.  top_k (K): experts per token.
    shared_experts: always-on experts (computed locally, never dispatched).
    hidden (H): model width.  expert_ffn (H'): routed expert intermediate width.
    dispatch_hidden: width of the row that is dispatched and that the expert consumes (== hidden,
        except for latent-MoE designs such as Kimi K3, where it may be narrower).
    n_groups / topk_groups: expert groups for group-limited routing (DeepSeek-V3: 8 / 4); 1 / 1 = none.
    router: ``softmax`` or ``sigmoid`` scores.
    note: provenance or caveats.
    source: where the shape comes from (a config file's address, or the file it was read from).

    The rest of the layer stack (read by the step model, ``moonep_sim.step``; 0 / "" = not given,
    and a step of a model that leaves them out is refused with a one-line error):
    attention: the attention kind of every layer, or a comma-separated pattern cycled over the
        layers: ``gqa`` (MHA is GQA with kv_heads == heads), ``mla`` (multi-head latent attention,
        DeepSeek-V2/V3, Kimi K2), ``gated-mla`` (MLA with an output gate, Kimi K3), ``linear`` (a
        recurrent / linear kind with a fixed state per sequence, laid out as Kimi's KDA),
        ``sliding`` (GQA over the last ``sliding_window`` tokens), ``none`` (no attention op: a bare
        MoE stack). Kimi K3: three ``linear`` then one ``gated-mla``, 23 times, then ``gated-mla``.
    heads / kv_heads / head_dim: attention heads, KV heads (GQA) and the per-head width.
    q_lora_rank / kv_lora_rank / qk_rope_dim / v_head_dim: MLA's query and KV latent widths, the
        decoupled RoPE width and the value head width (its QK head is ``head_dim + qk_rope_dim``).
    sliding_window: tokens a ``sliding`` layer attends to.  max_context: the longest context the
        model supports (max_position_embeddings).  vocab: embedding / LM-head rows.
    dense_ffn: FFN width of the dense (non-MoE) layers, which come first (``layers - moe_layers``
        of them, DeepSeek's first_k_dense_replace).
    stack_source: where the fields above come from.
    """

    name: str
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    shared_experts: int
    hidden: int
    expert_ffn: int
    dispatch_hidden: int = 0
    n_groups: int = 1
    topk_groups: int = 1
    router: str = "softmax"
    note: str = ""
    source: str = ""
    attention: str = ""
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    max_context: int = 0
    vocab: int = 0
    dense_ffn: int = 0
    stack_source: str = ""

    def __post_init__(self) -> None:
        check_spec_fields(self)   # every size an integer within its range (>= 1; >= 0 where 0 = not given)
        if self.dispatch_hidden == 0:
            object.__setattr__(self, "dispatch_hidden", self.hidden)
        require(self.moe_layers <= self.layers, f"moe_layers ({self.moe_layers}) must be <= layers ({self.layers})")
        require(self.top_k <= self.num_experts,
                f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        require(self.num_experts % self.n_groups == 0,
                f"num_experts ({self.num_experts}) must be divisible by n_groups ({self.n_groups})")
        require(self.topk_groups <= self.n_groups,
                f"topk_groups ({self.topk_groups}) must be <= n_groups ({self.n_groups})")
        require(self.router in ("softmax", "sigmoid"),
                f"router ({self.router!r}) must be 'softmax' or 'sigmoid'")
        for kind in self.attention_kinds:
            require(kind in ATTENTION_KINDS,
                    f"attention kind ({kind!r}) must be one of {', '.join(ATTENTION_KINDS)} (model {self.name})")

    @functools.cached_property
    def attention_kinds(self) -> tuple[str, ...]:
        """The attention pattern as a tuple (cycled over the layers); () when not given. Parsed once
        per instance (a 93-layer pattern is read per layer by the memory account and the step)."""
        return tuple(k.strip() for k in self.attention.split(",") if k.strip())

    def attention_kind(self, layer: int) -> str:
        """Layer ``layer``'s attention kind ("" when the model gives none)."""
        kinds = self.attention_kinds
        return kinds[layer % len(kinds)] if kinds else ""

    @property
    def dense_layers(self) -> int:
        """Dense (non-MoE) layers; they come first (first_k_dense_replace style)."""
        return self.layers - self.moe_layers

    # -- row and weight sizes -------------------------------------------------------------
    @property
    def row_bytes_bf16(self) -> int:
        """Bytes of one dispatched (or combined) bf16 row."""
        return self.dispatch_hidden * 2

    @property
    def row_bytes_fp8(self) -> int:
        """Bytes of one fp8 dispatch row, DeepEP style: 1 byte per element + fp32 scale per 128."""
        return self.dispatch_hidden + (self.dispatch_hidden + 127) // 128 * 4

    def dispatch_row_bytes(self, dtype: str = "bf16") -> int:
        require(dtype in ("bf16", "fp8"), f"dispatch dtype ({dtype!r}) must be 'bf16' or 'fp8'")
        return self.row_bytes_fp8 if dtype == "fp8" else self.row_bytes_bf16

    @property
    def combine_row_bytes(self) -> int:
        """Bytes of one combined row (always bf16)."""
        return self.row_bytes_bf16

    @property
    def expert_weight_elems(self) -> int:
        """Elements of one routed expert's weights: gate, up (H x H') and down (H' x H)."""
        return 3 * self.dispatch_hidden * self.expert_ffn

    @property
    def expert_weight_bytes(self) -> int:
        """Bytes of one expert's bf16 weights (what a prefetch copies)."""
        return self.expert_weight_elems * 2

    @property
    def expert_grad_bytes(self) -> int:
        """Bytes of one expert's fp32 weight gradient (what a gradient reduce sends home)."""
        return self.expert_weight_elems * 4

    def expert_flops_per_row(self) -> int:
        """Forward FLOPs of one token row through one SwiGLU expert (3 GEMMs, 2 FLOPs per MAC)."""
        return 2 * self.expert_weight_elems

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(row_bytes_bf16=self.row_bytes_bf16, row_bytes_fp8=self.row_bytes_fp8,
                 expert_weight_bytes=self.expert_weight_bytes,
                 expert_grad_bytes=self.expert_grad_bytes)
        return d


_HF = "huggingface.co/{}/blob/main/config.json"

#: Attention kinds of :attr:`ModelSpec.attention` (see its docstring): the names a model may give,
#: and the module list of the attention registry (``moonep_sim.step.attention``: one module per
#: kind, ``moonep_sim/step/attention/<name>.py``, states its weights, cache, core op and what it
#: saves for the backward). A new kind is its module and its name here.
ATTENTION_KINDS = ("gqa", "mla", "gated-mla", "linear", "sliding", "none")
# MLA as DeepSeek-V3 / Kimi K2 configure it (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128,
# qk_rope 64, v_head 128); only the head count differs between them.
_MLA = dict(attention="mla", head_dim=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, v_head_dim=128)

PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("kimi-k3", 93, 92, 896, 16, 2, 7168, 3072, dispatch_hidden=3584, router="sigmoid",
              note="LatentMoE: routed experts work in a 3584-wide latent (routed_expert_hidden_size), the rows "
                   "dispatched are 3584 wide; 2 shared experts in the full hidden width; 2.78T total, 104.2B "
                   "active per token (Moonshot's K3 report); AttnRes not modelled (elementwise only)",
              **{**_MLA, "attention": ",".join(["linear,linear,linear,gated-mla"] * 23 + ["gated-mla"])},
              heads=96, kv_heads=96, max_context=1048576, vocab=163840, dense_ffn=33792,
              stack_source="aiconfigurator-core 0.12.0 model_configs/moonshotai--Kimi-K3_config.json (text_config: "
                           "93 layers, KDA layers 1-91 but every 4th, full (gated MLA, mla_use_output_gate) layers "
                           "4, 8, ..., 92, 93 = 69 KDA + 24 MLA; 96 heads of 128; MLA q_lora 1536, kv_lora 512, "
                           "rope 64; first_k_dense_replace 1, intermediate_size 33792; vocab 163840 untied); KDA "
                           "projections as fla's KDA layer (full-rank gate, short conv 4); totals: Moonshot's K3 "
                           "report, 2.78T total, 104.2B active (ASSUMED: the vision tower, AttnRes and per-head "
                           "scalars are left out of both)"),
    ModelSpec("kimi-k2", 61, 60, 384, 8, 1, 7168, 2048, router="sigmoid", **_MLA, heads=64, kv_heads=64,
              max_context=131072, vocab=163840, dense_ffn=18432,
              stack_source=_HF.format("moonshotai/Kimi-K2-Instruct") + " (first_k_dense_replace 1, 64 heads, "
                                                                       "kv_lora_rank 512, vocab 163840)"),
    ModelSpec("deepseek-v3", 61, 58, 256, 8, 1, 7168, 2048, n_groups=8, topk_groups=4,
              router="sigmoid", note="8 expert groups, top-4 groups (node-limited routing)", **_MLA, heads=128,
              kv_heads=128, max_context=163840, vocab=129280, dense_ffn=18432,
              stack_source=_HF.format("deepseek-ai/DeepSeek-V3") + " (first_k_dense_replace 3, 128 heads, "
                                                                   "kv_lora_rank 512, intermediate_size 18432)"),
    ModelSpec("deepseek-v2", 60, 59, 160, 6, 2, 5120, 1536, n_groups=8, topk_groups=3,
              note="8 expert groups, top-3 groups (device-limited routing)", source=_HF.format("deepseek-ai/DeepSeek-V2"),
              **_MLA, heads=128, kv_heads=128, max_context=163840, vocab=102400, dense_ffn=12288,
              stack_source=_HF.format("deepseek-ai/DeepSeek-V2") + " (first_k_dense_replace 1, 128 heads, "
                                                                   "q_lora_rank 1536, kv_lora_rank 512, intermediate_size "
                                                                   "12288)"),
    ModelSpec("qwen3-235b", 94, 94, 128, 8, 0, 4096, 1536, attention="gqa", heads=64, kv_heads=4, head_dim=128,
              max_context=40960, vocab=151936, stack_source=_HF.format("Qwen/Qwen3-235B-A22B")),
    ModelSpec("mixtral-8x22b", 56, 56, 8, 2, 0, 6144, 16384, attention="gqa", heads=48, kv_heads=8, head_dim=128,
              max_context=65536, vocab=32768, stack_source=_HF.format("mistralai/Mixtral-8x22B-v0.1")),
    ModelSpec("mixtral-8x7b", 32, 32, 8, 2, 0, 4096, 14336, note="the shipped real trace", attention="gqa",
              heads=32, kv_heads=8, head_dim=128, max_context=32768, vocab=32000,
              stack_source=_HF.format("mistralai/Mixtral-8x7B-v0.1")),
    ModelSpec("gpt-oss-120b", 36, 36, 128, 4, 0, 2880, 2880, attention="sliding,gqa", heads=64, kv_heads=8,
              head_dim=64, sliding_window=128, max_context=131072, vocab=201088,
              stack_source=_HF.format("openai/gpt-oss-120b") + " (layer_types alternate sliding (128) and full)"),
    ModelSpec("olmoe-1b-7b", 16, 16, 64, 8, 0, 2048, 1024, note="the shipped real trace", attention="gqa",
              heads=16, kv_heads=16, head_dim=128, max_context=4096, vocab=50304,
              stack_source=_HF.format("allenai/OLMoE-1B-7B-0924")),
    # The four below: values from each model's public Hugging Face config.json (docs/traces.md
    # lists the sources; `source` names the file).
    ModelSpec("qwen1.5-moe-a2.7b", 24, 24, 60, 4, 4, 2048, 1408,
              note="shared expert FFN 5632 = 4 x 1408, counted as 4 shared experts; "
                   "top-k weights not renormalised (norm_topk_prob false)",
              source=_HF.format("Qwen/Qwen1.5-MoE-A2.7B"), attention="gqa", heads=16, kv_heads=16, head_dim=128,
              max_context=8192, vocab=151936, stack_source=_HF.format("Qwen/Qwen1.5-MoE-A2.7B")),
    ModelSpec("qwen3-30b-a3b", 48, 48, 128, 8, 0, 2048, 768, source=_HF.format("Qwen/Qwen3-30B-A3B"),
              attention="gqa", heads=32, kv_heads=4, head_dim=128, max_context=40960, vocab=151936,
              stack_source=_HF.format("Qwen/Qwen3-30B-A3B")),
    ModelSpec("deepseek-v2-lite", 27, 26, 64, 6, 2, 2048, 1408,
              note="first layer dense (first_k_dense_replace 1); greedy top-6, no expert groups",
              source=_HF.format("deepseek-ai/DeepSeek-V2-Lite"),
              **{**_MLA, "q_lora_rank": 0}, heads=16, kv_heads=16, max_context=163840, vocab=102400, dense_ffn=10944,
              stack_source=_HF.format("deepseek-ai/DeepSeek-V2-Lite") + " (q_lora_rank null: a direct query projection)"),
    ModelSpec("gpt-oss-20b", 24, 24, 32, 4, 0, 2880, 2880, source=_HF.format("openai/gpt-oss-20b"),
              attention="sliding,gqa", heads=64, kv_heads=8, head_dim=64, sliding_window=128, max_context=131072,
              vocab=201088, stack_source=_HF.format("openai/gpt-oss-20b")),
]}


def custom_model(num_experts: int, top_k: int, hidden: int = 1024, expert_ffn: int = 512,
                 name: str = "custom", **kw) -> ModelSpec:
    """A model of an explicit shape (for traces that name no preset)."""
    return ModelSpec(name, kw.pop("layers", 1), kw.pop("moe_layers", 1), num_experts, top_k,
                     kw.pop("shared_experts", 0), hidden, expert_ffn, **kw)


# ---------------------------------------------------------------------------------- any model shape
#: The layer-stack fields (``moonep_sim.step``) a model file may give beside the MoE shape (all optional).
STACK_FIELDS = ("attention", "heads", "kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_dim",
                "v_head_dim", "sliding_window", "max_context", "vocab", "dense_ffn", "stack_source")
# A model file (TOML or JSON) or mapping: key -> ModelSpec field. The first four are required.
MODEL_FILE_FIELDS: dict[str, str] = {
    "num_experts": "num_experts", "top_k": "top_k", "hidden": "hidden", "expert_ffn": "expert_ffn",
    "name": "name", "dispatch_hidden": "dispatch_hidden", "groups": "n_groups", "n_groups": "n_groups",
    "topk_groups": "topk_groups", "shared_experts": "shared_experts", "layers": "layers",
    "moe_layers": "moe_layers", "router": "router", "note": "note", "source": "source",
    **{k: k for k in STACK_FIELDS}}
_REQUIRED = ("num_experts", "top_k", "hidden", "expert_ffn")


def model_from_fields(fields: Mapping[str, Any], where: str = "model") -> ModelSpec:
    """A ModelSpec from the fields of a model file (see ``MODEL_FILE_FIELDS``); one-line errors."""
    unknown = sorted(set(fields) - set(MODEL_FILE_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: field ({unknown[0]!r}) must be one of {', '.join(MODEL_FILE_FIELDS)}")
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        raise ConfigError(f"{where}: fields ({', '.join(missing)}) must be given: a model needs "
                          f"{', '.join(_REQUIRED)}")
    # each value's type is ModelSpec's first check; every MoE layer unless said otherwise
    kw = {"name": "custom", "layers": 1, "shared_experts": 0, **{MODEL_FILE_FIELDS[k]: v for k, v in fields.items()}}
    kw.setdefault("moe_layers", kw["layers"])
    try:
        return ModelSpec(**kw)
    except ConfigError as e:
        msg = str(e)
        for k in fields:  # a field named as the file spells it ("groups", not ModelSpec's "n_groups")
            if MODEL_FILE_FIELDS[k] != k:
                msg = re.sub(rf"\b{MODEL_FILE_FIELDS[k]}\b", k, msg)
        raise ConfigError(f"{where}: {msg}") from None


def model_from_hf_config(cfg: Mapping[str, Any], where: str = "config.json", name: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` of a MoE model (Mixtral, Qwen-MoE, OLMoE,
    DeepSeek-V2/V3, GPT-OSS field names).

    Every field read is checked on its own (an integer where the model code takes one, within its
    range: ``first_k_dense_replace`` below ``num_hidden_layers``, ``n_group`` dividing the experts,
    ...), the message naming the field and ``where``; nothing is clamped, rounded or truncated. MoE
    layers are counted as the model code picks them: layer i is MoE unless i < first_k_dense_replace,
    i is in mlp_only_layers, or (i + 1) % decoder_sparse_step != 0 (Qwen) / i % moe_layer_freq != 0
    (DeepSeek)."""
    from moonep_sim.limits import MAX_LAYERS, MAX_NUM_EXPERTS, MAX_TOP_K, MAX_WIDTH

    def given(k):
        return cfg.get(k) not in (None, "")

    def get_int(keys, lo, hi, default=None, why=""):
        """(key, value) of the first of ``keys`` given, checked; (None, default) when none is."""
        for k in keys:
            if given(k):
                v = cfg[k]
                if not is_int(v) or not lo <= v <= hi:
                    raise ConfigError(f"{where}: {k} ({v!r}) must be an integer in [{lo}, {hi}]" + (f": {why}" if why else ""))
                return k, v
        return None, default

    _, E = get_int(("num_experts", "num_local_experts", "n_routed_experts"), 1, MAX_NUM_EXPERTS)
    _, K = get_int(("num_experts_per_tok", "experts_per_token", "moe_topk"), 1, MAX_TOP_K)
    _, H = get_int(("hidden_size",), 1, MAX_WIDTH)
    _, F = get_int(("moe_intermediate_size", "intermediate_size"), 1, MAX_WIDTH)
    if None in (E, K, H, F):
        raise ConfigError(f"{where}: a Hugging Face MoE config must give the experts (num_experts / "
                          "num_local_experts / n_routed_experts), top-k (num_experts_per_tok), "
                          "hidden_size and moe_intermediate_size or intermediate_size")
    _, layers = get_int(("num_hidden_layers",), 1, MAX_LAYERS, 1)
    _, dense = get_int(("first_k_dense_replace",), 0, layers - 1, 0,
                       f"the first layers that are dense, fewer than num_hidden_layers ({layers})")
    mlp_only = cfg.get("mlp_only_layers")
    mlp_only = [] if mlp_only is None else mlp_only
    if not isinstance(mlp_only, list) or not all(is_int(i) and 0 <= i < layers for i in mlp_only) \
            or len(set(mlp_only)) != len(mlp_only):
        raise ConfigError(f"{where}: mlp_only_layers ({mlp_only!r}) must be a list of distinct layer ids "
                          f"in [0, {layers})")
    step_key, step = get_int(("decoder_sparse_step", "moe_layer_freq"), 1, layers, 1, "every step-th layer is MoE")
    off = 1 if step_key == "decoder_sparse_step" else 0
    skip = set(mlp_only)
    moe_layers = sum(1 for i in range(layers) if i >= dense and i not in skip and (i + off) % step == 0)
    if moe_layers == 0:
        raise ConfigError(f"{where}: first_k_dense_replace ({dense}), mlp_only_layers and the sparse step "
                          f"({step}) must leave at least one MoE layer of num_hidden_layers ({layers})")
    _, shared = get_int(("n_shared_experts",), 0, MAX_NUM_EXPERTS, 0)
    _, shared_ffn = get_int(("shared_expert_intermediate_size",), 0, MAX_WIDTH, 0)
    if not shared and shared_ffn:
        shared = max(1, round(shared_ffn / F))
    _, groups = get_int(("n_group",), 1, E, 1, f"expert groups, dividing the experts ({E})")
    _, topk_groups = get_int(("topk_group",), 1, groups, 1, f"groups kept per token, at most n_group ({groups})")
    router = cfg.get("scoring_func", "softmax")
    if router not in ("softmax", "sigmoid"):
        raise ConfigError(f"{where}: scoring_func ({router!r}) must be 'softmax' or 'sigmoid'")
    label = next((cfg[k] for k in ("_name_or_path", "model_type") if given(k)), "custom")
    if not isinstance(label, str):
        raise ConfigError(f"{where}: _name_or_path / model_type ({label!r}) must be a string")
    fields = {"name": (name or label).split("/")[-1].lower(),
              "num_experts": E, "top_k": K, "hidden": H, "expert_ffn": F, "layers": layers,
              "moe_layers": moe_layers, "shared_experts": shared, "n_groups": groups, "topk_groups": topk_groups,
              "router": router, "source": where}
    return model_from_fields(fields, where)


def _read_model_file(path: Path) -> ModelSpec:
    from moonep_sim.io import read_config_bytes, read_toml

    where = str(path)
    if path.suffix.lower() == ".toml":
        doc = read_toml(path, "model")
        doc = doc.get("model", doc) if isinstance(doc.get("model"), dict) else doc
    else:
        raw = read_config_bytes(path, "model", "JSON")
        try:
            doc = json.loads(raw)  # a NaN / Infinity is refused by the field it stands in
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ConfigError(f"{where}: expected a JSON model file, found invalid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a table/object of model fields, found {type(doc).__name__}")
    if "hidden_size" in doc or "model_type" in doc:
        return model_from_hf_config(doc, where, name=path.parent.name if path.name == "config.json" else path.stem)
    doc = dict(doc)
    doc.setdefault("name", path.stem)
    doc.setdefault("source", where)
    return model_from_fields(doc, where)


def resolve_model(spec: "ModelSpec | str | os.PathLike | Mapping[str, Any]") -> ModelSpec:
    """The model a command costs rows and weights with, from whatever a user gave:

    - a :class:`ModelSpec` (returned as is);
    - a preset name (``moonep-sim models`` lists them);
    - a path to a ``.toml`` or ``.json`` model file with the fields of ``MODEL_FILE_FIELDS``
      (``num_experts``, ``top_k``, ``hidden``, ``expert_ffn`` required; ``name``, ``dispatch_hidden``,
      ``groups``, ``topk_groups``, ``shared_experts``, ``layers``, ``moe_layers``, ``router``
      optional; a TOML file may hold them under ``[model]``), or a Hugging Face ``config.json``;
    - a mapping of those fields (e.g. a trace's ``model_spec`` metadata).

    Raises :class:`ConfigError` (one line) otherwise.
    """
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, Mapping):
        return model_from_fields(spec)
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if text.lower() in PRESETS:   # preset names are lower-case
            return PRESETS[text.lower()]
        path = Path(text)
        if path.suffix.lower() in (".toml", ".json") or os.path.lexists(path):
            if not os.path.lexists(path):
                raise ConfigError(f"model ({text!r}) must be a preset or an existing .toml/.json file: "
                                  "no such file")
            return _read_model_file(path)  # a pipe, a folder, a link loop: refused as what it is
        raise ConfigError(f"model ({text!r}) must be one of the presets ({', '.join(sorted(PRESETS))}) "
                          "or a .toml/.json model file")
    raise ConfigError(f"model ({spec!r}) must be a preset name, a model file path, a mapping of fields "
                      "or a ModelSpec")


#: The model called ``name``: a preset or a model file (:func:`resolve_model`, the one rule).
get_model = resolve_model


def model_fields(m: ModelSpec) -> dict[str, Any]:
    """The model-file fields of ``m`` (what a trace stores as ``model_spec``; ``resolve_model`` reads
    them back to an equal ModelSpec)."""
    return {"name": m.name, **{k: getattr(m, f) for k, f in MODEL_FILE_FIELDS.items()
                               if k not in ("name", "n_groups")}}
