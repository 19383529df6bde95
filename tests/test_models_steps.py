"""Model shapes from presets, files and Hugging Face configs; step selection over a trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.models import PRESETS, model_fields, resolve_model
from moonep_sim.routing.steps import parse_steps, read_layer, select_layer, selected_steps_T, token_ranges
from moonep_sim.routing.trace import Trace, TraceMeta, write_trace


@pytest.mark.parametrize("name,E,K,H,F,shared", [
    ("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408, 4),
    ("qwen3-30b-a3b", 128, 8, 2048, 768, 0),
    ("deepseek-v2-lite", 64, 6, 2048, 1408, 2),
    ("gpt-oss-20b", 32, 4, 2880, 2880, 0),
])
def test_new_presets(name, E, K, H, F, shared):
    m = resolve_model(name)
    assert (m.num_experts, m.top_k, m.hidden, m.expert_ffn, m.shared_experts) == (E, K, H, F, shared)
    assert m.source.endswith("config.json")


def test_every_preset_round_trips_through_its_fields():
    for m in PRESETS.values():
        assert resolve_model(model_fields(m)) == m


def test_model_files(tmp_path):
    toml = tmp_path / "mine.toml"
    toml.write_text('name = "mine"\nnum_experts = 60\ntop_k = 4\nhidden = 2048\nexpert_ffn = 1408\n'
                    'shared_experts = 4\ngroups = 4\ntopk_groups = 2\n')
    m = resolve_model(str(toml))
    assert (m.name, m.num_experts, m.top_k, m.n_groups, m.topk_groups, m.shared_experts) == ("mine", 60, 4, 4, 2, 4)
    assert m.row_bytes_bf16 == 4096 and m.expert_weight_elems == 3 * 2048 * 1408
    js = tmp_path / "m.json"
    js.write_text(json.dumps({"num_experts": 16, "top_k": 2, "hidden": 256, "expert_ffn": 128,
                              "dispatch_hidden": 128}))
    m = resolve_model(js)
    assert (m.name, m.dispatch_hidden, m.hidden) == ("m", 128, 256)
    # a Hugging Face config.json (DeepSeek-V2-Lite's MoE fields)
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "deepseek_v2", "hidden_size": 2048, "moe_intermediate_size": 1408,
                              "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
                              "num_hidden_layers": 27, "first_k_dense_replace": 1, "n_group": 1,
                              "topk_group": 1, "intermediate_size": 10944}))
    m = resolve_model(hf)
    p = PRESETS["deepseek-v2-lite"]
    assert (m.num_experts, m.top_k, m.hidden, m.expert_ffn, m.shared_experts, m.layers, m.moe_layers) == \
        (p.num_experts, p.top_k, p.hidden, p.expert_ffn, p.shared_experts, p.layers, p.moe_layers)


@pytest.mark.parametrize("text,match", [
    ('num_experts = 8\ntop_k = 2\nhidden = 64\n', r"fields \(expert_ffn\) must be given"),
    ('num_experts = 8\ntop_k = 2\nhidden = 64\nexpert_ffn = 32\nhiden = 3\n', r"field \('hiden'\) must be one of"),
    ('num_experts = 8\ntop_k = 9\nhidden = 64\nexpert_ffn = 32\n', r"top_k \(9\) must be <= num_experts \(8\)"),
    ('num_experts = "8"\ntop_k = 2\nhidden = 64\nexpert_ffn = 32\n', r"num_experts \('8'\) must be an integer"),
    # a field named as the file spells it (``groups``, not ModelSpec's ``n_groups``)
    ('num_experts = 8\ntop_k = 2\nhidden = 64\nexpert_ffn = 32\ngroups = 3\n',
     r"num_experts \(8\) must be divisible by groups \(3\)$"),
    ('num_experts = 8\ntop_k = 2\nhidden = 64\nexpert_ffn = 32\nn_groups = 3\n',
     r"num_experts \(8\) must be divisible by n_groups \(3\)$"),
    ('num_experts = [', r"model \(.*bad\.toml\) must be valid TOML"),
])
def test_bad_model_files(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        resolve_model(str(f))


def test_bad_model_names(tmp_path):
    with pytest.raises(ConfigError, match=r"model \('mixtral-9x9b'\) must be one of the presets"):
        resolve_model("mixtral-9x9b")
    with pytest.raises(ConfigError, match="no such file"):
        resolve_model(str(tmp_path / "absent.toml"))


def _stepped_trace(tmp_path, sizes):
    rng = np.random.default_rng(1)
    T = sum(sizes)
    ids = np.argsort(rng.random((2, T, 16)), axis=2)[:, :, :4]
    w = rng.random((2, T, 4)).astype(np.float32)
    step = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
    meta = TraceMeta(kind="tokens", num_experts=16, top_k=4, layer_ids=[3, 5], num_tokens=T,
                     model_spec=model_fields(resolve_model({"name": "t", "num_experts": 16, "top_k": 4,
                                                            "hidden": 64, "expert_ffn": 32})))
    path = tmp_path / "s.safetensors"
    write_trace(path, meta, {"topk_ids": ids, "topk_weights": w, "step": step})
    return path, ids, w, step


def test_step_selection(tmp_path):
    path, ids, w, step = _stepped_trace(tmp_path, [5, 1, 1, 7, 0, 3])   # step 4 is empty
    tr = Trace(path)
    assert tr.model().hidden == 64
    for text in ("1-3", "0,2,5", "3-", "2", "all", None, "4"):
        sel = parse_steps(text)
        want = np.ones(len(step), bool) if sel is None else np.isin(step, sel.steps(6))
        lr = read_layer(tr, 1, text)
        np.testing.assert_array_equal(lr.topk_ids_TK, ids[1][want])
        np.testing.assert_array_equal(lr.topk_weights_TK, w[1][want])
        np.testing.assert_array_equal(selected_steps_T(tr, text), step[want])
        cut = select_layer(tr.layer(1), step, text)  # the same selection of a layer already read
        np.testing.assert_array_equal(cut.topk_ids_TK, ids[1][want])
        np.testing.assert_array_equal(cut.topk_weights_TK, w[1][want])
        assert (cut.num_experts, cut.layer) == (16, 5)
    assert token_ranges(step, len(step), "0-2") == [(0, 7)]
    assert token_ranges(None, 10, "0") == [(0, 10)]


@pytest.mark.parametrize("text,match", [("7", r"it has 6 step\(s\)"), ("3-1", "first <= last"),
                                        ("a-b", "must be step numbers"), ("1--2", "must be step numbers")])
def test_bad_step_selection(tmp_path, text, match):
    path, *_ = _stepped_trace(tmp_path, [5, 1, 1, 7, 0, 3])
    with pytest.raises(ConfigError, match=match):
        read_layer(path, 0, text)


def test_plan_costs_rows_with_a_model_file(tmp_path, capsys):
    """`--model FILE` reaches a command that costs rows: plan's row bytes follow the file's width."""
    from moonep_sim.cli import main
    path, *_ = _stepped_trace(tmp_path, [40, 24])
    f = tmp_path / "wide.toml"
    f.write_text("num_experts = 16\ntop_k = 4\nhidden = 4096\nexpert_ffn = 1024\n")
    out = {}
    for name, model in (("file", str(f)), ("trace", None)):
        argv = ["plan", "--trace", str(path), "--strategy", "alltoall", "--ranks", "4", "--json"]
        assert main(argv + (["--model", model] if model else [])) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert out["file"]["model"] == "wide"
    b_file, b_trace = out["file"]["bytes"], out["trace"]["bytes"]   # the trace's stored model: 64 wide
    moved = [k for k in b_file if b_trace[k]]
    assert moved and all(b_file[k] == 64 * b_trace[k] for k in moved)


def test_trace_gen_stores_a_model_file(tmp_path):
    from moonep_sim.cli import main
    f = tmp_path / "g.toml"
    f.write_text("num_experts = 24\ntop_k = 3\nhidden = 512\nexpert_ffn = 256\ngroups = 4\ntopk_groups = 2\n")
    out = tmp_path / "g.safetensors"
    assert main(["trace", "gen", "--model", str(f), "--tokens", "256", "--seed", "0", "--maxvio", "0.8",
                 "-o", str(out)]) == 0
    tr = Trace(out)
    assert tr.meta.model is None and tr.model() == resolve_model(str(f))
    out2 = tmp_path / "p.safetensors"
    assert main(["trace", "gen", "--model", "gpt-oss-20b", "--tokens", "256", "--seed", "0", "--uniform",
                 "-o", str(out2)]) == 0
    assert Trace(out2).meta.model == "gpt-oss-20b"


def test_experiments_cost_rows_with_the_traces_stored_model(tmp_path):
    """A trace imported or generated with a model file carries its shape; the experiments layer
    (every command) uses it when no --model is given."""
    from moonep_sim.experiments.routing import open_routing
    path, *_ = _stepped_trace(tmp_path, [8, 8])          # model_spec: hidden 64, expert FFN 32
    src = open_routing(str(path))
    assert (src.model.hidden, src.model.expert_ffn, src.model.name) == (64, 32, "t")
    assert open_routing(str(path), model=str(_toml(tmp_path))).model.hidden == 128   # --model FILE wins


def _toml(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text("num_experts = 16\ntop_k = 4\nhidden = 128\nexpert_ffn = 64\n")
    return f
