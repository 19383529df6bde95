"""Tiny random-initialised transformers MoE models, built offline (no weights are downloaded).

``build_model(spec, seed)`` takes a tiny preset name (``tiny-qwen2-moe``, ``tiny-mixtral``,
``tiny-deepseek``, ...; :data:`TINY`), a ``config.json`` path, or a local checkpoint directory
(``config.json`` plus weights, loaded with ``from_pretrained(..., local_files_only=True)``), and
returns the causal LM in eval mode. Presets use E=8 experts, top-2, hidden 32, 2 layers, and turn
the routers' auxiliary loss off (``output_router_logits=False``): a load-balancing loss computed on
one rank's shard differs from the whole batch's, so it is left out of the equality checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from moonep_sim.errors import ConfigError, require
from moonep_sim.integrations.hf import require_transformers

E, K = 8, 2
_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=128, intermediate_size=16, tie_word_embeddings=False)


def _presets() -> dict[str, Callable[[Any], Any]]:
    return {
        "tiny-mixtral": lambda tf: tf.MixtralConfig(**_COMMON, num_local_experts=E, num_experts_per_tok=K),
        "tiny-qwen2-moe": lambda tf: tf.Qwen2MoeConfig(**_COMMON, moe_intermediate_size=16,
                                                       shared_expert_intermediate_size=32, num_experts=E,
                                                       num_experts_per_tok=K),
        "tiny-qwen3-moe": lambda tf: tf.Qwen3MoeConfig(**_COMMON, moe_intermediate_size=16, num_experts=E,
                                                       num_experts_per_tok=K, head_dim=8),
        "tiny-olmoe": lambda tf: tf.OlmoeConfig(**_COMMON, num_experts=E, num_experts_per_tok=K),
        "tiny-deepseek-v2": lambda tf: tf.DeepseekV2Config(**_COMMON, moe_intermediate_size=16, n_routed_experts=E,
                                                           num_experts_per_tok=K, n_shared_experts=1,
                                                           first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=None,
                                                           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8),
        "tiny-deepseek": lambda tf: tf.DeepseekV3Config(**_COMMON, moe_intermediate_size=16, n_routed_experts=E,
                                                        num_experts_per_tok=K, n_shared_experts=1,
                                                        first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8,
                                                        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8,
                                                        n_group=2, topk_group=1),
        "tiny-gpt-oss": lambda tf: tf.GptOssConfig(**_COMMON, num_local_experts=E, num_experts_per_tok=K,
                                                   head_dim=8),
    }


#: the family each preset stands for (tests parametrise over these)
FAMILY = {"tiny-mixtral": "mixtral", "tiny-qwen2-moe": "qwen2_moe", "tiny-qwen3-moe": "qwen3_moe",
          "tiny-olmoe": "olmoe", "tiny-deepseek-v2": "deepseek_v2", "tiny-deepseek": "deepseek_v3",
          "tiny-gpt-oss": "gpt_oss"}
TINY = tuple(FAMILY)


def tiny_config(name: str):
    """The transformers config of a tiny preset."""
    tf = require_transformers()
    presets = _presets()
    require(name in presets, f"model ({name!r}) must be one of {', '.join(TINY)}, a config.json or a checkpoint "
                             "directory")
    cfg = presets[name](tf)
    cfg.output_router_logits = False
    return cfg


def config_from_json(path: str | os.PathLike, raw: bytes | None = None):
    """A transformers config from a ``config.json`` (its ``model_type`` picks the class); ``raw``:
    its bytes, when already read."""
    from moonep_sim.io import read_config_bytes

    tf = require_transformers()
    p = Path(path)
    try:
        d = json.loads(read_config_bytes(p, "model config", "JSON") if raw is None else raw)
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{p}: must be a readable JSON model config: {e}") from None
    require(isinstance(d, dict) and "model_type" in d, f"{p}: config must be a JSON object with a model_type")
    try:
        cfg = tf.AutoConfig.for_model(d.pop("model_type"), **d)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{p}: model_type must be one transformers knows: {e}") from None
    cfg.output_router_logits = False
    return cfg


def check_model_spec(spec: str, ranks: int | None = None) -> Path | None:
    """Refuse (one line) a ``--model`` the ranks could not build, before any rank starts: no preset,
    no config.json and no directory holding one; a config.json that is not a regular file, not JSON,
    of a model_type transformers does not know, without MoE layers (a dense model), with no attention
    heads or KV heads not dividing them; and, given the EP size ``ranks``, ranks that do not divide
    the experts. Returns the config file (None for a preset)."""
    p = Path(spec)
    if spec in TINY:
        cfg_path, E = None, globals()["E"]
    else:
        if p.is_dir():
            cfg_path = p / "config.json"
            require(cfg_path.is_file(), f"checkpoint directory ({p}) must hold a config.json")
        elif p.suffix == ".json":
            require(os.path.lexists(p), f"model config ({p}) must exist")
            cfg_path = p
        else:
            raise ConfigError(f"model ({spec!r}) must be one of {', '.join(TINY)}, a config.json or a checkpoint "
                              "directory")
        E = _check_config(cfg_path)
    if ranks is not None:
        require(1 <= ranks <= E and E % ranks == 0,
                f"--nproc ({ranks}) must divide the model's experts ({E}): each rank homes E/R experts")
    return cfg_path


def _check_config(path: Path) -> int:
    """A config.json's MoE shape and attention heads, checked as the model code will read them
    (``moonep_sim.models.model_from_hf_config``), and its class built by transformers; returns E."""
    from moonep_sim.io import read_config_bytes
    from moonep_sim.limits import MAX_HEADS
    from moonep_sim.models import model_from_hf_config

    raw = read_config_bytes(path, "model config", "JSON")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: must be a readable JSON model config: {e}") from None
    require(isinstance(doc, dict) and "model_type" in doc, f"{path}: config must be a JSON object with a model_type")
    spec = model_from_hf_config(doc, str(path))  # a dense config (no experts) is refused here
    heads = doc.get("num_attention_heads")
    if heads is not None:
        require(isinstance(heads, int) and not isinstance(heads, bool) and 1 <= heads <= MAX_HEADS,
                f"{path}: num_attention_heads ({heads!r}) must be an integer in [1, {MAX_HEADS}]")
        kv = doc.get("num_key_value_heads")
        if kv is not None:
            require(isinstance(kv, int) and not isinstance(kv, bool) and 1 <= kv <= heads and heads % kv == 0,
                    f"{path}: num_key_value_heads ({kv!r}) must divide num_attention_heads ({heads})")
        if doc.get("head_dim") is None:
            require(spec.hidden % heads == 0, f"{path}: num_attention_heads ({heads}) must divide hidden_size "
                                              f"({spec.hidden}) (or give head_dim)")
    vocab = doc.get("vocab_size")
    from moonep_sim.limits import MAX_VOCAB
    require(vocab is None or (isinstance(vocab, int) and not isinstance(vocab, bool) and 1 <= vocab <= MAX_VOCAB),
            f"{path}: vocab_size ({vocab!r}) must be an integer in [1, {MAX_VOCAB}]")
    _check_memory(path, spec, int(vocab or 0))
    config_from_json(path, raw)
    return spec.num_experts


def weight_elements(spec, vocab: int) -> int:
    """About how many weights a rank of the HF launcher holds (every rank builds the whole model):
    embeddings and LM head, attention (4 H^2 per layer), routers, every expert and shared expert."""
    H, L = spec.hidden, spec.layers
    return (2 * vocab * H + L * 4 * H * H + spec.moe_layers * (spec.num_experts + spec.shared_experts) * 3 * H * spec.expert_ffn
            + spec.moe_layers * H * spec.num_experts)


def _check_memory(path: Path, spec, vocab: int) -> None:
    """Refuse a config whose weights and gradients (float32) do not fit this machine's memory on one
    rank: the launcher runs small models on CPU, and each rank would fail allocating them."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need = weight_elements(spec, vocab) * 4 * 2  # float32 weights and their gradients
    require(need <= total, f"{path}: the model must fit this machine's memory on each rank: about "
                           f"{need / 2 ** 30:,.1f} GiB of float32 weights and gradients per rank, the machine has "
                           f"{total / 2 ** 30:,.1f} GiB (the HF launcher builds the whole model on every CPU rank)")


