"""Record logs as they come: forward passes as steps, dummy blocks judged by routing, field-name
aliases, missing layers. A generator writes logs in every variant and keeps the rows it meant to be
real; import must recover exactly those rows, in those steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep_sim.cli import main
from moonep_sim.routing.importers import FIELDS, fields_markdown, formats, formats_markdown, load_source
from moonep_sim.routing.metrics import inspect_trace, maxvio


def _rows(rng, n, E, K):
    ids = np.argsort(rng.random((n, E)), axis=1)[:, :K]
    w = rng.random((n, K)) + 0.05                              # non-uniform, not renormalised
    return ids, w


def make_log(seed, *, E=16, K=2, layer_ids=(0, 1), passes=4, positions="restart", step_field=False,
             vllm=False, warmup=0, capture=(), missing=0, names=None, extra_field=False, keep=False):
    """A log of ``passes`` real forward passes (after ``warmup`` dummy rows in one pass and one
    graph-capture pass per size in ``capture``), written layer-major within each pass.

    positions: ``restart`` (one constant request id; position = row in the pass, restarting every
    pass) or ``real`` (request ids; positions grow per request; prefill then decode passes).
    missing: that many (token, layer) records of real tokens are removed (those tokens are lost,
    or with ``keep`` kept at their other layers: filler rows 0..K-1, weight 0, mask 0).
    Returns (records, expected ids [L, T, K], weights [L, T, K], steps [T], dummy record count),
    and with ``keep`` also the expected token mask [L, T].
    """
    rng = np.random.default_rng(seed)
    names = names or {role: FIELDS[role][0] for role in FIELDS}
    L = len(layer_ids)
    P = []                                                    # passes: list of (kind, [(req, pos)])
    for n in ([warmup] if warmup else []) + list(capture):
        P.append(("dummy", [(0, i) for i in range(n)]))
    next_req, running = 1, {}                                 # real requests: id -> next position
    for p in range(passes):
        rows = []
        if positions == "restart":
            n = int(rng.integers(1, 12))
            rows = [(0, i) for i in range(n)]
        else:
            for r in sorted(running):                         # decode: one row per running request
                rows.append((r, running[r]))
                running[r] += 1
            if p == 0 or rng.random() < 0.5 or len(running) < 2:   # a new request's prefill
                n = int(rng.integers(1, 8))
                rows += [(next_req, i) for i in range(n)]
                running[next_req] = n
                next_req += 1
            if len(running) > 3:
                running.pop(min(running))
        P.append(("real", rows))
    recs, want, tok_of = [], [], []                           # want: (pass, req, pos, layer, ids, w)
    dummy = 0
    prev_kind, prev_sets = None, None
    for pi, (kind, rows) in enumerate(P):
        ids_l, w_l = [], []
        for li in range(L):
            ids, w = _rows(rng, len(rows), E, K)
            if kind == "dummy":
                ids[:] = np.sort(rng.choice(E, K, replace=False))[None]
            ids_l.append(ids)
            w_l.append(w)
        if kind == "real" and prev_kind == "dummy" and all(
                (np.sort(ids_l[li], axis=1) == prev_sets[li]).all() for li in range(L)):
            # a real pass that repeats the dummy pass before it at every row of every layer is a dummy
            # by any routing evidence: give one of its rows another set
            ids_l[0][0] = (ids_l[0][0] + 1) % E
        prev_kind, prev_sets = kind, [np.sort(x[:1], axis=1) for x in ids_l]
        for li, lay in enumerate(layer_ids):
            for j, (req, pos) in enumerate(rows):
                rec = {names["group"]: f"r{req}" if positions == "real" else "batch",
                       names["token"]: pos, names["layer"]: lay,
                       names["ids"]: ids_l[li][j].tolist(), names["weights"]: w_l[li][j].tolist()}
                if step_field:
                    rec[names["step"]] = 7 * pi + 3
                if vllm:
                    rec["type"] = "route"
                if extra_field:
                    rec["dataset"] = "synthetic"
                recs.append(rec)
                tok_of.append((kind, pi, req, pos))
                if kind == "dummy":
                    dummy += 1
                else:
                    want.append((pi, req, pos, li, ids_l[li][j], w_l[li][j]))
    if missing and L > 1:         # remove records of real tokens: those tokens miss a layer, are dropped
        # a pass keeps at least one record of every layer: a pass that lost a whole layer leaves no
        # boundary in a log without a step field (documented in docs/traces.md)
        real_idx = [i for i, t in enumerate(tok_of) if t[0] == "real"]
        left = {}
        for i in real_idx:
            key = (tok_of[i][1], recs[i][names["layer"]])
            left[key] = left.get(key, 0) + 1
        drop = set()
        for i in rng.permutation(real_idx).tolist():
            key = (tok_of[i][1], recs[i][names["layer"]])
            if len(drop) < missing and left[key] > 1:
                left[key] -= 1
                drop.add(i)
        removed = {tok_of[i][1:] for i in drop}
        gone = {(tok_of[i][1], tok_of[i][2], tok_of[i][3], layer_ids.index(recs[i][names["layer"]])) for i in drop}
        recs = [r for i, r in enumerate(recs) if i not in drop]
        if keep:
            want = [x for x in want if (x[0], x[1], x[2], x[3]) not in gone]
        else:
            want = [x for x in want if (x[0], x[1], x[2]) not in removed]
    # expected tensors: tokens ordered by (pass, request, position)
    toks = sorted({(x[0], x[1], x[2]) for x in want})
    tindex = {t: i for i, t in enumerate(toks)}
    T = len(toks)
    ids_LTK = np.broadcast_to(np.arange(K), (L, T, K)).copy() if keep else np.zeros((L, T, K), np.int64)
    w_LTK = np.zeros((L, T, K), np.float32)
    mask_LT = np.zeros((L, T), np.uint8)
    for pi, req, pos, li, ids, w in want:
        ids_LTK[li, tindex[(pi, req, pos)]] = ids
        w_LTK[li, tindex[(pi, req, pos)]] = w
        mask_LT[li, tindex[(pi, req, pos)]] = 1
    _, step_T = np.unique([t[0] for t in toks], return_inverse=True)
    if vllm:
        recs = [{"type": "meta", "num_experts": E, "top_k": K}] + recs
    if keep:
        return recs, ids_LTK, w_LTK, step_T.reshape(-1), dummy, mask_LT
    return recs, ids_LTK, w_LTK, step_T.reshape(-1), dummy


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), E=st.sampled_from([8, 16, 64]), K=st.sampled_from([1, 2, 4]),
       layers=st.sampled_from([(0,), (0, 1), (3, 7, 11)]), passes=st.integers(1, 6),
       positions=st.sampled_from(["restart", "real"]), step_field=st.booleans(), vllm=st.booleans(),
       warmup=st.sampled_from([0, 64, 150]), capture=st.sampled_from([(), (8,), (16, 8, 32)]),
       missing=st.sampled_from([0, 0, 2]), alias_seed=st.integers(0, 1000), extra=st.booleans(),
       keep=st.booleans())
def test_import_recovers_generated_real_rows_and_steps(tmp_path, seed, E, K, layers, passes, positions,
                                                       step_field, vllm, warmup, capture, missing, alias_seed,
                                                       extra, keep):
    """Every real row comes back, in its step; a token missing some layers is dropped
    (``incomplete_tokens="drop"``) or, by default, kept at the layers it has under the token
    mask, which the trace reader honours layer by layer."""
    if positions == "real" and len(layers) == 1 and not step_field:
        positions = "restart"     # one layer, growing positions and no step field: passes leave no trace
    rng = np.random.default_rng(alias_seed)
    names = {role: str(rng.choice(FIELDS[role])) for role in FIELDS}
    out = make_log(seed, E=E, K=K, layer_ids=layers, passes=passes, positions=positions, step_field=step_field,
                   vllm=vllm, warmup=warmup, capture=capture, missing=missing, names=names, extra_field=extra,
                   keep=keep)
    recs, ids, w, step, dummy = out[:5]
    if ids.shape[1] == 0:
        return
    imp = load_source(_write(tmp_path / "log.jsonl", recs), num_experts=E,
                      incomplete_tokens="keep" if keep else "drop")
    got = imp.tensors
    if keep and not out[5].all():
        mask = out[5]
        np.testing.assert_array_equal(got["token_mask"], mask)
        assert imp.meta.import_report["tokens_missing_layers"] == int((mask == 0).any(axis=0).sum())
        from moonep_sim.routing.trace import Trace, write_trace
        path = write_trace(tmp_path / "masked.safetensors", imp.meta, imp.tensors)
        for li in range(len(layers)):   # the reader returns exactly the rows each layer routed
            lr = Trace(path).layer(li)
            np.testing.assert_array_equal(lr.topk_ids_TK, ids[li][mask[li] == 1])
    else:
        assert "token_mask" not in got
    assert imp.meta.layer_ids == sorted(layers)
    np.testing.assert_array_equal(got["topk_ids"], ids)
    np.testing.assert_allclose(got["topk_weights"], w, rtol=1e-6)
    np.testing.assert_array_equal(got["step"], step)
    rep = imp.meta.import_report
    assert rep["dummy_records_dropped"] == dummy
    assert rep["fields"]["token"] == names["token"] and rep["fields"]["ids"] == names["ids"]
    if extra:
        assert rep["fields_ignored"] == ["dataset"]
    assert imp.meta.num_experts_inferred is False


def test_vllm_log_mostly_dummy_reports_real_maxvio_and_warns_when_left_in(tmp_path, capsys):
    """85% of the rows are profiling / graph-capture blocks (one expert set, non-uniform weights):
    inspect must report the real rows' maxvio; with the detection off, the sanity pass warns."""
    rng = np.random.default_rng(5)
    E, K = 64, 8
    recs = [{"type": "meta", "model_id": "synthetic", "num_experts": E, "top_k": K, "layers_logged": [0]}]
    hot = sorted(rng.choice(E, K, replace=False).tolist())

    def pass_rows(ids, w):
        for i in range(len(ids)):
            recs.append({"type": "route", "req_id": "r0", "token_idx": i, "layer": 0,
                         "topk_ids": ids[i].tolist(), "topk_weights": w[i].tolist()})

    for n in (2048, 2048, 2048):                                  # profiling runs: one expert set
        pass_rows(np.tile(hot, (n, 1)), rng.random((n, K)))
    for n in (512, 256, 128, 64, 32, 16, 8):                      # graph capture: one set per batch size
        pass_rows(np.tile(np.sort(rng.choice(E, K, replace=False)), (n, 1)), rng.random((n, K)))
    pop = rng.lognormal(0, 0.4, E)
    real = []
    for n in [300] + [16] * 40:                                   # a prefill then decode passes
        g = np.log(pop)[None] + rng.gumbel(size=(n, E))
        ids = np.argsort(-g, axis=1)[:, :K]
        real.append(ids)
        pass_rows(ids, rng.random((n, K)))
    real_ids = np.concatenate(real)
    dummy_rows = 2048 * 3 + 512 + 256 + 128 + 64 + 32 + 16 + 8
    assert dummy_rows / (dummy_rows + len(real_ids)) > 0.85
    src = _write(tmp_path / "routes.jsonl", recs)
    out = tmp_path / "t.safetensors"
    assert main(["trace", "import", str(src), "-o", str(out), "--num-experts", str(E)]) == 0
    assert "warning" not in capsys.readouterr().err
    res = inspect_trace(out)
    want = maxvio(np.bincount(real_ids.ravel(), minlength=E))
    assert res["per_layer"][0]["maxvio"] == pytest.approx(want)
    assert res["tokens"] == len(real_ids) and res["steps"]["count"] == 41
    assert res["steps"]["tokens_per_step"] == {"min": 16, "median": 16, "max": 300}
    rep = res["import_report"]
    assert rep["dummy_records_dropped"] == dummy_rows
    assert rep["dummy_rows_by_reason"]["graph_capture"] > 0 and rep["dummy_rows_by_reason"]["identical_run"] > 0
    # the same log with the dummy detection switched off: a warning, and the figures show why
    out2 = tmp_path / "t2.safetensors"
    assert main(["trace", "import", str(src), "-o", str(out2), "--num-experts", str(E),
                 "--warmup-min-rows", "0", "--capture-min-rows", "0"]) == 0
    err = capsys.readouterr().err
    assert "moonep-sim: warning: layer 0: one expert set holds" in err
    assert inspect_trace(out2)["per_layer"][0]["maxvio"] > 5 * want


