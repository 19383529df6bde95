"""A sweep repeated over seeds of its generated routing, so that a verdict's tie and confidence
rest on the spread over seeds (a winner-map cell that wins by 2% at one seed may lose at the next).

:func:`over_seeds` runs the same sweep at seeds ``seed, seed + 1, ...`` and returns the first
seed's report with, added: ``seeds`` (the seeds run), ``seed_layer_time_us`` (strategy -> per point,
the time at every seed), ``mean_layer_time_us`` (strategy -> per point, the mean over seeds), and
``verdicts`` recomputed per point from the figures averaged over seeds with the spread over seeds
(unit ``seed``). Each seed draws its own routing at the same target (maxvio, tokens per rank).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from moonep_sim.errors import require


def combine_seeds(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The first report, with the seed series, their means and per-point verdicts over seeds."""
    from moonep_sim.analysis.flags import sweep_flags
    from moonep_sim.analysis.verdict import mean_figures, verdict

    require(len(reps) >= 1, "a seed sweep needs at least one report")
    out = dict(reps[0])
    names = list(out["strategies"])
    pts = len(out["values"])
    out["seeds"] = [int(r["seed"]) for r in reps]
    out["seed_layer_time_us"] = {n: [[float(r["strategies"][n]["layer_time_us"][i]) for r in reps] for i in range(pts)]
                                 for n in names}
    out["mean_layer_time_us"] = {n: [float(np.mean(v)) for v in out["seed_layer_time_us"][n]] for n in names}
    out["flags"] = sweep_flags(out)
    verdicts = []
    for i in range(pts):
        figs, series = {}, {}
        for n in names:
            fs = [r["strategies"][n].get("figures", [None] * pts)[i] for r in reps]
            if any(f is None for f in fs):
                figs = {}
                break
            figs[n] = mean_figures(fs)
            figs[n]["time_us"] = out["mean_layer_time_us"][n][i]
            figs[n]["dropped"] = max(float(f.get("dropped", 0)) for f in fs)
            series[n] = out["seed_layer_time_us"][n][i]
        verdicts.append(verdict(figs, series=series, unit="seed", flags=out["flags"]) if figs else None)
    out["verdicts"] = verdicts
    return out


def over_seeds(seeds: int, run: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """``run(k)`` for the seed offsets k = 0 .. seeds-1 (each a sweep at seed ``seed + k``), combined
    (:func:`combine_seeds`); one seed: its report as it is."""
    require(seeds >= 1, f"seeds ({seeds}) must be >= 1")
    reps = [run(k) for k in range(seeds)]
    return combine_seeds(reps) if seeds > 1 else reps[0]


__all__ = ["combine_seeds", "over_seeds"]
