"""benchmarks/bench_step.py --floor: what it records of the step's Plans and how it adds them up.

No timing is asserted (timings are the bench's output); what is checked is that the floor is
taken from the Plans the step really made, that recording them leaves the step unchanged, and
that the totals are the sums of the named parts."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    mod = importlib.import_module("bench_step")
    monkeypatch.setitem(mod.CASES, "tiny-train", dict(
        spec=dict(model="olmoe-1b-7b", maxvio=2.0, tokens_per_rank=32, layers=16), cluster="8/4",
        step=dict(mode="train", overlap="shared-expert")))
    monkeypatch.setitem(mod.TARGET_CPU_S, "tiny-train", 1.0)
    return mod


def _scenario(bench):
    from moonep_sim.experiments import GeneratorSpec, Scenario

    c = bench.CASES["tiny-train"]
    return Scenario(routing=GeneratorSpec(**c["spec"]), cluster=c["cluster"], topology="h800-cx7",
                    strategies=["alltoall", "moonep"])


def test_probe_records_the_plans_the_step_made_and_leaves_the_step_unchanged(bench):
    import moonep_sim.strategies as st
    from moonep_sim.experiments.step import GeneratedLayer

    original = st.make_plan
    sc = _scenario(bench)
    plain = sc.step("train", "shared-expert")
    with bench.PlanProbe() as probe:
        probed = sc.step("train", "shared-expert")
    assert st.make_plan is original  # put back
    for s in ("alltoall", "moonep"):
        assert probed.figures[s]["step_time_us"] == plain.figures[s]["step_time_us"]
        assert probed.figures[s]["peak_memory_bytes"] == plain.figures[s]["peak_memory_bytes"]
    moe = sc.resolved.source.model.moe_layers
    assert [p["strategy"] for p in probe.plans] == ["alltoall", "moonep"] * moe  # layer by layer
    # the first record is layer 0's alltoall Plan: the same shapes as a Plan made here on that layer
    rs = sc.resolved
    routing = GeneratedLayer(rs.source, 0, rs.cluster.ranks)()
    plan = original("alltoall", routing, rs.ctx)
    rec = probe.plans[0]
    assert rec["arrays"] == bench.plan_arrays(plan, routing)
    assert (rec["tokens"], rec["top_k"]) == routing.topk_ids_TK.shape == (8 * 32, rs.source.model.top_k)
    assert rec["routing_dtypes"] == ["int64", "float32"]
    assert (rec["slots"], rec["hops"], rec["ranks"]) == (plan.slot_rank_S.size, len(plan.hops), 8)
    assert rec["entries"] == routing.topk_ids_TK.size


def test_floor_rows_are_the_sums_of_their_named_parts(bench):
    rows = bench.run("tiny-train", ["alltoall", "moonep"], 0, 1, moe_layers=3, floor=True)
    assert [r["strategy"] for r in rows] == ["alltoall", "moonep"]
    for r in rows:
        f = r["floor"]
        assert f["layers"] == r["layers_simulated"] == 3
        parts = ("routing_write_cpu_s", "routing_draws_cpu_s", "plan_write_cpu_s", "plan_sort_cpu_s",
                 "simulate_io_cpu_s")
        assert all(f[p] >= 0.0 for p in parts)
        assert f["total_cpu_s"] == pytest.approx(sum(f[p] for p in parts))
        assert f["routing_cpu_s"] == pytest.approx(f["routing_write_cpu_s"] + f["routing_draws_cpu_s"])
        assert f["plan_cpu_s"] == pytest.approx(f["plan_write_cpu_s"] + f["plan_sort_cpu_s"])
        assert f["warm_total_cpu_s"] == pytest.approx(f["total_cpu_s"] - f["routing_write_cpu_s"]
                                                      - f["plan_write_cpu_s"] + f["routing_write_warm_cpu_s"]
                                                      + f["plan_write_warm_cpu_s"])
        assert f["plan_bytes_per_layer"] > 0
        assert r["target_cpu_s"] == 1.0
        # together: each strategy's own share of the run is what its floor is set against
        assert r["measured_cpu_s"] == r["strategy_cpu_s"]
        if f["total_cpu_s"] > 0:
            assert r["measured_over_floor"] == pytest.approx(r["measured_cpu_s"] / f["total_cpu_s"])
    # the routing is shared: the same routing floor for both strategies
    assert rows[0]["floor"]["routing_cpu_s"] == rows[1]["floor"]["routing_cpu_s"]
    assert "tiny-train" in bench.floor_table(rows).splitlines()[1]


def test_floor_with_workers_is_refused(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--floor", "--jobs", "2"])
    assert e.value.code == 2
    assert "--jobs 1" in capsys.readouterr().err


def test_write_floor_writes_the_sizes_given():
    """bench_step reuses bench_plan's write floor (not a copy): it writes what it is given."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_plan

        assert bench_plan.write_floor([(1000, "int32"), (10, "float64")])["bytes"] == 1000 * 4 + 10 * 8
    finally:
        sys.path.remove(str(BENCH))


