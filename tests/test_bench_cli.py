"""benchmarks/_cli.py: the one helper every benchmark uses to time the command as a user runs it.

No timing is asserted (timings are the benchmarks' output): what is checked is the command's text,
that each run is a fresh process whose own exit status, output and rusage are reported, the
median and least over repeats, the ratios beside an in-process figure, a failing command named,
and a command past its time killed."""

from __future__ import annotations

import importlib
import statistics
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_cli")


def test_command_text_is_what_a_user_types(cli):
    assert cli.command_text(["plan", "--trace", "gen:model=kimi-k3,maxvio=2", "--json"]) == \
        "moonep-sim plan --trace gen:model=kimi-k3,maxvio=2 --json"
    assert cli.command_text(["trace", "import", "my log.jsonl"]) == "moonep-sim trace import 'my log.jsonl'"


def test_beside_gives_both_figures_and_the_ratios(cli):
    fake = {"command": "moonep-sim x", "wall_s": 3.0, "cpu_s": 2.0, "load_start": 1.0, "load_end": 2.0}
    row = cli.beside(fake, 2.0, 1.6, "in-process x")
    assert row["cli_over_inprocess_wall"] == 1.5 and row["cli_over_inprocess_cpu"] == 1.25
    assert (row["inprocess_wall_s"], row["inprocess_cpu_s"], row["inprocess"]) == (2.0, 1.6, "in-process x")
    assert cli.beside(fake, 0.0, 0.0)["cli_over_inprocess_wall"] is None  # nothing measured in process: no ratio
    line = cli.report_line(row)
    assert line.startswith("command: moonep-sim x\n") and "1.50x wall, 1.25x CPU" in line


@pytest.mark.slow
def test_repeats_are_fresh_processes_with_their_own_figures(cli):
    from moonep_sim import __version__

    r = cli.time_command(["--version"], repeat=3)
    assert r["command"] == "moonep-sim --version" and len(r["runs"]) == 3
    assert __version__ in r["stdout"]
    for run in r["runs"]:
        assert run["returncode"] == 0 and not run["timed_out"]
        assert run["cpu_s"] == pytest.approx(run["user_s"] + run["sys_s"]) and run["cpu_s"] > 0  # the child's own
        assert run["wall_s"] > 0 and "stdout" not in run
    assert r["wall_s"] == statistics.median(x["wall_s"] for x in r["runs"])
    assert r["cpu_s_min"] == min(x["cpu_s"] for x in r["runs"]) <= r["cpu_s"]


@pytest.mark.slow
def test_a_failing_command_is_named_with_its_exit_status(cli):
    with pytest.raises(RuntimeError, match=r"moonep-sim simulate --seed=-1 .*failed \(exit 2\)"):
        cli.time_command(["simulate", "--seed=-1", "--gen", "model=mixtral-8x7b", "--strategy", "alltoall"])
    got = cli.time_command(["no-such-command"], check=False)
    assert got["runs"][0]["returncode"] == 2


@pytest.mark.slow
def test_a_command_past_its_time_is_killed(cli):
    run = cli.run_once(["step", "--gen", "model=kimi-k3,maxvio=2,tokens-per-rank=4096", "--ranks", "64",
                        "--gpus-per-node", "8", "--strategies", "deepep", "--quiet"], timeout_s=1.0)
    assert run["timed_out"] and run["returncode"] < 0  # killed by a signal


@pytest.mark.slow
def test_bench_plan_times_the_plan_command_beside_its_figure_and_gets_the_same_plan(cli, tmp_path):
    bench_plan = importlib.import_module("bench_plan")
    out = tmp_path / "plan.json"
    assert bench_plan.main(["--gen", "model=mixtral-8x7b,maxvio=2,tokens-per-rank=64", "--ranks", "4",
                            "--gpus-per-node", "4", "--strategies", "alltoall,moonep", "--repeats", "1",
                            "--no-fresh", "--json", str(out)]) == 0
    import json

    for row in json.loads(out.read_text())["strategies"]:
        c = row["cli"]
        assert c["cli_command"] == ("moonep-sim plan --trace gen:model=mixtral-8x7b,maxvio=2,tokens-per-rank=64 "
                                    f"--strategy {row['strategy']} --ranks 4 --gpus-per-node 4 --json")
        assert c["same_answer"] is True  # the command's Plan is the one timed in process
        assert c["inprocess_cpu_s"] == row["best"]["cpu_s"]
        if row["best"]["cpu_s"] > 0:  # (a tiny Plan may take less than the clock's tick)
            assert c["cli_over_inprocess_cpu"] == pytest.approx(c["cli_cpu_s"] / row["best"]["cpu_s"])
