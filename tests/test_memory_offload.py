"""Optimizer CPU offload (moonep_sim.step.offload): the optimizer state moved from HBM to the host
by hand count, the step's optimizer time in closed form, the node's host memory checked."""

from __future__ import annotations

import dataclasses

import numpy as np
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


# -- through the layout step, the search and the command ------------------------------------------------
def _olmoe(layers: int = 2):
    m = get_model("olmoe-1b-7b")
    return dataclasses.replace(m, name=f"olmoe-{layers}l", layers=layers, moe_layers=layers)


def test_layout_step_prices_the_offloaded_optimizer_step_and_its_host_memory():
    from moonep_sim.experiments.scenario import Scenario
    from moonep_sim.step.layout_step import GRAD_BUFFER_ZERO_BYTES_PER_PARAM, GRAD_NORM_BYTES_PER_PARAM, chunk_params

    m = _olmoe()
    sc = Scenario(routing="gen:model=olmoe-1b-7b,maxvio=0.5,tokens-per-rank=128,seed=3", model=m, cluster=(4, 4),
                  topology="h800-cx7", strategies="alltoall")
    p = Parallel(dp=4, ep=4)
    topo = load_topology("h800-cx7")
    dense, expert = chunk_params(m, 0, 2, True, True)
    shard = dense / 4 + expert / 4
    base = sc.step("train", parallel=p, context=128).figures["alltoall"]
    for frac, overlap in ((1.0, False), (0.5, True)):
        f = sc.step("train", parallel=p, context=128, optimizer_offload=frac, offload_overlap=overlap).figures["alltoall"]
        r0 = f["pipeline_ranks"][0]
        want = optimizer_step_us(shard, frac, topo, 4, overlap)
        # Megatron's gradient norm over the shard and the fp32 gradient buffer zeroed stay on the GPU
        around = (shard * GRAD_NORM_BYTES_PER_PARAM + (dense + expert / 4) * GRAD_BUFFER_ZERO_BYTES_PER_PARAM) / \
            (topo.gpu_mem_bandwidth_GBps * topo.gpu_mem_efficiency * 1e3)
        assert r0["optimizer_us"] == pytest.approx(want["total_us"] + around, rel=1e-12)
        assert r0["optimizer_offload"]["cpu_us"] == pytest.approx(want["cpu_us"])
        assert f["step_time_us"] - base["step_time_us"] == pytest.approx(want["total_us"] + around - base["pipeline_ranks"][0]
                                                                         ["optimizer_us"], rel=1e-9)
        host = f["memory"]["host_bytes_per_gpu"]
        assert host > 0 and f["host_memory"]["bytes_per_node"] == pytest.approx(4 * host)
        assert f["host_memory"]["oom"] is False
        assert f["memory"]["parts"]["optimizer"] == pytest.approx(base["memory"]["parts"]["optimizer"] * (1 - frac))


def test_host_memory_overflow_is_out_of_memory(tmp_path):
    from moonep_sim.experiments.scenario import Scenario

    small = dataclasses.replace(load_topology("h800-cx7"), name="tiny-host", cpu_memory_GiB=0.01)
    path = tmp_path / "tiny-host.toml"
    path.write_text(small.to_toml())
    sc = Scenario(routing="gen:model=olmoe-1b-7b,maxvio=0.5,tokens-per-rank=128,seed=3", model=_olmoe(),
                  cluster=(4, 4), topology=str(path), strategies="alltoall")
    f = sc.step("train", parallel=Parallel(dp=4, ep=4), context=128, optimizer_offload=1.0).figures["alltoall"]
    assert f["host_memory"]["oom"] is True and f["oom"] is True
    assert f["peak_memory_bytes"] < f["gpu_memory_bytes"]   # the GPU itself has room


def test_search_offloads_only_where_a_layout_needs_it(tmp_path):
    """olmoe-1b-7b (6.9B parameters) on 8 GPUs of 12 GiB: 18 B per parameter over 8 GPUs is 14.5 GiB
    before activations, so only offload fits; on the 80 GiB preset nothing is offloaded."""
    from moonep_sim.experiments.scenario import Scenario

    small = dataclasses.replace(load_topology("h800-cx7"), name="h800-12g", gpu_memory_GiB=12.0)
    path = tmp_path / "h800-12g.toml"
    path.write_text(small.to_toml())
    gen = "gen:model=olmoe-1b-7b,maxvio=0.5,seed=3"
    rep = Scenario(routing=gen, cluster=(8, 8), topology=str(path), strategies="alltoall").search_layouts(
        8, "train", seq=1024, recompute="full", zeros=(1,), schedules=("1f1b",))
    fits = [r for r in rep["rows"] if r["fits"]]
    assert fits and all(r["optimizer_offload"] > 0 for r in fits)
    assert all(r["host_memory_bytes_per_node"] > 0 for r in fits)
    assert any("OPTIMIZER CPU OFFLOAD" in f for f in rep["flags"])
    big = Scenario(routing=gen, cluster=(8, 8), topology="h800-cx7", strategies="alltoall").search_layouts(
        8, "train", seq=1024, recompute="full", zeros=(1,), schedules=("1f1b",))
    assert all(r["optimizer_offload"] == 0 for r in big["rows"] if r["fits"]) and big["fit"]


def test_no_fit_note_states_the_floor_with_offload():
    from moonep_sim.experiments.layout_search import no_fit_note
    from moonep_sim.step.layout_step import chunk_params

    m = get_model("kimi-k3")
    mem = MemoryOptions(recompute="full")
    shape_of = lambda p: step_shape(m, "train", 4096 * p.tp, 4096)
    par = Parallel(pp=8, dp=8, ep=8, global_batch_size=64)
    note = no_fit_note(m, 64, [(par, 1e12)], mem, 80 * GiB, shape_of, True, offload=1.0, host_cap=2048 * GiB,
                       gpus_per_node=8)
    params = sum(chunk_params(m, 0, m.layers, True, True))
    assert note["bytes_per_param"] == 2 + 4      # bf16 weights and fp32 gradients stay on the GPU
    assert note["floor_bytes"] == pytest.approx(params * 6)
    assert note["min_host_nodes"] == int(np.ceil(params * 16 / (2048 * GiB)))
    assert note["min_gpus"] == max(int(np.ceil(params * 6 / (80 * GiB))), 8 * note["min_host_nodes"])
    assert note["min_gpus"] > 64 and f"at least {note['min_gpus']} GPUs" in note["line"]
    assert "on the host" in note["line"] and "x 6 B that stay on the GPU" in note["line"]


@pytest.mark.parametrize("args, match", [
    (["--optimizer-offload-fraction", "1.5", "--dp", "4", "--ep", "4"], r"must lie in \[0, 1\]"),
    (["--optimizer-offload-fraction", "-1"], r"must lie in \[0, 1\]"),
    (["--optimizer-offload-fraction", "1", "--mode", "decode", "--dp", "4", "--ep", "4"], r"needs --mode train"),
    (["--optimizer-offload-fraction", "1", "--dp", "4", "--ep", "4", "--topology", "b200"],
     r"needs the host side of topology b200"),
    (["--optimizer-offload-fraction", "0.5"], r"needs a parallel layout"),
])
def test_bad_offload_flags_are_one_line(args, match, capsys):
    import re

    from moonep_sim import cli

    try:
        rc = cli.main(["step", "--gen", "model=olmoe-1b-7b,maxvio=1", "--strategies", "alltoall",
                       "--distinct-layers", "1"] + args)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err