def test_per_step_figures_and_step_selection_in_inspect(tmp_path, capsys):
    recs, ids, w, step, _ = make_log(3, E=16, K=2, layer_ids=(0, 1), passes=6, positions="real")
    src = _write(tmp_path / "l.jsonl", recs)
    out = tmp_path / "l.safetensors"
    assert main(["trace", "import", str(src), "-o", str(out), "--num-experts", "16"]) == 0
    capsys.readouterr()
    assert main(["trace", "inspect", str(out), "--json", "--steps", "2-3"]) == 0
    res = json.loads(capsys.readouterr().out)
    sel = np.isin(step, [2, 3])
    assert res["tokens"] == int(sel.sum()) and res["steps"]["count"] == 2 and res["steps"]["of"] == 6
    for li, entry in enumerate(res["per_layer"]):
        assert entry["maxvio"] == pytest.approx(maxvio(np.bincount(ids[li][sel].ravel(), minlength=16)))
        mvs = [maxvio(np.bincount(ids[li][step == s].ravel(), minlength=16)) for s in (2, 3)]
        assert entry["maxvio_per_step"]["min"] == pytest.approx(min(mvs))
        assert entry["maxvio_per_step"]["max"] == pytest.approx(max(mvs))
    n = [int((step == s).sum()) for s in (2, 3)]
    assert res["steps"]["tokens_per_step"]["max"] == max(n)
    assert main(["trace", "inspect", str(out)]) == 0
    assert "per step: tokens min" in capsys.readouterr().out


