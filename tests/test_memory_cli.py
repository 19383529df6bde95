"""Precision flags of the step (--weight-dtype, --kv-dtype), the stored-bytes pricing of GEMMs,
and the verdict when no strategy fits."""

from __future__ import annotations

import json

import pytest

from moonep_sim.cli import main
from moonep_sim.experiments.verdict import step_verdict
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
