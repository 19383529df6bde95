"""PNG plots of compare and sweep reports (matplotlib, Agg backend: no display needed).

Every plot has a title, axis labels with units and a legend. Each function takes the JSON-ready
report dict that :mod:`moonep_sim.experiments.compare` / :mod:`~moonep_sim.experiments.sweep` build and a
destination path, writes the file atomically, and returns the path.

Notation: R ranks; ``_RR`` a [source, destination] matrix.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moonep_sim.io import write_bytes_atomic

# fixed phase order and colours, so plots of different runs read alike
PHASE_ORDER = ("plan", "dispatch", "prefetch", "migrate", "compute", "combine", "grad_reduce", "other")
PHASE_COLORS = {"plan": "#9e9e9e", "dispatch": "#1f77b4", "prefetch": "#ff7f0e", "migrate": "#8c564b",
                "compute": "#2ca02c", "combine": "#9467bd", "grad_reduce": "#e377c2", "other": "#7f7f7f"}


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, dest: str | os.PathLike) -> Path:
    dest = Path(dest)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    finally:
        _plt().close(fig)
    write_bytes_atomic(dest, buf.getbuffer())
    return dest


def phase_group(name: str) -> str:
    """Map a phase name (``dispatch.0``, ``expert_compute``, ``combine.1`` ...) to a plotted group."""
    n = name.lower()
    for key in ("grad_reduce", "prefetch", "migrate", "dispatch", "combine", "plan"):
        if n.startswith(key) or key in n:
            return key
    if "compute" in n or "expert" in n or "gemm" in n:
        return "compute"
    return "other"


def grouped_phases(phases_us: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in phases_us.items():
        g = phase_group(k)
        out[g] = out.get(g, 0.0) + float(v)
    return out


def _unit(max_us: float) -> tuple[str, float]:
    return ("ms", 1e-3) if max_us >= 2000 else ("us", 1.0)


def layer_time_bars(report: dict[str, Any], dest: str | os.PathLike) -> Path:
    """Stacked bars: mean simulated layer time per strategy, split by phase group, with the lower
    bound as a marker; with measured runs, a second panel of measured vs simulated (local-gloo)."""
    plt = _plt()
    strat = report["strategies"]
    names = list(strat)
    real = report.get("real")
    ncols = 2 if real else 1
    fig, axes = plt.subplots(1, ncols, figsize=(max(6.0, 1.3 * len(names) + 3) * ncols + 2.5, 4.6), squeeze=False,
                             layout="constrained")
    ax = axes[0][0]
    groups = [strat[n]["sim"]["critical_us_mean"] for n in names]
    total = [strat[n]["sim"]["layer_time_us_mean"] for n in names]
    unit, scale = _unit(max(total + [1.0]))
    x = np.arange(len(names))
    bottom = np.zeros(len(names))
    colors = {"plan": PHASE_COLORS["plan"], "dispatch + wait": PHASE_COLORS["dispatch"],
              "compute": PHASE_COLORS["compute"], "combine": PHASE_COLORS["combine"]}
    tot = np.array(total) * scale
    # one strategy far above the rest (moonep's weight copies on Mixtral) would squash the others: log axis
    log = len(tot) > 1 and tot.max() > 10 * max(tot.min(), 1e-12)
    for g in report["critical_parts"]:
        vals = np.array([gr.get(g, 0.0) for gr in groups]) * scale
        if not vals.any():
            continue
        ax.bar(x, vals, 0.6, bottom=bottom, label=g, color=colors[g])
        bottom += vals
    lb = np.array([strat[n]["sim"]["lower_bound_us_mean"] for n in names]) * scale
    ax.hlines(lb, x - 0.3, x + 0.3, color="black", lw=2, zorder=5, label="lower bound")
    for xi, t in zip(x, tot):
        ax.annotate(f"{t:.3g}", (xi, t), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_ylabel(f"simulated layer time ({unit}{', log scale' if log else ''})")
    topo = report["topology"]["name"]
    ax.set_title(f"simulated layer time -- {topo}, EP{report['cluster']['ranks']} (mean over layers)", fontsize=10)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(max(min(tot.min(), lb[lb > 0].min() if (lb > 0).any() else tot.min()) / 3, 1e-9), tot.max() * 3)
    else:
        ax.set_ylim(0, max(tot.max(), 1e-9) * 1.15)
    # the legend sits outside the axes, so no value label or bar hides under it
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.supxlabel("split along the rank whose expert compute ends last ('dispatch + wait' includes waiting for "
                  "copied weights)", fontsize=7, color="dimgray")
    if real:
        ax2 = axes[0][1]
        rn = [n for n in names if n in real["strategies"]]
        meas = np.array([real["strategies"][n]["measured_ms"] for n in rn])
        sim = np.array([real["strategies"][n]["simulated_ms"] for n in rn])
        xr = np.arange(len(rn))
        ax2.bar(xr - 0.2, meas, 0.4, label=f"measured (gloo, {real['nproc']} processes)", color="#1f77b4")
        ax2.bar(xr + 0.2, sim, 0.4, label=f"simulated ({real['topology']['name']})", color="#ff7f0e")
        ax2.set_xticks(xr, rn, rotation=20, ha="right")
        ax2.set_ylabel("layer time (ms)")
        ax2.set_title("real gloo (median over iterations) vs simulated local-gloo", fontsize=10)
        ax2.set_ylim(0, max(float(np.max(np.r_[meas, sim])), 1e-9) * 1.15)
        ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, dest)


def rows_per_rank(report: dict[str, Any], dest: str | os.PathLike) -> Path:
    """Rows (tokens) each rank computes, per strategy (mean over layers), with the mean marked."""
    plt = _plt()
    strat = report["strategies"]
    names = list(strat)
    R = report["cluster"]["ranks"]
    fig, ax = plt.subplots(figsize=(max(6.5, 0.18 * R + 4), 4.4))
    ranks = np.arange(R)
    if R <= 16:
        w = 0.8 / max(len(names), 1)
        for i, n in enumerate(names):
            ax.bar(ranks - 0.4 + w * (i + 0.5), strat[n]["rows_per_rank_mean"], w, label=n)
    else:
        for n in names:
            ax.step(ranks, strat[n]["rows_per_rank_mean"], where="mid", label=n)
    mean = float(np.mean(strat[names[0]]["rows_per_rank_mean"])) if names else 0.0
    ax.axhline(mean, color="black", ls=":", lw=1, label="mean rows per rank")
    ax.set_xlabel("rank")
    _integer_ticks(ax.xaxis, R)
    ax.set_ylabel("rows computed per layer (token-expert pairs)")
    ax.set_title(f"rows per rank -- {report['routing']['label']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, dest)


def traffic_heatmaps(report: dict[str, Any], dest: str | os.PathLike) -> Path:
    """One heat map per strategy: dispatch bytes from source rank to destination rank (all hops)."""
    plt = _plt()
    strat = report["strategies"]
    names = list(strat)
    n = len(names)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1.4, 3.3 * rows + 0.8), squeeze=False,
                             layout="constrained")
    mats = [np.asarray(strat[s]["dispatch_bytes_RR"], float) / 2**20 for s in names]
    R = mats[0].shape[0] if mats else 1
    vmax = max([float(m.max()) for m in mats] + [1e-9])
    im = None
    for i, ax in enumerate(axes.ravel()):
        if i >= n:
            ax.axis("off")
            continue
        im = ax.imshow(mats[i], cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(names[i], fontsize=9)
        _integer_ticks(ax.xaxis, R)  # ranks are whole numbers
        _integer_ticks(ax.yaxis, R)
        # axis labels once per row / column, so neighbouring panels do not overlap them
        if i // cols == rows - 1 or i + cols >= n:
            ax.set_xlabel("destination rank")
        if i % cols == 0:
            ax.set_ylabel("source rank")
    if im is not None:
        cb = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.85)
        cb.set_label("dispatch MiB, all hops, summed over layers (diagonal: local)")
    fig.suptitle(f"dispatch traffic matrix -- {report['routing']['label']}")
    return _save(fig, dest)


def _integer_ticks(axis, n: int, most: int = 8) -> None:
    """Whole-number ticks 0..n-1 on ``axis``: all of them up to ``most``, else an even spacing."""
    step = max(1, int(np.ceil(n / most)))
    axis.set_ticks(np.arange(0, n, step))


def sweep_lines(report: dict[str, Any], dest: str | os.PathLike) -> Path:
    """Two panels: simulated layer time and its ratio to the lower bound, per strategy, versus the
    swept value."""
    plt = _plt()
    over = report["over"]
    xs = report["values"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    tmax = max([max(v["layer_time_us"]) for v in report["strategies"].values()] + [1.0])
    unit, scale = _unit(tmax)
    xlabel = {"maxvio": "target maxvio (hottest expert load / mean - 1)", "ep": "EP size (ranks)"}.get(
        over, f"{over}")
    for name, v in report["strategies"].items():
        a1.plot(xs, np.array(v["layer_time_us"]) * scale, marker="o", label=name)
        a2.plot(xs, v["ratio_to_lower_bound"], marker="o", label=name)
    lb = report.get("lower_bound_us")
    if lb:
        a1.plot(xs, np.array(lb) * scale, ls=":", color="black", label="lower bound (dropless)")
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    for a in (a1, a2):
        a.set_xlabel(xlabel)
        if over in ("maxvio", "ep") and min(xs) > 0 and max(xs) / min(xs) >= 20:
            a.set_xscale("log")
            # ticks at the swept values only: the log axis's own minor labels overlap them
            a.xaxis.set_major_locator(FixedLocator(xs))
            a.xaxis.set_minor_locator(NullLocator())
            a.xaxis.set_minor_formatter(NullFormatter())
            a.set_xticks(xs, [f"{v:g}" for v in xs])
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylabel(f"simulated layer time ({unit})")
    a2.set_ylabel("layer time / lower bound (x)")
    title = (f"{report['model']['name']} on {report['topology']['name']}, EP{report['cluster']['ranks']}"
             if over != "ep" else f"{report['model']['name']} on {report['topology']['name']}")
    a1.set_title(f"layer time vs {over} -- {title}")
    a2.set_title("ratio to lower bound")
    return _save(fig, dest)


def fidelity_scatter(cases: Sequence[dict[str, Any]], dest: str | os.PathLike, topology: str) -> Path:
    """Measured vs simulated layer time, one point per case, coloured by strategy, y = x marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5.2))
    by: dict[str, list[tuple[float, float]]] = {}
    for c in cases:
        by.setdefault(c["strategy"], []).append((c["measured_ms"], c["simulated_ms"]))
    hi = max([max(m, s) for pts in by.values() for m, s in pts] + [1.0]) * 1.15
    lo = min([min(m, s) for pts in by.values() for m, s in pts] + [hi / 100]) / 1.15
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="simulated = measured")
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="gray", alpha=0.15,
                    label="+-25%")
    for name, pts in by.items():
        a = np.array(pts)
        ax.scatter(a[:, 0], a[:, 1], label=name, s=28)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured layer time, gloo (ms)")
    ax.set_ylabel(f"simulated layer time, {topology} (ms)")
    ax.set_title("simulator fidelity: one point per (case, strategy)")
    ax.legend(fontsize=8)
    return _save(fig, dest)
