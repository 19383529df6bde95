"""Optimizer CPU offload (moonep_sim.step.offload): the optimizer state moved from HBM to the host
by hand count, the step's optimizer time in closed form, the node's host memory checked."""

from __future__ import annotations

import dataclasses

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.models import get_model
from moonep_sim.sim.topology import load_topology
from moonep_sim.step.memory import MemoryOptions, memory_for_layout
from moonep_sim.step.offload import (CPU_ADAM_BYTES_PER_PARAM, CPU_ADAM_MEM_EFFICIENCY, D2H_BYTES, GPU_ADAM_BYTES_PER_PARAM,
                                     H2D_BYTES, HOST_GRAD_BYTES, PCIE_EFFICIENCY, check_host, check_offload, host_check,
                                     optimizer_step_us)
from moonep_sim.step.parallel import Parallel
from moonep_sim.step.stack import step_shape

GiB = 2**30


def _mem(frac: float, par: Parallel, **kw):
    m = get_model("deepseek-v3")
    return memory_for_layout(m, step_shape(m, "train", 4096, 4096), par, [],
                             MemoryOptions(optimizer_offload=frac, **kw))


@pytest.mark.parametrize("par", [Parallel(pp=4, dp=2, ep=2, global_batch_size=8),
                                 Parallel(tp=2, pp=2, dp=4, ep=8, zero=2, global_batch_size=16)])
def test_offload_moves_the_optimizer_state_to_the_host_and_nothing_else(par):
    base, half, full = _mem(0.0, par), _mem(0.5, par), _mem(1.0, par)
    for s0, s5, s1 in zip(base["stages"], half["stages"], full["stages"]):
        opt = s0["parts"]["optimizer"]
        assert opt > 0 and s0["host_bytes"] == 0.0
        assert s1["parts"]["optimizer"] == 0.0
        assert s5["parts"]["optimizer"] == pytest.approx(opt / 2)
        # the host holds the offloaded parameters' state (12 B) and a pinned fp32 gradient copy (4 B)
        assert s1["host_bytes"] == pytest.approx(opt / 12 * (12 + HOST_GRAD_BYTES))
        assert s5["host_bytes"] == pytest.approx(s1["host_bytes"] / 2)
        for k in ("weights", "gradients", "activations", "buffers"):
            assert s1["parts"][k] == s0["parts"][k]
        assert s0["peak_bytes"] - s1["peak_bytes"] == pytest.approx(opt)
    assert full["host_bytes_per_gpu"] == max(s["host_bytes"] for s in full["stages"])
    assert "0.5 of it on the host" in half["assumptions"]


def test_offload_honours_the_optimizer_bytes_per_parameter():
    par = Parallel(pp=2, dp=4, ep=4, global_batch_size=8)
    eight = _mem(1.0, par, optimizer_bytes_per_param=8)
    base = _mem(0.0, par, optimizer_bytes_per_param=8)
    for s0, s1 in zip(base["stages"], eight["stages"]):
        assert s1["host_bytes"] == pytest.approx(s0["parts"]["optimizer"] / 8 * (8 + HOST_GRAD_BYTES))


def test_optimizer_step_time_closed_forms():
    topo = load_topology("h800-cx7")
    S, G = 3e9, 8
    hbm = topo.gpu_mem_bandwidth_GBps * topo.gpu_mem_efficiency * 1e3
    pcie = 64.0 * PCIE_EFFICIENCY * 1e3
    dram = 614.4 * CPU_ADAM_MEM_EFFICIENCY * 1e3
    none = optimizer_step_us(S, 0.0, topo, G)
    assert none["total_us"] == pytest.approx(S * GPU_ADAM_BYTES_PER_PARAM / hbm)
    assert (none["d2h_us"], none["cpu_us"], none["h2d_us"]) == (0.0, 0.0, 0.0)
    f = 0.75
    seq = optimizer_step_us(S, f, topo, G)
    d2h, h2d = f * S * D2H_BYTES / pcie, f * S * H2D_BYTES / pcie
    cpu = G * f * S * CPU_ADAM_BYTES_PER_PARAM / dram       # the node's 8 GPUs share its CPUs
    gpu = (1 - f) * S * GPU_ADAM_BYTES_PER_PARAM / hbm
    assert (seq["d2h_us"], seq["h2d_us"], seq["cpu_us"], seq["gpu_us"]) == pytest.approx((d2h, h2d, cpu, gpu))
    assert seq["total_us"] == pytest.approx(max(gpu, d2h + cpu + h2d))
    ovl = optimizer_step_us(S, f, topo, G, overlap=True)
    assert ovl["total_us"] == pytest.approx(max(gpu, d2h, cpu, h2d))
    assert ovl["total_us"] < seq["total_us"]
    # one GPU per node: its CPUs serve it alone
    assert optimizer_step_us(S, f, topo, 1)["cpu_us"] == pytest.approx(cpu / G)


def test_host_memory_of_a_node_is_checked():
    topo = load_topology("h800-cx7")
    assert topo.cpu_memory_GiB == 2048.0
    ok = host_check({"host_bytes_per_gpu": 256 * GiB}, topo, 8, 64)
    assert (ok["bytes_per_node"], ok["capacity_bytes_per_node"], ok["oom"]) == (2048 * GiB, 2048 * GiB, False)
    assert host_check({"host_bytes_per_gpu": 257 * GiB}, topo, 8, 64)["oom"] is True
    assert host_check({"host_bytes_per_gpu": 257 * GiB}, topo, 8, 4)["oom"] is False   # 4 GPUs of the node
    assert host_check({"host_bytes_per_gpu": 0.0}, topo, 8, 64)["oom"] is None


def test_offload_bad_input():
    for bad in (-0.1, 1.5, float("nan"), True, "1"):
        with pytest.raises(ConfigError, match="must lie in \\[0, 1\\]"):
            check_offload(bad)
    with pytest.raises(ConfigError, match="optimizer offload .* must lie in"):
        MemoryOptions(optimizer_offload=2.0)
    with pytest.raises(ConfigError, match="needs --mode train"):
        check_host(load_topology("h800-cx7"), 1.0, "decode")
    with pytest.raises(ConfigError, match="host side of topology b200 .*not given"):
        check_host(load_topology("b200"), 0.5, "train")
    check_host(load_topology("b200"), 0.0, "train")   # nothing offloaded: nothing to refuse
    no_host = dataclasses.replace(load_topology("h800-cx7"), cpu_memory_GiB=0.0)
    with pytest.raises(ConfigError, match="not given"):
        check_host(no_host, 1.0, "train")
