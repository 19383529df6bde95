"""The verdict of ``Scenario.simulate`` / ``moonep-sim simulate``: a chain of layers (and a
backward) read stage by stage on each stage's critical rank, so that cases whose cause is known
name their mechanism on the simulate path too (issue 21, item 3)."""

from __future__ import annotations

import json

import pytest

from conftest import TRACES
from moonep_sim.experiments import Scenario
from moonep_sim.analysis.verdict import MECHANISMS, chain_figures, critical_breakdown, figures, terms

MIXTRAL = TRACES / "mixtral-8x7b_humaneval.safetensors"
K3 = "gen:model=kimi-k3,maxvio=1,tokens-per-rank=64"


def test_stage_windows_cover_the_run_and_their_parts_sum_to_it():
    res = Scenario(routing=str(MIXTRAL), cluster="4/2", strategies="moonep", layers=[0, 1],
                   steps="0").simulate(backward=True)
    d = res.per_strategy["moonep"]
    st = d["stages"]
    assert [(s["layer"], s["direction"]) for s in st] == [(0, "forward"), (1, "forward"), (1, "backward"),
                                                         (0, "backward")]
    assert st[0]["start_us"] == 0.0 and st[-1]["end_us"] == d["layer_time_us"]
    assert all(a["end_us"] == b["start_us"] for a, b in zip(st, st[1:]))  # contiguous windows
    for s in st:
        parts = s["plan_us"] + s["dispatch_us"] + s["compute_us"] + s["combine_us"]
        assert parts == pytest.approx(s["end_us"] - s["start_us"], rel=1e-12, abs=1e-9)
        assert 0 <= s["fixed_us"] <= s["dispatch_us"] + s["combine_us"] + 1e-9
        assert (s["plan_us"] > 0) == (s["direction"] == "forward")  # planning runs before the forward only
    # moonep's copies: forward waits for prefetched weights, backward for the gradients sent home
    assert st[0]["weights_us"] > 0.5 * st[0]["dispatch_us"] and st[-1]["weights_us"] > 0.5 * st[-1]["combine_us"]
    cb = critical_breakdown(d)
    assert sum(cb.values()) == pytest.approx(d["layer_time_us"])
    sc = Scenario(routing=str(MIXTRAL), cluster="4/2", strategies="moonep", layers=[0, 1], steps="0")
    plans = [it.plan for it in sc.plans().items]
    f = chain_figures(plans, d, sc.resolved.topology)
    assert sum(terms(f).values()) == pytest.approx(d["layer_time_us"])
    assert set(terms(f)) == set(MECHANISMS)
    # counts once per layer, bytes forward + backward
    assert f["weight_copies"] == sum(p.weight_copies for p in plans)
    fwd = sum(figures(p, {"layer_time_us": 0.0}, None)["inter_node_bytes"] for p in plans)
    assert f["inter_node_bytes"] > fwd  # the backward's token rows cross nodes too


def test_one_stage_parts_equal_the_per_rank_reading():
    # the chain reading of one stage agrees with the single-layer reading (per_rank and phases)
    sc = Scenario(routing=K3, cluster="64/8", strategies="deepep")
    raw = sc.simulate().raw["deepep"]
    (s,) = raw.stages
    cb = critical_breakdown(raw.to_dict())
    assert "stages" not in raw.to_dict()  # a single stage's JSON is unchanged
    got = {"plan": s["plan_us"], "dispatch + wait": s["dispatch_us"], "compute": s["compute_us"],
           "combine": s["combine_us"]}
    assert got == pytest.approx(cb, rel=1e-9, abs=1e-9)


def test_chained_layers_on_a_multi_node_cluster_name_node_deduplication():
    sc = Scenario(routing=K3, cluster="64/8", strategies="alltoall,deepep", layers=[0, 1])
    res = sc.simulate()
    v = res.verdict
    assert (v["winner"], v["runner_up"], v["mechanism"]) == ("deepep", "alltoall", "inter-node bytes")
    assert "node deduplication" in v["why"] and "per step" in v["why"]
    assert v["margin"] == pytest.approx(res.layer_time_us["alltoall"] / res.layer_time_us["deepep"] - 1)
    # the spread is over the chain's two layers; deepep is faster in both
    assert v["confidence"]["unit"] == "layer" and v["confidence"]["units"] == 2
    assert v["confidence"]["level"] == "high"
    # the bytes in the sentence are the two layers' forward token bytes, summed
    plans = sc.plans()
    inter = {n: sum(figures(plans.plan(n, l), {"layer_time_us": 0.0})["inter_node_bytes"] for l in (0, 1))
             for n in ("deepep", "alltoall")}
    assert inter["deepep"] < 0.6 * inter["alltoall"]
    assert f"{inter['deepep'] / 2**30:.3g} GiB" in v["why"] and f"{inter['alltoall'] / 2**30:.3g} GiB" in v["why"]
    assert sum(v["terms_us"]["deepep"].values()) == pytest.approx(res.layer_time_us["deepep"])


