"""The trace format: one safetensors file per trace, JSON metadata in its header.

Notation: L layers in the trace, T tokens, K top-k, E experts.

Tensors (all optional ones may be absent):

==================  =========  ============  ===================================================
name                dtype      shape         meaning
==================  =========  ============  ===================================================
``topk_ids``        int16/32   [L, T, K]     token-level: expert ids per layer per token, in
                                             [0, E), distinct within a token
``topk_weights``    float32    [L, T, K]     token-level: routing weights (gate values)
``router_logits``   float32    [L, T, E]     optional: raw router logits (for router replay)
``step``            int32      [T]           optional: step (batch) index per token, non-decreasing
``counts``          int64      [L, E]        count-level traces only: selections per expert
==================  =========  ============  ===================================================

Metadata: the safetensors header's ``__metadata__`` holds one key, ``moonep_sim``, whose value is
a JSON object: ``format_version`` (1), ``kind`` (``tokens`` or ``counts``), ``model`` (preset name
or null), ``num_experts``, ``top_k``, ``layer_ids`` (model layer index of each of the L layers),
``num_tokens`` (T; for count traces the number of tokens the counts came from, may be null),
``steps`` (a sentence on how tokens group into steps), ``source``, ``attribution``,
``import_report`` (what an importer dropped and why), and optionally ``model_spec`` (the model's
shape as ``models.resolve_model`` reads it, for models that are not presets) and
``num_experts_inferred`` (true when E was only inferred from the largest expert id).

Layers are stored layer-major so one layer is one contiguous slice; reading is lazy: opening a
trace reads only the header, and :meth:`Trace.layer` memory-maps one layer's slice.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from moonep_sim.errors import TraceFormatError
from moonep_sim.io import atomic_path

FORMAT_VERSION = 1
META_KEY = "moonep_sim"
KINDS = ("tokens", "counts")


@dataclass(frozen=True)
class TraceMeta:
    """A trace's metadata (see the module docstring for each field)."""

    kind: str
    num_experts: int
    top_k: int
    layer_ids: list[int]
    num_tokens: int | None
    model: str | None = None
    steps: str = "one step holds all tokens"
    source: str = ""
    attribution: str = ""
    import_report: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    model_spec: dict[str, Any] | None = None
    num_experts_inferred: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> "TraceMeta":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: metadata: expected JSON, found invalid JSON ({e.msg})") from None
        if not isinstance(raw, dict):
            raise TraceFormatError(f"{where}: metadata: expected a JSON object, found {type(raw).__name__}")
        required = ("kind", "num_experts", "top_k", "layer_ids", "num_tokens")
        missing = [k for k in required if k not in raw]
        if missing:
            raise TraceFormatError(f"{where}: metadata: expected keys {list(required)}, missing {missing}")
        known = {f for f in cls.__dataclass_fields__}
        meta = cls(**{k: v for k, v in raw.items() if k in known})
        meta.check(where)
        return meta

    def check(self, where: str) -> None:
        def bad(fld: str, expected: str, found: Any) -> TraceFormatError:
            return TraceFormatError(f"{where}: metadata: {fld}: expected {expected}, found {found!r}")

        if self.format_version != FORMAT_VERSION:
            raise bad("format_version", str(FORMAT_VERSION), self.format_version)
        if self.kind not in KINDS:
            raise bad("kind", " or ".join(KINDS), self.kind)
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise bad("num_experts", "an integer >= 1", self.num_experts)
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise bad("top_k", f"an integer in [1, num_experts={self.num_experts}]", self.top_k)
        if (not isinstance(self.layer_ids, list) or not self.layer_ids
                or not all(isinstance(x, int) for x in self.layer_ids)):
            raise bad("layer_ids", "a non-empty list of integers", self.layer_ids)
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise bad("layer_ids", "distinct layer ids", self.layer_ids)
        if self.num_tokens is not None and (not isinstance(self.num_tokens, int) or self.num_tokens < 0):
            raise bad("num_tokens", "null or an integer >= 0", self.num_tokens)
        if self.kind == "tokens" and self.num_tokens is None:
            raise bad("num_tokens", "an integer for a token-level trace", None)
        if self.model_spec is not None:
            if not isinstance(self.model_spec, dict):
                raise bad("model_spec", "null or an object of model fields", self.model_spec)
            for k in ("num_experts", "top_k"):
                if self.model_spec.get(k) != getattr(self, k):
                    raise bad(f"model_spec.{k}", f"{getattr(self, k)} (the trace's {k})", self.model_spec.get(k))
        if not isinstance(self.num_experts_inferred, bool):
            raise bad("num_experts_inferred", "true or false", self.num_experts_inferred)


