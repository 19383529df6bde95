"""Closed forms per preset and per kernel family: one flow on every preset's NVLink and NIC, one
kernel of every family (``moonep_sim.plan.kernel.FAMILIES``) -- a relay for the normal families, a
train of one-row messages for the low-latency ones -- against ``moonep_sim.sim.kernels``."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moonep_sim.models import custom_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.plan.kernel import FAMILIES, chunk_for
from moonep_sim.sim import SimOptions, list_topologies, load_topology, simulate_layer
from moonep_sim.sim.kernels import kernel_fixed_us, message_us, nic_message_cost_us, receive_copy_us, reduce_bytes_per_us, \
    kernel_sms, proxy_nic_share, relay_hop_rows, relay_rows, relay_two_hop_us, sm_cap_bytes_per_us
from ideal_topology import ideal_from_dict
from moonep_sim.strategies import PlanContext, make_plan

ROW = 1000
MODEL = custom_model(4, 1)


def _plan(strategy, dst_expert, rows, R, G, **opts):
    ids = np.full((rows, 1), dst_expert, np.int64)
    toks = np.zeros(R, np.int64)
    toks[0] = rows
    g = GlobalRouting(ids, np.ones_like(ids, dtype=np.float32), toks, R)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(R, R), RowCosts(ROW, ROW), 1)
    return make_plan(strategy, g, ctx, **opts)


def _iso(plan, topo, what="dispatch"):
    return simulate_layer(plan, topo, custom_model(plan.num_experts, 1),
                          SimOptions(isolate=what, tol=0.0)).layer_time_us


GPU_PRESETS = [n for n in list_topologies() if n != "local-gloo"]


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_one_flow_on_every_presets_nvlink_and_nic(name):
    """Rank 0 sends 100 rows to rank 1 (same node) and, on a second plan, to rank 2 (other node, same
    rail): the fixed cost, the link's latency and the bytes at its effective rate -- a full-mesh
    preset's pair link (``nvlink_peer_GBps``) where it is below the GPU's whole NVLink port."""
    topo = load_topology(name).with_gpus_per_node(2)
    fixed = kernel_fixed_us(topo, "dispatch")
    nv = topo.nvlink_bytes_per_us
    if topo.nvlink_peer_GBps:
        nv = min(nv, topo.nvlink_peer_GBps * topo.nvlink_efficiency * 1e3)
    R = 2 if topo.nodes == 1 else 4
    one = _plan("alltoall", 1, 100, R, 2)
    assert _iso(one, topo) == pytest.approx(fixed + topo.nvlink_latency_us + 100 * ROW / nv, rel=1e-9)
    if topo.nodes == 1:
        return
    other = _plan("alltoall", 2, 100, 4, 2)
    want = fixed + topo.nic_latency_us + 100 * ROW / topo.nic_bytes_per_us
    assert _iso(other, topo) == pytest.approx(want, rel=1e-9)


def _topo(**tables):
    doc = {"name": "t", "node": {"gpus_per_node": 2},
           "nvlink": {"bandwidth_GBps": 10.0, "latency_us": 1.0, "efficiency": 1.0},
           "nic": {"bandwidth_GBps": 2.0, "latency_us": 2.0, "efficiency": 1.0},
           "fabric": {"latency_us": 0.0}, "planning": {"fixed_us": 0.0},
           "kernel": {"dispatch_fixed_us": 7.0, "combine_fixed_us": 5.0, "relay_message_rows": 4},
           "sm": {"count": 100, "copy_GBps": 0.2}}
    for k, v in tables.items():
        doc[k] = {**doc.get(k, {}), **v}
    return ideal_from_dict(doc)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.mode == "normal" or f.node_relay])
def test_one_relay_of_every_normal_family(name):
    """deepep impl=<family> (a node-relayed low-latency family: deepep-ll): 100 rows rank 0 -> relay 2
    (NIC) -> rank 3 (NVLink), forwarded in messages: the pipeline bound with each hop at min(link,
    the family's SM cap) and the family's per-message cost on the NIC hop (one per relayed message of
    ``relay_rows``); a proxy bound to one NIC per thread stretches the NIC hop by its busiest NIC."""
    topo = _topo()
    fam = FAMILIES[name]
    plan = _plan("deepep" if fam.mode == "normal" else "deepep-ll", 3, 100, 4, 2, impl=name)
    spec = plan.kernel
    row = plan.costs.dispatch_row_bytes
    assert plan.hops[0].rows_RR(4)[0, 2] == 100 and plan.hops[1].rows_RR(4)[2, 3] == 100
    cap = sm_cap_bytes_per_us(topo, spec)
    assert cap == pytest.approx(min(fam.sms, 100) * 0.2e3 * fam.sm_copy_factor)
    r0, r1 = min(2e3, cap), min(10e3, cap)
    m = relay_rows(topo, spec)
    # a chunked family (DeepEP V1) relays channels x its Config's chunk of each hop's class instead
    h0, h1 = relay_hop_rows(topo, spec, 4, "dispatch", True), relay_hop_rows(topo, spec, 4, "dispatch", False)
    # one RDMA write per relayed message; a chunked family: each of its channels (SMs x channels per
    # SM) sends its even share of the pair's rows in RDMA chunks (DeepEP's internode.cu)
    c = chunk_for(fam.chunks, 4)
    ch = max(1, math.floor(kernel_sms(topo, spec) * spec.channels_per_sm))
    msgs = math.ceil(100 / m) if c is None else ch * math.ceil(100 / (ch * c.dispatch_rdma))
    t0 = 100 * row / r0 / proxy_nic_share(topo, spec) + msgs * (topo.nic_message_us + spec.message_us)
    if fam.chunks:
        assert (h0, h1) == (ch * c.dispatch_rdma, ch * c.dispatch_nvl)  # DeepEP: 24 SMs, 12 channels
    else:
        assert h0 == h1 == m
    m0, m1 = message_us(topo, row, True, cap, h0), message_us(topo, row, False, cap, h1)
    want = kernel_fixed_us(topo, "dispatch", spec) + relay_two_hop_us(100 * row, 100 * row / t0, 2.0, 100 * row,
                                                                       r1, 1.0, m0, m1)
    # a family whose receivers copy each chunk into the output (DeepEP V1) exposes the last message's copy
    if fam.recv_copy:
        want += receive_copy_us(100 * row, h1 * row, reduce_bytes_per_us(topo, spec))
    assert _iso(plan, topo) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.mode == "ll" and not f.node_relay])
def test_one_kernel_of_every_low_latency_family(name):
    """deepep-ll impl=<family>: 10 one-row messages rank 0 -> rank 2 (other node): the family's fixed
    cost, the NIC latency and each row at the NIC rate plus the per-message cost (the NIC's message
    rate, the kernel's own and the family's)."""
    topo = _topo(kernel={"nic_message_us": 0.3}, nic={"rails_per_node": 1, "message_rate_Mps": 0.5})
    plan = _plan("deepep-ll", 2, 10, 4, 2, impl=name)
    spec = plan.kernel
    cost = nic_message_cost_us(topo, spec)
    assert cost == pytest.approx(max(0.3, 1 / (0.5 * 0.5)) + FAMILIES[name].message_us)  # 2 GPUs share 1 NIC
    row = plan.costs.dispatch_row_bytes
    want = kernel_fixed_us(topo, "dispatch", spec) + 2.0 + 10 * (row / 2e3 + cost)
    assert _iso(plan, topo) == pytest.approx(want, rel=1e-9)
    assert dataclasses.replace(spec, message_us=0.0) != spec or FAMILIES[name].message_us == 0


def test_one_rail_shared_by_two_gpus_carries_both_at_one_nics_rate():
    """4 GPUs per node on 2 NICs (a NIC per pair of GPUs): ranks 0 and 1 (one NIC) each send 100
    rows to node 1 -- together at one NIC's rate; ranks 0 and 2 (two NICs) each at a whole NIC."""
    topo = _topo(node={"gpus_per_node": 4}, nic={"rails_per_node": 2}, kernel={"dispatch_fixed_us": 0.0},
                 sm={"count": 0, "copy_GBps": 0.0})
    assert topo.nic_share == 2
    R, G = 8, 4

    def two_senders(a, b):
        ids = np.concatenate([np.full((100, 1), 4 + a, np.int64), np.full((100, 1), 4 + b, np.int64)])
        toks = np.zeros(R, np.int64)
        toks[a] = toks[b] = 100
        order = np.argsort(np.r_[np.full(100, a), np.full(100, b)], kind="stable")
        g = GlobalRouting(ids[order], np.ones((200, 1), np.float32), toks, R)
        ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(R, R), RowCosts(ROW, ROW), 1)
        return _iso(make_plan("alltoall", g, ctx), topo)

    assert two_senders(0, 1) == pytest.approx(2.0 + 200 * ROW / 2e3, rel=1e-9)   # one NIC for both
    assert two_senders(0, 2) == pytest.approx(2.0 + 100 * ROW / 2e3, rel=1e-9)   # a NIC each


def test_a_mesh_link_binds_one_pair_and_is_named_as_the_busiest_port():
    """mi300x-cx7: one GPU pair's traffic runs at its own 64 GB/s link (x efficiency), not the
    GPU's 448 GB/s port, and the report names that link; traffic to all 7 peers reaches the port."""
    topo = load_topology("mi300x-cx7")
    one = _plan("alltoall", 1, 100, 8, 8)
    res = simulate_layer(one, topo, custom_model(8, 1), SimOptions(isolate="dispatch", tol=0.0))
    assert res.busiest_port["name"] == "mesh0-1"
    ids = np.tile(np.arange(1, 8), 100)[:, None]
    toks = np.zeros(8, np.int64)
    toks[0] = ids.shape[0]
    g = GlobalRouting(ids, np.ones(ids.shape, np.float32), toks, 8)
    ctx = PlanContext(ClusterShape(8, 8), Placement.home_groups(8, 8), RowCosts(ROW, ROW), 1)
    fan = _iso(make_plan("alltoall", g, ctx), topo)
    fixed = kernel_fixed_us(topo, "dispatch")
    assert fan == pytest.approx(fixed + topo.nvlink_latency_us + 700 * ROW / topo.nvlink_bytes_per_us, rel=1e-9)
