"""Calibration: fitting on synthetic measurements, the topology it writes, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.experiments import calibrate as cal


def synthetic(lat_us: dict[int, float], bw_gbps: dict[int, float], flops: dict[int, float], launch_us: float,
              noise: float = 0.0, seed: int = 0, cores: int = 4) -> dict:
    """Measurements drawn from the model the fit assumes (optionally with multiplicative noise)."""
    rng = np.random.default_rng(seed)
    a2a, comp, mem = [], [], []
    for P in lat_us:
        for m in (4096, 65536, 1 << 20, 4 << 20):
            t = lat_us[P] * 1e-6 + (P - 1) * m / (bw_gbps[P] * 1e9)
            a2a.append({"nproc": P, "bytes_per_peer": m, "seconds": list(t * (1 + noise * rng.standard_normal(7)))})
        for rows in (64, 256, 1024):
            f = 6 * rows * 512 * 1024
            t = launch_us * 1e-6 + f / flops[P]
            comp.append({"nproc": P, "rows": rows, "hidden": 512, "ffn": 1024, "flops": f,
                         "seconds": list(t * (1 + noise * rng.standard_normal(7)))})
        mem.append({"nproc": P, "bytes": 32 << 20, "seconds": [(32 << 20) / (5e9 / P)] * 3})
    plan = [{"seconds": [0.002, 0.001, 0.003]}]
    return {"alltoall": a2a, "swiglu": comp, "memcopy": mem, "planning": plan, "host": [{"cpu_cores": cores}]}


def test_fit_recovers_exact_constants():
    m = synthetic({2: 150.0, 4: 450.0}, {2: 1.5, 4: 0.75}, {2: 80e9, 4: 40e9}, launch_us=20.0)
    f = cal.fit(m)
    assert f.latency_us_P[2] == pytest.approx(150.0, rel=1e-6)
    assert f.latency_us_P[4] == pytest.approx(450.0, rel=1e-6)
    assert f.proc_gbps_P[2] == pytest.approx(1.5, rel=1e-6)
    assert f.proc_gbps_P[4] == pytest.approx(0.75, rel=1e-6)
    # latency(P) = base + per_peer * (P-1): 150 = b + p, 450 = b + 3p
    assert f.latency_per_peer_us == pytest.approx(150.0, rel=1e-6)
    assert f.latency_base_us == pytest.approx(0.0, abs=1e-6)
    # bandwidth model min(port, aggregate / P): port 1.5, aggregate 3.0
    assert f.port_gbps == pytest.approx(1.5)
    assert f.aggregate_gbps == pytest.approx(3.0)
    assert f.proc_gbps(8) == pytest.approx(3.0 / 8)
    assert f.flops_per_s_P[4] == pytest.approx(40e9, rel=1e-6)
    assert f.compute_flops_per_s == pytest.approx(40e9, rel=1e-6)
    assert f.compute_flops_per_s_alone == pytest.approx(80e9, rel=1e-6)
    assert f.launch_us_P[2] == pytest.approx(20.0, rel=1e-4)
    assert f.mem_gbps_P[2] == pytest.approx(2.5)
    assert f.plan_us == pytest.approx(2000.0)


def test_fit_is_robust_to_noise_and_outliers():
    m = synthetic({2: 200.0, 4: 600.0}, {2: 1.2, 4: 0.9}, {2: 60e9, 4: 30e9}, launch_us=50.0, noise=0.05, seed=3)
    # one wild repeat per record (a descheduled process): the median must ignore it
    for r in m["alltoall"] + m["swiglu"]:
        r["seconds"][0] *= 50
    f = cal.fit(m)
    assert f.proc_gbps_P[2] == pytest.approx(1.2, rel=0.1)
    assert f.proc_gbps_P[4] == pytest.approx(0.9, rel=0.1)
    assert f.latency_us_P[4] == pytest.approx(600.0, rel=0.15)
    assert f.flops_per_s_P[4] == pytest.approx(30e9, rel=0.1)


def test_fit_never_returns_negative_latency():
    # a measurement where small messages are *faster* per byte than the line: intercept would go < 0
    m = synthetic({2: 0.0, 4: 0.0}, {2: 1.0, 4: 1.0}, {2: 1e10, 4: 1e10}, launch_us=0.0)
    for r in m["alltoall"]:
        if r["bytes_per_peer"] == 4096:
            r["seconds"] = [s * 0.5 for s in r["seconds"]]
    f = cal.fit(m)
    assert min(f.latency_us_P.values()) >= 0
    assert all(np.isfinite(v) and v > 0 for v in f.proc_gbps_P.values())


def test_fit_needs_measurements():
    with pytest.raises(ConfigError, match="all-to-all measurements"):
        cal.fit({"alltoall": [], "swiglu": []})


def test_topology_written_from_fit_loads_in_the_simulator(tmp_path, monkeypatch):
    from moonep_sim.sim import topology as sim_topology

    m = synthetic({2: 150.0, 4: 450.0}, {2: 1.5, 4: 0.75}, {2: 80e9, 4: 40e9}, launch_us=20.0)
    f = cal.fit(m)
    topo = cal.local_gloo_topology(f, 4, (2, 4))
    path = tmp_path / "local-gloo.toml"
    path.write_text(topo.to_toml())
    back = sim_topology.read_topology_file(path)
    assert back.name == "local-gloo"
    assert back.nvlink_bandwidth_GBps == pytest.approx(0.75)
    # every hop of a 4-process job pays the latency measured with 4 processes, whatever its peers
    assert back.nvlink_latency_us == pytest.approx(450.0) and back.nic_latency_us == pytest.approx(450.0)
    assert back.host_message_us == 0.0
    # a target P between the measured ones: latency(P) = base + per_peer x (P-1) = 150 x 2
    assert cal.local_gloo_topology(f, 3, (2, 4)).nvlink_latency_us == pytest.approx(300.0)
    assert back.gpu_tflops * 1e12 == pytest.approx(40e9, rel=1e-4)
    assert back.gpu_slot_us == pytest.approx(20.0, rel=1e-3) and back.gpu_launch_us == 0.0
    assert back.plan_fixed_us == pytest.approx(2000.0)
    # measured at P=4: copy size rate x 2 (read + write traffic) / 2 (bf16 bytes)
    assert back.gpu_mem_bandwidth_GBps == pytest.approx(5.0 / 4)
    assert "calibrate" in back.sources["nvlink_bandwidth_GBps"]
    # the preset reads it from $MOONEP_SIM_HOME
    monkeypatch.setenv("MOONEP_SIM_HOME", str(tmp_path))
    assert sim_topology.load_topology("local-gloo").nvlink_bandwidth_GBps == pytest.approx(0.75)
    # for a process count between/beyond the measured ones, the bandwidth model is used
    t8 = cal.local_gloo_topology(f, 8, (2, 4))
    assert t8.nvlink_bandwidth_GBps == pytest.approx(f.proc_gbps(8), rel=1e-4)


def test_cpu_rates_are_written_per_core_with_the_sharing_and_row_passes(tmp_path):
    """With P processes on fewer cores, CPU rates measured all-at-once are de-shared (x P / cores) and
    the cores go into [host]; the simulator shares them among the busy ranks again, so 4 ranks
    computing at once on the written topology compute exactly as fast as measured with 4 processes."""
    m = synthetic({2: 150.0, 4: 450.0}, {2: 1.5, 4: 0.75}, {2: 80e9, 4: 40e9}, launch_us=20.0, cores=2)
    m["rowpass"] = [{"nproc": 4, "op": op, "bytes": 16 << 20, "seconds": [(16 << 20) / 0.5e9] * 3}
                    for op in ("gather", "scatter_add")]
    m["planning"] = [{"seconds": [0.003] * 3, "plan_seconds": [0.001] * 3}]
    m["memcopy"].append({"nproc": 4, "bytes": 32 << 20, "seconds": [(32 << 20) / 0.4e9] * 3, "fresh": True})
    f = cal.fit(m)
    assert f.mem_gbps_P[4] == pytest.approx(5.0 / 4) and f.fresh_copy_gbps_P[4] == pytest.approx(0.4)
    assert f.cpu_cores == 2 and f.share(4) == 2.0 and f.share(2) == 1.0
    assert f.rowpass_gbps_P[4] == pytest.approx(0.5)
    assert f.handle_us == pytest.approx(2000.0)
    topo = cal.local_gloo_topology(f, 4, (2, 4))
    assert topo.host_cores == 2.0 and topo.host_nodes_per_host == 0
    assert topo.gpu_tflops * 1e12 == pytest.approx(80e9, rel=1e-4)  # P=2 on 2 cores: a core each
    assert topo.gpu_slot_us == pytest.approx(20.0, rel=1e-3)  # from P=2 (no oversubscription)
    assert topo.gpu_padding_compute == 0.0
    assert topo.host_copy_bandwidth_GBps == pytest.approx(1.0)
    assert topo.plan_measured_factor == 1.0 and topo.plan_fixed_us == pytest.approx(2000.0)  # one process: per core
    assert topo.host_weight_copy_bandwidth_GBps == pytest.approx(0.8)  # 0.4 with 4 on 2 cores
    assert topo.nvlink_latency_us == pytest.approx(450.0) and topo.host_message_us == 0.0
    assert topo.nvlink_duplex == "half" and topo.plan_routing_bytes_per_entry == 16.0
    assert topo.host_R(4).tolist() == [0] * 4  # all ranks on this one machine
    from moonep_sim.sim.topology import read_topology_file
    back = read_topology_file(
        (tmp_path / "t.toml").write_text(topo.to_toml()) and tmp_path / "t.toml")
    assert back.host_copy_bandwidth_GBps == topo.host_copy_bandwidth_GBps and back.nic_duplex == "half"


def test_calibrate_cli_rejects_bad_input(capsys):
    assert main(["calibrate", "--nproc", "1"]) == 2
    assert "nproc (1) must lie in [2, 64]" in capsys.readouterr().err
    assert main(["calibrate", "--sizes", "4x"]) == 2
    assert "--sizes entry ('4x')" in capsys.readouterr().err
    assert main(["calibrate", "--sizes", "4K"]) == 2
    assert "at least two message sizes" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_measures_and_writes(tmp_path):
    """A real (tiny) calibration with 2 processes: sane positive constants, file written atomically."""
    out = tmp_path / "cal" / "local-gloo.toml"
    # the sizes 4096 x apart: the all-to-all's size dependence (the fitted bandwidth) is resolved even
    # when a loaded machine delays the small message's median by a few milliseconds
    res = cal.calibrate((2,), (4096, 16 << 20), ((64, 128, 256), (256, 128, 256)), repeats=3, out=out,
                        inner_flops=1e7)
    assert out.exists() and out.with_suffix(".measurements.json").exists()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".part")]
    f = res.fit
    assert f.proc_gbps_P[2] > 0 and np.isfinite(f.proc_gbps_P[2])
    assert f.flops_per_s_P[2] > 1e6
    assert {r["bytes_per_peer"] for r in res.measurements["alltoall"]} == {4096, 16 << 20}
