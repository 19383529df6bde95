"""Step-level fidelity: measured training steps of a Hugging Face MoE model over gloo against the
simulator on the ``local-gloo`` topology (``launch/train_hf.py --compare-sim``).

The rank program (:mod:`moonep_sim.integrations.train`) times every training step of every
strategy (interleaved: matched samples) and records the routing of the timed steps. Here each
timed step is simulated with the *same* routing (the recorded trace, step by step), the same
strategy and options, the same model shape (E, K, H, expert width, attention, float32 or float64
rows and weights as the gloo Buffer moves them) and the same ranks, two ways:

- ``step`` (the headline): the step model (``moonep_sim.step`` through ``Scenario.step(mode="train",
  overlap="none")``: every MoE layer's Plan through the layer simulator, composed with the layer
  stack on two streams per rank) gives the step time of its slowest rank; the compute of every op
  but the routed experts (a roofline of the calibrated CPU rates, which knows nothing of
  PyTorch's per-op overhead: ~0.6 ms for a tiny model whose non-MoE ops measure ~10 ms) is taken
  out and the rest of the step *measured* in the same run put in its place (forward + backward
  with the MoE layers bypassed, the gradient all-reduce, the optimizer step; each the slowest
  rank's). The MoE part is then its communication, planning and routed-expert compute.
- ``chain``: the per-layer simulator, the step's MoE layers chained forward then backward
  (``Scenario.simulate(backward=True)``, i.e. ``moonep_sim.sim.simulate_layers``), plus the same
  measured rest.

So the error lies in the MoE part alone; both the whole step and the MoE part are reported
(``moe_error``: the simulated MoE part against the measured step minus the measured rest). The
output names the simulator of every figure (``simulator``). Ranking: the matched per-step samples
through :func:`moonep_sim.analysis.ranking.agreement` (the reading ``validate`` uses: resolved
pairs by a Holm-corrected sign test).
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping

import numpy as np

from moonep_sim.errors import require

SIMULATOR = {
    "step": "step model (moonep_sim.step, Scenario.step mode=train overlap=none), its non-expert compute "
            "replaced by the rest of the step measured with the MoE layers bypassed",
    "chain": "per-layer simulator, the step's MoE layers chained forward + backward (moonep_sim.sim.simulate_layers "
             "via Scenario.simulate(backward=True)), plus the same measured rest",
}


def step_model(rep: Mapping[str, Any]):
    """The ModelSpec and RowCosts of a train_hf report's model, as the gloo Buffer counts bytes."""
    from moonep_sim.models import custom_model
    from moonep_sim.plan import RowCosts

    sh = rep["model_shape"]
    elem = 8 if rep["dtype"] == "float64" else 4
    H, P = int(sh["hidden"]), int(sh["expert_params"])
    stack = dict(sh.get("stack") or {})
    spec = custom_model(sh["num_experts"], sh["top_k"], H, int(sh["expert_ffn"]), name=f"{sh['class']}-H{H}",
                        layers=int(sh["layers"]), moe_layers=len(sh["moe_layers"]), **stack)
    return spec, RowCosts(H * elem, H * elem, P * elem, P * elem)


