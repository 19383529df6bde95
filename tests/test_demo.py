"""The demo in its fast mode: real gloo replay (2 processes) and both simulations, end to end."""

from __future__ import annotations

import json
import os

import pytest

from moonep_sim.cli import main


def _children() -> set[int]:
    """PIDs whose parent is this process (a leftover rank would show up here)."""
    me, out = os.getpid(), set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.add(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.slow
def test_demo_fast(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOONEP_SIM_HOME", str(tmp_path / "home"))  # no calibration file: preset defaults
    before = _children()
    rc = main(["demo", "--fast", "--out", str(tmp_path / "demo")])
    text = capsys.readouterr().out
    assert rc == 0
    assert "shipped preset defaults" in text  # says which local constants were used
    assert "measured" in text and "sim/measured" in text and "h800-cx7" in text
    rep = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert set(rep["strategies"]) == {"alltoall", "moonep"}
    assert rep["real"]["nproc"] == 2 and rep["real"]["topology"]["name"] == "local-gloo"
    for name, r in rep["real"]["strategies"].items():
        assert r["correct"] is True, name  # the gloo replay matched the dense reference
        assert r["measured_ms"] > 0 and r["simulated_ms"] > 0
        # the replay planned exactly the plan that was simulated (bytes at the replay's row size)
        assert r["same_plan_bytes"] is True, name
        assert len(r["measured_ms_samples"]) == rep["real"]["iters"]  # one matched sample per iteration
    rk = rep["real"]["ranking"]
    assert rk["pairs"] == 1 and set(rk["measured_order"]) == {"alltoall", "moonep"}
    assert "measured order:" in text
    for f in ("layer_time.png", "rows_per_rank.png", "traffic.png"):
        assert (tmp_path / "demo" / f).stat().st_size > 1000
    # the computed verdict (no fixed sentence) and the flags, in the terminal and in report.html
    assert "verdict: alltoall wins" in text and "mechanism: weight copies" in text
    assert rep["verdict"]["winner"] == "alltoall" and rep["verdict"]["mechanism"] == "weight copies"
    assert {f["code"] for f in rep["flags"]} >= {"uncalibrated"}  # no calibration file: the shipped defaults
    html = (tmp_path / "demo" / "report.html").read_text()
    assert "measured ms" in html and rep["verdict"]["why"].split(" (")[0] in html
    assert _children() <= before  # no stray rank processes


def test_demo_rejects_bad_input(capsys):
    assert main(["demo", "--strategies", "alltoall,warp"]) == 2
    assert "strategy ('warp') must be one of" in capsys.readouterr().err
    assert main(["demo", "--nproc", "3"]) == 2  # Mixtral has 8 experts: 3 ranks cannot own them evenly
    assert "must divide the routing's expert count (E=8)" in capsys.readouterr().err
