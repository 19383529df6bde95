"""The verdict of a comparison: who wins, by how much, how sure, and which term of the results
accounts for the margin -- computed from the figures, never written in advance.

A verdict is the dict ``{winner, runner_up, margin, tie, confidence, mechanism, why}`` (plus
``others``: the same reading of every other strategy against the winner, and ``terms_us``):

- ``winner``: the fastest strategy that drops no row (a strategy that drops did less work; it
  wins only when every strategy drops). ``runner_up``: the next one. ``margin``: runner-up time /
  winner time - 1.
- ``tie``: the difference is within the spread over the units compared (steps, else layers; and
  seeds where there are several), or under :data:`TIE` (identical figures).
- ``confidence``: ``{level, basis, units}``; ``level`` is ``high`` (the winner is faster in
  every unit and the spread excludes a tie), ``medium`` (the spread excludes a tie but the winner
  loses some units), ``tie``, or ``single sample`` (one unit: no spread to measure; ``basis`` says
  the margin was judged against :data:`TIE` only).
- ``mechanism``: the term of :data:`MECHANISMS` whose difference between the two strategies is
  the largest part of the margin; ``why``: one sentence built from the figures behind it. A tie
  names no mechanism (None) and its sentence states the two times and the spread, never a
  difference it does not resolve; a byte term whose volumes are the same says the time differs
  for the same bytes (never "moves X where the other moves X").

Terms (microseconds, per layer; they sum to the layer time): the simulated layer time is split
along its critical rank (:func:`critical_breakdown`: planning,
dispatch and waiting for copied weights, expert compute, combine). Its communication part is split
into kernel fixed costs (the simulator's ``*.fixed`` spans), weight copies (prefetch, migrate and
gradient-reduce spans) and token traffic, the last apportioned to inter-node and intra-node bytes
by each class's bytes over its bandwidth (forward bytes of the Plan, diagonal excluded). Expert
compute is split into padding (the padded share of the critical rank's rows) and the rest
(expert-compute imbalance: rows on the busiest rank). A strategy that drops a fraction f of its
entries is credited the work it skipped (its compute and token traffic x f / (1 - f)) as a
negative ``dropped rows`` term, so the terms still sum to its time. The decomposition is an
attribution, not a counterfactual simulation: it names the largest term, and its share.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

#: relative difference under which two times are the same figure (a planner that planned no copy
#: and its base strategy); the same threshold as winner-map cells
TIE = 5e-4

#: the mechanisms a verdict may name, and what each term measures
MECHANISMS = {
    "inter-node bytes": "token rows crossing nodes (NIC / RDMA), over the NIC bandwidth",
    "intra-node bytes": "token rows crossing NVLink inside a node, over the NVLink bandwidth",
    "weight copies": "expert weights moved before compute (prefetch, migrate) and gradients sent home",
    "expert-compute imbalance": "expert compute of the critical rank's real rows (the busiest rank's load)",
    "planning": "the planning step: count all-gather, planner work (host planners included)",
    "kernel fixed costs": "fixed launch costs of the dispatch and combine kernels, per hop",
    "padding": "expert compute of padded rows (capacity slots, token padding, static buffers)",
    "dropped rows": "work a strategy skipped by dropping entries (credited to it, negative)",
}

_GiB, _MiB = 2**30, 2**20


# -- the critical rank's parts of a simulated layer ----------------------------------------------
CRITICAL_PARTS = ("plan", "dispatch + wait", "compute", "combine")


def critical_breakdown(sim: dict[str, Any]) -> dict[str, float]:
    """Split a simulated layer time along its critical rank (the one whose expert compute ends
    last): planning, then dispatch and any wait for copied weights until its compute starts, its
    expert compute, and the combine until the layer ends. The parts sum to ``layer_time_us``."""
    stages = sim.get("stages") or []
    if len(stages) > 1:  # a chain: each stage's window read on its own critical rank, summed
        keys = zip(CRITICAL_PARTS, ("plan_us", "dispatch_us", "compute_us", "combine_us"))
        return {part: sum(float(s[k]) for s in stages) for part, k in keys}
    total = float(sim["layer_time_us"])
    pr = sim.get("per_rank") or {}
    starts, durs = pr.get("compute_start_us"), pr.get("compute_us")
    if not starts or not durs:
        return {"plan": 0.0, "dispatch + wait": 0.0, "compute": 0.0, "combine": total}
    ends = np.asarray(starts, float) + np.asarray(durs, float)
    r = int(np.argmax(ends))
    pre = float(starts[r])
    plan = min(float(sim.get("phases_us", {}).get("plan", 0.0)), pre)
    comp = float(durs[r])
    return {"plan": plan, "dispatch + wait": pre - plan, "compute": comp, "combine": max(total - pre - comp, 0.0)}


# -- one strategy's figures, from its Plan and its simulation -------------------------------------------
def figures(plan, sim: Mapping[str, Any], topo=None) -> dict[str, Any]:
    """The figures a verdict reads, for one (strategy, layer): from the Plan (bytes per class,
    rows, drops, copies) and the simulator's result dict (critical-path parts, phase spans).
    ``topo``: the topology (its NVLink / NIC bandwidths weigh the byte classes)."""
    crit = critical_breakdown(dict(sim))
    phases = {k: float(v) for k, v in (sim.get("phases_us") or {}).items()}
    return {
        "time_us": float(sim["layer_time_us"]),
        "plan_us": crit["plan"], "compute_us": crit["compute"], "comm_us": crit["dispatch + wait"] + crit["combine"],
        "fixed_us": _fixed_us(plan, topo),
        "weights_us": sum(v for k, v in phases.items() if k.split(".")[0] in ("prefetch", "migrate", "grad_reduce")),
        **_plan_figures(plan, topo, "forward")}


def _plan_figures(plan, topo, direction: str) -> dict[str, Any]:
    """The figures of :func:`figures` read from the Plan alone (token and weight bytes per link
    class of ``direction``'s phases, rows, drops, copies) and the topology's bandwidths."""
    from moonep_sim.plan.kinds import PhaseKind

    tok = {"intra": 0, "inter": 0}
    wts = {"intra": 0, "inter": 0}
    for p in plan.phases(direction):
        intra, inter = p.split_bytes(plan.cluster)
        d = tok if p.kind in (PhaseKind.DISPATCH, PhaseKind.COMBINE) else wts
        d["intra"] += intra
        d["inter"] += inter
    real, padded_R = plan.real_rows_R(), plan.rows_R()
    r = int(np.argmax(padded_R)) if padded_R.size else 0
    return {
        "inter_node_bytes": tok["inter"], "intra_node_bytes": tok["intra"],
        "weight_inter_bytes": wts["inter"], "weight_intra_bytes": wts["intra"],
        "rows_max": float(real.max()) if real.size else 0.0,
        "rows_mean": float(real.mean()) if real.size else 0.0,
        "crit_rows": float(padded_R[r]) if padded_R.size else 0.0,
        "crit_real_rows": float(real[r]) if real.size else 0.0,
        "padded": int(plan.padded), "dropped": int(plan.dropped), "entries": int(plan.num_tokens * plan.top_k),
        "weight_copies": int(plan.weight_copies), "migrations": int(plan.migrate_expert_X.size),
        "weight_bytes": int((plan.weight_copies + plan.migrate_expert_X.size) * plan.costs.weight_bytes),
        "duplicates_avoided": int(plan.entry_dup_TK.sum()), "hops": len(plan.hops),
        "nic_GBps": float(getattr(topo, "nic_bandwidth_GBps", 0.0) or 0.0),
        "nvlink_GBps": float(getattr(topo, "nvlink_bandwidth_GBps", 0.0) or 0.0),
    }


def _fixed_us(plan, topo) -> float:
    """Fixed kernel costs on a rank's path: launches per direction x (dispatch + combine fixed
    cost) from the topology (phase spans of ``*.fixed`` stretch over every rank's wait)."""
    if topo is None or not hasattr(topo, "kernel_dispatch_fixed_us"):
        return 0.0
    from moonep_sim.sim.kernels import kernel_launches

    n = kernel_launches(plan.kernel, len(plan.hops))
    return float(n * (topo.kernel_dispatch_fixed_us + topo.kernel_combine_fixed_us))


def mean_figures(items: Sequence[Mapping[str, Any]], weights: Sequence[float] | None = None) -> dict[str, Any]:
    """Figures averaged over units (layers or steps): every number is the mean (weighted by
    ``weights``, e.g. tokens per step, when given); a mapping of numbers (a chain's ``terms_us``)
    is averaged key by key."""
    if not items:
        return {}

    def avg(xs):
        return float(np.mean(xs)) if weights is None else float(np.average(xs, weights=np.asarray(weights, float)))

    out: dict[str, Any] = {}
    for k, v in items[0].items():
        if isinstance(v, Mapping):
            out[k] = {m: avg([float((it.get(k) or {}).get(m, 0.0)) for it in items]) for m in v}
        else:
            out[k] = avg([float(it.get(k, 0.0)) for it in items])
    return out


# -- a chain of stages (several layers, a backward): figures per stage, summed --------------------
#: figures of a chain summed over its stages (times, and bytes moved forward and backward)
_STAGE_SUMMED = ("time_us", "plan_us", "compute_us", "comm_us", "fixed_us", "weights_us", "inter_node_bytes",
                 "intra_node_bytes", "weight_inter_bytes", "weight_intra_bytes")


def stage_figures(plan, stage: Mapping[str, Any], topo=None) -> dict[str, Any]:
    """The figures of one stage of a chain (one direction of one layer): its window's parts on its
    critical rank (:func:`moonep_sim.sim.analysis.stage_parts`) and its Plan's figures for that
    direction (the kernel launch spans and weight flows come from the simulation)."""
    return {"time_us": float(stage["end_us"]) - float(stage["start_us"]), "plan_us": float(stage["plan_us"]),
            "compute_us": float(stage["compute_us"]),
            "comm_us": float(stage["dispatch_us"]) + float(stage["combine_us"]),
            "fixed_us": float(stage["fixed_us"]), "weights_us": float(stage["weights_us"]),
            **_plan_figures(plan, topo, stage["direction"])}


def chain_figures(plans: Sequence[Any], sim: Mapping[str, Any], topo=None) -> dict[str, Any]:
    """The figures of a simulated chain (``plans`` in the order simulated; ``sim`` the simulator's
    result dict). One stage: :func:`figures`. Several: times and bytes summed over stages, counts
    (rows, copies, drops, duplicates avoided) summed over the forward stages (once per layer),
    hops the most of any layer, and ``terms_us``: the sum of each stage's :func:`terms` (they sum
    to ``time_us``), which :func:`terms` then returns as they are."""
    stages = sim.get("stages") or []
    if len(stages) <= 1:
        return figures(plans[0], sim, topo)
    per = [stage_figures(plans[int(s["layer"])], s, topo) for s in stages]
    fwd = [f for f, s in zip(per, stages) if s["direction"] == "forward"] or per
    out: dict[str, Any] = {}
    for k in per[0]:
        if k in _STAGE_SUMMED:
            out[k] = float(sum(f[k] for f in per))
        elif k == "hops":
            out[k] = max(f[k] for f in per)
        elif k in ("nic_GBps", "nvlink_GBps"):
            out[k] = per[0][k]
        else:
            out[k] = sum(f[k] for f in fwd)
    out["time_us"] = float(sim["layer_time_us"])
    ts = [terms(f) for f in per]
    out["terms_us"] = {m: float(sum(t[m] for t in ts)) for m in MECHANISMS}
    return out


def layer_series(sim: Mapping[str, Any]) -> list[float]:
    """A chain's time per layer: the windows of its stages (forward and backward) summed by layer."""
    by: dict[int, float] = {}
    for s in sim.get("stages") or []:
        by[int(s["layer"])] = by.get(int(s["layer"]), 0.0) + float(s["end_us"]) - float(s["start_us"])
    return [by[k] for k in sorted(by)]


def terms(f: Mapping[str, Any]) -> dict[str, float]:
    """The layer time split into the :data:`MECHANISMS` terms (us); they sum to ``time_us``. A
    chain's figures carry them summed over its stages (``terms_us``, :func:`chain_figures`)."""
    if isinstance(f.get("terms_us"), Mapping):
        return {k: float(f["terms_us"].get(k, 0.0)) for k in MECHANISMS}
    comm = max(float(f["comm_us"]), 0.0)
    fixed = min(float(f["fixed_us"]), comm)
    weights = min(float(f["weights_us"]), comm - fixed)
    token = comm - fixed - weights
    wi = f["inter_node_bytes"] / max(f["nic_GBps"], 1e-9) if f["inter_node_bytes"] else 0.0
    wa = f["intra_node_bytes"] / max(f["nvlink_GBps"], 1e-9) if f["intra_node_bytes"] else 0.0
    inter = token * wi / (wi + wa) if wi + wa > 0 else 0.0
    intra = token - inter
    comp = float(f["compute_us"])
    pad_share = (f["crit_rows"] - f["crit_real_rows"]) / f["crit_rows"] if f["crit_rows"] > 0 else 0.0
    padding = comp * min(max(pad_share, 0.0), 1.0)
    imb = comp - padding
    drop = f["dropped"] / f["entries"] if f["entries"] else 0.0
    skipped = 0.0
    if 0 < drop < 1:  # the work it skipped, put back into the terms it would have grown, then credited
        g = drop / (1 - drop)
        skipped = (imb + inter + intra) * g
        imb, inter, intra = imb * (1 + g), inter * (1 + g), intra * (1 + g)
    return {"inter-node bytes": inter, "intra-node bytes": intra, "weight copies": weights,
            "expert-compute imbalance": imb, "planning": float(f["plan_us"]), "kernel fixed costs": fixed,
            "padding": padding, "dropped rows": -skipped}


# -- the verdict -------------------------------------------------------------------------------------
def fmt_time(us: float) -> str:
    """A duration in microseconds as a short human figure (us, ms or s, three digits)."""
    if abs(us) >= 1e6:
        return f"{us / 1e6:.3g} s"
    return f"{us / 1e3:.3g} ms" if abs(us) >= 1000 else f"{us:.3g} us"


def verdict_line(v: Mapping[str, Any] | None) -> str:
    """The verdict as one line (tables, the demo; ``"measured " +`` it: a replay's measured verdict)."""
    if not v:
        return "verdict: -"
    if v["runner_up"] is None:
        return f"verdict: {v['why']}"
    head = (f"verdict: {' = '.join([v['winner'], *v.get('tied_with', [])])} tie" if v["tie"] else
            f"verdict: {v['winner']} wins by {100 * v['margin']:.1f}% over {v['runner_up']}")
    mech = f", mechanism: {v['mechanism']}" if v.get("mechanism") else ""
    fl = "".join(f" ({n} flagged: {', '.join(c)})" for n, c in (v.get("flags") or {}).items())
    return f"{head} (confidence: {v['confidence']['level']}{mech}): {v['why']}{fl}"


def _bytes(b: float) -> str:
    return f"{b / _GiB:.3g} GiB" if b >= _GiB / 4 else f"{b / _MiB:.3g} MiB"


def tie_sentence(w: str, r: str, tw_us: float, tr_us: float, per: str, conf: Mapping[str, Any],
                 margin: float) -> str:
    """A tie's sentence: the two times and why they count as one; no mechanism (a tie names no
    difference to explain)."""
    if margin <= TIE:
        return f"{w} and {r} take the same time ({fmt_time(tw_us)} per {per}): a tie"
    return (f"{w} and {r} tie: {fmt_time(tw_us)} against {fmt_time(tr_us)} per {per}, a difference within the "
            f"spread ({conf['basis']})")


def explain(mech: str, w: str, r: str, fw: Mapping[str, Any], fr: Mapping[str, Any], tw: dict, tr: dict,
         unit: str) -> str:
    """One sentence from the numbers behind ``mech`` (w the faster, r the slower strategy)."""
    d = tr[mech] - tw[mech]
    per = f" per {unit}"
    if mech in ("inter-node bytes", "intra-node bytes"):
        key = "inter_node_bytes" if mech == "inter-node bytes" else "intra_node_bytes"
        where = "across nodes" if key == "inter_node_bytes" else "over NVLink inside nodes"
        if _bytes(fw[key]) == _bytes(fr[key]):  # the same volume: the time differs, not the bytes
            return (f"{r}'s token traffic {where} takes {fmt_time(d)} longer{per} for the same "
                    f"{_bytes(fw[key])} of token rows as {w} ({fw['hops']:.0f} hop(s) against {fr['hops']:.0f})")
        s = f"{w} moves {_bytes(fw[key])} of token rows {where}{per} where {r} moves {_bytes(fr[key])}"
        dup = fw["duplicates_avoided"] - fr["duplicates_avoided"]
        if dup > 0 and fw[key] < fr[key]:
            kind = "node deduplication" if fw["hops"] > 1 else "deduplication"
            s += f" ({kind}: {dup:,.0f} more duplicate rows not sent)"
        elif fw["hops"] != fr["hops"]:
            s += f" ({fw['hops']:.0f} hop(s) against {fr['hops']:.0f})"
        return s + f"; {fmt_time(d)} of token traffic"
    if mech == "weight copies":
        slow, fast, fs, ff = (r, w, fr, fw) if d > 0 else (w, r, fw, fr)
        return (f"{slow} copies {fs['weight_copies'] + fs['migrations']:.3g} expert(s){per} ({_bytes(fs['weight_bytes'])} of "
                f"weights, {fmt_time(abs(d))} longer on the critical path) where {fast} copies "
                f"{ff['weight_copies'] + ff['migrations']:.3g} ({_bytes(ff['weight_bytes'])})")
    if mech == "expert-compute imbalance":
        return (f"{r}'s busiest rank computes {fr['rows_max']:,.0f} rows{per} where {w}'s computes {fw['rows_max']:,.0f} "
                f"(max/mean {fr['rows_max'] / max(fr['rows_mean'], 1e-12):.2f} against "
                f"{fw['rows_max'] / max(fw['rows_mean'], 1e-12):.2f}); {fmt_time(d)} of expert compute")
    if mech == "planning":
        return f"{r} spends {fmt_time(tr[mech])} planning{per} where {w} spends {fmt_time(tw[mech])}"
    if mech == "kernel fixed costs":
        return (f"{r} pays {fmt_time(tr[mech])} of fixed kernel costs{per} ({fr['hops']:.0f} hop(s)) where {w} pays "
                f"{fmt_time(tw[mech])} ({fw['hops']:.0f} hop(s))")
    if mech == "padding":
        return (f"{r}'s critical rank computes {fr['crit_rows']:,.0f} rows of which {fr['crit_rows'] - fr['crit_real_rows']:,.0f} "
                f"are padding{per}, where {w}'s computes {fw['crit_rows']:,.0f} ({fw['crit_rows'] - fw['crit_real_rows']:,.0f} "
                f"padding); {fmt_time(d)} of expert compute")
    # dropped rows: the faster one skipped work
    return (f"{w} drops {fw['dropped']:,.0f} of {fw['entries']:,.0f} entries{per} (about {fmt_time(-tw[mech])} of work "
            f"skipped) where {r} drops {fr['dropped']:,.0f}")


def attribute(fw: Mapping[str, Any], fr: Mapping[str, Any]) -> tuple[str, float, dict[str, float], dict[str, float]]:
    """(mechanism, its share of the difference, winner's terms, runner-up's terms): the term whose
    difference (runner-up - winner) is largest."""
    tw, tr = terms(fw), terms(fr)
    diffs = {k: tr[k] - tw[k] for k in MECHANISMS}
    mech = max(diffs, key=lambda k: diffs[k])
    total = float(fr["time_us"]) - float(fw["time_us"])
    return mech, (diffs[mech] / total if total > 0 else 0.0), tw, tr


def confidence(series: Mapping[str, Sequence[float]] | None, w: str, r: str, margin: float, unit: str,
               weights: Sequence[float] | None = None) -> dict[str, Any]:
    """How sure the winner is: from the paired per-unit relative differences (r - w) / w (weighted
    by ``weights``, e.g. tokens per step); one unit: judged against :data:`TIE` only."""
    a = np.asarray((series or {}).get(w, []), float)
    b = np.asarray((series or {}).get(r, []), float)
    n = int(min(a.size, b.size))
    if n <= 1:
        return {"level": "tie" if margin <= TIE else "single sample", "units": n, "unit": unit,
                "basis": (f"one {unit} (one seed): no spread to measure; the margin ({100 * margin:.2f}%) was judged "
                          f"against the {100 * TIE:.2g}% threshold for identical figures only")}
    d = (b[:n] - a[:n]) / np.maximum(a[:n], 1e-12)
    wt = np.asarray(weights[:n], float) if weights is not None and len(weights) >= n else np.ones(n)
    wt = wt / wt.sum()
    m = float(np.sum(wt * d))
    sd = float(np.sqrt(np.sum(wt * (d - m) ** 2)))
    n_eff = 1.0 / float(np.sum(wt ** 2))
    half = float(2.0 * sd / np.sqrt(n_eff))
    wins = int(np.sum(d > TIE))
    basis = (f"over {n} {unit}s: {r} slower by {100 * m:.2f}% +- {100 * half:.2f}% (2 x the spread of the paired "
             f"differences / sqrt(n)); {w} faster in {wins} of {n}")
    if margin <= TIE or m - half <= 0:
        level = "tie"
    elif wins == n:
        level = "high"
    else:
        level = "medium"
    return {"level": level, "units": n, "unit": unit, "basis": basis, "mean_difference": m, "spread": half}


def verdict(figs: Mapping[str, Mapping[str, Any]], *, series: Mapping[str, Sequence[float]] | None = None,
            unit: str = "layer", weights: Sequence[float] | None = None,
            flags: Sequence[Mapping[str, Any]] = (), per: str = "layer") -> dict[str, Any] | None:
    """The verdict over strategies. figs: strategy -> its figures (:func:`figures`, or their
    :func:`mean_figures` over units); series: strategy -> time per unit (for the spread); unit:
    what one series entry is (``step``, ``layer``, ``seed``); per: what one figure is (the
    sentences say "per layer"); flags: the result's flags (the
    winner's and runner-up's codes are repeated in the verdict). None without strategies."""
    if not figs:
        return None
    times = {n: float(f["time_us"]) for n, f in figs.items()}
    ok = sorted((t, n) for n, t in times.items() if not figs[n].get("dropped") and np.isfinite(t))
    everyone = sorted((t, n) for n, t in times.items() if np.isfinite(t))
    order = [n for _, n in (ok or everyone)] + [n for _, n in everyone if ok and figs[n].get("dropped")]
    w = order[0]
    if len(order) == 1:
        return {"winner": w, "runner_up": None, "margin": 0.0, "tie": False,
                "confidence": {"level": "single strategy", "units": 0, "unit": unit, "basis": "one strategy compared"},
                "mechanism": None, "why": f"{w} is the only strategy compared", "others": [], "terms_us": {
                    w: terms(figs[w])}}
    others = [reading(w, r, figs, times, lambda m, r=r: confidence(series, w, r, m, unit, weights), per)
              for r in order[1:]]
    top = others[0]
    if top["tie"]:  # tied at the top: say what the tied strategies beat, and by what
        nxt = next((o for o in others if not o["tie"]), None)
        if nxt is not None:
            top = dict(top, why=f"{top['why']}; {w} beats {nxt['strategy']} by {100 * nxt['margin']:.1f}% "
                                f"({nxt['mechanism']}): {nxt['why']}")
    codes = {n: sorted({f["code"] for f in flags if f.get("strategy") == n}) for n in (w, top["strategy"])}
    return {"winner": w, "runner_up": top["strategy"], "margin": top["margin"], "tie": top["tie"],
            "confidence": top["confidence"], "mechanism": top["mechanism"], "why": top["why"],
            "flags": {n: c for n, c in codes.items() if c},
            "tied_with": [o["strategy"] for o in others if o["tie"]], "others": others,
            "terms_us": {n: terms(figs[n]) for n in order}}


def reading(w: str, r: str, figs: Mapping[str, Mapping[str, Any]], times: Mapping[str, float], conf_of,
            per: str, *, at: str = "", measured_as: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Strategy ``r`` read against the winner ``w`` (an entry of a verdict's ``others``): margin,
    tie, confidence (``conf_of(margin)``), mechanism, its share of the difference and the sentence.
    ``at``: where a measured verdict's times come from, said in its sentences, which name the
    measured phase of the mechanism (``measured_as``); empty for a simulated verdict."""
    margin = times[r] / times[w] - 1.0 if times[w] > 0 else 0.0
    mech, share, tw, tr = attribute(figs[w], figs[r])
    conf = conf_of(margin)
    tie = conf["level"] == "tie"
    pre = f"{at}: " if at else ""
    if figs[r].get("dropped") and not figs[w].get("dropped"):
        tie = False
        conf = dict(conf if at else {"level": "", "units": conf["units"], "unit": conf["unit"]}, level="drops rows",
                    basis=f"{r} dropped entries: it did less work and never wins")
        why = f"{pre}{r} drops {figs[r]['dropped']:,.0f} entries per {per} and never wins"
        if margin > 0:
            why += "; " + explain(mech, w, r, figs[w], figs[r], tw, tr, per)
        else:
            mech, why = "dropped rows", why + f" (it is faster by {-100 * margin:.1f}%: it did less work)"
    elif tie:
        why = (f"a measured tie ({at}): " if at else "") + tie_sentence(w, r, times[w], times[r], per, conf, margin)
    else:
        how = f"measured {(measured_as or {}).get(mech, mech)}; " if at else ""
        why = (pre + explain(mech, w, r, figs[w], figs[r], tw, tr, per)
               + f" ({how}of a {fmt_time(times[r] - times[w])} difference per {per})")
    return {"strategy": r, "margin": float(margin), "tie": tie, "confidence": conf,
            "mechanism": None if tie else mech, "share": 0.0 if tie else float(share), "why": why}


# -- hooks: reports ---------------------------------------------------------------------------------
def compare_verdict(rep: Mapping[str, Any]) -> dict[str, Any] | None:
    """The verdict of a compare report: per strategy, figures averaged over its layers (each
    layer entry's ``figures``); spread over steps when the report has per-step times, else layers."""
    strat = rep.get("strategies") or {}
    figs, series = {}, {}
    for n, s in strat.items():
        items = [e["figures"] for e in s.get("layers", []) if "figures" in e]
        if not items:
            return None
        figs[n] = mean_figures(items)
        figs[n]["time_us"] = float(s["sim"]["layer_time_us_mean"])
        series[n] = [float(e["sim"]["layer_time_us"]) for e in s["layers"]]
    unit, weights = "layer", None
    steps = _step_series(strat)
    if steps is not None:
        series, weights = steps
        unit = "step"
    return verdict(figs, series=series, unit=unit, weights=weights, flags=rep.get("flags") or ())


def simulate_verdict(runs: Mapping[str, Sequence[tuple[Sequence[Any], Mapping[str, Any]]]], topo=None,
                     tokens: Sequence[float | None] | None = None,
                     flags: Sequence[Mapping[str, Any]] = (), unit: str = "step") -> dict[str, Any] | None:
    """The verdict of :meth:`~moonep_sim.experiments.Scenario.simulate`. runs: strategy -> per
    unit (a step, or a seed's draw: ``unit``), (the plans chained, in the order simulated; the
    simulator's result dict). Each chain is read stage by stage (:func:`chain_figures`); the
    figures are the token-weighted mean over units (``tokens``: per unit, as the result's
    ``layer_time_us``). The spread behind tie and confidence is over the units (token-weighted)
    when there are several, else over the chain's layers (each layer's forward and backward
    windows), else none (one layer of one step: judged against :data:`TIE`). The sentences speak
    per step for a chain, per layer for one layer."""
    if not runs:
        return None
    figs, t_series, l_series = {}, {}, {}
    chain = any(len(sim.get("stages") or []) > 1 for steps in runs.values() for _, sim in steps)
    n_steps = min(len(steps) for steps in runs.values())
    w = [float(t) for t in tokens] if tokens and all(t for t in tokens) and len(tokens) == n_steps else None
    for n, steps in runs.items():
        fs = [chain_figures(plans, sim, topo) for plans, sim in steps]
        if chain:  # a step whose chain is one stage (a layer without tokens in it) carries its terms too
            for f in fs:
                f.setdefault("terms_us", terms(f))
        figs[n] = mean_figures(fs, w)
        t_series[n] = [float(sim["layer_time_us"]) for _, sim in steps]
        l_series[n] = layer_series(steps[0][1]) if chain else []
    if n_steps > 1:
        series, weights = t_series, w
    elif chain and min(len(v) for v in l_series.values()) > 1:
        series, unit, weights = l_series, "layer", None
    else:
        series, unit, weights = t_series, "layer", None
    return verdict(figs, series=series, unit=unit, weights=weights, flags=flags, per="step" if chain else "layer")


def _step_series(strat: Mapping[str, Any]):
    """(strategy -> time per step, tokens per step) when the report carries a per-step series of
    several steps (compare's ``per_step``, :mod:`moonep_sim.experiments.compare`: lists keyed by field)."""
    out, w = {}, None
    for n, s in strat.items():
        ps = s.get("per_step")
        if not isinstance(ps, Mapping) or len(ps.get("layer_time_us") or []) <= 1:
            return None
        out[n] = [float(x) for x in ps["layer_time_us"]]
        w = [float(x or 1) for x in ps.get("tokens") or [1] * len(out[n])]
    return out, w


def sweep_verdicts(rep: Mapping[str, Any]) -> list[dict[str, Any] | None]:
    """One verdict per sweep point (from each strategy's ``figures`` at that point; one seed)."""
    strat = rep.get("strategies") or {}
    n_pts = len(rep.get("values") or [])
    out = []
    for i in range(n_pts):
        figs = {}
        for n, s in strat.items():
            f = (s.get("figures") or [None] * n_pts)[i]
            if f is None:
                figs = {}
                break
            figs[n] = f
        out.append(verdict(figs, unit="point", flags=rep.get("flags") or ()) if figs else None)
    return out


#: the terms a step verdict may name (a step's figures are whole-step totals, not per-phase spans)
STEP_MECHANISMS = {
    "exposed communication": "communication not hidden behind compute on the slowest rank",
    "host time": "the GPU waiting on the host: kernel launches, syncs and host-proxy calls (layout steps)",
    "compute": "the slowest rank's compute (expert imbalance, padding and the rest of the model)",
    "memory": "the runner-up runs out of GPU memory (OOM)",
    "dropped rows": "the runner-up is faster only by dropping entries (less work: it never wins)",
}


def no_fit_verdict(strategies: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The verdict when every strategy runs out of memory: no winner (an OOM strategy never wins);
    ``why`` names the smallest need and, where the step found one (``fit`` in its figures: the
    memory account re-run under each candidate change, ``moonep_sim.step.memory_fit``), the
    smallest change that fits."""
    n, f = min(strategies.items(), key=lambda kv: (float(kv[1]["peak_memory_bytes"]), kv[0]))
    cap = float(f["gpu_memory_bytes"])
    why = (f"no strategy fits in the GPU's {cap / _GiB:.3g} GiB: the smallest need is {n}'s "
           f"{float(f['peak_memory_bytes']) / _GiB:.3g} GiB on its busiest GPU")
    fit = f.get("fit")
    why += (f"; the smallest change that fits ({n}): {fit['change']} ({fit['detail']}): "
            f"{float(fit['peak_bytes']) / _GiB:.3g} GiB" if fit else
            "; no single change or pair of changes tried (recompute, ZeRO, more pipeline stages, fp8 weights or "
            "KV) fits")
    return {"winner": None, "runner_up": None, "margin": 0.0, "tie": False, "no_fit": True, "fit": fit,
            "confidence": {"level": "no fit", "units": 0, "unit": "step", "basis": "every strategy is out of memory"},
            "mechanism": "memory", "why": why, "others": []}


def step_verdict(strategies: Mapping[str, Mapping[str, Any]],
                 flags: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any] | None:
    """The verdict of one step (``moonep-sim step``'s figures per strategy): the fastest strategy
    that fits in memory and drops no entry; the mechanism is the step term (:data:`STEP_MECHANISMS`) whose difference
    is the larger part of the margin. One step: confidence judged against :data:`TIE` only."""
    if strategies and all(f.get("oom") for f in strategies.values()):
        return no_fit_verdict(strategies)
    # those that fit before those that run out of memory; within each, those that drop nothing
    # before those that drop entries (less work: they never win, as in compare's verdict); then by time
    order = [n for *_, n in sorted((bool(f.get("oom")), bool(f.get("dropped")), float(f["step_time_us"]), n)
                                   for n, f in strategies.items())]
    if not order:
        return None
    w = order[0]
    fw = strategies[w]
    others = []
    for r in order[1:]:
        fr = strategies[r]
        margin = float(fr["step_time_us"]) / max(float(fw["step_time_us"]), 1e-12) - 1.0
        conf = confidence(None, w, r, margin, "step")
        d_comm = float(fr.get("exposed_comm_us", 0)) - float(fw.get("exposed_comm_us", 0))
        d_comp = float(fr.get("compute_us", 0)) - float(fw.get("compute_us", 0))
        d_host = float(fr.get("host_bound_us", 0)) - float(fw.get("host_bound_us", 0))  # inside exposed_comm_us
        tie = conf["level"] == "tie"
        if fr.get("oom") and not fw.get("oom"):
            mech, tie = "memory", False
            why = (f"{r} needs {float(fr['peak_memory_bytes']) / _GiB:.3g} GiB on its busiest GPU, more than its "
                   f"{float(fr['gpu_memory_bytes']) / _GiB:.3g} GiB (OOM), where {w} needs "
                   f"{float(fw['peak_memory_bytes']) / _GiB:.3g} GiB")
        elif (fr.get("dropped") and not fw.get("dropped") and bool(fr.get("oom")) == bool(fw.get("oom"))
              and float(fr["step_time_us"]) < float(fw["step_time_us"])):
            mech, tie = "dropped rows", False
            why = (f"{r} is {fmt_time(float(fw['step_time_us']) - float(fr['step_time_us']))} faster per step but drops "
                   f"{int(fr['dropped']):,} of {int(fr.get('entries', 0)):,} entries over the step's MoE layers "
                   f"(less work: it never wins) where {w} drops none")
        elif tie:
            mech, why = None, f"{w} and {r} take the same step time ({fmt_time(float(fw['step_time_us']))}): a tie"
        elif d_host > 0 and d_host >= max(d_comm - d_host, d_comp):
            mech, why = "host time", (f"{r}'s GPUs wait {fmt_time(float(fr['host_bound_us']))} per step on the host (launches, "
                                      f"syncs, host-proxy calls) where {w}'s wait {fmt_time(float(fw.get('host_bound_us', 0)))}")
        elif d_comm >= d_comp:
            mech, why = "exposed communication", (f"{r} leaves {fmt_time(float(fr['exposed_comm_us']))} of communication exposed per step where {w} leaves "
                                                  f"{fmt_time(float(fw['exposed_comm_us']))}")
        else:
            mech, why = "compute", (f"{r}'s slowest rank computes for {fmt_time(float(fr['compute_us']))} per step where {w}'s computes for "
                                    f"{fmt_time(float(fw['compute_us']))} (rows max/mean {float(fr.get('rows_max_mean', 0)):.2f} "
                                    f"against {float(fw.get('rows_max_mean', 0)):.2f})")
        others.append({"strategy": r, "margin": margin, "tie": tie, "confidence": conf, "mechanism": mech,
                       "share": 0.0, "why": why})
    if not others:
        return {"winner": w, "runner_up": None, "margin": 0.0, "tie": False,
                "confidence": {"level": "single strategy", "units": 0, "unit": "step", "basis": "one strategy"},
                "mechanism": None, "why": f"{w} is the only strategy compared", "others": []}
    top = others[0]
    codes = {n: sorted({f["code"] for f in flags if f.get("strategy") == n}) for n in (w, top["strategy"])}
    return {"winner": w, "runner_up": top["strategy"], "margin": top["margin"], "tie": top["tie"],
            "confidence": top["confidence"], "mechanism": top["mechanism"], "why": top["why"],
            "flags": {n: c for n, c in codes.items() if c},
            "tied_with": [o["strategy"] for o in others if o["tie"]], "others": others}


__all__ = ["MECHANISMS", "STEP_MECHANISMS", "no_fit_verdict", "step_verdict", "TIE", "attribute", "chain_figures",
           "compare_verdict", "confidence", "figures", "layer_series", "mean_figures", "simulate_verdict",
           "stage_figures", "reading", "sweep_verdicts", "terms", "tie_sentence", "verdict", "verdict_line"]
