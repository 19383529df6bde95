"""Winner maps: the cell rule (fastest dropless strategy, margin over the runner-up, ties), the map
from sweep reports, its table and heat map, and the ``sweep --by`` command end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.analysis.winner import cell, winner_map
from moonep_sim.report.winner import winner_heatmap, winner_table_md


def test_cell_picks_the_fastest_dropless_strategy_and_its_margin():
    c = cell({"a": 110.0, "b": 100.0, "c": 90.0}, {"c": 5})
    assert c["winner"] == "b" and c["runner_up"] == "a"
    assert c["margin"] == pytest.approx(0.10)
    assert c["dropped"] == ["c"] and c["tied"] == []
    t = cell({"a": 100.0, "b": 100.01, "c": 150.0})
    assert t["tied"] == ["a", "b"] and t["runner_up"] == "c" and t["margin"] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="dropless"):
        cell({"a": 1.0}, {"a": 1})


def _sweep(over, values, times, dropped=None):
    return {"over": over, "values": values, "model": {"name": "m"}, "topology": {"name": "t"},
            "strategies": {n: {"layer_time_us": ts, "dropped": (dropped or {}).get(n, [0] * len(values))}
                           for n, ts in times.items()}}


def test_map_table_and_heatmap(tmp_path):
    reps = [(128.0, _sweep("maxvio", [0.2, 20.0], {"x": [10.0, 30.0], "y": [12.0, 20.0]})),
            (8192.0, _sweep("maxvio", [0.2, 20.0], {"x": [100.0, 300.0], "y": [90.0, 150.0]}))]
    m = winner_map(reps, "tokens-per-rank")
    assert [[c["winner"] for c in row] for row in m["cells"]] == [["x", "y"], ["y", "y"]]
    assert m["cells"][0][1]["margin"] == pytest.approx(0.5)
    md = winner_table_md(m)
    assert "| 128 | **x** 0.01 ms (+20.0% vs y)" in md and "+100.0% vs x" in md
    png = winner_heatmap(m, tmp_path / "w.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="must sweep maxvio"):
        winner_map(reps + [(1.0, _sweep("maxvio", [1.0, 2.0], {"x": [1, 2], "y": [1, 2]}))], "t")


def test_sweep_by_writes_a_winner_map(tmp_path):
    out = tmp_path / "wm"
    cmd = [sys.executable, "-m", "moonep_sim", "sweep", "--model", "mixtral-8x7b", "--over", "maxvio",
           "--values", "1,3", "--by", "tokens-per-rank", "--by-values", "256,512", "--ranks", "4",
           "--gpus-per-node", "2", "--strategies", "deepep,moonep,costaware", "--out", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "winner.json").read_text())
    assert m["x"]["values"] == [1.0, 3.0] and m["y"] == {"knob": "tokens-per-rank", "values": [256.0, 512.0]}
    for row in m["cells"]:
        for c in row:
            assert c["winner"] in ("deepep", "moonep", "costaware")
            assert c["time_us"] == min(c["times_us"].values())
    assert (out / "winner.png").stat().st_size > 0 and "tokens-per-rank" in (out / "winner.md").read_text()
    bad = subprocess.run(cmd[:-1] + ["--by-values", "16,x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "moonep-sim: error: --by-values" in bad.stderr


def test_scenario_winner_map_is_the_python_api():
    from moonep_sim.experiments import Scenario

    sc = Scenario(routing="gen:model=mixtral-8x7b,tokens-per-rank=256", cluster="4/2",
                  strategies=["deepep", "costaware"], topology="h800-cx7")
    m = sc.winner_map("maxvio", [1.0, 3.0], "tokens-per-rank", [256, 512])
    assert m["x"]["values"] == [1.0, 3.0] and m["y"] == {"knob": "tokens-per-rank", "values": [256.0, 512.0]}
    assert len(m["sweeps"]) == 2 and m["sweeps"][1]["tokens_per_rank"] == 512
    for row in m["cells"]:
        for c in row:
            assert c["time_us"] == min(c["times_us"].values())
    with pytest.raises(ConfigError, match="by"):
        sc.winner_map("maxvio", [1.0], "maxvio", [1.0])
