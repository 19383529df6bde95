"""Model terms a cluster of CPU processes needs (half-duplex pairs, CPU-core sharing, local row
passes, per-slot cost, skipped padding, measured planning): off on the GPU presets, and each one
changes a simulated time by the amount its definition says."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import random_routing
from moonep_sim.errors import ConfigError
from moonep_sim.models import custom_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.sim import SimOptions, Topology, list_topologies, load_topology, simulate_layer
from moonep_sim.sim.topology import topology_from_dict
from ideal_topology import ideal
from moonep_sim.strategies import PlanContext, make_plan

MODEL = custom_model(8, 2, hidden=256, expert_ffn=128, name="tiny-cpu")
# a plain topology: 1 GB/s links, no latency, very fast compute, so transfers dominate
BASE = ideal("t", gpus_per_node=4, nvlink_bandwidth_GBps=1.0, nvlink_latency_us=0.0, nic_bandwidth_GBps=1.0,
                nic_latency_us=0.0, fabric_latency_us=0.0, gpu_tflops=1e6, gpu_mem_bandwidth_GBps=1e6,
                gpu_launch_us=0.0, plan_fixed_us=0.0)


def uniform_plan(R: int, G: int = 4, T_per: int = 64, strategy: str = "alltoall", seed: int = 0, skew: float = 0.0,
                 **opts):
    ids, w = random_routing(T_per * R, MODEL.top_k, MODEL.num_experts, seed, skew)
    g = GlobalRouting.split_evenly(ids, w, MODEL.num_experts, R)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(MODEL.num_experts, R), RowCosts.from_model(MODEL), 1)
    return make_plan(strategy, g, ctx, **opts)


def exchange_plan():
    """Two ranks, each token of rank r routed to the other rank's experts only: a pure exchange."""
    T, E = 64, MODEL.num_experts
    ids = np.zeros((2 * T, 2), dtype=np.int64)
    ids[:T] = [E // 2, E // 2 + 1]   # rank 0's tokens -> rank 1's experts
    ids[T:] = [0, 1]                 # rank 1's tokens -> rank 0's experts
    w = np.full((2 * T, 2), 0.5, np.float32)
    g = GlobalRouting.split_evenly(ids, w, E, 2)
    ctx = PlanContext(ClusterShape(2, 2), Placement.home_groups(E, 2), RowCosts.from_model(MODEL), 1)
    return make_plan("alltoall", g, ctx)


def dispatch_us(plan, topo) -> float:
    return simulate_layer(plan, topo, MODEL, SimOptions(isolate="dispatch", tol=0.0)).layer_time_us


@pytest.mark.parametrize("name", [n for n in list_topologies() if n != "local-gloo"])
def test_gpu_presets_leave_every_cpu_term_off(name):
    t = load_topology(name)
    assert (t.nvlink_duplex, t.nic_duplex, t.nic_attach) == ("full", "full", "gpu")
    assert t.host_cores == 0 and t.host_copy_bandwidth_GBps == 0 and t.gpu_slot_us == 0
    assert t.host_message_us == 0
    assert t.gpu_padding_compute == 1 and t.plan_measured_factor == 0 and t.plan_routing_bytes_per_entry == 0
    assert t.host_R(16) is None and np.all(t.cpu_share_R(16) == 1.0)  # no shared cores: CPU work is a plain delay


def test_half_duplex_pair_halves_a_two_rank_exchange_but_not_a_uniform_all_to_all():
    plan = exchange_plan()
    full = dispatch_us(plan, BASE)
    half = dispatch_us(plan, replace(BASE, nvlink_duplex="half"))
    assert half == pytest.approx(2 * full, rel=1e-6)  # both directions share one pair's capacity
    assert dispatch_us(plan, replace(BASE, nic_duplex="half")) == pytest.approx(full)  # the pair is intra-node
    # four ranks, near-uniform: each port carries 3 flows, each pair 2 -> the ports bind, not the pairs
    # (only the unequal tail of random routing can feel them)
    u = uniform_plan(4)
    assert dispatch_us(u, BASE) <= dispatch_us(u, replace(BASE, nvlink_duplex="half")) <= 1.05 * dispatch_us(u, BASE)
    # across nodes (G=1) only the NIC class matters
    gap = replace(BASE, gpus_per_node=1)
    assert dispatch_us(plan, replace(gap, nic_duplex="half")) == pytest.approx(2 * dispatch_us(plan, gap), rel=1e-6)


def test_half_duplex_pair_scales_with_a_degraded_end():
    from moonep_sim.sim import DegradedLink
    plan = exchange_plan()
    topo = replace(BASE, nvlink_duplex="half")
    slow = simulate_layer(plan, topo, MODEL, SimOptions(isolate="dispatch", tol=0.0,
                                                        faults=(DegradedLink(1, 0.5, "nvlink"),))).layer_time_us
    assert slow == pytest.approx(2 * dispatch_us(plan, topo), rel=1e-6)


def test_static_sharing_stretches_cpu_work_by_ranks_over_cores():
    plan = uniform_plan(4, skew=2.0, seed=5)
    topo = replace(BASE, gpu_tflops=1e-3, gpu_mem_bandwidth_GBps=1e3)  # compute dominates
    alone = simulate_layer(plan, topo, MODEL).per_rank["compute_us"]
    shared = simulate_layer(plan, replace(topo, host_cores=2.0), MODEL).per_rank["compute_us"]
    assert replace(topo, host_cores=2.0).host_sharing == "static"  # the default
    assert np.allclose(np.array(shared), 2 * np.array(alone))  # every rank, busy or not, at half speed
    assert list(replace(topo, host_cores=8.0).cpu_share_R(4)) == [1.0] * 4  # more cores than ranks
    assert list(replace(topo, host_cores=1.0, gpus_per_node=2).cpu_share_R(6)) == [2.0] * 6  # a host per node
    assert list(replace(topo, host_cores=2.0, gpus_per_node=2, host_nodes_per_host=0).cpu_share_R(6)) == [3.0] * 6
    with pytest.raises(ConfigError, match=r"host sharing \('fair'\) must be one of static, processor"):
        replace(topo, host_sharing="fair")


def test_processor_sharing_gives_the_cores_to_the_busy_ranks_only():
    # compute dominates; near-instant links, so every rank starts computing at the same moment
    topo = replace(BASE, gpu_tflops=1e-3, gpu_mem_bandwidth_GBps=1e3, nvlink_bandwidth_GBps=1e6, nic_bandwidth_GBps=1e6,
                   host_sharing="processor")
    plan = uniform_plan(4, strategy="moonep")  # every rank computes exactly as many rows
    alone = simulate_layer(plan, topo, MODEL).per_rank["compute_us"]
    shared = simulate_layer(plan, replace(topo, host_cores=2.0), MODEL).per_rank["compute_us"]
    assert np.allclose(np.array(shared), 2 * np.array(alone), rtol=1e-6)  # 4 busy ranks on 2 cores: half speed
    # unequal ranks: processor sharing, worked by hand from each rank's own work
    hot = uniform_plan(4, skew=2.0, seed=5)
    w = np.sort(np.array(simulate_layer(hot, topo, MODEL).per_rank["compute_us"]))
    end = np.array(simulate_layer(hot, replace(topo, host_cores=2.0), MODEL).per_rank["compute_us"])
    assert w[-1] > w[0] * 1.2  # the routing is skewed
    want, t, left, n = [], 0.0, list(w), 4
    for i in range(4):  # jobs all start together (the dispatch ends together): finish in size order
        dt = (left[i] - (w[i - 1] if i else 0.0)) / min(1.0, 2.0 / n)
        t += dt
        want.append(t)
        n -= 1
    assert np.allclose(np.sort(end), want, rtol=1e-3)
    assert end.max() < 2 * w[-1]  # the hottest rank gets a core to itself once the others wait
    # which ranks share a host
    assert replace(topo, host_cores=8.0).host_R(4).tolist() == [0] * 4
    assert replace(topo, host_cores=1.0, gpus_per_node=2).host_R(6).tolist() == [0, 0, 1, 1, 2, 2]  # a host per node
    # every node on one host (nodes emulated on one machine): all 6 ranks share the 2 cores
    assert replace(topo, host_cores=2.0, gpus_per_node=2, host_nodes_per_host=0).host_R(6).tolist() == [0] * 6


def test_row_passes_add_the_gather_and_expand_time_to_a_hop():
    plan = exchange_plan()
    rate_GBps = 0.5
    topo = replace(BASE, host_copy_bandwidth_GBps=rate_GBps)
    got = dispatch_us(plan, topo) - dispatch_us(plan, BASE)
    # symmetric exchange: each rank gathers what it sends, then expands its final rows
    sent = plan.phases("forward")[0].bytes_RR.sum(axis=1)[0]
    final = plan.rows_R()[0] * plan.costs.dispatch_row_bytes
    assert got == pytest.approx((sent + final) / (rate_GBps * 1e3), rel=1e-6)
    # and the core sharing stretches them
    both = replace(topo, host_cores=1.0)
    assert dispatch_us(plan, both) - dispatch_us(plan, BASE) == pytest.approx(2 * got, rel=1e-6)


def test_slot_cost_and_skipped_padding():
    plan = uniform_plan(4, strategy="capacity", skew=2.0, seed=3)
    assert plan.padded > 0
    topo = replace(BASE, gpu_tflops=1e-3, gpu_mem_bandwidth_GBps=1e3)
    base_c = np.array(simulate_layer(plan, topo, MODEL).per_rank["compute_us"])
    skip = np.array(simulate_layer(plan, replace(topo, gpu_padding_compute=0.0), MODEL).per_rank["compute_us"])
    real_R = plan.real_rows_R()
    pad_R = plan.rows_R()
    assert np.allclose(skip, base_c * real_R / pad_R)
    slots_R = np.bincount(plan.slot_rank_S, weights=(plan.slot_padded_S > 0), minlength=4)
    with_slot = np.array(simulate_layer(plan, replace(topo, gpu_slot_us=100.0), MODEL).per_rank["compute_us"])
    assert np.allclose(with_slot - base_c, 100.0 * slots_R)


def test_measured_planning_and_routing_gather():
    plan = replace(uniform_plan(4), plan_seconds=0.002)
    r0 = simulate_layer(plan, BASE, MODEL).phases_us["plan"] if "plan" in \
        simulate_layer(plan, BASE, MODEL).phases_us else 0.0
    t = replace(BASE, plan_measured_factor=1.0, host_cores=2.0)
    assert simulate_layer(plan, t, MODEL).phases_us["plan"] == pytest.approx(r0 + 2000.0 * 2, rel=1e-6)
    routed = replace(BASE, plan_routing_bytes_per_entry=16.0)
    want = 3 * 64 * MODEL.top_k * 16.0 / 1e3  # x tokens of the largest rank x K x 16 B at 1 GB/s
    assert simulate_layer(plan, routed, MODEL).phases_us["plan"] == pytest.approx(want, rel=1e-6)


def test_node_attached_nic_lets_a_hot_rank_use_its_node_link():
    """Two nodes of 2 ranks: only rank 0 sends across. With a NIC per GPU it gets its own NIC;
    with one link per node (2 x the per-GPU bandwidth) it gets all of it; all ranks sending at
    once share the node link as the per-GPU NICs did."""
    T, E = 64, MODEL.num_experts
    ids = np.zeros((4 * T, 2), dtype=np.int64)
    ids[:, 0], ids[:, 1] = 0, 1                     # everyone to rank 0's experts (node 0) ...
    ids[:T] = [E - 2, E - 1]                         # ... except rank 0's tokens, to rank 3 (node 1)
    w = np.full((4 * T, 2), 0.5, np.float32)
    g = GlobalRouting.split_evenly(ids, w, E, 4)
    ctx = PlanContext(ClusterShape(4, 2), Placement.home_groups(E, 4), RowCosts.from_model(MODEL), 1)
    plan = make_plan("alltoall", g, ctx)
    gpu = replace(BASE, gpus_per_node=2)
    node = replace(gpu, nic_attach="node")
    b = plan.phases("forward")[0].bytes_RR.astype(float)
    node_R = np.arange(4) // 2
    x = b * (node_R[:, None] != node_R[None, :])  # inter-node bytes
    # per GPU: each rank's NIC carries its own inter-node bytes at 1 GB/s
    want_gpu = max(x.sum(axis=1).max(), x.sum(axis=0).max()) / 1e3
    # per node: a node's link (2 GB/s) carries all its ranks' inter-node bytes; one rank may use it all
    xn = np.array([[x[np.ix_(node_R == i, node_R == j)].sum() for j in range(2)] for i in range(2)])
    want_node = max(xn.sum(axis=1).max(), xn.sum(axis=0).max()) / 2e3
    t_gpu, t_node = dispatch_us(plan, gpu), dispatch_us(plan, node)
    assert t_gpu == pytest.approx(want_gpu, rel=1e-6) and t_node == pytest.approx(want_node, rel=1e-6)
    assert t_node < t_gpu
    res = simulate_layer(plan, node, MODEL, SimOptions(isolate="dispatch", tol=0.0))
    assert res.busiest_port["name"].startswith(("node", "rank"))


def test_message_cost_grows_with_the_peers_a_rank_sends_to():
    """A 4-rank all-to-all pays 3 messages per sender, a 2-rank exchange 1."""
    msg = 100.0
    u, x = uniform_plan(4), exchange_plan()
    t = replace(BASE, host_message_us=msg)
    assert dispatch_us(u, t) == pytest.approx(dispatch_us(u, BASE) + 3 * msg, rel=1e-6)
    assert dispatch_us(x, t) == pytest.approx(dispatch_us(x, BASE) + msg, rel=1e-6)


def test_toml_round_trip_and_bad_values(tmp_path):
    t = replace(BASE, nvlink_duplex="half", nic_duplex="half", nic_attach="node", host_cores=2.0,
                host_message_us=7.0, host_copy_bandwidth_GBps=3.0,
                gpu_slot_us=5.0, gpu_padding_compute=0.0, plan_measured_factor=1.0, plan_routing_bytes_per_entry=16.0)
    from moonep_sim.io import tomllib
    back = topology_from_dict(tomllib.loads(t.to_toml()), "x")
    assert replace(back, path="") == t
    with pytest.raises(ConfigError, match="nvlink_duplex .'quarter'. must be one of full, half"):
        topology_from_dict({"name": "x", "nvlink": {"duplex": "quarter"}})
    with pytest.raises(ConfigError, match=r"\[nic\] duplex: expected a string"):
        topology_from_dict({"name": "x", "nic": {"duplex": 1}})
    with pytest.raises(ConfigError, match="nic_attach .'rack'. must be one of gpu, node"):
        topology_from_dict({"name": "x", "nic": {"attach": "rack"}})
    with pytest.raises(ConfigError, match="padding_compute"):
        topology_from_dict({"name": "x", "gpu": {"padding_compute": 2.0}})


def test_weight_copies_pay_a_pass_at_the_home_and_at_the_receiver():
    plan = uniform_plan(4, strategy="moonep", skew=3.0, seed=5)
    pf = [p for p in plan.phases("forward") if p.kind == "prefetch"]
    assert pf and pf[0].bytes_RR.sum() > 0
    rate = 0.25
    no = simulate_layer(plan, BASE, MODEL, SimOptions(tol=0.0))
    yes = simulate_layer(plan, replace(BASE, host_copy_bandwidth_GBps=rate), MODEL, SimOptions(tol=0.0))
    recv_R = pf[0].bytes_RR.sum(axis=0)
    r = int(np.argmax(recv_R))
    # the receiver cannot start computing before the weights' arrival pass (and the home's gather)
    assert yes.per_rank["compute_start_us"][r] >= no.per_rank["compute_start_us"][r] + recv_R[r] / (rate * 1e3)
    assert yes.layer_time_us > no.layer_time_us
    # a slower rate for (fresh, large) weight buffers applies to them only
    slow_w = simulate_layer(plan, replace(BASE, host_copy_bandwidth_GBps=rate, host_weight_copy_bandwidth_GBps=rate / 4),
                            MODEL, SimOptions(tol=0.0))
    assert slow_w.per_rank["compute_start_us"][r] >= no.per_rank["compute_start_us"][r] + recv_R[r] / (rate / 4 * 1e3)


def test_a_degraded_node_link_names_a_rank_of_that_node():
    from moonep_sim.sim import DegradedLink
    plan = uniform_plan(4, G=2)
    topo = replace(BASE, gpus_per_node=2, nic_attach="node", nic_duplex="half", gpu_tflops=10.0)
    res = simulate_layer(plan, topo, MODEL, SimOptions(faults=(DegradedLink(2, 0.25, "nic"),
                                                               DegradedLink(3, 0.25, "nic"))))
    assert res.busiest_port["name"].startswith("node1.")
    assert res.straggler["rank"] in (2, 3) and res.straggler["cause"] == "slow port"


def test_point_to_point_hops_get_their_own_inter_node_efficiency():
    """With ``nic_p2p_efficiency`` the inter-node flows of a last hop the executor sends
    point-to-point move at that efficiency instead of ``nic_efficiency``; other hops do not."""
    from moonep_sim.plan.direct import last_hop_is_direct

    topo = replace(BASE, gpus_per_node=2, nic_efficiency=0.5)
    hier = uniform_plan(4, G=2, T_per=4096, strategy="hierarchical")
    assert last_hop_is_direct(hier, int(hier.costs.dispatch_row_bytes))  # few large runs: point-to-point
    slow = dispatch_us(hier, topo)
    fast = dispatch_us(hier, replace(topo, nic_p2p_efficiency=1.0))
    assert fast < slow
    # only the inter-node hop speeds up, and by no more than the efficiency ratio
    assert fast >= slow * 0.5 - 1e-6
    assert dispatch_us(hier, replace(topo, nic_p2p_efficiency=0.5)) == pytest.approx(slow)  # same figure: no change
    # a last hop with many small runs goes as one all_to_all_single: unchanged
    small = uniform_plan(4, G=2, T_per=16, strategy="hierarchical")
    assert not last_hop_is_direct(small, int(small.costs.dispatch_row_bytes))
    assert dispatch_us(small, replace(topo, nic_p2p_efficiency=1.0)) == pytest.approx(dispatch_us(small, topo))
    with pytest.raises(ConfigError, match=r"nic p2p_efficiency \(1.5\) must lie in \[0, 1\]"):
        replace(topo, nic_p2p_efficiency=1.5)
