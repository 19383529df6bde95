"""Steps of a trace: which tokens form one batch as a dispatch sees it, and selecting some of them.

Notation: T tokens, S steps, K top-k.

A token-level trace may carry ``step`` (int [T], non-decreasing, dense 0..S-1: importers keep one
step per forward pass where the source shows them, see ``importers``); without it every token is in
step 0. Steps are contiguous token ranges, so a selection of steps is a list of token ranges and
reading it never copies more than the selected tokens.

Selection grammar (``--steps``): ``all``, ``N``, ``A-B`` (inclusive), ``A-`` (A to the last step),
and comma-separated lists of those (``0,2,5-7``). Step numbers are the trace's (0-based).

How the selected steps are costed (:class:`StepMode`, :func:`parse_step_mode`): by default each
selected step is its own batch (what a dispatch saw), and results aggregate over steps;
``merged`` (or ``merged:SEL``) concatenates the selected steps into one batch that never ran as
such -- an explicit choice, reported with a warning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from moonep_sim.errors import ConfigError, TraceFormatError
from moonep_sim.routing.trace import LayerRouting, Trace

_PART = re.compile(r"^\s*(\d+)\s*(?:(-)\s*(\d+)?)?\s*$")


@dataclass(frozen=True)
class StepSelection:
    """Selected steps as inclusive ranges ``(first, last)``; ``last`` None = to the last step.

    text: the selection as the user wrote it (for messages and reports).
    """

    ranges: tuple[tuple[int, int | None], ...]
    text: str

    def steps(self, num_steps: int) -> np.ndarray:
        """Selected step ids, int64 sorted and distinct, checked against ``num_steps`` (S)."""
        out = []
        for a, b in self.ranges:
            last = num_steps - 1 if b is None else b
            if a > num_steps - 1 or last > num_steps - 1:
                raise ConfigError(f"--steps ({self.text}) must select steps of the trace: it has {num_steps} "
                                  f"step(s), 0-{num_steps - 1}")
            out.append(np.arange(a, last + 1, dtype=np.int64))
        return np.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)


def parse_steps(text: "str | StepSelection | None") -> StepSelection | None:
    """``--steps`` text -> a :class:`StepSelection`; None or ``all`` -> None (every token)."""
    if text is None or isinstance(text, StepSelection):
        return text
    if text.strip().lower() in ("", "all"):
        return None
    ranges = []
    for part in text.split(","):
        m = _PART.match(part)
        if not m:
            raise ConfigError(f"--steps ({text!r}) must be step numbers and ranges like 10-20, 0,2,5-7 or 10-")
        a = int(m.group(1))
        if m.group(2) is None:
            b: int | None = a
        else:
            b = int(m.group(3)) if m.group(3) is not None else None
        if b is not None and b < a:
            raise ConfigError(f"--steps ({text!r}) must give ranges first-last with first <= last, found {a}-{b}")
        ranges.append((a, b))
    return StepSelection(tuple(ranges), text.strip())


@dataclass(frozen=True)
class StepMode:
    """Which steps, and whether each is its own batch (``merged`` False, the default) or all of
    them one concatenated batch (``merged`` True). selection: None = every step.  text: as given."""

    selection: StepSelection | None = None
    merged: bool = False
    text: str = "each"


def parse_step_mode(text: "str | StepMode | StepSelection | None") -> StepMode:
    """``--steps`` text -> a :class:`StepMode`: None / ``all`` / ``each`` (every step, each its own
    batch), ``SEL`` (those steps, each its own batch), ``merged`` (every token as one batch),
    ``merged:SEL`` (those steps' tokens as one batch)."""
    if isinstance(text, StepMode):
        return text
    if isinstance(text, StepSelection):
        return StepMode(text, False, text.text)
    if text is None:
        return StepMode()
    t = str(text).strip()
    head, sep, rest = t.partition(":")
    if head.strip().lower() == "merged":
        if sep and not rest.strip():
            raise ConfigError(f"--steps ({text!r}) must give steps after merged:, e.g. merged:0-9 (or merged alone)")
        return StepMode(parse_steps(rest) if sep else None, True, t)
    if t.lower() in ("", "all", "each"):
        return StepMode(None, False, t or "each")
    return StepMode(parse_steps(t), False, t)


def step_batches(step_T: "np.ndarray | None", num_tokens: int,
                 mode: "str | StepMode | None") -> list[tuple[int | None, list[tuple[int, int]]]]:
    """The batches a command costs: ``[(step id, token ranges)]``, one per selected step (step id
    None for a ``merged`` batch, which holds the ranges of every selected step). A trace without
    steps is one batch, step 0."""
    m = parse_step_mode(mode)
    if m.merged:
        return [(None, token_ranges(step_T, num_tokens, m.selection))]
    b = step_bounds(step_T, num_tokens)
    chosen = m.selection.steps(len(b) - 1) if m.selection is not None else np.arange(len(b) - 1)
    return [(int(s), [(int(b[s]), int(b[s + 1]))]) for s in chosen.tolist()]   # one iteration per step


def step_bounds(step_T: np.ndarray | None, num_tokens: int) -> np.ndarray:
    """Token offsets of each step, int64 [S+1]: step s holds tokens ``[b[s], b[s+1])``."""
    if step_T is None or num_tokens == 0:
        return np.array([0, num_tokens], np.int64)
    step_T = np.asarray(step_T, np.int64)
    if step_T.shape != (num_tokens,) or step_T[0] < 0 or (np.diff(step_T) < 0).any():
        raise TraceFormatError(f"step: expected non-decreasing step ids >= 0 of shape [{num_tokens}], "
                               f"found shape {list(step_T.shape)}")
    S = int(step_T[-1]) + 1
    return np.searchsorted(step_T, np.arange(S + 1), side="left").astype(np.int64)


def token_ranges(step_T: np.ndarray | None, num_tokens: int,
                 steps: "str | StepSelection | None") -> list[tuple[int, int]]:
    """Token ranges ``[start, stop)`` of the selected steps (merged where adjacent, in order)."""
    sel = parse_steps(steps)
    if sel is None:
        return [(0, num_tokens)]
    b = step_bounds(step_T, num_tokens)
    chosen = sel.steps(len(b) - 1)
    out: list[tuple[int, int]] = []
    for s in chosen.tolist():      # one iteration per selected step, not per token
        lo, hi = int(b[s]), int(b[s + 1])
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def token_index(step_T: np.ndarray | None, num_tokens: int, steps: "str | StepSelection | None") -> np.ndarray:
    """Indices of the tokens of the selected steps, int64 [T'] ascending."""
    rs = token_ranges(step_T, num_tokens, steps)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in rs]) if rs else np.zeros(0, np.int64)


