"""Record routing from a running Hugging Face transformers MoE model into a trace.

Notation: L layers, T tokens, K top-k, E experts, S steps (forward calls).

``record(model, path)`` is a context manager: it hooks every router module of ``model`` and writes
one trace on exit with one step per forward call of ``model`` (a ``generate()`` run gives its
prefill, then one step per decoding pass), on CPU or GPU::

    from moonep_sim.routing import record
    with record(model, "routing.safetensors"):
        model.generate(**inputs, max_new_tokens=32)

Routers: transformers (>= 5) gives every MoE family a router module (``MixtralTopKRouter``,
``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``, ``DeepseekV2TopkRouter``,
``DeepseekV3TopkRouter``, ``GptOssTopKRouter``, ...) whose forward returns ``(router_logits,
top-k weights [N, K], top-k ids [N, K])``; the recorder keeps the ids and weights the router itself
returned (nothing is recomputed). A module counts as a router when its class name ends in
``Router`` and it returns such a triple; its layer id is the first ``layers.<i>`` in its name.

Rows are recorded as the router sees them: ``[batch * sequence, K]`` per call, padding included
(a dispatch moves padded rows too). ``transformers`` is an optional extra; this module only needs
torch, and works on any model with such routers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moonep_sim.errors import ConfigError
from moonep_sim.routing.trace import TraceMeta, write_trace

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")


def find_routers(model) -> dict[int, Any]:
    """``{layer id: router module}`` of a transformers MoE model (see the module docstring)."""
    out: dict[int, Any] = {}
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("Router"):
            continue
        m = _LAYER.search(name)
        if m is None:
            continue
        layer = int(m.group(1))
        if layer in out:
            raise ConfigError(f"record: layer ({layer}) must have one router module, found two "
                              f"({type(out[layer]).__name__} and {name})")
        out[layer] = mod
    return out


@dataclass
class Recording:
    """What a recording holds so far: per step, per layer, the ids [N, K] and weights [N, K]."""

    steps: list[dict[int, tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)
    num_experts: int = 0
    top_k: int = 0
    layer_ids: list[int] = field(default_factory=list)
    model_fields: dict[str, Any] | None = None
    model_name: str = ""
    path: str | None = None

    def tensors(self) -> tuple[dict[str, np.ndarray], int]:
        """Trace tensors ``topk_ids [L, T, K]``, ``topk_weights``, ``step [T]``; steps with no routing
        (a forward call that never reached a router) are left out. Returns (tensors, steps kept)."""
        ids_parts, w_parts, steps = [], [], []
        for s, rec in enumerate(self.steps):
            if not rec:
                continue
            missing = [l for l in self.layer_ids if l not in rec]
            if missing:
                raise ConfigError(f"record: step {s}: layers ({missing}) must all be routed in every forward "
                                  "call: a call skipped them")
            n = {rec[l][0].shape[0] for l in self.layer_ids}
            if len(n) != 1:
                raise ConfigError(f"record: step {s}: every layer must route the same rows, found row "
                                  f"counts {sorted(n)}")
            ids_parts.append(np.stack([rec[l][0] for l in self.layer_ids]))
            w_parts.append(np.stack([rec[l][1] for l in self.layer_ids]))
            steps.append(np.full(n.pop(), len(steps), np.int32))
        if not steps:
            raise ConfigError("record: expected at least one forward call through the model's routers, found none")
        ids = np.concatenate(ids_parts, axis=1).astype(np.int64)
        w = np.concatenate(w_parts, axis=1).astype(np.float32)
        return {"topk_ids": ids, "topk_weights": w, "step": np.concatenate(steps)}, len(steps)

    def meta(self, num_tokens: int, num_steps: int, source: str, attribution: str) -> TraceMeta:
        return TraceMeta(kind="tokens", num_experts=self.num_experts, top_k=self.top_k,
                         layer_ids=list(self.layer_ids), num_tokens=num_tokens,
                         model=None, model_spec=self.model_fields,
                         steps=f"one step per forward call of the model ({num_steps} steps)", source=source,
                         attribution=attribution,
                         import_report={"format": "recorded", "steps": num_steps, "tokens": num_tokens})


class record:  # noqa: N801 (a context manager used like a function)
    """Hook the routers of ``model``; on exit write the trace to ``path`` (if given).

    model: a torch module with router modules (transformers MoE causal LMs).
    path: the trace file (written atomically on a clean exit; nothing is written if the block raises).
    layers: model layer ids to record (default: every layer with a router).
    attribution: stored in the trace; the default says what it is: a recording of this model.
    The :class:`Recording` is returned by ``__enter__`` (``rec.tensors()`` for the arrays).
    """

    def __init__(self, model, path: str | os.PathLike | None = None, *, layers=None, attribution: str | None = None):
        self.model = model
        self.path = None if path is None else os.fspath(path)
        routers = find_routers(model)
        if not routers:
            raise ConfigError(f"record: model ({type(model).__name__}) must have router modules (classes named "
                              "*Router returning (logits, weights, ids), as transformers >= 5 MoE models have): "
                              "found none")
        if layers is not None:
            bad = sorted(set(layers) - set(routers))
            if bad:
                raise ConfigError(f"record: layers ({bad}) must be layers with a router: {sorted(routers)}")
            routers = {l: routers[l] for l in layers}
        self.routers = dict(sorted(routers.items()))
        self.attribution = attribution
        self.rec = Recording(layer_ids=list(self.routers), path=self.path)
        self._handles: list[Any] = []

    # -- hooks ----------------------------------------------------------------------------
    def _on_forward(self, module, args, kwargs=None):
        self.rec.steps.append({})

    def _on_router(self, layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise ConfigError(f"record: layer {layer}: router {type(module).__name__} must return "
                                  "(logits, weights, ids), found another output")
            _, w, ids = output
            ids_np = ids.detach().to("cpu").numpy().astype(np.int64, copy=False)
            w_np = w.detach().float().to("cpu").numpy()
            if not self.rec.steps:      # a router called outside a model forward (e.g. a test)
                self.rec.steps.append({})
            cur = self.rec.steps[-1]
            if layer in cur:            # called twice in one forward: keep both calls' rows
                a, b = cur[layer]
                ids_np, w_np = np.concatenate([a, ids_np]), np.concatenate([b, w_np])
            cur[layer] = (ids_np.reshape(-1, ids_np.shape[-1]), w_np.reshape(-1, w_np.shape[-1]))
            if not self.rec.top_k:
                self.rec.top_k = int(ids_np.shape[-1])
                self.rec.num_experts = int(getattr(module, "num_experts", 0) or
                                           getattr(module, "weight").shape[0])
        return hook

    def __enter__(self) -> Recording:
        cfg = getattr(self.model, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            from moonep_sim.models import model_fields, model_from_hf_config
            try:
                spec = model_from_hf_config(cfg.to_dict(), where=f"{type(self.model).__name__}.config")
                self.rec.model_fields = model_fields(spec)
                self.rec.model_name = spec.name
            except ConfigError:
                self.rec.model_fields = None
        self._handles.append(self.model.register_forward_pre_hook(self._on_forward))
        for layer, mod in self.routers.items():
            self._handles.append(mod.register_forward_hook(self._on_router(layer)))
        return self.rec

    def __exit__(self, exc_type, exc, tb) -> bool:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if exc_type is not None or self.path is None:
            return False
        tensors, S = self.rec.tensors()
        if self.rec.model_fields and (self.rec.model_fields["num_experts"] != self.rec.num_experts
                                      or self.rec.model_fields["top_k"] != self.rec.top_k):
            self.rec.model_fields = None        # the config disagrees with the routers: trust the routers
        try:
            import transformers
            lib = f"transformers {transformers.__version__}"
        except ImportError:                     # pragma: no cover - any torch model with routers
            lib = "torch"
        source = (f"recorded with moonep_sim.routing.record from {type(self.model).__name__} ({lib}), "
                  f"one step per forward call")
        attribution = self.attribution if self.attribution is not None else (
            f"recording of {type(self.model).__name__}; the routing is that model's, with whatever weights "
            "it had loaded")
        write_trace(self.path, self.rec.meta(tensors["topk_ids"].shape[1], S, source, attribution), tensors)
        return False
