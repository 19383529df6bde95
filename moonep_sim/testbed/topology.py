"""The simulator topology that describes a testbed, so ``moonep-sim simulate`` predicts its runs.

- Intra-node (``[nvlink]``, ``[gpu]``, ``[planning]``): this machine's processes, taken from the
  calibrated ``local-gloo`` topology (``moonep-sim calibrate``) when it exists, else the
  ``local-gloo`` preset defaults: ranks of one node talk over that namespace's loopback exactly as
  the ``local-gloo`` ranks do.
- Inter-node (``[nic]``): a node's G ranks share its one shaped veth link: ``nic.attach = "node"``
  (one link of ``G x nic.bandwidth_GBps`` per node, shared max-min by the node's inter-node flows,
  any rank able to use all of it) with ``nic.bandwidth_GBps = rate / G``. ``nic.efficiency`` is what gloo gets of
  the tbf rate, measured by a uniform all-to-all across the nodes with the same G when the gloo
  probe ran (gloo's TCP pairs do not keep both directions of one pair busy at once: measured 0.46
  of the rate per direction with 1 rank per node, 0.73 with 2, 0.84 with 4, at 200 Mbit/s), else the
  TCP payload fraction (about 0.95), else 0.95. ``nic.latency_us`` is half the measured gloo
  point-to-point round trip (else the TCP one, else 200 us), or the intra-node hop latency when
  that is larger (a hop's fixed cost comes from the processes time-slicing this machine's cores).
  ``nic.p2p_efficiency`` is what one gloo ``send`` between two nodes gets of the rate (the probe's
  one-way transfer, about 0.97): the executor sends a last hop of few large runs point-to-point
  (``moonep_sim.plan.direct``), which gloo drives closer to the link rate than its
  ``all_to_all_single`` (about 0.8 at 200 Mbit/s).
- gloo's TCP pair is half duplex (one thread alternately writes and reads): the testbed sets
  ``nic.duplex = "half"``, so both directions of one rank pair share one link's rate.
  The probe's uniform all-to-all already feels this with 1 rank per node (each pair carries both
  directions: the model's own per-node rate is ``min(1, (N-1) G^2 / 2)`` of the full-duplex one),
  so ``nic.efficiency`` is the measured fraction divided by that (it is not counted twice).
- CPU: every emulated node runs on this one machine: ``[host] cores`` of the base topology (the
  calibrated cores of this machine) with ``nodes_per_host = 0`` (all N nodes on one host); the
  simulator shares those cores among the ranks busy at each moment (processor sharing).
- A degraded node (``--node-bandwidth i:RATE``) is not a topology constant (those are uniform):
  :func:`degraded_faults` gives the matching simulator faults, ``DegradedLink(rank, RATE / rate,
  "nic")`` for each of that node's ranks (CLI: ``--degrade-nic RANK:FACTOR``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moonep_sim.io import write_text_atomic
from moonep_sim.testbed.netns import TestbedSpec, format_rate

DEFAULT_NIC_EFFICIENCY = 0.95
DEFAULT_NIC_LATENCY_US = 200.0


def testbed_topology(spec: TestbedSpec, gpus_per_node: int, probes: dict | None = None, base: str | None = None):
    """A :class:`moonep_sim.sim.topology.Topology` for ``spec`` with G ranks per node (see module doc)."""
    from moonep_sim.sim.topology import load_topology

    probes = probes or {}
    b = load_topology(base or "local-gloo")  # the intra-node constants (local-gloo: the calibrated file if present)
    G = int(gpus_per_node)
    sources = {k: v for k, v in b.sources.items() if not k.startswith("nic")}
    eff, eff_src = DEFAULT_NIC_EFFICIENCY, "assumed: TCP payload over wire bytes at MTU 1500 (~0.95)"
    lat, lat_src = DEFAULT_NIC_LATENCY_US, "assumed"
    gl = probes.get("gloo") or {}
    tcp = (probes.get("tcp") or [{}])[0]
    if gl.get("a2a_node_bits_per_s"):
        half = uniform_half_duplex_fraction(int(gl.get("nodes", spec.nodes)), int(gl.get("gpus_per_node", G)))
        eff = min(1.0, gl["a2a_node_bits_per_s"] / spec.rate_bps / half)
        eff_src = (f"measured: gloo all_to_all_single across the testbed ({gl['nodes']} nodes x "
                   f"{gl['gpus_per_node']} ranks), {gl['a2a_node_bits_per_s'] / 1e6:.1f} Mbit/s per node "
                   f"and direction of a {format_rate(spec.rate_bps)} tbf link, divided by {half:g} (what "
                   f"half-duplex pairs alone leave of a uniform all-to-all in the model)")
    elif tcp.get("bits_per_s"):
        eff = min(1.0, tcp["bits_per_s"] / spec.node_rate(tcp.get("dst", 0)))
        eff_src = f"measured: one TCP stream, {tcp['bits_per_s'] / 1e6:.1f} Mbit/s payload"
    p2p_eff, p2p_src = 0.0, "not measured: the same as nic_efficiency"
    if gl.get("p2p_bits_per_s"):
        p2p_eff = round(min(1.0, gl["p2p_bits_per_s"] / spec.rate_bps), 4)
        p2p_src = (f"measured: a gloo send between two nodes, {gl['p2p_bits_per_s'] / 1e6:.1f} Mbit/s one way of a "
                   f"{format_rate(spec.rate_bps)} link (for the hops the executor sends point-to-point)")
    if gl.get("p2p_rtt_us"):
        lat, lat_src = gl["p2p_rtt_us"] / 2, "measured: half the gloo send/recv round trip of a 4-byte tensor"
    elif tcp.get("rtt_us_median"):
        lat, lat_src = tcp["rtt_us_median"] / 2, "measured: half the TCP 1-byte round trip"
    if b.nvlink_latency_us > lat:  # a hop across nodes costs at least what one within a node does
        lat, lat_src = b.nvlink_latency_us, (f"the intra-node hop latency of {b.name} ({lat_src}: "
                                             f"{lat:.0f} us, less)")
    sources.update({
        "nic_bandwidth_GBps": f"tbf rate {format_rate(spec.rate_bps)} per node and direction, shared by its "
                              f"{G} ranks: rate / 8 / G",
        "nic_efficiency": eff_src,
        "nic_latency_us": lat_src,
        "nic_p2p_efficiency": p2p_src,
        "testbed": f"{spec.nodes} network namespaces x {G} ranks; intra-node constants from {b.name} ({b.path or 'preset'})",
    })
    slow = {i: spec.node_rate(i) for i in range(spec.nodes) if spec.node_rate(i) != spec.rate_bps}
    if slow:
        sources["degraded_nodes"] = ", ".join(f"node {i}: {format_rate(r)} (use degraded_faults / --degrade-nic)"
                                              for i, r in slow.items())
    cores = b.host_cores
    sources["nic_attach"] = "node: the node's ranks share its one veth link (tbf)"
    sources["nic_duplex"] = "half: gloo's TCP pair carries one direction at a time (testbed probe: a 2-rank exchange " \
                            "gets ~0.5 of the link each way)"
    if cores:
        sources["host_cores"] = (f"{b.host_cores:g} cores of this machine ({b.name}) shared by "
                                          f"the {spec.nodes} emulated nodes")
    return replace(b, name=f"testbed-{spec.nodes}x{G}-{format_rate(spec.rate_bps)}",
                   description=f"Emulated testbed: {spec.nodes} nodes x {G} ranks, tbf {format_rate(spec.rate_bps)} "
                               f"per node link and direction",
                   gpus_per_node=G, nodes=spec.nodes,
                   nic_bandwidth_GBps=spec.rate_bps / 8 / 1e9 / G, nic_efficiency=round(eff, 4),
                   nic_p2p_efficiency=p2p_eff,
                   nic_latency_us=round(lat, 1), nic_duplex="half", nic_attach="node", fabric_oversubscription=1.0,
                   fabric_latency_us=0.0, host_cores=cores, host_nodes_per_host=0, sources=sources, path="")


def uniform_half_duplex_fraction(nodes: int, gpus_per_node: int) -> float:
    """What half-duplex pairs leave of a uniform all-to-all's per-node rate in the simulator: a node
    link C carries (N-1) G^2 flows out, each inter-node pair 2 flows (one per direction) on the
    same C, so a flow gets ``min(1/((N-1) G^2), 1/2)`` of it: ``min(1, (N-1) G^2 / 2)`` of the
    full-duplex rate (0.5 with one rank per node on 2 nodes, 1 from 2 ranks per node)."""
    G = max(gpus_per_node, 1)
    return min(1.0, max(nodes - 1, 1) * G * G / 2.0)


def degraded_faults(spec: TestbedSpec, gpus_per_node: int) -> tuple:
    """Simulator faults for the testbed's slower nodes: each of their ranks' NIC at RATE / rate.
    (A faster-than-default node cannot be expressed as a fault; it is left out.)"""
    from moonep_sim.sim.faults import DegradedLink
    out = []
    for i in range(spec.nodes):
        f = spec.node_rate(i) / spec.rate_bps
        if f < 1:
            out += [DegradedLink(i * gpus_per_node + g, f, "nic") for g in range(gpus_per_node)]
    return tuple(out)


def write_topology(path: str | Path, spec: TestbedSpec, gpus_per_node: int, probes: dict | None = None,
                   base: str | None = None) -> Path:
    """Write the testbed's topology TOML atomically; returns the path."""
    topo = testbed_topology(spec, gpus_per_node, probes, base)
    write_text_atomic(path, topo.to_toml())
    return Path(path)
