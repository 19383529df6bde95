"""Where an experiment's routing comes from: a trace file, a generator spec, or routing in memory.

Notation (docs/concepts.md): T tokens of all ranks, K top-k, E experts, R ranks.

The generator-spec grammar, one for every command (``simulate --gen``, ``compare --trace gen:``,
``Scenario(routing="gen:...")``)::

    model=mixtral-8x7b,maxvio=1,tokens-per-rank=512,layers=1,seed=0

Keys (``-`` and ``_`` are the same): ``model`` (preset name, or a TOML/JSON model file,
:func:`moonep_sim.models.resolve_model`); at most one popularity: ``maxvio`` (MoonEP's method,
lognormal popularity with sigma bisected to hit it), ``sigma``, ``zipf``, ``uniform=1``, or
``hot=N,hot-share=F``; ``tokens-per-rank``; ``layers``; ``seed``; ``groups``/``topk-groups``
(group-limited routing; a preset brings its own); ``experts``/``top-k`` (override the preset's
E and K). The defaults are :data:`GEN_DEFAULTS`. An unknown key, a key given twice, a non-number
or two popularities is one line naming the key and listing the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.limits import MAX_TOKENS_PER_RANK
from moonep_sim.models import PRESETS, ModelSpec, custom_model, resolve_model
from moonep_sim.plan import GlobalRouting
from moonep_sim.routing.steps import parse_step_mode, read_layer, step_batches
from moonep_sim.routing.trace import LayerRouting, Trace, TraceMeta, write_trace

GEN_PREFIX = "gen:"

#: One set of defaults for generated routing, used by every command and the Python API.
GEN_DEFAULTS: dict[str, Any] = {"model": "mixtral-8x7b", "maxvio": 1.0, "tokens_per_rank": 512, "layers": 1,
                                "seed": 0}

_POPULARITY = ("maxvio", "sigma", "zipf", "uniform", "hot")
_INT_KEYS = ("tokens_per_rank", "layers", "seed", "hot", "groups", "topk_groups", "experts", "top_k")
GEN_KEYS = ("model", "maxvio", "sigma", "zipf", "uniform", "hot", "hot_share", "tokens_per_rank", "layers", "seed",
            "groups", "topk_groups", "experts", "top_k")


@dataclass(frozen=True)
class GeneratorSpec:
    """Generated routing (see the module docstring for the grammar).

    At most one popularity field is set; with none, ``maxvio`` defaults to ``GEN_DEFAULTS``.
    tokens_per_rank: tokens on each rank (T = tokens_per_rank * R).  layers: how many layers
    (ids 0..layers-1), each drawn with seed ``seed * 1009 + layer``.
    """

    model: str = GEN_DEFAULTS["model"]
    maxvio: float | None = None
    sigma: float | None = None
    zipf: float | None = None
    uniform: bool = False
    hot: int | None = None
    hot_share: float | None = None
    tokens_per_rank: int = GEN_DEFAULTS["tokens_per_rank"]
    layers: int = GEN_DEFAULTS["layers"]
    seed: int = GEN_DEFAULTS["seed"]
    groups: int | None = None
    topk_groups: int | None = None
    experts: int | None = None
    top_k: int | None = None

    def __post_init__(self) -> None:
        from moonep_sim.routing.generators import check_spec_value

        for f in dataclasses.fields(self):  # type, finiteness, integer-ness and range of every key
            check_spec_value(f.name, getattr(self, f.name))
        require(isinstance(self.model, str) or not isinstance(self.model, (int, float, bool)),
                f"generator spec model ({self.model!r}) must be a preset name or a model file")
        pops = [k for k in _POPULARITY if getattr(self, k) not in (None, False)]
        require(len(pops) <= 1, f"generator spec ({self.text()}) must set at most one popularity of "
                                f"maxvio, sigma, zipf, uniform, hot (got {', '.join(pops)})")
        require((self.hot is None) == (self.hot_share is None),
                "generator spec hot and hot-share must be given together")
        require(1 <= self.tokens_per_rank <= MAX_TOKENS_PER_RANK,
                f"generator spec tokens-per-rank ({self.tokens_per_rank}) must be in [1, {MAX_TOKENS_PER_RANK}]")
        require(self.layers >= 1, f"generator spec layers ({self.layers}) must be >= 1")
        if self.maxvio is not None:
            require(self.maxvio > 0, f"generator spec maxvio ({self.maxvio:g}) must be > 0")

    @classmethod
    def parse(cls, text: str) -> "GeneratorSpec":
        """``"model=kimi-k3,maxvio=10,tokens-per-rank=512"`` (a leading ``gen:`` is allowed)."""
        body = text[len(GEN_PREFIX):] if text.startswith(GEN_PREFIX) else text
        kw: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in body.split(","))):
            if "=" not in part:
                raise ConfigError(f"generator spec entry ({part!r}) must look like key=value, e.g. "
                                  "model=kimi-k3,maxvio=10,tokens-per-rank=512")
            k, v = (s.strip() for s in part.split("=", 1))
            key = k.replace("-", "_")
            if key not in GEN_KEYS:
                raise ConfigError(f"generator spec key ({k!r}) must be one of: "
                                  f"{', '.join(g.replace('_', '-') for g in GEN_KEYS)}")
            require(key not in kw, f"generator spec key ({k!r}) must be given once")
            kw[key] = _typed(key, v)
        return cls(**kw)

    def text(self) -> str:
        """The canonical spec string (parses back to an equal spec)."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or (f.name == "uniform" and not v):
                continue
            out.append(f"{f.name.replace('_', '-')}={int(v) if isinstance(v, bool) else v:g}"
                       if isinstance(v, (int, float)) and not isinstance(v, str) else f"{f.name.replace('_', '-')}={v}")
        return ",".join(out)

    def popularity(self) -> dict[str, Any]:
        """The keyword arguments of :func:`moonep_sim.routing.generators.generate_layer`'s popularity."""
        if self.uniform:
            return {"uniform": True}
        if self.hot is not None:
            return {"hot": self.hot, "hot_share": self.hot_share}
        for k in ("maxvio", "sigma", "zipf"):
            if getattr(self, k) is not None:
                return {k: getattr(self, k)}
        return {"maxvio": GEN_DEFAULTS["maxvio"]}

    def with_(self, **changes: Any) -> "GeneratorSpec":
        """A copy with ``changes``; setting a popularity clears the others."""
        if any(k in changes for k in _POPULARITY):
            base = {k: None for k in _POPULARITY if k != "uniform"} | {"uniform": False, "hot_share": None}
            changes = base | changes
        return dataclasses.replace(self, **changes)

    def resolve_model(self, override: str | ModelSpec | None = None) -> ModelSpec:
        m = resolve_model(override or self.model)
        if self.experts is not None or self.top_k is not None:
            m = custom_model(int(self.experts or m.num_experts), int(self.top_k or m.top_k), m.hidden, m.expert_ffn,
                             name=f"{m.name}-custom", dispatch_hidden=m.dispatch_hidden)
        return m


