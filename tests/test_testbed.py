"""The emulated multi-node testbed: command construction (no root needed) and, as root with
``ip netns``, a real 2-node run that must leave no namespace behind -- also after a failure."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moonep_sim.errors import CommError, ConfigError
from moonep_sim.testbed.netns import (LinkShape, TestbedSpec, format_rate, parse_node_rates, parse_rate,
                                      setup_commands)
from moonep_sim.testbed.run import LaunchSpec, _json_arg, node_env, torchrun_command

REPO = Path(__file__).resolve().parents[1]


def teardown_commands(spec: TestbedSpec) -> list[list[str]]:
    """Deleting the namespaces removes every veth, the bridge and the qdiscs with them."""
    return [["ip", "netns", "del", ns] for ns in reversed(spec.namespaces())]


def degrade_nic_args(spec: TestbedSpec, gpus_per_node: int) -> list[str]:
    """The ``moonep-sim simulate`` flags matching :func:`degraded_faults`."""
    from moonep_sim.testbed.topology import degraded_faults

    out: list[str] = []
    for f in degraded_faults(spec, gpus_per_node):
        out += ["--degrade-nic", f"{f.rank}:{f.factor:g}"]
    return out


# ---------------------------------------------------------------- pure: parsing and commands

@pytest.mark.parametrize("text, bps", [("1gbit", 10**9), ("200mbit", 2 * 10**8), ("500kbit", 5 * 10**5),
                                       ("1.5gbit", 15 * 10**8), (" 100MBIT ", 10**8)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps
    assert parse_rate(format_rate(bps)) == bps


@pytest.mark.parametrize("bad", ["fast", "100", "100mbps", "-5mbit", "10bit", "1000gbit"])
def test_parse_rate_rejects(bad):
    with pytest.raises(ConfigError, match=r"--bandwidth \(.*\) must be"):
        parse_rate(bad)


def test_parse_node_rates():
    assert parse_node_rates(["1:50mbit", "0:1gbit"], 2) == {1: 5 * 10**7, 0: 10**9}
    with pytest.raises(ConfigError, match=r"node \(2\) must be in \[0, 2\)"):
        parse_node_rates(["2:50mbit"], 2)
    with pytest.raises(ConfigError, match="must look like NODE:RATE"):
        parse_node_rates(["50mbit"], 2)


def test_tbf_shape_burst_and_args():
    slow, fast = LinkShape.for_rate(10**8), LinkShape.for_rate(10**10)
    assert slow.burst_bytes == 128 * 1024  # at least a GSO segment pair
    assert fast.burst_bytes == 10**10 // 8 // 1000  # 1 ms of line rate
    assert slow.tc_args() == ["tbf", "rate", "100000000bit", "burst", "131072", "latency", "100ms"]


def test_setup_commands_stay_inside_namespaces():
    spec = TestbedSpec(nodes=3, rate_bps=2 * 10**8, node_rate_bps={2: 5 * 10**7}, tag=4242)
    cmds = setup_commands(spec)
    assert spec.namespaces() == ["msim4242h", "msim4242n0", "msim4242n1", "msim4242n2"]
    assert cmds[:4] == [["ip", "netns", "add", ns] for ns in spec.namespaces()]
    # every other command names one of the testbed's namespaces: nothing runs in the caller's
    for c in cmds[4:]:
        assert c[1] == "-n" and c[2] in spec.namespaces(), c
    tbf = [c for c in cmds if c[0] == "tc"]
    assert len(tbf) == 6  # egress + ingress of 3 nodes
    rates = {(c[2], c[6]): c[c.index("rate") + 1] for c in tbf}
    assert rates[("msim4242n2", "eth0")] == "50000000bit" and rates[("msim4242h", "n2")] == "50000000bit"
    assert rates[("msim4242n0", "eth0")] == "200000000bit"
    addrs = [c[5] for c in cmds if c[3:5] == ["addr", "add"]]
    assert addrs == ["10.213.0.1/24", "10.213.0.2/24", "10.213.0.3/24"]
    assert teardown_commands(spec) == [["ip", "netns", "del", ns] for ns in reversed(spec.namespaces())]
    no_ingress = TestbedSpec(nodes=2, rate_bps=10**9, tag=1, shape_ingress=False)
    assert sum(c[0] == "tc" for c in setup_commands(no_ingress)) == 2


def test_spec_rejects_bad_values():
    with pytest.raises(ConfigError, match=r"--nodes \(0\) must be in \[1, 250\]"):
        TestbedSpec(nodes=0, rate_bps=10**9)
    with pytest.raises(ConfigError, match="subnet"):
        TestbedSpec(nodes=2, rate_bps=10**9, subnet="192.168.1")
    with pytest.raises(ConfigError, match="gpus-per-node"):
        LaunchSpec(0)


def test_torchrun_command_and_env():
    spec = TestbedSpec(nodes=2, rate_bps=10**9, tag=77)
    launch = LaunchSpec(4, module_args=("--trace", "t.safetensors", "--json", "/tmp/o.json"), master_port=29600)
    cmd = torchrun_command(spec, launch, 1)
    # inside the node's network namespace, as a job in its own PID namespace (it dies with the testbed)
    assert cmd[:9] == ["ip", "netns", "exec", "msim77n1", "unshare", "--pid", "--fork", "--kill-child=SIGKILL",
                       sys.executable]
    i = cmd.index("torch.distributed.run")
    opts = dict(zip(cmd[i + 1::2], cmd[i + 2::2]))
    assert opts["--nnodes"] == "2" and opts["--node-rank"] == "1" and opts["--nproc-per-node"] == "4"
    assert opts["--master-addr"] == "10.213.0.1" and opts["--master-port"] == "29600"
    assert cmd[cmd.index("-m", i) + 1] == "moonep_sim.experiments.ranks.replay_rank"
    assert _json_arg(launch.module_args) == "/tmp/o.json"
    env = node_env({"MASTER_ADDR": "1.2.3.4", "RANK": "3", "PATH": "/bin"})
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["OMP_NUM_THREADS"] == "1"
    assert "MASTER_ADDR" not in env and "RANK" not in env and env["PATH"] == "/bin"


def test_topology_matches_the_testbed():
    from moonep_sim.testbed.topology import degraded_faults, testbed_topology

    spec = TestbedSpec(nodes=2, rate_bps=2 * 10**8, node_rate_bps={1: 5 * 10**7}, tag=5)
    probes = {"gloo": {"a2a_node_bits_per_s": 1.5e8, "p2p_rtt_us": 400.0, "nodes": 2, "gpus_per_node": 2}}
    topo = testbed_topology(spec, 2, probes, base="local-gloo")
    assert (topo.nodes, topo.gpus_per_node) == (2, 2)
    assert topo.nic_bandwidth_GBps == pytest.approx(2e8 / 8 / 1e9 / 2)  # the node link shared by 2 ranks
    from moonep_sim.sim import load_topology as _load
    intra = _load("local-gloo").nvlink_latency_us  # a hop across nodes costs at least one within a node
    assert topo.nic_efficiency == pytest.approx(0.75) and topo.nic_latency_us == pytest.approx(max(200.0, intra), abs=0.1)
    assert [(f.rank, f.factor) for f in degraded_faults(spec, 2)] == [(2, 0.25), (3, 0.25)]
    assert degrade_nic_args(spec, 2) == ["--degrade-nic", "2:0.25", "--degrade-nic", "3:0.25"]
    no_probe = testbed_topology(spec, 2, {}, base="local-gloo")
    assert no_probe.nic_efficiency == pytest.approx(0.95)
    assert no_probe.nic_p2p_efficiency == 0.0 and topo.nic_p2p_efficiency == 0.0  # not probed: as nic_efficiency
    p2p = testbed_topology(spec, 2, {"gloo": {**probes["gloo"], "p2p_bits_per_s": 1.9e8}}, base="local-gloo")
    assert p2p.nic_p2p_efficiency == pytest.approx(0.95) and "gloo send" in p2p.sources["nic_p2p_efficiency"]
    # gloo's pairs are half duplex; this machine's cores are split over the emulated nodes
    from moonep_sim.sim import load_topology
    assert topo.nic_duplex == "half" and topo.nic_attach == "node"
    from moonep_sim.testbed.agreement import _node_of_port
    assert _node_of_port("node1.nic_out", 2) == 1 and _node_of_port("rank3.nic_out", 2) == 1
    assert topo.host_cores == load_topology("local-gloo").host_cores and topo.host_nodes_per_host == 0
    # one rank per node: the half-duplex pair alone explains 0.5 of a uniform all-to-all, so a probe
    # measuring 0.46 of the rate leaves an efficiency of 0.92 (not counted twice)
    g1 = {"gloo": {"a2a_node_bits_per_s": 0.46 * 2e8, "p2p_rtt_us": 400.0, "nodes": 2, "gpus_per_node": 1}}
    assert testbed_topology(spec, 1, g1, base="local-gloo").nic_efficiency == pytest.approx(0.92)


def test_cli_without_root_says_so(monkeypatch, capsys):
    from moonep_sim.cli import main
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    rc = main(["testbed", "cleanup"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "must run as root" in err[0]


# ---------------------------------------------------------------- root: a real testbed

def _netns_reason() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    if os.geteuid() != 0:
        return "needs root: network namespaces and tc qdiscs need CAP_NET_ADMIN"
    probe = f"msim{os.getpid()}probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns unavailable here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_REASON = _netns_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _burst_allowance(measured_bytes: int, burst_bytes: int, buckets: int = 1) -> float:
    """How far above the tbf rate a short transfer may measure: the bucket starts full, so its
    ``burst_bytes`` leave at once and ``measured_bytes`` take only (measured - burst) / rate.
    Payload bits/s <= rate * measured / (measured - burst) (payload < wire bytes only lowers it).
    E.g. 1 Gbit/s, burst 131072 B (128 KiB, ``LinkShape.for_rate``), 2 MiB: <= 1.067 Gbit/s. The
    TCP probe gets ``buckets=2``: its sink starts the clock at its first read, so up to another
    bucket's worth may already wait in the receive buffer (8 MiB: <= 1.032 Gbit/s)."""
    return measured_bytes / (measured_bytes - buckets * burst_bytes)


