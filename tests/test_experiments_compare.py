"""compare / sweep through moonep_sim.experiments: JSON contents, each strategy's figures from its own
Plan, plots, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TRACES
from moonep_sim.cli import main
from moonep_sim.plan import GlobalRouting

MIXTRAL = TRACES / "mixtral-8x7b_humaneval.safetensors"
STRATS = "alltoall,capacity,hierarchical,moonep"


@pytest.fixture(scope="module")
def report():
    from moonep_sim.experiments import Scenario

    # the two recorded steps as one batch: every figure below is checked against plans of all its tokens
    res = Scenario(routing=str(MIXTRAL), cluster="4/2", strategies=STRATS, layers=[0, 5], steps="merged").compare()
    assert tuple(res.strategies) == tuple(STRATS.split(","))
    assert res.layer_time_us["moonep"] == res.to_dict()["strategies"]["moonep"]["sim"]["layer_time_us_mean"]
    return res.to_dict()


def test_report_has_the_documented_keys(report):
    assert report["kind"] == "compare"
    assert {"routing", "model", "cluster", "topology", "strategies"} <= set(report)
    assert report["cluster"] == {"ranks": 4, "gpus_per_node": 2, "nodes": 2}
    assert report["topology"]["name"] == "h800-cx7"
    # the constants that produced the simulated figures travel with them
    assert report["topology"]["constants"]["nic_bandwidth_GBps"] == pytest.approx(50.0)
    assert list(report["strategies"]) == STRATS.split(",")
    for name, s in report["strategies"].items():
        assert {"plan_bytes", "weight_bytes", "dropped", "rows_max", "rows_mean", "rows_per_rank_mean",
                "dispatch_bytes_RR", "sim", "layers"} <= set(s)
        assert {"layer_time_us_mean", "phases_us_mean", "lower_bound_us_mean", "ratio_to_lower_bound",
                "straggler", "topology"} <= set(s["sim"])
        assert [e["layer"] for e in s["layers"]] == [0, 5]
        assert s["sim"]["ratio_to_lower_bound"] >= 1.0 - 1e-9
        assert np.asarray(s["dispatch_bytes_RR"]).shape == (4, 4)
        assert s["invariant_violations"] == 0
    json.dumps(report)  # JSON-ready as it is


def plan_context(source, cluster):
    """The context compare plans with: the home-group placement, the model's row costs (bf16 rows)."""
    from moonep_sim.plan import Placement, RowCosts
    from moonep_sim.strategies import PlanContext

    return PlanContext(cluster, Placement.home_groups(source.num_experts, cluster.ranks),
                       RowCosts.from_model(source.model, "bf16"), 1, None)


def test_each_strategy_numbers_come_from_its_own_plan(report):
    """Bytes, drops and rows per rank equal make_plan(...).summary() of that strategy, layer by layer."""
    from moonep_sim.experiments.routing import open_routing
    from moonep_sim.plan import ClusterShape
    from moonep_sim.strategies import make_plan

    src = open_routing(str(MIXTRAL), [0, 5], steps="merged")
    ctx = plan_context(src, ClusterShape(4, 2))
    totals: dict[str, dict[str, int]] = {}
    for lid in (0, 5):
        lr = src.layer(lid, 4)
        g = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, 8, 4)
        for name in STRATS.split(","):
            summ = make_plan(name, g, ctx).summary()
            entry = next(e for e in report["strategies"][name]["layers"] if e["layer"] == lid)
            assert entry["plan"]["bytes"] == summ["bytes"], name
            assert entry["plan"]["recv_rows_per_rank"] == summ["recv_rows_per_rank"], name
            assert entry["plan"]["dropped"] == summ["dropped"], name
            t = totals.setdefault(name, {})
            for k, v in summ["bytes"].items():
                t[k] = t.get(k, 0) + v
    for name in STRATS.split(","):
        assert report["strategies"][name]["plan_bytes"] == totals[name], name
    # and they differ between strategies: moonep moves weights, capacity drops, alltoall neither
    s = report["strategies"]
    assert s["moonep"]["weight_bytes"] > 0 and s["alltoall"]["weight_bytes"] == 0
    assert s["capacity"]["dropped"] > 0 and s["alltoall"]["dropped"] == 0
    assert s["moonep"]["rows_max_over_mean"] < s["alltoall"]["rows_max_over_mean"]


