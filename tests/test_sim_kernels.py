"""GPU kernel terms (moonep_sim.sim.kernels): closed forms, presets, and the terms being off on CPU presets."""

from __future__ import annotations

import math

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.plan.kernel import ALL_SMS, KernelSpec
from moonep_sim.sim import load_topology
from moonep_sim.sim.kernels import (kernel_fixed_us, kernel_launches, kernel_sms, planning_us, relay_two_hop_us,
                                    sm_cap_bytes_per_us, weight_copy_us)
from ideal_topology import ideal_from_dict


def test_kernel_terms_are_off_on_the_cpu_preset():
    t = load_topology("local-gloo")
    assert (t.sm_count, t.kernel_dispatch_fixed_us, t.kernel_combine_fixed_us, t.kernel_relay_message_rows,
            t.kernel_nic_message_us, t.plan_per_entry_ns, t.plan_per_cell_ns) == (0, 0, 0, 0, 0, 0, 0)
    assert sm_cap_bytes_per_us(t, KernelSpec(sms=24)) == math.inf


def test_sm_cap_is_sms_times_rate_and_all_sms_means_the_gpu():
    t = ideal_from_dict({"name": "x", "sm": {"count": 100, "copy_GBps": 10.0}})
    assert sm_cap_bytes_per_us(t, KernelSpec(sms=24)) == pytest.approx(24 * 10.0 * 1e3)
    assert kernel_sms(t, KernelSpec(sms=ALL_SMS)) == 100
    assert kernel_sms(t, KernelSpec(sms=500)) == 100
    assert sm_cap_bytes_per_us(t, KernelSpec()) == math.inf and sm_cap_bytes_per_us(t, None) == math.inf


def test_fixed_costs_per_launch_and_relayed_plans_launch_once():
    t = ideal_from_dict({"name": "x", "kernel": {"dispatch_fixed_us": 30.0, "combine_fixed_us": 20.0}})
    assert (kernel_fixed_us(t, "dispatch"), kernel_fixed_us(t, "combine")) == (30.0, 20.0)
    assert kernel_launches(KernelSpec(relay=True), 2) == 1
    assert kernel_launches(KernelSpec(), 2) == 2 and kernel_launches(None, 0) == 0


def test_relay_closed_form_is_the_pipeline_bound():
    # equal stages: one message of the second stage after the first ends
    assert relay_two_hop_us(1000.0, 10.0, 1.0, 1000.0, 10.0, 2.0, 5.0, 5.0) == pytest.approx(1 + 100 + 2 + 5)
    # slow second stage: it starts one message late and runs whole
    assert relay_two_hop_us(1000.0, 100.0, 1.0, 1000.0, 10.0, 2.0, 0.5, 5.0) == pytest.approx(1 + 0.5 + 2 + 100)


def test_planning_grows_with_entries_and_cells():
    t = ideal_from_dict({"name": "x", "planning": {"fixed_us": 20.0, "per_entry_ns": 0.02, "per_cell_ns": 3.0}})
    assert planning_us(t, 65536, 256, 64) == pytest.approx(20 + 65536 * 0.02e-3 + 256 * 64 * 3e-3)


def test_weight_copy_closed_form_and_h800_epic_row():
    t = ideal_from_dict({"name": "x", "nvlink": {"bandwidth_GBps": 200.0, "latency_us": 2.0, "efficiency": 0.5},
                            "nic": {"bandwidth_GBps": 50.0, "latency_us": 4.0, "efficiency": 0.9},
                            "weights": {"nvlink_efficiency": 1.0}, "sm": {"count": 10, "copy_GBps": 10.0}})
    assert weight_copy_us(t, 42e6, False) == pytest.approx(2 + 42e6 / 200e3)
    assert weight_copy_us(t, 42e6, True) == pytest.approx(4 + 42e6 / 45e3)      # 0 = the NIC's efficiency
    assert weight_copy_us(t, 42e6, False, engine="sm", sms=5) == pytest.approx(2 + 42e6 / 50e3)
    h800 = load_topology("h800-cx7")
    assert weight_copy_us(h800, 42e6, False) == pytest.approx(210.0, rel=0.03)  # EPIC: fitted on this row


