"""Renders step-level sweeps (``moonep-sim sweep --level step``): the terminal table, its footer
and the line plot.

Takes the plain report dict of :func:`moonep_sim.experiments.step_levels.step_sweep` (per
strategy and point: ``step_time_us``, ``exposed_comm_us``, ``comm_share``, ``peak_memory_bytes``,
``gpu_memory_bytes``, ``oom``; per point a step ``verdict``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from moonep_sim.report.plots import _plt, _save, _unit, flagged, mark
from moonep_sim.report.steps import _t


def step_sweep_table(rep: dict[str, Any]):
    """A rich Table: per value, each strategy's step time, exposed communication share, peak
    memory (OOM marked), then the step verdict."""
    from moonep_sim.report.tables import sweep_grid

    st = rep["step"]
    return sweep_grid(rep, f"sweep over {rep['over']} at step level: {st['mode']} step, overlap {st['overlap']} -- "
                           f"{rep['model']['name']} on {rep['topology']['name']} (step time; exposed comm share; peak "
                           "memory per rank)",
                      lambda s, i: f"{_t(s['step_time_us'][i])}; {s['comm_share'][i]:.0%}; "
                                   f"{s['peak_memory_bytes'][i] / 2**30:,.1f} GiB" + (" OOM" if s["oom"][i] else ""))


def step_sweep_footer(rep: dict[str, Any]) -> list[str]:
    """What every point ran: the step options and the GPU capacity the OOM verdict uses."""
    st = rep["step"]
    caps = sorted({float(c) for s in rep["strategies"].values() for c in s["gpu_memory_bytes"] if c})
    out = [f"each point: a whole {st['mode']} step per strategy (overlap {st['overlap']}, context "
           f"{st.get('context')}, distinct layers {st.get('distinct_layers') or 'all'}); docs/steps.md"]
    if caps:
        out.append("OOM: peak memory per rank above the GPU's " + ", ".join(f"{c / 2**30:,.0f}" for c in caps) +
                   " GiB; an OOM strategy never wins a point it shares with one that fits")
    sk = rep.get("standin_skew")
    if sk:
        out.append(f"stand-in layers drawn at maxvio {sk['maxvio']:.3g}, measured over {sk['tokens']:,} tokens of "
                   f"{sk['layers']} recorded layer(s), every recorded step pooled")
    out += aggregate_lines(rep)
    return out


def aggregate_lines(rep: dict[str, Any]) -> list[str]:
    """Per point of a sweep over a trace: each strategy's step time over the recorded steps
    (token-weighted mean / median / p90 / worst (step)) and the steps it was fastest in."""
    out = []
    for p, agg in zip(rep.get("points") or [], rep.get("aggregates") or []):
        if not agg:
            continue
        out.append(f"{rep['over']}={p['value']:g}: step time over {agg['steps']} recorded step(s), token-weighted "
                   "mean / median / p90 / worst (step); fastest in")
        rows = agg["strategies"]
        for n in sorted(rows, key=lambda k: rows[k]["step_time_us"]["token_weighted_mean"]):
            a = rows[n]["step_time_us"]
            w = agg["wins"].get(n)
            out.append(f"  {n}: {_t(a['token_weighted_mean'])} / {_t(a['median'])} / {_t(a['p90'])} / "
                       f"{_t(a['worst'])} ({a['worst_step']}); " + (f"{w} of {agg['steps']}" if w is not None
                                                                   else "not ranked (OOM or dropped rows)"))
    return out


def step_sweep_lines(rep: dict[str, Any], dest: str | os.PathLike) -> Path:
    """Two panels: step time and peak memory per rank (with the GPU's capacity), per strategy,
    versus the swept value; OOM points drawn hollow."""
    plt = _plt()
    xs = rep["values"]
    st = rep["strategies"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    tmax = max([max(s["step_time_us"]) for s in st.values()] + [1.0])
    unit, scale = _unit(tmax)
    fl = flagged(rep)
    for n, s in st.items():
        line, = a1.plot(xs, np.array(s["step_time_us"]) * scale, marker="o", label=mark(n, fl))
        a2.plot(xs, np.array(s["peak_memory_bytes"], float) / 2**30, marker="o", color=line.get_color(),
                label=mark(n, fl))
        bad = [i for i, o in enumerate(s["oom"]) if o]
        if bad:
            a2.scatter([xs[i] for i in bad], [s["peak_memory_bytes"][i] / 2**30 for i in bad], s=90,
                       facecolors="none", edgecolors="red", zorder=3)
    caps = sorted({float(c) for s in st.values() for c in s["gpu_memory_bytes"] if c})
    for c in caps:
        a2.axhline(c / 2**30, ls=":", color="black", label=f"GPU memory {c / 2**30:,.0f} GiB")
    a1.set_ylabel(f"step time ({unit})")
    a2.set_ylabel("peak memory per rank (GiB; red ring: OOM)")
    for a in (a1, a2):
        a.set_xlabel(rep["over"])
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    s = rep["step"]
    fig.suptitle(f"{rep['model']['name']}: {s['mode']} step, overlap {s['overlap']}, on {rep['topology']['name']}",
                 fontsize=10)
    return _save(fig, dest)


__all__ = ["aggregate_lines", "step_sweep_footer", "step_sweep_lines", "step_sweep_table"]
