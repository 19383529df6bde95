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

from moonep_sim.analysis.verdict import TIE as SAME  # series within it are drawn as one ("a = b")
from moonep_sim.io import write_bytes_atomic

# fixed phase colours, so plots of different runs read alike
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


#: traffic panels get one colour scale each when their peaks differ by more than this factor
OWN_SCALE = 4.0


def merge_identical(series: dict[str, Sequence[float]]) -> list[tuple[str, list[str], np.ndarray]]:
    """Series that are the same figures (every point within :data:`SAME`) drawn once, labelled
    ``a = b``: [(label, names, values)] in first-seen order (identical lines would hide each other)."""
    out: list[tuple[str, list[str], np.ndarray]] = []
    for n, v in series.items():
        a = np.asarray(v, float)
        for i, (_, names, b) in enumerate(out):
            if a.shape == b.shape and np.all(np.abs(a - b) <= SAME * np.maximum(np.abs(b), 1e-12)):
                names.append(n)
                out[i] = (" = ".join(names), names, b)
                break
        else:
            out.append((n, [n], a))
    return out


def tied(report: dict[str, Any], names: Sequence[str], values: Sequence[float]) -> set[str]:
    """The strategies a bar plot labels ``(tie)``: those whose figures are the same
    (:func:`merge_identical`) and those the report's verdict finds tied with its winner within
    the spread over steps, layers or seeds (``verdict["others"][*]["tie"]``): a difference
    inside the spread is drawn as no win."""
    out = {n for _, ns, _ in merge_identical({n: [v] for n, v in zip(names, values)}) if len(ns) > 1 for n in ns}
    v = report.get("verdict") or {}
    spread = [o["strategy"] for o in v.get("others") or [] if o.get("tie")]
    if spread:
        out |= {v["winner"], *spread}
    return out & set(names)


def tie_note(fig, ties: set[str], y: float = -0.07) -> None:
    """A footnote saying what ``(tie)`` means, when a bar carries it."""
    if ties:
        fig.text(0.01, y, "(tie): the same figure, or a difference within the verdict's spread (no win)",
                 fontsize=7, color="dimgray", ha="left", va="top")


def flagged(report: dict[str, Any]) -> dict[str, list[str]]:
    """strategy -> the codes of the flags that concern it (report["flags"])."""
    out: dict[str, list[str]] = {}
    for f in report.get("flags") or []:
        if f.get("strategy"):
            out.setdefault(f["strategy"], []).append(f["code"])
    return out


def mark(name: str, flags: dict[str, list[str]]) -> str:
    """``name*`` when a flag concerns the strategy (the plot's footnote says which)."""
    return " = ".join(n + ("*" if n in flags else "") for n in name.split(" = "))


def flag_note(fig, flags: dict[str, list[str]], y: float = -0.02) -> None:
    """A footnote under the figure: ``* eplb: oracle, free-migration; moonep: outside-library``."""
    if flags:
        fig.text(0.01, y, "* flagged: " + "; ".join(f"{n}: {', '.join(c)}" for n, c in flags.items()),
                 fontsize=7, color="#8a5a00", ha="left", va="top")