@pytest.mark.parametrize("doc, match", [
    ({"sm": {"count": 10, "copy_GBps": 0.0}}, r"sm count \(10\) and sm copy_GBps \(0.0\) must be both 0"),
    ({"weights": {"engine": "dma"}}, r"weights engine \('dma'\) must be one of copy_engine, sm"),
    ({"weights": {"engine": "sm"}}, r"weights sms \(0\) must be > 0"),
    ({"weights": {"nvlink_efficiency": 1.5}}, r"weights_nvlink_efficiency \(1.5\) must lie in \[0, 1\]"),
    ({"kernel": {"relay_message_rows": 1.5}}, r"relay_message_rows: expected an integer"),
])
def test_bad_kernel_constants_fail_with_one_line(doc, match):
    with pytest.raises(ConfigError, match=match):
        ideal_from_dict({"name": "x", **doc})


# -- the timeline against the closed forms (one flow, one kernel, one relay) ---------------------
import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

from moonep_sim.models import custom_model  # noqa: E402
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts  # noqa: E402
from moonep_sim.sim import SimOptions, simulate_layer  # noqa: E402
from moonep_sim.sim.kernels import message_us  # noqa: E402
from moonep_sim.strategies import PlanContext, make_plan  # noqa: E402

ROW = 1000  # bytes per row, dispatch and combine alike
MODEL = custom_model(4, 1)


def _topo(**tables):
    doc = {"name": "t", "node": {"gpus_per_node": 2},
           "nvlink": {"bandwidth_GBps": 10.0, "latency_us": 0.0, "efficiency": 1.0},
           "nic": {"bandwidth_GBps": 2.0, "latency_us": 0.0, "efficiency": 1.0},
           "fabric": {"latency_us": 0.0}, "planning": {"fixed_us": 0.0}}
    for k, v in tables.items():
        doc[k] = {**doc.get(k, {}), **v}
    return ideal_from_dict(doc)


def _plan(strategy, ids_T, tokens_per_rank, R=4, G=2, **opts):
    ids = np.asarray(ids_T, np.int64)[:, None]
    g = GlobalRouting(ids, np.ones_like(ids, dtype=np.float32), np.asarray(tokens_per_rank), 4)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(4, R), RowCosts(ROW, ROW), 1)
    return make_plan(strategy, g, ctx, **opts)


def _iso(plan, topo, what="dispatch"):
    return simulate_layer(plan, topo, MODEL, SimOptions(isolate=what, tol=0.0)).layer_time_us


def test_one_flow_is_capped_by_the_senders_sms():
    # rank 0 sends 100 rows to rank 1 (same node, NVLink 10 GB/s); a 2-SM kernel at 1 GB/s per SM
    plan = dataclasses.replace(_plan("alltoall", [1] * 100, [100, 0, 0, 0]), kernel=KernelSpec(sms=2))
    free = _iso(plan, _topo())
    capped = _iso(plan, _topo(sm={"count": 8, "copy_GBps": 1.0}))
    assert free == pytest.approx(100 * ROW / 10e3)
    assert capped == pytest.approx(100 * ROW / 2e3)
    # a Plan that declares no budget is not capped
    assert _iso(dataclasses.replace(plan, kernel=None), _topo(sm={"count": 8, "copy_GBps": 1.0})) == \
        pytest.approx(free)


def test_one_kernel_pays_its_fixed_cost_once_per_launch():
    kern = {"dispatch_fixed_us": 30.0, "combine_fixed_us": 20.0}
    one_hop = _plan("alltoall", [1] * 100, [100, 0, 0, 0])
    base_d, base_c = _iso(one_hop, _topo()), _iso(one_hop, _topo(), "combine")
    assert _iso(one_hop, _topo(kernel=kern)) == pytest.approx(base_d + 30.0)
    assert _iso(one_hop, _topo(kernel=kern), "combine") == pytest.approx(base_c + 20.0)
    # two hops as separate collectives pay it per hop; the relayed deepep kernel once
    two = _plan("hierarchical", [3] * 100, [100, 0, 0, 0])
    assert len(two.hops) == 2
    assert _iso(two, _topo(kernel=kern)) == pytest.approx(_iso(two, _topo()) + 60.0)
    relayed = _plan("deepep", [3] * 100, [100, 0, 0, 0])
    assert relayed.kernel.relay
    assert _iso(relayed, _topo(kernel=kern)) == pytest.approx(_iso(relayed, _topo()) + 30.0)


