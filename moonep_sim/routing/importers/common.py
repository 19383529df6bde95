"""What every importer shares: options, the result type, field-name aliases, one-line errors, the
expert-count and top-k resolution, attribution lookup, and the post-import sanity pass.

Notation: L layers, T tokens, K top-k, E experts, S steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moonep_sim.errors import TraceFormatError, is_int
from moonep_sim.limits import MAX_NUM_EXPERTS, MAX_TOP_K
from moonep_sim.routing.metrics import per_step_maxvio, step_expert_counts
from moonep_sim.routing.trace import TraceMeta

# role -> accepted field names of record logs, first match wins (decided on the first route record).
FIELDS: dict[str, tuple[str, ...]] = {
    "step": ("step", "step_id", "forward_id", "forward_pass", "iter", "iteration", "batch", "batch_id",
             "batch_idx"),
    "group": ("problem_id", "req_id", "request_id", "seq_id", "sequence_id", "seq_idx"),
    "token": ("token_idx", "token_pos", "position", "pos", "token_index", "token", "token_id"),
    "layer": ("layer", "layer_idx", "layer_id", "layer_index"),
    "ids": ("experts", "topk_ids", "expert_ids", "selected_experts", "topk_indices", "ids"),
    "weights": ("gating_probs", "topk_weights", "weights", "scores", "probs", "gates", "routing_weights"),
}
ROLE_MEANING = {
    "step": "forward pass / batch number: a new step where its value changes (overrides the step rules)",
    "group": "request / sequence id (constant ids are fine: a batch-level hook)",
    "token": "position of the row (in its request, or in its forward pass: may restart every pass)",
    "layer": "model layer id",
    "ids": "top-k expert ids (a list of K integers)",
    "weights": "top-k routing weights (a list of K numbers; renormalised or not); absent: 1/K",
}
REQUIRED_ROLES = ("token", "layer", "ids")
# fields a record log may carry that mean nothing for routing but are not worth listing
QUIET_FIELDS = frozenset({"type"})


def fields_markdown() -> str:
    """The docs' field-name table of the record-log formats."""
    rows = ["| role | accepted names (first match wins) | required | meaning |", "| --- | --- | --- | --- |"]
    for role, names in FIELDS.items():
        rows.append(f"| {role} | {', '.join(f'`{n}`' for n in names)} | "
                    f"{'yes' if role in REQUIRED_ROLES else 'no'} | {ROLE_MEANING[role]} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class ImportOptions:
    """Options of every importer (each uses those that apply to its format).

    model: a preset name, a model file, or a ModelSpec (its E and K must agree with the file).
    num_experts / top_k: E and K given on the command line (must agree with the file).
    warmup_min_rows: shortest run of rows of one layer with one identical expert set that is
        dropped as a dummy block, whatever its weights (0 disables it).
    capture_min_rows: shortest power-of-two step whose rows of a layer all carry one expert set
        that is dropped as a graph-capture block (0 disables it).
    steps_from: ``auto`` (a step field if present, else forward passes), ``field``, ``passes``,
        ``group`` (one step per request id) or ``none`` (one step).
    dominant_share: the sanity pass warns when one expert set holds more than this share of a
        layer's kept rows.
    incomplete_tokens: ``keep`` (a token missing some layers keeps the layers it has, under a
        per-layer token mask) or ``drop`` (such tokens are dropped at every layer).
    """

    model: Any = None
    num_experts: int | None = None
    top_k: int | None = None
    warmup_min_rows: int = 64
    capture_min_rows: int = 8
    steps_from: str = "auto"
    dominant_share: float = 0.3
    incomplete_tokens: str = "keep"


STEPS_FROM = ("auto", "field", "passes", "group", "none")


@dataclass
class Imported:
    """What an importer produced: trace metadata and tensors (see ``trace.py``)."""

    meta: TraceMeta
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


def err(where: str, msg: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: {msg}")


def load_json(where: str, data: bytes | str, what: str = "JSON") -> Any:
    """``json.loads`` with every failure (invalid, not UTF-8, nested too deep) as one line."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        pos = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise err(where, f"expected {what}, found invalid JSON{pos} ({getattr(e, 'msg', e)}; truncated?)") from None
    except RecursionError:
        raise err(where, f"expected {what}, found JSON nested too deep to parse") from None


def check_sizes(opts: "ImportOptions") -> None:
    """--num-experts and --top-k in range (before the file is read)."""
    if opts.num_experts is not None and (not is_int(opts.num_experts)
                                         or not 1 <= opts.num_experts <= MAX_NUM_EXPERTS):
        raise TraceFormatError(f"--num-experts ({opts.num_experts}) must be an integer in [1, {MAX_NUM_EXPERTS}]")
    if opts.top_k is not None and (not is_int(opts.top_k) or not 1 <= opts.top_k <= MAX_TOP_K):
        raise TraceFormatError(f"--top-k ({opts.top_k}) must be an integer in [1, {MAX_TOP_K}]")


def first_true(mask_N: np.ndarray) -> int:
    return int(np.argmax(mask_N))


def pick(rec: dict, role: str) -> str | None:
    """The first of ``role``'s accepted field names that ``rec`` holds (None: none)."""
    return next((name for name in FIELDS[role] if name in rec), None)


def attribution(src: Path) -> str:
    """The SOURCES.md table row describing ``src``, when one sits next to it."""
    sources = src.parent / "SOURCES.md"
    if sources.is_file():
        for line in sources.read_text(errors="replace").splitlines():
            if line.startswith(f"| {src.name} |"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                return " | ".join(cells[1:])
    return ""


def model_of(opts: ImportOptions):
    """The ModelSpec of ``opts.model`` (None when none was given)."""
    if opts.model is None:
        return None
    from moonep_sim.models import resolve_model
    return resolve_model(opts.model)


def resolve_experts(where: str, opts: ImportOptions, in_file: Any, ids: np.ndarray | None,
                    report: dict) -> tuple[int, bool]:
    """E from the command line, the file's metadata and the model (must agree), else inferred from
    the largest id (with a warning). Returns (E, inferred)."""
    given = []
    if opts.num_experts is not None:
        given.append(("--num-experts", int(opts.num_experts)))
    if in_file is not None:
        if not is_int(in_file) or not 1 <= in_file <= MAX_NUM_EXPERTS:
            raise err(where, f"metadata: num_experts: expected an integer in [1, {MAX_NUM_EXPERTS}] (the largest "
                             f"expert count moonep-sim handles), found {in_file!r}")
        given.append(("the file's num_experts", in_file))
    m = model_of(opts)
    if m is not None:
        given.append((f"model {m.name}", m.num_experts))
    for name, v in given[1:]:
        if v != given[0][1]:
            raise err(where, f"num_experts: expected {given[0][1]} ({given[0][0]}), found {v} ({name}): "
                             "metadata contradicts")
    if given:
        return given[0][1], False
    if ids is None or ids.size == 0:
        raise err(where, "num_experts: expected --num-experts or --model, found neither")
    E = max(int(ids.max()) + 1, 1)
    if E > MAX_NUM_EXPERTS:
        raise err(where, f"expert id ({E - 1}) must be < {MAX_NUM_EXPERTS} (the largest expert count moonep-sim "
                         "handles): the expert count would be inferred from it")
    report["num_experts"] = f"inferred from the largest id: {E}"
    report.setdefault("warnings", []).append(
        f"num_experts inferred as {E} from the largest expert id: if the model has more experts, every load "
        "figure is off; pass --num-experts or --model")
    return E, True


def check_top_k(where: str, K: int, opts: ImportOptions) -> None:
    if opts.top_k is not None and opts.top_k != K:
        raise err(where, f"top_k: expected {opts.top_k} (--top-k), found {K} ids per token")
    m = model_of(opts)
    if m is not None and m.top_k != K:
        raise err(where, f"top_k: expected {m.top_k} (model {m.name}), found {K} ids per token")


# ---------------------------------------------------------------------------------- sanity pass
def set_ids(ids_NK: np.ndarray) -> np.ndarray:
    """One integer per distinct (sorted) expert set, int64 [N] (equal sets, equal integers)."""
    if ids_NK.shape[0] == 0:
        return np.zeros(0, np.int64)
    s = np.sort(ids_NK, axis=1)
    E = int(s.max()) + 1
    K = s.shape[1]
    if K * np.log2(max(E, 2)) < 62:       # one integer per set: base-E digits
        return (s * (E ** np.arange(K - 1, -1, -1, dtype=np.int64))).sum(axis=1)
    _, inv = np.unique(s, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64)


def sanity_warnings(ids_LTK: np.ndarray, step_T: np.ndarray | None, num_experts: int, layer_ids: list[int],
                    dominant_share: float, mask_LT: np.ndarray | None = None) -> list[str]:
    """Warnings about kept rows that look like dummy traffic left in:

    - one expert set holding more than ``max(dominant_share, 4 / C(E, K))`` of a layer's rows (real
      routing spreads over many sets; warm-up and graph-capture blocks repeat one);
    - a layer whose maxvio in one step is far from its other steps (``> 3 * median + 1``, over the
      steps with at least 16 expected selections per expert, so small decode steps are not judged).

    mask_LT: the per-layer token mask (rows under 0 are filler, not judged); None = every row.
    """
    out: list[str] = []
    L, T, K = ids_LTK.shape
    if T == 0:
        return out
    from math import comb
    share = max(dominant_share, min(1.0, 4.0 / comb(num_experts, K)))   # >= 4x a uniform set's share
    rows = (lambda li: slice(None)) if mask_LT is None else (lambda li: mask_LT[li].astype(bool))
    for li in range(L):
        sid = set_ids(ids_LTK[li][rows(li)])
        if sid.size == 0:
            continue
        top = np.unique(sid, return_counts=True)[1].max() / sid.size
        if top > share and sid.size >= 32:
            out.append(f"layer {layer_ids[li]}: one expert set holds {top:.0%} of the kept rows (more than "
                       f"{share:.0%}): dummy rows (warm-up, profiling, graph capture) may be left in")
            break
    if step_T is not None and T:
        S = int(step_T.max()) + 1
        for li in range(L):
            st_l, ids_l = step_T[rows(li)], ids_LTK[li][rows(li)]
            n_S = np.bincount(st_l, minlength=S)
            mv_S = per_step_maxvio(*step_expert_counts(st_l, ids_l, num_experts), n_S, K, num_experts)
            ok = n_S * K / num_experts >= 16
            if ok.sum() < 3:
                continue
            med = float(np.median(mv_S[ok]))
            worst = int(np.flatnonzero(ok)[np.argmax(mv_S[ok])])
            if mv_S[worst] > 3 * med + 1.0:
                out.append(f"layer {layer_ids[li]}: step {worst} has maxvio {mv_S[worst]:.2f} where the median "
                           f"step has {med:.2f}: a dummy or unusual block may be left in")
                break
    return out