def _leftovers(spec: TestbedSpec) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in ns.splitlines() if ln.startswith(spec.prefix)] + \
           [ln for ln in links.splitlines() if spec.prefix in ln]


@pytest.mark.root
@pytest.mark.slow
@needs_netns
def test_two_node_replay_and_cleanup(tmp_path):
    from moonep_sim.testbed.run import run_testbed

    spec = TestbedSpec(nodes=2, rate_bps=10**9)
    out = tmp_path / "replay.json"
    args = ("--trace", str(REPO / "traces/olmoe-1b-7b_layer0.safetensors"), "--strategy", "alltoall",
            "--hidden", "16", "--ffn", "16", "--max-tokens", "64", "--iters", "1", "--warmup", "0",
            "--gpus-per-node", "1", "--quiet", "--json", str(out))
    seen = {}
    res = run_testbed(spec, LaunchSpec(1, module_args=args, timeout_s=120), probe_tcp=True,
                      on_ready=lambda tb: seen.update(ns=_leftovers(spec)),
                      topology_out=str(tmp_path / "topo.toml"))
    assert len(seen["ns"]) == 3  # hub + 2 nodes existed during the run
    assert res.replay["world_size"] == 2 and res.replay["correct"] is True
    assert res.replay["bytes_sent"] > 0
    tcp = res.probes["tcp"][0]
    # the upper bound is the shaping (tbf rate plus its bucket): a loaded machine only lowers the measured
    # rate, so no lower bound beyond a transfer that happened; that the link is shaped at the spec's rate
    # (not mis-shaped by an order of magnitude) is read from the qdisc node 0's bytes went through
    assert 0 < tcp["bits_per_s"] <= 1.0e9 * _burst_allowance(tcp["bytes"], spec.shape(0).burst_bytes, buckets=2)
    q = res.probes["qdisc"]["n0.egress"]
    assert "tbf" in q and "rate 1Gbit" in q, q
    assert int(re.search(r"Sent (\d+) bytes", q).group(1)) >= tcp["bytes"], q
    assert (tmp_path / "topo.toml").read_text().count("[nic]") == 1
    assert _leftovers(spec) == []


