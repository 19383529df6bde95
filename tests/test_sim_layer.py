"""Layer timelines: every strategy on every preset, conservation, determinism, the lower bound,
faults and stragglers, Perfetto output and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import random_routing
from moonep_sim.models import custom_model, get_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.sim import (DegradedLink, SimOptions, SlowGPU, Stall, list_topologies, load_topology, lower_bound,
                            simulate_layer, simulate_layers)
from moonep_sim.strategies import PlanContext, available, make_plan

MODEL = custom_model(32, 4, hidden=512, expert_ffn=256, name="tiny")


def plan_for(strategy, R=8, G=4, T_per=64, skew=1.0, seed=0, model=MODEL, **opts):
    ids, w = random_routing(T_per * R, model.top_k, model.num_experts, seed, skew)
    g = GlobalRouting.split_evenly(ids, w, model.num_experts, R)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(model.num_experts, R), RowCosts.from_model(model), 1)
    return make_plan(strategy, g, ctx, **opts)


STRATEGIES = list(available())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_and_never_beats_the_lower_bound(strategy):
    topo = load_topology("h800-cx7", gpus_per_node=4)
    for seed, skew in ((0, 0.0), (1, 2.0)):
        plan = plan_for(strategy, seed=seed, skew=skew)
        for opts in (SimOptions(tol=0.0), SimOptions(), SimOptions(backward=True, chunks=2)):
            res = simulate_layer(plan, topo, MODEL, opts)
            assert res.layer_time_us >= res.lower_bound_us > 0
            assert res.ratio_to_lower_bound >= 1.0
            assert res.lower_bound_us == pytest.approx(lower_bound(plan, MODEL, topo, backward=opts.backward).lower_bound_us)


@pytest.mark.parametrize("topo_name", list_topologies())
def test_every_preset_times_a_plan(topo_name):
    topo = load_topology(topo_name)
    R = 16 if not topo.nodes else min(16, topo.nodes * topo.gpus_per_node)  # mi350x: one node
    plan = plan_for("alltoall", R=R, G=min(topo.gpus_per_node, R))
    res = simulate_layer(plan, topo, MODEL)
    assert res.layer_time_us > 0 and res.topology == topo_name
    assert set(res.phases_us) >= {"dispatch.0", "combine.0", "expert", "plan"}
    d = res.to_dict()
    for k in ("strategy", "topology", "layer_time_us", "phases_us", "lower_bound_us", "ratio_to_lower_bound",
              "straggler", "busiest_port", "sim_wall_seconds", "topology_constants"):
        assert k in d
    json.dumps(d)


@pytest.mark.parametrize("chunks", [1, 3])
def test_simulated_bytes_equal_the_plans_bytes(chunks):
    plan = plan_for("moonep" if "moonep" in STRATEGIES else "alltoall", skew=2.0)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    res = simulate_layer(plan, topo, MODEL, SimOptions(backward=True, chunks=chunks))
    want = sum(float(p.bytes_RR.sum()) for d in ("forward", "backward") for p in plan.phases(d))
    assert res.flow_bytes == pytest.approx(want, rel=1e-12)


def test_same_seed_same_result_bit_for_bit():
    plan = plan_for("alltoall", skew=1.0)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    o = SimOptions(jitter=0.3, seed=7, backward=True, faults=(SlowGPU(2, 0.5),))
    a, b = simulate_layer(plan, topo, MODEL, o), simulate_layer(plan, topo, MODEL, o)
    da, db = a.to_dict(), b.to_dict()
    for d in (da, db):
        d.pop("sim_wall_seconds"), d["sim_stats"].pop("wall_seconds")
    assert json.dumps(da) == json.dumps(db)
    c = simulate_layer(plan, topo, MODEL, SimOptions(jitter=0.3, seed=8, backward=True, faults=(SlowGPU(2, 0.5),)))
    assert c.layer_time_us != a.layer_time_us


def test_default_tolerance_is_close_to_exact_and_never_faster():
    topo = load_topology("h800-cx7", gpus_per_node=4)
    for strategy in [s for s in ("alltoall", "deepep", "hierarchical") if s in STRATEGIES]:
        plan = plan_for(strategy, R=16, skew=1.5, T_per=128)
        exact = simulate_layer(plan, topo, MODEL, SimOptions(tol=0.0)).layer_time_us
        approx = simulate_layer(plan, topo, MODEL).layer_time_us
        assert exact * (1 - 1e-9) <= approx <= exact * 1.015


def test_slow_gpu_is_the_straggler_with_cause_compute():
    plan = plan_for("alltoall", skew=0.0, T_per=256)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    base = simulate_layer(plan, topo, MODEL)
    slow = simulate_layer(plan, topo, MODEL, SimOptions(faults=(SlowGPU(5, 0.02),)))
    assert slow.layer_time_us > base.layer_time_us
    assert slow.straggler["rank"] == 5 and slow.straggler["cause"] == "compute"


def test_degraded_nic_is_the_busiest_port_and_the_straggler():
    plan = plan_for("alltoall", skew=0.0, T_per=256)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    base = simulate_layer(plan, topo, MODEL)
    deg = simulate_layer(plan, topo, MODEL, SimOptions(faults=(DegradedLink(6, 0.05, "nic"),)))
    assert deg.layer_time_us > 2 * base.layer_time_us
    assert deg.busiest_port["name"].startswith("rank6.nic")
    assert deg.straggler["rank"] == 6 and deg.straggler["cause"] == "slow port"
    nv = simulate_layer(plan, topo, MODEL, SimOptions(faults=(DegradedLink(1, 0.02, "nvlink"),)))
    assert nv.busiest_port["name"].startswith("rank1.nvlink") and nv.layer_time_us > base.layer_time_us


def test_stall_delays_the_layer_by_about_its_length_and_is_named():
    plan = plan_for("alltoall", skew=0.0)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    base = simulate_layer(plan, topo, MODEL)
    st = simulate_layer(plan, topo, MODEL, SimOptions(faults=(Stall(3, 5000.0, "compute"),)))
    assert st.layer_time_us >= base.layer_time_us + 5000.0 * 0.9
    assert st.straggler["rank"] == 3 and st.straggler["cause"] == "stall"


def test_hot_receiver_is_the_straggler_by_tokens_received():
    # every token picks expert 0 (home rank 0) plus others: rank 0 receives the most rows
    R, E, K = 8, 32, 4
    rng = np.random.default_rng(0)
    T = 8 * 256
    others = np.argsort(rng.random((T, E - 1)), axis=1)[:, :K - 1] + 1
    ids = np.concatenate([np.zeros((T, 1), np.int64), others], axis=1)
    w = np.full((T, K), 0.25, np.float32)
    g = GlobalRouting.split_evenly(ids, w, E, R)
    ctx = PlanContext(ClusterShape(R, 4), Placement.home_groups(E, R), RowCosts.from_model(MODEL), 1)
    plan = make_plan("alltoall", g, ctx)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    res = simulate_layer(plan, topo, MODEL, SimOptions(isolate="dispatch"))
    assert res.straggler["rank"] == 0 and res.straggler["cause"] == "tokens received"
    assert res.busiest_port["name"].startswith("rank0.")


def test_backward_step_blames_the_gradient_reduce_when_it_ends_the_step():
    # moonep copies hot experts; in the backward their fp32 weight gradients (4x the bf16 weight
    # bytes) go home after compute and arrive last. The straggler names that phase by its kind
    # (issue: it used to blame "combine ... tokens received" by matching phase names).
    from moonep_sim.routing.generators import generate_layer

    model = get_model("deepseek-v3")
    R = 16
    lr = generate_layer(model.num_experts, model.top_k, 512 * R, 0, maxvio=3.0)
    g = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, model.num_experts, R)
    ctx = PlanContext(ClusterShape(R, 8), Placement.home_groups(model.num_experts, R), RowCosts.from_model(model), 1)
    plan = make_plan("moonep", g, ctx)
    assert plan.weight_copies > 0
    res = simulate_layer(plan, load_topology("h800-cx7"), model, SimOptions(backward=True))
    assert res.straggler["phase"] == "grad_reduce" and res.straggler["cause"] == "gradient traffic"
    assert res.straggler["detail"].startswith("grad_reduce (backward): rank")
    # the detail counts the gradient bytes on the port's side (its rank sends or receives them)
    import re
    mib = float(re.search(r"(sends|receives) ([0-9.]+) MiB", res.straggler["detail"]).group(2))
    assert mib > 0
    # the gradient reduce is what ends the step: its span reaches the step's end
    assert res.phases_us["bwd.grad_reduce"] > 0.2 * res.layer_time_us
    fwd = simulate_layer(plan, load_topology("h800-cx7"), model)
    assert fwd.straggler["phase"] != "grad_reduce"


def test_phase_records_carry_typed_kinds_scopes_and_directions():
    from moonep_sim.plan.kinds import Direction, PhaseKind, Scope

    plan = plan_for("hierarchical", R=8, G=4)
    for direction in Direction:
        for p in plan.phases(direction):
            assert isinstance(p.kind, PhaseKind) and isinstance(p.scope, Scope) and p.direction is direction
    bwd = {p.name: p.kind for p in plan.phases("backward")}
    assert bwd["combine_bwd.0"] is PhaseKind.DISPATCH and bwd["dispatch_bwd.0"] is PhaseKind.COMBINE
    assert plan.hops and all(isinstance(h.scope, Scope) for h in plan.hops)
    res = simulate_layer(plan, load_topology("h800-cx7", gpus_per_node=4), MODEL,
                         SimOptions(backward=True, timeline=True))
    kinds = {e["args"]["kind"] for e in res.timeline_events if e.get("pid") == 1 and e.get("ph") == "X"}
    assert {"planning", "routing_gather", "dispatch", "combine", "expert_compute"} <= kinds


def test_isolated_dispatch_excludes_compute_and_planning():
    plan = plan_for("alltoall")
    topo = load_topology("h800-cx7", gpus_per_node=4)
    iso = simulate_layer(plan, topo, MODEL, SimOptions(isolate="dispatch"))
    full = simulate_layer(plan, topo, MODEL)
    assert set(iso.phases_us) <= {"dispatch.0", "dispatch.0.fixed"} and "dispatch.0" in iso.phases_us
    assert iso.phases_us.get("dispatch.0.fixed", 0.0) == pytest.approx(topo.kernel_dispatch_fixed_us)
    assert iso.layer_time_us < full.layer_time_us
    # the kernel's fixed cost, then its bytes
    assert iso.layer_time_us == pytest.approx(iso.phases_us["dispatch.0"] + topo.kernel_dispatch_fixed_us)


def test_overlapping_prefetch_is_not_slower_and_layers_chain():
    s = "moonep" if "moonep" in STRATEGIES else "alltoall"
    plan = plan_for(s, skew=2.5, T_per=256)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    ov = simulate_layer(plan, topo, MODEL, SimOptions(overlap_prefetch=True))
    seq = simulate_layer(plan, topo, MODEL, SimOptions(overlap_prefetch=False))
    assert ov.layer_time_us <= seq.layer_time_us * (1 + 1e-9)
    two = simulate_layers([plan, plan], topo, MODEL)
    assert len(two.layers_us) == 2
    assert ov.layer_time_us * 1.5 < two.layer_time_us <= 2 * ov.layer_time_us * 1.02


def test_perfetto_trace_is_valid_trace_event_json(tmp_path):
    from moonep_sim.sim.perfetto import write_trace
    plan = plan_for("alltoall", skew=1.0)
    topo = load_topology("h800-cx7", gpus_per_node=4)
    res = simulate_layer(plan, topo, MODEL, SimOptions(timeline=True, backward=True))
    out = tmp_path / "t.json"
    write_trace(out, res.timeline_events, {"strategy": "alltoall"})
    doc = json.loads(out.read_text())
    evs = doc["traceEvents"]
    assert {e["ph"] for e in evs} >= {"M", "X", "C"}
    ranks_with_spans = {e["tid"] for e in evs if e["ph"] == "X" and e["pid"] == 1}
    assert ranks_with_spans == set(range(8))
    for e in evs:
        if e["ph"] in ("X", "C"):
            assert isinstance(e["ts"], float) and e["ts"] >= 0 and "name" in e
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "C":
            assert 0 <= e["args"]["utilisation"] <= 1 + 1e-9


def test_cli_simulate_json_and_timeline(tmp_path):
    out = tmp_path / "tl.json"
    cmd = [sys.executable, "-m", "moonep_sim", "simulate", "--gen", "maxvio=2,model=deepseek-v3,tokens-per-rank=256",
           "--strategy", "alltoall", "--topology", "h800-cx7", "--ranks", "16", "--degrade-nic", "3:0.1",
           "--jitter", "0.1", "--seed", "1", "--json", "--timeline", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["strategy"] == "alltoall" and d["topology"] == "h800-cx7" and d["ranks"] == 16
    assert d["layer_time_us"] >= d["lower_bound_us"] > 0
    assert d["topology_constants"]["nic_bandwidth_GBps"] == 50.0
    assert d["busiest_port"]["name"].startswith("rank3.nic")
    assert json.loads(out.read_text())["traceEvents"]
    bad = subprocess.run([sys.executable, "-m", "moonep_sim", "simulate", "--gen", "maxvio=2", "--strategy",
                          "alltoall", "--slow-gpu", "3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("moonep-sim: error: --slow-gpu ('3') must look like")


def test_fault_rank_out_of_range_is_one_clear_error():
    from moonep_sim.errors import ConfigError
    plan = plan_for("alltoall")
    with pytest.raises(ConfigError, match=r"fault rank \(9\) must be < ranks \(8\)"):
        simulate_layer(plan, load_topology("h800-cx7"), MODEL, SimOptions(faults=(SlowGPU(9, 0.5),)))


def test_lower_bound_compute_side_is_work_over_ranks():
    m = get_model("deepseek-v3")
    plan = plan_for("alltoall", R=8, G=8, T_per=128, model=m)
    topo = load_topology("h20")
    from moonep_sim.sim.lower_bound import lower_bound
    lb = lower_bound(plan, m, topo)
    flops = plan.real_rows_R().sum() * m.expert_flops_per_row()
    assert lb.compute_us >= flops / (8 * topo.flops_per_us)
    assert lb.lower_bound_us == max(lb.comm_us, lb.compute_us)


from hypothesis import HealthCheck, given, settings, strategies as hst  # noqa: E402


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.integers(0, 10_000), hst.floats(0.0, 3.0), hst.sampled_from([(4, 2), (8, 4), (8, 8)]),
       hst.integers(1, 96))
def test_lower_bound_is_never_beaten_on_random_routings(seed, skew, shape, t_per):
    R, G = shape
    topo = load_topology("h800-cx7", gpus_per_node=G)
    for s in STRATEGIES:
        # home groups (E = 32 divisible by every R drawn), >= 1 token per rank: no strategy refuses
        plan = plan_for(s, R=R, G=G, T_per=t_per, skew=skew, seed=seed)
        res = simulate_layer(plan, topo, MODEL, SimOptions(tol=0.0, backward=bool(seed % 2)))
        assert res.layer_time_us >= res.lower_bound_us * (1 - 1e-12), (s, res.lower_bound)


def test_host_planning_of_a_plan_is_charged_in_the_planning_step():
    """A Plan's ``host_plan_us`` (a host-side planner, e.g. LLEP's Python loop) delays the layer by
    exactly that much: it sits on every rank's planning step, before any transfer."""
    import dataclasses

    topo = load_topology("h800-cx7", gpus_per_node=4)
    plan = plan_for("alltoall")
    base = simulate_layer(plan, topo, MODEL, SimOptions(tol=0.0))
    slow = simulate_layer(dataclasses.replace(plan, host_plan_us=250.0), topo, MODEL, SimOptions(tol=0.0))
    assert slow.layer_time_us == pytest.approx(base.layer_time_us + 250.0, rel=1e-9)
    assert slow.phases_us["plan"] == pytest.approx(base.phases_us["plan"] + 250.0, rel=1e-9)