def test_kernels_without_a_planning_step_are_charged_no_planning():
    from moonep_sim.sim.program import planning_us as plan_step_us
    t = load_topology("h800-cx7")
    ll = _plan("deepep-ll", [1] * 100, [100, 0, 0, 0])
    assert ll.kernel is not None and not ll.kernel.planned
    assert plan_step_us(ll, t) == (0.0, 0.0)
    planned = _plan("deepep", [1] * 100, [100, 0, 0, 0])
    cpu_us, comm_us = plan_step_us(planned, t)
    assert cpu_us > 0 and comm_us > 0
    assert plan_step_us(dataclasses.replace(planned, kernel=KernelSpec(relay=True, planned=False)), t) == (0.0, 0.0)


def test_one_relay_forwards_as_rows_arrive():
    # rank 0 -> relay 2 (node 1, same local index: NIC 2 GB/s) -> rank 3 (NVLink 10 GB/s)
    plan = dataclasses.replace(_plan("deepep", [3] * 100, [100, 0, 0, 0]), kernel=KernelSpec(relay=True))
    assert [h.rows_RR(4)[0, 2] for h in plan.hops[:1]] == [100] and plan.hops[1].rows_RR(4)[2, 3] == 100
    lat = {"nvlink": {"latency_us": 1.0}, "nic": {"latency_us": 2.0}}
    sync = _iso(plan, _topo(**lat))
    assert sync == pytest.approx(2.0 + 100 * ROW / 2e3 + 1.0 + 100 * ROW / 10e3)
    topo = _topo(kernel={"relay_message_rows": 4}, **lat)
    m0, m1 = message_us(topo, ROW, True), message_us(topo, ROW, False)
    want = relay_two_hop_us(100 * ROW, 2e3, 2.0, 100 * ROW, 10e3, 1.0, m0, m1)
    assert _iso(plan, topo) == pytest.approx(want)
    assert want < sync
    # the slow stage second: combine runs the hops back (NVLink first, then the NIC)
    want_c = relay_two_hop_us(100 * ROW, 10e3, 1.0, 100 * ROW, 2e3, 2.0, m1, m0)
    assert _iso(plan, topo, "combine") == pytest.approx(want_c)


def test_cli_isolate_prints_the_kernel_counted_as_published(capsys):
    import json

    from moonep_sim.cli import main

    args = ["simulate", "--gen", "model=deepseek-v3,uniform=1,tokens-per-rank=64", "--strategy", "deepep",
            "--ranks", "16", "--dispatch-dtype", "fp8", "--isolate", "dispatch", "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    k = d["kernel"]
    assert k["kernel"] == "dispatch" and k["row_bytes"] == 7168 + 7168 // 128 * 4
    assert 0 < k["rank_mean_us"] <= k["span_us"] == pytest.approx(d["layer_time_us"])
    # DeepEP's internode count: unique (token, node) pairs, local node included (<= 2 nodes per token here)
    assert 64 * k["row_bytes"] <= k["node_pairs"] <= 2 * 64 * k["row_bytes"]
    assert k["node_pairs_GBps"] == pytest.approx(k["node_pairs"] / k["rank_mean_us"] / 1e3)
    assert main(args[:-1]) == 0
    assert "unique (token, node) pairs" in capsys.readouterr().out


def test_sm_bound_kernel_names_the_sm_port():
    plan = dataclasses.replace(_plan("alltoall", [1] * 100, [100, 0, 0, 0]), kernel=KernelSpec(sms=2))
    res = simulate_layer(plan, _topo(sm={"count": 8, "copy_GBps": 1.0}), MODEL, SimOptions(isolate="dispatch", tol=0.0))
    assert res.busiest_port["name"] in ("rank0.sm_send", "rank1.sm_recv")
    assert "sm_" in res.straggler["detail"]


def test_weight_copies_by_sms_are_slower_than_by_copy_engine_when_the_sms_bind():
    from moonep_sim.routing.generators import generate_layer
    from moonep_sim.models import custom_model

    m = custom_model(8, 2, hidden=512, expert_ffn=1024)
    lr = generate_layer(8, 2, 2048, 0, maxvio=3.0)
    g = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, 8, 2)
    ctx = PlanContext(ClusterShape(2, 2), Placement.home_groups(8, 2), RowCosts.from_model(m), 1)
    plan = make_plan("moonep", g, ctx, sms=0)
    assert plan.weight_copies > 0
    ce = _topo(weights={"nvlink_efficiency": 1.0}, sm={"count": 8, "copy_GBps": 0.5})
    sm = _topo(weights={"nvlink_efficiency": 1.0, "engine": "sm", "sms": 1}, sm={"count": 8, "copy_GBps": 0.5})
    t_ce = simulate_layer(plan, ce, m, SimOptions(tol=0.0)).phases_us["prefetch"]
    t_sm = simulate_layer(plan, sm, m, SimOptions(tol=0.0)).phases_us["prefetch"]
    # one SM at 0.5 GB/s against NVLink at 10 GB/s: 20 x slower per copy
    assert t_sm > 5 * t_ce


