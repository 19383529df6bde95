"""``npy``: ``[T, L, K]`` (or ``[T, K]``) integer arrays in ``.npy``, or ``.npz`` with ``topk_ids``
(or ``routed_experts``, the shape in which vLLM returns routed experts) and optionally
``topk_weights``, ``step``, ``layer_ids``. Read with ``allow_pickle=False``: pickled data is never
loaded."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from moonep_sim.errors import TraceFormatError
from moonep_sim.routing.importers.common import (ImportOptions, Imported, attribution, check_top_k, err,
                                                 resolve_experts, sanity_warnings)
from moonep_sim.routing.importers.registry import Importer, Sniff, register
from moonep_sim.routing.trace import TraceMeta, find_bad_token, model_meta


def sniff(s: Sniff) -> bool:
    return s.head.startswith(b"\x93NUMPY") or s.head.startswith(b"PK\x03\x04")


# an .npz may inflate to at most this many times its own size (with a floor): more is a
# decompression bomb, refused before anything is inflated
MAX_INFLATION = 200
MIN_INFLATED_BYTES = 256 << 20


def _npy_header(f, where: str, member: str = "") -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, dtype and data bytes promised by an .npy header (read without reading the data)."""
    what = f"member {member}: " if member else ""
    try:
        version = np.lib.format.read_magic(f)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = reader(f)
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise err(where, f"{what}expected a .npy array header, found {str(e).splitlines()[0][:80]}") from None
    if dtype.hasobject:
        raise err(where, f"{what}expected a numeric array, found an object array stored by pickle "
                         "(pickled data is never loaded)")
    n = dtype.itemsize
    for d in shape:
        n *= int(d)  # Python integers: no overflow
    return tuple(int(d) for d in shape), dtype, n