def _typed(key: str, v: str) -> Any:
    if key == "model":
        return v
    try:
        num = float(v)
    except ValueError:
        raise ConfigError(f"generator spec {key.replace('_', '-')} ({v!r}) must be a number") from None
    require(math.isfinite(num), f"generator spec {key.replace('_', '-')} ({v}) must be a finite number")
    if key == "uniform":
        require(num in (0, 1), f"generator spec uniform ({v}) must be 0 or 1")
        return bool(num)
    if key in _INT_KEYS:
        require(num == int(num), f"generator spec {key.replace('_', '-')} ({v}) must be an integer")
        return int(v) if v.strip().lstrip("+-").isdigit() else int(num)
    return num


@dataclass
class RoutingSource:
    """An opened routing source: its shape, model and layers, and each batch's global routing.

    label: short human description.  num_experts (E), top_k (K).  model: the model whose row and
    weight sizes the plans use.  layer_ids: the layers an experiment runs.  path: the trace file
    (None for generated or in-memory routing).  gen: the generator spec (None otherwise).
    tokens: tokens of all selected steps of a trace (None when it depends on the ranks).
    steps: how a trace's steps are costed (:class:`moonep_sim.routing.steps.StepMode`; None for
    generated or in-memory routing).  batches: ``[(step id, token ranges)]``, the batches a command
    costs, one per selected step (step id None: the ``merged`` batch); generated and in-memory
    routing is one batch.  batch_tokens: tokens of each batch (the weights of the per-step means).
    transform: a function applied to each trace layer read (a sweep's re-weighted popularity, see
    :mod:`moonep_sim.experiments.trace_sweep`); None: the routing as recorded.
    """

    label: str
    num_experts: int
    top_k: int
    model: ModelSpec
    layer_ids: list[int]
    path: Path | None = None
    gen: GeneratorSpec | None = None
    tokens: int | None = None
    steps: Any = None
    batches: list = dataclasses.field(default_factory=lambda: [(None, None)])
    batch_tokens: list = dataclasses.field(default_factory=lambda: [None])
    transform: Any = None   # (LayerRouting, layer id, batch) -> LayerRouting applied to a trace's layers
    _trace: Any = None
    _routing: GlobalRouting | None = None

    @property
    def num_batches(self) -> int:
        return len(self.batches)

    @property
    def merged(self) -> bool:
        """True when several recorded steps are costed as one concatenated batch (``--steps merged``)."""
        return self.steps is not None and self.steps.merged and self.trace_steps > 1

    @property
    def trace_steps(self) -> int:
        """Steps the trace records (1 without a step tensor; 1 for generated or in-memory routing)."""
        if self._trace is None:
            return 1
        st = self._trace.steps()
        return int(st[-1]) + 1 if st is not None and st.size else 1

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "path": str(self.path) if self.path else None,
                "generated": self.gen.text() if self.gen else None, "num_experts": self.num_experts,
                "top_k": self.top_k, "model": self.model.name, "layers": self.layer_ids, "tokens": self.tokens,
                "steps": self.steps.text if self.steps is not None else None}

    def steps_info(self) -> dict[str, Any]:
        """What a report says of its batches: mode (``each`` or ``merged``), the trace's step count,
        the step ids costed (None: merged), and each batch's tokens."""
        return {"mode": "merged" if (self.steps is not None and self.steps.merged) else "each",
                "selection": self.steps.text if self.steps is not None else None,
                "trace_steps": self.trace_steps, "batches": self.num_batches,
                "step_ids": [b[0] for b in self.batches], "tokens": list(self.batch_tokens)}

    def layer(self, layer_id: int, ranks: int, batch: int = 0) -> LayerRouting:
        """The global routing of one layer of one batch (all ranks' tokens, ``[T, K]``)."""
        if self._routing is not None:
            r = self._routing
            return LayerRouting(r.topk_ids_TK, r.topk_weights_TK, self.num_experts, layer_id)
        if self.gen is not None:
            from moonep_sim.routing.generators import generate_layer

            g = self.gen
            extra = {k: getattr(g, k) for k in ("groups", "topk_groups") if getattr(g, k) is not None}
            r = generate_layer(self.num_experts, self.top_k, g.tokens_per_rank * ranks,
                               g.seed * 1009 + int(layer_id), **g.popularity(), **extra)
            return LayerRouting(r.topk_ids_TK, r.topk_weights_TK, self.num_experts, layer_id)
        lr = read_layer(self._trace, self._trace.layer_index(layer_id), ranges=self.batches[batch][1])
        return self.transform(lr, int(layer_id), batch) if self.transform is not None else lr

    def selected_layer(self, layer_id: int) -> LayerRouting:
        """A trace layer's tokens of every batch, concatenated in token order (what a step model
        splits by :meth:`selected_steps_T`)."""
        require(self.num_batches <= 1 or not self._trace.has("token_mask"),
                f"trace ({self.path}) has a per-layer token mask: its steps cannot be split by token index here "
                "(select one step with --steps N, or re-import with --drop-incomplete-tokens)")
        ranges = [r for _, rs in self.batches for r in rs]
        return read_layer(self._trace, self._trace.layer_index(layer_id), ranges=ranges)

    def selected_steps_T(self) -> np.ndarray | None:
        """The step id of each token :meth:`selected_layer` returns, int64 [T'] (None: one batch,
        merged or generated; a layer with a per-layer token mask has fewer rows)."""
        if self._trace is None or self.num_batches <= 1 or self.batches[0][0] is None:
            return None
        return np.concatenate([np.full(sum(b - a for a, b in rs), s, np.int64) for s, rs in self.batches])

    def router_logits(self, layer_id: int, batch: int = 0) -> np.ndarray:
        """A trace's router logits of one layer's tokens of one batch, float32 [T, E]."""
        tr = self._trace
        idx = tr.layer_index(layer_id)
        return np.concatenate([tr.router_logits(idx, a, b) for a, b in self.batches[batch][1]])

    def global_routing(self, layer_id: int, ranks: int, batch: int = 0) -> GlobalRouting:
        """One layer's routing of one batch split over ``ranks`` (evenly; in-memory routing keeps
        its own split)."""
        if self._routing is not None:
            require(self._routing.ranks == ranks, f"ranks ({ranks}) must equal the given routing's ranks "
                                                  f"({self._routing.ranks})")
            return self._routing
        lr = self.layer(layer_id, ranks, batch)
        return GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, self.num_experts, ranks)

    def routing_for(self, name: str, opts: dict[str, Any], layer_id: int, cluster, batch: int = 0,
                    base: GlobalRouting | None = None) -> GlobalRouting:
        """The routing strategy ``name`` plans on: the layer's (``base`` when given), except deepep
        with ``max_nodes``, which re-routes a trace's router logits node-limited (top-K within the
        ``max_nodes`` best nodes, as DeepSeek-V3's router does). Every command plans through here."""
        if (name == "deepep" and opts.get("max_nodes") and self._trace is not None and self.transform is None
                and self._trace.has("router_logits")):
            from moonep_sim.strategies import get_strategy
            from moonep_sim.strategies.deepep import node_limited_topk

            m = int(get_strategy(name).parse_options(dict(opts))["max_nodes"])
            if m:
                ids, w = node_limited_topk(self.router_logits(layer_id, batch), self.top_k, cluster.num_nodes, m,
                                           score=self.model.router)
                return GlobalRouting.split_evenly(ids, w, self.num_experts, cluster.ranks)
        return base if base is not None else self.global_routing(layer_id, cluster.ranks, batch)

    def trace_file(self, dest_dir: Path, ranks: int) -> Path:
        """A trace file holding the routing: a trace's own path (the replay selects its steps), else
        generated or in-memory routing written once, as one step."""
        if self.path is not None:
            return self.path
        layers = [self.layer(i, ranks) for i in self.layer_ids]
        ids = np.stack([l.topk_ids_TK for l in layers]).astype(np.int32)
        w = np.stack([l.topk_weights_TK for l in layers]).astype(np.float32)
        meta = TraceMeta(kind="tokens", num_experts=self.num_experts, top_k=self.top_k, layer_ids=list(self.layer_ids),
                         num_tokens=int(ids.shape[1]), model=self.model.name if self.model.name in PRESETS else None,
                         source=f"synthetic: {self.label}", attribution="synthetic (moonep-sim)")
        dest = Path(dest_dir) / "generated.safetensors"
        write_trace(dest, meta, {"topk_ids": ids, "topk_weights": w})
        return dest


