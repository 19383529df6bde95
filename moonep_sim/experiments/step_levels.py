"""Every layer-level question asked of whole steps: ``compare``, ``sweep`` and winner maps at
``level="step"`` (``--level step``).

Notation: R ranks, T tokens per rank, P points of a sweep.

- **compare** at step level is :meth:`Scenario.step <moonep_sim.experiments.Scenario.step>`: the
  same :class:`~moonep_sim.experiments.step.StepResult` (figures, flags, verdict).
- **sweep** at step level: at every point the scenario of that point (generated: the point's
  ranks, topology and target maxvio, the spec's tokens per rank and seed; a trace: the point of
  :func:`moonep_sim.experiments.trace_sweep.point`) runs its whole step per strategy
  (:func:`moonep_sim.experiments.step.run_step`); the report keeps per strategy and point the step
  figures (:data:`SERIES`), and per point the step verdict
  (:func:`moonep_sim.analysis.verdict.step_verdict`). A trace of several recorded steps is one
  step each; a point's figure is then the token-weighted mean over them (times), the largest
  (peak memory) and any (OOM), and ``aggregates[i]`` keeps the point's per-step aggregate
  (:func:`moonep_sim.analysis.stepstats.step_aggregates`: mean, median, p90, worst, wins).
- **winner maps** at step level: one step sweep per row; a cell's winner is the point's step
  verdict's winner (the fastest strategy that fits in memory), see
  :func:`moonep_sim.analysis.winner.cell`.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.experiments.compare import topology_info
from moonep_sim.experiments.step import StepOptions, run_step, steps_document
from moonep_sim.experiments.sweep import at, check_rows, head, setup, winner_of

#: the levels compare, sweep and winner maps run at
LEVELS = ("layer", "step")
#: the per-point series a step-level sweep keeps per strategy
SERIES = ("step_time_us", "exposed_comm_us", "compute_us", "comm_share", "tokens_per_s_per_gpu", "mfu",
          "peak_memory_bytes", "gpu_memory_bytes", "oom")
_TIMES = ("step_time_us", "exposed_comm_us", "compute_us", "comm_us", "comm_share", "tokens_per_s_per_gpu", "mfu",
          "rows_max_mean", "padded_rows_per_rank", "real_rows_per_rank", "copies_per_layer")


def check_level(level: str) -> str:
    require(level in LEVELS, f"level ({level!r}) must be layer or step")
    return level


def scalars(f: dict[str, Any]) -> dict[str, Any]:
    """A strategy's step figures without the per-layer records and the memory parts."""
    return {k: v for k, v in f.items() if not isinstance(v, (list, dict)) and k != "wall_seconds"}


def point_step(sc, opts: StepOptions, *, jobs: int | None = 1, cluster: str | None = None,
               progress=None) -> dict[str, Any]:
    """Every strategy's step at one point (``sc``: a Scenario or its Resolved): ``figures`` (strategy
    -> scalar step figures; several recorded steps combined, see the module doc), ``flags``,
    ``verdict``, ``setup`` and ``steps`` (the recorded steps it ran)."""
    from moonep_sim.analysis.verdict import step_verdict

    res = run_step(sc, opts, progress=progress, jobs=jobs, cluster=cluster)
    doc = steps_document(res)   # its flags: every recorded step's, each once
    docs = doc.get("steps") or [doc]
    names = list(res[0].strategies)
    if len(docs) == 1:
        figs = {n: scalars(docs[0]["strategies"][n]) for n in names}
        verdict = docs[0]["verdict"]
    else:
        w = np.array([float(d["setup"].get("step_tokens") or 1) for d in docs])
        figs = {}
        for n in names:
            per = [scalars(d["strategies"][n]) for d in docs]
            f = dict(per[0])
            for k in _TIMES:
                if all(isinstance(p.get(k), (int, float)) for p in per):
                    f[k] = float(np.average([float(p[k]) for p in per], weights=w))
            f["peak_memory_bytes"] = max(float(p["peak_memory_bytes"]) for p in per)
            f["oom"] = any(bool(p["oom"]) for p in per)
            for k in ("dropped", "entries"):  # over every recorded step
                f[k] = int(sum(int(p.get(k) or 0) for p in per))
            f["steps"] = len(per)
            figs[n] = f
        verdict = step_verdict(figs, doc["flags"])
    return {"figures": figs, "flags": doc["flags"], "verdict": verdict, "setup": docs[0]["setup"], "steps": len(docs),
            "aggregate": doc.get("aggregate")}


