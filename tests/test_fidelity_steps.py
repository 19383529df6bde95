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
