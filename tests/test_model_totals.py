"""Every preset's total and active parameter counts against the figures its model card or report
publishes (``moonep_sim.step.stack.parameter_counts``), and the counting by hand on one model.

A published figure is rounded (``37B``, ``2.78T``): ours must lie within 1% of it, or within its
rounding (half a unit of its last digit), whichever is wider; a source that truncates (a negative
unit below: ``3.3B`` for 3.35) within its last digit upward. Vendors count *active* parameters two
ways: DeepSeek, Moonshot and OpenAI leave the input embedding out (a row lookup), Qwen, Mistral and
AI2 count it; each row below says which its source uses.
"""

from __future__ import annotations

import pytest

from moonep_sim.models import PRESETS, ModelSpec
from moonep_sim.step.stack import parameter_counts

B, T = 1e9, 1e12
# name: (total, its rounding unit, active, its rounding unit, active counts the embedding, source)
PUBLISHED = {
    "kimi-k3": (2.78 * T, 0.01 * T, 104.2 * B, 0.1 * B, False, "Moonshot's Kimi K3 report: 2.78T total, 104.2B active"),
    "deepseek-v2": (236 * B, 1 * B, 21 * B, 1 * B, False, "DeepSeek-V2 technical report (arXiv 2405.04434): 236B, 21B"),
    "deepseek-v3": (671 * B, 1 * B, 37 * B, 1 * B, False, "DeepSeek-V3 technical report (arXiv 2412.19437): 671B, 37B"),
    "qwen3-235b": (235 * B, 1 * B, 22 * B, 1 * B, True, "Qwen/Qwen3-235B-A22B model card: 235B in total, 22B activated"),
    "mixtral-8x22b": (141 * B, 1 * B, 39 * B, 1 * B, True, "Mistral's Mixtral 8x22B announcement: 39B active of 141B"),
    "mixtral-8x7b": (46.7 * B, 0.1 * B, 12.9 * B, 0.1 * B, True, "Mistral's Mixtral of experts post: 46.7B, 12.9B"),
    "gpt-oss-120b": (116.83 * B, 0.01 * B, 5.13 * B, 0.01 * B, False, "gpt-oss model card (OpenAI): 116.83B, 5.13B"),
    "gpt-oss-20b": (20.91 * B, 0.01 * B, 3.61 * B, 0.01 * B, False, "gpt-oss model card (OpenAI): 20.91B, 3.61B"),
    "olmoe-1b-7b": (6.9 * B, 0.1 * B, 1.3 * B, 0.1 * B, True, "OLMoE paper (arXiv 2409.02060): 6.9B total, 1.3B active"),
    "qwen1.5-moe-a2.7b": (14.3 * B, 0.1 * B, 2.7 * B, 0.1 * B, True, "Qwen1.5-MoE-A2.7B post: 14.3B, 2.7B activated"),
    # the two cards below truncate: their configs count 3.353B (with the embedding) and 2.451B
    # (without), which the cards give as 3.3B and 2.4B
    "qwen3-30b-a3b": (30.5 * B, 0.1 * B, 3.3 * B, -0.1 * B, True,
                      "Qwen/Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated"),
    "deepseek-v2-lite": (15.7 * B, 0.1 * B, 2.4 * B, -0.1 * B, False,
                         "DeepSeek-V2-Lite model card: 15.7B total, 2.4B activated"),
}
# Counted from the public config, off the published figure by more than 1% and its rounding: the
# measured gap, pinned so it is not hidden (see each reason).
OFF = {
    # Kimi K2's report gives 1.04T; its released config counts 1.026T (-1.3%): the gap, ~14B, is
    # near one more MoE layer's weights (17B) and is not in the released config. Its model card
    # gives "1T" total and "32B" active: the config's count lies within that figure's rounding
    # (1.03T to one decimal) and its active count (31.7B) within the card's 32B.
    "kimi-k2": (1.04 * T, -0.0131, 32 * B, False, "Kimi K2 report (arXiv 2507.20534): 1.04T total, 32B active"),
}