@pytest.mark.parametrize("strategy", ["alltoall", "moonep", "capacity"])
@pytest.mark.parametrize("even", [True, False])
def test_lower_bound_entry_counts_match_a_per_entry_reference(strategy, even):
    """The bound's per-entry pass (int32 cells, chunked, a division for an even token split)
    against a plain per-entry reference: counts per (source rank, expert) and tokens needing a
    non-resident expert, on an uneven split and on dropped (padded) entries."""
    import importlib
    lbm = importlib.import_module("moonep_sim.sim.lower_bound")
    R, E, K = 8, 32, 4
    rng = np.random.default_rng(7)
    T = 896
    ids = np.argsort(rng.random((T, E)) ** np.linspace(0.3, 3, E), axis=1)[:, :K]
    tpr = np.full(R, T // R) if even else rng.multinomial(T, np.ones(R) / R)
    routing = GlobalRouting(ids, np.full((T, K), 1.0 / K), tpr, E)
    ctx = PlanContext(ClusterShape(R, 4), Placement.from_map(np.arange(E) * R // E, R),
                      RowCosts.from_model(custom_model(E, K, hidden=256, expert_ffn=128, name="t"), "bf16"), 1)
    plan = make_plan(strategy, routing, ctx)
    ents = lbm._Entries(plan, chunk=1000)   # several chunks
    real = plan.row_entry_W >= 0
    tok = plan.row_entry_W[real] // K
    exp = np.repeat(plan.slot_expert_S, plan.slot_padded_S)[real]
    src = np.repeat(np.arange(R), plan.tokens_per_rank_R)[tok]
    n_RE = np.zeros((R, E), dtype=np.int64)
    np.add.at(n_RE, (src, exp), 1)
    assert np.array_equal(ents.n_RE, n_RE)
    res_RE = rng.random((R, E)) < 0.4
    need = {int(t) for t, s, e in zip(tok, src, exp) if not res_RE[s, e]}
    src_T = np.repeat(np.arange(R), plan.tokens_per_rank_R)
    want = np.bincount(src_T[sorted(need)], minlength=R) if need else np.zeros(R, int)
    assert np.array_equal(ents.tokens_needing(res_RE), want)


@pytest.mark.parametrize("strategy", ["deepep", "hierarchical", "moonep"])
def test_hop_rows_counted_once_give_each_directions_phases(strategy):
    """The simulator counts each hop's rows once for both directions (``Plan.phases(d, hop_rows)``):
    the same phases, bytes and messages as counting them per direction."""
    plan = plan_for(strategy, skew=1.5)
    rows = [h.rows_RR(plan.ranks) for h in plan.hops]
    for d in ("forward", "backward"):
        a, b = plan.phases(d), plan.phases(d, rows)
        assert [p.name for p in a] == [p.name for p in b]
        for p, q in zip(a, b):
            assert np.array_equal(p.bytes_RR, q.bytes_RR) and np.array_equal(p.msgs_RR, q.msgs_RR)