def _report(setup_head: dict[str, Any], names: Sequence[str], options: dict, points: list, runs: list,
            opts: StepOptions, t0: float) -> dict[str, Any]:
    from moonep_sim.analysis.winner import dedup_flags

    out_s = {n: {"options": dict(options[n]), **{k: [] for k in SERIES}, "figures": []} for n in names}
    for r in runs:
        for n in names:
            f = r["figures"][n]
            for k in SERIES:
                out_s[n][k].append(f.get(k))
            out_s[n]["figures"].append(f)
    first = runs[0]["setup"] if runs else {}
    rep = dict(setup_head, level="step", step=dict(opts.to_dict(), context=first.get("context"),
                                             tokens_per_rank=first.get("tokens_per_rank")),
               points=points, strategies=out_s, verdicts=[r["verdict"] for r in runs],
               aggregates=[r.get("aggregate") for r in runs], standin_skew=first.get("standin_skew"),
               flags=dedup_flags([f for r in runs for f in r["flags"]]))
    rep["seconds"] = time.perf_counter() - t0
    return rep


def step_sweep(sc, ax, opts: StepOptions, *, progress: Callable[[str, int, int], None] | None = None,
               jobs: int | None = 1, cluster: str | None = None) -> dict[str, Any]:
    """A generated sweep (``ax``: :class:`~moonep_sim.experiments.sweep.SweepAxis`) at step level."""
    t0 = time.perf_counter()
    require(opts.tokens_per_rank is None, "step tokens per rank must not be set in a sweep: the generator spec's "
                                          "tokens per rank (--tokens-per-rank) set the batch")
    st = setup(sc, ax)
    scs = [_point_scenario(sc, st, v) for v in st.axis.values]
    for p in scs:   # every point checked before any work
        _check_point(p, opts)
    points, runs = [], []
    for i, (v, p) in enumerate(zip(st.axis.values, scs)):
        if progress:
            progress(f"{st.axis.over}={v:g}", i, len(scs))
        rs = p.resolved
        runs.append(point_step(p, opts, jobs=jobs, cluster=cluster))
        points.append({"value": float(v), "ranks": rs.cluster.ranks, "gpus_per_node": rs.cluster.gpus_per_node,
                       "tokens": rs.source.gen.tokens_per_rank * rs.cluster.ranks,
                       "target_maxvio": float(rs.source.gen.maxvio), "topology": topology_info(rs.topology)})
    if progress:
        progress("done", len(scs), len(scs))
    return _report(head(st), [n for n, _ in st.strategies], dict(st.strategies), points, runs, opts, t0)


def _point_scenario(sc, st, v: float):
    """The scenario of one generated sweep point: its ranks, topology and target maxvio."""
    topo = st.topology
    if st.axis.over not in ("maxvio", "ep"):
        topo = dataclasses.replace(topo, **{st.axis.over: type(getattr(topo, st.axis.over))(v)})
    ranks = int(v) if st.axis.over == "ep" else st.ranks
    g = st.gpus_per_node or topo.gpus_per_node_for(ranks)
    spec = st.spec.with_(maxvio=float(v) if st.axis.over == "maxvio" else st.maxvio)
    return dataclasses.replace(sc, routing=spec, cluster=(ranks, g), topology=topo)