def test_one_layer_simulate_gives_the_compare_verdict():
    sc = Scenario(routing=K3, cluster="64/8", strategies="alltoall,deepep")
    s, c = sc.simulate().verdict, sc.compare().verdict
    for k in ("winner", "runner_up", "mechanism", "why"):
        assert s[k] == c[k], k
    assert s["margin"] == pytest.approx(c["margin"], rel=1e-12)
    assert s["confidence"]["level"] == c["confidence"]["level"] == "single sample"


def test_a_training_step_of_copies_loses_on_weight_copies():
    res = Scenario(routing=str(MIXTRAL), cluster="4/2", strategies="alltoall,moonep",
                   layers=[0, 1]).simulate(backward=True)
    v = res.verdict
    assert (v["winner"], v["runner_up"], v["mechanism"]) == ("alltoall", "moonep", "weight copies")
    assert "moonep copies" in v["why"] and "GiB of weights" in v["why"]
    n = len(res.per_strategy["moonep"]["per_step"]["step"])
    assert n > 1 and v["confidence"]["unit"] == "step" and v["confidence"]["units"] == n  # over the trace's steps
    assert v["flags"] == {"moonep": ["outside-library"]}  # moonep on 2 nodes: beyond its real library
    assert res.to_dict()["verdict"] == v and "wins by" in repr(res) and "(weight copies)" in repr(res)


def test_padded_chain_names_padding():
    sc = Scenario(routing="gen:model=kimi-k3,uniform=1,tokens-per-rank=4", cluster="8/8",
                  strategies="alltoall,capacity", options={"capacity": {"cf": 32}}, layers=[0, 1])
    assert all(it.plan.dropped == 0 for it in sc.plans().items)  # dropless: a fair race, lost on padding
    res = sc.simulate()
    v = res.verdict
    assert (v["winner"], v["mechanism"]) == ("alltoall", "padding") and "are padding" in v["why"]
    assert "padded-rows" in {f["code"] for f in res.flags}


def test_one_strategy_states_it_and_isolate_gives_none():
    sc = Scenario(routing=str(MIXTRAL), cluster="4/4", strategies="alltoall", layers=[0], steps="0")
    v = sc.simulate().verdict
    assert v["winner"] == "alltoall" and v["runner_up"] is None and v["mechanism"] is None
    assert v["confidence"]["level"] == "single strategy" and "only strategy" in v["why"]
    assert "alltoall alone" in repr(sc.simulate())
    assert sc.simulate(isolate="dispatch").verdict is None  # a kernel timed alone is no comparison


