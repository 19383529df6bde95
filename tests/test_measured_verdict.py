"""The measured verdict of a gloo replay (moonep_sim.analysis.measured_verdict): from the replay's
own figures, a win only where both the spread over measured units and the sign test resolve it,
and the mechanism read from the measured phase behind the margin.

The first tests build replay reports whose cause is known by construction (no process, no timing);
the slow ones replay for real on 2 local ranks, where the cause dominates by construction (large
hidden: a copied expert's weights cost far more than the rows)."""

from __future__ import annotations

import pytest

from moonep_sim.analysis.measured_verdict import measured_figures, measured_verdict
from moonep_sim.analysis.ranking import agreement

PH = ("exchange", "plan", "dispatch", "prefetch", "expert", "combine", "backward", "total")


def _entry(batch=0, tokens=64, iters=(1.0,) * 8, *, exchange=0.1, plan=0.1, rows=0.2, prefetch=0.0, expert=0.3,
           combine=0.2, inter=0, intra=4096, crit_rows=32, crit_real_rows=32, dropped=0, copies=0):
    ph = {"exchange": exchange, "plan": plan, "dispatch": exchange + plan + rows, "prefetch": prefetch,
          "expert": expert, "combine": combine, "backward": 0.0}
    ph["total"] = sum(v for k, v in ph.items() if k != "dispatch") + rows
    figs = {"inter_node_bytes": inter, "intra_node_bytes": intra, "rows_max": crit_real_rows, "rows_mean": 16.0,
            "crit_rows": crit_rows, "crit_real_rows": crit_real_rows, "padded": crit_rows - crit_real_rows,
            "dropped": dropped, "entries": 128, "weight_copies": copies, "migrations": 0,
            "weight_bytes": copies * 3 * 2**20, "duplicates_avoided": 0, "hops": 1}
    return {"batch": batch, "tokens": tokens, "iter_total_ms": list(iters), "phase_ms_median": ph,
            "phases": {p: {"max_ms": v, "mean_ms": v} for p, v in ph.items()}, "plan_figures": figs}