def test_pipeline_pairs_give_identical_steps_and_a_table(bench, capsys, tmp_path):
    import json

    out = tmp_path / "rows.json"
    assert bench.main(["--cases", "tiny-train", "--strategies", "alltoall", "--distinct-layers", "0",
                       "--moe-layers", "3", "--pipeline", "off,on", "--repeat", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # two pairs, the second in the other order (off first, then on first)
    assert [(r["repeat"], r["pipelined"]) for r in rows] == [(0, False), (0, True), (1, True), (1, False)]
    for r in rows:
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["layers_cpu_s"] > 0
        assert (r["main_wait_s"] is None) == (r["main_thread_cpu_s"] is None) == (not r["pipelined"])
        assert r["step_time_us"] == rows[0]["step_time_us"]
    table = capsys.readouterr().out.splitlines()
    pairs = [l for l in table if l.startswith("tiny-train")]
    assert len(pairs) == 2 and all(l.split()[-1] == "yes" for l in pairs)


def test_floor_needs_the_serial_step(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--floor", "--pipeline", "on"])
    assert e.value.code == 2
    assert "--pipeline off" in capsys.readouterr().err


def test_cli_figures_sit_beside_the_in_process_rows(bench):
    """The command's figures (from benchmarks/_cli.py) beside each in-process row: the ratios, the
    step time compared per strategy, the command named under the table."""
    rows = [{"case": "tiny-train", "strategy": s, "wall_s": 2.0, "cpu_s": 4.0, "load_end": 1.0, "step_time_us": t}
            for s, t in (("alltoall", 10.0), ("moonep", 20.0))]
    cli = {"cli_command": "moonep-sim step --gen x", "cli_wall_s": 3.0, "cli_cpu_s": 5.0, "cli_load_start": 1.0,
           "cli_step_time_us": {"alltoall": 10.0, "moonep": 21.0}}
    got = bench.with_cli(rows, cli)
    assert [r["cli_same_step_time"] for r in got] == [True, False]
    assert got[0]["cli_over_inprocess_wall"] == 1.5 and got[0]["cli_over_inprocess_cpu"] == 1.25
    table = bench.cli_table(got)
    assert "| 1.50x | 5.0 | 4.0 | 1.25x |" in table and table.splitlines()[-1] == "  moonep-sim step --gen x"


@pytest.mark.slow
def test_before_times_the_warm_step_in_both_trees(bench, capsys):
    """--before with this tree as the earlier one: a row per (case, strategy, distinct) with the least
    of each tree's runs and their ratio (the same package both sides: no timing asserted)."""
    tree = str(Path(__file__).resolve().parents[1])
    assert bench.main(["--before", tree, "--cases", "tiny-train", "--strategies", "moonep",
                       "--distinct-layers", "2", "--rounds", "1", "--warm", "1"]) == 0
    out = capsys.readouterr().out
    row = bench.json.loads(out.splitlines()[0])
    assert (row["case"], row["strategy"], row["distinct_layers"], row["rounds"]) == ("tiny-train", "moonep", 2, 1)
    assert row["before_cpu_s"] == min(row["runs"]["before"]) > 0
    assert row["after_cpu_s"] == min(row["runs"]["after"]) > 0
    assert row["after_over_before"] == row["after_cpu_s"] / row["before_cpu_s"]
    assert "after/before" in out


def test_before_needs_a_tree_with_the_package(bench, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main(["--before", str(tmp_path), "--cases", "tiny-train"])
    assert e.value.code == 2
    assert "--before" in capsys.readouterr().err
