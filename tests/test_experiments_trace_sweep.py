"""Sweeps and winner maps over a trace: every knob on the recorded routing, each step its own batch;
default values derived from what is valid (left-out ones named); --no-plots."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TRACES
from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.experiments import Scenario

MIXTRAL = TRACES / "mixtral-8x7b_humaneval.safetensors"     # E=8, K=2, 2 recorded steps (81 + 252 tokens)
QWEN = TRACES / "qwen1.5-moe-a2.7b_layer0.safetensors"      # E=60, K=4, 18 decode steps of 11-16 tokens
STRATS = "alltoall,moonep"


def _sc(**kw):
    return Scenario(routing=str(MIXTRAL), cluster=kw.pop("cluster", "4/2"), strategies=STRATS, layers=[0], **kw)


def _compare_figure(sc, name):
    return sc.compare().to_dict()["strategies"][name]["steps_aggregate"]["layer_time_us"]["token_weighted_mean"]


def test_over_a_topology_constant_keeps_the_routing_and_matches_compare():
    from moonep_sim.sim.topology import load_topology

    res = _sc().sweep("nic_bandwidth_GBps", [25, 50])
    rep = res.to_dict()
    assert rep["over"] == "nic_bandwidth_GBps" and rep["values"] == [25.0, 50.0]
    # each point is the compare of the trace on that topology: the token-weighted mean over steps
    topo = load_topology("h800-cx7")
    import dataclasses
    want = _compare_figure(_sc(topology=dataclasses.replace(topo, nic_bandwidth_GBps=25.0)), "alltoall")
    assert rep["strategies"]["alltoall"]["layer_time_us"][0] == pytest.approx(want)
    # slower NICs, slower layers (4 ranks over 2 nodes cross the NIC)
    for n in STRATS.split(","):
        t = rep["strategies"][n]["layer_time_us"]
        assert t[0] > t[1]
        assert len(rep["strategies"][n]["per_step_layer_time_us"][0]) == 2  # both recorded steps
    assert len(rep["verdicts"]) == 2 and rep["left_out"] == []


def test_over_ranks_splits_each_step_and_leaves_out_invalid_sizes():
    rep = _sc().sweep("ep").to_dict()
    assert rep["over"] == "ranks" and rep["values"] == [2.0, 4.0, 8.0]
    assert {lo["value"] for lo in rep["left_out"]} == {16.0, 32.0, 64.0}
    assert all("must divide E=8" in lo["reason"] for lo in rep["left_out"])
    assert [p["ranks"] for p in rep["points"]] == [2, 4, 8]
    assert rep["strategies"]["alltoall"]["layer_time_us"][1] == pytest.approx(_compare_figure(_sc(), "alltoall"))
    with pytest.raises(ConfigError, match=r"ranks value \(3\) must divide E=8"):
        _sc().sweep("ranks", [2, 3])


def test_over_gpus_per_node():
    rep = _sc(cluster="8/8").sweep("gpus_per_node").to_dict()
    assert rep["values"] == [1.0, 2.0, 4.0, 8.0]
    assert [p["gpus_per_node"] for p in rep["points"]] == [1, 2, 4, 8]
    # all ranks on one node: no NIC in the way, faster than one rank per node
    t = rep["strategies"]["alltoall"]["layer_time_us"]
    assert t[-1] < t[0]


def test_over_tokens_per_rank_recuts_the_concatenated_steps():
    from moonep_sim.experiments.trace_sweep import recut

    rs = _sc().resolved
    src, left = recut(rs.source, 40 * 4)
    assert src.num_batches == 333 // 160 and left == 333 - 2 * 160
    # the batches are consecutive slices of the steps in recorded order, across the step boundary
    assert src.batches[0][1] == [(0, 81), (81, 160)] and src.batches[1][1] == [(160, 320)]
    rep = _sc().sweep("tokens_per_rank", [10, 40]).to_dict()
    assert [p["steps"] for p in rep["points"]] == [333 // 40, 2]
    assert [p["tokens"] for p in rep["points"]] == [8 * 40, 2 * 160]
    with pytest.raises(ConfigError, match=r"tokens_per_rank value \(100\) must be <= the trace's tokens per rank"):
        _sc().sweep("tokens_per_rank", [100])


def test_over_maxvio_reweights_the_traces_popularity():
    sc = Scenario(routing=str(QWEN), cluster=4, strategies=STRATS)
    rep = sc.sweep("maxvio", [3.0, 6.0]).to_dict()
    got = [p["realised_maxvio"] for p in rep["points"]]
    assert got[0] == pytest.approx(3.0, rel=0.25) and got[1] == pytest.approx(6.0, rel=0.25) and got[0] < got[1]
    assert "re-weighted" not in rep["routing"]["label"]   # the base trace is named; each point re-weights it
    assert rep["seed"] == 0 and "(n_e + 1)^a" in rep["method"]
    # the re-weighting keeps every token, its step and its weights; only the experts are redrawn
    from moonep_sim.experiments.trace_sweep import reweighted

    rs = sc.resolved
    src, realised = reweighted(rs.source, 2.0, 4)
    a, b = rs.source.layer(0, 4, 3), src.layer(0, 4, 3)
    assert a.num_tokens == b.num_tokens and np.array_equal(a.topk_weights_TK, b.topk_weights_TK)
    assert not np.array_equal(a.topk_ids_TK, b.topk_ids_TK)
    # the defaults leave out what this size cannot show, and say why
    d = sc.sweep("maxvio").to_dict()
    reasons = {lo["value"]: lo["reason"] for lo in d["left_out"]}
    assert "sampling-noise floor" in reasons[0.2]
    with pytest.raises(ConfigError, match=r"maxvio value \(0.05\) must be above the sampling-noise floor"):
        sc.sweep("maxvio", [0.05])


def test_winner_map_over_a_trace():
    m = _sc().winner_map("nic_bandwidth_GBps", [25, 100], "ranks", [2, 4])
    assert m["kind"] == "winner_map" and m["x"]["knob"] == "nic_bandwidth_GBps" and m["y"]["knob"] == "ranks"
    assert len(m["cells"]) == 2 and all(len(r) == 2 for r in m["cells"])
    assert m["sweeps"][0]["fixed"] == {"ranks": 2.0}
    for row, sw in zip(m["cells"], m["sweeps"]):
        for i, c in enumerate(row):
            times = {n: s["layer_time_us"][i] for n, s in sw["strategies"].items()}
            assert c["winner"] == min(times, key=times.get)


def test_cli_sweep_over_a_trace_and_no_plots(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["sweep", "--trace", str(MIXTRAL), "--layers", "0", "--over", "ranks", "--strategies", STRATS,
                 "--jobs", "1", "--no-plots", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "left out ranks=16: must divide E=8" in text
    assert (out / "sweep.json").exists() and not (out / "sweep.png").exists()
    rep = json.loads((out / "sweep.json").read_text())
    assert rep["values"] == [2.0, 4.0, 8.0] and rep["files"]["plot"] is None
    w = tmp_path / "w"
    assert main(["sweep", "--trace", str(MIXTRAL), "--layers", "0", "--over", "nic_bandwidth_GBps", "--values",
                 "25,100", "--by", "gpus_per_node", "--by-values", "1,2", "--ranks", "4", "--strategies", STRATS,
                 "--jobs", "1", "--no-plots", "--out", str(w)]) == 0
    assert (w / "winner.json").exists() and not (w / "winner.png").exists()
    assert main(["sweep", "--trace", str(MIXTRAL), "--over", "bogus", "--out", str(tmp_path / "x")]) == 2
    assert "--over ('bogus') must be one of ranks, gpus_per_node, tokens_per_rank, maxvio" in capsys.readouterr().err


def test_generated_sweep_default_maxvio_leaves_out_targets_below_the_noise_floor(tmp_path, capsys):
    """The default 0.2 target at a small size was a worker traceback; now it is left out, named."""
    out = tmp_path / "g"
    assert main(["sweep", "--model", "mixtral-8x7b", "--over", "maxvio", "--tokens-per-rank", "8", "--ranks", "8",
                 "--strategies", STRATS, "--jobs", "1", "--no-plots", "--out", str(out)]) == 0
    rep = json.loads((out / "sweep.json").read_text())
    assert 0.2 not in rep["values"] and rep["values"]
    assert any(lo["value"] == 0.2 and "sampling-noise floor" in lo["reason"] for lo in rep["left_out"])
    assert "left out maxvio=0.2" in capsys.readouterr().out
