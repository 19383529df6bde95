"""Expert parallelism for Hugging Face MoE models (moonep_sim.integrations.hf) against the
single-process model: K training steps (loss per step, logits, every parameter gradient) and a short
greedy generate, on tiny random-initialised models built offline.

Coverage without the full product: every family with one strategy (moonep, 2 ranks) and every
strategy with one family (Mixtral, 4 ranks); each group runs in one set of rank processes (the
start-up of torch and transformers dominates a tiny model's steps)."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from moonep_sim.errors import ConfigError  # noqa: E402
from rank_spawner import spawn_ranks  # noqa: E402
from moonep_sim.integrations.hf import expert_parallel, find_experts  # noqa: E402
from moonep_sim.integrations.tiny import FAMILY, TINY, build_model  # noqa: E402

HERE = str(Path(__file__).resolve().parent)
STRATEGIES = ("alltoall", "deepep", "moonep", "costaware")


def equality_worker(rank, world, models, strategies, steps=2, generate=3):
    """Every (model, strategy) pair: check_training + check_generate; one result row each."""
    from moonep_sim.integrations.check import check_generate, check_training
    from moonep_sim.sim.topology import load_topology

    topo = load_topology("local-gloo", gpus_per_node=world)
    out = {}
    for model in models:
        for strategy in strategies:
            res = check_training(lambda: build_model(model, 0, torch.float64),
                                 lambda m: expert_parallel(m, strategy=strategy, capacity=64, timeout_s=60,
                                                           topology=topo),
                                 steps=steps, batch=2, seq=8, seed=3)
            gen = check_generate(res["ref"], res["model"], new_tokens=generate, prompt_len=5, seed=3)
            key = f"{model}/{strategy}"
            for k in ("loss_err", "logits_err", "grad_err", "router_grad_err", "copies", "ok", "tolerance"):
                out[f"{key}/{k}"] = res[k]
            out[f"{key}/tokens_equal"] = gen["tokens_equal"]
            out[f"{key}/steps"] = len(res["losses"])
            out[f"{key}/loss_moved"] = abs(res["losses"][-1] - res["losses"][0]) > 0
    return out


def _run(models, strategies, world, timeout_s):
    res = spawn_ranks("test_hf_train:equality_worker", world, dict(models=list(models), strategies=list(strategies)),
                      timeout_s=timeout_s, pythonpath=[HERE], pg_timeout_s=120)
    for r in res:
        assert r.ok, f"rank {r.rank} failed (exit {r.returncode}): {r.output[-3000:]}"
    return res


def _assert_equal(res, models, strategies):
    for model in models:
        for s in strategies:
            k = f"{model}/{s}"
            for r in res:
                got = r.result
                assert got[f"{k}/steps"] == 2 and got[f"{k}/loss_moved"], k      # SGD steps changed the model
                assert got[f"{k}/loss_err"] <= 1e-6, (k, got[f"{k}/loss_err"])
                assert got[f"{k}/logits_err"] <= 1e-9 and got[f"{k}/grad_err"] <= 1e-9, (k, got)
                # DeepSeek's routers score in float32 even in a float64 model; others are exact
                assert got[f"{k}/router_grad_err"] <= (1e-5 if "deepseek" in model else 1e-9), (k, got)
                assert got[f"{k}/ok"] and got[f"{k}/tokens_equal"], k


@pytest.mark.slow  # 2 gloo ranks, 7 tiny models
def test_every_family_trains_and_generates_like_the_single_process_model():
    models = list(TINY)
    assert {FAMILY[m] for m in models} == {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                           "gpt_oss"}
    res = _run(models, ["moonep"], 2, 600)
    _assert_equal(res, models, ["moonep"])
    # moonep balanced by copying experts somewhere: the prefetch and gradient reduce ran
    assert sum(res[0].result[f"{m}/moonep/copies"] for m in models) > 0


@pytest.mark.slow  # 4 gloo ranks, 4 strategies
def test_every_strategy_trains_and_generates_like_the_single_process_model():
    res = _run(["tiny-mixtral"], STRATEGIES, 4, 600)
    _assert_equal(res, ["tiny-mixtral"], STRATEGIES)
    assert res[0].result["tiny-mixtral/moonep/copies"] > 0
    assert res[0].result["tiny-mixtral/alltoall/copies"] == 0


def death_worker(rank, world, victim, layer):
    """A training step in which rank ``victim`` dies (SIGKILL) as it enters MoE layer ``layer``."""
    model = build_model("tiny-olmoe", 0)
    ep = expert_parallel(model, strategy="moonep", capacity=64, timeout_s=15)
    model.train()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()              # one good step
    ep.sync_grads()
    if rank == victim:
        ep.layers[layer].register_forward_pre_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    model(input_ids=ids, labels=ids).loss.backward()
    return {"finished": True}


@pytest.mark.slow  # 4 gloo ranks, one killed mid-step
def test_a_rank_that_dies_mid_step_is_named():
    victim = 2
    res = spawn_ranks("test_hf_train:death_worker", 4, dict(victim=victim, layer=1), timeout_s=180,
                      pythonpath=[HERE], kill_on_failure=False, wait_for=[0, 1, 3])
    assert res[victim].returncode == -signal.SIGKILL
    for r in (0, 1, 3):
        out = res[r].output
        assert res[r].returncode == 1, out[-2000:]
        assert "CommError: " in out, out[-2000:]
        # the Buffer's own line (the test spawner may wrap it in its own): phase, this rank, the victim
        m = re.search(r"(dispatch\S*) \S+ (?:timed out|failed) after [\d.]+ s on rank (\d) \(silent peer rank (\d)",
                      out)
        assert m, out[-2000:]
        assert int(m.group(2)) == r and int(m.group(3)) == victim   # the victim died entering layer 1's dispatch


# -- single-process: discovery and refusals -----------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_experts_modules_are_found_in_every_family(name):
    model = build_model(name, 0)
    sites = find_experts(model)
    assert [s.layer_id for s in sites] == [0, 1]
    for s in sites:
        assert s.num_experts == 8 and s.attr == "experts"
        assert all(getattr(s.module, n).shape[0] == 8 for n in s.weight_names)
        assert "down_proj" in s.weight_names


def test_expert_parallel_refuses_without_a_process_group_and_without_experts():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"torch.distributed \(not initialised\) must be initialised"):
        expert_parallel(build_model("tiny-mixtral", 0))


def test_bad_model_names_and_configs_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model \('tiny-nope'\) must be one of tiny-mixtral"):
        build_model("tiny-nope")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="must be a readable JSON model config"):
        build_model(str(bad))
    bad.write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ConfigError, match="model_type must be one transformers knows"):
        build_model(str(bad))
    d = tmp_path / "ckpt"
    d.mkdir()
    with pytest.raises(ConfigError, match="must hold a config.json"):
        build_model(str(d))


def test_a_config_json_and_a_checkpoint_directory_build_the_same_model(tmp_path):
    m = build_model("tiny-qwen3-moe", 5)
    m.config.to_json_file(str(tmp_path / "config.json"))
    again = build_model(str(tmp_path / "config.json"), 5)
    for (n, p), (_, q) in zip(m.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    ck = tmp_path / "ck"
    m.save_pretrained(str(ck))
    loaded = build_model(str(ck))
    for (n, p), (_, q) in zip(m.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), n


def test_missing_transformers_is_one_clear_line(monkeypatch):
    from moonep_sim.integrations import hf

    monkeypatch.setitem(sys.modules, "transformers", None)       # import transformers -> ImportError
    with pytest.raises(ConfigError, match=r"transformers \(not installed\) must be installed"):
        hf.require_transformers()