def compare_steps(rep: Mapping[str, Any], topology: str = "local-gloo") -> dict[str, Any]:
    """Simulate every timed step of every strategy of a train_hf report (see the module doc)."""
    from moonep_sim.analysis.ranking import agreement
    from moonep_sim.experiments.scenario import Scenario

    require("record" in rep, "the train_hf report must carry its recorded routing (run with --record or --compare-sim)")
    spec, costs = step_model(rep)
    R = int(rep["world_size"])
    G = R
    path = rep["record"]["path"]
    names = list(rep["strategies"])
    n_steps = int(rep["record"]["steps"])
    require(n_steps == int(rep["steps"]), f"recorded steps ({n_steps}) must equal the timed steps ({rep['steps']})")
    out: dict[str, Any] = {"simulator": SIMULATOR, "topology": None, "strategies": {}, "model": spec.name,
                           "ranks": R, "steps": n_steps}
    strategies = [(n, dict(rep["options"].get(n, {}))) for n in names]
    step_comm = {n: [] for n in names}
    step_pure = {n: [] for n in names}
    chain = {n: [] for n in names}
    topo_info = None
    for s in range(n_steps):
        sc = Scenario(routing=path, model=spec, cluster=(R, G), topology=topology, strategies=strategies,
                      steps=str(s), costs=costs)
        st = sc.step(mode="train", overlap="none", context=int(rep["seq"]))
        ch = sc.simulate(backward=True)
        topo_info = topo_info or ch.topology
        for n in names:
            f = st.figures[n]
            step_comm[n].append((float(f["step_time_us"]) - _non_expert_compute_us(st.timelines[n],
                                                                                   int(f["slowest_rank"]))) / 1e3)
            step_pure[n].append(float(f["step_time_us"]) / 1e3)
            chain[n].append(float(ch.layer_time_us[n]) / 1e3)
    out["topology"] = topo_info
    for n in names:
        t = rep["times_ms"][n]
        rest = [o + y + p for o, y, p in zip(t["other"], t["sync"], t["opt"])]
        meas = list(t["step"])
        meas_moe = [max(m - r, 0.0) for m, r in zip(meas, rest)]
        m_med, mm = statistics.median(meas), statistics.median(meas_moe)
        e = {"measured_ms": m_med, "measured_ms_samples": meas, "rest_ms": statistics.median(rest),
             "measured_moe_ms": mm, "step_model_pure_ms": statistics.median(step_pure[n])}
        for kind, moe in (("step", step_comm[n]), ("chain", chain[n])):
            sim = [a + r for a, r in zip(moe, rest)]
            s_med, sm = statistics.median(sim), statistics.median(moe)
            e[kind] = {"simulated_ms": s_med, "error": s_med / m_med - 1 if m_med > 0 else None,
                       "simulated_ms_samples": sim, "simulated_moe_ms": sm,
                       "moe_error": sm / mm - 1 if mm > 0 else None}
        e.update(simulated_ms=e["step"]["simulated_ms"], error=e["step"]["error"],
                 simulated_moe_ms=e["step"]["simulated_moe_ms"], moe_error=e["step"]["moe_error"])
        out["strategies"][n] = e
    for kind in ("step", "chain"):
        errs = [abs(v[kind]["error"]) for v in out["strategies"].values() if v[kind]["error"] is not None]
        moe = [abs(v[kind]["moe_error"]) for v in out["strategies"].values() if v[kind]["moe_error"] is not None]
        out[kind] = {"median_abs_error": statistics.median(errs) if errs else None,
                     "median_abs_moe_error": statistics.median(moe) if moe else None}
        if len(names) >= 2:
            out[kind]["ranking"] = agreement({n: out["strategies"][n]["measured_ms_samples"] for n in names},
                                             {n: out["strategies"][n][kind]["simulated_ms"] for n in names})
    out["median_abs_error"] = out["step"]["median_abs_error"]
    out["ranking"] = out["step"].get("ranking")
    return out


def _non_expert_compute_us(timeline, rank: int) -> float:
    """The step model's compute on ``rank`` other than the routed experts' (the ops the measured
    rest of the step replaces): every compute event but ``expert`` / ``expert_bwd``."""
    return float(sum(float(e.end_R[rank] - e.start_R[rank]) for e in timeline.events
                     if e.stream == "compute" and not e.name.startswith("expert")))


def summary_lines(cs: Mapping[str, Any]) -> list[str]:
    """The comparison as text: per strategy the measured step and both simulated figures, then the
    error and ranking reading of each."""
    lines = [f"measured vs simulated step time ({cs['ranks']} ranks, {cs['steps']} steps, topology "
             f"{(cs.get('topology') or {}).get('name', '?')}; medians over steps, slowest rank)",
             f"  step  = {cs['simulator']['step']}", f"  chain = {cs['simulator']['chain']}",
             f"  {'strategy':<11} {'measured':>9} {'step':>8} {'err':>7} {'chain':>8} {'err':>7}   "
             f"{'MoE meas':>8} {'step':>7} {'chain':>7}   rest (meas)"]
    for n, v in cs["strategies"].items():
        a, b = v["step"], v["chain"]
        lines.append(f"  {n:<11} {v['measured_ms']:>7.1f}ms {a['simulated_ms']:>6.1f}ms {_pct(a['error'])} "
                     f"{b['simulated_ms']:>6.1f}ms {_pct(b['error'])}   {v['measured_moe_ms']:>6.1f}ms "
                     f"{a['simulated_moe_ms']:>5.1f}ms {b['simulated_moe_ms']:>5.1f}ms   {v['rest_ms']:.1f} ms")
    for kind in ("step", "chain"):
        k = cs.get(kind) or {}
        if k.get("median_abs_error") is None:
            continue
        line = (f"  {kind}: median |error| {k['median_abs_error']:.1%} (step), {k['median_abs_moe_error']:.1%} "
                "(MoE part)")
        rk = k.get("ranking")
        if rk:
            line += (f"; measured order {rk['measured_order_text']}, simulated {' < '.join(rk['simulated_order'])}, "
                     f"resolved pairs ordered right {rk['resolved_agree']}/{rk['resolved_pairs']}"
                     + (f" ({'; '.join(rk['disagreements'])})" if rk["disagreements"] else ""))
        lines.append(line)
    return lines


