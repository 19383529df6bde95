"""Sweeps and winner maps over a trace: the user's own routing, one knob varied.

Notation: R ranks, G GPUs per node, E experts, K top-k, T tokens, B batches (steps).

Every point is a full comparison (:func:`moonep_sim.experiments.compare.compare`): each of the
trace's selected steps is its own batch, and a strategy's figure at the point is the token-weighted
mean over steps of the step's mean over layers (``steps_aggregate`` keeps the median, p90 and worst
step beside it). The knobs (``--over``, and ``--by`` for a winner map):

- any numeric **topology constant** (``nic_bandwidth_GBps``, ``fabric_oversubscription`` ...): the
  routing as recorded, the constant varied (default values: 0.25x .. 4x the preset's);
- ``ranks`` (``ep``): the EP size; every step's tokens are split evenly over R ranks (tokens per
  rank fall as R grows: the trace's batches are what they were). Default: the divisors of E in
  2..64 that every step can feed (at least one token per rank) and G tiles;
- ``gpus_per_node``: the node size on the trace as recorded (default: the divisors of R up to 8);
- ``tokens_per_rank``: the selected steps **concatenated** in recorded order and re-cut into
  batches of ``tokens_per_rank x R`` consecutive tokens; every full batch is costed (a final
  partial batch is left out and counted); values above the trace's tokens per rank are left out;
- ``maxvio``: the trace's own expert popularity **re-weighted**: per layer, ``p_e ∝ (n_e + 1)^a``
  over the layer's per-expert counts ``n_e`` of the selected tokens (a = 1: the recorded popularity,
  a = 0: uniform), ``a`` bisected so the expected maxvio of K distinct experts per token drawn
  from ``p`` hits the target; every token keeps its step and its weights, its experts are redrawn
  (seed per layer and step). The realised maxvio is reported per point (``points[i].realised_maxvio``);
  targets below the sampling-noise floor of the trace's size (the realised maxvio of a uniform
  draw) or above what E/K allows are left out by default and refused when given.

Default values say what they left out and why (``left_out``); explicit values out of range are
refused with one line before any work.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.experiments.compare import compare, topology_info
from moonep_sim.experiments.sweep import MAXVIO_TARGETS, finish, routing_lower_bound, topology_params, winner_of
from moonep_sim.routing.metrics import maxvio
from moonep_sim.routing.trace import LayerRouting

#: the trace knobs that are not topology constants (``ep`` is ``ranks``)
TRACE_KNOBS = ("ranks", "gpus_per_node", "tokens_per_rank", "maxvio")
_ALIASES = {"ep": "ranks", "tokens-per-rank": "tokens_per_rank", "gpus-per-node": "gpus_per_node"}
_SCALE = (0.25, 0.5, 1.0, 2.0, 4.0)


def knob_name(text: str) -> str:
    """``ep`` -> ``ranks``; ``tokens-per-rank`` -> ``tokens_per_rank``; others as given."""
    return _ALIASES.get(text, text)


@dataclass(frozen=True)
class Reweight:
    """The maxvio re-weighting of a trace (see the module doc): per layer id, the log-popularity the
    experts are redrawn from; ``seed`` seeds the draws (per layer and batch)."""

    logp: dict
    seed: int = 0

    def __call__(self, lr: LayerRouting, layer_id: int, batch: int) -> LayerRouting:
        from moonep_sim.routing.generators import sample_topk

        rng = np.random.default_rng(np.random.SeedSequence([int(self.seed), int(layer_id), int(batch), 7]))
        ids, _, _ = sample_topk(self.logp[layer_id], lr.top_k, lr.num_tokens, rng)
        return LayerRouting(ids, lr.topk_weights_TK, lr.num_experts, lr.layer)


def _layer_counts(source, layer_id: int, ranks: int) -> np.ndarray:
    c = np.zeros(source.num_experts, np.int64)
    for b in range(source.num_batches):
        c += source.layer(layer_id, ranks, b).counts_E()
    return c


def _expected_maxvio(logp: np.ndarray, K: int) -> float:
    from moonep_sim.routing.generators import inclusion_probs

    pi = inclusion_probs(logp, K)
    return float(pi.max() / pi.mean() - 1.0)


def reweighted(source, target: float, ranks: int, seed: int = 0):
    """``source`` with every layer's experts redrawn from its re-weighted popularity for ``target``
    maxvio, and the realised maxvio (mean over layers, of all selected tokens' counts)."""
    K = source.top_k
    logp = {}
    for lid in source.layer_ids:
        base = np.log(_layer_counts(source, lid, ranks) + 1.0)
        lo, hi = 0.0, 1.0
        while _expected_maxvio(hi * base, K) < target and hi < 1e3:
            hi *= 2
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _expected_maxvio(mid * base, K) < target else (lo, mid)
        logp[int(lid)] = 0.5 * (lo + hi) * base
    src = dataclasses.replace(source, transform=Reweight(logp, seed), label=f"{source.label}, re-weighted to maxvio "
                                                                             f"{target:g}")
    realised = float(np.mean([maxvio(_layer_counts(src, lid, ranks)) for lid in src.layer_ids]))
    return src, realised


def noise_floor(source, ranks: int, seed: int = 0) -> float:
    """The realised maxvio of a uniform redraw of the trace (its sampling-noise floor at this size)."""
    flat = {int(l): np.zeros(source.num_experts) for l in source.layer_ids}
    src = dataclasses.replace(source, transform=Reweight(flat, seed))
    return float(np.mean([maxvio(_layer_counts(src, l, ranks)) for l in src.layer_ids]))


def recut(source, batch_tokens: int):
    """``source`` with its selected steps concatenated and re-cut into batches of ``batch_tokens``
    consecutive tokens (a final partial batch is dropped); returns (source, tokens left out)."""
    from moonep_sim.routing.steps import StepMode

    ranges = [r for _, rs in source.batches for r in rs]
    total = sum(b - a for a, b in ranges)
    n = total // batch_tokens
    edges = np.cumsum([0] + [b - a for a, b in ranges])
    out = []
    for i in range(n):                     # one iteration per new batch
        lo, hi = i * batch_tokens, (i + 1) * batch_tokens
        part = []
        for (a, b), e0 in zip(ranges, edges[:-1]):
            s, t = max(lo, e0), min(hi, e0 + (b - a))
            if s < t:
                part.append((int(a + s - e0), int(a + t - e0)))
        out.append((i, part))
    mode = StepMode(None, False, f"steps concatenated, re-cut into batches of {batch_tokens} tokens")
    return dataclasses.replace(source, batches=out, batch_tokens=[batch_tokens] * n, steps=mode), int(total - n * batch_tokens)


# -- values -------------------------------------------------------------------------------------------
def check_knob(knob: str, topo) -> None:
    if knob not in TRACE_KNOBS and knob not in topology_params(topo):
        raise ConfigError(f"--over ({knob!r}) must be one of {', '.join(TRACE_KNOBS)} (ep = ranks) or a topology "
                          f"constant: {', '.join(topology_params(topo))}")


def valid_values(sc, knob: str, values: Sequence[float] | None, seed: int = 0) -> tuple[list[float], list[dict]]:
    """The values of ``knob`` for the scenario's trace: the given ones checked (out of range: one
    line), or defaults derived from what is valid at this size, with those left out and why."""
    rs = sc.resolved
    src, R = rs.source, rs.cluster.ranks
    E, K = src.num_experts, src.top_k
    check_knob(knob, rs.topology)
    min_batch = min(t for t in src.batch_tokens)
    total = int(sum(src.batch_tokens))
    cand: list[float]
    reasons: dict[float, str] = {}
    if knob == "ranks":
        cand = [float(v) for v in values] if values is not None else [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
        for v in cand:
            r = int(v)
            if v != r or r < 1:
                reasons[v] = "must be a positive integer"
            elif E % r:
                reasons[v] = f"must divide E={E} (each rank owns E/R experts)"
            # more ranks than a step's tokens is allowed: those ranks hold no token in that step
    elif knob == "gpus_per_node":
        cand = [float(v) for v in values] if values is not None else [1.0, 2.0, 4.0, 8.0]
        for v in cand:
            g = int(v)
            if v != g or g < 1 or R % g:
                reasons[v] = f"must be a positive integer dividing R={R}"
    elif knob == "tokens_per_rank":
        per = total // R
        base = max(1, min_batch // R)
        cand = [float(v) for v in values] if values is not None else sorted(
            {float(max(1, int(base * s))) for s in (0.5, 1, 2, 4, 8)} | ({float(per)} if per >= 1 else set()))
        for v in cand:
            if v != int(v) or v < 1:
                reasons[v] = "must be a positive integer"
            elif int(v) > per:
                reasons[v] = f"must be <= the trace's tokens per rank ({total} tokens / {R} ranks = {per})"
    elif knob == "maxvio":
        floor = noise_floor(src, R, seed)
        cap = E / K - 1
        recorded = float(np.mean([maxvio(_layer_counts(src, l, R)) for l in src.layer_ids]))
        cand = [float(v) for v in values] if values is not None else sorted(set(MAXVIO_TARGETS) | {round(recorded, 3)})
        for v in cand:
            if v <= 1.1 * floor:
                reasons[v] = (f"must be above the sampling-noise floor of this trace's size (a uniform redraw "
                              f"already has maxvio {floor:.3g})")
            elif v > 0.8 * cap:
                reasons[v] = f"must be <= 0.8 x (E/K - 1) = {0.8 * cap:.3g} (an expert takes one selection per token)"
    else:
        v0 = float(getattr(rs.topology, knob))
        cand = [float(v) for v in values] if values is not None else [v0 * s for s in _SCALE]
        for v in cand:
            try:
                dataclasses.replace(rs.topology, **{knob: type(getattr(rs.topology, knob))(v)})
            except (ConfigError, ValueError, TypeError) as e:
                reasons[v] = str(e)
    if values is not None:
        for v in cand:
            require(v not in reasons, f"{knob} value ({v:g}) {reasons.get(v, '')}")
    keep = [v for v in cand if v not in reasons]
    require(len(keep) >= 1, f"sweep over {knob}: no valid value for this trace "
                            f"({'; '.join(f'{v:g} {r}' for v, r in reasons.items())})")
    return keep, [{"value": v, "reason": reasons[v]} for v in cand if v in reasons]


def point(sc, knobs: dict[str, float], seed: int = 0):
    """The resolved scenario of one point (``knobs``: knob -> value): cluster and topology knobs
    re-resolve the scenario; tokens per rank and maxvio transform its source. Returns (resolved,
    point record)."""
    rs0 = sc.resolved
    R, G = rs0.cluster.ranks, rs0.cluster.gpus_per_node
    topo = rs0.topology
    for k, v in knobs.items():
        if k == "ranks":
            R = int(v)
        elif k == "gpus_per_node":
            G = int(v)
        elif k not in ("tokens_per_rank", "maxvio"):
            topo = dataclasses.replace(topo, **{k: type(getattr(topo, k))(v)})
    if "ranks" in knobs and "gpus_per_node" not in knobs and R % min(G, R):
        G = topo.gpus_per_node_for(R)      # the node size the topology gives this EP size
    G = min(G, R)
    rs = dataclasses.replace(sc, cluster=(R, G), topology=topo).resolved
    rec: dict[str, Any] = {"ranks": R, "gpus_per_node": G}
    src = rs.source
    if "tokens_per_rank" in knobs:
        src, left = recut(src, int(knobs["tokens_per_rank"]) * R)
        rec["tokens_left_out"] = left
    if "maxvio" in knobs:
        src, rec["realised_maxvio"] = reweighted(src, float(knobs["maxvio"]), R, seed)
    else:
        rec["realised_maxvio"] = float(np.mean([maxvio(_layer_counts(src, l, R)) for l in src.layer_ids]))
    rec.update(tokens=int(sum(src.batch_tokens)), steps=src.num_batches)
    return dataclasses.replace(rs, source=src), rec


# -- the sweep ----------------------------------------------------------------------------------------
_SERIES = ("layer_time_us", "lower_bound_us", "ratio_to_lower_bound", "phases_us", "dropped", "weight_bytes",
           "rows_max_over_mean", "straggler", "plan_seconds", "sim_seconds", "figures", "steps_aggregate",
           "per_step_layer_time_us")


def trace_sweep(sc, over: str, values: Sequence[float] | None = None, *, fixed: dict[str, float] | None = None,
                seed: int = 0, progress: Callable[[str, int, int], None] | None = None, jobs: int | None = 1,
                cluster: str | None = None) -> dict[str, Any]:
    """Sweep ``over`` on the scenario's trace (see the module doc); ``fixed``: other knobs held at a
    value (a winner map's row). The report has the shape of a generated sweep's
    (:func:`moonep_sim.experiments.sweep.sweep`), each figure the token-weighted mean over steps."""
    from moonep_sim.analysis.verdict import mean_figures

    t0 = time.perf_counter()
    over = knob_name(over)
    vals, left_out = valid_values(sc, over, values, seed)
    pts = [point(sc, {**(fixed or {}), over: v}, seed) for v in vals]   # every point checked before any work
    rs0 = sc.resolved
    names = [n for n, _ in rs0.strategies]
    out_s = {n: {"options": dict(o), **{k: [] for k in _SERIES}} for n, o in rs0.strategies}
    points = []
    for i, ((rs, rec), v) in enumerate(zip(pts, vals)):
        if progress:
            progress(f"{over}={v:g}", i, len(vals))
        rep = compare(rs, jobs=jobs, cluster=cluster)
        points.append({"value": v, **rec, "topology": topology_info(rs.topology)})
        for n in names:
            s, sim = rep["strategies"][n], rep["strategies"][n]["sim"]
            t = s["steps_aggregate"]["layer_time_us"]["token_weighted_mean"]
            at = {"layer_time_us": t, "lower_bound_us": sim["lower_bound_us_mean"],
                  "ratio_to_lower_bound": sim["ratio_to_lower_bound"], "phases_us": sim["phases_us_mean"],
                  "dropped": s["dropped"], "weight_bytes": s["weight_bytes"],
                  "rows_max_over_mean": s["rows_max_over_mean"], "straggler": sim["straggler"],
                  "plan_seconds": s["plan_seconds"],
                  "sim_seconds": float(sum(e["sim"].get("sim_stats", {}).get("wall_seconds", 0.0) for e in s["layers"])),
                  "figures": dict(mean_figures([e["figures"] for e in s["layers"] if "figures" in e]), time_us=t),
                  "steps_aggregate": s["steps_aggregate"], "per_step_layer_time_us": s["per_step"]["layer_time_us"]}
            for k in _SERIES:
                out_s[n][k].append(at[k])
    if progress:
        progress("done", len(vals), len(vals))
    res = dict(head(rs0, over, vals, left_out, fixed, seed), points=points,
               lower_bound_us=routing_lower_bound(out_s, len(vals)), strategies=out_s, warnings=list(rs0.warnings))
    return finish(res, t0)


def head(rs0, over: str, vals: Sequence[float], left_out: list, fixed: dict[str, float] | None,
         seed: int) -> dict[str, Any]:
    """What a trace sweep's report (layer or step level) says of its setup, before its points."""
    return {"kind": "sweep", "over": over, "values": [float(v) for v in vals], "left_out": left_out,
            "routing": rs0.source.describe(), "trace": str(rs0.source.path), "fixed": dict(fixed or {}),
            "model": rs0.source.model.to_dict(), "topology": topology_info(rs0.topology),
            "cluster": {"ranks": rs0.cluster.ranks if over != "ranks" else None,
                        "gpus_per_node": rs0.cluster.gpus_per_node},
            "tokens_per_rank": None, "maxvio": None,
            "seed": seed if (over == "maxvio" or "maxvio" in (fixed or {})) else None,
            "dispatch_dtype": rs0.dispatch_dtype, "method": _METHOD.get(over, _METHOD["topology"])}


_METHOD = {
    "topology": "the trace as recorded, each step its own batch; the topology constant varied",
    "ranks": "every step's tokens split evenly over R ranks (the recorded batches, fewer tokens per rank as R grows)",
    "gpus_per_node": "the trace as recorded, each step its own batch; GPUs per node varied",
    "tokens_per_rank": "the selected steps concatenated in recorded order and re-cut into batches of "
                       "tokens_per_rank x R consecutive tokens (a final partial batch left out)",
    "maxvio": "per layer, expert popularity p_e ∝ (n_e + 1)^a over the trace's own counts, a bisected to the target "
              "(expected maxvio of K distinct draws); every token's experts redrawn, its step and weights kept; "
              "realised maxvio per point",
}


def trace_winner_map(sc, over: str, values: Sequence[float] | None, by: str, by_values: Sequence[float], *,
                     seed: int = 0, sweep: Callable[..., dict[str, Any]] | None = None, **run: Any) -> dict[str, Any]:
    """The fastest strategy per cell over two knobs of a trace: one :func:`trace_sweep` (or ``sweep``,
    e.g. the step level's) of ``over`` per value of ``by`` (any knob :func:`trace_sweep` takes),
    combined by :func:`moonep_sim.analysis.winner.winner_map`; ``run``: the sweeps' progress, jobs
    and cluster."""
    by = knob_name(by)
    over = knob_name(over)
    require(by != over, f"--by ({by}) must differ from --over ({over})")
    bys, _ = valid_values(sc, by, by_values, seed)
    vals, _ = valid_values(sc, over, values, seed)
    for b in bys:       # every cell checked before any work
        for v in vals:
            point(sc, {by: b, over: v}, seed)
    return winner_of([(float(b), (sweep or trace_sweep)(sc, over, vals, fixed={by: b}, seed=seed, **run))
                      for b in bys], by)


__all__ = ["Reweight", "TRACE_KNOBS", "check_knob", "knob_name", "noise_floor", "point", "recut", "reweighted",
           "trace_sweep", "trace_winner_map", "valid_values"]