def layer_time_bars(report: dict[str, Any], dest: str | os.PathLike) -> Path:
    """Stacked bars on a linear axis: mean simulated layer time per strategy, split along the
    critical rank, with the lower bound as a marker. When one strategy is more than 10x the
    fastest, a second panel zooms on the fastest (taller bars clipped, their value written), so
    no segment (planning) disappears as it would on a log axis. With measured runs, a last panel
    of measured vs simulated (local-gloo). Flagged strategies carry ``*`` and a footnote."""
    plt = _plt()
    strat = report["strategies"]
    names = list(strat)
    fl = flagged(report)
    real = report.get("real")
    total = [strat[n]["sim"]["layer_time_us_mean"] for n in names]
    unit, scale = _unit(max(total + [1.0]))
    tot = np.array(total) * scale
    zoom = len(tot) > 1 and tot.max() > 10 * max(tot.min(), 1e-12)
    panels = 1 + int(zoom) + int(bool(real))
    fig, axes = plt.subplots(1, panels, figsize=(max(5.0, 1.1 * len(names) + 2) * panels + 2.5, 4.6), squeeze=False,
                             layout="constrained")
    groups = [strat[n]["sim"]["critical_us_mean"] for n in names]
    x = np.arange(len(names))
    colors = {"plan": PHASE_COLORS["plan"], "dispatch + wait": PHASE_COLORS["dispatch"],
              "compute": PHASE_COLORS["compute"], "combine": PHASE_COLORS["combine"]}
    lb = np.array([strat[n]["sim"]["lower_bound_us_mean"] for n in names]) * scale
    topo = report["topology"]["name"]
    ties = tied(report, names, total)
    labels = [mark(n, fl) + (" (tie)" if n in ties else "") for n in names]
    for k in range(1 + int(zoom)):
        ax = axes[0][k]
        bottom = np.zeros(len(names))
        for g in report["critical_parts"]:
            vals = np.array([gr.get(g, 0.0) for gr in groups]) * scale
            if not vals.any():
                continue
            ax.bar(x, vals, 0.6, bottom=bottom, label=g, color=colors[g])
            bottom += vals
        ax.hlines(lb, x - 0.3, x + 0.3, color="black", lw=2, zorder=5, label="lower bound")
        top = tot.max() * 1.15 if k == 0 else 1.6 * max(tot[tot <= 10 * max(tot.min(), 1e-12)].max(), 1e-9)
        for xi, t in zip(x, tot):
            clipped = t > top
            ax.annotate(f"{t:.3g}" + (" (clipped)" if clipped else ""), (xi, min(t, top)), xytext=(0, -4 if clipped else 2),
                        textcoords="offset points", ha="center", va="bottom" if not clipped else "top", fontsize=8,
                        color="black" if not clipped else "white", fontweight="bold" if clipped else None)
        ax.set_ylim(0, max(top, 1e-9))
        ax.set_xticks(x, labels, rotation=20, ha="right")
        ax.set_ylabel(f"simulated layer time ({unit})")
        ax.set_title(f"simulated layer time -- {topo}, EP{report['cluster']['ranks']} (mean over layers)" if k == 0
                     else "zoom on the fastest (linear; taller bars clipped)", fontsize=10)
        if k == int(zoom):  # the legend sits outside the last time panel, over no bar or value label
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.supxlabel("split along the rank whose expert compute ends last ('dispatch + wait' includes waiting for "
                  "copied weights)", fontsize=7, color="dimgray")
    if real:
        ax2 = axes[0][-1]
        rn = [n for n in names if n in real["strategies"]]
        meas = np.array([real["strategies"][n]["measured_ms"] for n in rn])
        sim = np.array([real["strategies"][n]["simulated_ms"] for n in rn])
        xr = np.arange(len(rn))
        ax2.bar(xr - 0.2, meas, 0.4, label=f"measured (gloo, {real['nproc']} processes)", color="#1f77b4")
        ax2.bar(xr + 0.2, sim, 0.4, label=f"simulated ({real['topology']['name']})", color="#ff7f0e")
        ax2.set_xticks(xr, [mark(n, fl) for n in rn], rotation=20, ha="right")
        ax2.set_ylabel("layer time (ms)")
        ax2.set_title("real gloo (median over iterations) vs simulated local-gloo", fontsize=10)
        ax2.set_ylim(0, max(float(np.max(np.r_[meas, sim])), 1e-9) * 1.15)
        ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    flag_note(fig, fl)
    tie_note(fig, ties)
    return _save(fig, dest)