def select_layer(layer: LayerRouting, step_T: np.ndarray | None, steps: "str | StepSelection | None") -> LayerRouting:
    """The tokens of ``layer`` that belong to the selected steps (``step_T``: [T] of that routing)."""
    if parse_steps(steps) is None:
        return layer
    idx = token_index(step_T, layer.num_tokens, steps)
    return LayerRouting(layer.topk_ids_TK[idx], layer.topk_weights_TK[idx], layer.num_experts, layer.layer)


def read_layer(trace: "Trace | str", index: int, steps: "str | StepSelection | None" = None,
               ranges: "list[tuple[int, int]] | None" = None) -> LayerRouting:
    """Routing of the ``index``-th stored layer of ``trace``, only the tokens of the selected steps
    (reads those token ranges only). ``steps``: ``--steps`` text, a StepSelection, or None (all);
    ``ranges``: token ranges to read instead (one batch of :func:`step_batches`)."""
    tr = trace if isinstance(trace, Trace) else Trace(trace)
    T = tr.meta.num_tokens or 0
    if ranges is None and parse_steps(steps) is None:
        return tr.layer(index)
    parts = [tr.layer(index, a, b) for a, b in (ranges if ranges is not None else token_ranges(tr.steps(), T, steps))]
    if len(parts) == 1:
        return parts[0]
    return LayerRouting(np.concatenate([p.topk_ids_TK for p in parts]),
                        np.concatenate([p.topk_weights_TK for p in parts]), tr.meta.num_experts,
                        tr.meta.layer_ids[index])


def selected_steps_T(trace: "Trace | str", steps: "str | StepSelection | None" = None) -> np.ndarray:
    """The step id of each selected token, int64 [T'] (what ``read_layer`` returns rows for)."""
    tr = trace if isinstance(trace, Trace) else Trace(trace)
    st = tr.steps()
    idx = token_index(st, tr.meta.num_tokens or 0, steps)
    return np.zeros(idx.size, np.int64) if st is None else st[idx]
