"""Precision flags of the step (--weight-dtype, --kv-dtype), the stored-bytes pricing of GEMMs,
and the verdict when no strategy fits."""

from __future__ import annotations

import json

import pytest

from moonep_sim.cli import main
from moonep_sim.analysis.verdict import step_verdict
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import CostModel
from moonep_sim.step.stack import Op

GEN = "model=deepseek-v3,maxvio=1.5,tokens-per-rank=128"


@pytest.mark.parametrize("flag,value,want", [
    ("--weight-dtype", "fp4", "--weight-dtype (nvfp4) needs FP4 support: topology h800-cx7"),
    ("--weight-dtype", "mxfp4", "--weight-dtype (mxfp4) needs FP4 support"),
    ("--weight-dtype", "int3", "--weight-dtype ('int3') must be one of bf16, fp16, fp32, fp8, mxfp4, nvfp4, fp4"),
    ("--kv-dtype", "fp32", "--kv-dtype ('fp32') must be one of"),
    ("--kv-dtype", "nvfp4", "--kv-dtype (nvfp4) needs FP4 support"),
])
def test_bad_dtypes_are_one_line(flag, value, want, capsys):
    code = main(["step", "--gen", GEN, "--ranks", "32", "--mode", "decode", flag, value, "--strategies", "alltoall",
                 "--distinct-layers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and want in err[0], err


def test_fp8_weights_halve_a_memory_bound_gemm():
    c2 = CostModel(load_topology("h800-cx7"))
    c8 = CostModel(load_topology("h800-cx7"), weight_bytes=1 + 4 / 16384)
    op = Op("attn_proj", "gemm", 2.0 * 4 * 10**8, 10**8 * 2.0, 4, "tokens=4")  # 4 rows: bound by the weights
    assert c8.op_us(op) == pytest.approx(c2.op_us(op) * (1 + 4 / 16384) / 2)


def test_deepseek_v3_decode_ep32_fits_with_fp8_weights(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["step", "--gen", GEN, "--ranks", "32", "--mode", "decode", "--strategies", "deepep-ll",
            "--distinct-layers", "1", "--out", str(out), "--no-plots"]
    assert main(args + ["--weight-dtype", "fp8"]) == 0
    doc = json.loads((out / "report.json").read_text())
    d = doc["strategies"]["deepep-ll"]
    assert d["oom"] is False and doc["setup"]["weight_dtype"] == "fp8"
    assert doc["verdict"]["winner"] == "deepep-ll"
    # bf16 weights: out of memory, no winner, and the smallest change that fits is named
    assert main(args[:-3] + ["--out", str(tmp_path / "b"), "--no-plots"]) == 0
    doc = json.loads((tmp_path / "b" / "report.json").read_text())
    v = doc["verdict"]
    assert doc["strategies"]["deepep-ll"]["oom"] and v["winner"] is None and v["no_fit"]
    assert v["fit"]["change"] == "fp8 weights" and v["fit"]["peak_bytes"] <= 80 * 2**30


def test_an_oom_strategy_never_wins():
    fits = {"step_time_us": 200.0, "oom": False, "peak_memory_bytes": 70e9, "gpu_memory_bytes": 80 * 2**30}
    oom = {"step_time_us": 100.0, "oom": True, "peak_memory_bytes": 90e9 * 2, "gpu_memory_bytes": 80 * 2**30}
    v = step_verdict({"a": fits, "b": oom})
    assert v["winner"] == "a" and v["mechanism"] == "memory"
    v = step_verdict({"a": {**fits, "oom": True, "peak_memory_bytes": 100e9}, "b": oom})
    assert v["winner"] is None and v["no_fit"] and "no strategy fits" in v["why"] and "a's" in v["why"]
    fit = {"change": "full recompute", "detail": "recompute none -> full", "peak_bytes": 60e9}
    v = step_verdict({"a": {**fits, "oom": True, "peak_memory_bytes": 100e9, "fit": fit}, "b": oom})
    assert "the smallest change that fits (a): full recompute (recompute none -> full): 55.9 GiB" in v["why"]


def test_mtp_tokens_per_step_and_bad_values():
    from moonep_sim.errors import ConfigError
    from moonep_sim.step.mtp import MTP

    assert MTP(1, 0.85).tokens_per_step == pytest.approx(1.85)
    assert MTP(3, 0.5).tokens_per_step == pytest.approx(1 + 0.5 + 0.25 + 0.125) and MTP(3, 0.5).verify_tokens == 4
    assert MTP(0).tokens_per_step == 1.0
    with pytest.raises(ConfigError, match=r"mtp depth \(9\) must be an integer in \[0, 8\]"):
        MTP(9)
    with pytest.raises(ConfigError, match=r"mtp acceptance \(0\) must lie in \(0, 1\]"):
        MTP(1, 0)


def test_mtp_decode_routes_the_drafts_and_adds_the_draft_layer(tmp_path):
    base = ["step", "--gen", "model=deepseek-v3,maxvio=1.5,tokens-per-rank=32", "--ranks", "32", "--mode", "decode",
            "--weight-dtype", "fp8", "--strategies", "alltoall", "--distinct-layers", "1", "--no-plots"]
    assert main(base + ["--out", str(tmp_path / "a")]) == 0
    assert main(base + ["--out", str(tmp_path / "b"), "--mtp-depth", "1", "--mtp-acceptance", "0.85"]) == 0
    a = json.loads((tmp_path / "a" / "report.json").read_text())["strategies"]["alltoall"]
    doc = json.loads((tmp_path / "b" / "report.json").read_text())
    b = doc["strategies"]["alltoall"]
    m = b["mtp"]
    assert m["tokens_per_step"] == pytest.approx(1.85) and doc["setup"]["mtp"]["sequences_per_rank"] == 32
    # twice the routed rows per rank (1 + 1 tokens per sequence), the same sequences' KV cache
    assert b["real_rows_per_rank"] == pytest.approx(2 * a["real_rows_per_rank"], rel=0.1)
    assert b["memory"]["parts"]["kv_cache"] == a["memory"]["parts"]["kv_cache"]
    assert b["peak_memory_bytes"] == pytest.approx(a["peak_memory_bytes"] + m["draft_weight_bytes"], rel=0.02)
    assert b["tokens_per_s_per_gpu"] == pytest.approx(32 * 1.85 / (b["step_time_us"] * 1e-6))
    assert b["step_time_us"] > a["step_time_us"] + m["draft_us"] * 0.99


@pytest.mark.parametrize("argv,want", [
    (["--mtp-depth", "-1"], "mtp depth (-1) must be an integer in [0, 8]"),
    (["--mtp-depth", "1", "--mtp-acceptance", "1.5"], "mtp acceptance (1.5) must lie in (0, 1]"),
    (["--mtp-depth", "2", "--mode", "train"], "--mtp-depth (2) needs --mode decode (mode train)"),
])
def test_bad_mtp_flags_are_one_line(argv, want, capsys):
    code = main(["step", "--gen", GEN, "--ranks", "32", "--mode", "decode", "--strategies", "alltoall",
                 "--distinct-layers", "1", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and want in err[0], err
