"""What a newcomer hit (issue 16, item 6), each pinned: tables that keep names whole at 80 columns,
one flag spelling, strict generator specs, progress when not on a terminal, default sweep values
every preset can reach, plots that stay readable, the testbed's multi-strategy summary."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import TRACES
from moonep_sim.cli import main
from moonep_sim.errors import ConfigError, MoonEPSimError
from moonep_sim.models import PRESETS

MIXTRAL = TRACES / "mixtral-8x7b_humaneval.safetensors"


@pytest.mark.parametrize("cmd", ["models", "topologies"])
@pytest.mark.parametrize("width", [80, 100])
def test_tables_keep_names_whole(cmd, width, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(width))
    assert main([cmd]) == 0
    out = capsys.readouterr().out
    from moonep_sim.sim.topology import list_topologies

    names = list(PRESETS) if cmd == "models" else list_topologies()
    for n in names:
        assert re.search(rf"^{re.escape(n)}\s", out, re.M), f"{n} truncated or wrapped at {width} columns"
    assert "…" not in out  # nothing cut short: long cells wrap (fold) instead


def test_compare_help_cites_what_exists(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help text wraps at the terminal width
    assert "plan --list" not in text and "capacity_factor" not in text
    assert "moonep-sim strategies" in text and "capacity.cf=" in text
    assert main(["strategies"]) == 0
    assert "cf=1.0" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", [["plan", "--trace", str(MIXTRAL), "--strategy", "alltoall", "--ranks", "4", "--json"],
                                 ["simulate", "--trace", str(MIXTRAL), "--strategy", "alltoall", "--ranks", "4",
                                  "--json"]])
def test_one_dtype_flag_with_old_spellings(cmd, capsys):
    import json

    for flag, value in (("--dispatch-dtype", "fp8"), ("--dtype", "fp8"), ("--dispatch-dtype", "bfloat16")):
        assert main(cmd + [flag, value]) == 0, (flag, value)
        json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--dispatch-dtype", "fp4"])
    assert e.value.code == 2


def test_generator_spec_is_strict_and_shared(capsys):
    from moonep_sim.experiments import GEN_DEFAULTS, GeneratorSpec

    for argv in (["simulate", "--gen", "maxvoi=10", "--strategy", "moonep"],
                 ["compare", "--trace", "gen:maxvoi=10"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "generator spec key ('maxvoi') must be one of: model, maxvio" in err
    with pytest.raises(ConfigError, match="at most one popularity"):
        GeneratorSpec.parse("maxvio=2,zipf=1.1")
    with pytest.raises(ConfigError, match="must be given once"):
        GeneratorSpec.parse("seed=1,seed=2")
    with pytest.raises(ConfigError, match="tokens-per-rank .* must be an integer"):
        GeneratorSpec.parse("tokens-per-rank=1.5")
    g = GeneratorSpec.parse("gen:model=kimi-k3,maxvio=10,tokens-per-rank=64")
    assert GeneratorSpec.parse(g.text()) == g
    d = GeneratorSpec()
    assert (d.model, d.tokens_per_rank, d.popularity()) == (GEN_DEFAULTS["model"], GEN_DEFAULTS["tokens_per_rank"],
                                                             {"maxvio": GEN_DEFAULTS["maxvio"]})


def test_progress_lines_when_asked_for_off_a_terminal(capsys, monkeypatch):
    from moonep_sim.progress import tracker

    monkeypatch.setenv("MOONEP_SIM_PROGRESS", "lines")  # a CI log: plain lines (piped, it is quiet)
    with tracker("job", interval_s=0.05) as cb:
        cb("step a", 0, 2)
        cb("step b", 1, 2)  # within the interval: not printed on its own
        for _ in range(400):  # a long blocking step: the heartbeat speaks up (up to 20 s on a loaded machine)
            if "still running" in capsys.readouterr().err:
                break
            import time
            time.sleep(0.05)
        else:
            pytest.fail("no heartbeat line while a step ran long")
        cb("done", 2, 2)
    err = capsys.readouterr().err
    assert "[job 2/2" in err and "done" in err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_default_maxvio_targets_are_reachable_for_every_preset(name):
    from moonep_sim.experiments.sweep import maxvio_targets

    m = PRESETS[name]
    vals = maxvio_targets(m)
    assert len(vals) == 4 and vals == sorted(set(vals))
    assert all(0 < v <= m.num_experts / m.top_k - 1 for v in vals)


def test_sweep_defaults_run_on_mixtral(tmp_path):
    """Mixtral (E/K - 1 = 3): the old default targets 10 and 20 were impossible."""
    assert main(["sweep", "--model", "mixtral-8x7b", "--over", "maxvio", "--ranks", "8", "--tokens-per-rank", "256",
                 "--strategies", "alltoall", "--out", str(tmp_path / "s"), "--json"]) == 0


def _capture_figures(monkeypatch):
    from moonep_sim.report import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, dest: figs.append(fig) or dest)
    return plots, figs


def _report():
    from moonep_sim.experiments import Scenario

    return Scenario(routing=str(MIXTRAL), cluster="4/2", strategies="alltoall,capacity,moonep", layers=[0]).compare(
    ).to_dict()


def test_plots_stay_readable(monkeypatch, tmp_path):
    plots, figs = _capture_figures(monkeypatch)
    rep = _report()
    plots.layer_time_bars(rep, tmp_path / "a.png")
    # moonep's weight copies are >10x the others: no log axis (it hides the planning segment of a
    # stacked bar) but a second, linear panel zoomed on the fastest
    full, ax = figs[-1].axes[:2]
    assert full.get_yscale() == ax.get_yscale() == "linear"
    t = [s["sim"]["layer_time_us_mean"] / 1e3 for s in rep["strategies"].values()]
    assert ax.get_ylim()[1] < max(t) / 5 and full.get_ylim()[1] >= max(t)
    assert any("(clipped)" in a.get_text() for a in ax.texts)
    leg = ax.get_legend()
    fig = figs[-1]
    fig.canvas.draw()
    lb, ab = leg.get_window_extent(), ax.get_window_extent()
    assert lb.x0 >= ab.x1 - 1  # the legend sits beside the axes, over no bar or value label
    plots.traffic_heatmaps(rep, tmp_path / "t.png")
    for a in figs[-1].axes[:3]:
        for t in list(a.get_xticks()) + list(a.get_yticks()):
            assert float(t).is_integer()  # ranks are whole numbers
    assert sum(bool(a.get_ylabel()) for a in figs[-1].axes[:3]) == 1  # one y label per row
    sw = {"over": "maxvio", "values": [0.2, 1, 10, 20], "model": {"name": "m"}, "topology": {"name": "t"},
          "cluster": {"ranks": 8}, "lower_bound_us": [1, 1, 1, 1],
          "strategies": {"a": {"layer_time_us": [1, 2, 3, 4], "ratio_to_lower_bound": [1, 2, 3, 4]}}}
    plots.sweep_lines(sw, tmp_path / "s.png")
    a1 = figs[-1].axes[0]
    assert a1.get_xscale() == "log"
    assert [float(t) for t in a1.get_xticks()] == [0.2, 1, 10, 20]
    assert not [t for t in a1.xaxis.get_minorticklabels() if t.get_text()]


def test_testbed_multi_strategy_summary_is_not_null():
    from moonep_sim.cli.testbed import run_summary

    one = {"strategy": "a", "world_size": 4, "layers": [0], "layer_ms_median": 1.5, "dispatch_ms": 1.0,
           "combine_ms": 0.5, "total_ms": 2.0, "bytes_sent": 10, "correct": True}
    two = {"strategies": {"a": one, "b": dict(one, strategy="b", layer_ms_median=2.5)}, "order": ["a", "b"],
           "interleaved": True}
    s1 = run_summary(one)
    assert s1["strategy"] == "a" and s1["layer_ms_median"] == 1.5
    s2 = run_summary(two)
    assert s2["strategies"]["b"]["layer_ms_median"] == 2.5 and s2["strategies"]["a"]["world_size"] == 4
    assert all(v is not None for r in s2["strategies"].values() for v in r.values())


def test_demo_explains_weights_vs_rows():
    """The demo's explanation is the computed verdict: moonep's loss on Mixtral is named as weight
    copies, with the figures of this run (no fixed sentence)."""
    from moonep_sim.report.tables import verdict_lines

    rep = _report()
    lines = verdict_lines(rep)
    mo = next(o for o in rep["verdict"]["others"] if o["strategy"] == "moonep")
    assert mo["mechanism"] == "weight copies"
    s = rep["strategies"]
    # per unit compared: each of the trace's recorded steps (one layer each), the run's total over them
    per_step = s["moonep"]["weight_bytes"] / len(s["moonep"]["per_step"]["step"])
    assert f"{per_step / 2**30:.3g} GiB of weights" in mo["why"]
    assert any("moonep" in l and "weight copies" in l for l in lines)
    assert not any("few, large experts" in l for l in lines)


def test_quick_calibration_is_recognised(tmp_path):
    """The demo warns when the local-gloo constants come from its quick calibration."""
    import json

    from moonep_sim.experiments.calibrate import QUICK_SIZES_BYTES, calibration_kind

    toml = tmp_path / "local-gloo.toml"
    assert calibration_kind(toml) is None
    toml.write_text("name = 'local-gloo'\n")
    meas = tmp_path / "local-gloo.measurements.json"
    for kind in ("quick", "full"):
        meas.write_text(json.dumps({"kind": kind, "measurements": {"alltoall": []}}))
        assert calibration_kind(toml) == kind
    # files written before the kind field: told apart by the message sizes measured
    rows = [{"bytes_per_peer": b} for b in QUICK_SIZES_BYTES]
    meas.write_text(json.dumps({"measurements": {"alltoall": rows}}))
    assert calibration_kind(toml) == "quick"
    meas.write_text(json.dumps({"measurements": {"alltoall": rows + [{"bytes_per_peer": 4 << 20}]}}))
    assert calibration_kind(toml) == "full"


def test_layers_are_ids_in_the_replay_as_everywhere(tmp_path):
    """`launch/replay.py --layers` names layer ids (the trace's layer_ids), not stored positions."""
    from moonep_sim.experiments.ranks.replay_args import parse_layers
    from moonep_sim.routing.trace import Trace, TraceMeta, write_trace

    ids = np.stack([np.tile([[0, 1], [2, 3]], (4, 1))] * 2).astype(np.int32)  # [L=2, T=8, K=2]
    path = write_trace(tmp_path / "t.safetensors",
                       TraceMeta(kind="tokens", num_experts=4, top_k=2, layer_ids=[3, 7], num_tokens=8),
                       {"topk_ids": ids, "topk_weights": np.ones(ids.shape, np.float32)})
    tr = Trace(path)
    assert parse_layers("7", tr) == [1] and parse_layers("3,7", tr) == [0, 1]
    assert parse_layers(None, tr) == [0, 1]
    with pytest.raises(MoonEPSimError, match=r"layer \(1\) must be one of the trace.s layers"):
        parse_layers("1", tr)


def test_demo_names_the_resolved_pairs():
    from moonep_sim.report.tables import resolved_line

    rep = {"real": {"ranking": {"resolved": ["alltoall < moonep"], "pairs": 6}}}
    assert resolved_line(rep) == ("the measurements resolved 1 of 6 pairs: alltoall < moonep "
                                  "(the other pairs are measured ties)")
    rep["real"]["ranking"]["resolved"] = []
    assert "resolved no pair" in resolved_line(rep)
    assert resolved_line({"strategies": {}}) is None
