"""The record-log engine shared by ``jsonl-records`` and ``vllm-routes``: one JSON object per
(row, layer), field names from ``common.FIELDS``.

Notation: N records, L layers, T tokens, K top-k, E experts, S steps, R runs.

What happens to a log, in order (every drop is counted in the trace's ``import_report``):

1. **Parse** one record per line (the only per-record Python step); a first ``{"type": "meta"}``
   line may give ``num_experts``, ``top_k``, ``layers_logged``, ``model_id``; records of another
   ``type`` are skipped; fields outside the table are ignored and listed once.
2. **Check** ids in [0, E), distinct within a row, positions and layers >= 0, weights finite and
   >= 0, metadata against the records: a one-line error naming the record (line) and field.
3. **Exact repeats**: a record equal to the previous record of its layer (same request, position,
   experts and weights) is a duplicate write: dropped.
4. **Steps** (forward passes). ``field``: a new step where the step field's value changes.
   ``passes``: a forward pass visits the layers in order and each request once, so a new step
   starts where (a) the log goes back to an earlier layer (the next pass begins), (b) a request's
   position does not increase (positions that restart every pass), or (c) a request comes back
   after another request (the next decode pass). Computed per layer over runs of consecutive
   rows of one request: ``p_r = max(p_(r-1) + new_pass_r, p_(previous run of the request) + 1)``,
   solved by vectorised rounds from the lower bound "occurrence number of the request" (the
   least solution, i.e. the greedy split). ``group``: one step per request id. ``none``: one step.
   ``auto``: ``field`` when a step field exists, else ``passes``.
5. **Dummy blocks**, judged by routing, never by weights: a run of at least ``warmup_min_rows``
   consecutive rows of one layer with one expert set (warm-up, profiling; when the run covers whole
   steps, rows of a step it covers only in part are kept: real rows that repeat the set by
   chance), and a whole step of a
   power-of-two size >= ``capture_min_rows`` whose rows of a layer all carry one expert set (CUDA
   graph capture). A token whose rows at every layer it has are dummy rows is dropped, counted per
   reason.
6. **Duplicates within a step** (same request, position and layer): equal ones dropped, different
   ones an error naming both records.
7. **Tokens missing layers** (generation stopped, log cut mid-pass, a layer not logged for some
   tokens): kept at the layers they have, under a per-layer token mask (``token_mask`` [L, T]),
   with a warning giving their count; ``incomplete_tokens="drop"`` (``--drop-incomplete-tokens``)
   drops them instead, as earlier versions did.
8. The sanity pass (``common.sanity_warnings``) warns about what still looks like dummy traffic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from moonep_sim.routing.importers.common import (FIELDS, QUIET_FIELDS, REQUIRED_ROLES, ImportOptions, Imported,
                                                 attribution, check_top_k, err, first_true, is_int, pick,
                                                 resolve_experts, sanity_warnings, set_ids)
from moonep_sim.routing.trace import TraceMeta, find_bad_token, model_meta

MAX_BLOCKS_LISTED = 20


# ---------------------------------------------------------------------------------- parse
def parse_records(path: Path) -> dict[str, Any]:
    """One pass over a JSONL log: raw per-record arrays plus the meta line (if any)."""
    where = str(path)
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise err(where, "expected routing records, found an empty file")
    c = _collect(where, _records(where, data))
    if not c.ids:
        raise err(where, "expected at least one route record, found none")
    line_N = np.asarray(c.line, np.int64)
    # JSON true/false decode as Python bools, which numpy silently turns into 1/0: when the file
    # holds the words at all, the (slow, exact) per-record type check of _ints runs
    maybe_bools = b"true" in data or b"false" in data
    names = c.names
    ids_NK = _ints(where, c.ids, names["ids"], 2, line_N, maybe_bools)
    tok_N = _ints(where, c.tok, names["token"], 1, line_N, maybe_bools)
    lay_N = _ints(where, c.lay, names["layer"], 1, line_N, maybe_bools)
    w_NK = _weights(where, c.w, names["weights"], line_N) if names["weights"] is not None else None
    used = {v for v in names.values() if v}
    ignored = sorted(c.seen_keys - used - QUIET_FIELDS)
    return {"meta": c.meta, "names": names, "group_N": np.asarray(c.group, np.int64),
            "stepfield_N": np.asarray(c.step, np.int64) if names["step"] else None,
            "token_N": tok_N, "layer_N": lay_N, "ids_NK": ids_NK, "w_NK": w_NK, "line_N": line_N,
            "skipped": c.skipped, "ignored": ignored}


def _records(where: str, data: bytes) -> Iterator[tuple[int, dict]]:
    """(line number, record) of each non-blank line, in order: one C-level decode of every line,
    per line only on error (then the first bad line is named)."""
    truncated = not data.endswith(b"\n")
    lines = data.split(b"\n")
    numbered = [(i, s) for i, s in enumerate((x.strip() for x in lines), 1) if s]
    try:
        decoded = json.loads(b"[" + b",".join(s for _, s in numbered) + b"]")
        if len(decoded) != len(numbered):
            raise ValueError("a line held more than one JSON value")
    except (ValueError, UnicodeDecodeError, RecursionError):
        decoded = None
    for j, (lineno, s) in enumerate(numbered):
        if decoded is not None:
            rec = decoded[j]
        else:
            try:
                rec = json.loads(s)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                hint = " (truncated last line?)" if truncated and lineno == len(lines) else ""
                raise err(where, f"record {lineno}: expected a JSON object, found invalid JSON "
                                 f"({getattr(e, 'msg', str(e))}){hint}") from None
            except RecursionError:
                raise err(where, f"record {lineno}: expected a JSON object, found JSON nested too deep "
                                 "to parse") from None
        if not isinstance(rec, dict):
            raise err(where, f"record {lineno}: expected a JSON object, found {type(rec).__name__}")
        yield lineno, rec


@dataclass
class _Columns:
    """What :func:`_collect` gathers, one entry per route record (lists), and what it saw."""

    meta: dict | None = None
    names: dict[str, str | None] | None = None
    groups: dict[Any, int] = field(default_factory=dict)
    steps: dict[Any, int] = field(default_factory=dict)
    group: list = field(default_factory=list)
    step: list = field(default_factory=list)
    tok: list = field(default_factory=list)
    lay: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    w: list = field(default_factory=list)
    line: list = field(default_factory=list)
    skipped: int = 0
    K0: int | None = None
    seen_keys: set[str] = field(default_factory=set)


def _collect(where: str, records: Iterable[tuple[int, dict]]) -> _Columns:
    """The meta record, the field names (from the first route record) and each route record's
    fields, checked as they come (the only per-record Python step)."""
    c = _Columns()
    for lineno, rec in records:
        kind = rec.get("type")
        if kind == "meta":
            if c.meta is not None or c.ids:
                raise err(where, f"record {lineno}: type: expected the meta record first and once, found another")
            c.meta = rec
            continue
        if kind is not None and kind != "route":
            c.skipped += 1
            continue
        if c.names is None:
            c.names = {role: pick(rec, role) for role in FIELDS}
            for role in REQUIRED_ROLES:
                if c.names[role] is None:
                    raise err(where, f"record {lineno}: {role}: expected one of the fields "
                                     f"{list(FIELDS[role])}, found keys {sorted(rec)}")
        names = c.names
        if len(rec) > len(c.seen_keys) or not c.seen_keys.issuperset(rec):
            c.seen_keys.update(rec)
        try:
            ids = rec[names["ids"]]
            tok = rec[names["token"]]
            lay = rec[names["layer"]]
        except KeyError as e:
            raise err(where, f"record {lineno}: {e.args[0]}: expected the field (as in earlier records), "
                             "missing") from None
        if not isinstance(ids, list):
            raise err(where, f"record {lineno}: {names['ids']}: expected a list of expert ids, "
                             f"found {type(ids).__name__}")
        if c.K0 is None:
            c.K0 = len(ids)
            if c.K0 == 0:
                raise err(where, f"record {lineno}: {names['ids']}: expected at least one expert id, found []")
        elif len(ids) != c.K0:
            raise err(where, f"record {lineno}: {names['ids']}: expected {c.K0} ids (the top-k of the first "
                             f"record), found {len(ids)}: top-k width varies across records")
        if names["weights"] is not None:
            w = rec.get(names["weights"])
            if not isinstance(w, list) or len(w) != c.K0:
                raise err(where, f"record {lineno}: {names['weights']}: expected a list of {c.K0} weights, "
                                 f"found {json.dumps(w)[:60]}")
            c.w.append(w)
        gkey = rec.get(names["group"]) if names["group"] else None
        if isinstance(gkey, (list, dict)):
            gkey = json.dumps(gkey, sort_keys=True)
        c.group.append(c.groups.setdefault(gkey, len(c.groups)))
        if names["step"] is not None:
            skey = rec.get(names["step"])
            if isinstance(skey, (list, dict)):
                skey = json.dumps(skey, sort_keys=True)
            c.step.append(c.steps.setdefault(skey, len(c.steps)))
        c.tok.append(tok)
        c.lay.append(lay)
        c.ids.append(ids)
        c.line.append(lineno)
    return c


def _ints(where: str, values: list, fld: str, ndim: int, line_N: np.ndarray, maybe_bools: bool) -> np.ndarray:
    """int64 array of ``ndim`` dimensions from one field's values, or a one-line error naming the
    first record that is not integers (checked value by value when the file holds true/false)."""
    try:
        a = np.asarray(values)
    except (ValueError, OverflowError):
        a = np.asarray(values, dtype=object)
    if a.dtype.kind in "iu" and a.ndim == ndim and not maybe_bools:
        return a.astype(np.int64)
    for i, v in enumerate(values):  # error path (or true/false in the file): find the offending record
        vv = v if isinstance(v, list) else [v]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in vv):
            raise err(where, f"record {line_N[i]}: {fld}: expected integers, found {json.dumps(v)[:60]}")
        if not all(-(1 << 63) <= x < 1 << 63 for x in vv):
            raise err(where, f"record {line_N[i]}: {fld}: expected 64-bit integers, found {json.dumps(v)[:60]}")
    if a.dtype.kind in "iu" and a.ndim == ndim:
        return a.astype(np.int64)
    raise err(where, f"{fld}: expected integers, found dtype {a.dtype}")


def _weights(where: str, values: list, fld: str, line_N: np.ndarray) -> np.ndarray:
    """float64 [N, K] weights, or a one-line error naming the first record that is not numbers."""
    try:
        w_NK = np.asarray(values, dtype=np.float64)
        if w_NK.ndim != 2:
            raise ValueError("nested lists")
        return w_NK
    except (ValueError, TypeError):
        for i, v in enumerate(values):
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                raise err(where, f"record {line_N[i]}: {fld}: expected numbers, found {json.dumps(v)[:60]}") from None
        raise err(where, f"{fld}: expected lists of numbers") from None


# ---------------------------------------------------------------------------------- steps
def _segment_starts(key_N: np.ndarray) -> np.ndarray:
    """True where a sorted key array starts a new segment, bool [N]."""
    new = np.ones(len(key_N), bool)
    new[1:] = key_N[1:] != key_N[:-1]
    return new


def _segmented_maxacc(v_R: np.ndarray, seg_R: np.ndarray) -> np.ndarray:
    """Running maximum of ``v`` restarting at each segment (``seg`` sorted, non-decreasing ints)."""
    if v_R.size == 0:
        return v_R
    span = int(v_R.max() - v_R.min()) + 1
    off = (seg_R - seg_R[0]) * span
    return np.maximum.accumulate(v_R - v_R.min() + off) - off + v_R.min()


def steps_by_passes(lay: np.ndarray, grp: np.ndarray, tok: np.ndarray) -> np.ndarray:
    """Forward-pass step of each record (records in file order), int64 [N]; see the module doc."""
    N = len(lay)
    if N == 0:
        return np.zeros(0, np.int64)
    new_pass_N = np.zeros(N, np.int64)
    new_pass_N[1:] = np.cumsum(lay[1:] < lay[:-1])           # the log went back to an earlier layer
    order = np.argsort(lay, kind="stable")                    # per layer, file order
    l, g, t, P = lay[order], grp[order], tok[order], new_pass_N[order]
    layer_start = _segment_starts(l)
    run_start = layer_start.copy()
    run_start[1:] |= (g[1:] != g[:-1]) | (t[1:] <= t[:-1]) | (P[1:] != P[:-1])
    rs = np.flatnonzero(run_start)                            # [R] first record of each run
    R = len(rs)
    run_of = np.cumsum(run_start) - 1                         # run index of each (sorted) record
    r_layer, r_grp = l[rs], g[rs]
    # force: this run must be in a later step than the previous run of its layer
    force = np.zeros(R, np.int64)
    same_layer = ~layer_start[rs]
    force[same_layer] = ((P[rs][same_layer] != P[rs - 1][same_layer])
                         | ((g[rs][same_layer] == g[rs - 1][same_layer]))).astype(np.int64)
    # previous run of the same (layer, request)
    o2 = np.lexsort((np.arange(R), r_grp, r_layer))
    prev = np.full(R, -1, np.int64)
    same = (r_layer[o2][1:] == r_layer[o2][:-1]) & (r_grp[o2][1:] == r_grp[o2][:-1])
    prev[o2[1:][same]] = o2[:-1][same]
    occ = np.zeros(R, np.int64)                               # earlier runs of the same request
    seg = np.concatenate([[True], ~same])
    idx = np.arange(R)
    occ[o2] = idx - np.maximum.accumulate(np.where(seg, idx, 0))
    lay_seg = np.cumsum(layer_start[rs]) - 1
    cf = np.cumsum(force)
    F = cf - cf[np.flatnonzero(layer_start[rs])][lay_seg]
    p = _segmented_maxacc(occ - F, lay_seg) + F
    for _ in range(10_000):                                   # rounds; usually 1-2
        cand = np.where(prev >= 0, p[np.maximum(prev, 0)] + 1, 0)
        new_p = _segmented_maxacc(np.maximum(cand, p) - F, lay_seg) + F
        if np.array_equal(new_p, p):
            break
        p = new_p
    step = np.empty(N, np.int64)
    step[order] = p[run_of]
    return step


def assign_steps(mode: str, r: dict, keep: np.ndarray) -> tuple[np.ndarray, str]:
    """Step of each kept record (int64 [N], -1 for dropped ones) and a sentence describing the rule."""
    names = r["names"]
    N = len(keep)
    step = np.full(N, -1, np.int64)
    k = np.flatnonzero(keep)
    if mode == "auto":
        mode = "field" if r["stepfield_N"] is not None else "passes"
    if mode == "field":
        if r["stepfield_N"] is None:
            raise err("--steps-from", f"field: expected a step field ({', '.join(FIELDS['step'])}) in the "
                                      "records, found none")
        step[k] = np.cumsum(_segment_starts(r["stepfield_N"][k])) - 1
        return step, f"one step per value run of {names['step']}"
    if mode == "passes":
        step[k] = steps_by_passes(r["layer_N"][k], r["group_N"][k], r["token_N"][k])
        return step, ("one step per forward pass (the log returning to an earlier layer, a position that "
                      "does not increase, or a request coming back after another)")
    if mode == "group":
        step[k] = r["group_N"][k]
        return step, f"one step per {names['group'] or 'request id'}"
    step[k] = 0
    return step, "one step holds all tokens"


# ---------------------------------------------------------------------------------- dummy blocks
def dummy_rows(r: dict, keep: np.ndarray, step: np.ndarray, sid: np.ndarray, opts: ImportOptions
               ) -> tuple[np.ndarray, list[dict], dict[str, int]]:
    """Rows in dummy blocks (bool [N]), the blocks, and rows per reason. Judged by routing only."""
    lay_id, line = r["layer_N"], r["line_N"]
    lay = np.unique(lay_id, return_inverse=True)[1].reshape(-1)  # dense 0..L-1: keys and counts stay small
    N = len(lay)
    mask = np.zeros(N, bool)
    blocks: list[dict] = []
    per_reason = {"identical_run": 0, "graph_capture": 0}
    k = np.flatnonzero(keep)
    if len(k) == 0:
        return mask, blocks, per_reason
    # identical runs: per layer, file order
    order = k[np.argsort(lay[k], kind="stable")]
    if opts.warmup_min_rows > 0:
        s = np.flatnonzero(_segment_starts(sid[order]) | _segment_starts(lay[order]))
        e = np.append(s[1:], len(order))
        long_runs = np.flatnonzero(e - s >= opts.warmup_min_rows)
        S = int(step[k].max()) + 1
        n_LS = np.bincount(lay[k] * S + step[k])              # rows per (layer, step)
        for j in long_runs:                                   # one iteration per dummy block
            rows = order[s[j]:e[j]]
            # a block that covers whole steps ends at step edges: rows of a step it covers only in
            # part are real rows that happen to repeat the block's set
            key = lay[rows] * S + step[rows]
            u, cnt = np.unique(key, return_counts=True)
            whole = cnt == n_LS[u]
            if whole.any() and not whole.all():
                rows = rows[np.isin(key, u[whole])]
            mask[rows] = True
            per_reason["identical_run"] += len(rows)
            blocks.append({"reason": "identical_run", "layer": int(lay_id[rows[0]]), "first_record": int(line[rows[0]]),
                           "rows": int(len(rows)), "experts": np.sort(r["ids_NK"][rows[0]]).tolist()})
    # graph capture: a whole (layer, step) of power-of-two size with one expert set
    if opts.capture_min_rows > 0:
        S = int(step[k].max()) + 1
        key = lay[k] * S + step[k]
        o = k[np.argsort(key, kind="stable")]
        ko = lay[o] * S + step[o]
        st = np.flatnonzero(_segment_starts(ko))
        n = np.diff(np.append(st, len(o)))
        smin = np.minimum.reduceat(sid[o], st)
        smax = np.maximum.reduceat(sid[o], st)
        pow2 = (n & (n - 1)) == 0
        hit = np.flatnonzero((smin == smax) & pow2 & (n >= opts.capture_min_rows))
        for j in hit:                                         # one iteration per dummy block
            rows = o[st[j]:st[j] + n[j]]
            fresh = ~mask[rows]
            if not fresh.any():
                continue
            mask[rows] = True
            per_reason["graph_capture"] += int(fresh.sum())
            blocks.append({"reason": "graph_capture", "layer": int(lay_id[rows[0]]), "first_record": int(line[rows[0]]),
                           "rows": int(len(rows)), "step": int(step[rows[0]]),
                           "experts": np.sort(r["ids_NK"][rows[0]]).tolist()})
    blocks.sort(key=lambda b: b["first_record"])
    return mask, blocks, per_reason


# ---------------------------------------------------------------------------------- import
def load_records(path: Path, fmt: str, opts: ImportOptions) -> Imported:
    where = str(path)
    r = parse_records(path)
    names, meta_line = r["names"], r["meta"] or {}
    ids, lay, tok, grp = r["ids_NK"], r["layer_N"], r["token_N"], r["group_N"]
    N, K = ids.shape
    report: dict[str, Any] = {"format": fmt, "records": int(N), "fields": {k: v for k, v in names.items() if v}}
    if r["ignored"]:
        report["fields_ignored"] = r["ignored"]
    if r["skipped"]:
        report["non_route_records_skipped"] = r["skipped"]
    E, inferred, logged = _check_against_meta(where, r, meta_line, opts, report)
    w = r["w_NK"] = _checked_weights(where, r, report)
    keep = np.ones(N, bool)
    # -- exact repeats of the previous record of the same layer
    order = np.argsort(lay, kind="stable")
    rep = np.zeros(N, bool)
    a, b = order[:-1], order[1:]
    rep[b] = ((lay[a] == lay[b]) & (grp[a] == grp[b]) & (tok[a] == tok[b]) & (ids[a] == ids[b]).all(axis=1)
              & (np.abs(w[a] - w[b]) <= 1e-6).all(axis=1))
    if r["stepfield_N"] is not None:
        rep[b] &= r["stepfield_N"][a] == r["stepfield_N"][b]
    keep &= ~rep
    n_dup = int(rep.sum())
    # -- steps, then dummy blocks
    step, steps_rule = assign_steps(opts.steps_from, r, keep)
    tkey = _drop_dummy_tokens(r, keep, step, opts, report)
    report["duplicate_records_dropped"] = n_dup + _drop_step_duplicates(where, r, keep, tkey)
    # -- tokens missing layers: kept at the layers they have (a per-layer token mask), or dropped
    layer_ids = [int(x) for x in logged] if logged is not None else (
        sorted(int(x) for x in np.unique(lay[keep])) if keep.any() else [])
    if not layer_ids:
        raise err(where, "expected route records after dropping dummy blocks and duplicates, found none")
    tensors, step_T, n_incomplete, drop = _token_tensors(where, r, keep, tkey, step, layer_ids, opts, report)
    ids_LTK, T, L = tensors["topk_ids"], tensors["topk_ids"].shape[1], len(layer_ids)
    S = int(step_T.max()) + 1
    steps = f"{steps_rule}: {S} step(s), tokens ordered by step, request, {names['token']}"
    report["tokens"], report["layers"], report["steps"] = T, L, S
    if n_incomplete > T - n_incomplete:
        report.setdefault("warnings", []).append(
            f"{n_incomplete} tokens miss some layers (more than the {T - n_incomplete} complete ones): the step "
            "rule may split passes wrongly; try --steps-from group or none")
    report.setdefault("warnings", []).extend(
        sanity_warnings(ids_LTK, step_T, E, layer_ids, opts.dominant_share,
                        tensors.get("token_mask") if n_incomplete and not drop else None))
    if not report["warnings"]:
        del report["warnings"]
    src_model = meta_line.get("model_id") or meta_line.get("model")
    meta = TraceMeta(kind="tokens", num_experts=E, top_k=K, layer_ids=layer_ids, num_tokens=T, steps=steps,
                     source=f"imported from {path.name} ({fmt})" + (f"; model {src_model}" if src_model else ""),
                     attribution=attribution(path), import_report=report, num_experts_inferred=inferred,
                     **model_meta(opts.model))
    return Imported(meta, tensors)


def _check_against_meta(where: str, r: dict, meta_line: dict, opts: ImportOptions,
                        report: dict[str, Any]) -> tuple[int, Any, list | None]:
    """(E, whether it was inferred, the meta's layers_logged or None): the records' ids, positions
    and layers checked, and checked against the meta record."""
    names, ids, lay, tok, line = r["names"], r["ids_NK"], r["layer_N"], r["token_N"], r["line_N"]
    K = ids.shape[1]
    E, inferred = resolve_experts(where, opts, meta_line.get("num_experts"), ids, report)
    mk = meta_line.get("top_k")
    if mk is not None and not is_int(mk):
        raise err(where, f"meta top_k: expected an integer, found {json.dumps(mk)[:40]}")
    if mk is not None and mk != K:
        raise err(where, f"record {line[0]}: {names['ids']}: expected {mk} ids (meta top_k), found {K}: "
                         "metadata contradicts the records")
    check_top_k(where, K, opts)
    bad = find_bad_token(ids, E)
    if bad is not None:
        i = bad[1]
        expected = f"ids in [0, {E})" if bad[0] == "range" else "distinct experts"
        raise err(where, f"record {line[i]}: {names['ids']}: expected {expected}, found {ids[i].tolist()}")
    for arr, role in ((tok, "token"), (lay, "layer")):
        if (arr < 0).any():
            i = first_true(arr < 0)
            raise err(where, f"record {line[i]}: {names[role]}: expected >= 0, found {int(arr[i])}")
    if (lay >= 1 << 31).any():  # layer ids are 32-bit in a trace
        i = first_true(lay >= 1 << 31)
        raise err(where, f"record {line[i]}: {names['layer']}: expected a layer id < 2^31, found {int(lay[i])}")
    logged = meta_line.get("layers_logged")
    if logged is not None and (not isinstance(logged, list) or not logged
                               or not all(is_int(x) and 0 <= x < 1 << 31 for x in logged)):
        raise err(where, f"meta layers_logged: expected a non-empty list of layer ids, found {json.dumps(logged)[:60]}")
    if logged is not None:
        extra = ~np.isin(lay, np.asarray(logged, np.int64))
        if extra.any():
            i = first_true(extra)
            raise err(where, f"record {line[i]}: {names['layer']}: expected one of meta layers_logged "
                             f"{logged}, found {int(lay[i])}: metadata contradicts the records")
    return E, inferred, logged


def _checked_weights(where: str, r: dict, report: dict[str, Any]) -> np.ndarray:
    """The records' weights, finite and >= 0 (1/K each where the log has none, said in the report)."""
    w, ids, line, names = r["w_NK"], r["ids_NK"], r["line_N"], r["names"]
    if w is None:
        report["weights"] = "absent in the source: set to 1/K"
        return np.full(ids.shape, 1.0 / ids.shape[1])
    fin = np.isfinite(w).all(axis=1)
    if not fin.all():
        i = first_true(~fin)
        raise err(where, f"record {line[i]}: {names['weights']}: expected finite numbers, found {w[i].tolist()}")
    neg = (w < 0).any(axis=1)
    if neg.any():
        i = first_true(neg)
        raise err(where, f"record {line[i]}: {names['weights']}: expected >= 0, found {w[i].tolist()}")
    return w


def _drop_dummy_tokens(r: dict, keep: np.ndarray, step: np.ndarray, opts: ImportOptions,
                       report: dict[str, Any]) -> np.ndarray:
    """Each record's token key (one id per (step, request, position)); the tokens of dummy blocks
    dropped from ``keep`` (in place) and counted in the report."""
    ids, grp, tok = r["ids_NK"], r["group_N"], r["token_N"]
    dmask, blocks, per_reason = dummy_rows(r, keep, step, set_ids(ids), opts)
    G = int(grp.max()) + 1
    Tm = int(tok.max()) + 1
    S = int(step.max()) + 2
    if S * G * Tm < 2 ** 62:
        tkey = (step * G + grp) * Tm + tok                   # one id per (step, request, position)
    else:
        _, tkey = np.unique(np.stack([step, grp, tok], 1), axis=0, return_inverse=True)
        tkey = tkey.reshape(-1)
    if dmask.any():
        # a token is a dummy when every layer it has is in a dummy block (warm-up and capture passes
        # repeat one set at every layer); a real token that repeats a block's set at one layer by chance
        # stays
        _, tinv = np.unique(tkey[keep], return_inverse=True)
        rows_per_tok = np.bincount(tinv)
        dummy_per_tok = np.bincount(tinv, weights=dmask[keep], minlength=len(rows_per_tok))
        dummy_tok = np.zeros(ids.shape[0], bool)
        dummy_tok[keep] = (dummy_per_tok == rows_per_tok)[tinv]
        keep &= ~dummy_tok
        report["dummy_records_dropped"] = int(dummy_tok.sum())
    else:
        report["dummy_records_dropped"] = 0
    report["dummy_rows_by_reason"] = per_reason
    report["dummy_blocks_total"] = len(blocks)
    report["dummy_blocks"] = blocks[:MAX_BLOCKS_LISTED]
    return tkey


def _drop_step_duplicates(where: str, r: dict, keep: np.ndarray, tkey: np.ndarray) -> int:
    """Records repeating an earlier one's (step, request, position, layer): dropped from ``keep``
    (in place) when equal, an error naming both when they differ. Returns how many were dropped."""
    ids, w, lay, line, names = r["ids_NK"], r["w_NK"], r["layer_N"], r["line_N"], r["names"]
    k = np.flatnonzero(keep)
    o = k[np.lexsort((line[k], lay[k], tkey[k]))]
    same_key = (tkey[o][1:] == tkey[o][:-1]) & (lay[o][1:] == lay[o][:-1])
    if not same_key.any():
        return 0
    a, b = o[:-1][same_key], o[1:][same_key]              # b repeats a (a earlier in the file)
    differ = (ids[a] != ids[b]).any(axis=1) | (np.abs(w[a] - w[b]) > 1e-6).any(axis=1)
    if differ.any():
        j = first_true(differ)
        raise err(where, f"record {line[b[j]]}: {names['ids']}: expected a duplicate of record {line[a[j]]} "
                         f"(same step, token and layer) to match it, found experts {ids[b[j]].tolist()} "
                         f"vs {ids[a[j]].tolist()}")
    keep[b] = False
    return len(b)


def _token_tensors(where: str, r: dict, keep: np.ndarray, tkey: np.ndarray, step: np.ndarray, layer_ids: list[int],
                   opts: ImportOptions, report: dict[str, Any]) -> tuple[dict[str, np.ndarray], np.ndarray, int, bool]:
    """(the trace's tensors -- ``topk_ids`` [L, T, K], ``topk_weights``, ``step``, ``token_mask``
    where tokens miss layers --, each token's step (int64 [T]), the tokens missing layers, whether
    they were dropped). Tokens missing layers are kept at the layers they
    have under the mask, or dropped (``incomplete_tokens="drop"``), counted in the report."""
    ids, w, lay = r["ids_NK"], r["w_NK"], r["layer_N"]
    K, L = ids.shape[1], len(layer_ids)
    uk, tinv = np.unique(tkey[keep], return_inverse=True)
    per_tok = np.bincount(tinv, minlength=len(uk))
    complete = per_tok == L
    n_incomplete = int((~complete).sum())
    if n_incomplete:
        report["tokens_missing_layers"] = n_incomplete
    drop = opts.incomplete_tokens == "drop"
    report["tokens_missing_layers_dropped"] = n_incomplete if drop else 0
    report["records_of_incomplete_tokens_dropped"] = int(per_tok[~complete].sum()) if drop else 0
    if drop:
        kidx = np.flatnonzero(keep)
        keep[kidx[~complete[tinv]]] = False
        if not keep.any():
            raise err(where, f"expected at least one token with all {L} layers, found none")
        uk, tinv = np.unique(tkey[keep], return_inverse=True)  # token order: (step, request, position)
    T = len(uk)
    li = np.searchsorted(np.asarray(layer_ids), lay[keep])
    # rows a token lacks hold filler (experts 0..K-1, weight 0) under a mask of 0: never read as routing
    ids_LTK = np.broadcast_to(np.arange(K, dtype=np.int64), (L, T, K)).copy()
    w_LTK = np.zeros((L, T, K), np.float32)
    ids_LTK[li, tinv] = ids[keep]
    w_LTK[li, tinv] = w[keep]
    mask_LT = np.zeros((L, T), np.uint8)
    mask_LT[li, tinv] = 1
    step_T = np.empty(T, np.int64)
    step_T[tinv] = step[keep]
    _, step_T = np.unique(step_T, return_inverse=True)        # dense 0..S-1, order kept
    step_T = step_T.reshape(-1)
    tensors = {"topk_ids": ids_LTK, "topk_weights": w_LTK, "step": step_T.astype(np.int32)}
    if not drop and n_incomplete:
        tensors["token_mask"] = mask_LT
        missing = int(L * T - mask_LT.sum())
        report.setdefault("warnings", []).append(
            f"{n_incomplete} of {T} tokens miss some of the {L} layers ({missing} (token, layer) rows absent): each "
            "is kept at the layers it has (a per-layer token mask); --drop-incomplete-tokens drops them instead")
    return tensors, step_T, n_incomplete, drop
