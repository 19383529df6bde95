"""Bar plots label ties as ties (issue 21, item 6): the same figure, or a difference within the
verdict's spread -- simulate, compare and step alike -- with a footnote saying what (tie) means."""

from __future__ import annotations

import pytest

from moonep_sim.report import plots


@pytest.fixture
def figs(monkeypatch):
    out = []
    monkeypatch.setattr(plots, "_save", lambda fig, dest: out.append(fig) or dest)
    return out


def _labels(fig):
    return [t.get_text() for t in fig.axes[0].get_xticklabels()]


def _simulate(verdict):
    return {"kind": "simulate", "topology": {"name": "t"}, "flags": [], "verdict": verdict,
            "strategies": {"a": {"layer_time_us": 100.0, "lower_bound_us": 50.0},
                           "b": {"layer_time_us": 102.0, "lower_bound_us": 50.0},
                           "c": {"layer_time_us": 180.0, "lower_bound_us": 50.0}}}


def test_simulate_bars_label_a_tie_within_the_spread(figs, tmp_path):
    v = {"winner": "a", "runner_up": "b", "tie": True, "tied_with": ["b"],
         "others": [{"strategy": "b", "tie": True}, {"strategy": "c", "tie": False}]}
    plots.simulate_bars(_simulate(v), tmp_path / "s.png")
    assert _labels(figs[-1]) == ["a (tie)", "b (tie)", "c"]  # 2% apart, within the spread: no win drawn
    assert any("within the verdict's spread" in t.get_text() for t in figs[-1].texts)


def test_simulate_bars_without_a_tie_label_none(figs, tmp_path):
    v = {"winner": "a", "runner_up": "b", "tie": False, "tied_with": [],
         "others": [{"strategy": "b", "tie": False}, {"strategy": "c", "tie": False}]}
    plots.simulate_bars(_simulate(v), tmp_path / "s.png")
    assert _labels(figs[-1]) == ["a", "b", "c"]
    assert not any("(tie)" in t.get_text() for t in figs[-1].texts)
    # identical figures are a tie with or without a verdict
    rep = _simulate(None)
    rep["strategies"]["b"]["layer_time_us"] = 100.0
    plots.simulate_bars(rep, tmp_path / "s.png")
    assert _labels(figs[-1]) == ["a (tie)", "b (tie)", "c"]


def test_step_bars_and_compare_bars_read_the_verdict_too(figs, tmp_path):
    v = {"winner": "b", "tie": True, "others": [{"strategy": "a", "tie": True}]}
    doc = {"kind": "step", "setup": {}, "flags": [], "verdict": v,
           "strategies": {"a": {"step_time_us": 10.1, "exposed_comm_us": 1.0},
                          "b": {"step_time_us": 10.0, "exposed_comm_us": 1.0}}}
    plots.step_bars(doc, tmp_path / "st.png")
    assert _labels(figs[-1]) == ["a (tie)", "b (tie)"]
    parts = {"plan": 1.0, "dispatch + wait": 2.0, "compute": 3.0, "combine": 4.0}
    rep = {"topology": {"name": "t"}, "cluster": {"ranks": 4}, "critical_parts": list(parts), "flags": [],
           "verdict": {"winner": "a", "tie": True, "others": [{"strategy": "b", "tie": True},
                                                              {"strategy": "c", "tie": False}]},
           "strategies": {n: {"sim": {"layer_time_us_mean": t, "critical_us_mean": parts, "lower_bound_us_mean": 5.0}}
                          for n, t in (("a", 10.0), ("b", 10.3), ("c", 20.0))}}
    plots.layer_time_bars(rep, tmp_path / "c.png")
    assert _labels(figs[-1]) == ["a (tie)", "b (tie)", "c"]