def _check_point(sc, opts: StepOptions) -> None:
    """The step options against one point's scenario (mode, tokens, context, static buffers,
    profile), before any work."""
    from moonep_sim.step import read_profile, step_shape

    rs = sc.resolved if hasattr(sc, "resolved") else sc
    src = rs.source
    T = (opts.tokens_per_rank or src.gen.tokens_per_rank) if src.gen is not None else max(
        min(int(t or 0) for t in src.batch_tokens) // rs.cluster.ranks, 1)
    step_shape(src.model, opts.mode, int(T), opts.context)
    names = [n for n, _ in rs.strategies]
    for s, S in dict(opts.static_tokens).items():
        require(s in names, f"static buffer strategy ({s!r}) must be one of the strategies ({', '.join(names)})")
        require(int(S) >= 1, f"static buffer tokens ({S}) of {s} must be >= 1")
        if src.gen is not None:
            require(int(S) >= T, f"static buffer tokens ({S}) of {s} must be >= the tokens per rank ({T})")
    if opts.compute_profile:
        read_profile(opts.compute_profile)


def trace_step_sweep(sc, over: str, values: Sequence[float] | None, opts: StepOptions, *,
                     fixed: dict[str, float] | None = None, seed: int = 0, progress=None, jobs: int | None = 1,
                     cluster: str | None = None) -> dict[str, Any]:
    """A sweep over a trace (:mod:`moonep_sim.experiments.trace_sweep`'s knobs and points) at step
    level; ``fixed``: other knobs held (a winner map's row)."""
    from moonep_sim.experiments.trace_sweep import head as trace_head, knob_name, point, valid_values

    t0 = time.perf_counter()
    require(opts.tokens_per_rank is None, "tokens per rank must not be given with a trace: the trace's tokens over "
                                          "the ranks set the batch")
    over = knob_name(over)
    vals, left_out = valid_values(sc, over, values, seed)
    pts = [point(sc, {**(fixed or {}), over: v}, seed) for v in vals]   # every point checked before any work
    for rs, _ in pts:
        _check_point(rs, opts)
    rs0 = sc.resolved
    points, runs = [], []
    for i, ((rs, rec), v) in enumerate(zip(pts, vals)):
        if progress:
            progress(f"{over}={v:g}", i, len(vals))
        runs.append(point_step(rs, opts, jobs=jobs, cluster=cluster))
        points.append({"value": float(v), **rec, "topology": topology_info(rs.topology)})
    if progress:
        progress("done", len(vals), len(vals))
    return _report(dict(trace_head(rs0, over, vals, left_out, fixed, seed), warnings=list(rs0.warnings)),
                   [n for n, _ in rs0.strategies], dict(rs0.strategies), points, runs, opts, t0)


def check(sc, over: str, values: Sequence[float] | None, opts: StepOptions, *, by: str | None = None,
          by_values: Sequence[float] | None = None, maxvio: float | None = None) -> None:
    """Every point (every cell, with ``by``) of a step-level sweep checked before any work."""
    if sc.is_trace():
        from moonep_sim.experiments.trace_sweep import knob_name, point, valid_values

        over = knob_name(over)
        vals, _ = valid_values(sc, over, values, 0)
        rows: list[dict[str, float]] = [{}]
        if by is not None:
            by = knob_name(by)
            require(by != over, f"--by ({by}) must differ from --over ({over})")
            rows = [{by: b} for b in valid_values(sc, by, by_values, 0)[0]]
        for fixed in rows:
            for v in vals:
                _check_point(point(sc, {**fixed, over: v}, 0)[0], opts)
        return
    ax = sc.sweep_axis(over, values, maxvio=maxvio)
    pairs = [(sc, ax)]
    if by is not None:
        check_rows(sc, ax, by, by_values or [])
        pairs = [at(sc, ax, by, v) for v in by_values or []]
    for r_sc, r_ax in pairs:
        st = setup(r_sc, r_ax)
        for x in st.axis.values:
            _check_point(_point_scenario(r_sc, st, x), opts)


def step_winner_map(sc, over: str, values: Sequence[float] | None, by: str, by_values: Sequence[float],
                    opts: StepOptions, *, maxvio: float | None = None, **run: Any) -> dict[str, Any]:
    """A winner map at step level: one step sweep of ``over`` per value of ``by`` (generated:
    tokens-per-rank, maxvio or ep; a trace: any of its knobs); ``run``: the sweeps' progress, jobs
    and cluster."""
    check(sc, over, values, opts, by=by, by_values=by_values, maxvio=maxvio)  # every cell before any work
    if sc.is_trace():
        from moonep_sim.experiments.trace_sweep import trace_winner_map

        return trace_winner_map(sc, over, values, by, by_values, sweep=partial(trace_step_sweep, opts=opts), **run)
    ax = sc.sweep_axis(over, values, maxvio=maxvio)
    return winner_of([(float(v), step_sweep(*at(sc, ax, by, v), opts, **run)) for v in by_values], by)


__all__ = ["LEVELS", "SERIES", "check", "check_level", "point_step", "scalars", "step_sweep", "step_winner_map",
           "trace_step_sweep"]
