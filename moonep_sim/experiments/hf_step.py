"""Step-level fidelity: measured training steps of a Hugging Face MoE model over gloo against the
simulator on the ``local-gloo`` topology (``launch/train_hf.py --compare-sim``).

The rank program (:mod:`moonep_sim.integrations.train`) times every training step of every
strategy (interleaved: matched samples) and records the routing of the timed steps. Here each
timed step is simulated with the *same* routing (the recorded trace, step by step), the same
strategy and options, the same model shape (E, K, H, the expert width, float32 or float64 rows
and weights as the gloo Buffer moves them) and the same ranks:

    simulated step = MoE layers simulated  (the recorded step's Plans of every MoE layer chained,
                                            forward then backward: ``Scenario.simulate(backward=True)``,
                                            i.e. ``moonep_sim.sim.simulate_layers``)
                   + the rest of the step measured  (the same forward + backward with the MoE layers
                                            bypassed, the gradient all-reduce and the optimizer step,
                                            each the slowest rank's, from the same run)

so the error lies in the MoE part alone, and both the whole step and the MoE part are reported
(``moe_error``: simulated MoE time against the measured step minus the measured rest). The
simulated figure names the simulator that produced it (``simulator``). Ranking: the matched
per-step samples through :func:`moonep_sim.experiments.ranking.agreement` (the reading
``validate`` uses: resolved pairs by a Holm-corrected sign test).
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping

import numpy as np

from moonep_sim.errors import require

SIMULATOR = ("per-layer simulator, the step's MoE layers chained forward + backward "
             "(moonep_sim.sim.simulate_layers via Scenario.simulate(backward=True)), plus the rest of the step "
             "measured with the MoE layers bypassed")


def step_model(rep: Mapping[str, Any]):
    """The ModelSpec and RowCosts of a train_hf report's model, as the gloo Buffer counts bytes."""
    from moonep_sim.models import custom_model
    from moonep_sim.plan import RowCosts

    sh = rep["model_shape"]
    elem = 8 if rep["dtype"] == "float64" else 4
    H, P = int(sh["hidden"]), int(sh["expert_params"])
    spec = custom_model(sh["num_experts"], sh["top_k"], H, int(sh["expert_ffn"]), name=f"{sh['class']}-H{H}",
                        layers=int(sh["layers"]), moe_layers=len(sh["moe_layers"]))
    return spec, RowCosts(H * elem, H * elem, P * elem, P * elem)


def compare_steps(rep: Mapping[str, Any], topology: str = "local-gloo") -> dict[str, Any]:
    """Simulate every timed step of every strategy of a train_hf report (see the module doc)."""
    from moonep_sim.experiments.compare import topology_info
    from moonep_sim.experiments.ranking import agreement
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
    for n in names:
        t = rep["times_ms"][n]
        sim_moe = []
        topo_info = None
        for s in range(n_steps):
            sc = Scenario(routing=path, model=spec, cluster=(R, G), topology=topology,
                          strategies=[(n, dict(rep["options"].get(n, {})))], steps=str(s), costs=costs)
            res = sc.simulate(backward=True)
            sim_moe.append(float(res.layer_time_us[n]) / 1e3)
            topo_info = topo_info or res.topology
        out["topology"] = topo_info
        rest = [o + y + p for o, y, p in zip(t["other"], t["sync"], t["opt"])]
        meas = list(t["step"])
        simulated = [m + r for m, r in zip(sim_moe, rest)]
        meas_moe = [max(st - r, 0.0) for st, r in zip(meas, rest)]
        m_med, s_med = statistics.median(meas), statistics.median(simulated)
        mm, sm = statistics.median(meas_moe), statistics.median(sim_moe)
        out["strategies"][n] = {
            "measured_ms": m_med, "simulated_ms": s_med, "error": s_med / m_med - 1 if m_med > 0 else None,
            "measured_ms_samples": meas, "simulated_ms_samples": simulated,
            "rest_ms": statistics.median(rest), "measured_moe_ms": mm, "simulated_moe_ms": sm,
            "moe_error": sm / mm - 1 if mm > 0 else None, "simulated_moe_ms_samples": sim_moe,
        }
    if topo_info is None:
        out["topology"] = topology_info(topology)
    errs = [abs(v["error"]) for v in out["strategies"].values() if v["error"] is not None]
    moe = [abs(v["moe_error"]) for v in out["strategies"].values() if v["moe_error"] is not None]
    out["median_abs_error"] = statistics.median(errs) if errs else None
    out["median_abs_moe_error"] = statistics.median(moe) if moe else None
    if len(names) >= 2:
        out["ranking"] = agreement({n: out["strategies"][n]["measured_ms_samples"] for n in names},
                                   {n: out["strategies"][n]["simulated_ms"] for n in names})
    return out


def summary_lines(cs: Mapping[str, Any]) -> list[str]:
    """The comparison as text: one line per strategy, then the error and ranking reading."""
    lines = [f"measured vs simulated step time ({cs['ranks']} ranks, {cs['steps']} steps, topology "
             f"{(cs.get('topology') or {}).get('name', '?')}); simulated by: {cs['simulator']}",
             f"  {'strategy':<12} {'measured':>9} {'simulated':>9} {'error':>7}   {'MoE meas':>8} {'MoE sim':>8} "
             f"{'error':>7}   rest (measured)"]
    for n, v in cs["strategies"].items():
        lines.append(f"  {n:<12} {v['measured_ms']:>7.1f}ms {v['simulated_ms']:>7.1f}ms {_pct(v['error'])}   "
                     f"{v['measured_moe_ms']:>6.1f}ms {v['simulated_moe_ms']:>6.1f}ms {_pct(v['moe_error'])}   "
                     f"{v['rest_ms']:.1f} ms")
    if cs.get("median_abs_error") is not None:
        lines.append(f"  median |error|: step {cs['median_abs_error']:.1%}, MoE part {cs['median_abs_moe_error']:.1%}")
    rk = cs.get("ranking")
    if rk:
        lines.append(f"  measured order: {rk['measured_order_text']}; simulated: {' < '.join(rk['simulated_order'])}; "
                     f"resolved pairs ordered right: {rk['resolved_agree']}/{rk['resolved_pairs']}"
                     + (f" ({'; '.join(rk['disagreements'])})" if rk["disagreements"] else ""))
    return lines


def _pct(v: float | None) -> str:
    return f"{v:>+6.1%}" if v is not None and np.isfinite(v) else "      -"


__all__ = ["SIMULATOR", "compare_steps", "step_model", "summary_lines"]