def test_cli_simulate_prints_the_verdict_and_flags_and_writes_them_to_json(capsys, tmp_path):
    from moonep_sim.cli import main

    argv = ["simulate", "--trace", str(MIXTRAL), "--ranks", "4", "--gpus-per-node", "2", "--layers", "0,1",
            "--strategy", "alltoall,moonep"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "verdict: alltoall wins by" in out and "mechanism: weight copies" in out
    assert "flag outside-library: moonep on 2 nodes" in out
    assert out.count("straggler:") == 2  # one block per strategy
    assert main(argv + ["--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["kind"] == "simulate" and set(js["strategies"]) == {"alltoall", "moonep"}
    assert js["verdict"]["mechanism"] == "weight copies" and js["verdict"]["why"]
    assert {f["code"] for f in js["flags"]} == {"outside-library"}
    # one strategy: the flat JSON as before, with its flags and the one-strategy verdict beside it
    assert main(argv[:-1] + ["moonep", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["strategy"] == "moonep" and one["verdict"]["confidence"]["level"] == "single strategy"
    assert [f["code"] for f in one["flags"]] == ["outside-library"]
    assert main(argv + ["--isolate", "dispatch", "--layers", "0"]) == 2  # one strategy only
    assert "--isolate takes one --strategy" in capsys.readouterr().err


def test_saved_simulate_report_carries_the_verdict(tmp_path):
    res = Scenario(routing=K3, cluster="64/8", strategies="alltoall,deepep", layers=[0, 1]).simulate()
    paths = res.save(tmp_path / "sim", plots=False)
    html = (tmp_path / "sim" / "report.html").read_text()
    assert "deepep wins by" in html and "inter-node bytes" in html
    assert json.loads((tmp_path / "sim" / "report.json").read_text())["verdict"]["winner"] == "deepep"
    assert paths


def test_eplb_default_on_simulate_is_flagged_as_an_oracle_in_the_verdict():
    res = Scenario(routing=str(MIXTRAL), cluster="4/4", strategies="alltoall,eplb", layers=[0], steps="0").simulate()
    codes = {(f["code"], f["strategy"]) for f in res.flags}
    assert {("oracle", "eplb"), ("free-migration", "eplb")} <= codes
    v = res.verdict
    assert {v["winner"], v["runner_up"]} == {"alltoall", "eplb"}
    assert {"oracle", "free-migration"} <= set(v["flags"]["eplb"])
    from moonep_sim.report.tables import verdict_line

    assert "(eplb flagged: free-migration, oracle" in verdict_line(v)


def test_seeds_of_generated_routing_give_simulate_a_spread():
    sc = Scenario(routing="gen:model=mixtral-8x7b,tokens-per-rank=64", cluster="4/2", strategies="alltoall,deepep")
    res = sc.simulate(seeds=3)
    d = res.per_strategy["deepep"]
    assert d["seeds"] == [0, 1, 2] and len(set(d["seed_layer_time_us"])) == 3  # each seed its own draw
    assert res.layer_time_us["deepep"] == pytest.approx(sum(d["seed_layer_time_us"]) / 3)
    assert d["layer_time_us"] == d["seed_layer_time_us"][0] == sc.simulate().layer_time_us["deepep"]
    v = res.verdict
    assert v["confidence"]["unit"] == "seed" and v["confidence"]["units"] == 3 and "over 3 seeds" in v["confidence"]["basis"]
    assert v["margin"] == pytest.approx(res.layer_time_us[v["runner_up"]] / res.layer_time_us[v["winner"]] - 1)
    from moonep_sim.errors import ConfigError

    with pytest.raises(ConfigError, match=r"seeds \(2\) apply to generated routing"):
        Scenario(routing=str(MIXTRAL), cluster=4, strategies="alltoall").simulate(seeds=2)
    with pytest.raises(ConfigError, match=r"seeds \(0\) must be an integer in \[1, 64\]"):
        sc.simulate(seeds=0)


def test_a_step_without_tokens_at_one_layer_keeps_its_terms(tmp_path):
    # two steps, two layers; step 1 has no token at layer 1 (a per-layer token mask): its chain is one
    # stage, the other's two, and the verdict's terms still sum to the token-weighted mean time
    import numpy as np

    from moonep_sim.routing.trace import TraceMeta, write_trace

    rng = np.random.default_rng(3)
    L, T, K, E = 2, 96, 2, 8
    ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)]) for _ in range(L)]).astype(np.int32)
    mask = np.ones((L, T), np.uint8)
    step = np.repeat(np.array([0, 1], np.int32), [64, 32])
    mask[1, 64:] = 0
    ids[1, 64:] = np.arange(K)  # filler ids where the mask is 0
    w = np.where(mask[..., None] > 0, 0.5, 0.0).astype(np.float32) * np.ones((L, T, K), np.float32)
    path = write_trace(tmp_path / "m.safetensors", TraceMeta("tokens", E, K, [0, 1], T, model="mixtral-8x7b"),
                       {"topk_ids": ids, "topk_weights": w, "step": step, "token_mask": mask})
    res = Scenario(routing=str(path), cluster="4/2", strategies="alltoall,deepep").simulate()
    assert res.per_strategy["alltoall"]["per_step"]["step"] == [0, 1]
    v = res.verdict
    assert v["confidence"]["unit"] == "step" and v["mechanism"] in MECHANISMS
    for n in ("alltoall", "deepep"):
        assert sum(v["terms_us"][n].values()) == pytest.approx(res.layer_time_us[n], rel=1e-9)


def test_cli_gen_chains_the_specs_layers(capsys):
    from moonep_sim.cli import main

    assert main(["simulate", "--gen", "model=mixtral-8x7b,tokens-per-rank=64,layers=2", "--ranks", "4",
                 "--strategy", "alltoall,deepep", "--backward", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["layers"] == [0, 1]
    st = js["strategies"]["deepep"]["stages"]
    assert [(s["layer"], s["direction"]) for s in st] == [(0, "forward"), (1, "forward"), (1, "backward"),
                                                         (0, "backward")]
    assert js["verdict"]["confidence"]["unit"] == "layer" and js["verdict"]["confidence"]["units"] == 2


def test_cli_simulate_out_writes_the_html_report_with_the_verdict(capsys, tmp_path):
    from moonep_sim.cli import main

    out = tmp_path / "sim"
    assert main(["simulate", "--trace", str(MIXTRAL), "--ranks", "4", "--gpus-per-node", "2", "--layers", "0,1",
                 "--strategy", "alltoall,moonep", "--out", str(out)]) == 0
    assert "wrote " in capsys.readouterr().out
    html = (out / "report.html").read_text()
    assert "alltoall wins by" in html and "weight copies" in html and "outside-library" in html
    assert (out / "layer_time.png").read_bytes()[:4] == b"\x89PNG"
    rep = json.loads((out / "report.json").read_text())
    assert rep["kind"] == "simulate" and rep["verdict"]["mechanism"] == "weight copies"
    assert set(rep["provenance"]) >= {"command", "versions", "date_utc"}
