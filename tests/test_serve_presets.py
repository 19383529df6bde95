"""The Blackwell Ultra presets the silicon-sample rows need (b300: HGX B300 nodes of 8; gb300-nvl72:
GB300 NVL72 racks), against their datasheet / AIConfigurator system figures, and what serving reads
from them (KV capacity, the KV transfer over the NIC)."""

from __future__ import annotations

import pytest

from moonep_sim.models import get_model
from moonep_sim.serve.deployment import deployment_from_dict, kv_bytes_per_token, weight_bytes_per_gpu
from moonep_sim.sim import list_topologies, load_topology

GiB = 1024 ** 3


def test_blackwell_ultra_presets_carry_their_datasheet_figures():
    assert {"b200", "b300", "gb200-nvl72", "gb300-nvl72", "h100-cx7"} <= set(list_topologies())
    b300, gb300 = load_topology("b300"), load_topology("gb300-nvl72")
    # HGX B300: 8 GPUs a node, NVLink 5 at 900 GB/s a direction, one ConnectX-8 (800 Gb/s = 100 GB/s) per GPU
    assert (b300.gpus_per_node, b300.nvlink_bandwidth_GBps, b300.nic_bandwidth_GBps) == (8, 900.0, 100.0)
    # dense peaks (TFLOP/s): BF16 2,250, FP8 4,500, NVFP4 14,000; HBM 7.75 TB/s (62 TB/s over 8 GPUs)
    assert (b300.gpu_tflops, b300.gpu_tflops_fp8, b300.gpu_tflops_fp4) == (2250.0, 4500.0, 14000.0)
    assert b300.gpu_mem_bandwidth_GBps == 7750.0
    # nvidia-smi's 275,040 MiB and 284,208 MiB (AIConfigurator's mem_capacity), in GiB
    assert b300.gpu_memory_GiB == pytest.approx(275040 / 1024, abs=0.05)
    assert gb300.gpu_memory_GiB == pytest.approx(284208 / 1024, abs=0.05)
    # GB300 NVL72: one NVLink domain of 72; 360 PF FP8 and 1.1 EF FP4 dense a rack over 72 GPUs
    assert (gb300.gpus_per_node, gb300.nvlink_bandwidth_GBps, gb300.nic_bandwidth_GBps) == (72, 900.0, 100.0)
    assert gb300.gpu_tflops_fp8 == pytest.approx(360e3 / 72) and gb300.gpu_tflops_fp4 == pytest.approx(1.1e6 / 72,
                                                                                                        rel=0.02)
    assert gb300.gpus_per_node_for(128) == 64  # as GB200 NVL72: 2 racks of 64
    for t in (b300, gb300):
        assert t.gpu_tflops_fp8 == 2 * t.gpu_tflops
        for k in ("gpu_tflops", "gpu_tflops_fp8", "gpu_tflops_fp4", "gpu_memory_GiB", "gpu_mem_bandwidth_GBps",
                  "nic_bandwidth_GBps", "nvlink_bandwidth_GBps", "sm_count"):
            assert t.sources.get(k), (t.name, k)
        assert "ASSUMED" in t.sources["sm_count"]


def test_blackwell_ultra_presets_find_their_measured_tables_and_architecture():
    from moonep_sim.step.collectives import nvls_capable
    from moonep_sim.step.costs import fitted_constants
    from moonep_sim.step.fused_moe import arch_of
    from moonep_sim.step.measured import system_for

    assert system_for("b300") == ("b300_sxm", "own") and system_for("gb300-nvl72") == ("gb300", "own")
    for name in ("b300", "gb300-nvl72"):
        t = load_topology(name)
        assert arch_of(name) == "blackwell" and nvls_capable(t) == "blackwell"
        f = fitted_constants(name, "fp8")
        assert f is not None and "FITTED" in f["source"] and 0 < f["compute_efficiency"] < 1


def test_b300_holds_more_kv_than_b200_by_the_memory_left_after_weights():
    m = get_model("deepseek-v3")
    doc = {"worker": {"workers": 1, "layout": {"tp": 1, "dp": 8, "ep": 8, "dp_attention": True}}, "mem_fraction": 0.9}
    dep = deployment_from_dict(doc)
    lay = dep.pools[0].layout
    w, kv = weight_bytes_per_gpu(m, lay, 1.0), kv_bytes_per_token(m, lay, 2.0)
    for name in ("b200", "b300", "gb300-nvl72"):
        mem = load_topology(name).gpu_memory_GiB
        got = dep.check(m, mem)["both"]
        # the KV cache is what 0.9 of HBM leaves after the weights, in tokens of one attention rank (one GPU)
        assert got == pytest.approx((0.9 * mem * GiB - w) / kv, abs=16), name
    assert dep.check(m, load_topology("b300").gpu_memory_GiB)["both"] > 2 * dep.check(m, 180.0)["both"]


def test_kv_transfer_rides_the_800g_nic():
    from moonep_sim.experiments.serve import kv_transfer

    m = get_model("deepseek-v3")
    doc = {"prefill": {"layout": {"tp": 1, "dp": 8, "ep": 8, "dp_attention": True}},
           "decode": {"layout": {"tp": 1, "dp": 8, "ep": 8, "dp_attention": True}}}
    dep = deployment_from_dict(doc)
    per = kv_bytes_per_token(m, dep.pools[-1].layout, dep.kv_bytes)
    for name, gbps in (("b200", 50.0), ("b300", 100.0), ("gb300-nvl72", 100.0)):
        t = load_topology(name)
        x = kv_transfer(dep, m, t)
        assert x(1024) == pytest.approx(1024 * per / (gbps * t.nic_efficiency * 1e9) + t.nic_latency_us * 1e-6)