def _close(ours: float, published: float, unit: float) -> bool:
    if unit < 0:   # a truncated figure: the true value lies in [published, published + |unit|)
        return abs(ours - published) <= 0.01 * published or published <= ours < published - unit
    return abs(ours - published) <= max(0.01 * published, unit / 2)


def test_every_preset_has_its_published_figures():
    assert set(PUBLISHED) | set(OFF) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_totals_match_the_published_figures(name):
    total, t_unit, active, a_unit, with_embedding, source = PUBLISHED[name]
    c = parameter_counts(PRESETS[name])
    ours_active = c["active_with_embedding"] if with_embedding else c["active"]
    assert _close(c["total"], total, t_unit), f"{name} total {c['total'] / B:.2f}B vs {source}"
    assert _close(ours_active, active, a_unit), f"{name} active {ours_active / B:.3f}B vs {source}"


def test_the_presets_off_their_published_figures_stay_where_measured():
    k2 = parameter_counts(PRESETS["kimi-k2"])
    assert k2["total"] / OFF["kimi-k2"][0] - 1 == pytest.approx(OFF["kimi-k2"][1], abs=5e-4)
    assert _close(k2["active"], 32 * B, 1 * B)
    assert round(k2["total"] / T, 1) == 1.0   # the model card's "1T"
    q = parameter_counts(PRESETS["qwen3-30b-a3b"])
    assert q["active_with_embedding"] == pytest.approx(3.353e9, rel=1e-3)  # the card's 3.3B: 3.35 truncated
    v2 = parameter_counts(PRESETS["deepseek-v2-lite"])
    assert v2["active"] == pytest.approx(2.451e9, rel=1e-3)  # the card's 2.4B: 2.45 truncated


def test_a_truncated_figure_holds_only_upward():
    assert _close(3.353 * B, 3.3 * B, -0.1 * B) and not _close(3.41 * B, 3.3 * B, -0.1 * B)
    assert not _close(3.25 * B, 3.3 * B, -0.1 * B)   # below a truncated figure: more than 1% off


def test_kimi_k3_is_laid_out_as_its_config():
    k3 = PRESETS["kimi-k3"]
    kinds = [k3.attention_kind(l) for l in range(k3.layers)]
    assert (kinds.count("linear"), kinds.count("gated-mla")) == (69, 24)
    # the config's full-attention layers, 1-based: 4, 8, ..., 92, 93
    assert [l + 1 for l, k in enumerate(kinds) if k == "gated-mla"] == list(range(4, 93, 4)) + [93]
    assert (k3.num_experts, k3.top_k, k3.dispatch_hidden, k3.dense_layers, k3.heads) == (896, 16, 3584, 1, 96)


def test_parameter_counts_by_hand():
    """A small latent-MoE model with one layer of each MLA kind: every part counted by hand."""
    m = ModelSpec("tiny", 2, 1, 8, 2, 1, 64, 32, dispatch_hidden=48, attention="mla,gated-mla", heads=2,
                  kv_heads=2, head_dim=16, q_lora_rank=24, kv_lora_rank=8, qk_rope_dim=4, v_head_dim=16, vocab=100,
                  dense_ffn=96)
    mla = (64 * 24 + 24 * 2 * 20) + 64 * (8 + 4) + 8 * 2 * (16 + 16) + 2 * 16 * 64
    gated = mla + 64 * 2 * 16
    expert = 3 * 48 * 32
    dense = mla + gated + 1 * 3 * 64 * 32 + 64 * 8 + 3 * 64 * 96 + 2 * 64 * 48 + 2 * 2 * 64 + 2 * 100 * 64
    c = parameter_counts(m)
    assert c["routed_experts"] == 8 * expert and c["dense"] == dense
    assert c["total"] == dense + 8 * expert
    assert c["active_with_embedding"] == dense + 2 * expert and c["active"] == dense + 2 * expert - 100 * 64


def test_the_models_command_states_each_presets_parameters(capsys):
    import json

    from moonep_sim.cli import main

    assert main(["models", "--json"]) == 0
    listed = {d["name"]: d["parameters"] for d in json.loads(capsys.readouterr().out)}
    assert listed == {name: parameter_counts(m) for name, m in PRESETS.items()}
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "69 linear + 24 gated-mla" in out and "2.78T" in out and "104.2B" in out
