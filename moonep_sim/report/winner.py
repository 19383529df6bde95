"""Winner maps: over two knobs, the fastest strategy of every cell and its margin over the runner-up.

Input: sweep reports (the dicts :mod:`moonep_sim.experiments.sweep` builds), one per value of the second
knob (rows, y), each sweeping the first knob (columns, x). Output: a map dict (JSON-ready), a
heat map PNG (cell colour = the winner, label = winner and its margin) and a Markdown table.

A strategy that dropped entries at a point did less work than the dropless ones: it is listed
with its time but never wins that cell (``dropped`` in the cell says who was left out).

Notation: X columns (first knob's values), Y rows (second knob's values).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import require

# fixed colours per strategy so maps of different runs read alike (others cycle through tab20)
STRATEGY_COLORS = {"costaware": "#2ca02c", "deepep": "#1f77b4", "moonep": "#ff7f0e", "llep": "#9467bd",
                   "ultraep": "#8c564b", "alltoall": "#7f7f7f", "hierarchical": "#bcbd22", "eplb": "#17becf",
                   "deepep-ll": "#d62728", "deepep_ll": "#d62728", "capacity": "#e377c2", "allgather": "#c7c7c7"}


#: relative difference under which strategies share a cell (a tie, e.g. a planner that planned no copy
#: and its base strategy)
TIE = 5e-4


def cell(times_us: dict[str, float], dropped: dict[str, int] | None = None) -> dict[str, Any]:
    """The winner of one cell: fastest dropless strategy, the runner-up and the margin
    (runner-up time / winner time - 1; 0 when only one strategy competes). Strategies within
    ``TIE`` of the winner are listed in ``tied`` (the winner is the lowest time, then the name), and
    the runner-up is then the fastest strategy outside the tie."""
    dropped = dropped or {}
    ok = sorted((t, n) for n, t in times_us.items() if not dropped.get(n) and np.isfinite(t))
    require(len(ok) >= 1, "a winner-map cell needs at least one dropless strategy")
    (t1, n1) = ok[0]
    tied = [n for t, n in ok if t <= t1 * (1 + TIE)]
    rest = ok[len(tied):] if len(tied) > 1 else ok[1:]
    t2, n2 = rest[0] if rest else (t1, None)
    return {"winner": n1, "time_us": float(t1), "runner_up": n2, "runner_up_us": float(t2),
            "margin": float(t2 / t1 - 1.0) if t1 > 0 else 0.0, "tied": tied if len(tied) > 1 else [],
            "times_us": {n: float(t) for n, t in times_us.items()},
            "dropped": sorted(n for n in times_us if dropped.get(n))}


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
        row = []
        for i in range(len(xs)):
            row.append(cell({n: s["layer_time_us"][i] for n, s in st.items()},
                            {n: int(s["dropped"][i]) for n, s in st.items()}))
        rows.append(row)
    first = reports[0][1]
    return {"kind": "winner_map", "x": {"knob": x_knob, "values": [float(v) for v in xs]},
            "y": {"knob": y_knob, "values": [float(y) for y, _ in reports]},
            "strategies": list(first["strategies"]), "model": first.get("model", {}).get("name"),
            "topology": first.get("topology", {}).get("name"), "cluster": first.get("cluster"),
            "cells": rows}


def _fmt(v: float) -> str:
    return f"{v:g}"


def winner_table_md(m: dict[str, Any]) -> str:
    """Markdown: one row per y value, one column per x value; each cell ``winner (+margin vs
    runner-up)`` and the winner's layer time."""
    xk, yk = m["x"]["knob"], m["y"]["knob"]
    head = f"| {yk} \\ {xk} | " + " | ".join(_fmt(v) for v in m["x"]["values"]) + " |"
    sep = "| --- " * (len(m["x"]["values"]) + 1) + "|"
    lines = [head, sep]
    for y, row in zip(m["y"]["values"], m["cells"]):
        cells = []
        for c in row:
            ru = f" vs {c['runner_up']}" if c["runner_up"] else ""
            who = " = ".join(c["tied"]) if c.get("tied") else c["winner"]
            cells.append(f"**{who}** {c['time_us'] / 1e3:.2f} ms (+{100 * c['margin']:.1f}%{ru})")
        lines.append(f"| {_fmt(y)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def winner_heatmap(m: dict[str, Any], dest: str | os.PathLike, title: str | None = None) -> Path:
    """PNG heat map: colour = the cell's winner, brightness = its margin over the runner-up
    (saturated at 25%), label = winner and margin."""
    from matplotlib.patches import Patch

    from moonep_sim.report.plots import _plt, _save

    plt = _plt()
    xs, ys = m["x"]["values"], m["y"]["values"]
    winners = sorted({c["winner"] for row in m["cells"] for c in row})
    cmap = plt.get_cmap("tab20")
    colors = {n: STRATEGY_COLORS.get(n, cmap(i % 20)) for i, n in enumerate(winners)}
    from matplotlib.colors import to_rgb

    img = np.ones((len(ys), len(xs), 3))
    for i, row in enumerate(m["cells"]):
        for j, c in enumerate(row):
            a = 0.35 + 0.65 * min(c["margin"] / 0.25, 1.0)  # stronger colour = larger margin
            img[i, j] = 1 - a * (1 - np.array(to_rgb(colors[c["winner"]])))
    fig, ax = plt.subplots(figsize=(1.9 * len(xs) + 2.5, 0.9 * len(ys) + 1.8))
    ax.imshow(img, aspect="auto", origin="lower")
    for i, row in enumerate(m["cells"]):
        for j, c in enumerate(row):
            who = " =\n".join(c["tied"]) if c.get("tied") else c["winner"]
            ax.text(j, i, f"{who}\n+{100 * c['margin']:.1f}%\n{c['time_us'] / 1e3:.2f} ms",
                    ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(xs)), [_fmt(v) for v in xs])
    ax.set_yticks(range(len(ys)), [_fmt(v) for v in ys])
    ax.set_xlabel(m["x"]["knob"])
    ax.set_ylabel(m["y"]["knob"])
    ax.set_title(title or f"fastest strategy per cell ({m.get('model')}, {m.get('topology')}); "
                          "margin over the runner-up", fontsize=9)
    ax.legend(handles=[Patch(color=colors[n], label=n) for n in winners], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, title="winner")
    return _save(fig, dest)


__all__ = ["cell", "winner_heatmap", "winner_map", "winner_table_md"]
