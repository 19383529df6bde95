"""compare, sweep and winner maps at step level (--level step, moonep_sim.experiments.step_levels):
the same step as `moonep-sim step`, one step result per point, cells won as the step verdict
says, layer-only and step-only options refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moonep_sim.cli import main
from moonep_sim.experiments import Scenario
from moonep_sim.experiments.step import StepOptions
from moonep_sim.analysis.winner import cell

MIXTRAL = Path(__file__).resolve().parent.parent / "traces" / "mixtral-8x7b_humaneval.safetensors"
GEN = "gen:model=mixtral-8x7b,maxvio=1,tokens-per-rank=64"
OPTS = StepOptions(mode="train", overlap="shared-expert", distinct_layers=1)


def _sc(**kw):
    return Scenario(routing=kw.pop("routing", GEN), cluster=kw.pop("cluster", "4/4"),
                    strategies=kw.pop("strategies", "alltoall,moonep"), **kw)


def test_compare_at_step_level_is_the_step():
    sc = _sc()
    a = sc.compare(level="step", step=OPTS).to_dict()
    b = sc.step("train", "shared-expert", distinct_layers=1).to_dict()
    for n in ("alltoall", "moonep"):
        for k in ("step_time_us", "exposed_comm_us", "peak_memory_bytes", "oom", "mfu"):
            assert a["strategies"][n][k] == b["strategies"][n][k], (n, k)
    assert a["verdict"]["winner"] == b["verdict"]["winner"]


def test_compare_cli_at_step_level_matches_scenario_step(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["compare", "--trace", GEN, "--ranks", "4", "--gpus-per-node", "4", "--strategies", "alltoall,moonep",
                 "--level", "step", "--overlap", "shared-expert", "--distinct-layers", "1", "--no-plots",
                 "--out", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    want = _sc().step("train", "shared-expert", distinct_layers=1).to_dict()
    assert rep["kind"] == "step"
    for n in ("alltoall", "moonep"):
        assert rep["strategies"][n]["step_time_us"] == pytest.approx(want["strategies"][n]["step_time_us"], rel=1e-12)
        assert rep["strategies"][n]["oom"] == want["strategies"][n]["oom"]
    assert (out / "report.html").exists()
    assert "step time" in capsys.readouterr().out


def test_sweep_at_step_level_gives_one_step_per_point():
    sc = _sc()
    rep = sc.sweep("maxvio", [0.5, 3.0], level="step", step=OPTS).to_dict()
    assert rep["level"] == "step" and rep["values"] == [0.5, 3.0] and len(rep["verdicts"]) == 2
    for n, s in rep["strategies"].items():
        for k in ("step_time_us", "exposed_comm_us", "peak_memory_bytes", "oom"):
            assert len(s[k]) == 2, (n, k)
    # each point is the step of that point's scenario: the same setup through Scenario.step
    for i, v in enumerate([0.5, 3.0]):
        one = _sc(routing=f"gen:model=mixtral-8x7b,maxvio={v},tokens-per-rank=64").step(
            "train", "shared-expert", distinct_layers=1).to_dict()
        for n in ("alltoall", "moonep"):
            assert rep["strategies"][n]["step_time_us"][i] == one["strategies"][n]["step_time_us"]
            assert rep["strategies"][n]["peak_memory_bytes"][i] == one["strategies"][n]["peak_memory_bytes"]
        assert rep["verdicts"][i]["winner"] == one["verdict"]["winner"]
    # the imbalance moves the flat all-to-all's busiest rank: its step time grows with maxvio
    a = rep["strategies"]["alltoall"]["step_time_us"]
    assert a[1] > a[0]


def test_sweep_over_ep_at_step_level_runs_each_ep_size():
    rep = _sc(cluster=None).sweep("ep", [2, 4], level="step", step=OPTS).to_dict()
    assert [p["ranks"] for p in rep["points"]] == [2, 4]
    assert all(len(s["step_time_us"]) == 2 for s in rep["strategies"].values())


def test_winner_map_cells_at_step_level_follow_the_step_verdict():
    m = _sc().winner_map("maxvio", [0.5, 3.0], "tokens-per-rank", [32, 64], level="step", step=OPTS)
    assert m["level"] == "step" and len(m["cells"]) == 2 and all(len(r) == 2 for r in m["cells"])
    for row, rep in zip(m["cells"], m["sweeps"]):
        for i, c in enumerate(row):
            assert c["winner"] == c["verdict"]["winner"] == rep["verdicts"][i]["winner"]
            assert set(c["step"]) == {"alltoall", "moonep"}
            assert c["time_us"] == rep["strategies"][c["winner"]]["step_time_us"][i]


def test_a_step_cell_never_goes_to_a_strategy_that_runs_out_of_memory():
    c = cell({"a": 1.0, "b": 2.0, "c": 3.0}, None, {"a": True, "b": False, "c": False})
    assert c["winner"] == "b" and c["runner_up"] == "c" and c["oom"] == ["a"]
    every = cell({"a": 1.0, "b": 2.0}, None, {"a": True, "b": True})   # all OOM: the fastest, as the verdict
    assert every["winner"] == "a" and every["oom"] == ["a", "b"]
    assert "oom" not in cell({"a": 1.0, "b": 2.0})                       # the layer level: unchanged cells


def test_trace_sweep_at_step_level_runs_every_recorded_step():
    sc = Scenario(routing=str(MIXTRAL), cluster="4/4", strategies="alltoall,moonep")
    rep = sc.sweep("gpus_per_node", [2, 4], level="step", step=StepOptions(mode="prefill")).to_dict()
    assert rep["level"] == "step" and [p["gpus_per_node"] for p in rep["points"]] == [2, 4]
    # two recorded steps: each point's figure combines both (token-weighted time, largest memory)
    assert all(f["steps"] == 2 for s in rep["strategies"].values() for f in s["figures"])
    # fewer GPUs per node: more of the all-to-all crosses the slower NICs
    a = rep["strategies"]["alltoall"]["step_time_us"]
    assert a[0] > a[1]


def test_sweep_cli_at_step_level_writes_table_json_and_html(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["sweep", "--model", "mixtral-8x7b", "--ranks", "4", "--over", "maxvio", "--values", "0.5,2",
                 "--tokens-per-rank", "64", "--strategies", "alltoall,moonep", "--level", "step", "--distinct-layers",
                 "1", "--out", str(out), "--no-plots"]) == 0
    rep = json.loads((out / "sweep.json").read_text())
    assert rep["level"] == "step" and rep["step"]["mode"] == "train"
    assert len(rep["strategies"]["moonep"]["step_time_us"]) == 2
    html = (out / "report.html").read_text()
    assert "verdict" in html and "moonep" in html and "GiB OOM" in html
    assert "at step level" in capsys.readouterr().out


def test_winner_map_cli_at_step_level(tmp_path):
    out = tmp_path / "w"
    assert main(["sweep", "--model", "mixtral-8x7b", "--ranks", "4", "--over", "maxvio", "--values", "0.5",
                 "--by", "tokens-per-rank", "--by-values", "32,64", "--strategies", "alltoall,moonep", "--level",
                 "step", "--distinct-layers", "1", "--out", str(out), "--no-plots"]) == 0
    m = json.loads((out / "winner.json").read_text())
    assert m["level"] == "step" and [len(r) for r in m["cells"]] == [1, 1]
    assert all(c["winner"] == c["verdict"]["winner"] for r in m["cells"] for c in r)
    # Mixtral's 32 layers whole on 4 H800s do not fit: every cell says so, in the JSON and the table
    assert all(c["oom"] == ["alltoall", "moonep"] for r in m["cells"] for c in r)
    assert "OOM: alltoall, moonep" in (out / "winner.md").read_text()
    assert " OOM" in (out / "report.html").read_text()


def test_layer_level_is_the_default_and_unchanged():
    sc = _sc(routing="gen:model=olmoe-1b-7b,tokens-per-rank=32", cluster="8/8")
    a = sc.sweep("maxvio", [1.0]).to_dict()
    b = sc.sweep("maxvio", [1.0], level="layer").to_dict()
    assert "level" not in a and a["strategies"]["moonep"]["layer_time_us"] == b["strategies"]["moonep"]["layer_time_us"]


@pytest.mark.parametrize("argv, message", [
    (["compare", "--trace", str(MIXTRAL), "--level", "step", "--real"], "--real applies to --level layer only"),
    (["compare", "--trace", str(MIXTRAL), "--level", "step", "--layers", "0"], "--layers applies to --level layer"),
    (["compare", "--trace", str(MIXTRAL), "--mode", "decode"], "--mode applies to --level step only"),
    (["compare", "--trace", str(MIXTRAL), "--static-buffer", "moonep=8"], "--static-buffer applies to --level step"),
    (["sweep", "--model", "mixtral-8x7b", "--ranks", "4", "--over", "maxvio", "--overlap", "two-batch"],
     "--overlap applies to --level step only"),
    (["sweep", "--model", "mixtral-8x7b", "--ranks", "4", "--over", "maxvio", "--level", "step", "--seeds", "2"],
     "--seeds applies to --level layer only"),
    (["sweep", "--trace", str(MIXTRAL), "--over", "ranks", "--level", "step", "--layers", "0"],
     "--layers applies to --level layer only"),
    (["sweep", "--model", "mixtral-8x7b", "--ranks", "4", "--over", "maxvio", "--values", "1", "--level", "step",
      "--mode", "decode", "--static-buffer", "moonep=16", "--strategies", "alltoall,moonep"],
     "static buffer tokens (16) of moonep must be >= the tokens per rank"),
    (["sweep", "--model", "mixtral-8x7b", "--ranks", "4", "--over", "maxvio", "--values", "1", "--level", "step",
      "--distinct-layers", "-1"], "--distinct-layers (-1) must be in [0, "),
])
def test_level_combinations_refused_in_one_line(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_python_api_refuses_step_options_at_layer_level():
    from moonep_sim.errors import ConfigError

    with pytest.raises(ConfigError, match="step options must be given with level='step' only"):
        _sc().sweep("maxvio", [1.0], step=OPTS)
    with pytest.raises(ConfigError, match="level .'cell'. must be layer or step"):
        _sc().compare(level="cell")
    with pytest.raises(ConfigError, match="real replays run the layer level only"):
        _sc().compare(real=True, level="step")


def test_trace_knobs_of_the_layer_sweep_work_at_step_level():
    """tokens_per_rank re-cuts the trace into batches, each its own step; maxvio re-weights the
    trace's popularity, which the step's layers are planned on (the busiest rank's load grows)."""
    sc = Scenario(routing=str(MIXTRAL), cluster="4/4", strategies="alltoall,moonep")
    opts = StepOptions(mode="prefill")
    cut = sc.sweep("tokens_per_rank", [16, 32], level="step", step=opts).to_dict()
    assert [f["steps"] for f in cut["strategies"]["alltoall"]["figures"]] == [p["steps"] for p in cut["points"]]
    assert cut["points"][0]["steps"] > cut["points"][1]["steps"] > 1
    mv = sc.sweep("maxvio", [0.5, 1.5], level="step", step=opts).to_dict()
    lo, hi = (f["rows_max_mean"] for f in mv["strategies"]["alltoall"]["figures"])
    assert hi > lo
    assert max(f["rows_max_mean"] for f in mv["strategies"]["moonep"]["figures"]) < 1.05


def test_a_strategy_that_drops_entries_is_flagged_and_never_wins_a_step():
    # capacity (cf 1) under skew drops entries: its step does less work and is faster for it, so it
    # is flagged and ranked behind the strategy that drops none, the mechanism naming the drops
    sc = _sc(routing="gen:model=mixtral-8x7b,maxvio=3,tokens-per-rank=64", strategies="alltoall,capacity")
    d = sc.step("train", "none", distinct_layers=1).to_dict()
    cap, a2a = d["strategies"]["capacity"], d["strategies"]["alltoall"]
    assert cap["dropped"] > 0 and a2a["dropped"] == 0 and cap["entries"] == a2a["entries"] > cap["dropped"]
    assert any(f["code"] == "dropped-rows" and f["strategy"] == "capacity" for f in d["flags"])
    v = d["verdict"]
    assert v["winner"] == "alltoall" and v["runner_up"] == "capacity"
    assert cap["step_time_us"] < a2a["step_time_us"]  # faster only by skipping work: the mechanism says so
    assert v["mechanism"] == "dropped rows" and f"drops {cap['dropped']:,} of {cap['entries']:,}" in v["why"]
