"""deepep-ll: DeepEP's low-latency kernels as a Plan (row format, fixed buffers, kernel spec) and timed."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.models import get_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.plan.kernel import ALL_SMS
from moonep_sim.sim import SimOptions, load_topology, simulate_layer
from moonep_sim.strategies import PlanContext, make_plan
from moonep_sim.strategies.deepep_ll import ll_counted_bytes

M = get_model("deepseek-v3")


def _plan(R=16, T=32, seed=0, **opts):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((R * T, 256)), axis=1)[:, :8]
    g = GlobalRouting.split_evenly(ids, np.full(ids.shape, 0.125, np.float32), 256, R)
    ctx = PlanContext(ClusterShape(R, 8), Placement.home_groups(256, R), RowCosts.from_model(M, "bf16"), 1)
    return make_plan("deepep-ll", g, ctx, **opts), g


def test_every_selection_is_one_row_in_the_wire_format():
    plan, g = _plan()
    H = M.hidden
    assert plan.costs.dispatch_row_bytes == H + H // 128 * 4 + 16 and plan.costs.combine_row_bytes == 2 * H
    assert len(plan.hops) == 1 and plan.hops[0].src_rank_M.size == g.topk_ids_TK.size  # no dedup, no relay
    assert not plan.entry_dup_TK.any()
    assert ll_counted_bytes(plan) == g.topk_ids_TK.size * plan.costs.dispatch_row_bytes
    assert plan.kernel.sms == ALL_SMS and plan.kernel.row_messages and not plan.kernel.relay
    # fixed buffers: [local experts, max tokens x ranks] rows per rank
    np.testing.assert_array_equal(plan.capacity_R, np.full(16, (256 // 16) * 32 * 16))
    assert _plan(dispatch_dtype="bf16")[0].costs.dispatch_row_bytes == 2 * H + 16


def test_buffers_must_hold_the_largest_rank():
    with pytest.raises(ConfigError, match=r"max_tokens \(8\) must be >= the largest rank's token count \(32\)"):
        _plan(max_tokens=8)
    assert _plan(max_tokens=64)[0].capacity_R[0] == 16 * 64 * 16


def test_same_node_peers_over_nvlink_unless_pure_rdma():
    topo = load_topology("h800-cx7")
    fast, _ = _plan(R=8)
    rdma, _ = _plan(R=8, nvlink=False)
    t_nv = simulate_layer(fast, topo, M, SimOptions(isolate="dispatch"))
    t_rdma = simulate_layer(rdma, topo, M, SimOptions(isolate="dispatch"))
    assert "nvlink" in t_nv.busiest_port["name"] and "nic" in t_rdma.busiest_port["name"]
    assert t_rdma.layer_time_us > t_nv.layer_time_us