def open_routing(routing: "str | Path | GeneratorSpec | GlobalRouting", layers: Sequence[int] | None = None,
                 model: str | ModelSpec | None = None, steps: Any = None) -> RoutingSource:
    """Open a trace path, a ``gen:`` string or :class:`GeneratorSpec`, or a :class:`GlobalRouting`.

    layers: layer ids to use (a trace's ids; 0..layers-1 for generated routing); default all.
    model: a preset, model file or ModelSpec for row and weight sizes; default the trace's or the spec's.
    steps: a trace's steps and how to cost them (:func:`moonep_sim.routing.steps.parse_step_mode`:
    default every step as its own batch; ``"0,2,5-7"`` those steps; ``merged`` one batch of all).
    Everything cheap is checked here, before any work.
    """
    if isinstance(routing, str) and routing.startswith(GEN_PREFIX):
        routing = GeneratorSpec.parse(routing)
    require(steps is None or not isinstance(routing, (GeneratorSpec, GlobalRouting)),
            "steps must be selected from a trace (generated or in-memory routing has none)")
    if isinstance(routing, GeneratorSpec):
        g = routing
        m = g.resolve_model(model)
        if m.n_groups > 1 and g.groups is None:
            g = dataclasses.replace(g, groups=m.n_groups, topk_groups=m.topk_groups)
        ids = list(layers) if layers else list(range(g.layers))
        for l in ids:
            require(l >= 0, f"layers entry ({l}) must be >= 0")
        pop = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in g.popularity().items())
        label = f"generated {m.name} ({pop}, {g.tokens_per_rank} tokens/rank)"
        return RoutingSource(label, m.num_experts, m.top_k, m, ids, None, g)
    if isinstance(routing, GlobalRouting):
        E, K = routing.num_experts, int(routing.topk_ids_TK.shape[1])
        m = resolve_model(model) if model else custom_model(E, K)
        require((m.num_experts, m.top_k) == (E, K),
                f"model ({m.name}: E={m.num_experts}, K={m.top_k}) must match the routing (E={E}, K={K})")
        return RoutingSource(f"in-memory routing ({routing.num_tokens} tokens)", E, K, m,
                             list(layers)[:1] if layers else [0], tokens=routing.num_tokens, _routing=routing)
    path = Path(routing)
    require(path.exists(), f"trace ({routing}) must be an existing trace file: no such file (generated routing: "
                           "gen:model=...,maxvio=...,tokens-per-rank=...)")
    tr = Trace(path)
    require(tr.meta.kind == "tokens", f"trace ({routing}) must be a token-level trace (this one holds only counts)")
    E, K = tr.meta.num_experts, tr.meta.top_k
    m = resolve_model(model) if model else tr.model()   # the trace's preset or stored shape (model_spec)
    if m is not None:
        require(m.num_experts == E and m.top_k == K,
                f"model ({m.name}: E={m.num_experts}, K={m.top_k}) must match the trace ({routing}: E={E}, K={K})")
    else:
        m = custom_model(E, K)
    all_ids = list(tr.meta.layer_ids)
    if layers:
        for l in layers:
            require(l in all_ids, f"--layers entry ({l}) must be one of the trace's layer ids "
                                  f"({all_ids[0]}..{all_ids[-1]})")
        ids = list(layers)
    else:
        ids = all_ids
    mode = parse_step_mode(steps)
    batches = step_batches(tr.steps(), int(tr.meta.num_tokens or 0), mode)
    btok = [int(sum(b - a for a, b in rs)) for _, rs in batches]
    tokens = int(sum(btok))
    what = (f", steps {mode.text}" if mode.selection is not None or mode.merged else "") + (
        f", {len(batches)} steps" if len(batches) > 1 else "")
    label = f"{path.name} ({m.name}, {tokens} tokens{what})"
    return RoutingSource(label, E, K, m, ids, path, tokens=tokens, steps=mode, batches=batches, batch_tokens=btok,
                         _trace=tr)