def test_simulated_time_is_the_simulator_on_that_plan(report):
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.experiments.routing import open_routing
    from moonep_sim.plan import ClusterShape
    from moonep_sim.sim import simulate_layer
    from moonep_sim.strategies import make_plan

    src = open_routing(str(MIXTRAL), [5], steps="merged")
    cl = ClusterShape(4, 2)
    lr = src.layer(5, 4)
    g = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, 8, 4)
    res = simulate_layer(make_plan("hierarchical", g, plan_context(src, cl)), load_topology("h800-cx7", cl.gpus_per_node), src.model)
    entry = next(e for e in report["strategies"]["hierarchical"]["layers"] if e["layer"] == 5)
    assert entry["sim"]["layer_time_us"] == pytest.approx(res.layer_time_us)


def test_plots_are_written(report, tmp_path):
    from moonep_sim.cli.compare import write_outputs

    files = write_outputs(report, tmp_path / "out")
    for k in ("layer_time", "rows_per_rank", "traffic", "report"):
        assert (tmp_path / "out").joinpath(files[k].split("/")[-1]).stat().st_size > 1000
    assert open(files["layer_time"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    back = json.loads(open(files["report"]).read())
    assert back["files"]["traffic"] == files["traffic"]


def test_generated_routing_source():
    from moonep_sim.experiments.routing import open_routing

    src = open_routing("gen:model=kimi-k2,maxvio=4,tokens-per-rank=64,layers=2,seed=3")
    assert (src.num_experts, src.top_k, src.layer_ids) == (384, 8, [0, 1])
    a, b = src.layer(0, 8), src.layer(0, 8)
    assert a.topk_ids_TK.shape == (512, 8)
    np.testing.assert_array_equal(a.topk_ids_TK, b.topk_ids_TK)  # deterministic by seed
    from moonep_sim.routing.metrics import maxvio
    assert maxvio(np.bincount(a.topk_ids_TK.ravel(), minlength=384)) == pytest.approx(4, rel=0.1)


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "alltoall,nope"], "strategy ('nope') must be one of"),
    (["--topology", "h999"], "topology ('h999') must be a preset"),
    (["--ranks", "3"], "--ranks (3) must divide the routing's expert count (E=8)"),
    (["--ranks", "4", "--gpus-per-node", "3"], "must be divisible by --gpus-per-node (3)"),
    (["--layers", "99"], "--layers entry (99) must be one of the trace's layer ids"),
    (["--opt", "capacity.nope=1"], "option ('nope') must be one of strategy 'capacity'"),
    (["--real", "--nproc", "4", "--ranks", "8"], "--ranks (8) must equal --nproc (4) with --real"),
])
def test_compare_bad_input_is_one_line_before_work(argv, message, capsys, tmp_path):
    rc = main(["compare", "--trace", str(MIXTRAL), "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()  # nothing written: the error came before any work


def test_compare_bad_trace(capsys, tmp_path):
    assert main(["compare", "--trace", str(tmp_path / "missing.safetensors")]) == 2
    assert "must be an existing trace file" in capsys.readouterr().err
    assert main(["compare", "--trace", "gen:model=kimi-k3,bogus=1"]) == 2
    assert "generator spec key ('bogus') must be one of: model, maxvio" in capsys.readouterr().err


def test_compare_cli_writes_report_and_plots(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--trace", "gen:model=olmoe-1b-7b,maxvio=2,tokens-per-rank=64", "--strategies",
               "alltoall,moonep", "--ranks", "8", "--topology", "h800-cx7", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "alltoall" in text and "moonep" in text and "h800-cx7" in text
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["strategies"]) == {"alltoall", "moonep"}
    assert all((out / f).exists() for f in ("layer_time.png", "rows_per_rank.png", "traffic.png"))


def test_sweep_over_maxvio_and_a_topology_constant(tmp_path):
    from moonep_sim.experiments import Scenario

    sc = Scenario(routing="gen:model=olmoe-1b-7b,tokens-per-rank=64", cluster="16/8", strategies="alltoall,moonep")
    res = sc.sweep(over="maxvio", values=[0.5, 3.0])
    assert res.values == (0.5, 3.0) and len(res.layer_time_us["moonep"]) == 2
    rep = res.to_dict()
    assert rep["values"] == [0.5, 3.0]
    assert [p["realised_maxvio"] for p in rep["points"]] == pytest.approx([0.5, 3.0], rel=0.1)
    for s in rep["strategies"].values():
        assert len(s["layer_time_us"]) == 2 and all(r >= 1 - 1e-9 for r in s["ratio_to_lower_bound"])
    # the flat all-to-all suffers from imbalance; moonep keeps rows balanced
    a, b = rep["strategies"]["alltoall"], rep["strategies"]["moonep"]
    assert a["rows_max_over_mean"][1] > a["rows_max_over_mean"][0]
    assert max(b["rows_max_over_mean"]) < 1.05
    rep2 = Scenario(routing="gen:model=olmoe-1b-7b,tokens-per-rank=64", cluster="16/8", strategies="alltoall").sweep(
        over="nic_bandwidth_GBps", values=[25, 100]).to_dict()
    t = rep2["strategies"]["alltoall"]["layer_time_us"]
    assert t[0] > t[1]  # a faster NIC is never slower
    assert [p["topology"]["constants"]["nic_bandwidth_GBps"] for p in rep2["points"]] == [25, 100]
    from moonep_sim.report.plots import sweep_lines
    assert sweep_lines(rep, tmp_path / "s.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--model", "kimi-k9", "--over", "maxvio"], "model ('kimi-k9') must be one of the presets"),
    (["--model", "kimi-k3", "--over", "maxvio", "--values", "100"], "maxvio (100) must lie in (0, E/K-1 = 55]"),
    (["--model", "kimi-k3", "--over", "ep", "--values", "8,48"], "EP size (48) must divide kimi-k3's expert count"),
    (["--model", "kimi-k3", "--over", "color"], "--over ('color') must be maxvio, ep or a topology constant"),
    (["--model", "kimi-k3", "--over", "maxvio", "--strategies", "x"], "strategy ('x') must be one of"),
])
def test_sweep_bad_input(argv, message, capsys, tmp_path):
    assert main(["sweep", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_scenario_replay_runs_the_strategies_over_gloo():
    """Scenario.replay: the same scenario replayed for real (2 ranks, small rows), every strategy
    checked against the dense reference."""
    from moonep_sim.experiments import Scenario

    res = Scenario(routing=str(MIXTRAL), cluster="2/2", strategies="alltoall,moonep", layers=[0, 31]).replay(
        nproc=2, iters=1, warmup=0, hidden=32, ffn=64, check=True, timeout_s=120)
    assert res.strategies == ("alltoall", "moonep")
    assert all(v > 0 for v in res.measured_ms.values())
    assert res.correct == {"alltoall": True, "moonep": True}
    moon = res.to_dict()["strategies"]["moonep"]
    # one record per replayed (step, layer): each recorded step its own batch, naming the model's
    # layer ids the scenario asked for
    assert [(e["step"], e["layer_id"]) for e in moon["per_layer"]] == [(0, 0), (0, 31), (1, 0), (1, 31)]
    assert len(moon["layers"]) == 2, moon["layers"]
    assert moon["per_step"]["step"] == [0, 1] and moon["per_step"]["tokens"] == [81, 252]


def test_scenario_plans_simulate_and_steps():
    from moonep_sim.experiments import Scenario

    sc = Scenario(routing=str(MIXTRAL), cluster="4/2", strategies=["alltoall", ("capacity", {"cf": 1.5})],
                  layers=[0], steps="0")
    plans = sc.plans()
    assert plans.plan("capacity").options["cf"] == 1.5
    assert sum(plans.plan("alltoall").summary()["recv_rows_per_rank"]) == 2 * sc.resolved.source.tokens
    assert sc.resolved.source.tokens < 333  # step 0 only
    sim = sc.simulate()
    assert set(sim.layer_time_us) == {"alltoall", "capacity"} and sim.to_dict()["topology"]["name"] == "h800-cx7"
    with pytest.raises(Exception, match="generator spec key"):
        Scenario(routing="gen:maxvoi=3").check()