@dataclass(frozen=True)
class LayerRouting:
    """One layer's routing for a set of tokens (global: all ranks' tokens, concatenated).

    topk_ids_TK: int64 [T, K], expert ids in [0, E), distinct within a row.
    topk_weights_TK: float32 [T, K], routing weights (>= 0 for softmax/sigmoid gates).
    num_experts: E.  layer: model layer id (or -1 if synthetic and unnamed).
    """

    topk_ids_TK: np.ndarray
    topk_weights_TK: np.ndarray
    num_experts: int
    layer: int = -1

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids_TK.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids_TK.shape[1])

    def counts_E(self) -> np.ndarray:
        """Selections per expert, int64 [E]."""
        return np.bincount(self.topk_ids_TK.ravel(), minlength=self.num_experts).astype(np.int64)

    def take(self, start: int, stop: int) -> "LayerRouting":
        """Tokens [start, stop) of this layer (views, no copy)."""
        return LayerRouting(self.topk_ids_TK[start:stop], self.topk_weights_TK[start:stop],
                            self.num_experts, self.layer)


def _read_header(path: Path) -> dict:
    """Parse a safetensors header without reading the data (and without trusting its sizes)."""
    where = str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise TraceFormatError(f"{where}: expected a safetensors trace (8-byte header length), "
                                       f"found a {size}-byte file")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise TraceFormatError(f"{where}: header: expected length <= {size - 8} bytes, "
                                       f"found {n} (truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise TraceFormatError(f"{where}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TraceFormatError(f"{where}: header: expected safetensors JSON, found undecodable bytes") from None
    if not isinstance(header, dict):
        raise TraceFormatError(f"{where}: header: expected a JSON object")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = int(info["data_offsets"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise TraceFormatError(f"{where}: tensor {name}: expected data_offsets in header") from None
        if end > data_len:
            raise TraceFormatError(f"{where}: tensor {name}: expected {end} data bytes, file holds "
                                   f"{data_len} (truncated)")
    return header


_NP_DTYPES = {"I16": np.int16, "I32": np.int32, "I64": np.int64, "F32": np.float32, "F16": np.float16,
              "BF16": np.float32}

_EXPECTED = {  # name -> (allowed dtypes, shape template)
    "topk_ids": (("I16", "I32", "I64"), ("L", "T", "K")),
    "topk_weights": (("F32", "F16", "BF16"), ("L", "T", "K")),
    "router_logits": (("F32", "F16", "BF16"), ("L", "T", "E")),
    "step": (("I32", "I64"), ("T",)),
    "counts": (("I32", "I64"), ("L", "E")),
}


class Trace:
    """A trace file opened lazily: the header is parsed and checked; tensors are read per layer.

    ``Trace(path)`` raises :class:`TraceFormatError` (one line naming the file and the field) when
    the file is not a trace, is truncated, or its metadata contradicts its tensors.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        where = str(self.path)
        if not self.path.exists():
            raise TraceFormatError(f"{where}: no such file")
        header = _read_header(self.path)
        meta_raw = (header.get("__metadata__") or {}).get(META_KEY)
        if meta_raw is None:
            raise TraceFormatError(f"{where}: metadata: expected key {META_KEY!r} in the safetensors "
                                   "header (is this a moonep-sim trace? import it with `moonep-sim trace import`)")
        self.meta = TraceMeta.from_json(meta_raw, where)
        self._shapes = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
        self._check_tensors(where)
        self._handle = None

    # -- checks ---------------------------------------------------------------------------
    def _check_tensors(self, where: str) -> None:
        m = self.meta
        dims = {"L": m.num_layers, "T": m.num_tokens, "K": m.top_k, "E": m.num_experts}
        required = ("topk_ids", "topk_weights") if m.kind == "tokens" else ("counts",)
        for name in required:
            if name not in self._shapes:
                raise TraceFormatError(f"{where}: tensor {name}: expected for a {m.kind}-level trace, missing")
        for name, (dtype, shape) in self._shapes.items():
            if name not in _EXPECTED:
                raise TraceFormatError(f"{where}: tensor {name}: unknown tensor (expected one of "
                                       f"{sorted(_EXPECTED)})")
            dtypes, template = _EXPECTED[name]
            if dtype not in dtypes:
                raise TraceFormatError(f"{where}: tensor {name}: expected dtype {'/'.join(dtypes)}, found {dtype}")
            want = tuple(dims[d] for d in template)
            if m.kind == "counts" and "T" in template:
                raise TraceFormatError(f"{where}: tensor {name}: not allowed in a counts-level trace")
            if shape != want:
                raise TraceFormatError(f"{where}: tensor {name}: expected shape {list(want)} from metadata "
                                       f"({', '.join(f'{d}={dims[d]}' for d in template)}), found {list(shape)}")

    # -- access ---------------------------------------------------------------------------
    def _open(self):
        if self._handle is None:
            from safetensors import safe_open
            self._handle = safe_open(str(self.path), framework="numpy")
        return self._handle

    def has(self, name: str) -> bool:
        return name in self._shapes

    @property
    def num_layers(self) -> int:
        return self.meta.num_layers

    @property
    def num_tokens(self) -> int | None:
        return self.meta.num_tokens

    def layer_index(self, layer_id: int) -> int:
        """Position in the file of model layer ``layer_id``."""
        try:
            return self.meta.layer_ids.index(layer_id)
        except ValueError:
            raise TraceFormatError(f"{self.path}: layer ({layer_id}) must be one of the trace's layers "
                                   f"{self.meta.layer_ids}") from None

    def _slice(self, name: str, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.meta.num_tokens if stop is None else stop
        dtype, shape = self._shapes[name]
        if name != "counts" and (min(stop, shape[1]) <= start or shape[2] == 0):
            # safetensors refuses empty slices: build the empty result here
            return np.zeros((max(0, min(stop, shape[1]) - start), shape[2]), dtype=_NP_DTYPES[dtype])
        sl = self._open().get_slice(name)
        return sl[i:i + 1, start:stop][0] if name != "counts" else sl[i:i + 1][0]

    def layer(self, index: int, start: int = 0, stop: int | None = None) -> LayerRouting:
        """Routing of the ``index``-th stored layer (tokens [start, stop)), ids checked in range."""
        m = self.meta
        if m.kind != "tokens":
            raise TraceFormatError(f"{self.path}: kind: expected a token-level trace for per-token routing, "
                                   "found a counts-level trace (use Trace.counts)")
        if not 0 <= index < m.num_layers:
            raise TraceFormatError(f"{self.path}: layer index ({index}) must be in [0, {m.num_layers})")
        ids = self._slice("topk_ids", index, start, stop).astype(np.int64)
        w = self._slice("topk_weights", index, start, stop).astype(np.float32)
        check_routing(ids, w, m.num_experts, f"{self.path}: layer {m.layer_ids[index]}")
        return LayerRouting(ids, w, m.num_experts, m.layer_ids[index])

    def counts(self, index: int) -> np.ndarray:
        """Selections per expert of the ``index``-th layer, int64 [E] (any trace kind)."""
        if self.meta.kind == "counts":
            c = self._slice("counts", index).astype(np.int64)
            if (c < 0).any():
                raise TraceFormatError(f"{self.path}: layer {self.meta.layer_ids[index]}: counts: "
                                       f"expected >= 0, found {int(c.min())}")
            return c
        return self.layer(index).counts_E()

    def router_logits(self, index: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        if not self.has("router_logits"):
            raise TraceFormatError(f"{self.path}: tensor router_logits: expected for router replay, missing")
        return self._slice("router_logits", index, start, stop).astype(np.float32)

    def steps(self) -> np.ndarray | None:
        """Step index per token, int64 [T], or None when the trace has none (one step)."""
        if not self.has("step"):
            return None
        return self._open().get_tensor("step").astype(np.int64)

    def model(self):
        """The trace's model (a :class:`moonep_sim.models.ModelSpec`) from its metadata
        (``model_spec``, else the preset ``model``), or None when it names none."""
        from moonep_sim.models import resolve_model

        if self.meta.model_spec:
            return resolve_model(self.meta.model_spec)
        return resolve_model(self.meta.model) if self.meta.model else None

    def __repr__(self) -> str:
        m = self.meta
        return (f"Trace({str(self.path)!r}, kind={m.kind}, model={m.model}, layers={m.num_layers}, "
                f"tokens={m.num_tokens}, E={m.num_experts}, K={m.top_k})")


def find_bad_token(ids_TK: np.ndarray, num_experts: int) -> tuple[str, int] | None:
    """The first token breaking the routing rules, vectorised: ``("range", t)`` when token t has an
    expert id outside [0, E), ``("duplicate", t)`` when it picks one expert twice; None if valid."""
    if ids_TK.size == 0:
        return None
    bad = (ids_TK < 0) | (ids_TK >= num_experts)
    if bad.any():
        return "range", int(np.argmax(bad.any(axis=1)))
    if ids_TK.shape[1] > 1:
        s = np.sort(ids_TK, axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if dup.any():
            return "duplicate", int(np.argmax(dup))
    return None


def check_routing(ids_TK: np.ndarray, weights_TK: np.ndarray | None, num_experts: int, where: str) -> None:
    """Vectorised checks of one layer's routing; raises TraceFormatError naming the first bad token."""
    if ids_TK.ndim != 2:
        raise TraceFormatError(f"{where}: topk_ids: expected shape [T, K], found {list(ids_TK.shape)}")
    bad = find_bad_token(ids_TK, num_experts)
    if bad is not None:
        kind, t = bad
        expected = f"ids in [0, {num_experts})" if kind == "range" else "distinct experts"
        raise TraceFormatError(f"{where}: token {t}: topk_ids: expected {expected}, found {ids_TK[t].tolist()}")
    if weights_TK is not None:
        if weights_TK.shape != ids_TK.shape:
            raise TraceFormatError(f"{where}: topk_weights: expected shape {list(ids_TK.shape)}, "
                                   f"found {list(weights_TK.shape)}")
        finite = np.isfinite(weights_TK)
        if not finite.all():
            t = int(np.argmax(~finite.all(axis=1)))
            raise TraceFormatError(f"{where}: token {t}: topk_weights: expected finite values, "
                                   f"found {weights_TK[t].tolist()}")


def write_trace(path: str | os.PathLike, meta: TraceMeta, tensors: Mapping[str, np.ndarray]) -> Path:
    """Write a trace atomically (a temp file renamed into place); checks it reads back.

    ``tensors`` per the table in the module docstring; ``meta`` must agree with their shapes.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    meta.check(str(path))
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if "topk_ids" in arrays:
        ids = arrays["topk_ids"]
        dtype = np.int16 if meta.num_experts <= np.iinfo(np.int16).max else np.int32
        arrays["topk_ids"] = ids.astype(dtype, copy=False)
        for li in range(ids.shape[0]):
            check_routing(ids[li], arrays.get("topk_weights", [None] * ids.shape[0])[li],
                          meta.num_experts, f"{path}: layer {meta.layer_ids[li]}")
    if "topk_weights" in arrays:
        arrays["topk_weights"] = arrays["topk_weights"].astype(np.float32, copy=False)
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata={META_KEY: meta.to_json()})
        Trace(tmp)  # read-back check: shapes agree with metadata
    return path
