"""The trace format: round trips, lazy per-layer reads, metadata/tensor contradictions."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.errors import TraceFormatError
from moonep_sim.routing.generators import generate_trace
from moonep_sim.routing.metrics import inspect_trace
from moonep_sim.routing.trace import Trace, TraceMeta, write_trace


@st.composite
def small_traces(draw):
    E = draw(st.integers(1, 40))
    K = draw(st.integers(1, min(E, 6)))
    L = draw(st.integers(1, 4))
    T = draw(st.integers(0, 30))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((L, T, E)), axis=2)[:, :, :K]
    w = rng.random((L, T, K)).astype(np.float32)
    steps = np.sort(rng.integers(0, 3, T)).astype(np.int32)
    layer_ids = sorted(rng.choice(100, L, replace=False).tolist())
    return E, K, layer_ids, ids, w, steps


@settings(max_examples=40, deadline=None)
@given(small_traces())
def test_roundtrip_random_traces(tmp_path_factory, case):
    E, K, layer_ids, ids, w, steps = case
    path = tmp_path_factory.mktemp("rt") / "t.safetensors"
    meta = TraceMeta(kind="tokens", num_experts=E, top_k=K, layer_ids=layer_ids, num_tokens=ids.shape[1],
                     import_report={"x": 1})
    write_trace(path, meta, {"topk_ids": ids, "topk_weights": w, "step": steps})
    tr = Trace(path)
    assert tr.meta == meta
    for i, lid in enumerate(layer_ids):
        lr = tr.layer(i)
        assert lr.layer == lid
        np.testing.assert_array_equal(lr.topk_ids_TK, ids[i])
        np.testing.assert_array_equal(lr.topk_weights_TK, w[i])
        np.testing.assert_array_equal(tr.counts(i), np.bincount(ids[i].ravel(), minlength=E))
    np.testing.assert_array_equal(tr.steps(), steps)


def test_counts_roundtrip(tmp_path):
    c = np.array([[3, 0, 5], [1, 1, 6]])
    meta = TraceMeta(kind="counts", num_experts=3, top_k=1, layer_ids=[4, 9], num_tokens=8)
    write_trace(tmp_path / "c.safetensors", meta, {"counts": c})
    tr = Trace(tmp_path / "c.safetensors")
    np.testing.assert_array_equal(tr.counts(1), c[1])
    with pytest.raises(TraceFormatError, match="token-level"):
        tr.layer(0)


def _raw_trace(path, meta: dict, tensors: dict):
    from safetensors.numpy import save_file
    save_file(tensors, str(path), metadata={"moonep_sim": json.dumps(meta)})


def test_metadata_contradicting_tensors(tmp_path):
    ids = np.zeros((2, 5, 1), np.int16)
    meta = {"kind": "tokens", "num_experts": 4, "top_k": 1, "layer_ids": [0, 1, 2], "num_tokens": 5,
            "format_version": 1}
    _raw_trace(tmp_path / "bad.safetensors", meta, {"topk_ids": ids, "topk_weights": np.ones((2, 5, 1), np.float32)})
    with pytest.raises(TraceFormatError, match=r"bad.safetensors: tensor topk_(ids|weights): expected shape \[3, 5, 1\] from metadata .* found \[2, 5, 1\]"):
        Trace(tmp_path / "bad.safetensors")


def test_truncated_and_foreign_files(tmp_path):
    meta = TraceMeta(kind="tokens", num_experts=4, top_k=1, layer_ids=[0], num_tokens=50)
    good = tmp_path / "good.safetensors"
    write_trace(good, meta, {"topk_ids": np.zeros((1, 50, 1)), "topk_weights": np.ones((1, 50, 1))})
    data = good.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[:-40])
    with pytest.raises(TraceFormatError, match="truncated"):
        Trace(tmp_path / "trunc.safetensors")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(TraceFormatError, match="0-byte file"):
        Trace(tmp_path / "empty.safetensors")
    from safetensors.numpy import save_file
    save_file({"a": np.zeros(3)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(TraceFormatError, match="moonep-sim trace"):
        Trace(tmp_path / "plain.safetensors")


def test_write_refuses_bad_ids_and_leaves_nothing(tmp_path):
    meta = TraceMeta(kind="tokens", num_experts=4, top_k=2, layer_ids=[0], num_tokens=2)
    out = tmp_path / "o.safetensors"
    with pytest.raises(TraceFormatError, match=r"token 1: topk_ids: expected ids in \[0, 4\), found \[1, 4\]"):
        write_trace(out, meta, {"topk_ids": np.array([[[0, 1], [1, 4]]]), "topk_weights": np.ones((1, 2, 2))})
    assert list(tmp_path.iterdir()) == []


def test_inspect_reads_per_layer_not_whole(tmp_path, monkeypatch):
    """A 16-layer trace is inspected with peak Python-heap use well under the file's tensor bytes,
    and every read is one layer's slice (at most chunk_tokens tokens)."""
    path = tmp_path / "big.safetensors"
    L, T, K, E = 16, 40000, 8, 64
    generate_trace(path, E, K, T, seed=3, layers=L, uniform=True)
    tensor_bytes = L * T * K * (2 + 4)
    reads = []
    orig = Trace._slice

    def spy(self, name, i, start=0, stop=None):
        out = orig(self, name, i, start, stop)
        reads.append((name, out.shape))
        return out

    inspect_trace(path, ranks=8, gpus_per_node=4, chunk_tokens=10000)  # one-time costs (lazy imports, caches) first
    monkeypatch.setattr(Trace, "_slice", spy)
    tracemalloc.start()
    res = inspect_trace(path, ranks=8, gpus_per_node=4, chunk_tokens=10000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert res["layers"] == L and res["tokens"] == T
    assert peak < tensor_bytes / 8, (peak, tensor_bytes)
    assert reads and all(shape[0] <= 10000 for _, shape in reads)
    assert sum(np.prod(s) for n, s in reads if n == "topk_ids") == L * T * K


def _bad_token_reference(ids, E):
    """Slow, obviously correct: the first token with an id out of range, else the first with a repeat."""
    for t, row in enumerate(ids.tolist()):
        if any(not 0 <= x < E for x in row):
            return "range", t
    for t, row in enumerate(ids.tolist()):
        if len(set(row)) < len(row):
            return "duplicate", t
    return None


@settings(max_examples=60, deadline=None)
@given(E=st.sampled_from([3, 40, 40000]), K=st.integers(1, 40), T=st.integers(0, 40), seed=st.integers(0, 2**31 - 1),
       plant=st.sampled_from(["none", "duplicate", "range", "both"]))
def test_find_bad_token_matches_the_reference(E, K, T, seed, plant):
    """Pairwise compares (K <= 32) and the row sort (larger K) name the same first bad token."""
    from moonep_sim.routing.trace import find_bad_token

    K = min(K, E)
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) if T else np.zeros((0, K), np.int64)
    if T and K > 1 and plant in ("duplicate", "both"):
        t = rng.integers(T)
        i, j = rng.choice(K, 2, replace=False)
        ids[t, i] = ids[t, j]
    if T and plant in ("range", "both"):
        ids[rng.integers(T), rng.integers(K)] = rng.choice([-1, E, E + 7])
    assert find_bad_token(ids, E) == _bad_token_reference(ids, E)
