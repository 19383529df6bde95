"""A result written to a folder: ``report.json``, its PNG plots and one self-contained
``report.html`` (what ``result.save(folder)`` and the CLI's ``--out`` write).

The plots of each kind (:data:`PLOTS`): compare -- layer time, rows per rank, traffic; sweep --
layer time and ratio to the lower bound per value; simulate -- layer time per strategy; step --
step time split into compute and exposed communication per strategy; a kind
without plots (plans, replay, a new kind) still gets its JSON and HTML.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from moonep_sim.io import make_output_dir, staged_dir
from moonep_sim.report import plots as P

#: kind -> [(file stem, plot function(report dict, dest) -> Path)]
PLOTS = {
    "compare": [("layer_time", P.layer_time_bars), ("rows_per_rank", P.rows_per_rank), ("traffic", P.traffic_heatmaps)],
    "sweep": [("sweep", P.sweep_lines)],
    "simulate": [("layer_time", P.simulate_bars)],
    "step": [("step_time", P.step_bars)],
}


def plot_report(data: Mapping[str, Any], folder: str | os.PathLike, which: list[str] | None = None) -> dict[str, Path]:
    """The kind's plots as PNGs under ``folder`` (``which``: a subset of the stems); {stem: path}."""
    folder = Path(folder)
    make_output_dir(folder, "folder")
    out = {}
    for stem, fn in PLOTS.get(str(data.get("kind")), []):
        if which is None or stem in which:
            out[stem] = fn(dict(data), folder / f"{stem}.png")
    return out


def save_report(data: dict[str, Any], folder: str | os.PathLike, *, plots: bool = True,
                command: str | None = None) -> dict[str, str]:
    """report.json, the plots and report.html under ``folder``, assembled beside it and moved in
    when all are written (a failure leaves none of them); returns {what: path}. The report dict
    gets ``provenance`` (command, versions, date) and ``files``."""
    from moonep_sim.report.html import provenance, write_report

    folder = Path(folder)
    with staged_dir(folder, "folder") as tmp:
        kind_plots = PLOTS.get(str(data.get("kind")), []) if plots else []
        figs = {stem: fn(dict(data), tmp / f"{stem}.png") for stem, fn in kind_plots}
        data.setdefault("provenance", provenance(command))
        files = write_report(data, tmp, folder, figs)
    data["files"] = dict(files)
    return files


__all__ = ["PLOTS", "plot_report", "save_report"]
