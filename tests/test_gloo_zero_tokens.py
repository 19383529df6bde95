"""Ranks with no tokens: a pass with fewer tokens than ranks (a decode step of a small batch) runs
on every strategy in the gloo executor, forward and backward, and equals the dense layer; the
simulator plans and times the same routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moonep_sim.models import custom_model
from moonep_sim.plan import GlobalRouting
from moonep_sim.plan.validate import validate
from moonep_sim.sim import simulate_layer
from moonep_sim.sim.topology import load_topology
from moonep_sim.strategies import PlanContext, available, make_plan

HERE = str(Path(__file__).resolve().parent)


@st.composite
def sparse_routing(draw):
    """Routing over R ranks where some (at least one, not all) ranks hold no token."""
    R = draw(st.sampled_from([4, 8]))
    E = draw(st.sampled_from([8, 16]))
    K = draw(st.integers(1, 3))
    tpr = np.array(draw(st.lists(st.integers(0, 3), min_size=R, max_size=R)), dtype=np.int64)
    zero = draw(st.integers(0, R - 1))
    tpr[zero] = 0
    if tpr.sum() == 0:
        tpr[(zero + 1) % R] = 1
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    T = int(tpr.sum())
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
    w = rng.random((T, K)).astype(np.float32)
    return GlobalRouting(ids, w, tpr, E), R


@given(case=sparse_routing())
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_strategy_plans_and_simulates_ranks_with_zero_tokens(case):
    r, R = case
    topo = load_topology("h800-cx7")
    model = custom_model(r.num_experts, r.top_k)
    ctx = PlanContext.default(r.num_experts, R, 4)
    for name in available():
        p = make_plan(name, r, ctx)
        assert validate(p) == [], name
        res = simulate_layer(p, topo, model)
        assert np.isfinite(res.layer_time_us) and res.layer_time_us > 0, name
        # a zero-token rank sends no row on the first hop
        sent_RR = p.hops[0].rows_RR(R)
        assert (sent_RR[r.tokens_per_rank_R == 0].sum(axis=1) == 0).all(), name


@pytest.mark.slow
def test_gloo_layer_runs_with_fewer_tokens_than_ranks():
    """4 gloo ranks, 2 tokens: ranks 2 and 3 hold none; every strategy's output and gradients equal
    the dense layer's (the layer test's worker and reference)."""
    from rank_spawner import spawn_ranks
    from moonep_sim.gloo.moe import dense_moe
    from test_gloo_layer import make_inputs, variants  # the tests folder is on the path

    cfg = dict(T=2, H=8, F=6, E=8, K=3, G=2, seed=5)
    vs = variants()
    results = spawn_ranks("test_gloo_layer:layer_worker", 4, dict(variants=vs, **cfg), timeout_s=240,
                          pythonpath=[HERE])
    for r in results:
        assert r.ok, f"rank {r.rank} failed (exit {r.returncode}): {r.output[-3000:]}"
    assert [len(r.result["0/out"]) for r in results] == [1, 1, 0, 0]
    x, router_w, grad_out, experts = make_inputs(**cfg)
    for i, (name, opts) in enumerate(vs):
        keep = results[0].result[f"{i}/keep"]
        xx = x.clone().requires_grad_(True)
        ew = [w.clone().requires_grad_(True) for w in experts]
        ref = dense_moe(xx, router_w.clone(), ew, cfg["K"], keep_TK=keep)
        (ref * grad_out).sum().backward()
        out = np.concatenate([r.result[f"{i}/out"] for r in results])
        gx = np.concatenate([r.result[f"{i}/gx"] for r in results])
        np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-9, atol=1e-10, err_msg=f"{name} {opts}")
        np.testing.assert_allclose(gx, xx.grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=f"{name} {opts}")


@pytest.mark.slow
def test_a_real_replay_runs_steps_with_fewer_tokens_than_ranks(tmp_path):
    """A trace of 3 tokens replayed on 4 gloo ranks, forward and backward: the last rank holds no
    token, every strategy's result is checked against the dense layer (``correct``)."""
    from moonep_sim.experiments.ranks.replay_rank import run_replay
    from moonep_sim.routing.generators import generate_trace

    path = tmp_path / "t.safetensors"
    generate_trace(path, 8, 2, 3, 4, layers=1, maxvio=3.0)
    for name in ("alltoall", "moonep", "deepep", "deepep-ll"):
        rep = run_replay(4, ["--trace", path, "--strategy", name, "--hidden", "16", "--ffn", "8", "--backward",
                             "--gpus-per-node", "2", "--iters", "1", "--warmup", "0", "--timeout", "30"], timeout_s=180)
        assert rep["correct"] is True and rep["tokens_per_rank"] == [1, 1, 1, 0], name
