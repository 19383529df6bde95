"""Winner maps rendered: a heat map PNG (cell colour = the winner, label = winner and its margin
over the runner-up) and a Markdown table, from the map dict :mod:`moonep_sim.analysis.winner`
builds (``cell`` and ``winner_map`` are there).

Notation: X columns (first knob's values), Y rows (second knob's values).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

# fixed colours per strategy so maps of different runs read alike (others cycle through tab20)
STRATEGY_COLORS = {"costaware": "#2ca02c", "deepep": "#1f77b4", "moonep": "#ff7f0e", "llep": "#9467bd",
                   "ultraep": "#8c564b", "alltoall": "#7f7f7f", "hierarchical": "#bcbd22", "eplb": "#17becf",
                   "deepep-ll": "#d62728", "deepep_ll": "#d62728", "capacity": "#e377c2", "allgather": "#c7c7c7"}


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
            who = " = ".join(_tied(c)) + " (tie)" if _is_tie(c) else c["winner"]
            conf = ((c.get("verdict") or {}).get("confidence") or {})
            how = f"; {conf['level']} over {conf['units']} {conf['unit']}s" if conf.get("units", 0) > 1 else ""
            oom = f"; OOM: {', '.join(c['oom'])}" if c.get("oom") else ""   # a step-level cell
            cells.append(f"**{who}** {c['time_us'] / 1e3:.2f} ms (+{100 * c['margin']:.1f}%{ru}{how}{oom})")
        lines.append(f"| {_fmt(y)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def winner_heatmap(m: dict[str, Any], dest: str | os.PathLike, title: str | None = None) -> Path:
    """PNG heat map: colour = the cell's winner, brightness = its margin over the runner-up
    (saturated at 25%), label = winner, margin and the runner-up it is measured against."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle

    from moonep_sim.report.plots import _plt, _save

    plt = _plt()
    xs, ys = m["x"]["values"], m["y"]["values"]
    winners = sorted({c["winner"] for row in m["cells"] for c in row})
    cmap = plt.get_cmap("tab20")
    colors = {n: STRATEGY_COLORS.get(n, cmap(i % 20)) for i, n in enumerate(winners)}
    img = np.ones((len(ys), len(xs), 3))
    ties = []
    for i, row in enumerate(m["cells"]):
        for j, c in enumerate(row):
            if _is_tie(c):  # a tie is no one's colour: light grey, hatched
                img[i, j] = to_rgb(TIE_COLOR)
                ties.append((i, j))
                continue
            a = 0.35 + 0.65 * min(c["margin"] / 0.25, 1.0)  # stronger colour = larger margin
            img[i, j] = 1 - a * (1 - np.array(to_rgb(colors[c["winner"]])))
    fig, ax = plt.subplots(figsize=(1.9 * len(xs) + 2.5, 0.9 * len(ys) + 1.8))
    ax.imshow(img, aspect="auto", origin="lower")
    for i, j in ties:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="#999999", lw=0))
    for i, row in enumerate(m["cells"]):
        for j, c in enumerate(row):
            who = " = ".join(_tied(c)) + "\n(tie)" if _is_tie(c) else c["winner"]
            ru = f" vs {c['runner_up']}" if c.get("runner_up") else ""
            ax.text(j, i, f"{who}\n+{100 * c['margin']:.1f}%{ru}\n{c['time_us'] / 1e3:.2f} ms",
                    ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(xs)), [_fmt(v) for v in xs])
    ax.set_yticks(range(len(ys)), [_fmt(v) for v in ys])
    ax.set_xlabel(m["x"]["knob"])
    ax.set_ylabel(m["y"]["knob"])
    ax.set_title(title or f"fastest strategy per cell ({m.get('model')}, {m.get('topology')}); "
                          "margin vs the runner-up", fontsize=9)
    handles = [Patch(color=colors[n], label=n) for n in winners]
    if ties:
        handles.append(Patch(facecolor=TIE_COLOR, hatch="//", edgecolor="#999999", label="tie"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="winner")
    notes = []
    conf = {(c.get("verdict") or {}).get("confidence", {}).get("level") for row in m["cells"] for c in row}
    if "single sample" in conf:
        notes.append("one seed per cell: margins are not tested against a spread over seeds")
    fl = sorted({f"{f['strategy']}: {f['code']}" for f in m.get("flags") or [] if f.get("strategy")})
    if fl:
        notes.append("flagged: " + "; ".join(fl))
    if notes:
        fig.text(0.01, -0.02, "\n".join(notes), fontsize=7, color="#8a5a00", ha="left", va="top")
    return _save(fig, dest)


TIE_COLOR = "#e6e6e6"


def _tied(c: dict[str, Any]) -> list[str]:
    """The strategies sharing a cell: the cell's own tie list, else the verdict's."""
    v = c.get("verdict") or {}
    return c.get("tied") or [c["winner"], *v.get("tied_with", [])]


def _is_tie(c: dict[str, Any]) -> bool:
    return bool(c.get("tied")) or bool((c.get("verdict") or {}).get("tie"))


__all__ = ["STRATEGY_COLORS", "winner_heatmap", "winner_table_md"]