def _check_sizes(path: Path, where: str) -> None:
    """Every array's promised size against what the file can hold, before numpy allocates it: an
    .npy's data must be in the file; an .npz must hold only .npy members whose inflated size is
    what their headers promise and at most MAX_INFLATION times the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        f.seek(0)
        if magic != b"PK\x03\x04":
            _shape, _dtype, n = _npy_header(f, where)
            held = size - f.tell()
            if n > held:
                raise err(where, f"expected {n} bytes of array data (shape {list(_shape)}, {_dtype}), the file "
                                 f"holds {held} (truncated?)")
            return
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            if not infos:
                raise err(where, "expected arrays in the .npz, found an empty archive")
            limit = max(MIN_INFLATED_BYTES, MAX_INFLATION * size)
            total = sum(i.file_size for i in infos)
            if total > limit:
                raise err(where, f"expected at most {limit} bytes once inflated ({MAX_INFLATION}x the file's "
                                 f"size), found members of {total} bytes (a decompression bomb?)")
            for i in infos:
                if not i.filename.endswith(".npy"):
                    raise err(where, f"member {i.filename}: expected a .npy array, found another file")
                with z.open(i) as m:
                    _shape, _dtype, n = _npy_header(m, where, i.filename)
                    if n > i.file_size:
                        raise err(where, f"member {i.filename}: expected {n} bytes of array data (shape "
                                         f"{list(_shape)}), found {i.file_size} bytes in the archive")
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as e:
        raise err(where, f"expected a readable .npz archive, found {type(e).__name__}: {e} (truncated?)") from None


def load_npy(path: Path, fmt: str, opts: ImportOptions) -> Imported:
    where = str(path)
    extra: dict[str, np.ndarray] = {}
    _check_sizes(path, where)
    try:
        obj = np.load(path, allow_pickle=False)
        if isinstance(obj, np.lib.npyio.NpzFile):
            with obj:
                keys = list(obj.files)
                main = "topk_ids" if "topk_ids" in keys else ("routed_experts" if "routed_experts" in keys
                                                             else (keys[0] if len(keys) == 1 else None))
                if main is None:
                    raise err(where, f"expected an array named topk_ids in the .npz, found {keys}")
                ids = obj[main]
                for k in ("topk_weights", "step", "layer_ids"):
                    if k in keys:
                        extra[k] = obj[k]
        else:
            ids = obj
    except TraceFormatError:
        raise
    except ValueError as e:
        if "allow_pickle" in str(e) or "Object arrays" in str(e):
            raise err(where, "expected a numeric array, found an object array stored by pickle "
                              "(pickled data is never loaded)") from None
        raise err(where, f"expected a readable numpy file, found {e} (truncated?)") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise err(where, f"expected a readable numpy file, found {type(e).__name__}: {e} (truncated?)") from None
    if ids.dtype.kind not in "iu":
        raise err(where, f"topk_ids: expected an integer array, found dtype {ids.dtype}")
    if ids.ndim == 2:
        ids = ids[:, None, :]
    if ids.ndim != 3 or ids.shape[0] == 0 or ids.shape[2] == 0:
        raise err(where, f"topk_ids: expected shape [tokens, layers, k] with tokens, k >= 1, found {list(ids.shape)}")
    T, L, K = ids.shape
    report: dict[str, Any] = {"format": "npy", "shape_TLK": [T, L, K]}
    E, inferred = resolve_experts(where, opts, None, ids, report)
    check_top_k(where, K, opts)
    ids_LTK = np.ascontiguousarray(ids.transpose(1, 0, 2)).astype(np.int64)
    bad = find_bad_token(ids_LTK.reshape(L * T, K), E)
    if bad is not None:
        l, t = divmod(bad[1], T)
        expected = f"ids in [0, {E})" if bad[0] == "range" else "distinct experts"
        raise err(where, f"token {t}: layer {l}: topk_ids: expected {expected}, found {ids_LTK[l, t].tolist()}")
    if "topk_weights" in extra:
        w = extra["topk_weights"]
        if w.shape != (T, L, K) and not (w.ndim == 2 and L == 1 and w.shape == (T, K)):
            raise err(where, f"topk_weights: expected shape {[T, L, K]} (as topk_ids), found {list(w.shape)}")
        if w.dtype.kind != "f":
            raise err(where, f"topk_weights: expected a float array, found dtype {w.dtype}")
        w_LTK = np.ascontiguousarray(w.reshape(T, L, K).transpose(1, 0, 2)).astype(np.float32)
        fin = (np.isfinite(w_LTK) & (w_LTK >= 0)).all(axis=2)
        if not fin.all():
            l, t = np.unravel_index(int(np.argmax(~fin)), (L, T))
            raise err(where, f"token {t}: layer {l}: topk_weights: expected finite numbers >= 0, "
                             f"found {w_LTK[l, t].tolist()}")
    else:
        w_LTK = np.full((L, T, K), 1.0 / K, np.float32)
        report["weights"] = "absent in the source: set to 1/K"
    tensors = {"topk_ids": ids_LTK, "topk_weights": w_LTK}
    steps, step_T = "one step holds all tokens", None
    if "step" in extra:
        st = extra["step"]
        if st.shape != (T,) or st.dtype.kind not in "iu" or (T > 1 and (np.diff(st) < 0).any()):
            raise err(where, f"step: expected non-decreasing integers of shape [{T}], found shape "
                              f"{list(st.shape)} dtype {st.dtype}")
        step_T = np.unique(st, return_inverse=True)[1].reshape(-1)   # dense 0..S-1, order kept
        tensors["step"] = step_T.astype(np.int32)
        steps = "step tensor from the source"
    layer_ids = list(range(L))
    if "layer_ids" in extra:
        li = extra["layer_ids"]
        if li.shape != (L,) or li.dtype.kind not in "iu":
            raise err(where, f"layer_ids: expected {L} integers, found shape {list(li.shape)} dtype {li.dtype}")
        layer_ids = [int(x) for x in li]
    report["tokens"], report["layers"] = T, L
    report["warnings"] = report.get("warnings", []) + sanity_warnings(ids_LTK, step_T, E, layer_ids,
                                                                       opts.dominant_share)
    if not report["warnings"]:
        del report["warnings"]
    meta = TraceMeta(kind="tokens", num_experts=E, top_k=K, layer_ids=layer_ids, num_tokens=T,
                     steps=steps, source=f"imported from {path.name} (npy)", attribution=attribution(path),
                     import_report=report, num_experts_inferred=inferred, **model_meta(opts.model))
    return Imported(meta, tensors)


register(Importer(
    name="npy",
    summary="`[tokens, layers, k]` (or `[tokens, k]`) integer expert ids in `.npy`, or `.npz` with "
            "`topk_ids`/`routed_experts` and optionally `topk_weights`, `step`, `layer_ids`",
    drops="nothing is dropped (arrays carry no dummy-block evidence beyond the sanity warnings); absent "
          "weights become 1/K; without `--num-experts`/`--model` the expert count is inferred from the "
          "largest id, with a warning",
    sniff=sniff, load=load_npy, priority=100))
