"""Importers: routing recorded elsewhere -> a moonep-sim trace (see ``trace.py``).

Notation: L layers, T tokens, K top-k, E experts, N records (rows of a log).

Formats (``detect_format`` picks one from the file's name and first bytes):

- ``jsonl-records``: one JSON object per (token, layer), e.g. ``{"problem_id", "token_idx",
  "layer", "experts", "gating_probs"}``; tokens group into steps by their problem/request id.
- ``vllm-routes``: a vLLM route log: an optional first line ``{"type": "meta", "num_experts",
  "top_k", "layers_logged", ...}`` then ``{"type": "route", "req_id", "token_idx", "layer",
  "topk_ids", "topk_weights"}`` rows. Field names of both record formats are matched from a list
  of aliases (``_FIELDS``), so users' own logs of either shape import too.
- ``counts-json``: a per-layer expert-count histogram (``expert_usage_by_layer[layer][expert]``,
  a ``counts`` list of lists, or ``{layer: [counts]}``) -> a counts-level trace.
- ``npy``: ``[T, L, K]`` (or ``[T, K]``) integer arrays in ``.npy``, or ``.npz`` with
  ``topk_ids`` (and optionally ``topk_weights``, ``step``, ``layer_ids``), the shape in which vLLM
  returns routed experts. Read with ``allow_pickle=False``: pickled data is never loaded.

Explicit handling of what real logs contain (each counted in the trace's ``import_report``):

- warm-up / profiling blocks: runs of at least ``warmup_min_rows`` consecutive rows of one layer
  with identical expert sets and uniform weights; every token with such a row is dropped;
- exact duplicate records (same token, layer, experts and weights): dropped; a duplicate with
  different experts or weights is an error naming both records;
- tokens missing some layers (generation stopped early): dropped;
- top-k width varying across records, ids out of range or negative, repeated ids within a token,
  NaN or negative weights, metadata contradicting the records: a one-line error naming the file,
  the record (line number) and field, what was expected and what was found.

Text formats are parsed line by line (one Python step per record); everything after parsing is
vectorised.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moonep_sim.errors import TraceFormatError
from moonep_sim.io import check_output_path
from moonep_sim.routing.trace import TraceMeta, write_trace

FORMATS = ("jsonl-records", "vllm-routes", "counts-json", "npy")

_FIELDS = {  # role -> accepted names, first match wins (decided on the first record)
    "group": ("problem_id", "req_id", "request_id", "seq_id", "sequence_id", "batch_id"),
    "token": ("token_idx", "token_id", "token", "position", "pos"),
    "layer": ("layer", "layer_id", "layer_idx"),
    "ids": ("experts", "topk_ids", "expert_ids", "selected_experts", "ids"),
    "weights": ("gating_probs", "topk_weights", "weights", "probs", "gates", "scores"),
}


@dataclass
class Imported:
    """What an importer produced: trace metadata and tensors (see ``trace.py``)."""

    meta: TraceMeta
    tensors: dict[str, np.ndarray]


def _err(where: str, msg: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: {msg}")


# ---------------------------------------------------------------------------------- detection
def _is_pickle(head: bytes) -> bool:
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def detect_format(path: str | os.PathLike) -> str:
    """The importer format of ``path`` (one of ``FORMATS``), from its suffix and first bytes."""
    p = Path(path)
    where = str(p)
    if not p.is_file():
        raise _err(where, "expected a file, found none" if not p.exists() else "expected a file, found a directory")
    with open(p, "rb") as f:
        head = f.read(4096)
    if not head.strip():
        raise _err(where, "expected routing data, found an empty file")
    if _is_pickle(head):
        raise _err(where, "expected routing data, found a Python pickle (pickled files are never loaded; "
                          "save arrays with numpy.save or as JSON)")
    if head.startswith(b"\x93NUMPY") or head.startswith(b"PK\x03\x04"):
        return "npy"
    if p.suffix in (".npy", ".npz"):
        raise _err(where, f"expected a {p.suffix} file (numpy magic bytes), found other content")
    text = head.decode("utf-8", errors="replace").lstrip()
    if text.startswith("{") or text.startswith("["):
        first = text.split("\n", 1)[0].strip()
        try:
            rec = json.loads(first)
        except json.JSONDecodeError:
            rec = None  # a multi-line JSON document
        if isinstance(rec, dict):
            if rec.get("type") in ("meta", "route") or "topk_ids" in rec:
                return "vllm-routes"
            if _pick(rec, "ids") is not None and _pick(rec, "layer") is not None:
                return "jsonl-records"
        if p.suffix == ".jsonl" or (isinstance(rec, dict) and "\n" in text.strip() and text.strip().split("\n")[1].lstrip().startswith("{")):
            return "jsonl-records"
        if rec is None or isinstance(rec, (dict, list)):
            return "counts-json"
    raise _err(where, f"expected one of the formats {', '.join(FORMATS)}, found unrecognised content "
                      f"starting {head[:24]!r}")


def _pick(rec: dict, role: str) -> str | None:
    for name in _FIELDS[role]:
        if name in rec:
            return name
    return None


def _attribution(src: Path) -> str:
    """The SOURCES.md table row describing ``src``, when one sits next to it."""
    sources = src.parent / "SOURCES.md"
    if sources.is_file():
        for line in sources.read_text(errors="replace").splitlines():
            if line.startswith(f"| {src.name} |"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                return " | ".join(cells[1:])
    return ""


# ---------------------------------------------------------------------------------- record logs
def _parse_records(path: Path, fmt: str) -> dict[str, Any]:
    """One pass over a JSONL log: raw per-record arrays plus the meta line (if any)."""
    where = str(path)
    meta_line: dict | None = None
    names: dict[str, str | None] | None = None
    groups: dict[Any, int] = {}
    g_l, t_l, l_l, ids_l, w_l, line_l = [], [], [], [], [], []
    skipped = 0
    K0 = None
    last_line = 0
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise _err(where, "expected routing records, found an empty file")
    truncated = not data.endswith(b"\n")
    lines = data.split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        s = raw.strip()
        if not s:
            continue
        last_line = lineno
        try:
            rec = json.loads(s)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            hint = " (truncated last line?)" if truncated and lineno == len(lines) else ""
            raise _err(where, f"record {lineno}: expected a JSON object, found invalid JSON "
                              f"({getattr(e, 'msg', str(e))}){hint}") from None
        if not isinstance(rec, dict):
            raise _err(where, f"record {lineno}: expected a JSON object, found {type(rec).__name__}")
        kind = rec.get("type")
        if kind == "meta":
            if meta_line is not None or ids_l:
                raise _err(where, f"record {lineno}: type: expected the meta record first and once, "
                                  "found another")
            meta_line = rec
            continue
        if kind is not None and kind != "route":
            skipped += 1
            continue
        if names is None:
            names = {role: _pick(rec, role) for role in _FIELDS}
            for role in ("token", "layer", "ids"):
                if names[role] is None:
                    raise _err(where, f"record {lineno}: {role}: expected one of the fields "
                                      f"{list(_FIELDS[role])}, found keys {sorted(rec)}")
        try:
            ids = rec[names["ids"]]
            tok = rec[names["token"]]
            lay = rec[names["layer"]]
        except KeyError as e:
            raise _err(where, f"record {lineno}: {e.args[0]}: expected the field (as in earlier records), "
                              "missing") from None
        if not isinstance(ids, list):
            raise _err(where, f"record {lineno}: {names['ids']}: expected a list of expert ids, "
                              f"found {type(ids).__name__}")
        if K0 is None:
            K0 = len(ids)
            if K0 == 0:
                raise _err(where, f"record {lineno}: {names['ids']}: expected at least one expert id, found []")
        elif len(ids) != K0:
            raise _err(where, f"record {lineno}: {names['ids']}: expected {K0} ids (the top-k of the first "
                              f"record), found {len(ids)}: top-k width varies across records")
        if names["weights"] is not None:
            w = rec.get(names["weights"])
            if not isinstance(w, list) or len(w) != K0:
                raise _err(where, f"record {lineno}: {names['weights']}: expected a list of {K0} weights, "
                                  f"found {json.dumps(w)[:60]}")
            w_l.append(w)
        gkey = rec.get(names["group"]) if names["group"] else None
        if isinstance(gkey, (list, dict)):
            gkey = json.dumps(gkey, sort_keys=True)
        g_l.append(groups.setdefault(gkey, len(groups)))
        t_l.append(tok)
        l_l.append(lay)
        ids_l.append(ids)
        line_l.append(lineno)
    if not ids_l:
        raise _err(where, "expected at least one route record, found none")
    line_N = np.asarray(line_l, np.int64)

    def ints(values, field: str, shape_ok) -> np.ndarray:
        try:
            a = np.asarray(values)
        except ValueError:
            a = np.asarray(values, dtype=object)
        if a.dtype.kind in "iu" and shape_ok(a):
            return a.astype(np.int64)
        for i, v in enumerate(values):  # error path only: find the offending record
            vv = v if isinstance(v, list) else [v]
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in vv):
                raise _err(where, f"record {line_N[i]}: {field}: expected integers, found {json.dumps(v)[:60]}")
        raise _err(where, f"{field}: expected integers, found dtype {a.dtype}")

    ids_NK = ints(ids_l, names["ids"], lambda a: a.ndim == 2)
    tok_N = ints(t_l, names["token"], lambda a: a.ndim == 1)
    lay_N = ints(l_l, names["layer"], lambda a: a.ndim == 1)
    if names["weights"] is not None:
        try:
            w_NK = np.asarray(w_l, dtype=np.float64)
        except (ValueError, TypeError):
            for i, v in enumerate(w_l):
                if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                    raise _err(where, f"record {line_N[i]}: {names['weights']}: expected numbers, "
                                      f"found {json.dumps(v)[:60]}") from None
            raise
    else:
        w_NK = None
    return {"meta": meta_line, "names": names, "group_N": np.asarray(g_l, np.int64), "groups": list(groups),
            "token_N": tok_N, "layer_N": lay_N, "ids_NK": ids_NK, "w_NK": w_NK, "line_N": line_N,
            "skipped": skipped, "last_line": last_line}


def _first(mask_N: np.ndarray) -> int:
    return int(np.argmax(mask_N))


def _warmup_rows(r: dict, min_rows: int) -> tuple[np.ndarray, list[dict]]:
    """Rows in warm-up blocks: per layer, in file order, runs of >= min_rows identical expert sets
    with uniform weights. Returns a bool mask [N] and a description of each block."""
    ids, w, lay, line = r["ids_NK"], r["w_NK"], r["layer_N"], r["line_N"]
    N = len(ids)
    mask = np.zeros(N, bool)
    blocks: list[dict] = []
    if w is None or min_rows <= 0:
        return mask, blocks
    uniform = (w.max(axis=1) - w.min(axis=1)) <= 1e-6 * np.maximum(1.0, np.abs(w).max(axis=1))
    order = np.lexsort((line, lay))                       # per layer, file order
    s_ids = np.sort(ids[order], axis=1)
    u = uniform[order]
    same = np.zeros(N, bool)
    same[1:] = (s_ids[1:] == s_ids[:-1]).all(axis=1) & (lay[order][1:] == lay[order][:-1])
    # a run continues while the row is uniform and identical to the previous uniform row
    cont = same & u & np.concatenate([[False], u[:-1]])
    starts = np.flatnonzero(~cont)
    ends = np.append(starts[1:], N)
    for a, b in zip(starts, ends):                        # one iteration per run boundary
        if b - a >= min_rows and u[a]:
            mask[order[a:b]] = True
            blocks.append({"layer": int(lay[order[a]]), "first_record": int(line[order[a]]),
                           "rows": int(b - a), "experts": s_ids[a].tolist()})
    return mask, blocks


def _from_records(path: Path, fmt: str, *, model, num_experts, top_k, warmup_min_rows) -> Imported:
    where = str(path)
    r = _parse_records(path, fmt)
    names, meta_line = r["names"], r["meta"] or {}
    ids, w, lay, tok, grp, line = r["ids_NK"], r["w_NK"], r["layer_N"], r["token_N"], r["group_N"], r["line_N"]
    K = ids.shape[1]
    report: dict[str, Any] = {"format": fmt, "records": int(len(ids)), "fields": {k: v for k, v in names.items() if v}}
    if r["skipped"]:
        report["non_route_records_skipped"] = r["skipped"]
    # -- metadata against records
    E = _resolve_experts(where, num_experts, meta_line.get("num_experts"), model, ids, report)
    mk = meta_line.get("top_k")
    if mk is not None and mk != K:
        raise _err(where, f"record {line[0]}: {names['ids']}: expected {mk} ids (meta top_k), found {K}: "
                          "metadata contradicts the records")
    _check_top_k(where, K, top_k, model)
    bad = (ids < 0) | (ids >= E)
    if bad.any():
        i = _first(bad.any(axis=1))
        raise _err(where, f"record {line[i]}: {names['ids']}: expected ids in [0, {E}), found {ids[i].tolist()}")
    s = np.sort(ids, axis=1)
    dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
    if dup.any():
        i = _first(dup)
        raise _err(where, f"record {line[i]}: {names['ids']}: expected distinct experts, found {ids[i].tolist()}")
    if (tok < 0).any():
        i = _first(tok < 0)
        raise _err(where, f"record {line[i]}: {names['token']}: expected >= 0, found {int(tok[i])}")
    if (lay < 0).any():
        i = _first(lay < 0)
        raise _err(where, f"record {line[i]}: {names['layer']}: expected >= 0, found {int(lay[i])}")
    logged = meta_line.get("layers_logged")
    if logged is not None:
        extra = ~np.isin(lay, np.asarray(logged, np.int64))
        if extra.any():
            i = _first(extra)
            raise _err(where, f"record {line[i]}: {names['layer']}: expected one of meta layers_logged "
                              f"{logged}, found {int(lay[i])}: metadata contradicts the records")
    if w is None:
        w = np.full(ids.shape, 1.0 / K)
        report["weights"] = "absent in the source: set to 1/K"
    else:
        fin = np.isfinite(w).all(axis=1)
        if not fin.all():
            i = _first(~fin)
            raise _err(where, f"record {line[i]}: {names['weights']}: expected finite numbers, found "
                              f"{w[i].tolist()}")
        neg = (w < 0).any(axis=1)
        if neg.any():
            i = _first(neg)
            raise _err(where, f"record {line[i]}: {names['weights']}: expected >= 0, found {w[i].tolist()}")
    keep = np.ones(len(ids), bool)
    # -- warm-up / profiling blocks: drop every token that has a row in one
    wmask, blocks = _warmup_rows({**r, "w_NK": w}, warmup_min_rows)
    tkey = grp * (int(tok.max()) + 1) + tok            # one id per (group, token)
    if wmask.any():
        warm_tokens = np.isin(tkey, np.unique(tkey[wmask]))
        keep &= ~warm_tokens
        report["warmup_rows_dropped"] = int(warm_tokens.sum())
        report["warmup_blocks"] = blocks
    else:
        report["warmup_rows_dropped"] = 0
    # -- duplicates: same (group, token, layer)
    order = np.lexsort((line, lay, tkey))
    same_key = (tkey[order][1:] == tkey[order][:-1]) & (lay[order][1:] == lay[order][:-1])
    if same_key.any():
        a, b = order[:-1][same_key], order[1:][same_key]   # b duplicates a (a earlier in file)
        differ = (ids[a] != ids[b]).any(axis=1) | (np.abs(w[a] - w[b]) > 1e-6).any(axis=1)
        if differ.any():
            j = _first(differ)
            raise _err(where, f"record {line[b[j]]}: {names['ids']}: expected a duplicate of record {line[a[j]]} "
                              f"(same token and layer) to match it, found experts {ids[b[j]].tolist()} "
                              f"vs {ids[a[j]].tolist()}")
        keep[b] = False
        report["duplicate_records_dropped"] = int(len(b))
    else:
        report["duplicate_records_dropped"] = 0
    # -- tokens missing layers
    layer_ids = sorted(int(x) for x in np.unique(lay[keep])) if keep.any() else []
    if logged is not None:
        layer_ids = [int(x) for x in logged]
    if not layer_ids:
        raise _err(where, "expected route records after dropping warm-up and duplicates, found none")
    L = len(layer_ids)
    uk, tinv = np.unique(tkey[keep], return_inverse=True)
    per_tok = np.bincount(tinv, minlength=len(uk))
    complete = per_tok == L
    report["tokens_missing_layers_dropped"] = int((~complete).sum())
    report["records_of_incomplete_tokens_dropped"] = int(per_tok[~complete].sum())
    kidx = np.flatnonzero(keep)
    keep[kidx[~complete[tinv]]] = False
    if not keep.any():
        raise _err(where, f"expected at least one token with all {L} layers, found none")
    uk, tinv = np.unique(tkey[keep], return_inverse=True)   # token order: (group order, token_idx)
    T = len(uk)
    li = np.searchsorted(np.asarray(layer_ids), lay[keep])
    ids_LTK = np.empty((L, T, K), np.int64)
    w_LTK = np.empty((L, T, K), np.float32)
    ids_LTK[li, tinv] = ids[keep]
    w_LTK[li, tinv] = w[keep]
    tensors = {"topk_ids": ids_LTK, "topk_weights": w_LTK}
    gname = names["group"]
    if gname is not None:
        step_T = (uk // (int(tok.max()) + 1)).astype(np.int64)
        _, step_T = np.unique(step_T, return_inverse=True)   # dense 0..S-1, group order kept
        tensors["step"] = step_T.astype(np.int32)
        steps = f"one step per {gname} ({int(step_T.max()) + 1} steps), tokens ordered by {names['token']}"
    else:
        steps = "one step holds all tokens (no request/problem id in the source)"
    report["tokens"] = T
    report["layers"] = L
    src_model = meta_line.get("model_id") or meta_line.get("model")
    meta = TraceMeta(kind="tokens", num_experts=E, top_k=K, layer_ids=layer_ids, num_tokens=T,
                     model=model, steps=steps,
                     source=f"imported from {path.name} ({fmt})" + (f"; model {src_model}" if src_model else ""),
                     attribution=_attribution(path), import_report=report)
    return Imported(meta, tensors)


def _resolve_experts(where: str, cli: int | None, in_file: Any, model: str | None, ids: np.ndarray | None,
                     report: dict) -> int:
    """num_experts from the command line, the file's metadata and the model preset (must agree),
    else inferred from the largest id."""
    given = []
    if cli is not None:
        given.append(("--num-experts", int(cli)))
    if in_file is not None:
        if not isinstance(in_file, int) or in_file < 1:
            raise _err(where, f"metadata: num_experts: expected an integer >= 1, found {in_file!r}")
        given.append(("the file's num_experts", in_file))
    if model is not None:
        from moonep_sim.models import get_model
        given.append((f"model {model}", get_model(model).num_experts))
    for name, v in given[1:]:
        if v != given[0][1]:
            raise _err(where, f"num_experts: expected {given[0][1]} ({given[0][0]}), found {v} ({name}): "
                              "metadata contradicts")
    if given:
        return given[0][1]
    if ids is None or ids.size == 0:
        raise _err(where, "num_experts: expected --num-experts or --model, found neither")
    E = int(ids.max()) + 1
    report["num_experts"] = f"inferred from the largest id: {E} (pass --num-experts or --model to set it)"
    return max(E, 1)


def _check_top_k(where: str, K: int, cli: int | None, model: str | None) -> None:
    if cli is not None and cli != K:
        raise _err(where, f"top_k: expected {cli} (--top-k), found {K} ids per token")
    if model is not None:
        from moonep_sim.models import get_model
        mk = get_model(model).top_k
        if mk != K:
            raise _err(where, f"top_k: expected {mk} (model {model}), found {K} ids per token")


# ---------------------------------------------------------------------------------- histograms
def _from_counts_json(path: Path, *, model, num_experts, top_k) -> Imported:
    where = str(path)
    text = path.read_bytes()
    if not text.strip():
        raise _err(where, "expected a JSON expert-count histogram, found an empty file")
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        pos = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise _err(where, f"expected JSON, found invalid JSON{pos} ({getattr(e, 'msg', e)}; truncated?)") from None
    file_E = file_K = file_layers = None
    if isinstance(doc, dict):
        file_E, file_K, file_layers = doc.get("num_experts"), doc.get("top_k"), doc.get("layers")
        for key in ("expert_usage_by_layer", "counts", "expert_counts"):
            if key in doc:
                body, field = doc[key], key
                break
        else:
            body, field = doc, "(top level)"
    elif isinstance(doc, list):
        body, field = doc, "(top level)"
    else:
        raise _err(where, f"expected a JSON object or list of per-layer counts, found {type(doc).__name__}")
    if isinstance(body, dict):
        items = list(body.items())
    elif isinstance(body, list):
        items = [(str(i), v) for i, v in enumerate(body)]
    else:
        raise _err(where, f"{field}: expected per-layer counts (object or list), found {type(body).__name__}")
    if not items:
        raise _err(where, f"{field}: expected at least one layer, found none")
    layer_ids, rows = [], []
    for lk, v in items:
        try:
            layer_ids.append(int(lk))
        except ValueError:
            raise _err(where, f"{field}: layer key: expected an integer, found {lk!r}") from None
        if isinstance(v, dict):
            try:
                pairs = [(int(e), c) for e, c in v.items()]
            except ValueError:
                raise _err(where, f"{field}[{lk}]: expert key: expected integers, found {list(v)[:4]}") from None
            rows.append(pairs)
        elif isinstance(v, list):
            rows.append(list(enumerate(v)))
        else:
            raise _err(where, f"{field}[{lk}]: expected an object or list of counts, found {type(v).__name__}")
    for (lk, _), pairs in zip(items, rows):
        for e, c in pairs:
            if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                raise _err(where, f"{field}[{lk}][{e}]: expected a count (integer >= 0), found {c!r}")
            if e < 0:
                raise _err(where, f"{field}[{lk}]: expert id: expected >= 0, found {e}")
    max_id = max((e for pairs in rows for e, _ in pairs), default=-1)
    report: dict[str, Any] = {"format": "counts-json", "field": field}
    E = _resolve_experts(where, num_experts, file_E, model, np.asarray([max_id]) if max_id >= 0 else None, report)
    if max_id >= E:
        lk = next(lk for (lk, _), pairs in zip(items, rows) if any(e >= E for e, _ in pairs))
        raise _err(where, f"{field}[{lk}]: expert id: expected < num_experts ({E}), found {max_id}")
    if len(set(layer_ids)) != len(layer_ids):
        raise _err(where, f"{field}: layer keys: expected distinct layers, found {layer_ids}")
    if file_layers is not None and sorted(file_layers) != sorted(layer_ids):
        raise _err(where, f"layers: expected the layers of {field} {layer_ids}, found {file_layers}: "
                          "metadata contradicts the counts")
    counts_LE = np.zeros((len(rows), E), np.int64)
    for i, pairs in enumerate(rows):
        if pairs:
            e, c = zip(*pairs)
            counts_LE[i, list(e)] = c
    # cross-check per-layer totals that some exporters write alongside
    analysis = doc.get("layer_analysis") if isinstance(doc, dict) else None
    if isinstance(analysis, dict):
        for i, lk in enumerate(layer_ids):
            tot = (analysis.get(str(lk)) or {}).get("total_usage")
            if tot is not None and tot != int(counts_LE[i].sum()):
                raise _err(where, f"layer_analysis[{lk}].total_usage: expected {int(counts_LE[i].sum())} "
                                  f"(the sum of its counts), found {tot}: metadata contradicts the counts")
    K = top_k or file_K
    if K is None and model is not None:
        from moonep_sim.models import get_model
        K = get_model(model).top_k
    if K is None:
        K = 1
        report["top_k"] = "not in the source: assumed 1 (pass --top-k to set it)"
    _check_top_k(where, K, top_k, model)
    if not 1 <= K <= E:
        raise _err(where, f"top_k: expected an integer in [1, {E}], found {K}")
    sums = counts_LE.sum(axis=1)
    if (sums == sums[0]).all() and sums[0] % K == 0:
        T = int(sums[0] // K)
    else:
        T = None
        report["num_tokens"] = "unknown: layer totals differ or are not multiples of top_k"
    report["layers"] = len(layer_ids)
    order = np.argsort(layer_ids, kind="stable")
    meta = TraceMeta(kind="counts", num_experts=E, top_k=int(K), layer_ids=[layer_ids[i] for i in order],
                     num_tokens=T, model=model, steps="counts aggregated over all tokens (one step)",
                     source=f"imported from {path.name} (counts-json)", attribution=_attribution(path),
                     import_report=report)
    return Imported(meta, {"counts": counts_LE[order]})


# ---------------------------------------------------------------------------------- arrays
def _from_npy(path: Path, *, model, num_experts, top_k) -> Imported:
    where = str(path)
    extra: dict[str, np.ndarray] = {}
    try:
        obj = np.load(path, allow_pickle=False)
        if isinstance(obj, np.lib.npyio.NpzFile):
            with obj:
                keys = list(obj.files)
                main = "topk_ids" if "topk_ids" in keys else ("routed_experts" if "routed_experts" in keys
                                                             else (keys[0] if len(keys) == 1 else None))
                if main is None:
                    raise _err(where, f"expected an array named topk_ids in the .npz, found {keys}")
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
            raise _err(where, "expected a numeric array, found an object array stored by pickle "
                              "(pickled data is never loaded)") from None
        raise _err(where, f"expected a readable numpy file, found {e} (truncated?)") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise _err(where, f"expected a readable numpy file, found {type(e).__name__}: {e} (truncated?)") from None
    if ids.dtype.kind not in "iu":
        raise _err(where, f"topk_ids: expected an integer array, found dtype {ids.dtype}")
    if ids.ndim == 2:
        ids = ids[:, None, :]
    if ids.ndim != 3 or ids.shape[0] == 0 or ids.shape[2] == 0:
        raise _err(where, f"topk_ids: expected shape [tokens, layers, k] with tokens, k >= 1, found {list(ids.shape)}")
    T, L, K = ids.shape
    report: dict[str, Any] = {"format": "npy", "shape_TLK": [T, L, K]}
    E = _resolve_experts(where, num_experts, None, model, ids, report)
    _check_top_k(where, K, top_k, model)
    ids_LTK = np.ascontiguousarray(ids.transpose(1, 0, 2)).astype(np.int64)
    bad = (ids_LTK < 0) | (ids_LTK >= E)
    if bad.any():
        l, t = np.unravel_index(int(np.argmax(bad.any(axis=2))), (L, T))
        raise _err(where, f"token {t}: layer {l}: topk_ids: expected ids in [0, {E}), found {ids_LTK[l, t].tolist()}")
    s = np.sort(ids_LTK, axis=2)
    dup = (s[:, :, 1:] == s[:, :, :-1]).any(axis=2)
    if dup.any():
        l, t = np.unravel_index(int(np.argmax(dup)), (L, T))
        raise _err(where, f"token {t}: layer {l}: topk_ids: expected distinct experts, found {ids_LTK[l, t].tolist()}")
    if "topk_weights" in extra:
        w = extra["topk_weights"]
        if w.shape != (T, L, K) and not (w.ndim == 2 and L == 1 and w.shape == (T, K)):
            raise _err(where, f"topk_weights: expected shape {[T, L, K]} (as topk_ids), found {list(w.shape)}")
        if w.dtype.kind != "f":
            raise _err(where, f"topk_weights: expected a float array, found dtype {w.dtype}")
        w_LTK = np.ascontiguousarray(w.reshape(T, L, K).transpose(1, 0, 2)).astype(np.float32)
        fin = np.isfinite(w_LTK).all(axis=2)
        if not fin.all():
            l, t = np.unravel_index(int(np.argmax(~fin)), (L, T))
            raise _err(where, f"token {t}: layer {l}: topk_weights: expected finite numbers, found {w_LTK[l, t].tolist()}")
    else:
        w_LTK = np.full((L, T, K), 1.0 / K, np.float32)
        report["weights"] = "absent in the source: set to 1/K"
    tensors = {"topk_ids": ids_LTK, "topk_weights": w_LTK}
    steps = "one step holds all tokens"
    if "step" in extra:
        st = extra["step"]
        if st.shape != (T,) or st.dtype.kind not in "iu" or (T > 1 and (np.diff(st) < 0).any()):
            raise _err(where, f"step: expected non-decreasing integers of shape [{T}], found shape "
                              f"{list(st.shape)} dtype {st.dtype}")
        tensors["step"] = st.astype(np.int32)
        steps = "step tensor from the source"
    layer_ids = list(range(L))
    if "layer_ids" in extra:
        li = extra["layer_ids"]
        if li.shape != (L,) or li.dtype.kind not in "iu":
            raise _err(where, f"layer_ids: expected {L} integers, found shape {list(li.shape)} dtype {li.dtype}")
        layer_ids = [int(x) for x in li]
    report["tokens"], report["layers"] = T, L
    meta = TraceMeta(kind="tokens", num_experts=E, top_k=K, layer_ids=layer_ids, num_tokens=T, model=model,
                     steps=steps, source=f"imported from {path.name} (npy)", attribution=_attribution(path),
                     import_report=report)
    return Imported(meta, tensors)


# ---------------------------------------------------------------------------------- entry points
def load_source(src: str | os.PathLike, format: str = "auto", *, model: str | None = None,
                num_experts: int | None = None, top_k: int | None = None,
                warmup_min_rows: int = 64) -> Imported:
    """Parse ``src`` into trace metadata and tensors (nothing is written).

    format: ``auto`` or one of ``FORMATS``. model: a preset name (its E and K must agree with the
    file). warmup_min_rows: the shortest run of identical uniform-weight rows taken as warm-up
    (0 disables the detection).
    """
    path = Path(src)
    if format == "auto":
        format = detect_format(path)
    elif format not in FORMATS:
        raise TraceFormatError(f"--format ({format!r}) must be auto or one of {', '.join(FORMATS)}")
    else:
        detect_format(path)  # existence, emptiness, pickle checks
    if model is not None:
        from moonep_sim.models import get_model
        get_model(model)
    if format in ("jsonl-records", "vllm-routes"):
        return _from_records(path, format, model=model, num_experts=num_experts, top_k=top_k,
                             warmup_min_rows=warmup_min_rows)
    if format == "counts-json":
        return _from_counts_json(path, model=model, num_experts=num_experts, top_k=top_k)
    return _from_npy(path, model=model, num_experts=num_experts, top_k=top_k)


def import_trace(src: str | os.PathLike, out: str | os.PathLike, format: str = "auto", **kwargs) -> TraceMeta:
    """Import ``src`` and write the trace ``out`` atomically (nothing is written on error)."""
    check_output_path(out, "-o", inputs=(src,))  # before parsing: `trace import X -o X` never runs
    imp = load_source(src, format, **kwargs)
    write_trace(out, imp.meta, imp.tensors, what="-o", inputs=(src,))
    return imp.meta
