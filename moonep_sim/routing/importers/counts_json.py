"""``counts-json``: a per-layer expert-count histogram (``expert_usage_by_layer[layer][expert]``, a
``counts`` list of lists, or ``{layer: [counts]}``) -> a counts-level trace (no per-token rows, so no
steps and no co-occurrence of experts within a token)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from moonep_sim.routing.importers.common import (ImportOptions, Imported, attribution, check_top_k, err, is_int,
                                                 load_json, model_of, resolve_experts)
from moonep_sim.routing.importers.registry import Importer, Sniff, register
from moonep_sim.routing.trace import TraceMeta, model_meta


def sniff(s: Sniff) -> bool:
    text = s.head.lstrip()
    if not (text.startswith(b"{") or text.startswith(b"[")):
        return False
    rec = s.first_record
    return rec is None or isinstance(rec, (dict, list))


def load_counts(path: Path, fmt: str, opts: ImportOptions) -> Imported:
    where = str(path)
    text = path.read_bytes()
    if not text.strip():
        raise err(where, "expected a JSON expert-count histogram, found an empty file")
    doc = load_json(where, text)
    (file_E, file_K, file_layers), body, field = _header_and_body(where, doc)
    items, layer_ids, rows = _layer_rows(where, body, field)
    max_id = max((e for pairs in rows for e, _ in pairs), default=-1)
    report: dict[str, Any] = {"format": "counts-json", "field": field}
    E, inferred = resolve_experts(where, opts, file_E, np.asarray([max_id]) if max_id >= 0 else None, report)
    if max_id >= E:
        lk = next(lk for (lk, _), pairs in zip(items, rows) if any(e >= E for e, _ in pairs))
        raise err(where, f"{field}[{lk}]: expert id: expected < num_experts ({E}), found {max_id}")
    if len(set(layer_ids)) != len(layer_ids):
        raise err(where, f"{field}: layer keys: expected distinct layers, found {layer_ids}")
    if file_layers is not None and sorted(file_layers) != sorted(layer_ids):
        raise err(where, f"layers: expected the layers of {field} {layer_ids}, found {file_layers}: "
                          "metadata contradicts the counts")
    counts_LE = np.zeros((len(rows), E), np.int64)
    for i, pairs in enumerate(rows):
        if pairs:
            e, c = zip(*pairs)
            counts_LE[i, list(e)] = c
    _check_totals(where, doc, layer_ids, counts_LE)
    K = _top_k(where, opts, file_K, E, report)
    sums = counts_LE.sum(axis=1)
    if (sums == sums[0]).all() and sums[0] % K == 0:
        T = int(sums[0] // K)
    else:
        T = None
        report["num_tokens"] = "unknown: layer totals differ or are not multiples of top_k"
    report["layers"] = len(layer_ids)
    order = np.argsort(layer_ids, kind="stable")
    meta = TraceMeta(kind="counts", num_experts=E, top_k=int(K), layer_ids=[layer_ids[i] for i in order],
                     num_tokens=T, steps="counts aggregated over all tokens (one step)",
                     source=f"imported from {path.name} (counts-json)", attribution=attribution(path),
                     import_report=report, num_experts_inferred=inferred, **model_meta(opts.model))
    return Imported(meta, {"counts": counts_LE[order]})


def _header_and_body(where: str, doc: Any) -> tuple[tuple[Any, Any, Any], Any, str]:
    """((num_experts, top_k, layers) the file states, or None each; the per-layer counts; the
    field they are under)."""
    if isinstance(doc, list):
        return (None, None, None), doc, "(top level)"
    if not isinstance(doc, dict):
        raise err(where, f"expected a JSON object or list of per-layer counts, found {type(doc).__name__}")
    file_E, file_K, file_layers = doc.get("num_experts"), doc.get("top_k"), doc.get("layers")
    if file_K is not None and (not is_int(file_K) or file_K < 1):
        raise err(where, f"top_k: expected an integer >= 1, found {json.dumps(file_K)[:40]}")
    if file_layers is not None and (not isinstance(file_layers, list)
                                    or not all(is_int(x) for x in file_layers)):
        raise err(where, f"layers: expected a list of integer layer ids, found {json.dumps(file_layers)[:60]}")
    key = next((k for k in ("expert_usage_by_layer", "counts", "expert_counts") if k in doc), None)
    return (file_E, file_K, file_layers), (doc if key is None else doc[key]), key or "(top level)"


def _layer_rows(where: str, body: Any, field: str) -> tuple[list, list[int], list[list[tuple[int, Any]]]]:
    """(the (layer key, value) items, the layer ids, each layer's (expert, count) pairs), every
    key and count checked."""
    if isinstance(body, dict):
        items = list(body.items())
    elif isinstance(body, list):
        items = [(str(i), v) for i, v in enumerate(body)]
    else:
        raise err(where, f"{field}: expected per-layer counts (object or list), found {type(body).__name__}")
    if not items:
        raise err(where, f"{field}: expected at least one layer, found none")
    layer_ids, rows = [], []
    for lk, v in items:
        try:
            layer_ids.append(int(lk))
        except ValueError:
            raise err(where, f"{field}: layer key: expected an integer, found {lk!r}") from None
        if not 0 <= layer_ids[-1] < 1 << 31:
            raise err(where, f"{field}: layer key: expected a layer id in [0, 2^31), found {lk!r}")
        if isinstance(v, dict):
            try:
                pairs = [(int(e), c) for e, c in v.items()]
            except ValueError:
                raise err(where, f"{field}[{lk}]: expert key: expected integers, found {list(v)[:4]}") from None
            rows.append(pairs)
        elif isinstance(v, list):
            rows.append(list(enumerate(v)))
        else:
            raise err(where, f"{field}[{lk}]: expected an object or list of counts, found {type(v).__name__}")
    for (lk, _), pairs in zip(items, rows):
        for e, c in pairs:
            if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                raise err(where, f"{field}[{lk}][{e}]: expected a count (integer >= 0), found {c!r}")
            if e < 0:
                raise err(where, f"{field}[{lk}]: expert id: expected >= 0, found {e}")
    return items, layer_ids, rows


def _check_totals(where: str, doc: Any, layer_ids: list[int], counts_LE: np.ndarray) -> None:
    """Cross-check the per-layer totals some exporters write alongside (``layer_analysis``)."""
    analysis = doc.get("layer_analysis") if isinstance(doc, dict) else None
    if analysis is not None and not isinstance(analysis, dict):
        raise err(where, f"layer_analysis: expected an object of per-layer objects, found {type(analysis).__name__}")
    if isinstance(analysis, dict):
        for i, lk in enumerate(layer_ids):
            entry = analysis.get(str(lk)) or {}
            if not isinstance(entry, dict):
                raise err(where, f"layer_analysis[{lk}]: expected an object, found {json.dumps(entry)[:40]}")
            tot = entry.get("total_usage")
            if tot is not None and tot != int(counts_LE[i].sum()):
                raise err(where, f"layer_analysis[{lk}].total_usage: expected {int(counts_LE[i].sum())} "
                                  f"(the sum of its counts), found {tot}: metadata contradicts the counts")


def _top_k(where: str, opts: ImportOptions, file_K: Any, E: int, report: dict[str, Any]) -> int:
    """The top-k: given, the file's, the model's, else 1 (said in the report)."""
    m = model_of(opts)
    K = opts.top_k or file_K
    if K is None and m is not None:
        K = m.top_k
    if K is None:
        K = 1
        report["top_k"] = "not in the source: assumed 1 (pass --top-k to set it)"
    check_top_k(where, K, opts)
    if not 1 <= K <= E:
        raise err(where, f"top_k: expected an integer in [1, {E}], found {K}")
    return K


register(Importer(
    name="counts-json",
    summary="a per-layer expert-count histogram: `expert_usage_by_layer[layer][expert]`, `counts` "
            "(list of lists) or `{layer: [counts]}`; optional `num_experts`, `top_k`, `layers`",
    drops="nothing is dropped; a histogram has no tokens, so no steps and no co-occurrence within a token "
          "(distinct ranks per token are estimated and labelled so); top-k absent: assumed 1 unless "
          "`--top-k` or `--model`; the token count is known only when every layer's total is the same "
          "multiple of top-k",
    sniff=sniff, load=load_counts, priority=10))
