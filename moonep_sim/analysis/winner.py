"""Winner maps: over two knobs, the fastest strategy of every cell and its margin over the runner-up.

Input: sweep reports (what :func:`moonep_sim.experiments.sweep.sweep` returns), one per value of a
second knob (rows, y), each sweeping the first knob (columns, x); :meth:`Scenario.winner_map
<moonep_sim.experiments.Scenario.winner_map>` runs them. Output: a map dict (JSON-ready) that
:mod:`moonep_sim.report.winner` renders as a heat map and a table.

A strategy that dropped entries at a point did less work than the dropless ones: it is listed
with its time but never wins that cell (``dropped`` in the cell says who was left out). At step
level (sweep reports with ``level: "step"``, :mod:`moonep_sim.experiments.step_levels`) a cell is
timed by the step time, and a strategy that runs out of memory ranks behind every one that fits
(``oom`` in the cell), as the step verdict orders them; each cell then carries every strategy's
step figures (``step``: step time, exposed communication, peak memory, OOM).

Notation: X columns (first knob's values), Y rows (second knob's values).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from moonep_sim.analysis.verdict import TIE  # strategies within it of the winner share a cell
from moonep_sim.errors import require

#: the step figures a step-level cell keeps per strategy
_STEP_CELL = ("step_time_us", "exposed_comm_us", "peak_memory_bytes", "gpu_memory_bytes", "oom")


def cell(times_us: dict[str, float], dropped: dict[str, int] | None = None,
         oom: dict[str, bool] | None = None) -> dict[str, Any]:
    """The winner of one cell: fastest dropless strategy, the runner-up and the margin
    (runner-up time / winner time - 1; 0 when only one strategy competes). Strategies within
    ``TIE`` of the winner are listed in ``tied`` (the winner is the lowest time, then the name), and
    the runner-up is then the fastest strategy outside the tie. With ``oom`` (step level), the
    strategies that fit in memory come first, then those that do not (``oom`` lists them)."""
    dropped = dropped or {}
    live = [(t, n) for n, t in times_us.items() if not dropped.get(n) and np.isfinite(t)]
    fit = sorted(x for x in live if not (oom or {}).get(x[1]))
    ok = fit + sorted(x for x in live if (oom or {}).get(x[1])) if fit else sorted(live)
    require(len(ok) >= 1, "a winner-map cell needs at least one dropless strategy")
    (t1, n1) = ok[0]
    tied = [n for t, n in (fit or ok) if t <= t1 * (1 + TIE)]
    rest = ok[len(tied):] if len(tied) > 1 else ok[1:]
    t2, n2 = rest[0] if rest else (t1, None)
    out = {"winner": n1, "time_us": float(t1), "runner_up": n2, "runner_up_us": float(t2),
           "margin": float(t2 / t1 - 1.0) if t1 > 0 else 0.0, "tied": tied if len(tied) > 1 else [],
           "times_us": {n: float(t) for n, t in times_us.items()},
           "dropped": sorted(n for n in times_us if dropped.get(n))}
    if oom is not None:
        out["oom"] = sorted(n for n in times_us if oom.get(n))
    return out


def winner_map(reports: Sequence[tuple[float, dict[str, Any]]], y_knob: str) -> dict[str, Any]:
    """Map dict from ``[(y value, sweep report)]``; every report sweeps the same x knob and values."""
    require(len(reports) >= 1, "a winner map needs at least one sweep")
    x_knob = reports[0][1]["over"]
    xs = list(reports[0][1]["values"])
    rows = []
    for y, rep in reports:
        require(rep["over"] == x_knob and list(rep["values"]) == xs,
                f"sweep at {y_knob}={y} must sweep {x_knob} over {xs} like the first")
        st = rep["strategies"]
        verdicts = rep.get("verdicts") or [None] * len(xs)
        step = rep.get("level") == "step"
        row = []
        for i in range(len(xs)):
            if step:   # a step sweep: the step time; OOM ranks last, as in the step verdict
                c = cell({n: float(s["step_time_us"][i]) for n, s in st.items()}, None,
                         {n: bool(s["oom"][i]) for n, s in st.items()})
                c["step"] = {n: {k: s[k][i] for k in _STEP_CELL} for n, s in st.items()}
                c["verdict"] = verdicts[i]
                row.append(c)
                continue
            # over several seeds: the mean time (rep["mean_layer_time_us"]), and a tie within their spread
            times = rep.get("mean_layer_time_us") or {n: s["layer_time_us"] for n, s in st.items()}
            c = cell({n: times[n][i] for n in st}, {n: int(s["dropped"][i]) for n, s in st.items()})
            v = c["verdict"] = verdicts[i]  # winner, margin, tie, confidence, mechanism, why
            if v and v.get("tie") and v["winner"] == c["winner"] and not c["tied"]:
                c["tied"] = [v["winner"], *v.get("tied_with", [])]
            row.append(c)
        rows.append(row)
    first = reports[0][1]
    extra = {"level": "step", "step": first.get("step")} if first.get("level") == "step" else {}
    return {**extra, "kind": "winner_map", "x": {"knob": x_knob, "values": [float(v) for v in xs]},
            "y": {"knob": y_knob, "values": [float(y) for y, _ in reports]},
            "strategies": list(first["strategies"]), "model": first.get("model", {}).get("name"),
            "topology": first.get("topology", {}).get("name"), "cluster": first.get("cluster"),
            "cells": rows, "flags": dedup_flags([f for _, r in reports for f in r.get("flags") or []])}


def dedup_flags(flags: list[dict[str, Any]], key: Sequence[str] = ("code", "strategy")) -> list[dict[str, Any]]:
    """The flags of every sweep (or cluster), each ``key`` (default: code and strategy) once."""
    seen, out = set(), []
    for f in flags:
        k = tuple(f.get(x) for x in key)
        if k not in seen:
            seen.add(k)
            out.append(f)
    return out


__all__ = ["TIE", "cell", "dedup_flags", "winner_map"]