def _rep(entries, samples):
    return {"layer_ms_median": float(sorted(samples)[len(samples) // 2]), "layer_ms_samples": list(samples),
            "backward": False, "per_layer": entries}


FAST = [1.0, 1.02, 0.99, 1.01, 1.0, 0.98, 1.03, 1.0]
SLOW = [2.0, 2.1, 1.9, 2.05, 2.0, 1.95, 2.02, 2.0]


@pytest.mark.parametrize("slow_kw, mechanism", [
    ({"prefetch": 1.0, "copies": 1}, "weight copies"),
    ({"plan": 1.1}, "planning"),
    ({"expert": 1.3, "crit_rows": 64, "crit_real_rows": 64}, "expert-compute imbalance"),
    ({"expert": 1.3, "crit_rows": 256, "crit_real_rows": 32}, "padding"),
    ({"rows": 1.0, "combine": 0.4, "inter": 2**20, "intra": 4096}, "inter-node bytes"),
    ({"rows": 1.0, "combine": 0.4, "inter": 0, "intra": 2**20}, "intra-node bytes"),
])
def test_the_measured_phase_behind_the_margin_is_named(slow_kw, mechanism):
    reps = {"a": _rep([_entry(iters=FAST)], FAST), "b": _rep([_entry(iters=SLOW, **slow_kw)], SLOW)}
    v = measured_verdict(reps, where="2 processes")
    assert (v["winner"], v["runner_up"], v["tie"]) == ("a", "b", False)
    assert v["mechanism"] == mechanism, v["terms_us"]
    assert v["margin"] == pytest.approx(2.0 / 1.0 - 1.0)
    assert v["confidence"]["level"] == "high" and v["confidence"]["sign_test"]["resolved"]
    assert v["why"].startswith("measured on local gloo (2 processes)")
    assert v["measured"] is True
    # the same winner and a '<' in the measured ranking the compare --real table prints
    rk = agreement({n: r["layer_ms_samples"] for n, r in reps.items()}, {"a": 1.0, "b": 2.0})
    assert rk["measured_order"][0] == v["winner"] and rk["resolved"] == ["a < b"]


def test_terms_are_the_measured_phases_in_us():
    f = measured_figures(_rep([_entry(prefetch=0.5, expert=0.4, crit_rows=40, crit_real_rows=30)], FAST))
    t = f["terms_us"]
    assert t["weight copies"] == pytest.approx(500.0)
    assert t["planning"] == pytest.approx(200.0)
    assert t["padding"] == pytest.approx(400.0 * 10 / 40) and t["expert-compute imbalance"] == pytest.approx(300.0)
    assert t["intra-node bytes"] == pytest.approx(400.0) and t["inter-node bytes"] == 0.0
    assert f["time_us"] == pytest.approx(1000.0)


def test_too_few_iterations_for_the_sign_test_is_a_tie_saying_why():
    """3 matched iterations: the sign test cannot resolve a pair (p >= 0.25) however clear the spread."""
    reps = {"a": _rep([_entry(iters=[1.0, 1.0, 1.0])], [1.0, 1.0, 1.0]),
            "b": _rep([_entry(iters=[2.0, 2.1, 1.9], prefetch=1.0, copies=1)], [2.0, 2.1, 1.9])}
    v = measured_verdict(reps)
    assert v["tie"] and v["confidence"]["level"] == "tie" and v["tied_with"] == ["b"]
    assert "not resolved" in v["confidence"]["basis"] and v["why"].startswith("a measured tie")
    assert v["mechanism"] is None and "cop" not in v["why"]  # a tie names no mechanism of a difference


def test_overlapping_samples_are_a_tie():
    a = [1.0, 1.3, 0.9, 1.2, 1.0, 1.1, 0.95, 1.25]
    b = [1.1, 1.0, 1.2, 0.9, 1.3, 1.0, 1.05, 1.15]
    v = measured_verdict({"a": _rep([_entry(iters=a)], a), "b": _rep([_entry(iters=b)], b)})
    assert v["tie"] and v["confidence"]["level"] == "tie"


def test_a_strategy_that_drops_never_wins():
    reps = {"a": _rep([_entry(iters=SLOW)], SLOW), "b": _rep([_entry(iters=FAST, dropped=40)], FAST)}
    v = measured_verdict(reps)
    assert v["winner"] == "a" and v["runner_up"] == "b" and not v["tie"]
    assert v["confidence"]["level"] == "drops rows" and v["mechanism"] == "dropped rows"


def test_several_steps_spread_over_steps_and_iterations():
    """Two steps: the units are (step, iteration) pairs, token-weighted."""
    ea = [_entry(0, 100, FAST), _entry(1, 300, FAST)]
    eb = [_entry(0, 100, SLOW, prefetch=1.0, copies=1), _entry(1, 300, SLOW, prefetch=1.0, copies=1)]
    v = measured_verdict({"a": _rep(ea, FAST), "b": _rep(eb, SLOW)})
    assert v["confidence"]["unit"] == "measured step-iteration" and v["confidence"]["units"] == 16
    assert v["mechanism"] == "weight copies" and not v["tie"]


def test_the_replay_program_prints_the_measured_verdict_under_the_summaries():
    from moonep_sim.experiments.ranks.replay_rank import _summaries

    reps = {"a": _rep([_entry(iters=FAST)], FAST), "b": _rep([_entry(iters=SLOW, plan=1.1)], SLOW)}
    for n, r in reps.items():
        r.update(strategy=n, options={}, world_size=2, tokens=64, hidden=32, ffn=64, layers=[0], bytes_sent=1,
                 correct=True, max_abs_err=0.0, phases={p: {"max_ms": 1.0, "mean_ms": 1.0} for p in PH})
    rep = {"strategies": reps, "verdict": measured_verdict(reps, where="2 processes")}
    last = _summaries(rep).splitlines()[-1]
    assert last.startswith("measured verdict: a wins by 100.0% over b (confidence: high, mechanism: planning): "
                           "measured on local gloo (2 processes)")


def test_one_strategy_is_stated():
    v = measured_verdict({"a": _rep([_entry()], FAST)})
    assert v["runner_up"] is None and "only strategy replayed" in v["why"]


SKEWED = "gen:model=mixtral-8x7b,tokens-per-rank=32,maxvio=3"


@pytest.mark.slow
def test_a_real_replay_names_the_weight_copies_moonep_pays():
    """moonep copies a hot expert (24 MiB of weights at hidden 1024) to even a skewed tiny layer whose
    rows are a few hundred KiB: on local gloo alltoall wins, and the measured verdict names weight
    copies from the measured prefetch (the replay's JSON carries it)."""
    from moonep_sim.experiments import Scenario

    res = Scenario(routing=SKEWED, cluster="2/2", strategies="alltoall,moonep", layers=[0]).replay(
        nproc=2, iters=8, warmup=1, hidden=1024, ffn=2048, check=False, timeout_s=300)
    v = res.verdict
    assert v == res.to_dict()["verdict"]
    moon = res.to_dict()["strategies"]["moonep"]
    assert moon["per_layer"][0]["weight_copies"] >= 1 and "phase_ms_median" in moon["per_layer"][0]
    assert "measured on local gloo (2 processes, hidden 1024" in v["why"]
    assert v["phases_us"]["moonep"]["prefetch"] > v["phases_us"]["alltoall"]["prefetch"]
    if v["tie"]:   # measured times on a loaded machine may tie: the verdict then names no winner's mechanism
        assert {v["winner"], *v["tied_with"]} == {"alltoall", "moonep"}
        return
    assert v["winner"] == "alltoall" and v["runner_up"] == "moonep"
    assert v["mechanism"] == "weight copies", v["terms_us"]
    assert "moonep copies 1 expert" in v["why"]


@pytest.mark.slow
def test_compare_real_shows_the_measured_verdict_beside_the_simulated_one(tmp_path):
    from moonep_sim.experiments import Scenario
    from moonep_sim.report.html import render_html
    from moonep_sim.report.tables import verdict_lines

    res = Scenario(routing=SKEWED, cluster="2/2", strategies="alltoall,moonep", layers=[0]).compare(
        real=True, nproc=2, iters=8, hidden=1024, ffn=2048, timeout_s=300)
    rep = res.to_dict()
    mv = rep["real"]["verdict"]
    assert mv["measured"]
    rk = rep["real"]["ranking"]
    assert rk["measured_order"][0] == mv["winner"]  # the same times: the measured order's head
    lines = verdict_lines(rep)
    assert lines[0].startswith("verdict: ") and "measured on local gloo" not in lines[0]  # the simulated one
    if mv["tie"]:  # measured times on a loaded machine may tie: the verdict then names no mechanism
        assert {mv["winner"], *mv["tied_with"]} == {"alltoall", "moonep"} and mv["mechanism"] is None
        assert any(ln.startswith("measured verdict: ") and " tie" in ln for ln in lines)
    else:
        assert mv["winner"] == "alltoall" and mv["mechanism"] == "weight copies"
        assert "alltoall < moonep" in rk["resolved"]
        assert any(ln.startswith("measured verdict: ") and "mechanism: weight copies" in ln for ln in lines)
    html = render_html(rep, None)
    assert "Measured verdict (local gloo)" in html and "measured on local gloo" in html