def build_model(spec: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The causal LM named by ``spec`` (preset, config.json, or checkpoint directory), eval mode.

    Presets and config files are initialised from ``torch.manual_seed(seed)``: the same seed gives
    the same weights in every process. A checkpoint directory is loaded as saved. In float64 the
    experts run transformers' eager loop (its default grouped_mm kernel takes no float64).
    """
    tf = require_transformers()
    p = Path(spec)
    # transformers' default grouped_mm experts kernel has no float64: use its eager loop then
    impl = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    if spec in TINY:
        cfg = tiny_config(spec)
    elif p.is_dir():
        require((p / "config.json").is_file(), f"checkpoint directory ({p}) must hold a config.json")
        try:
            model = tf.AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype, **impl)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{p}: must be a local transformers checkpoint: {str(e).splitlines()[0]}") from None
        model.config.output_router_logits = False
        return model.eval()
    elif p.suffix == ".json":
        require(p.is_file(), f"model config ({p}) must exist")
        cfg = config_from_json(p)
    else:
        raise ConfigError(f"model ({spec!r}) must be one of {', '.join(TINY)}, a config.json or a checkpoint directory")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, **impl)
    return model.to(dtype).eval()


__all__ = ["FAMILY", "TINY", "build_model", "check_model_spec", "config_from_json", "tiny_config"]
