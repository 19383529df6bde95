"""Importers: every real file, format detection, and every bad-input case (one line, exit 2,
no output file)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from conftest import TRACES
from moonep_sim.cli import main
from moonep_sim.errors import TraceFormatError
from moonep_sim.routing.importers import detect_format, import_trace, load_source
from moonep_sim.routing.trace import Trace

# samples of real records shipped in traces/ (cut by traces/cut_real_samples.py, attribution in
# traces/SOURCES.md): the tests stand on the repository alone, nothing is skipped
MIXTRAL = TRACES / "mixtral-8x7b_humaneval_routing_sample.jsonl"   # tokens 0-7 of both problems + the 5 incomplete
OLMOE = TRACES / "olmoe-1b-7b_layer0_vllm_routes_sample.jsonl"     # meta, 100 dummy rows, 300 real rows
SWITCH = TRACES / "switch-base-128_expert_counts.json"             # whole
QWEN = TRACES / "qwen1.5-moe-a2.7b_layer0_vllm_routes_sample.jsonl"


# ---------------------------------------------------------------------------------- real files
def test_mixtral_records(tmp_path):
    out = tmp_path / "m.safetensors"
    assert detect_format(MIXTRAL) == "jsonl-records"
    assert main(["trace", "import", str(MIXTRAL), "-o", str(out), "--model", "mixtral-8x7b",
                 "--drop-incomplete-tokens"]) == 0
    tr = Trace(out)
    m = tr.meta
    assert (m.num_experts, m.top_k, m.layer_ids, m.num_tokens) == (8, 2, list(range(32)), 16)
    assert m.import_report["tokens_missing_layers_dropped"] == 5
    assert m.import_report["duplicate_records_dropped"] == 0
    assert "Mario928/speculative-moe" in m.attribution
    # hand check: the first records of the file are problem 0, layer 0, tokens 0.. in order
    recs = [json.loads(l) for l in MIXTRAL.read_text().splitlines()[:3]]
    lr = tr.layer(0)
    for t, r in enumerate(recs):
        assert lr.topk_ids_TK[t].tolist() == r["experts"]
        np.testing.assert_allclose(lr.topk_weights_TK[t], r["gating_probs"], rtol=1e-6)
    steps = tr.steps()
    assert steps.tolist() == [0] * 8 + [1] * 8            # problem 0: tokens 0..7, problem 1: 0..7 complete


def test_olmoe_vllm_warmup_dropped(tmp_path):
    out = tmp_path / "o.safetensors"
    assert detect_format(OLMOE) == "vllm-routes"
    m = import_trace(OLMOE, out, model="olmoe-1b-7b")
    rep = m.import_report
    assert rep["dummy_records_dropped"] == 100 and rep["dummy_rows_by_reason"]["identical_run"] == 100
    assert rep["dummy_blocks"][0]["first_record"] == 2 and rep["dummy_blocks"][0]["rows"] == 100
    assert (m.num_tokens, m.num_experts, m.top_k, m.layer_ids) == (300, 64, 8, [0])
    # the first kept token is the source's token_idx 2048 (the sample keeps 100 of its 2048 dummy rows)
    first = json.loads(OLMOE.read_text().splitlines()[1 + 100])
    assert first["token_idx"] == 2048
    assert Trace(out).layer(0).topk_ids_TK[0].tolist() == first["topk_ids"]
    # disabling the detection keeps every row
    m2 = import_trace(OLMOE, tmp_path / "o2.safetensors", warmup_min_rows=0)
    assert m2.num_tokens == 400


def test_qwen_vllm_dummy_block_cut_short_is_dropped(tmp_path):
    """A real log cut to 81 rows of its dummy block (one expert set, NON-uniform weights) + 246 rows of
    real traffic (traces/cut_qwen15_sample.py): the identical run is dropped by routing, not weights."""
    from moonep_sim.routing.metrics import maxvio
    assert detect_format(QWEN) == "vllm-routes"
    lines = QWEN.read_text().splitlines()
    rows = [json.loads(l) for l in lines[1:]]
    assert len(rows) == 327 and all(r["topk_ids"] == [43, 5, 7, 58] for r in rows[:81])
    assert len(set(rows[0]["topk_weights"])) == 4                 # the dummy weights are not uniform
    m = import_trace(QWEN, tmp_path / "q.safetensors", model="qwen1.5-moe-a2.7b")
    rep = m.import_report
    assert rep["dummy_records_dropped"] == 81 and rep["dummy_rows_by_reason"] == {"identical_run": 81, "graph_capture": 0}
    assert rep["dummy_blocks"] == [{"reason": "identical_run", "layer": 0, "first_record": 2, "rows": 81,
                                    "experts": [5, 7, 43, 58]}]
    assert (m.num_tokens, m.num_experts, m.top_k, m.layer_ids) == (246, 60, 4, [0])
    assert "weiran0129/vLLM-MoE-Logger @ 43d608127447b9e1bd2ec87e503f934d6f95e195" in m.attribution
    tr = Trace(tmp_path / "q.safetensors")
    # one step per forward pass (token_idx restarts at 0): a pass cut at token_idx 2, then 17 whole ones
    assert np.bincount(tr.steps()).tolist() == [14, 16, 16, 16, 16, 15, 15, 14, 13, 13, 13, 13, 13, 12, 12, 12, 12, 11]
    ids_TK = tr.layer(0).topk_ids_TK
    assert ids_TK[0].tolist() == rows[81]["topk_ids"] and ids_TK[-1].tolist() == rows[-1]["topk_ids"]
    # maxvio of the kept rows, by hand from the file's real rows, against the trace's
    kept = maxvio(np.bincount(ids_TK.ravel(), minlength=60))
    hand = maxvio(np.bincount(np.array([r["topk_ids"] for r in rows[81:]]).ravel(), minlength=60))
    assert kept == pytest.approx(hand) and kept < 1.0              # 0.585: real layer-0 traffic, 246 tokens
    # keeping the dummies (detection off, or a threshold above the cut block's 81 rows) inflates it
    for wmr in (0, 82):
        m2 = import_trace(QWEN, tmp_path / f"d{wmr}.safetensors", model="qwen1.5-moe-a2.7b", warmup_min_rows=wmr)
        assert m2.num_tokens == 327 and m2.import_report["dummy_records_dropped"] == 0
        with_dummies = maxvio(np.bincount(Trace(tmp_path / f"d{wmr}.safetensors").layer(0).topk_ids_TK.ravel(),
                                          minlength=60))
        assert with_dummies > 5 * kept                             # 3.68 vs 0.585
    # the threshold is inclusive: a block of exactly --warmup-min-rows rows is dropped
    assert import_trace(QWEN, tmp_path / "d81.safetensors", model="qwen1.5-moe-a2.7b",
                        warmup_min_rows=81).num_tokens == 246


def test_switch_counts(tmp_path):
    out = tmp_path / "s.safetensors"
    assert detect_format(SWITCH) == "counts-json"
    m = import_trace(SWITCH, out)
    doc = json.loads(SWITCH.read_text())
    tr = Trace(out)
    assert m.kind == "counts" and m.layer_ids == [1, 3, 5, 7, 9, 11] and m.top_k == 1
    assert m.num_tokens == 206866
    for i, lid in enumerate(m.layer_ids):
        want = [doc["expert_usage_by_layer"][str(lid)][str(e)] for e in range(128)]
        assert tr.counts(i).tolist() == want
    assert "assumed 1" in m.import_report["top_k"]


def test_inspect_json_checked_by_hand(tmp_path, capsys):
    """maxvio / gini / top share / distinct ranks of the Mixtral trace, recomputed from records."""
    out = tmp_path / "m.safetensors"
    import_trace(MIXTRAL, out, incomplete_tokens="drop")  # the hand count below takes complete tokens only
    capsys.readouterr()
    assert main(["trace", "inspect", str(out), "--json", "--ranks", "4", "--gpus-per-node", "2",
                 "--layers", "0,31", "--top", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["layers"], res["tokens"], res["num_experts"], res["top_k"]) == (2, 16, 8, 2)
    # independent recomputation from the raw records (complete tokens only)
    recs = [json.loads(l) for l in MIXTRAL.read_text().splitlines()]
    per_tok = {}
    for r in recs:
        per_tok.setdefault((r["problem_id"], r["token_idx"]), []).append(r)
    for entry in res["per_layer"]:
        lay = entry["layer"]
        counts = [0] * 8
        ranks_touched = []
        for rs in per_tok.values():
            if len(rs) != 32:
                continue
            (r,) = [x for x in rs if x["layer"] == lay]
            for e in r["experts"]:
                counts[e] += 1
            ranks_touched.append(len({e * 4 // 8 for e in r["experts"]}))
        mean = sum(counts) / 8
        assert entry["maxvio"] == pytest.approx(max(counts) / mean - 1)
        xs = sorted(counts)
        g = sum((2 * (i + 1) - 8 - 1) * x for i, x in enumerate(xs)) / (8 * sum(xs))
        assert entry["gini"] == pytest.approx(g)
        assert entry["top_share"] == pytest.approx(sum(sorted(counts)[-2:]) / sum(counts))
        assert entry["rank_loads"] == [counts[2 * r] + counts[2 * r + 1] for r in range(4)]
        assert entry["mean_distinct_ranks"] == pytest.approx(sum(ranks_touched) / len(ranks_touched))
        assert entry["distinct_is_estimate"] is False


def test_inspect_counts_labels_estimate(tmp_path):
    from moonep_sim.routing.metrics import inspect_trace
    out = tmp_path / "s.safetensors"
    import_trace(SWITCH, out)
    res = inspect_trace(out, ranks=8, gpus_per_node=4)
    p = res["per_layer"][0]
    assert p["distinct_is_estimate"] is True and "estimate" in p["distinct_note"]
    assert p["mean_distinct_ranks"] == pytest.approx(1.0)   # top-1: one rank per token, exactly


# ---------------------------------------------------------------------------------- arrays
def test_npy_and_npz(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((50, 3, 16)), axis=2)[:, :, :4]        # [T, L, K]
    np.save(tmp_path / "r.npy", ids)
    m = import_trace(tmp_path / "r.npy", tmp_path / "r.safetensors", num_experts=16)
    tr = Trace(tmp_path / "r.safetensors")
    assert (m.num_tokens, m.num_layers, m.top_k, m.num_experts) == (50, 3, 4, 16)
    np.testing.assert_array_equal(tr.layer(2).topk_ids_TK, ids[:, 2])
    w = rng.random((50, 3, 4)).astype(np.float32)
    np.savez(tmp_path / "r.npz", topk_ids=ids, topk_weights=w, layer_ids=np.array([3, 7, 11]))
    m = import_trace(tmp_path / "r.npz", tmp_path / "z.safetensors", num_experts=16)
    assert m.layer_ids == [3, 7, 11]
    np.testing.assert_array_equal(Trace(tmp_path / "z.safetensors").layer(1).topk_weights_TK, w[:, 1])


# ---------------------------------------------------------------------------------- bad input
def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _rec(tok, layer, experts, w=None, pid=0):
    return {"problem_id": pid, "token_idx": tok, "layer": layer, "experts": experts,
            "gating_probs": w if w is not None else [0.6, 0.4][:len(experts)] + [0.0] * (len(experts) - 2)}


GOOD = [_rec(t, l, [t % 4, (t + 1) % 4]) for t in range(3) for l in range(2)]


def _pickle(p):
    p.write_bytes(pickle.dumps({"a": 1}))


def _object_npy(p):
    with open(p, "wb") as f:
        np.lib.format.write_array(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)


BAD_CASES = {
    # name: (writer(path), file name, extra CLI args, regex the one-line message must match)
    "empty": (lambda p: p.write_text(""), "e.jsonl", [], r"e\.jsonl: expected routing data, found an empty file"),
    "malformed": (lambda p: p.write_text(json.dumps(GOOD[0]) + "\n{not json\n"), "m.jsonl", [],
                  r"m\.jsonl: record 2: expected a JSON object, found invalid JSON"),
    "truncated": (lambda p: p.write_text(json.dumps(GOOD[0]) + "\n" + json.dumps(GOOD[1])[:30]), "t.jsonl", [],
                  r"t\.jsonl: record 2: .*invalid JSON .*truncated"),
    "unknown": (lambda p: p.write_text("hello world\n"), "u.txt", [], r"u\.txt: expected one of the formats"),
    "out_of_range": (lambda p: _jsonl(p, GOOD[:3] + [_rec(9, 0, [1, 8])]), "r.jsonl", ["--num-experts", "8"],
                     r"r\.jsonl: record 4: experts: expected ids in \[0, 8\), found \[1, 8\]"),
    "negative": (lambda p: _jsonl(p, [_rec(0, 0, [-1, 2])]), "n.jsonl", ["--num-experts", "4"],
                 r"record 1: experts: expected ids in \[0, 4\), found \[-1, 2\]"),
    "topk_width": (lambda p: _jsonl(p, GOOD[:2] + [_rec(5, 0, [0, 1, 2], [0.5, 0.3, 0.2])]), "w.jsonl", [],
                   r"w\.jsonl: record 3: experts: expected 2 ids .*found 3"),
    "nan_weight": (lambda p: p.write_text(json.dumps(GOOD[0]) + "\n" +
                                          json.dumps(_rec(1, 0, [0, 1], [float("nan"), 0.5])) + "\n"),
                   "nan.jsonl", [], r"nan\.jsonl: record 2: gating_probs: expected finite numbers, found \[nan, 0\.5\]"),
    "meta_topk": (lambda p: _jsonl(p, [{"type": "meta", "top_k": 8, "num_experts": 64}] +
                                   [{"type": "route", "req_id": "a", "token_idx": 0, "layer": 0,
                                     "topk_ids": [1, 2], "topk_weights": [0.5, 0.5]}]),
                  "v.jsonl", [], r"v\.jsonl: record 2: topk_ids: expected 8 ids \(meta top_k\), found 2"),
    "meta_layers": (lambda p: _jsonl(p, [{"type": "meta", "top_k": 2, "layers_logged": [0]}] +
                                     [{"type": "route", "req_id": "a", "token_idx": 0, "layer": 3,
                                       "topk_ids": [1, 2], "topk_weights": [0.5, 0.5]}]),
                    "v2.jsonl", [], r"record 2: layer: expected one of meta layers_logged \[0\], found 3"),
    "model_contradicts": (lambda p: _jsonl(p, GOOD), "mc.jsonl", ["--model", "olmoe-1b-7b"],
                          r"mc\.jsonl: num_experts: expected 64 .*|top_k: expected 8 \(model olmoe-1b-7b\), found 2"),
    "conflicting_duplicate": (lambda p: _jsonl(p, GOOD + [_rec(0, 0, [2, 3])]), "d.jsonl", ["--steps-from", "group"],
                              r"d\.jsonl: record 7: experts: expected a duplicate of record 1"),
    "conflicting_in_step": (lambda p: _jsonl(p, [dict(r, step=0) for r in GOOD] + [dict(_rec(0, 0, [2, 3]), step=0)]),
                            "ds.jsonl", [], r"ds\.jsonl: record 7: experts: expected a duplicate of record 1 "
                                            r"\(same step, token and layer\)"),
    "steps_from_field_without_field": (lambda p: _jsonl(p, GOOD), "sf.jsonl", ["--steps-from", "field"],
                                       r"--steps-from: field: expected a step field"),
    "dominant_share": (lambda p: _jsonl(p, GOOD), "ds2.jsonl", ["--dominant-share", "2"],
                       r"--dominant-share \(2\.0\) must be in \(0, 1\]"),
    "warmup_negative": (lambda p: _jsonl(p, GOOD), "wn.jsonl", ["--warmup-min-rows", "-1"],
                        r"--warmup-min-rows \(-1\) must be an integer >= 0"),
    "model_file_bad": (lambda p: _jsonl(p, GOOD), "mf.jsonl", ["--model", "nope.toml"],
                       r"model \('nope\.toml'\) must be a preset or an existing \.toml/\.json file"),
    "counts_negative": (lambda p: p.write_text(json.dumps({"expert_usage_by_layer": {"0": {"0": 3, "1": -2}}})),
                        "c.json", [], r"c\.json: expert_usage_by_layer\[0\]\[1\]: expected a count .*found -2"),
    "counts_total": (lambda p: p.write_text(json.dumps({"expert_usage_by_layer": {"0": {"0": 3, "1": 2}},
                                                        "layer_analysis": {"0": {"total_usage": 9}}})),
                     "ct.json", [], r"layer_analysis\[0\]\.total_usage: expected 5 .*found 9"),
    "counts_truncated": (lambda p: p.write_text('{"expert_usage_by_layer": {"0": {"0": 3, '), "tr.json", [],
                         r"tr\.json: expected JSON, found invalid JSON"),
    "pickle": (_pickle, "x.pkl", [], r"x\.pkl: expected routing data, found a Python pickle"),
    "pickle_npy": (_object_npy, "o.npy", [], r"o\.npy: expected a numeric array, found an object array"),
    "npy_float": (lambda p: np.save(p, np.zeros((3, 1, 2))), "f.npy", ["--num-experts", "4"],
                  r"f\.npy: topk_ids: expected an integer array, found dtype float64"),
    "npy_range": (lambda p: np.save(p, np.array([[[0, 1]], [[2, 9]]])), "g.npy", ["--num-experts", "4"],
                  r"g\.npy: token 1: layer 0: topk_ids: expected ids in \[0, 4\), found \[2, 9\]"),
    "npy_truncated": (lambda p: (np.save(p, np.zeros((100, 2, 2), np.int64)),
                                 p.write_bytes(p.read_bytes()[:300])), "h.npy", ["--num-experts", "4"],
                      r"h\.npy: expected 3200 bytes of array data \(shape \[100, 2, 2\], int64\), the file holds \d+ \(truncated\?\)"),
}


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_input_one_line_exit2_no_output(name, tmp_path, capsys):
    writer, fname, extra, pattern = BAD_CASES[name]
    src = tmp_path / fname
    writer(src)
    out = tmp_path / "out" / "t.safetensors"
    out.parent.mkdir()
    rc = main(["trace", "import", str(src), "-o", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moonep-sim: error: "), err
    import re
    assert re.search(pattern, lines[0]), lines[0]
    assert not out.exists()
    assert not any(out.parent.iterdir())  # no temp file either


def test_bad_case_table_covers_the_required_regimes():
    required = {"malformed", "truncated", "empty", "unknown", "out_of_range", "negative", "topk_width",
                "nan_weight", "meta_topk", "pickle", "pickle_npy"}
    assert required <= set(BAD_CASES)


def test_exact_duplicates_and_missing_layers_are_dropped_with_counts(tmp_path):
    recs = GOOD + [GOOD[0], GOOD[3]] + [_rec(7, 0, [1, 2])]          # 2 exact dups, token 7 lacks layer 1
    # one step per request: the repeats at the end are in the same step as the records they repeat
    src = _jsonl(tmp_path / "d.jsonl", recs)
    imp = load_source(src, steps_from="group", incomplete_tokens="drop")
    rep = imp.meta.import_report
    assert rep["duplicate_records_dropped"] == 2
    assert rep["tokens_missing_layers_dropped"] == 1
    assert imp.meta.num_tokens == 3 and imp.tensors["topk_ids"].shape == (2, 3, 2)
    assert "token_mask" not in imp.tensors
    # by default the token keeps the layer it has, under the per-layer token mask, with a warning
    imp = load_source(src, steps_from="group")
    rep = imp.meta.import_report
    assert rep["tokens_missing_layers"] == 1 and rep["tokens_missing_layers_dropped"] == 0
    assert imp.meta.num_tokens == 4 and imp.tensors["token_mask"].sum(axis=1).tolist() == [4, 3]
    assert any("1 of 4 tokens miss some of the 2 layers" in w for w in rep["warnings"])


def test_repeats_by_step_rule(tmp_path):
    """Forward passes: a record repeated right after itself is a duplicate write; the same (request,
    position, layer) coming back later is the next pass (positions restart), never an error."""
    recs = GOOD[:2] + [GOOD[1]] + GOOD[2:]                            # exact repeat of the previous layer-1 row
    imp = load_source(_jsonl(tmp_path / "a.jsonl", recs))
    assert imp.meta.import_report["duplicate_records_dropped"] == 1 and imp.meta.num_tokens == 3
    later = GOOD + [_rec(0, 0, [2, 3]), _rec(0, 1, [0, 3])]           # token 0 again, other experts: pass 4
    imp = load_source(_jsonl(tmp_path / "b.jsonl", later))
    assert imp.meta.num_tokens == 4 and imp.tensors["step"].tolist() == [0, 1, 2, 3]
    assert imp.tensors["topk_ids"][0, 3].tolist() == [2, 3]


def test_missing_file_and_bad_format_name(tmp_path):
    with pytest.raises(TraceFormatError, match="expected a file, found none"):
        load_source(tmp_path / "nope.jsonl")
    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    with pytest.raises(TraceFormatError, match=r"--format \('xml'\) must be"):
        load_source(tmp_path / "a.jsonl", "xml")


# ---------------------------------------------------------------------------------- shipped traces
@pytest.mark.parametrize("src,shipped,kwargs", [
    (SWITCH, "switch-base-128_counts.safetensors", {"top_k": 1}),
    (QWEN, "qwen1.5-moe-a2.7b_layer0.safetensors", {"model": "qwen1.5-moe-a2.7b"}),
])
def test_shipped_traces_are_what_the_importer_makes(src, shipped, kwargs):
    from pathlib import Path
    tr = Trace(Path(__file__).resolve().parents[1] / "traces" / shipped)
    imp = load_source(src, **kwargs)
    assert tr.meta.import_report == json.loads(json.dumps(imp.meta.import_report))
    for name, arr in imp.tensors.items():
        got = tr._open().get_tensor(name)
        np.testing.assert_array_equal(got, arr.astype(got.dtype))


@pytest.mark.parametrize("src,shipped,kwargs,tokens", [
    (MIXTRAL, "mixtral-8x7b_humaneval.safetensors", {"model": "mixtral-8x7b", "incomplete_tokens": "drop"},
     list(range(8)) + list(range(81, 89))),            # tokens 0-7 of problem 0 (81 tokens) and of problem 1
    (OLMOE, "olmoe-1b-7b_layer0.safetensors", {"model": "olmoe-1b-7b"}, list(range(300))),
])
def test_shipped_traces_agree_with_the_importer_on_the_samples(src, shipped, kwargs, tokens):
    """The shipped traces were imported from the whole sources; the samples hold some of the same
    records (traces/cut_real_samples.py): their import equals the shipped trace at those tokens."""
    from pathlib import Path
    tr = Trace(Path(__file__).resolve().parents[1] / "traces" / shipped)
    imp = load_source(src, **kwargs)
    for name, arr in imp.tensors.items():
        got = tr._open().get_tensor(name)
        got = got[:, tokens] if got.ndim >= 2 else got[tokens]
        np.testing.assert_array_equal(got, arr.astype(got.dtype))


def test_shipped_recordings_are_labelled_synthetic():
    from pathlib import Path
    files = sorted((Path(__file__).resolve().parents[1] / "traces").glob("recorded-random_*.safetensors"))
    assert len(files) == 3
    for f in files:
        tr = Trace(f)
        assert "RANDOM weights" in tr.meta.attribution and "not real routing" in tr.meta.attribution
        assert np.bincount(tr.steps()).tolist() == [128] + [4] * 15
        assert tr.meta.num_layers == 4 and tr.model().num_experts == tr.meta.num_experts


def test_tokens_missing_layers_keep_their_layers_through_compare(tmp_path, capsys):
    """A log whose tokens miss some layers (as a real Mixtral log does): import keeps each token's
    layers under the mask and warns with the count; compare plans each layer on the tokens it has;
    --drop-incomplete-tokens drops them at every layer."""
    recs = [_rec(t, l, [t % 4, (t + 1) % 4]) for t in range(12) for l in range(2) if not (l == 1 and t >= 8)]
    src = _jsonl(tmp_path / "m.jsonl", recs)
    out = tmp_path / "m.safetensors"
    assert main(["trace", "import", str(src), "-o", str(out), "--num-experts", "4", "--steps-from", "none"]) == 0
    err = capsys.readouterr().err
    assert "moonep-sim: warning: 4 of 12 tokens miss some of the 2 layers (4 (token, layer) rows absent)" in err
    tr = Trace(out)
    assert tr.meta.num_tokens == 12 and [tr.layer(i).num_tokens for i in range(2)] == [12, 8]
    from moonep_sim.experiments import Scenario

    rep = Scenario(routing=str(out), cluster=2, strategies="alltoall").compare().to_dict()
    rows = [sum(e["plan"]["recv_rows_per_rank"]) for e in rep["strategies"]["alltoall"]["layers"]]
    assert rows == [24, 16]    # K=2 rows per token each layer has
    assert main(["trace", "inspect", str(out), "--ranks", "2", "--json"]) == 0   # inspect reads the mask too
    assert json.loads(capsys.readouterr().out)["tokens"] == 12
    dropped = tmp_path / "d.safetensors"
    assert main(["trace", "import", str(src), "-o", str(dropped), "--num-experts", "4", "--steps-from", "none",
                 "--drop-incomplete-tokens"]) == 0
    assert Trace(dropped).meta.num_tokens == 8 and not Trace(dropped).has("token_mask")
    assert Trace(dropped).meta.import_report["tokens_missing_layers_dropped"] == 4
