"""The serving engine against closed forms and hand counts (constant step-time models)."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.serve.engine import EngineConfig, Worker, cuda_graph_sizes, simulate
from moonep_sim.serve.metrics import parse_slo, pareto, summarize
from moonep_sim.serve.requests import Requests, synthetic
from moonep_sim.serve.steptime import AffineStepTime, ConstantStepTime


def _req(arr, isl, osl, hit=None, closed=0):
    n = len(isl)
    return Requests(np.asarray(arr, float), np.asarray(isl, np.int64), np.asarray(osl, np.int64),
                    np.zeros(n, np.int64) if hit is None else np.asarray(hit, np.int64), closed, "test")


def _one(cfg=None, us=1000.0, ranks=1, role="both"):
    return Worker(role, ranks, ranks, cfg or EngineConfig(max_running=8, token_budget=8, kv_tokens=1 << 16, block=1),
                  ConstantStepTime(us))


def test_chunked_prefill_then_decode_hand_count():
    # prompt 10 in chunks of 4, 4, 2 (first token at the end of the third iteration), then 2 decodes
    r = simulate(_req([0.0], [10], [3]), [_one(EngineConfig(max_running=4, token_budget=4, kv_tokens=64, block=1))])
    assert r.first_s[0] == pytest.approx(3e-3)
    assert r.finish_s[0] == pytest.approx(5e-3)
    assert r.it_prefill_tokens.tolist() == [4, 4, 2, 0, 0]


def test_continuous_batching_two_requests_share_iterations():
    r = simulate(_req([0.0, 0.0], [4, 4], [2, 2]), [_one()])
    assert r.first_s.tolist() == pytest.approx([1e-3, 1e-3])
    assert r.finish_s.tolist() == pytest.approx([2e-3, 2e-3])


def test_late_arrival_joins_running_batch():
    # B arrives while A decodes: it is admitted at the next iteration boundary beside A's decode
    r = simulate(_req([0.0, 0.0015], [2, 2], [4, 1]), [_one()])
    assert r.first_s[1] == pytest.approx(3e-3)      # admitted at 2 ms, its prefill runs 2-3 ms
    assert r.finish_s[0] == pytest.approx(4e-3)
    assert r.it_decode_seqs.tolist() == [0, 1, 1, 1]


def test_affine_step_time_prices_the_busiest_rank():
    # two ranks; 3 requests go to the rank with fewest running: ranks get 2 and 1 -> busiest rank 2 x 5 tokens
    w = Worker("both", 2, 2, EngineConfig(max_running=8, token_budget=64, kv_tokens=1 << 12, block=1),
               AffineStepTime(100.0, 10.0))
    r = simulate(_req([0, 0, 0], [5, 5, 5], [1, 1, 1]), [w])
    assert r.it_dur_s.tolist() == pytest.approx([(100 + 10 * 10) * 1e-6])


def test_cuda_graph_padding_hand_count():
    assert cuda_graph_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    w = Worker("both", 1, 1, EngineConfig(max_running=8, token_budget=64, kv_tokens=1 << 12, block=1,
                                          cuda_graphs=(1, 2, 4, 8)), AffineStepTime(0.0, 100.0))
    r = simulate(_req([0, 0, 0], [1, 1, 1], [2, 2, 2]), [w])
    # prefill of 3 tokens (eager), then a decode of 3 sequences padded to the graph of 4
    assert r.it_dur_s.tolist() == pytest.approx([300e-6, 400e-6])


def test_disaggregated_kv_transfer_hand_count():
    p = Worker("prefill", 1, 1, EngineConfig(max_running=4, token_budget=8, kv_tokens=64, block=1), ConstantStepTime(1000))
    d = Worker("decode", 1, 1, EngineConfig(max_running=4, token_budget=8, kv_tokens=64, block=1), ConstantStepTime(2000))
    r = simulate(_req([0.0], [4], [3]), [p, d], kv_transfer_s=lambda n: 0.5e-3)
    assert r.first_s[0] == pytest.approx(1e-3)
    assert r.finish_s[0] == pytest.approx(1e-3 + 0.5e-3 + 2 * 2e-3)
    assert r.worker[0] == 1


def test_mtp_all_accepted_emits_two_tokens_a_step():
    cfg = EngineConfig(max_running=4, token_budget=8, kv_tokens=64, block=1, mtp_tokens=1, mtp_accept=1.0)
    r = simulate(_req([0.0], [4], [5]), [_one(cfg)])
    assert r.finish_s[0] == pytest.approx(3e-3)    # 1 at prefill, then 2 + 2
    assert r.emitted[0] == 5


def test_preemption_conserves_requests_and_tokens():
    # 4 tokens of KV per rank, two requests of 2 + 2: the younger is preempted when both grow
    cfg = EngineConfig(max_running=4, token_budget=8, kv_tokens=4, block=1)
    req = _req([0, 0], [2, 2], [2, 2])
    r = simulate(req, [_one(cfg)])
    assert r.preempted.sum() >= 1
    assert not np.isnan(r.finish_s).any()
    assert r.emitted.tolist() == [2, 2]


def test_conservation_and_determinism_random_load():
    req = synthetic(300, "uniform:16:256", "uniform:1:64", seed=3, rate=200.0)
    ws = [Worker("both", 4, 4, EngineConfig(max_running=16, token_budget=256, kv_tokens=2048, block=16),
                 AffineStepTime(500.0, 2.0)) for _ in range(2)]
    a = simulate(req, ws, seed=1)
    b = simulate(req, ws, seed=1)
    assert not np.isnan(a.finish_s).any()
    assert np.array_equal(a.emitted, req.output_N)
    assert int(a.it_tokens.sum()) == int(req.output_N.sum())          # every token counted once
    # every prompt token computed once, plus recomputation of preempted requests only
    assert int(a.it_prefill_tokens.sum()) >= int((req.input_N - req.hit_N).sum())
    if a.preempted.sum() == 0:
        assert int(a.it_prefill_tokens.sum()) == int((req.input_N - req.hit_N).sum())
    assert np.array_equal(a.finish_s, b.finish_s) and np.array_equal(a.it_dur_s, b.it_dur_s)


def test_closed_loop_keeps_concurrency():
    req = synthetic(40, 8, 4, concurrency=4)
    r = simulate(req, [_one(EngineConfig(max_running=8, token_budget=64, kv_tokens=1 << 12, block=1))])
    assert not np.isnan(r.finish_s).any()
    # the second wave starts when the first finishes: 4 at t=0, then each next at a finish
    assert (r.arrival_s[:4] == 0).all() and (r.arrival_s[4:] > 0).all()
    assert set(np.round(r.arrival_s[4:8], 9)) <= set(np.round(r.finish_s[:4], 9))


def test_md1_mean_wait_matches_pollaczek_khinchine():
    """One worker serving one single-token request per iteration of fixed length D: an M/D/1 queue.
    Its mean wait in queue is lambda D^2 / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    D, lam, n = 1e-3, 600.0, 6000
    rng = np.random.default_rng(7)
    arr = np.cumsum(rng.exponential(1 / lam, n))
    req = _req(arr, np.ones(n), np.ones(n))
    cfg = EngineConfig(max_running=1, token_budget=1, kv_tokens=16, block=1)
    r = simulate(req, [_one(cfg, us=D * 1e6)])
    wait = r.first_s - r.arrival_s - D
    rho = lam * D
    pk = lam * D * D / (2 * (1 - rho))
    batches = wait[n // 10:].reshape(20, -1).mean(axis=1)          # batch means after a warm-up
    half = 2.86 * batches.std(ddof=1) / np.sqrt(len(batches))     # 99% (t, 19 dof)
    assert abs(batches.mean() - pk) <= half


def test_bad_input_lines():
    with pytest.raises(ConfigError, match="sorted"):
        _req([1.0, 0.5], [1, 1], [1, 1])
    with pytest.raises(ConfigError, match="input length"):
        _req([0.0], [-3], [1])
    with pytest.raises(ConfigError, match="unit"):
        parse_slo("ttft=200")
    assert parse_slo("ttft=200ms,tpot=50ms") == pytest.approx({"ttft": 0.2, "tpot": 0.05})
    with pytest.raises(ConfigError, match="does not fit"):
        simulate(_req([0.0], [100], [100]), [_one(EngineConfig(max_running=4, token_budget=8, kv_tokens=64, block=1))])


def test_summary_slo_and_pareto():
    req = _req([0.0, 0.0], [4, 4], [3, 3])
    r = simulate(req, [_one()])
    s = summarize(r, req.input_N, req.output_N, 1, {"ttft": 1.5e-3, "tpot": 1e-3}, price=2.0)
    assert s["ttft_s"]["p50"] == pytest.approx(1e-3) and s["tpot_s"]["p50"] == pytest.approx(1e-3)
    assert s["slo_attainment"] == 1.0
    assert s["output_tokens_per_s_per_gpu"] == pytest.approx(6 / 3e-3)
    assert s["usd_per_million_output_tokens"] == pytest.approx(2.0 / (2000 * 3600) * 1e6)
    assert pareto([(1, 5), (2, 4), (1.5, 3), (3, 1)]) == [0, 1, 3]


def test_eplb_copy_every_n_iterations_hand_count():
    cfg = EngineConfig(max_running=4, token_budget=8, kv_tokens=64, block=1, eplb_every=2, eplb_us=500.0)
    r = simulate(_req([0.0], [4], [4]), [_one(cfg)])
    # iterations 2 and 4 carry the weight copy: 1 + 1.5 + 1 + 1.5 ms
    assert r.it_dur_s.tolist() == pytest.approx([1e-3, 1.5e-3, 1e-3, 1.5e-3])
    assert r.finish_s[0] == pytest.approx(5e-3)


def test_in_order_draws_walk_the_recorded_steps():
    class ByDraw:
        draws = 3

        def time_us(self, n_pre, c_pre, n_dec, c_dec, draw=0):
            return 1000.0 * (draw + 1)

    w = Worker("both", 1, 1, EngineConfig(max_running=4, token_budget=8, kv_tokens=64, block=1), ByDraw())
    r = simulate(_req([0.0], [4], [5]), [w], draw_order="in-order")
    assert r.it_dur_s.tolist() == pytest.approx([1e-3, 2e-3, 3e-3, 1e-3, 2e-3])


def test_arrivals_and_lengths_have_their_moments():
    from moonep_sim.serve.requests import gamma_arrivals, lengths

    rng = np.random.default_rng(0)
    gaps = np.diff(gamma_arrivals(50.0, 20000, rng, cv=2.0), prepend=0.0)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)
    x = lengths("lognormal:1000:0.5", 20000, rng)
    assert x.mean() == pytest.approx(1000, rel=0.03) and x.min() >= 1
    u = lengths("uniform:10:20", 1000, rng)
    assert u.min() >= 10 and u.max() <= 20
    with pytest.raises(ConfigError, match="uniform:LO:HI"):
        lengths("normal:3", 5, rng)
