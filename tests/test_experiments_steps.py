"""Steps as the default unit: every recorded step costed as its own batch, aggregated over steps;
merging steps only when asked, with a warning; identical points computed once; the typed spec."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TRACES
from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.experiments import Scenario

VLLM_LOG = TRACES / "qwen1.5-moe-a2.7b_layer0_vllm_routes_sample.jsonl"
OLMOE = TRACES / "olmoe-1b-7b_layer0.safetensors"
STRATS = "alltoall,deepep,moonep"


@pytest.fixture(scope="module")
def vllm_trace(tmp_path_factory):
    """The shipped vLLM route log (decode passes of 11-16 tokens), imported as it would be by a user."""
    from moonep_sim.routing.importers import import_trace

    out = tmp_path_factory.mktemp("vllm") / "qwen.safetensors"
    import_trace(VLLM_LOG, out)
    return out


@pytest.fixture(scope="module")
def per_step(vllm_trace):
    return Scenario(routing=str(vllm_trace), strategies=STRATS).compare().to_dict()


def test_default_compare_costs_each_recorded_step(per_step, vllm_trace):
    from moonep_sim.routing.trace import Trace

    n = np.bincount(Trace(vllm_trace).steps())
    st = per_step["steps"]
    assert st["mode"] == "each" and st["costed_step_ids"] == list(range(len(n)))
    assert st["costed_tokens"] == n.tolist() and len(n) > 10
    assert per_step["warnings"] == []
    for name, s in per_step["strategies"].items():
        ser = s["per_step"]
        assert ser["step"] == st["costed_step_ids"] and len(ser["layer_time_us"]) == len(n)
        # every step's figure is that step's own entry (one layer here)
        assert ser["layer_time_us"] == [e["sim"]["layer_time_us"] for e in s["layers"]]
        agg = s["steps_aggregate"]["layer_time_us"]
        t = np.asarray(ser["layer_time_us"])
        assert agg["token_weighted_mean"] == pytest.approx(float((t * n).sum() / n.sum()))
        assert agg["median"] == pytest.approx(float(np.median(t)))
        assert agg["p90"] == pytest.approx(float(np.percentile(t, 90)))
        assert agg["worst"] == pytest.approx(t.max()) and agg["worst_step"] == int(np.argmax(t))
        assert s["sim"]["layer_time_us_mean"] == pytest.approx(agg["token_weighted_mean"])
    assert sum(st["wins"].values()) == len(n)


def test_a_step_alone_is_the_same_figure(per_step, vllm_trace):
    """Selecting one step costs exactly what the per-step series says of it."""
    one = Scenario(routing=str(vllm_trace), strategies=STRATS, steps="5").compare().to_dict()
    assert one["steps"]["costed_step_ids"] == [5]
    for name in STRATS.split(","):
        assert one["strategies"][name]["sim"]["layer_time_us_mean"] == pytest.approx(
            per_step["strategies"][name]["per_step"]["layer_time_us"][5])


def test_merged_only_when_asked_and_warned(per_step, vllm_trace):
    merged = Scenario(routing=str(vllm_trace), strategies=STRATS, steps="merged").compare().to_dict()
    assert merged["steps"]["mode"] == "merged" and merged["steps"]["costed_step_ids"] == [None]
    assert len(merged["warnings"]) == 1 and "steps merged" in merged["warnings"][0]
    # one batch of every token: a different (larger) batch than any recorded pass
    for name in STRATS.split(","):
        m = merged["strategies"][name]["sim"]["layer_time_us_mean"]
        assert m != pytest.approx(per_step["strategies"][name]["sim"]["layer_time_us_mean"])


def test_cli_prints_per_step_aggregates_and_warns_only_when_merged(vllm_trace, tmp_path, capsys):
    assert main(["compare", "--trace", str(vllm_trace), "--strategies", STRATS, "--jobs", "1", "--no-plots",
                 "--out", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    assert "token-weighted mean / median / p90 / worst" in out and "fastest by the token-weighted mean" in out
    assert "warning" not in err
    assert main(["compare", "--trace", str(vllm_trace), "--strategies", STRATS, "--jobs", "1", "--no-plots",
                 "--steps", "merged", "--json", "--out", str(tmp_path / "b")]) == 0
    out, err = capsys.readouterr()
    assert "moonep-sim: warning: steps merged: 18 recorded steps" in err
    assert json.loads(out)["steps"]["mode"] == "merged"


def test_a_trace_with_one_step_behaves_as_before():
    rep = Scenario(routing=str(OLMOE), cluster=8, strategies="alltoall,moonep").compare().to_dict()
    assert rep["steps"]["costed_step_ids"] == [0] and rep["warnings"] == []
    for s in rep["strategies"].values():
        assert s["sim"]["layer_time_us_mean"] == pytest.approx(np.mean([e["sim"]["layer_time_us"] for e in s["layers"]]))
        assert s["steps_aggregate"]["layer_time_us"]["median"] == pytest.approx(s["sim"]["layer_time_us_mean"])


def test_identical_steps_are_planned_once(tmp_path):
    """Three steps, two with the same routing: two distinct points per strategy, equal figures."""
    from moonep_sim.routing.generators import generate_layer
    from moonep_sim.routing.trace import TraceMeta, write_trace

    a = generate_layer(16, 2, 32, 1, uniform=True)
    b = generate_layer(16, 2, 24, 2, zipf=1.5)
    ids = np.concatenate([a.topk_ids_TK, b.topk_ids_TK, a.topk_ids_TK])[None].astype(np.int32)
    w = np.concatenate([a.topk_weights_TK, b.topk_weights_TK, a.topk_weights_TK])[None].astype(np.float32)
    step = np.repeat([0, 1, 2], [32, 24, 32]).astype(np.int32)
    path = tmp_path / "rep.safetensors"
    write_trace(path, TraceMeta(kind="tokens", num_experts=16, top_k=2, layer_ids=[0], num_tokens=88),
                {"topk_ids": ids, "topk_weights": w, "step": step})
    rep = Scenario(routing=str(path), cluster=4, strategies="alltoall,moonep").compare().to_dict()
    assert rep["steps"]["simulated_points"] == 4 and rep["steps"]["reused_points"] == 2
    for s in rep["strategies"].values():
        t = s["per_step"]["layer_time_us"]
        assert t[0] == t[2] and t[0] != t[1]


def test_simulate_aggregates_over_steps(vllm_trace):
    res = Scenario(routing=str(vllm_trace), strategies="alltoall").simulate()
    d = res.per_strategy["alltoall"]
    assert len(d["per_step"]["step"]) == 18
    assert res.layer_time_us["alltoall"] == pytest.approx(d["steps_aggregate"]["layer_time_us"]["token_weighted_mean"])
    assert d["layer_time_us"] == pytest.approx(max(d["per_step"]["layer_time_us"]))  # details: the worst step
    assert res.steps["warnings"] == []


@pytest.mark.parametrize("text, merged, sel", [(None, False, None), ("all", False, None), ("each", False, None),
                                               ("3-5", False, "3-5"), ("merged", True, None),
                                               ("merged:0,2", True, "0,2")])
def test_step_mode_grammar(text, merged, sel):
    from moonep_sim.routing.steps import parse_step_mode

    m = parse_step_mode(text)
    assert m.merged == merged and (m.selection.text if m.selection else None) == sel


def test_step_mode_refuses_an_empty_merged_selection():
    from moonep_sim.routing.steps import parse_step_mode

    with pytest.raises(ConfigError, match=r"--steps \('merged:'\) must give steps after merged:"):
        parse_step_mode("merged:")


# -- one parser for strategies, options and dtypes; the typed replay spec ------------------------------
@pytest.mark.parametrize("text, want", [("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"), ("fp8", "fp8"),
                                        ("float8", "fp8")])
def test_dtype_spellings(text, want):
    from moonep_sim.experiments.spec import normalise_dtype

    assert normalise_dtype(text) == want


def test_dtype_refusal_names_the_accepted_spellings():
    from moonep_sim.experiments.spec import REPLAY_DTYPES, dtype_name, normalise_dtype

    with pytest.raises(ConfigError, match=r"dispatch dtype \('fp16'\) must be one of bf16, fp8"):
        normalise_dtype("fp16")
    assert dtype_name("bf16", tuple(REPLAY_DTYPES)) == "bf16" and dtype_name("float32", tuple(REPLAY_DTYPES)) == "fp32"


def test_opt_items_parse_alike_everywhere():
    from moonep_sim.experiments.spec import parse_opt_items

    assert parse_opt_items(["capacity.cf=1.5", "moonep.token-padding=8"], ["capacity", "moonep"]) == {
        "capacity": {"cf": "1.5"}, "moonep": {"token_padding": "8"}}
    assert parse_opt_items(["cf=2"], ["capacity"]) == {"capacity": {"cf": "2"}}
    assert parse_opt_items(["x=1"], ["a", "b"], plain="all") == {"a": {"x": "1"}, "b": {"x": "1"}}
    with pytest.raises(ConfigError, match=r"--opt \('x=1'\) must look like STRATEGY.key=value"):
        parse_opt_items(["x=1"], ["a", "b"])
    with pytest.raises(ConfigError, match=r"--opt strategy \('c'\) must be one of the strategies \(a, b\)"):
        parse_opt_items(["c.x=1"], ["a", "b"])


def test_replay_spec_round_trips_typed_options(tmp_path):
    from moonep_sim.experiments.compare import replay_spec
    from moonep_sim.experiments.spec import ReplaySpec

    sc = Scenario(routing=str(OLMOE), cluster="4/2", strategies=[("capacity", {"cf": 1.25}), ("moonep", {})],
                  steps="merged")
    spec = replay_spec(sc.resolved, OLMOE, hidden=16, ffn=8, iters=2)
    back = ReplaySpec.read(spec.write(tmp_path / "s.json"))
    assert back == spec
    assert back.strategies == (("capacity", {"cf": 1.25}), ("moonep", {})) and back.steps == "merged"
    assert back.gpus_per_node == 2 and back.layers == (0,)
    (tmp_path / "bad.json").write_text(json.dumps({"moonep_sim_replay_spec": 1, "trace": "x", "strategies": [],
                                                   "nope": 1}))
    with pytest.raises(ConfigError, match=r"field \(nope\) must be one of"):
        ReplaySpec.read(tmp_path / "bad.json")


def test_deepep_node_limited_routing_is_one_code_path(tmp_path):
    """plans() and compare() plan deepep max_nodes on the same re-routed routing."""
    from moonep_sim.routing.trace import TraceMeta, write_trace

    lg = np.random.default_rng(3).normal(size=(1, 64, 16)).astype(np.float32)
    ids = np.argsort(-lg, axis=2)[:, :, :4].astype(np.int32)
    w = np.full(ids.shape, 0.25, np.float32)
    path = tmp_path / "logits.safetensors"
    write_trace(path, TraceMeta(kind="tokens", num_experts=16, top_k=4, layer_ids=[0], num_tokens=64),
                {"topk_ids": ids, "topk_weights": w, "router_logits": lg})
    sc = Scenario(routing=str(path), cluster="8/2", strategies=[("deepep", {"max_nodes": 1})], steps="merged")
    plan = sc.plans().plan("deepep")
    rep = sc.compare().to_dict()
    assert rep["strategies"]["deepep"]["layers"][0]["plan"]["bytes"] == plan.bytes_summary()
    plain = Scenario(routing=str(path), cluster="8/2", strategies="deepep", steps="merged").plans().plan("deepep")
    assert plan.bytes_summary() != plain.bytes_summary()  # the node limit did change the routing
