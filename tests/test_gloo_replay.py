"""The torchrun replay: a trace replayed over gloo ranks, checked against the dense reference."""

from __future__ import annotations

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.experiments.ranks.replay_rank import run_replay
from moonep_sim.routing.generators import generate_trace

pytestmark = pytest.mark.slow  # every test here starts gloo ranks in processes (-m "not slow" skips them)

KEYS = {"strategy", "world_size", "layers", "dispatch_ms", "combine_ms", "total_ms", "bytes_sent", "correct",
        "options", "per_layer", "phases", "prefetch_ms", "expert_ms", "backward_ms", "phases_R", "slowest_rank"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "t.safetensors"
    generate_trace(path, 8, 2, 61, 4, layers=2, maxvio=1.0)
    return path


def test_replay_two_hop_strategy_forward_and_backward_is_correct(trace):
    rep = run_replay(4, ["--trace", trace, "--strategy", "hierarchical", "--opt", "dedup=1", "--hidden", "16",
                         "--ffn", "8", "--backward", "--gpus-per-node", "2", "--iters", "1", "--warmup", "0",
                         "--timeout", "30"], timeout_s=120)
    assert KEYS <= set(rep)
    assert rep["strategy"] == "hierarchical" and rep["options"] == {"dedup": True}
    assert rep["world_size"] == 4 and rep["layers"] == [0, 1] and rep["tokens_per_rank"] == [16, 15, 15, 15]
    assert rep["correct"] is True
    assert all(e["correct"] and e["hops"] == 2 for e in rep["per_layer"])
    assert rep["bytes_sent"] == sum(e["bytes"]["sent"] for e in rep["per_layer"]) > 0
    for e in rep["per_layer"]:
        assert e["bytes"]["inter_node"] > 0 and sum(e["recv_rows_per_rank"]) == 61 * 2 - 0
        for ph in e["phases"].values():
            assert ph["max_ms"] >= ph["mean_ms"] >= 0
        # every rank's own phase times, consistent with the max / mean over ranks
        for name, ph in e["phases"].items():
            per_rank = e["phases_R"][name]
            assert len(per_rank) == 4
            assert max(per_rank) == pytest.approx(ph["max_ms"]) and sum(per_rank) / 4 == pytest.approx(ph["mean_ms"])
    for name, per_rank in rep["phases_R"].items():
        assert per_rank == pytest.approx([sum(e["phases_R"][name][r] for e in rep["per_layer"]) for r in range(4)])
        assert rep["slowest_rank"][name] == per_rank.index(max(per_rank))


def test_replay_of_a_bad_strategy_fails_with_one_clear_line(trace):
    with pytest.raises(ConfigError, match=r"^strategy \('nope'\) must be one of: .*\(rank 0 of 1\)$"):
        run_replay(1, ["--trace", trace, "--strategy", "nope"], timeout_s=60)


def test_replay_of_eplb_fetches_resident_replicas_once_per_layer(trace):
    """eplb's replicas are resident: after the warm-up iteration nothing is fetched, and each layer
    (one Buffer, one cache entry per layer) still computes with its own weights."""
    rep = run_replay(4, ["--trace", trace, "--strategy", "eplb", "--hidden", "16", "--ffn", "8", "--backward",
                         "--gpus-per-node", "2", "--iters", "2", "--warmup", "1", "--timeout", "30"], timeout_s=120)
    assert rep["correct"] is True
    assert all(e["correct"] and e["weight_copies"] == 0 and e["fetched_weights"] == 0 for e in rep["per_layer"])


def test_replay_of_several_strategies_interleaved(trace):
    """One process group replays every strategy in turn each iteration: each is checked against the
    dense layer, carries one sample per iteration, and per-strategy options reach only their own."""
    rep = run_replay(4, ["--trace", trace, "--strategy", "alltoall,hierarchical,moonep",
                         "--opt", "hierarchical.dedup=1", "--hidden", "16", "--ffn", "8", "--gpus-per-node", "2",
                         "--iters", "3", "--warmup", "1", "--timeout", "30"], timeout_s=180)
    assert rep["interleaved"] is True and rep["order"] == ["alltoall", "hierarchical", "moonep"]
    assert set(rep["strategies"]) == {"alltoall", "hierarchical", "moonep"}
    assert rep["strategies"]["hierarchical"]["options"] == {"dedup": True}
    assert rep["strategies"]["alltoall"]["options"].get("dedup") is not True  # its own default
    for name, r in rep["strategies"].items():
        assert KEYS <= set(r) and r["strategy"] == name and r["correct"] is True, name
        assert len(r["layer_ms_samples"]) == 3 and min(r["layer_ms_samples"]) > 0
        assert r["layer_ms_median"] == pytest.approx(sorted(r["layer_ms_samples"])[1])
        for e in r["per_layer"]:
            assert len(e["iter_total_ms"]) == 3
            # a sample is the slowest rank's iteration: at least the mean over iterations of any rank
            assert max(e["iter_total_ms"]) >= max(e["phases_R"]["total"]) - 1e-9
        # samples: the layers' iteration times averaged over the layers
        for i in range(3):
            assert r["layer_ms_samples"][i] == pytest.approx(sum(e["iter_total_ms"][i] for e in r["per_layer"]) / 2)
    assert rep["strategies"]["hierarchical"]["per_layer"][0]["hops"] == 2
    assert rep["strategies"]["alltoall"]["per_layer"][0]["hops"] == 1


def test_replay_rejects_a_repeated_strategy(trace):
    with pytest.raises(ConfigError, match=r"--strategy \('alltoall,alltoall'\) must name one or more distinct"):
        run_replay(1, ["--trace", trace, "--strategy", "alltoall,alltoall"], timeout_s=60)


def test_replay_of_selected_steps(tmp_path):
    """--steps 1-2 replays each of those steps as its own batch (the rows each rank receives are
    that step's); --steps merged:1-2 replays their tokens as one batch."""
    import numpy as np

    from moonep_sim.routing.steps import read_layer
    path = tmp_path / "s.safetensors"
    generate_trace(path, 8, 2, 20, 5, layers=1, steps=3, maxvio=1.0)
    home = np.arange(8) * 2 // 8
    common = ["--trace", path, "--strategy", "alltoall", "--hidden", "16", "--ffn", "8", "--iters", "1",
              "--warmup", "0", "--timeout", "30"]
    rep = run_replay(2, common + ["--steps", "merged:1-2"], timeout_s=120)
    assert rep["correct"] is True and rep["tokens"] == 40
    ids = read_layer(path, 0, "1-2").topk_ids_TK
    assert rep["per_layer"][0]["recv_rows_per_rank"] == np.bincount(home[ids.ravel()], minlength=2).tolist()
    rep = run_replay(2, common + ["--steps", "1-2"], timeout_s=120)
    assert rep["correct"] is True and rep["tokens"] == 40
    assert [e["step"] for e in rep["per_layer"]] == [1, 2] and rep["per_step"]["step"] == [1, 2]
    for e in rep["per_layer"]:
        ids = read_layer(path, 0, str(e["step"])).topk_ids_TK
        assert e["recv_rows_per_rank"] == np.bincount(home[ids.ravel()], minlength=2).tolist()
