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
``token_mask``      uint8      [L, T]        optional: 1 where the token was routed at that layer
                                             (a token a log recorded at only some layers); rows
                                             with 0 hold filler ids 0..K-1 and weight 0 and are
                                             never returned by :meth:`Trace.layer`
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
import stat
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from moonep_sim.errors import TraceFormatError, is_int
from moonep_sim.io import check_output_path, file_kind, write_bytes_atomic
from moonep_sim.limits import MAX_LAYERS, MAX_NUM_EXPERTS, MAX_TOP_K

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
    def from_json(cls, text: Any, where: str) -> "TraceMeta":
        if not isinstance(text, str):
            raise TraceFormatError(f"{where}: metadata: {META_KEY}: expected a JSON string, "
                                   f"found {type(text).__name__}")
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: metadata: expected JSON, found invalid JSON ({e.msg})") from None
        except RecursionError:
            raise TraceFormatError(f"{where}: metadata: expected JSON, found nesting too deep to parse") from None
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
            text = repr(found)
            return TraceFormatError(f"{where}: metadata: {fld}: expected {expected}, "
                                    f"found {text if len(text) <= 80 else text[:77] + '...'}")

        if not is_int(self.format_version) or self.format_version != FORMAT_VERSION:
            raise bad("format_version", str(FORMAT_VERSION), self.format_version)
        if self.kind not in KINDS:
            raise bad("kind", " or ".join(KINDS), self.kind)
        if not is_int(self.num_experts) or not 1 <= self.num_experts <= MAX_NUM_EXPERTS:
            raise bad("num_experts", f"an integer in [1, {MAX_NUM_EXPERTS}] (the largest expert count "
                      "moonep-sim handles)", self.num_experts)
        if not is_int(self.top_k) or not 1 <= self.top_k <= min(self.num_experts, MAX_TOP_K):
            raise bad("top_k", f"an integer in [1, num_experts={self.num_experts}]", self.top_k)
        if (not isinstance(self.layer_ids, list) or not self.layer_ids
                or not all(is_int(x) and -(1 << 31) <= x < 1 << 31 for x in self.layer_ids)):
            raise bad("layer_ids", "a non-empty list of 32-bit integers", self.layer_ids)
        if len(self.layer_ids) > MAX_LAYERS:
            raise bad("layer_ids", f"at most {MAX_LAYERS} layers", f"{len(self.layer_ids)} layers")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise bad("layer_ids", "distinct layer ids", self.layer_ids)
        if self.num_tokens is not None and (not is_int(self.num_tokens) or not 0 <= self.num_tokens < 1 << 62):
            raise bad("num_tokens", "null or an integer in [0, 2^62)", self.num_tokens)
        if self.kind == "tokens" and self.num_tokens is None:
            raise bad("num_tokens", "an integer for a token-level trace", None)
        if self.model_spec is not None:
            if not isinstance(self.model_spec, dict):
                raise bad("model_spec", "null or an object of model fields", self.model_spec)
            for k in ("num_experts", "top_k"):
                if self.model_spec.get(k) != getattr(self, k):
                    raise bad(f"model_spec.{k}", f"{getattr(self, k)} (the trace's {k})", self.model_spec.get(k))
        for fld, typ, expected in (("num_experts_inferred", bool, "true or false"),
                                   ("model", (str, type(None)), "null or a preset name"), ("steps", str, "a string"),
                                   ("source", str, "a string"), ("attribution", str, "a string"),
                                   ("import_report", dict, "a JSON object")):
            if not isinstance(getattr(self, fld), typ):
                raise bad(fld, expected, getattr(self, fld))


def model_meta(model: Any) -> dict[str, Any]:
    """:class:`TraceMeta` fields naming ``model`` (a preset name, a model file or a ModelSpec; None:
    none): ``model`` (a preset's name) or ``model_spec`` (the shape of a model that is not a preset;
    ``Trace.model()`` reads either)."""
    if model is None:
        return {}
    from moonep_sim.models import PRESETS, model_fields, resolve_model
    m = resolve_model(model)
    return {"model": m.name} if PRESETS.get(m.name) == m else {"model_spec": model_fields(m)}


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


_MAX_HEADER_BYTES = 100 << 20

