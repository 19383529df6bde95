"""Topology presets and files, and the DeepEP calibration rows (simulated vs published)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.sim import Topology, calibrated_topology_path, list_topologies, load_topology
from moonep_sim.sim.topology import read_topology_file, topology_from_dict
from ideal_topology import ideal

REPO = Path(__file__).resolve().parents[1]


def test_presets_exist_with_documented_constants():
    assert set(list_topologies()) >= {"h800-cx7", "h100-cx7", "h20", "h200-cx7", "b200", "gb200-nvl72", "local-gloo",
                                      "mi300x-cx7", "mi350x", "h20-roce200", "h100-efa", "h200-efa"}
    h800 = load_topology("h800-cx7")
    # H800 NVLink: 400 GB/s bidirectional; DeepEP's "~160 GB/s" is what its kernels reach (the efficiency)
    assert (h800.gpus_per_node, h800.nvlink_bandwidth_GBps, h800.nic_bandwidth_GBps) == (8, 200.0, 50.0)
    assert load_topology("h200").nvlink_bandwidth_GBps == 450.0
    assert load_topology("h200") == load_topology("h200-cx7")  # the older name is an alias
    assert load_topology("h20").gpu_tflops == pytest.approx(148.0)
    nvl = load_topology("gb200-nvl72")
    assert nvl.gpus_per_node == 72 and nvl.nvlink_bandwidth_GBps == 900.0
    for name in list_topologies():
        t = load_topology(name)
        assert t.sources, f"{name} must cite its constants"
    assert "FITTED" in h800.sources["nvlink_efficiency"]


def test_gpu_presets_give_fp8_peak_and_hbm_capacity_with_sources():
    # datasheets: H800/H100 80 GB, H20 96 GB, H200 141 GB; FP8 dense = 2x BF16 dense on Hopper/Blackwell
    want = {"h800-cx7": 80.0, "h100-cx7": 80.0, "h20": 96.0, "h200": 141.0, "b200": 180.0, "gb200-nvl72": 186.0,
            "mi300x-cx7": 192.0, "mi350x": 288.0, "h20-roce200": 96.0, "h100-efa": 80.0, "h200-efa": 141.0}
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


def test_toml_round_trip_of_awkward_strings(tmp_path):
    t = replace(load_topology("h800-cx7"), description='a "quoted" C:\\path\nand a second line, µs',
                sources={"nic_bandwidth_GBps": 'ib_write_bw "-s 1M" \\ 2026', "gpu_tflops": "spec sheet"})
    f = tmp_path / "awkward.toml"
    f.write_text(t.to_toml(), encoding="utf-8")
    assert replace(load_topology(str(f)), path="") == replace(t, path="")


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


# -- class defaults, new presets, multi-rail NICs, message rates, NVLink domains ---------------------------
def test_class_defaults_are_the_h800_cx7_preset():
    """Issue 20: a Topology built in code is the h800-cx7 preset unless told otherwise."""
    preset = load_topology("h800-cx7")
    mine = Topology("h800-cx7", description=preset.description, sources=preset.sources, path=preset.path)
    assert mine == preset


def test_ideal_topology_turns_the_kernel_terms_off():
    t = ideal("t")
    assert (t.nvlink_efficiency, t.nic_efficiency, t.sm_count, t.kernel_dispatch_fixed_us) == (1.0, 1.0, 0, 0.0)
    assert ideal("t", nic_efficiency=0.5).nic_efficiency == 0.5


@pytest.mark.parametrize("name, rails, per_gpu_GBps, msg_us", [
    ("h100-efa", 32, 4 * 12.5, 1 / (10.0 * 4)),   # p5: 32 x 100 Gb/s rails, 4 per GPU
    ("h200-efa", 16, 2 * 25.0, 1 / (10.0 * 2)),   # p5en: 16 x 200 Gb/s rails, 2 per GPU
    ("h20-roce200", 0, 25.0, 0.0),                 # one 200 Gb/s RoCE NIC per GPU
    ("mi300x-cx7", 0, 50.0, 0.0),
])
def test_multi_rail_nics_join_into_one_port_per_gpu(name, rails, per_gpu_GBps, msg_us):
    t = load_topology(name)
    assert t.nic_rails_per_node == rails
    assert t.nic_bytes_per_us == pytest.approx(per_gpu_GBps * t.nic_efficiency * 1e3)
    assert t.nic_message_us == pytest.approx(msg_us)
    assert t.weights_nic_bytes_per_us == pytest.approx(t.nic_bytes_per_us)  # a weight copy uses every rail too


def test_fewer_rails_than_gpus_share_a_nic_and_rails_follow_the_node_size():
    t = Topology("four-nics", nic_rails_per_node=4)          # 8 GPUs, 4 NICs: pairs of GPUs share one
    assert (t.nics_per_gpu, t.nic_share) == (0.5, 2)
    assert t.nic_bytes_per_us == pytest.approx(50.0 * 0.9 * 1e3)  # each GPU may use all of its NIC
    efa = load_topology("h100-efa", gpus_per_node=4)         # a 4-GPU run keeps 4 NICs per GPU
    assert (efa.nic_rails_per_node, efa.nics_per_gpu) == (16, 4.0)
    with pytest.raises(ConfigError, match=r"nic rails_per_node \(3\) must be 0 \(one per GPU\), a multiple or a divisor"):
        Topology("bad", nic_rails_per_node=3)
    with pytest.raises(ConfigError, match=r"gpus_per_node \(3\) must keep a whole number of NICs per node"):
        t.with_gpus_per_node(3)


def test_mesh_and_single_node_presets():
    mi = load_topology("mi300x-cx7")
    assert mi.nvlink_peer_GBps == 64.0 and mi.nvlink_bandwidth_GBps == pytest.approx(7 * 64.0)
    m350 = load_topology("mi350x")
    assert m350.nodes == 1 and m350.nvlink_peer_GBps == pytest.approx(76.8)
    with pytest.raises(ConfigError, match=r"ranks \(16\) must be <= nodes x gpus_per_node \(1 x 8\)"):
        m350.num_nodes(16)


@pytest.mark.parametrize("ranks, g", [(64, 64), (72, 72), (128, 64), (144, 72), (256, 64), (8, 8)])
def test_nvl72_domains_hold_as_many_ranks_as_tile_the_run(ranks, g):
    assert load_topology("gb200-nvl72").gpus_per_node_for(ranks) == g


def test_every_preset_constant_is_marked_sourced_fitted_or_assumed():
    """The new presets say, for each cited constant, whether it is sourced, fitted (on which row) or assumed."""
    for name in ("mi300x-cx7", "mi350x", "h20-roce200", "h100-efa", "h200-efa"):
        for k, v in load_topology(name).sources.items():
            assert v.split(":")[0].split(" ")[0] in ("sourced", "FITTED", "assumed", "approximate", "one", "0"), (name, k, v)