def rows_per_rank(report: dict[str, Any], dest: str | os.PathLike) -> Path:
    """Rows (tokens) each rank computes, per strategy (mean over layers), with the mean marked."""
    plt = _plt()
    strat = report["strategies"]
    names = list(strat)
    R = report["cluster"]["ranks"]
    fig, ax = plt.subplots(figsize=(max(6.5, 0.18 * R + 4), 4.4))
    ranks = np.arange(R)
    fl = flagged(report)
    # strategies with the same rows on every rank are drawn once, labelled "a = b"
    groups = merge_identical({n: strat[n]["rows_per_rank_mean"] for n in names})
    if R <= 16:
        w = 0.8 / max(len(groups), 1)
        for i, (lab, _, v) in enumerate(groups):
            ax.bar(ranks - 0.4 + w * (i + 0.5), v, w, label=mark(lab, fl))
    else:
        for lab, _, v in groups:
            ax.step(ranks, v, where="mid", label=mark(lab, fl))
    mean = float(np.mean(strat[names[0]]["rows_per_rank_mean"])) if names else 0.0
    ax.axhline(mean, color="black", ls=":", lw=1, label="mean rows per rank")
    ax.set_xlabel("rank")
    _integer_ticks(ax.xaxis, R)
    ax.set_ylabel("rows computed per layer (token-expert pairs)")
    ax.set_title(f"rows per rank -- {report['routing']['label']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    flag_note(fig, fl)
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
    peaks = [max(float(m.max()), 1e-9) for m in mats]
    vmax = max(peaks + [1e-9])
    # panels whose peaks differ by more than 4x: one colour scale each (a shared one leaves most blank)
    own = len(peaks) > 1 and vmax > OWN_SCALE * min(peaks)
    same = {n: lab for lab, ns, _ in merge_identical({n: m.ravel() for n, m in zip(names, mats)}) for n in ns}
    fl = flagged(report)
    im = None
    for i, ax in enumerate(axes.ravel()):
        if i >= n:
            ax.axis("off")
            continue
        im = ax.imshow(mats[i], cmap="viridis", vmin=0, vmax=peaks[i] if own else vmax, interpolation="nearest")
        if own:
            fig.colorbar(im, ax=ax, shrink=0.8).set_label("MiB", fontsize=7)
        ax.set_title(mark(same[names[i]], fl) if " = " in same[names[i]] else mark(names[i], fl), fontsize=9)
        _integer_ticks(ax.xaxis, R)  # ranks are whole numbers
        _integer_ticks(ax.yaxis, R)
        # axis labels once per row / column, so neighbouring panels do not overlap them
        if i // cols == rows - 1 or i + cols >= n:
            ax.set_xlabel("destination rank")
        if i % cols == 0:
            ax.set_ylabel("source rank")
    if im is not None and not own:
        cb = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.85)
        cb.set_label("dispatch MiB, all hops, summed over layers (diagonal: local)")
    fig.suptitle(f"dispatch traffic matrix -- {report['routing']['label']}" +
                 (f"\n(one colour scale per panel: their peaks differ by more than {OWN_SCALE:g}x; MiB, all hops, summed over "
                  "layers, diagonal local)" if own else ""), fontsize=10 if own else None)
    flag_note(fig, fl)
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
    fl = flagged(report)
    st = report["strategies"]
    # identical series drawn once, labelled "a = b" (else the later line hides the earlier)
    for lab, ns, v in merge_identical({n: st[n]["layer_time_us"] for n in st}):
        line, = a1.plot(xs, np.array(v) * scale, marker="o", label=mark(lab, fl))
        a2.plot(xs, st[ns[0]]["ratio_to_lower_bound"], marker="o", label=mark(lab, fl), color=line.get_color())
    for i, v in enumerate(report.get("verdicts") or []):
        if v and v.get("tie"):  # a tie at this point: the winner is not resolved
            a1.annotate("tie", (xs[i], st[v["winner"]]["layer_time_us"][i] * scale), xytext=(0, 8),
                        textcoords="offset points", ha="center", fontsize=7, color="dimgray")
    lb = report.get("lower_bound_us")
    if lb:
        a1.plot(xs, np.array(lb) * scale, ls=":", color="black", label="lower bound (dropless)")
    for a in (a1, a2):
        a.set_xlabel(xlabel)
        if over in ("maxvio", "ep") and min(xs) > 0 and max(xs) / min(xs) >= 20:
            a.set_xscale("log")
            # ticks at the swept values only: the log axis's own minor labels overlap them
            a.set_xticks(xs, [f"{v:g}" for v in xs])
            a.xaxis.minorticks_off()
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylabel(f"simulated layer time ({unit})")
    a2.set_ylabel("layer time / lower bound (x)")
    title = (f"{report['model']['name']} on {report['topology']['name']}, EP{report['cluster']['ranks']}"
             if over != "ep" else f"{report['model']['name']} on {report['topology']['name']}")
    a1.set_title(f"layer time vs {over} -- {title}")
    a2.set_title("ratio to lower bound")
    flag_note(fig, fl)
    return _save(fig, dest)


