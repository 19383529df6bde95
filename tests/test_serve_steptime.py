"""Step-time models: interpolation, the grid from the step simulator, the cache, deployments."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.serve import steptime as st
from moonep_sim.serve.deployment import (Deployment, Pool, deployment_from_dict, kv_tokens, read_deployment,
                                         weight_bytes_per_gpu)
from moonep_sim.step.parallel import Parallel


def _affine_sim(mode, T, C, d):
    """A step that is exactly affine in T and C: its grid's interpolation is exact at grid points."""
    base = 1000.0 if mode == "decode" else 5000.0
    return {"a": base + 10.0 * T + 0.1 * C + d, "b": 2 * (base + 10.0 * T)}


def test_grid_reproduces_its_points_and_interpolates_between():
    m = st.build_grid(_affine_sim, ["a", "b"], [1, 2, 4, 8], [256, 1024], [16, 64], [512], draws=2)
    a = m["a"]
    assert a.time_us(0, 0, 4, 1024, 1) == pytest.approx(1000 + 40 + 102.4 + 1)
    assert a.time_us(0, 0, 4, 1024, 3) == pytest.approx(1000 + 40 + 102.4 + 1)   # draws wrap
    # between grid points, linear in log2 T: T=3 sits 0.585 of the way from 2 to 4
    w = np.log2(3) - 1
    assert a.time_us(0, 0, 3, 256, 0) == pytest.approx((1 - w) * (1045.6) + w * (1065.6))
    # beyond the largest T: linear in T
    assert m["b"].time_us(0, 0, 16, 256, 0) == pytest.approx(2 * (1000 + 80) * 2)
    # between contexts, linear in C: the affine step is reproduced exactly at C = 640
    assert a.time_us(0, 0, 4, 640, 0) == pytest.approx(1000 + 40 + 64)
    # mixed: the prefill step of every token + the decodes' extra KV reads over the smallest context
    mixed = a.time_us(62, 512, 2, 1024, 0)
    assert mixed == pytest.approx((5000 + 640 + 51.2) + (0.1 * 1024 - 0.1 * 256))


def test_holdout_error_is_zero_for_a_model_exact_between_points():
    lin = lambda mode, T, C, d: {"a": 100.0 + 7.0 * np.log2(T)}    # linear in log2 T: interpolation is exact
    m = st.build_grid(lin, ["a"], [1, 4, 16], [512], [16, 64, 256], [512], draws=1)
    pts = st.holdout_points(m["a"], 4, seed=1)
    assert pts and all(p[1] not in (1, 4, 16, 64, 256) for p in pts)
    e = st.holdout_error(m, lin, pts)
    assert e["a"]["max_abs_rel_error"] == pytest.approx(0.0, abs=1e-12)


def test_cache_roundtrip_without_pickle(tmp_path):
    m = st.build_grid(_affine_sim, ["a", "b"], [1, 2], [256], [16], [512], draws=2)
    p = tmp_path / "g.npz"
    st.save(p, m, {"a": {"median_abs_rel_error": 0.1}})
    got, hold = st.load(p)
    assert hold == {"a": {"median_abs_rel_error": 0.1}}
    assert got["b"].time_us(0, 0, 2, 256, 1) == m["b"].time_us(0, 0, 2, 256, 1)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert st.load(tmp_path / "bad.npz") is None
    assert st.cache_key({"x": 1}) != st.cache_key({"x": 2})


def test_pow2_grid():
    assert st.pow2_grid(1, 32) == [1, 2, 4, 8, 16, 32]
    assert st.pow2_grid(3, 20) == [3, 4, 8, 16, 32]


def test_deployment_toml_and_memory(tmp_path):
    from moonep_sim.models import get_model

    p = tmp_path / "d.toml"
    p.write_text('weight_bytes = 1\n[prefill]\nworkers = 1\nlayout = { dp = 32, ep = 32, dp_attention = true }\n'
                 '[decode]\nworkers = 2\nlayout = { dp = 16, ep = 16, dp_attention = true }\nmax_running = 64\n')
    d = read_deployment(p)
    assert d.disaggregated and d.gpus == 64
    assert read_deployment_roundtrip(d, tmp_path).to_dict() == d.to_dict()
    m = get_model("deepseek-v3")
    kv = d.check(m, 80.0, 64)
    # hand count: EP32 holds 256/32 experts of 58 layers at 1 B + the dense part
    w = weight_bytes_per_gpu(m, Parallel(dp=32, ep=32, dp_attention=True), 1.0)
    per_tok = (m.kv_lora_rank + m.qk_rope_dim) * 2 * m.layers
    assert kv["prefill"] == int((80 * 2**30 * 0.85 - w) // per_tok)
    with pytest.raises(ConfigError, match="does not fit"):     # BF16 weights on EP8 of 80 GB GPUs
        Deployment((Pool("both", 1, Parallel(dp=8, ep=8, dp_attention=True)),), weight_bytes=2).check(m, 80.0)
    with pytest.raises(ConfigError, match="unknown key"):
        deployment_from_dict({"worker": {"workers": 1, "lanes": 3}})
    with pytest.raises(ConfigError, match="must equal --gpus"):
        d.check(m, 80.0, 32)
    assert kv_tokens(m, Parallel(dp=8, ep=8), 80.0, 1.0, 2.0, 0.85) == 0     # 671 GB of FP8 weights over 8 x 80 GB
    assert kv_tokens(m, Parallel(dp=8, ep=8), 141.0, 1.0, 2.0, 0.85) > 0    # H200


def read_deployment_roundtrip(d, tmp_path):
    q = tmp_path / "rt.toml"
    q.write_text(d.to_toml())
    return read_deployment(q)