def test_inferred_expert_count_warns_and_is_stored(tmp_path, capsys):
    recs, *_ = make_log(1, E=16, K=2)
    src = _write(tmp_path / "l.jsonl", recs)
    out = tmp_path / "l.safetensors"
    assert main(["trace", "import", str(src), "-o", str(out)]) == 0
    assert "moonep-sim: warning: num_experts inferred as" in capsys.readouterr().err
    assert main(["trace", "inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_experts_inferred"] is True


def test_custom_model_file_is_stored_with_the_trace(tmp_path):
    from moonep_sim.routing.trace import Trace
    recs, *_ = make_log(2, E=60, K=4)
    model = tmp_path / "qwen-like.toml"
    model.write_text('num_experts = 60\ntop_k = 4\nhidden = 2048\nexpert_ffn = 1408\nshared_experts = 4\n')
    out = tmp_path / "l.safetensors"
    assert main(["trace", "import", str(_write(tmp_path / "l.jsonl", recs)), "-o", str(out),
                 "--model", str(model)]) == 0
    m = Trace(out).model()
    assert (m.name, m.num_experts, m.top_k, m.expert_ffn, m.shared_experts) == ("qwen-like", 60, 4, 1408, 4)
    out2 = tmp_path / "p.safetensors"
    assert main(["trace", "import", str(_write(tmp_path / "l.jsonl", recs)), "-o", str(out2),
                 "--model", "qwen1.5-moe-a2.7b"]) == 0
    assert Trace(out2).meta.model_spec is None and Trace(out2).model().name == "qwen1.5-moe-a2.7b"


def test_docs_tables_come_from_the_registry():
    from pathlib import Path
    doc = (Path(__file__).resolve().parent.parent / "docs" / "traces.md").read_text()
    assert formats_markdown() in doc and fields_markdown() in doc
    assert set(formats()) == {"npy", "vllm-routes", "jsonl-records", "counts-json"}


def _steps_reference(lay, grp, tok):
    """The step rule record by record (slow, obviously the documented greedy split): per layer, a
    new step where the log went back to an earlier layer since this layer's previous record, where
    the same request's position does not increase, or where a request seen in the current step
    comes back after another request."""
    P, state, out = 0, {}, []
    for i in range(len(lay)):
        if i and lay[i] < lay[i - 1]:
            P += 1
        l, g, t = lay[i], grp[i], tok[i]
        s = state.get(l)
        if s is None:
            s = state[l] = {"step": 0, "seen": {g}, "last": (g, t), "P": P}
        else:
            lg, lt = s["last"]
            new = P != s["P"] or (g == lg and t <= lt) or (g != lg and g in s["seen"])
            if new:
                s["step"] += 1
                s["seen"] = set()
            s["seen"].add(g)
            s["last"], s["P"] = (g, t), P
        out.append(s["step"])
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 4)), min_size=1, max_size=60))
def test_pass_rule_matches_its_reference(recs):
    from moonep_sim.routing.importers.records import steps_by_passes
    lay, grp, tok = (np.array(x, np.int64) for x in zip(*recs))
    assert steps_by_passes(lay, grp, tok).tolist() == _steps_reference(lay.tolist(), grp.tolist(), tok.tolist())


def test_sparse_per_step_maxvio_equals_the_dense_count():
    from moonep_sim.routing.metrics import per_step_maxvio, step_expert_counts
    rng = np.random.default_rng(4)
    E, K = 12, 3
    step = np.sort(rng.choice([0, 1, 2, 4, 5], 300))                # step 3 is empty
    ids = np.argsort(rng.random((300, E)), axis=1)[:, :K]
    n_S = np.bincount(step, minlength=6)
    got = per_step_maxvio(*step_expert_counts(step, ids, E), n_S, K, E)
    want = [maxvio(np.bincount(ids[step == s].ravel(), minlength=E)) for s in range(6)]
    np.testing.assert_allclose(got, want)