def test_cli_isolate_of_several_layers_is_one_line_before_any_work(capsys):
    from pathlib import Path

    from moonep_sim.cli import main

    trace = Path(__file__).resolve().parent.parent / "traces" / "mixtral-8x7b_humaneval.safetensors"
    rc = main(["simulate", "--trace", str(trace), "--layers", "0,1", "--strategy", "deepep", "--ranks", "8",
               "--isolate", "dispatch"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--isolate times one layer's kernel" in err


def test_ep16_diagnostic_own_rows_cancel_and_no_checked_limit_binds():
    """The fidelity report's EP16 section: a GPU's own rows are the same share of EP8's counted rows
    and of EP16's forwarded rows (DeepEP's routing spreads a token's experts evenly), so counting them
    on both sides leaves the forwarding-to-intranode ratio unchanged; the checked limits do not bind."""
    import sys
    from pathlib import Path
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        import fidelity_gpu as F
    finally:
        sys.path.remove(bench)
    from moonep_sim.sim import load_topology
    d = F.ep16_diagnostic({n: load_topology(n) for n in ("h800-cx7", "b200")})
    assert abs(d["own_share_ep8"] - 1 / 8) < 0.01 and abs(d["own_share_ep16"] - 1 / 8) < 0.01
    assert abs(d["own_rows_ratio"] / d["forward_vs_intranode"] - 1) < 0.01
    assert d["forward_vs_intranode"] < 0.95          # the miss the section explains
    assert d["forwarder_role_GBps"] < d["sm_role_cap_GBps"] and d["receiver_role_GBps"] < d["sm_role_cap_GBps"]
    assert d["forwarder_pair_GBps"] < d["forwarder_pair_cap_GBps"]
    assert d["intranode_pair_GBps"] < d["intranode_pair_cap_GBps"]
    assert d["rdma_window_bind_us"] > 10 * d["nic_latency_us"] and d["nvl_window_bind_us"] > 10 * d["nvlink_latency_us"]
    # (d) the priced chunking: channels x chunk rows of one hop, a little slower than unchunked relays
    assert d["chunk_dispatch_tail_us"] == pytest.approx(12 * 36 * F.H * (1 + 4 / 128) / 140e3, rel=0.01)
    assert d["dispatch_nocopy_GBps"] <= d["dispatch_unchunked_GBps"]
    assert d["combine_chunked_GBps"] < d["combine_unchunked_GBps"]
    # (e) the receivers' pass over the last chunk of every channel: 12 x 36 rows copied (12 x 6 at EP8)
    row, rate = F.H * (1 + 4 / 128), d["recv_rate_GBps"] * 1e3
    assert d["recv_copy_ep16_us"] == pytest.approx(2 * 12 * 36 * row / rate)
    assert d["recv_copy_ep8_us"] == pytest.approx(2 * 12 * 6 * row / rate)
    assert d["reduce_ep16_us"] == pytest.approx(2 * 12 * 12 * 2 * F.H / rate)
    assert d["dispatch_chunked_GBps"] < d["dispatch_nocopy_GBps"]
    # (f) wire metadata: internode rows carry less beyond the counted row than intranode's fitted one
    assert (d["meta_dispatch_ep8_bytes"], d["meta_dispatch_ep16_bytes"]) == (row + 100, 7472)
    assert d["meta_dispatch_time_factor"] < 1 and d["meta_combine_time_factor"] < 1
    # (g) the forwarders' start gate costs less than a microsecond beyond the model's head start
    assert 0 <= d["gate_meta_us"] - d["gate_local_us"] < 1.0
    # V2's SM90 EP 8x2 row is beyond an H800's NVLink under node-deduplicated forwarding
    assert d["v2_ep16_relay_nvlink_need_GBps"] > d["h800_nvlink_GBps_per_direction"]


# -- kernel families (moonep_sim.plan.kernel.FAMILIES): one kernel, one flow, one message each --------------
from moonep_sim.plan.kernel import FAMILIES, family, family_spec  # noqa: E402
from moonep_sim.sim.kernels import combine_reduce_us, nic_message_cost_us, reduce_bytes_per_us, relay_rows  # noqa: E402


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_plans_with_its_terms_and_sources(name):
    fam = FAMILIES[name]
    assert fam.sources["design"].startswith(("sourced:", "assumed, set from")), fam.sources["design"]
    plan = _plan("deepep" if fam.mode == "normal" else "deepep-ll", [1] * 10, [10, 0, 0, 0], impl=name)
    k = plan.kernel
    assert (k.family, k.sms, k.message_us, k.sm_copy_factor, k.reduce) == \
        (name, fam.sms, fam.message_us, fam.sm_copy_factor, fam.reduce)
    relayed = fam.mode == "normal" or fam.node_relay  # mori's low-latency kernel relays through one GPU per node
    assert k.relay == relayed and k.row_messages == (fam.mode == "ll" and not fam.node_relay)


def test_impl_of_the_wrong_mode_names_the_families_of_that_mode():
    with pytest.raises(ConfigError, match=r"option impl \('deepep-v1-ll'\) must be 'deepep-v1', 'deepep-v2', .* \(strategy deepep\)"):
        _plan("deepep", [1] * 10, [10, 0, 0, 0], impl="deepep-v1-ll")
    with pytest.raises(ConfigError, match=r"impl \('mori'\) must be one of .*\(the ll kernel families\)"):
        family("mori", "ll")


def test_one_kernel_pays_its_familys_fixed_cost_and_per_message_cost():
    """deepep-ll, rank 0 -> rank 2 (other node, NIC 2 GB/s), 10 rows: latency 0, so the dispatch is
    fixed + rows x (ROW / NIC rate + per-message cost) -- the per-message cost stretches the flow."""
    topo = _topo(kernel={"dispatch_fixed_us": 30.0, "nic_message_us": 0.5})
    base = _plan("deepep-ll", [2] * 10, [10, 0, 0, 0])
    row = base.costs.dispatch_row_bytes  # the FP8 row with its scales and header
    assert _iso(base, topo) == pytest.approx(30.0 + 10 * (row / 2e3 + 0.5))
    uccl = _plan("deepep-ll", [2] * 10, [10, 0, 0, 0], impl="uccl-ep-ll")
    fam = FAMILIES["uccl-ep-ll"]
    assert fam.extra_fixed_us > 0 and fam.message_us > 0
    assert _iso(uccl, topo) == pytest.approx(30.0 + fam.extra_fixed_us + 10 * (row / 2e3 + 0.5 + fam.message_us))
    own = dataclasses.replace(base, kernel=dataclasses.replace(base.kernel, dispatch_fixed_us=5.0))
    assert _iso(own, topo) == pytest.approx(5.0 + 10 * (row / 2e3 + 0.5))


def test_one_rail_limit_the_nics_message_rate_bounds_one_row_messages():
    """8 NICs of 1 GB/s for 2 GPUs per node: each GPU's port is 4 GB/s, and at a message rate of 0.1
    per us per NIC each row message costs 1 / (0.1 x 4 NICs per GPU) = 2.5 us."""
    topo = _topo(nic={"bandwidth_GBps": 1.0, "rails_per_node": 8, "message_rate_Mps": 0.1})
    assert topo.nics_per_gpu == 4 and topo.nic_message_us == pytest.approx(2.5)
    flow = _plan("alltoall", [2] * 100, [100, 0, 0, 0])
    assert _iso(flow, topo) == pytest.approx(100 * ROW / 4e3)          # 4 NICs joined, no per-message cost
    ll = _plan("deepep-ll", [2] * 10, [10, 0, 0, 0])
    assert nic_message_cost_us(topo, ll.kernel) == pytest.approx(2.5)
    assert _iso(ll, topo) == pytest.approx(10 * (ll.costs.dispatch_row_bytes / 4e3 + 2.5))


def test_one_reduce_after_the_rows_arrive_reads_them_and_writes_the_sums():
    """deepep-ll combine of one token with 2 experts on rank 1 (experts 2, 3: other node, NIC 2 GB/s):
    rank 1 sends 2 rows back, rank 0 reads both and writes one -- at HBM (1 GB/s here, no SM cap binds)."""
    sm = {"count": 100, "copy_GBps": 100.0}
    topo = _topo(sm=sm, gpu={"mem_bandwidth_GBps": 1.0, "mem_efficiency": 1.0})
    g = GlobalRouting(np.array([[2, 3]]), np.ones((1, 2), np.float32), np.array([1, 0, 0, 0]), 4)
    ctx = PlanContext(ClusterShape(4, 2), Placement.home_groups(4, 4), RowCosts(ROW, ROW), 1)
    plan = make_plan("deepep-ll", g, ctx, nvlink=True)
    assert plan.kernel.reduce == "after"
    rate = reduce_bytes_per_us(topo, plan.kernel)
    assert rate == pytest.approx(1e3)
    want = 2 * ROW / 2e3 + combine_reduce_us(2 * ROW, ROW, rate, "after")   # 2 rows over the NIC, then the pass
    assert _iso(plan, topo, "combine") == pytest.approx(want)
    assert combine_reduce_us(2 * ROW, ROW, rate, "after") == pytest.approx(3.0)
    # fused (the normal kernels): only the last message's reduce, 2 x relay rows x row at most
    assert combine_reduce_us(2 * ROW, ROW, rate, "fused", tail_bytes=ROW) == pytest.approx(1.0)
    # pplx: one message per (token, rank): a token's two experts on rank 2 take one row, not two
    g8 = GlobalRouting(np.array([[4, 5]]), np.ones((1, 2), np.float32), np.array([1, 0, 0, 0]), 8)
    ctx8 = PlanContext(ClusterShape(4, 2), Placement.home_groups(8, 4), RowCosts(ROW, ROW), 1)
    assert int(make_plan("deepep-ll", g8, ctx8, impl="pplx").hops[0].src_rank_M.size) == 1
    assert int(make_plan("deepep-ll", g8, ctx8).hops[0].src_rank_M.size) == 2


def test_family_sm_rate_factor_scales_the_sm_cap():
    topo = _topo(sm={"count": 8, "copy_GBps": 1.0})
    v2 = family_spec(FAMILIES["deepep-v2"], sms=2, relay=True)
    assert sm_cap_bytes_per_us(topo, v2) == pytest.approx(2 * 1.0 * 1e3 * FAMILIES["deepep-v2"].sm_copy_factor)
    plan = dataclasses.replace(_plan("alltoall", [1] * 100, [100, 0, 0, 0]), kernel=dataclasses.replace(v2, relay=False))
    assert _iso(plan, topo) == pytest.approx(100 * ROW / (2e3 * FAMILIES["deepep-v2"].sm_copy_factor))
    assert relay_rows(topo, v2) == topo.kernel_relay_message_rows
    assert relay_rows(topo, dataclasses.replace(v2, relay_message_rows=3)) == 3


def test_kernel_checks_name_rows_of_the_fidelity_benchmark_and_known_presets_and_families():
    import sys
    from pathlib import Path

    from moonep_sim.sim import list_topologies
    from moonep_sim.sim.kernels import checked_on, kernel_checks
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        import fidelity_gpu as F
    finally:
        sys.path.remove(bench)
    ids = {r["id"]: r for r in F.ROWS}
    for c in kernel_checks():
        assert c["preset"] in list_topologies() and c["family"] in FAMILIES, c
        for rid in c["rows"]:
            assert F.family_of(ids[rid]) == c["family"] and ids[rid]["spec"]["topo"] == c["preset"], rid
    assert [f for f, _ in checked_on("h800-cx7")] == ["deepep-v1", "deepep-v1-ll"]
    assert [f for f, _ in checked_on("h100-cx7")] == ["deepep-v2"]
    assert checked_on("h200-efa") == []


def test_cli_topologies_lists_the_families_and_what_each_preset_was_checked_against(capsys):
    from moonep_sim.cli import main
    assert main(["topologies"]) == 0
    out = capsys.readouterr().out
    for name in FAMILIES:
        assert name in out
    assert "kernel families checked on each preset" in out and "HybridEP" in out


@pytest.mark.parametrize("strategy, impl, counts", [("deepep", "deepep-v1", ["node_pairs", "rows_received"]),
                                                    ("deepep", "deepep-v2", ["scale_up", "scale_out"]),
                                                    ("deepep-ll", "nixl-ep", ["selections"])])
def test_cli_isolate_counts_as_each_librarys_own_test(capsys, strategy, impl, counts):
    import json

    from moonep_sim.cli import main

    args = ["simulate", "--gen", "model=deepseek-v3,uniform=1,tokens-per-rank=64", "--strategy", strategy,
            "--opt", f"impl={impl}", "--ranks", "16", "--dispatch-dtype", "fp8", "--isolate", "dispatch", "--json"]
    assert main(args) == 0
    k = json.loads(capsys.readouterr().out)["kernel"]
    assert k["family"] == impl and k["library_counts"] == counts
    # scale-up + scale-out: every row a rank sends to another GPU, by where it goes; one selection per kept entry
    assert k["selections"] == pytest.approx(64 * 8 * k["row_bytes"])
    if strategy == "deepep":
        assert 0 < k["scale_out"] <= 64 * k["row_bytes"]  # at most one row per token to the other node
    for key in counts:
        assert k[key + "_GBps"] == pytest.approx(k[key] / k["rank_mean_us"] / 1e3)
    assert main(args[:-1]) == 0
    assert f"kernel family {impl}: its library's own test counts" in capsys.readouterr().out


# -- DeepEP V1's chunked relays and DeepEP V2's copy epilogue (expanded dispatch) ------------------------
from moonep_sim.plan.kernel import V1_CHUNKS, RelayChunk, chunk_for  # noqa: E402
from moonep_sim.sim.kernels import (dispatch_epilogue_us, epilogue_rows_R, expand_read_bytes_per_us,  # noqa: E402
                                    relay_hop_rows)


def test_v1_relay_message_is_its_channels_times_its_configs_chunk():
    """DeepEP V1 at EP16 on 24 SMs: 12 channels; get_dispatch_config(16) sends NVLink chunks of 36 and
    RDMA chunks of 20 tokens, get_combine_config(16) 4 and 12."""
    t = load_topology("h800-cx7")
    v1 = family_spec(FAMILIES["deepep-v1"], sms=24, relay=True)
    assert [relay_hop_rows(t, v1, 16, d, x) for d in ("dispatch", "combine") for x in (False, True)] == \
        [12 * 36, 12 * 20, 12 * 4, 12 * 12]
    assert chunk_for(V1_CHUNKS, 40).ranks == 32 and chunk_for(V1_CHUNKS, 1).ranks == 2
    assert relay_hop_rows(t, family_spec(FAMILIES["deepep-v1"], sms=8, relay=True), 64, "dispatch", True) == 4 * 8
    # a family without a chunk table keeps the topology's message (V2: its chunking is not published)
    assert relay_hop_rows(t, family_spec(FAMILIES["deepep-v2"], sms=6, relay=True), 16, "dispatch", True) == \
        t.kernel_relay_message_rows


def test_one_chunked_relay_forwards_once_its_channels_first_chunks_arrived():
    # rank 0 -> relay 2 (NIC 2 GB/s) -> rank 3 (NVLink 10 GB/s); 4 SMs = 2 channels; chunks 3 (RDMA), 5 (NVLink)
    spec = KernelSpec(sms=4, relay=True, chunks=(RelayChunk(4, 5, 3, 7, 2),))
    plan = dataclasses.replace(_plan("deepep", [3] * 100, [100, 0, 0, 0]), kernel=spec)
    lat = {"nvlink": {"latency_us": 1.0}, "nic": {"latency_us": 2.0}}
    topo = _topo(sm={"count": 8, "copy_GBps": 1000.0}, kernel={"relay_message_rows": 4}, **lat)
    m0, m1 = message_us(topo, ROW, True, rows=2 * 3), message_us(topo, ROW, False, rows=2 * 5)
    assert _iso(plan, topo) == pytest.approx(relay_two_hop_us(100 * ROW, 2e3, 2.0, 100 * ROW, 10e3, 1.0, m0, m1))
    from moonep_sim.sim.program import _relay_RR
    c0 = _relay_RR(plan.phases("forward")[-1], plan, topo, 4e6, "combine")  # the RDMA hop back: chunk 2
    assert c0[2, 0] == pytest.approx(2.0 + 2 * 2 * ROW / 2e3)


def _epilogue_topo():
    return _topo(sm={"count": 8, "copy_GBps": 1000.0}, gpu={"mem_bandwidth_GBps": 1.0, "mem_efficiency": 1.0})


def test_v2_copy_epilogue_writes_each_received_row_once_or_once_per_local_expert():
    """One token of rank 0 with experts 2 and 3 (8 experts on 4 ranks: both on rank 1): rank 1
    receives 1 row; its epilogue writes it once (recv) or twice (expand), at HBM (1 GB/s)."""
    from moonep_sim.plan.kinds import Direction
    from moonep_sim.sim.faults import FaultState
    from moonep_sim.sim.program import stage_program
    g = GlobalRouting(np.array([[2, 3]]), np.ones((1, 2), np.float32), np.array([1, 0, 0, 0]), 8)
    ctx = PlanContext(ClusterShape(4, 2), Placement.home_groups(8, 4), RowCosts(ROW, ROW), 1)
    topo = _epilogue_topo()
    fs = FaultState.build([], 4)
    for impl, rows in (("deepep-v2", 1), ("deepep-v2-expand", 2)):
        plan = make_plan("deepep", g, ctx, impl=impl)
        recv_R, out_R = epilogue_rows_R(plan)
        assert (recv_R[1], out_R[1]) == (1, rows)
        full = stage_program(plan, MODEL, topo, Direction.FORWARD, SimOptions(), fs)
        iso = stage_program(plan, MODEL, topo, Direction.FORWARD, SimOptions(isolate="dispatch"), fs)
        want = dispatch_epilogue_us(1, rows, ROW, 1e3)
        assert want == pytest.approx((1 + rows) * ROW / 1e3)
        assert full.post_copy[-1][1] - iso.post_copy[-1][1] == pytest.approx(want)
        # the expanded combine first reads its 2 expanded rows, at HBM or the SMs' read rate
        extra = full.post_pre_copy[0][1] - stage_program(plan, MODEL, topo, Direction.FORWARD,
                                                          SimOptions(isolate="combine"), fs).post_pre_copy[0][1]
        rate = expand_read_bytes_per_us(topo, plan.kernel)
        assert rate == pytest.approx(min(1e3, 6 * 200.0 * 1e3))
        assert extra == pytest.approx(2 * ROW / rate if impl == "deepep-v2-expand" else 0.0)
    v1 = make_plan("deepep", g, ctx)
    assert epilogue_rows_R(v1) == (None, None)  # V1's receivers write the output themselves


def test_cli_isolate_reports_v2s_epilogue_apart_from_the_kernel(capsys):
    import json

    from moonep_sim.cli import main
    args = ["simulate", "--gen", "model=deepseek-v3,uniform=1,tokens-per-rank=64", "--strategy", "deepep",
            "--opt", "impl=deepep-v2-expand", "--ranks", "16", "--dispatch-dtype", "fp8", "--isolate", "dispatch",
            "--json"]
    assert main(args) == 0
    k = json.loads(capsys.readouterr().out)["kernel"]
    assert k["epilogue"] == "expand" and k["epilogue_us"] > 0
    assert k["epilogue_GBps"] == pytest.approx(k["epilogue_bytes"] / k["epilogue_us"] / 1e3)
    assert main(args[:-1]) == 0
    assert "copy epilogue (expand), timed apart" in capsys.readouterr().out


def test_a_chunked_relay_pays_the_nics_message_cost_once_per_channels_chunk():
    """4 NICs of 1 GB/s per GPU at 0.1 M messages/s each: 2.5 us per message. Rank 0 -> relay 2 ->
    rank 3, 100 rows; 2 channels with RDMA chunks of 3: the NIC hop is ceil(100 / 3) = 34 writes."""
    spec = KernelSpec(sms=4, relay=True, chunks=(RelayChunk(4, 5, 3, 7, 2),))
    plan = dataclasses.replace(_plan("deepep", [3] * 100, [100, 0, 0, 0]), kernel=spec)
    topo = _topo(nic={"bandwidth_GBps": 1.0, "rails_per_node": 8, "message_rate_Mps": 0.1},
                 sm={"count": 8, "copy_GBps": 1000.0}, kernel={"relay_message_rows": 4})
    assert topo.nic_message_us == pytest.approx(2.5)
    t0 = 100 * ROW / 4e3 + 34 * 2.5
    m0, m1 = message_us(topo, ROW, True, rows=2 * 3), message_us(topo, ROW, False, rows=2 * 5)
    assert _iso(plan, topo) == pytest.approx(relay_two_hop_us(100 * ROW, 100 * ROW / t0, 0.0, 100 * ROW, 10e3, 0.0,
                                                              m0, m1))
