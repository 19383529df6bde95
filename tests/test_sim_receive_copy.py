"""DeepEP V1's receivers: the copy of the last dispatch chunk and the reduce of the last combine chunk.

A chunked kernel's receiving SMs copy (dispatch) or sum (combine) each arrived chunk as it arrives,
so only the last message's pass is exposed: ``channels x chunk`` rows of the hop's class
(``get_dispatch_config`` / ``get_combine_config``), at the kernel's SM rate. Closed forms of
``moonep_sim.sim.kernels.receive_copy_us`` / ``combine_reduce_us`` against the simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moonep_sim.models import custom_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.plan.kernel import FAMILIES, V1_CHUNKS, chunk_for
from moonep_sim.plan.kinds import Direction, PhaseKind
from moonep_sim.sim import SimOptions, load_topology, simulate_layer
from moonep_sim.sim.kernels import (combine_reduce_us, kernel_fixed_us, receive_copy_us, reduce_bytes_per_us,
                                    relay_hop_rows, sm_cap_bytes_per_us)
from moonep_sim.sim.program import combine_reduce_R, receive_copy_R
from ideal_topology import ideal_from_dict
from moonep_sim.strategies import PlanContext, make_plan

ROW = 1000


def _topo():
    """2 GPUs per node; NVLink 10 GB/s (1 us), NIC 2 GB/s (2 us); 100 SMs of 0.2 GB/s: a 24-SM kernel
    copies at 4.8 GB/s; HBM 1 TB/s (never binds)."""
    return ideal_from_dict({
        "name": "t", "node": {"gpus_per_node": 2},
        "nvlink": {"bandwidth_GBps": 10.0, "latency_us": 1.0, "efficiency": 1.0},
        "nic": {"bandwidth_GBps": 2.0, "latency_us": 2.0, "efficiency": 1.0}, "fabric": {"latency_us": 0.0},
        "gpu": {"mem_bandwidth_GBps": 1000.0, "mem_efficiency": 1.0},
        "kernel": {"dispatch_fixed_us": 7.0, "combine_fixed_us": 5.0, "relay_message_rows": 4},
        "sm": {"count": 100, "copy_GBps": 0.2}})


def _plan(dst_expert, rows, R, impl="deepep-v1"):
    ids = np.full((rows, 1), dst_expert, np.int64)
    toks = np.zeros(R, np.int64)
    toks[0] = rows
    g = GlobalRouting(ids, np.ones_like(ids, dtype=np.float32), toks, R)
    ctx = PlanContext(ClusterShape(R, 2), Placement.home_groups(R, R), RowCosts(ROW, ROW), 1)
    return make_plan("deepep", g, ctx, impl=impl)


def _iso(plan, topo, what="dispatch"):
    return simulate_layer(plan, topo, custom_model(plan.num_experts, 1), SimOptions(isolate=what, tol=0.0)).layer_time_us


def test_receive_copy_closed_form():
    """min(2 recv, 2 message) / rate: the whole hop when it is shorter than one message; arrays per rank."""
    assert receive_copy_us(100.0, 300.0, 10.0) == pytest.approx(20.0)
    assert receive_copy_us(500.0, 300.0, 10.0) == pytest.approx(60.0)
    np.testing.assert_allclose(receive_copy_us(np.array([0.0, 100.0, 500.0]), 300.0, 10.0), [0.0, 20.0, 60.0])
    assert receive_copy_us(500.0, 300.0, float("inf")) == 0.0 and receive_copy_us(500.0, 300.0, 0.0) == 0.0


@pytest.mark.parametrize("rows", [100, 400])
def test_one_v1_kernel_exposes_the_copy_of_its_last_chunk(rows):
    """deepep impl=deepep-v1, rank 0 -> rank 1 over NVLink (one node of 2; the plan's node hop is rank 0's
    own): 24 SMs = 12 channels, get_dispatch_config(2) sends NVLink chunks of 24 tokens, so the receiver's
    last message is 288 rows. Its copy (all the rows when the hop is shorter than one message) at the
    SM rate comes after the last rows arrived: the kernel is exactly that much longer than without it
    (the relay itself: tests/test_sim_closed_forms.py). None for deepep-v2 (its receivers leave the
    rows in the buffer for a copy epilogue, timed apart)."""
    topo = _topo()
    plan = _plan(1, rows, 2)
    spec = plan.kernel
    assert spec.recv_copy and FAMILIES["deepep-v1"].recv_copy
    m = relay_hop_rows(topo, spec, 2, "dispatch", False)
    assert m == 12 * chunk_for(V1_CHUNKS, 2).dispatch_nvl == 288
    rate = reduce_bytes_per_us(topo, spec)
    assert rate == sm_cap_bytes_per_us(topo, spec) == pytest.approx(4.8e3)
    copy = receive_copy_us(rows * ROW, m * ROW, rate)
    assert copy == pytest.approx(2 * min(rows, 288) * ROW / 4.8e3)
    pre = [p for p in plan.phases(Direction.FORWARD) if p.kind == PhaseKind.DISPATCH]
    np.testing.assert_allclose(receive_copy_R(plan, topo, pre), [0.0, copy])  # on the receiver only
    off = dataclasses.replace(plan, kernel=dataclasses.replace(spec, recv_copy=False))
    assert receive_copy_R(off, topo, pre) is None
    assert _iso(plan, topo) == pytest.approx(_iso(off, topo) + copy, rel=1e-9)
    assert _iso(off, topo) > kernel_fixed_us(topo, "dispatch", spec) + 1.0 + rows * ROW / 4.8e3 - 1e-9
    assert not _plan(1, rows, 2, impl="deepep-v2").kernel.recv_copy


def test_a_chunked_combine_reduces_its_channels_last_chunk_of_each_hop():
    """The relayed combine of 100 rows: rank 3 -> relay 2 (NVLink), relay 2 -> rank 0 (RDMA). V1 at 4
    ranks: 12 channels x get_combine_config(4)'s chunks, 9 NVLink / 6 RDMA tokens: the relay sums
    its 100 rows (read 100, write the 100 it sends: all of it, under one 108-row message), rank 0 the
    last 72 rows' message (2 x 72 rows); a family without a chunk table keeps the topology's 4-row message."""
    topo = _topo()
    plan = _plan(3, 100, 4)
    post = [p for p in plan.phases(Direction.FORWARD) if p.kind == PhaseKind.COMBINE]
    assert len(post) == 2
    c = chunk_for(V1_CHUNKS, 4)
    assert (c.combine_nvl, c.combine_rdma) == (9, 6)
    assert relay_hop_rows(topo, plan.kernel, 4, "combine", False) == 12 * 9
    assert relay_hop_rows(topo, plan.kernel, 4, "combine", True) == 12 * 6
    rate = reduce_bytes_per_us(topo, plan.kernel)
    got = combine_reduce_R(plan, topo, post)
    assert got[0][2] == pytest.approx(combine_reduce_us(100 * ROW, 100 * ROW, rate, "fused", 2 * 108 * ROW))
    assert got[0][2] == pytest.approx(200 * ROW / rate)
    assert got[1][0] == pytest.approx(combine_reduce_us(100 * ROW, 100 * ROW, rate, "fused", 2 * 72 * ROW))
    assert got[1][0] == pytest.approx(144 * ROW / rate)
    assert got[0][[0, 1, 3]].sum() == 0 and got[1][1:].sum() == 0
    unchunked = dataclasses.replace(plan, kernel=dataclasses.replace(plan.kernel, chunks=()))
    assert combine_reduce_R(unchunked, topo, post)[1][0] == pytest.approx(2 * 4 * ROW / rate)


def test_v1_ep16_receivers_expose_channels_times_the_ep16_chunks():
    """On the H800 preset at EP16, 24 SMs: the dispatch receiver's last message is 12 x 36 rows and the
    combine's last RDMA message 12 x 12 (against 12 x 6 and 12 x 4 at EP8, intranode): the terms
    that differ between the fitted EP8 row and the EP16 predictions."""
    t = load_topology("h800-cx7")
    plan = _plan(1, 1, 16)
    spec = dataclasses.replace(plan.kernel, sms=24)
    row = 7168 * (1 + 4 / 128)
    rate = reduce_bytes_per_us(t, spec)
    assert rate == pytest.approx(min(t.mem_bytes_per_us, 24 * t.sm_copy_GBps * 1e3))
    ep16 = receive_copy_us(1e12, relay_hop_rows(t, spec, 16, "dispatch", False) * row, rate)
    ep8 = receive_copy_us(1e12, relay_hop_rows(t, spec, 8, "dispatch", False) * row, rate)
    assert ep16 == pytest.approx(2 * 12 * 36 * row / rate) and ep8 == pytest.approx(2 * 12 * 6 * row / rate)
    assert relay_hop_rows(t, spec, 16, "combine", True) == 12 * 12
    assert relay_hop_rows(t, spec, 8, "combine", False) == 12 * 4
