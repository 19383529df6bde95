"""benchmarks/profile_check.py: the kernel classes of DeepSeek's H800 training profile (names by
hand) and the shipped per-class summary of the published profile (traces/profile_check_published.csv)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

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


def test_barrier_kernels_are_their_own_class():
    c = pc.classify
    assert c("void dpsk::ep::internode::notify_dispatch<false, 8>(int const*)") in pc.WAIT_CLASSES
    assert c("void dpsk::ep::internode::cached_notify<false>(int)") in pc.WAIT_CLASSES
    assert c("void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*)") == "dispatch"
    assert c("void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*)") == "combine"


def test_pair_total_is_the_longer_stream():
    cls = {c: 0.0 for c, _ in pc.CLASSES}
    cls.update({"GEMMs (fwd + dgrad)": 100.0, "casts": 20.0, "dispatch": 30.0, "combine": 30.0,
                pc.WAIT_CLASSES[0]: 1e6, "_sources": {}})
    assert pc.pair_total(cls) == 120.0          # compute; the barriers' waits are not work
    cls["dispatch"] = 500.0
    assert pc.pair_total(cls) == 530.0          # communication longer than the compute


def test_structure_bytes_by_hand():
    """The norms: 4 RMSNorms per layer (7168, 1536, 512, 7168 wide), forward twice (recomputed)
    at 4 bytes per element, backward at 6."""
    from moonep_sim.models import get_model

    m = get_model("deepseek-v3")
    b = pc.structure_bytes(m, 4096, 32768.0)
    assert b["norms"] == 4096 * (7168 + 1536 + 512 + 7168) * (2 * 4 + 6)
    assert b["casts"] > 0 and b[pc.OTHER] > 0


@pytest.mark.slow
def test_the_simulated_chunk_pair_meets_the_profile_check_targets():
    """Against the shipped per-class summary of DeepSeek's H800 profile: every class within 20%
    (the barriers' waits are not simulated) and the chunk pair within 10%, with the measured GEMM
    tables (the check's three FITTED constants are named in benchmarks/profile_check.py)."""
    pytest.importorskip("aiconfigurator_core")
    rows = {r["class"]: float(r["us"]) for r in csv.DictReader(open(ROOT / "traces" / "profile_check_published.csv"))}
    sim = pc.simulated()
    for c, _ in pc.CLASSES:
        if c in pc.WAIT_CLASSES:
            continue
        assert sim[c] == pytest.approx(rows[c], rel=0.20), c
    assert sim[pc.OTHER] == pytest.approx(rows[pc.OTHER], rel=0.20)
    assert pc.pair_total(sim) == pytest.approx(rows["wall span"], rel=0.10)
