"""Scheduler policies: mixed iterations (vLLM V1) against SGLang's separate prefill and decode
batches (``prefill-first``), by hand count on a constant step time; conservation under both."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from moonep_sim.errors import ConfigError
from moonep_sim.serve.deployment import deployment_from_dict
from moonep_sim.serve.engine import EngineConfig, Worker, simulate
from moonep_sim.serve.policies import SCHEDULER_POLICIES
from moonep_sim.serve.requests import Requests
from moonep_sim.serve.steptime import ConstantStepTime


def _req(arr, isl, osl):
    n = len(isl)
    return Requests(np.asarray(arr, float), np.asarray(isl, np.int64), np.asarray(osl, np.int64),
                    np.zeros(n, np.int64), 0, "test")


def _worker(policy, budget=8, running=4, kv=1 << 12, us=1e6, ranks=1):
    return Worker("both", ranks, ranks, EngineConfig(max_running=running, token_budget=budget, kv_tokens=kv,
                                                     block=1, policy=policy), ConstantStepTime(us))


def test_policies_registered():
    assert SCHEDULER_POLICIES.names() == ("mixed", "prefill-first")
    assert SCHEDULER_POLICIES.get("mixed").mixes and not SCHEDULER_POLICIES.get("prefill-first").mixes


def test_prefill_first_pauses_decodes_for_a_prompt_hand_count():
    # 1 s iterations. A (prompt 4, 3 tokens) at 0; B (prompt 8, 1 token) at 0.5 s.
    req = _req([0.0, 0.5], [4, 8], [3, 1])
    mixed = simulate(req, [_worker("mixed")])
    # mixed: 0-1 A's prompt; 1-2 A decodes + B's first 7 tokens (budget 8 - 1); 2-3 A decodes + B's last token
    assert mixed.first_s.tolist() == pytest.approx([1.0, 3.0])
    assert mixed.finish_s.tolist() == pytest.approx([3.0, 3.0])
    assert mixed.it_prefill_tokens.tolist() == [4, 7, 1]
    sep = simulate(req, [_worker("prefill-first")])
    # prefill-first: 0-1 A's prompt; 1-2 B's whole prompt alone (A waits); 2-3 and 3-4 A decodes
    assert sep.first_s.tolist() == pytest.approx([1.0, 2.0])
    assert sep.finish_s.tolist() == pytest.approx([4.0, 2.0])
    assert sep.it_prefill_tokens.tolist() == [4, 8, 0, 0]
    assert sep.it_decode_seqs.tolist() == [0, 0, 1, 1]


def test_prefill_first_decodes_when_no_prompt_can_be_admitted():
    # one running slot: B cannot be admitted while A runs, so A decodes to its end before B's prompt
    req = _req([0.0, 0.5], [4, 4], [3, 1])
    r = simulate(req, [_worker("prefill-first", running=1)])
    assert r.finish_s.tolist() == pytest.approx([3.0, 4.0])
    assert r.it_prefill_tokens.tolist() == [4, 0, 0, 4]


@settings(max_examples=25, deadline=None)
@given(seed=hs.integers(0, 10_000), budget=hs.sampled_from([8, 32, 128]), kv=hs.sampled_from([64, 256, 4096]))
def test_prefill_first_conserves_requests_and_tokens(seed, budget, kv):
    rng = np.random.default_rng(seed)
    n = 30
    isl, osl = rng.integers(1, 40, n), rng.integers(1, 20, n)
    req = _req(np.sort(rng.uniform(0, 0.002, n)), isl, osl)
    r = simulate(req, [_worker("prefill-first", budget=budget, running=8, kv=kv, us=100.0, ranks=2)])
    assert not np.isnan(r.finish_s).any()
    assert np.array_equal(r.emitted, req.output_N)
    assert int(r.it_tokens.sum()) == int(req.output_N.sum())
    # an iteration is prefill or decode, never both
    assert not ((r.it_prefill_tokens > 0) & (r.it_decode_seqs > 0)).any()


def test_deployment_scheduler_key_and_bad_name():
    d = deployment_from_dict({"worker": {"layout": {"dp": 4, "ep": 4, "dp_attention": True},
                                         "scheduler": "prefill-first"}})
    assert d.pools[0].scheduler == "prefill-first" and "prefill-first" in d.label()
    assert deployment_from_dict(d.to_dict()).pools[0].scheduler == "prefill-first"
    with pytest.raises(ConfigError, match="scheduler policy .*must be one of mixed, prefill-first"):
        deployment_from_dict({"worker": {"layout": {"dp": 4, "ep": 4}, "scheduler": "lpm"}})


class _Shaped:
    """A step time that depends on every part of the shape and on the routing draw (3 draws)."""

    draws = 3

    def time_us(self, n_pre, c_pre, n_dec, c_dec, draw=0):
        return 300.0 + 7.0 * n_pre + 0.01 * n_pre * c_pre + 11.0 * n_dec + 0.03 * n_dec * c_dec + 17.0 * draw


def _same_run(a, b):
    for f in ("arrival_s", "first_s", "finish_s", "preempted", "worker", "it_worker", "it_start_s", "it_dur_s",
              "it_decode_seqs", "it_tokens", "it_prefill_tokens", "it_kv_use", "it_shape", "emitted"):
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f


@settings(max_examples=12, deadline=None)
@given(seed=hs.integers(0, 10_000), policy=hs.sampled_from(["mixed", "prefill-first"]),
       kv=hs.sampled_from([112, 400, 1 << 14]), closed=hs.booleans(), order=hs.sampled_from(["resample", "in-order"]),
       disagg=hs.booleans())
def test_running_decodes_ahead_gives_the_step_by_step_run(seed, policy, kv, closed, order, disagg):
    from moonep_sim.serve.requests import synthetic

    n = 40
    req = synthetic(n, "uniform:4:60", "uniform:1:40", seed, concurrency=8) if closed else \
        synthetic(n, "uniform:4:60", "uniform:1:40", seed, rate=3000.0)

    def w(role, ranks=2):
        return Worker(role, ranks, ranks, EngineConfig(max_running=8, token_budget=64, kv_tokens=kv, block=16,
                                                       cuda_graphs=(1, 2, 4, 8), policy=policy), _Shaped())
    ws = [w("prefill"), w("decode"), w("decode")] if disagg else [w("both"), w("both", 1)]
    xfer = (lambda tok: 1e-4 + tok * 1e-7) if disagg else (lambda tok: 0.0)
    fast = simulate(req, ws, kv_transfer_s=xfer, seed=seed, draw_order=order)
    slow = simulate(req, ws, kv_transfer_s=xfer, seed=seed, draw_order=order, ahead=False)
    _same_run(fast, slow)
    assert not np.isnan(fast.finish_s).any()