@pytest.mark.root
@pytest.mark.slow
@needs_netns
def test_gloo_probe_measures_rtt_all_to_all_and_rail_exchange(tmp_path):
    from moonep_sim.testbed.netns import Testbed
    from moonep_sim.testbed.run import measure_gloo

    spec = TestbedSpec(nodes=2, rate_bps=10**9)
    with Testbed(spec) as tb:
        g = measure_gloo(tb, 2, tmp_path, mbytes=2.0, reps=1)
    assert (g["world_size"], g["nodes"], g["gpus_per_node"]) == (4, 2, 2)
    assert g["p2p_rtt_us"] > 0
    # each measures 2 MiB per node link per direction (p2p: one 2 MiB message; all-to-all: 4 ranks x
    # 2 MiB x 2/4 off-node / 2 nodes; rail: the same bytes to one peer), each rep from a full bucket
    for key in ("p2p_bits_per_s", "a2a_node_bits_per_s", "rail_node_bits_per_s"):
        assert 0 < g[key] <= 1.0e9 * _burst_allowance(2 << 20, spec.shape(0).burst_bytes), key
    assert _leftovers(spec) == []


@pytest.mark.root
@pytest.mark.slow
@needs_netns
def test_failed_run_cleans_up(tmp_path):
    from moonep_sim.testbed.run import run_testbed

    spec = TestbedSpec(nodes=2, rate_bps=10**9)
    args = ("--trace", str(tmp_path / "missing.safetensors"), "--strategy", "alltoall", "--json",
            str(tmp_path / "o.json"))
    with pytest.raises(CommError, match=r"testbed node \d \(msim\d+n\d\) must exit 0"):
        run_testbed(spec, LaunchSpec(1, module_args=args, timeout_s=120), probe_tcp=False)
    assert _leftovers(spec) == []


@pytest.mark.root
@needs_netns
def test_interrupt_during_setup_cleans_up():
    from moonep_sim.testbed.netns import Testbed

    spec = TestbedSpec(nodes=2, rate_bps=10**9)

    class Boom(KeyboardInterrupt):
        pass

    def explode(tb):
        raise Boom()

    with pytest.raises(Boom):
        with Testbed(spec) as tb:
            assert len(_leftovers(spec)) == 3
            explode(tb)
    assert _leftovers(spec) == []
