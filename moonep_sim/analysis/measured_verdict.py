"""The verdict of a measured gloo replay: who won on the local machine, by how much, how sure, and
which measured phase accounts for the margin -- the same dict as a simulated verdict
(:mod:`~moonep_sim.analysis.verdict`: ``{winner, runner_up, margin, tie, confidence, mechanism,
why}``, with ``others`` and ``terms_us``), built from the replay's own figures only.

- Times: each strategy's measured layer time (``layer_ms_median``: the median over iterations of
  the slowest rank's layer time, token-weighted over steps) -- the figure the measured ranking
  (:func:`moonep_sim.analysis.ranking.agreement`) orders by, so both name the same winner.
- ``tie``: a measured difference counts only when (a) the spread of the paired relative
  differences over the measured units -- iterations, and (step, iteration) pairs when the replay
  ran several steps, token-weighted -- excludes a tie (:func:`~.verdict.confidence`), and (b) the
  exact sign test over the matched iterations resolves the pair, Holm-corrected over every pair
  at :data:`~moonep_sim.analysis.ranking.ALPHA` (the ranking's own test: a measured verdict
  without a tie is a ``<`` in the measured order). With few iterations (fewer than 6 for two
  strategies) the sign test cannot resolve anything and every pair is a tie: say ``--iters``.
- ``confidence.level``: ``high`` (both tests pass and the winner is faster in every unit),
  ``medium`` (both pass, the winner loses some units), ``tie``.
- ``mechanism``: the measured phases (per layer, the median over iterations of the slowest
  rank's time in that phase, token-weighted over steps) mapped onto :data:`~.verdict.MECHANISMS`: exchange + plan
  -> planning; prefetch -> weight copies; expert compute -> padding (the padded share of the
  busiest rank's rows) and expert-compute imbalance (the rest); row movement (dispatch after the
  plan, and combine) -> inter-node and intra-node bytes, split by the Plan's token bytes of each
  class (on local gloo both classes cross loopback: bytes weigh alike); the backward pass, when
  replayed, is spread over those terms in the forward's proportions (it is not timed by phase); a
  strategy that drops entries is credited the work it skipped (``dropped rows``, as simulated).
  Kernel fixed costs are not separated from the phases they sit in. The phase maxima need not sum
  to the layer time (different ranks are slowest in different phases): the terms name the largest
  measured difference, and its share of the margin.
  A tie names none (``mechanism`` None): its sentence gives the two times and the spread that
  makes them one, never a term of a difference it does not resolve.
- ``why``: one sentence from the measured numbers, saying it was measured on local gloo.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from moonep_sim.analysis.stepstats import batch_weights
from moonep_sim.analysis.verdict import MECHANISMS, confidence, fmt_time, reading, terms

#: the measured phases each term is read from (replay_rank.PHASES: dispatch includes exchange and plan)
PHASE_TERMS = {"planning": "exchange + plan", "weight copies": "prefetch",
               "expert-compute imbalance": "expert (real rows)", "padding": "expert (padded rows)",
               "inter-node bytes": "dispatch rows + combine (inter-node share of token bytes)",
               "intra-node bytes": "dispatch rows + combine (intra-node share of token bytes)"}

_FIG_KEYS = ("inter_node_bytes", "intra_node_bytes", "rows_max", "rows_mean", "crit_rows", "crit_real_rows",
             "padded", "dropped", "entries", "weight_copies", "migrations", "weight_bytes", "duplicates_avoided",
             "hops")


def _item_weights(per_layer: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Weight of each (step, layer) entry: its step's token weight over that step's layer count
    (so a figure is the token-weighted mean over steps of the mean over layers, as the time is)."""
    bis = sorted({int(e["batch"]) for e in per_layer})
    tok = [next(int(e["tokens"]) for e in per_layer if int(e["batch"]) == b) for b in bis]
    wb = dict(zip(bis, batch_weights(tok)))
    n = {b: sum(1 for e in per_layer if int(e["batch"]) == b) for b in bis}
    return np.asarray([wb[int(e["batch"])] / n[int(e["batch"])] for e in per_layer], float)


def measured_figures(rep: Mapping[str, Any]) -> dict[str, Any]:
    """One strategy's measured figures per layer (us and the Plan's counts), read from its replay
    report (``replay_rank``'s per-strategy report): ``time_us``, the measured phases
    (``phases_us``), the Plan's figures averaged over entries, and ``terms_us`` (module docstring)."""
    pl = list(rep.get("per_layer") or [])
    w = _item_weights(pl) if pl else np.ones(0)

    def avg(xs) -> float:
        return float(np.dot(w, np.asarray(xs, float))) if len(xs) else 0.0

    # each phase: the median over iterations of the slowest rank's time
    ph = {p: avg([1e3 * float(e["phase_ms_median"][p]) for e in pl])
          for p in ("exchange", "plan", "dispatch", "prefetch", "expert", "combine", "backward")}
    if not rep.get("backward"):
        ph["backward"] = 0.0  # (the untimed no-op between combine and the step's end)
    figs = {k: avg([float((e.get("plan_figures") or {}).get(k, 0.0)) for e in pl]) for k in _FIG_KEYS}
    plan_us = ph["exchange"] + ph["plan"]
    rows_us = max(ph["dispatch"] - plan_us, 0.0)
    f = dict(figs, time_us=1e3 * float(rep["layer_ms_median"]), plan_us=plan_us, compute_us=ph["expert"],
             comm_us=rows_us + ph["prefetch"] + ph["combine"], weights_us=ph["prefetch"], fixed_us=0.0,
             nic_GBps=1.0, nvlink_GBps=1.0)  # loopback: bytes of either class weigh alike
    t = terms(f)
    fwd = sum(t.values())
    if ph["backward"] > 0 and fwd > 0:  # not timed by phase: spread in the forward's proportions
        t = {k: v * (fwd + ph["backward"]) / fwd for k, v in t.items()}
    f.update(terms_us=t, phases_us=ph)
    return f