STEP_CASES = ("tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek")
STEP_STRATEGIES = ("alltoall", "deepep", "moonep", "costaware")


def validate_steps(models=STEP_CASES, strategies=STEP_STRATEGIES, *, nproc: int = 4, steps: int = 16,
                   batch: int = 2, seq: int = 16, timeout_s: float = 900.0, progress=None,
                   record_dir: str | None = None) -> dict[str, Any]:
    """``moonep-sim validate --level step``: for every model, train ``steps`` interleaved steps of
    every strategy on ``nproc`` local gloo ranks (``launch/train_hf.py``'s rank program, routing
    recorded) and simulate the same steps (:func:`compare_steps`). Returns the points (case,
    strategy, measured, simulated by the step model and by the chain), the per-case rankings and
    the summary (median |error| of each simulator, resolved pairs ordered right), with the load
    average at the start and the end. ``record_dir``: keep each model's recorded routing there
    (``routing-MODEL.safetensors``; default: a temporary folder, removed)."""
    import os
    import tempfile
    import time

    from moonep_sim.integrations.train import launch
    from moonep_sim.io import load_average

    t0 = time.perf_counter()
    load_start = load_average()
    points, per_case, reports = [], [], []
    for i, model in enumerate(models):
        if progress:
            progress(f"{model}: {nproc} ranks, {','.join(strategies)}", i, len(models))
        with tempfile.TemporaryDirectory(prefix="validate-step-") as tmp:
            trace = os.path.join(record_dir or tmp, f"routing-{os.path.basename(model)}.safetensors")
            argv = ["--model", model, "--strategy", ",".join(strategies), "--steps", str(steps), "--batch", str(batch),
                    "--seq", str(seq), "--record", trace, "--quiet"]
            rep = launch(nproc, argv, timeout_s)
            cs = compare_steps(rep)
        reports.append({"train": rep, "compare_sim": cs})
        for n, v in cs["strategies"].items():
            points.append({"case": model, "strategy": n, "measured_ms": v["measured_ms"],
                           "simulated_ms": v["step"]["simulated_ms"], "error": v["step"]["error"],
                           "chain_ms": v["chain"]["simulated_ms"], "chain_error": v["chain"]["error"],
                           "moe_error": v["step"]["moe_error"], "rest_ms": v["rest_ms"]})
        per_case.append({"case": model, **{k: cs[k] for k in ("step", "chain")}})
    if progress:
        progress("done", len(models), len(models))
    summary = {}
    for kind, key in (("step", "error"), ("chain", "chain_error")):
        errs = [abs(p[key]) for p in points if p[key] is not None]
        rk = [c[kind].get("ranking") or {} for c in per_case]
        summary[kind] = {"median_abs_error": statistics.median(errs) if errs else None,
                         "resolved_pairs": sum(r.get("resolved_pairs", 0) for r in rk),
                         "resolved_agree": sum(r.get("resolved_agree", 0) for r in rk),
                         "pairs": sum(r.get("pairs", 0) for r in rk)}
    return {"kind": "fidelity-step", "nproc": nproc, "steps": steps, "strategies": list(strategies),
            "models": list(models), "simulator": SIMULATOR, "points": points, "per_case": per_case,
            "summary": summary, "seconds": time.perf_counter() - t0,
            "load_average": {"start": load_start, "end": load_average()},
            "reports": reports}


def _pct(v: float | None) -> str:
    return f"{v:>+6.1%}" if v is not None and np.isfinite(v) else "      -"


__all__ = ["SIMULATOR", "STEP_CASES", "STEP_STRATEGIES", "compare_steps", "step_model", "summary_lines", "validate_steps"]