def simulate_bars(report: dict[str, Any], dest: str | os.PathLike) -> Path:
    """A simulate result (the layers chained as one step): step time per strategy with its lower
    bound, on a linear axis; flags marked, and ties (the same figure, or a difference within the
    verdict's spread over steps, layers or seeds: :func:`tied`) labelled as such."""
    plt = _plt()
    strat = report["strategies"]
    names = list(strat)
    fl = flagged(report)
    t = np.array([float(strat[n]["layer_time_us"]) for n in names])
    unit, scale = _unit(float(t.max()) if t.size else 1.0)
    fig, ax = plt.subplots(figsize=(max(5.5, 1.2 * len(names) + 2.5), 4.2), layout="constrained")
    x = np.arange(len(names))
    ax.bar(x, t * scale, 0.6, color="#1f77b4", label="simulated")
    lb = np.array([float(strat[n].get("lower_bound_us", 0.0)) for n in names]) * scale
    ax.hlines(lb, x - 0.3, x + 0.3, color="black", lw=2, label="lower bound")
    ties = tied(report, names, t)
    for xi, v in zip(x, t * scale):
        ax.annotate(f"{v:.3g}", (xi, v), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(x, [mark(n, fl) + (" (tie)" if n in ties else "") for n in names], rotation=20, ha="right")
    ax.set_ylabel(f"simulated time of the layers ({unit})")
    ax.set_title(f"simulated on {(report.get('topology') or {}).get('name', '?')}", fontsize=10)
    ax.set_ylim(0, max(float(t.max()) * scale * 1.15, 1e-9) if t.size else 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    flag_note(fig, fl)
    tie_note(fig, ties)
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


def step_bars(doc: dict[str, Any], dest: str | os.PathLike) -> Path:
    """A step result: step time per strategy stacked as compute + exposed communication (linear),
    OOM strategies hatched, ties and flags marked."""
    plt = _plt()
    strat = doc["strategies"]
    names = list(strat)
    fl = flagged(doc)
    t = np.array([float(strat[n]["step_time_us"]) for n in names])
    unit, scale = _unit(float(t.max()) if t.size else 1.0)
    comm = np.array([float(strat[n].get("exposed_comm_us", 0.0)) for n in names])
    fig, ax = plt.subplots(figsize=(max(5.5, 1.2 * len(names) + 2.5), 4.2), layout="constrained")
    x = np.arange(len(names))
    rest = np.maximum(t - comm, 0.0)
    oom = [bool(strat[n].get("oom")) for n in names]
    ax.bar(x, rest * scale, 0.6, color=PHASE_COLORS["compute"], label="compute and the rest",
           hatch=None, edgecolor="black", linewidth=[1.5 if o else 0 for o in oom])
    ax.bar(x, comm * scale, 0.6, bottom=rest * scale, color=PHASE_COLORS["dispatch"], label="exposed communication")
    ties = tied(doc, names, t)
    for xi, v, o in zip(x, t * scale, oom):
        ax.annotate(f"{v:.3g}" + (" OOM" if o else ""), (xi, v), xytext=(0, 2), textcoords="offset points",
                    ha="center", fontsize=8, color="red" if o else "black")
    ax.set_xticks(x, [mark(n, fl) + (" (tie)" if n in ties else "") for n in names], rotation=20, ha="right")
    ax.set_ylabel(f"simulated step time ({unit})")
    s = doc.get("setup") or {}
    ax.set_title(f"{s.get('mode', '')} step of {s.get('model', '?')} on {s.get('topology', '?')}", fontsize=10)
    ax.set_ylim(0, max(float(t.max()) * scale * 1.15, 1e-9) if t.size else 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    flag_note(fig, fl)
    tie_note(fig, ties)
    return _save(fig, dest)
