"""Topology presets and files, and the DeepEP calibration rows (simulated vs published)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.sim import Topology, calibrated_topology_path, list_topologies, load_topology
from moonep_sim.sim.topology import read_topology_file, topology_from_dict

REPO = Path(__file__).resolve().parents[1]


def test_presets_exist_with_documented_constants():
    assert set(list_topologies()) >= {"h800-cx7", "h100-cx7", "h20", "h200", "b200", "gb200-nvl72", "local-gloo"}
    h800 = load_topology("h800-cx7")
    # H800 NVLink: 400 GB/s bidirectional; DeepEP's "~160 GB/s" is what its kernels reach (the efficiency)
    assert (h800.gpus_per_node, h800.nvlink_bandwidth_GBps, h800.nic_bandwidth_GBps) == (8, 200.0, 50.0)
    assert load_topology("h200").nvlink_bandwidth_GBps == 450.0
    assert load_topology("h20").gpu_tflops == pytest.approx(148.0)
    nvl = load_topology("gb200-nvl72")
    assert nvl.gpus_per_node == 72 and nvl.nvlink_bandwidth_GBps == 900.0
    for name in list_topologies():
        t = load_topology(name)
        assert t.sources, f"{name} must cite its constants"
    assert "FITTED" in h800.sources["nvlink_efficiency"]


def test_gpu_presets_give_fp8_peak_and_hbm_capacity_with_sources():
    # datasheets: H800/H100 80 GB, H20 96 GB, H200 141 GB; FP8 dense = 2x BF16 dense on Hopper/Blackwell
    want = {"h800-cx7": 80.0, "h100-cx7": 80.0, "h20": 96.0, "h200": 141.0, "b200": 180.0, "gb200-nvl72": 186.0}
    for name, mem in want.items():
        t = load_topology(name)
        assert t.gpu_memory_GiB == mem, name
        assert t.gpu_tflops_fp8 == pytest.approx(2 * t.gpu_tflops, rel=1e-3), name
        assert t.sources["gpu_tflops_fp8"] and t.sources["gpu_memory_GiB"], name
    assert load_topology("h20").gpu_tflops_fp8 == 296.0
    gloo = load_topology("local-gloo")
    assert (gloo.gpu_tflops_fp8, gloo.gpu_memory_GiB) == (0.0, 0.0)  # not given on CPU processes


def test_toml_round_trip_and_override(tmp_path):
    t = load_topology("h800-cx7")
    f = tmp_path / "mine.toml"
    f.write_text(t.to_toml().replace("oversubscription = 1.0", "oversubscription = 2.0"))
    u = load_topology(str(f), gpus_per_node=4)
    assert u.fabric_oversubscription == 2.0 and u.gpus_per_node == 4
    assert {k: v for k, v in u.constants().items() if k not in ("fabric_oversubscription", "gpus_per_node")} == \
        {k: v for k, v in t.constants().items() if k not in ("fabric_oversubscription", "gpus_per_node")}


def test_local_gloo_prefers_the_calibrated_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_SIM_HOME", str(tmp_path))
    assert calibrated_topology_path() == tmp_path / "local-gloo.toml"
    default = load_topology("local-gloo")
    cal = Topology("local-gloo", gpus_per_node=64, nvlink_bandwidth_GBps=3.5, gpu_tflops=0.2)
    calibrated_topology_path().write_text(cal.to_toml())
    got = load_topology("local-gloo")
    assert got.nvlink_bandwidth_GBps == 3.5 != default.nvlink_bandwidth_GBps
    assert got.path == str(calibrated_topology_path())


@pytest.mark.parametrize("text, match", [
    ('name = "x"\n[nic]\nspeed = 3\n', r"\[nic\] key \('speed'\) must be one of"),
    ('name = "x"\n[nic]\nbandwidth_GBps = "fast"\n', r"\[nic\] bandwidth_GBps: expected a number, found 'fast'"),
    ('name = "x"\n[nvlink]\nefficiency = 1.5\n', r"nvlink_efficiency \(1.5\) must lie in \(0, 1\]"),
    ('[nic]\nbandwidth_GBps = 3\n', r"name must be given"),
    ('name = "x"\n[node\n', r"must be valid TOML"),
])
def test_bad_topology_files_fail_with_one_line(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_topology_file(f)


def test_unknown_topology_names_the_presets():
    with pytest.raises(ConfigError, match=r"topology \('nope'\) must be a preset \(.*h800-cx7"):
        load_topology("nope")
    with pytest.raises(ConfigError, match="must be one of name, description"):
        topology_from_dict({"name": "x", "bogus": 1})


def test_deepep_calibration_rows_within_20_percent():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from calibrate_deepep import PUBLISHED, simulate_row
    finally:
        sys.path.pop(0)
    for kind, R, pd, pc, _ in PUBLISHED:
        r = simulate_row(kind, R)
        assert abs(r["dispatch_GBps"] / pd - 1) <= 0.2, r
        assert abs(r["combine_GBps"] / pc - 1) <= 0.2, r


def test_cli_topologies_json(capsys):
    from moonep_sim.cli import main
    assert main(["topologies", "--json"]) == 0
    import json
    d = json.loads(capsys.readouterr().out)
    names = {t["name"] for t in d["topologies"]}
    assert "h800-cx7" in names and "sources" in d["topologies"][0]