def _units(reps: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, list[float]], list[float] | None, str]:
    """strategy -> measured time per unit (us), their weights, and the unit's name: one sample per
    iteration for one step, else per (step, iteration) pair, weighted by the step's tokens."""
    first = next(iter(reps.values()))
    bis = sorted({int(e["batch"]) for e in first.get("per_layer") or []})
    if len(bis) <= 1:
        return {n: [1e3 * float(x) for x in r["layer_ms_samples"]] for n, r in reps.items()}, None, "measured iteration"
    out, wts = {}, None
    for n, r in reps.items():
        pl = r["per_layer"]
        it_B = np.asarray([np.mean([e["iter_total_ms"] for e in pl if int(e["batch"]) == b], axis=0) for b in bis])
        out[n] = [1e3 * float(x) for x in it_B.ravel()]
        if wts is None:
            tok = [next(int(e["tokens"]) for e in pl if int(e["batch"]) == b) for b in bis]
            wts = [float(x) for x in np.repeat(batch_weights(tok), it_B.shape[1])]
    return out, wts, "measured step-iteration"


def measured_verdict(reps: Mapping[str, Mapping[str, Any]], *, where: str = "") -> dict[str, Any] | None:
    """The verdict of a gloo replay. reps: strategy -> its replay report (interleaved strategies:
    matched iterations). where: how it ran, e.g. ``"2 local processes, hidden 64, float32"`` (the
    sentences say "measured on local gloo (...)"). None without strategies."""
    from moonep_sim.analysis.ranking import ALPHA, resolved_pairs

    if not reps:
        return None
    figs = {n: measured_figures(r) for n, r in reps.items()}
    times = {n: f["time_us"] for n, f in figs.items()}
    ok = sorted((t, n) for n, t in times.items() if not figs[n]["dropped"])
    everyone = sorted((t, n) for n, t in times.items())
    order = [n for _, n in (ok or everyone)] + [n for _, n in everyone if ok and figs[n]["dropped"]]
    w = order[0]
    at = f"measured on local gloo{f' ({where})' if where else ''}"
    base = {"measured": True, "basis": at, "terms_us": {n: figs[n]["terms_us"] for n in order},
            "phases_us": {n: figs[n]["phases_us"] for n in order}}
    if len(order) == 1:
        return {"winner": w, "runner_up": None, "margin": 0.0, "tie": False, "mechanism": None,
                "confidence": {"level": "single strategy", "units": 0, "unit": "measured iteration",
                               "basis": "one strategy replayed"},
                "why": f"{w} is the only strategy replayed ({at}: {fmt_time(times[w])} per layer)", "others": [],
                "tied_with": [], **base}
    series, weights, unit = _units(reps)
    samples = {n: reps[n]["layer_ms_samples"] for n in order}
    sign = {frozenset((p["faster"], p["slower"])): p for p in resolved_pairs(samples, ALPHA)}
    n_it = len(samples[w])

    def conf_of(r: str, margin: float) -> dict[str, Any]:
        """The confidence over the units, then the sign test over matched iterations: a pair it
        does not resolve is a measured tie."""
        conf = confidence(series, w, r, margin, unit, weights)
        p = sign[frozenset((w, r))]
        resolved = bool(p["resolved"]) and p["faster"] == w
        conf = dict(conf, sign_test={"p": p["p"], "resolved": resolved, "iterations": n_it, "alpha": ALPHA},
                    basis=f"{conf['basis']}; sign test over {n_it} matched iterations: p={p['p']:.3g}, "
                          f"{'resolved' if resolved else 'not resolved'} (Holm over {len(sign)} pair(s) at {ALPHA:g})")
        if conf["level"] != "tie" and not resolved:
            conf["level"] = "tie"
        return conf

    others = [reading(w, r, figs, times, lambda m, r=r: conf_of(r, m), "layer", at=at, measured_as=PHASE_TERMS)
              for r in order[1:]]
    top = others[0]
    return {"winner": w, "runner_up": top["strategy"], "margin": top["margin"], "tie": top["tie"],
            "confidence": top["confidence"], "mechanism": top["mechanism"], "why": top["why"],
            "tied_with": [o["strategy"] for o in others if o["tie"]], "others": others, **base}


def replay_where(rep: Mapping[str, Any]) -> str:
    """How a replay ran, for the verdict's sentences (ranks, hidden, ffn, dtype, iterations)."""
    r = rep["strategies"][next(iter(rep["strategies"]))] if "strategies" in rep else rep
    return (f"{r['world_size']} processes, hidden {r['hidden']}, ffn {r['ffn']}, {r['dispatch_dtype']}, "
            f"{r['iters']} iterations")


__all__ = ["MECHANISMS", "PHASE_TERMS", "measured_figures", "measured_verdict", "replay_where"]
