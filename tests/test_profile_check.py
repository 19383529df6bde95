"""benchmarks/profile_check.py: the kernel classes of DeepSeek's H800 training profile (names by
hand) and the shipped per-class summary of the published profile (traces/profile_check_published.csv)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_check as pc  # noqa: E402


def test_kernel_names_fall_in_their_class():
    c = pc.classify
    assert c("void cutlass::device_kernel<dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c::GemmKernel>") == \
        "grouped GEMMs (fwd + dgrad)"
    assert c("void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_dptp128c_acc::GemmKernel>") == \
        "weight-gradient GEMMs"
    assert c("void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>") == "GEMMs (fwd + dgrad)"
    assert c("void dpsk::ep::internode::notify_dispatch<false, 8>(int const*)") == "dispatch"
    assert c("void dpsk::ep::internode::cached_notify<false>(int)") == "combine"
    assert c("void cuda::per_token_cast_to_fp8_with_channels<__nv_bfloat16, 128>") == "casts"
    assert c("void layer_norm::ln_fwd_kernel<...>") == "norms"
    assert c("rotary_kernel") == pc.OTHER


def test_shipped_summary_covers_every_kernel_of_the_profile_once():
    rows = list(csv.DictReader(open(ROOT / "traces" / "profile_check_published.csv")))
    classes = {r["class"] for r in rows}
    assert classes == {c for c, _ in pc.CLASSES} | {pc.OTHER, "wall span"}
    assert sum(int(r["kernels"]) for r in rows) == 963   # every kernel event of the trace, in one class
    span = float(next(r["us"] for r in rows if r["class"] == "wall span"))
    busy = sum(float(r["us"]) for r in rows if r["class"] != "wall span")
    assert busy > span   # the communication stream's kernels overlap the compute stream's


def test_pair_total_is_the_dualpipe_bound():
    cls = {c: 0.0 for c, _ in pc.CLASSES}
    cls.update({"GEMMs (fwd + dgrad)": 100.0, "dispatch": 30.0, "combine": 30.0})
    assert pc.pair_total(cls, 0.25) == 100.0 * (1 + 0.25 * 60 / 100)
    cls["dispatch"] = 500.0
    assert pc.pair_total(cls, 0.25) == 530.0