# safetensors dtype -> bytes per element (the format's full list; a trace uses a few of them)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _read_header(path: Path) -> tuple[bytes, int]:
    """The raw safetensors header of ``path`` and the length of its data section, read without
    trusting the file: a non-regular file (a named pipe, a device, a directory) is refused before
    it is opened, so reading never blocks."""
    where = str(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise TraceFormatError(f"{where}: expected a trace file, found no such file") from None
    except OSError as e:
        raise TraceFormatError(f"{where}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceFormatError(f"{where}: expected a regular file (a safetensors trace), found {file_kind(st.st_mode)}")
    size = st.st_size
    try:
        with open(path, "rb") as f:
            n = _header_length(f.read(8), size, where)
            raw = f.read(n)
    except OSError as e:
        raise TraceFormatError(f"{where}: cannot read: {e.strerror}") from None
    return raw, size - 8 - n


def _header_length(head: bytes, size: int, where: str) -> int:
    """The header length a safetensors file of ``size`` bytes starting ``head`` gives, refused when
    the 8 bytes are missing or the header would not fit."""
    if len(head) < 8:
        raise TraceFormatError(f"{where}: expected a safetensors trace (8-byte header length), "
                               f"found a {size}-byte file")
    (n,) = struct.unpack("<Q", head[:8])
    if n > min(size - 8, _MAX_HEADER_BYTES):
        raise TraceFormatError(f"{where}: header: expected length <= {min(size - 8, _MAX_HEADER_BYTES)} "
                               f"bytes, found {n} (truncated or not a safetensors file)")
    return n


def _parse_header(raw: bytes, data_len: int, where: str) -> dict:
    """Parse and check a safetensors header: every field of the expected type, every tensor's
    byte range inside the data section, matching its dtype and shape, the ranges contiguous.
    After this, no safetensors call on the file can fail on the header."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TraceFormatError(f"{where}: header: expected safetensors JSON, found undecodable bytes") from None
    except RecursionError:
        raise TraceFormatError(f"{where}: header: expected safetensors JSON, found nesting too deep to parse") from None
    if not isinstance(header, dict):
        raise TraceFormatError(f"{where}: header: expected a JSON object, found {type(header).__name__}")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TraceFormatError(f"{where}: header: __metadata__: expected an object of strings, "
                               f"found {type(meta).__name__ if not isinstance(meta, dict) else 'non-string values'}")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        t = f"{where}: tensor {name}"
        if not isinstance(info, dict):
            raise TraceFormatError(f"{t}: expected an object with dtype, shape and data_offsets, "
                                   f"found {type(info).__name__}")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise TraceFormatError(f"{t}: dtype: expected a safetensors dtype name, found {dtype!r}")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise TraceFormatError(f"{t}: shape: expected a list of integers >= 0, found {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(is_int(o) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise TraceFormatError(f"{t}: data_offsets: expected [begin, end] with 0 <= begin <= end, found {offs!r}")
        if offs[1] > data_len:
            raise TraceFormatError(f"{t}: expected {offs[1]} data bytes, file holds {data_len} (truncated)")
        nbytes = _ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d  # Python integers: no overflow however large the shape
        if nbytes != offs[1] - offs[0]:
            raise TraceFormatError(f"{t}: expected {nbytes} bytes for dtype {dtype} and shape {shape}, "
                                   f"found data_offsets {offs} ({offs[1] - offs[0]} bytes)")
        spans.append((offs[0], offs[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise TraceFormatError(f"{where}: tensor {name}: data_offsets: expected to begin at byte {end} "
                                   f"(tensors back to back), found {begin}")
        end = stop
    return header


_NP_DTYPES = {"I16": np.int16, "I32": np.int32, "I64": np.int64, "F32": np.float32, "F16": np.float16,
              "U8": np.uint8, "BOOL": np.bool_}

_EXPECTED = {  # name -> (allowed dtypes, shape template); no BF16: numpy cannot read it
    "topk_ids": (("I16", "I32", "I64"), ("L", "T", "K")),
    "topk_weights": (("F32", "F16"), ("L", "T", "K")),
    "router_logits": (("F32", "F16"), ("L", "T", "E")),
    "step": (("I32", "I64"), ("T",)),
    "token_mask": (("U8", "BOOL"), ("L", "T")),
    "counts": (("I32", "I64"), ("L", "E")),
}


def _check_tensors(m: TraceMeta, shapes: dict, where: str) -> None:
    """Every tensor known, of an allowed dtype, of the shape the metadata implies."""
    dims = {"L": m.num_layers, "T": m.num_tokens, "K": m.top_k, "E": m.num_experts}
    required = ("topk_ids", "topk_weights") if m.kind == "tokens" else ("counts",)
    for name in required:
        if name not in shapes:
            raise TraceFormatError(f"{where}: tensor {name}: expected for a {m.kind}-level trace, missing")
    for name, (dtype, shape) in shapes.items():
        if name not in _EXPECTED:
            raise TraceFormatError(f"{where}: tensor {name}: unknown tensor (expected one of "
                                   f"{sorted(_EXPECTED)})")
        dtypes, template = _EXPECTED[name]
        if dtype not in dtypes:
            hint = " (numpy cannot read bf16: store float32)" if dtype == "BF16" else ""
            raise TraceFormatError(f"{where}: tensor {name}: expected dtype {'/'.join(dtypes)}, found {dtype}{hint}")
        want = tuple(dims[d] for d in template)
        if m.kind == "counts" and "T" in template:
            raise TraceFormatError(f"{where}: tensor {name}: not allowed in a counts-level trace")
        if shape != want:
            raise TraceFormatError(f"{where}: tensor {name}: expected shape {list(want)} from metadata "
                                   f"({', '.join(f'{d}={dims[d]}' for d in template)}), found {list(shape)}")


class Trace:
    """A trace file opened lazily: the header is parsed and checked; tensors are read per layer.

    ``Trace(path)`` raises :class:`TraceFormatError` (one line naming the file and the field) when
    the file is not a trace, is truncated, or its metadata contradicts its tensors.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        where = str(self.path)
        raw, data_len = _read_header(self.path)
        self.meta, self._shapes = self._validate(_parse_header(raw, data_len, where), where)
        self._handle = None
        if self.has("step"):
            self.steps()  # [T] integers, cheap: a trace with decreasing steps is refused when opened

    @classmethod
    def check_bytes(cls, data: bytes, where: str) -> TraceMeta:
        """Check a whole serialised trace (as :func:`write_trace` is about to write it) the way
        opening it would; returns its metadata."""
        n = _header_length(bytes(data[:8]), len(data), where)
        header = _parse_header(bytes(data[8:8 + n]), len(data) - 8 - n, where)
        return cls._validate(header, where)[0]

    @staticmethod
    def _validate(header: dict, where: str) -> tuple[TraceMeta, dict[str, tuple[str, tuple[int, ...]]]]:
        meta_raw = header.get("__metadata__", {}).get(META_KEY)
        if meta_raw is None:
            raise TraceFormatError(f"{where}: metadata: expected key {META_KEY!r} in the safetensors "
                                   "header (is this a moonep-sim trace? import it with `moonep-sim trace import`)")
        meta = TraceMeta.from_json(meta_raw, where)
        shapes = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
        _check_tensors(meta, shapes, where)
        return meta, shapes

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
        if name != "counts" and (min(stop, shape[1]) <= start or (len(shape) > 2 and shape[2] == 0)):
            # safetensors refuses empty slices: build the empty result here
            return np.zeros((max(0, min(stop, shape[1]) - start),) + tuple(shape[2:]), dtype=_NP_DTYPES[dtype])
        try:
            sl = self._open().get_slice(name)
            return sl[i:i + 1, start:stop][0] if name != "counts" else sl[i:i + 1][0]
        except Exception as e:  # safetensors' own error: a file changed or damaged after opening
            raise TraceFormatError(f"{self.path}: tensor {name}: cannot read ({e})") from None

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
        keep = self.token_mask(index, start, stop)
        if keep is not None:   # only the tokens this layer routed
            ids, w = ids[keep], w[keep]
        check_routing(ids, w, m.num_experts, f"{self.path}: layer {m.layer_ids[index]}")
        return LayerRouting(ids, w, m.num_experts, m.layer_ids[index])

    def token_mask(self, index: int, start: int = 0, stop: int | None = None) -> np.ndarray | None:
        """bool [stop - start]: the tokens the ``index``-th layer routed, or None when the trace has
        no ``token_mask`` (every token at every layer)."""
        if not self.has("token_mask"):
            return None
        return self._slice("token_mask", index, start, stop).astype(bool)

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
        lg = self._slice("router_logits", index, start, stop).astype(np.float32)
        keep = self.token_mask(index, start, stop)
        return lg if keep is None else lg[keep]

    def steps(self) -> np.ndarray | None:
        """Step index per token, int64 [T], or None when the trace has none (one step)."""
        if not self.has("step"):
            return None
        try:
            step_T = self._open().get_tensor("step").astype(np.int64)
        except Exception as e:  # safetensors' own error: a file changed or damaged after opening
            raise TraceFormatError(f"{self.path}: tensor step: cannot read ({e})") from None
        if step_T.size:
            if step_T[0] < 0:
                raise TraceFormatError(f"{self.path}: token 0: step: expected >= 0, found {int(step_T[0])}")
            down = np.diff(step_T) < 0
            if down.any():
                t = int(np.argmax(down)) + 1
                raise TraceFormatError(f"{self.path}: token {t}: step: expected non-decreasing steps, "
                                       f"found {int(step_T[t])} after {int(step_T[t - 1])}")
        return step_T

    def model(self):
        """The trace's model (a :class:`moonep_sim.models.ModelSpec`) from its metadata
        (``model_spec``, else the preset ``model``), or None when it names none."""
        from moonep_sim.errors import MoonEPSimError
        from moonep_sim.models import resolve_model

        try:
            if self.meta.model_spec:
                return resolve_model(self.meta.model_spec)
            return resolve_model(self.meta.model) if self.meta.model else None
        except MoonEPSimError as e:  # the file names a model this installation does not know
            raise TraceFormatError(f"{self.path}: metadata: model: {e}") from None

    def __repr__(self) -> str:
        m = self.meta
        return (f"Trace({str(self.path)!r}, kind={m.kind}, model={m.model}, layers={m.num_layers}, "
                f"tokens={m.num_tokens}, E={m.num_experts}, K={m.top_k})")


_PAIRWISE_MAX_K = 32  # find_bad_token compares position pairs up to this top-k, sorts rows above it


def find_bad_token(ids_TK: np.ndarray, num_experts: int) -> tuple[str, int] | None:
    """The first token breaking the routing rules, vectorised: ``("range", t)`` when token t has an
    expert id outside [0, E), ``("duplicate", t)`` when it picks one expert twice; None if valid."""
    if ids_TK.size == 0:
        return None
    bad = (ids_TK < 0) | (ids_TK >= num_experts)
    if bad.any():
        return "range", int(np.argmax(bad.any(axis=1)))
    K = ids_TK.shape[1]
    if K > 1:
        if K <= _PAIRWISE_MAX_K:
            # every pair of positions compared on contiguous narrow columns: K(K-1)/2 passes over T,
            # about 3x faster than a row sort for K=16 (the sort below is the reference, kept for large K)
            c_KT = ids_TK.T.astype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32, order="C")
            dup = np.zeros(ids_TK.shape[0], bool)
            for i in range(1, K):
                for j in range(i):
                    dup |= c_KT[i] == c_KT[j]
        else:
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
        ok = np.isfinite(weights_TK) & (weights_TK >= 0)
        if not ok.all():
            t = int(np.argmax(~ok.all(axis=1)))
            raise TraceFormatError(f"{where}: token {t}: topk_weights: expected finite values >= 0 "
                                   f"(gate weights), found {weights_TK[t].tolist()}")


def write_trace(path: str | os.PathLike, meta: TraceMeta, tensors: Mapping[str, np.ndarray], *,
                what: str = "output", inputs: tuple = ()) -> Path:
    """Write a trace atomically (serialised to bytes, checked to read back, then written through
    :func:`moonep_sim.io.write_bytes_atomic`).

    ``tensors`` per the table in the module docstring; ``meta`` must agree with their shapes.
    ``what``/``inputs``: the output's name in messages and the files it must not overwrite.
    """
    from safetensors.numpy import save

    path = Path(path)
    check_output_path(path, what, inputs)
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
    data = save(arrays, metadata={META_KEY: meta.to_json()})
    Trace.check_bytes(data, str(path))  # read-back check: shapes agree with metadata
    write_bytes_atomic(path, data, what=what, inputs=inputs)
    return path
