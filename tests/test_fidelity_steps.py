"""benchmarks/fidelity_steps.py: how development row 5 (torchtitan with DeepEP) becomes a step --
torchtitan's FLOP count per token and the sequence length it gives for the row (no run of the
simulator: the bench's output is the results page)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def fs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("fidelity_steps")


def test_torchtitan_flops_per_token_hand_count(fs):
    from moonep_sim.models import get_model

    m = get_model("qwen3-30b-a3b")
    # per layer: q 2048x4096, k and v 2048x512 each, o 4096x2048, q/k norms 128 each, two norms of
    # 2048, router 2048x128, 8 of 128 experts at 3 x 2048 x 768
    layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048 + 2048 * 128 + 8 * 3 * 2048 * 768
    assert layer == 56_889_600
    active = 48 * layer + 2048 + 151936 * 2048          # final norm, output head; token embedding not counted
    attention = 12 * 48 * 32 * 128 * 2048               # 12 x layers x heads x head_dim x seq
    assert fs.torchtitan_flops_per_token(m, 2048) == 6 * active + attention
    assert fs.torchtitan_flops_per_token(m, 0) == 6 * active


def test_row5_sequence_length_from_its_tflops(fs):
    from moonep_sim.models import get_model

    m = get_model("qwen3-30b-a3b")
    # the inverse of the count; the row's 341 TFLOPS at 14,796 tokens/s gives 2033, within 1% of
    # 2048 (torchtitan's default seq_len), while 4096 would log 413 TFLOPS at those tokens/s
    assert fs.torchtitan_seq_len(m, fs.torchtitan_flops_per_token(m, 4096)) == pytest.approx(4096)
    seq = fs.torchtitan_seq_len(m, 341e12 / 14796)
    assert abs(seq / 2048 - 1) < 0.01
    assert fs.torchtitan_flops_per_token(m, 4096) * 14796 / 1e12 == pytest.approx(413, abs=1)

def test_fsdp2_bytes_per_parameter(fs):
    # fp32 parameter shard 4 + fp32 gradient 4 + Adam moments 8 = 16 = the step's bf16 weight 2 +
    # gradient 4 + the optimizer's share
    assert 2 + 4 + fs.FSDP2_OPTIMIZER_BYTES_PER_PARAM == 4 + 4 + 8


def test_row5_state_drop_hand_count(fs):
    """Row 5's mapping under FSDP2 (ZeRO 3 at 16 B per parameter): from 1 node (dp 8, the experts'
    edp 1) to 16 nodes (dp 128, edp 16) a GPU's weights, gradients and optimizer state fall by
    16 B x (the dense parameters x (1/8 - 1/128) + a rank's experts x (1 - 1/16)); activations are
    the same per GPU."""
    from moonep_sim.models import get_model
    from moonep_sim.step.memory import MemoryOptions, memory_for_layout
    from moonep_sim.step.parallel import Parallel
    from moonep_sim.step.stack import step_shape

    m = get_model("qwen3-30b-a3b")
    shape = step_shape(m, "train", 2048, None)
    opts = MemoryOptions(optimizer_bytes_per_param=fs.FSDP2_OPTIMIZER_BYTES_PER_PARAM)

    def state(gpus: int) -> tuple[float, float]:
        par = Parallel(dp=gpus, ep=8, zero=3, micro_batch_size=fs.ROW5_LOCAL_BATCH,
                       global_batch_size=fs.ROW5_LOCAL_BATCH * gpus).check(gpus, m)
        p = memory_for_layout(m, shape, par, [], opts)["parts"]
        return p["weights"] + p["gradients"] + p["optimizer"], p["activations"]

    (s1, a1), (s16, a16) = state(8), state(128)
    # dense: embedding and head 151936 x 2048 each, per layer attention 18,874,368 + norms 2 x 2048 +
    # q/k norms 2 x 128 + router 2048 x 128, the final norm; experts 48 x 128 x 3 x 2048 x 768
    dense = 2 * 151936 * 2048 + 48 * (18_874_368 + 2 * 2048 + 2 * 128 + 2048 * 128) + 2048
    experts = 48 * 128 * 3 * 2048 * 768
    drop = 16 * (dense * (1 / 8 - 1 / 128) + experts / 8 * (1 - 1 / 16))
    assert s1 - s16 == pytest.approx(drop, rel=0.005)
    assert a1 == a16
