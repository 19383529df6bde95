"""benchmarks/fidelity_serving.py: how a silicon-sample row becomes a deployment, and its decode
floor (three rows of AIConfigurator's public sample shipped under tests/data; no run of the
simulator: the bench's output is the results page)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")  # the optional 'measured' extra brings it; the bench reads CSVs with it

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent / "benchmarks"


@pytest.fixture
def fs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("fidelity_serving")


@pytest.fixture
def rows():
    return pd.read_csv(HERE / "data" / "silicon_sample_rows.csv").set_index("id", drop=False)


def test_rows_become_deployments(fs, rows):
    from moonep_sim.serve.deployment import deployment_from_dict

    agg = rows.loc["2026_03_25_deepseek_r1_b200_sxm_sglang_fp4_agg_1024x1024_c4_tp8_0_ep8_0_298"]
    p = fs._pool(agg, "", 4, "both")
    # SGLang's --tp 8 with EP8 and no DP attention: one attention rank of 8 GPUs running the 4 requests
    assert p["layout"] == {"tp": 8, "dp": 1, "ep": 8, "etp": 1, "dp_attention": False}
    assert p["max_running"] == 4
    dis = rows.loc["dsr1_gb200_trtllm_fp8_disagg_1024x1024_c3_cfg386"]
    pre, dec = fs._pool(dis, "prefill_", 3, "prefill"), fs._pool(dis, "decode_", 3, "decode")
    assert pre["layout"]["dp_attention"] and pre["layout"]["dp"] == 8 and pre["workers"] == 1
    assert dec["workers"] == 3 and dec["layout"]["tp"] == 8 and dec["max_running"] == 1
    d = deployment_from_dict({"prefill": pre, "decode": dec})
    assert d.gpus == 8 + 3 * 8


def test_decode_floor_hand_count(fs, rows):
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.models import get_model
    from moonep_sim.step.stack import dense_params

    r = rows.loc["2026_03_25_deepseek_r1_b200_sxm_sglang_fp4_agg_1024x1024_c4_tp8_0_ep8_0_298"]
    m, t = get_model("deepseek-v3"), load_topology("b200")
    # 4 sequences x top-8 over 256 experts: E/ep x (1 - (1 - 1/E)^32) experts active per GPU
    active = 256 / 8 * (1 - (1 - 1 / 256) ** 32)
    want = (sum(dense_params(m).values()) / 8 + m.moe_layers * active * 3 * m.dispatch_hidden * m.expert_ffn) \
        * 0.5 / (t.gpu_mem_bandwidth_GBps * 1e9) * 1e3    # an fp4 row: NVFP4 weights, 0.5 B
    assert fs.tpot_floor_ms(r) == pytest.approx(want)


def test_k_squared_record_of_a_k_gpu_deployment_is_read_as_its_id_names(fs, rows):
    # the sample records "tp8 ep8" deployments as tp (or attention dp) 64 with moe tp 8 x moe ep 8
    row = {"backend": "trtllm", "tp_size": 64.0, "attention_dp_size": 1.0, "moe_tp_size": 8.0, "moe_ep_size": 8.0}
    assert fs.read_layout(row) == (8, 1, 8, 1, True)
    assert fs.read_layout(dict(row, tp_size=1.0, attention_dp_size=64.0)) == (1, 8, 8, 1, True)
    assert fs.read_layout(dict(row, backend="sglang", tp_size=16.0, moe_tp_size=4.0, moe_ep_size=4.0)) == \
        (4, 1, 4, 1, True)
    # every other record as written: TP8 over moe tp 2 x moe ep 4 is 8 GPUs, expert TP 2
    assert fs.read_layout(dict(row, tp_size=8.0, moe_tp_size=2.0, moe_ep_size=4.0)) == (8, 1, 4, 2, False)
    # an id naming tp 4 over moe tp 2 x ep 2 is the 4-GPU deployment it says
    named = dict(row, id="qwen_x_h100_sxm_trtllm_agg_128x128_c16_tp4_epnone_16", tp_size=4.0, moe_tp_size=2.0,
                 moe_ep_size=2.0)
    assert fs.read_layout(named) == (4, 1, 2, 2, False)
    assert fs.read_layout(dict(named, id="x_c16_tp2_ep2_1")) == (2, 1, 2, 1, True)
    agg = rows.loc["2026_03_25_deepseek_r1_b200_sxm_sglang_fp4_agg_1024x1024_c4_tp8_0_ep8_0_298"]
    assert fs.read_layout(agg) == (8, 1, 8, 1, False)


def test_merged_grid_covers_every_rows_shapes(fs):
    g = fs.merge_grids([{"dec_T": [1, 2, 4], "dec_C": [1024, 1448, 2048], "pre_T": [16, 64, 256], "pre_C": [1024]},
                        {"dec_T": [1, 2, 4, 8, 16], "dec_C": [8192, 8688, 9216], "pre_T": [16, 64, 256, 1024],
                         "pre_C": [8192]}])
    assert g == {"dec_T": [1, 2, 4, 8, 16], "dec_C": [1024, 9216], "pre_T": [16, 64, 256, 1024],
                 "pre_C": [1024, 8192]}
