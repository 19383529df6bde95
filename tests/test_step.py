"""The step model (moonep_sim.step): closed forms against the layer simulator, the overlap
schedules' bounds, the memory account by hand, and bad input."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.routing.generators import generate_layer
from moonep_sim.sim import SimOptions, simulate_layer, simulate_layers
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import CostModel, MemoryOptions, StepConfig, flat_cost_model, memory_per_rank, simulate_step, step_shape
from moonep_sim.step.layer_work import ROUTING_FIELDS, pad_to_static, split_micro_batches
from moonep_sim.step.memory import deepep_ll_buffer_bytes, deepep_normal_buffer_bytes
from moonep_sim.strategies import PlanContext, make_plan

R, G = 8, 4
BARE = ModelSpec("bare-moe", 1, 1, 32, 4, 0, 256, 128, attention="none")  # one MoE layer, no other op
SMALL = ModelSpec("small", 3, 2, 32, 4, 2, 256, 128, attention="gqa", heads=4, kv_heads=2, head_dim=64,
                  max_context=4096, vocab=1000, dense_ffn=512)


class NoOtherOps(CostModel):
    """The layer simulator's expert compute and nothing else (the closed-form check)."""

    def op_us(self, op):
        return 0.0


def _ctx(model, topo):
    return PlanContext(ClusterShape(R, G), Placement.home_groups(model.num_experts, R),
                       RowCosts.from_model(model), 1, topo)


def _routing(model, tokens_per_rank, maxvio=2.0, seed=0):
    lr = generate_layer(model.num_experts, model.top_k, tokens_per_rank * R, seed, maxvio=maxvio)
    return GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, model.num_experts, R)


def _step(model, topo, strategies, mode, tokens, overlap="none", costs=None, routing=None, **kw):
    r = routing if routing is not None else _routing(model, tokens)
    cfg = StepConfig(model, topo, _ctx(model, topo), tuple((s, {}) for s in strategies),
                     step_shape(model, mode, tokens, kw.pop("context", None)), overlap, costs, **kw)
    return simulate_step(cfg, lambda i: (i, r, f"layer {i}"))


@pytest.mark.parametrize("strategy", ["alltoall", "moonep", "deepep"])
def test_one_moe_layer_with_no_other_op_equals_the_layer_simulation(strategy):
    topo = load_topology("h800-cx7")
    r = _routing(BARE, 64)
    out = _step(BARE, topo, [strategy], "prefill", 64, costs=NoOtherOps(topo, half_rows=0.0), routing=r)
    plan = make_plan(strategy, r, _ctx(BARE, topo))
    # the step adds the host's wait for the count exchange before the dispatch (DeepEP's normal kernels)
    hw = plan.kernel.host_wait_us if plan.kernel is not None else 0.0
    want = simulate_layer(plan, topo, BARE).layer_time_us + hw
    assert out["strategies"][strategy]["step_time_us"] == pytest.approx(want, rel=1e-9)
    # train: forward and backward as two collectives; the layer simulator chains them per rank,
    # so the step can only be later, and by no more than the forward's rank skew
    tr = _step(BARE, topo, [strategy], "train", 64, costs=NoOtherOps(topo, half_rows=0.0), routing=r)
    both = simulate_layers([plan], topo, BARE, SimOptions(backward=True)).layer_time_us + hw
    assert both - 1e-6 <= tr["strategies"][strategy]["step_time_us"] <= both * 1.05


def test_flat_cost_model_prices_experts_as_the_simulator_does():
    from moonep_sim.sim.compute import rank_compute_us

    topo = load_topology("h20")
    plan = make_plan("moonep", _routing(SMALL, 48), _ctx(SMALL, topo))
    for bwd in (False, True):
        np.testing.assert_allclose(flat_cost_model(topo).expert_us_R(plan, SMALL, bwd),
                                   rank_compute_us(plan, SMALL, topo, backward=bwd))
    # the assumed curve only slows small groups down
    assert (CostModel(topo).expert_us_R(plan, SMALL) >= flat_cost_model(topo).expert_us_R(plan, SMALL) - 1e-9).all()


@pytest.mark.parametrize("mode", ["train", "prefill", "decode"])
def test_shared_expert_overlap_is_never_longer_and_never_shorter_than_the_busiest_compute(mode):
    topo = load_topology("h800-cx7")
    tokens = 16 if mode == "decode" else 256
    r = _routing(SMALL, tokens, maxvio=3.0)
    strategies = ["alltoall", "moonep", "deepep"]
    none = _step(SMALL, topo, strategies, mode, tokens, "none", routing=r)["strategies"]
    shared = _step(SMALL, topo, strategies, mode, tokens, "shared-expert", routing=r)
    for s in strategies:
        assert shared["strategies"][s]["step_time_us"] <= none[s]["step_time_us"] + 1e-6
        busiest = max(_compute_by_rank(shared["_timelines"][s]))
        assert shared["strategies"][s]["step_time_us"] >= busiest - 1e-6
        assert shared["strategies"][s]["exposed_comm_us"] <= none[s]["exposed_comm_us"] + 1e-6


def _compute_by_rank(tl):
    out = np.zeros(tl.R)
    for e in tl.events:
        if e.stream == "compute":
            out += e.end_R - e.start_R
    return out


def test_two_batch_splits_every_rank_in_halves_and_runs():
    r = _routing(SMALL, 65)
    a, b = split_micro_batches(r, 2)
    assert (a.tokens_per_rank_R + b.tokens_per_rank_R == r.tokens_per_rank_R).all()
    assert a.num_tokens + b.num_tokens == r.num_tokens
    out = _step(SMALL, load_topology("h800-cx7"), ["alltoall"], "train", 65, "two-batch", routing=r)
    assert out["strategies"]["alltoall"]["step_time_us"] > 0
    assert out["strategies"]["alltoall"]["distinct_layers_simulated"] == 4  # 2 MoE layers x 2 halves


def test_cut_and_padded_routing_is_what_the_checked_constructor_gives():
    # micro-batches and padded passes skip GlobalRouting's id check (trusted_routing): the same
    # arrays as the checked constructor's, which still accepts them, and every field set
    assert ROUTING_FIELDS == tuple(f.name for f in dataclasses.fields(GlobalRouting))
    r = _routing(SMALL, 65)
    for got in (*split_micro_batches(r, 2), pad_to_static(r, 80)):
        ref = GlobalRouting(got.topk_ids_TK, got.topk_weights_TK, got.tokens_per_rank_R, got.num_experts)
        for f in ROUTING_FIELDS:
            a, b = getattr(got, f), getattr(ref, f)
            assert np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype, f


def test_static_buffer_pads_every_pass_and_costs_a_decode_step():
    topo = load_topology("h20")
    r = _routing(SMALL, 8)
    p = pad_to_static(r, 64)
    assert (p.tokens_per_rank_R == 64).all() and p.num_tokens == 64 * R
    out = _step(SMALL, topo, ["alltoall", "moonep"], "decode", 8, routing=r, static_tokens={"moonep": 64})
    s = out["strategies"]
    assert s["moonep"]["static_tokens"] == 64
    assert s["moonep"]["step_time_us"] > s["alltoall"]["step_time_us"]


def test_memory_of_every_buffer_kind_by_hand():
    topo = load_topology("h800-cx7")
    m, T = SMALL, 64
    r = _routing(m, T, maxvio=3.0)
    ctx = _ctx(m, topo)
    shape = step_shape(m, "prefill", T, 128)
    D, F, H = m.dispatch_hidden, m.expert_ffn, m.hidden
    row = RowCosts.from_model(m)
    dense = (3 * (H * 4 * 64 + 2 * H * 2 * 64 + 4 * 64 * H)   # three gqa layers' q, k, v, o
             + 2 * 2 * 3 * H * F + 2 * H * 32 + 1 * 3 * H * 512 + 3 * 2 * H + 2 * 1000 * H)
    home = 32 / R * 2 * 3 * D * F
    kv = 3 * 1 * 128 * (2 * 2 * 64) * 2  # 3 layers x 1 sequence x 128 keys x (K and V of 2 heads x 64) x bf16
    for name, opts in [("alltoall", {}), ("deepep", {}), ("moonep", {}), ("capacity", {"cf": 1.5}),
                       ("deepep-ll", {})]:
        plan = make_plan(name, r, ctx, **opts)
        mem = memory_per_rank(m, shape, [plan], R)
        k = mem["peak_rank"]
        if plan.capacity_R is not None:  # static: moonep S x K, capacity's rows
            rows = plan.capacity_R[k]
        else:
            rows = plan.rows_R()[k]
        copies = int((plan.slot_rank_S[plan.is_copy_S()] == k).sum())
        row_buf = rows * (plan.costs.dispatch_row_bytes + plan.costs.combine_row_bytes)
        if name == "deepep-ll":  # DeepEP's double-buffered LL layout for T tokens per rank
            row_buf = deepep_ll_buffer_bytes(T, D, R, 32)
        want_buf = row_buf + (deepep_normal_buffer_bytes(R, 2 * D)[0] if name == "deepep" else 0) \
            + copies * 3 * D * F * 2
        assert mem["parts"]["buffers"] == pytest.approx(want_buf), name
        assert mem["parts"]["weights"] == pytest.approx((dense + home) * 2), name
        assert mem["parts"]["kv_cache"] == pytest.approx(kv), name
        assert mem["peak_bytes"] == pytest.approx(sum(mem["parts"].values()))
    moon = make_plan("moonep", r, ctx)
    assert (moon.capacity_R == T * m.top_k).all()  # MoonEP: exactly S x K rows per rank
    ll = make_plan("deepep-ll", r, ctx)
    assert (ll.capacity_R == (32 // R) * T * R).all()  # [local experts, max tokens x ranks]
    assert row.dispatch_row_bytes == 2 * D


def test_train_memory_counts_activations_gradients_and_sharded_adam():
    topo = load_topology("h800-cx7")
    m, T = SMALL, 64
    r = _routing(m, T)
    plan = make_plan("alltoall", r, _ctx(m, topo))
    shape = step_shape(m, "train", T, None)
    a = memory_per_rank(m, shape, [plan], R, MemoryOptions(optimizer_shard=1))
    b = memory_per_rank(m, shape, [plan], R, MemoryOptions(optimizer_shard=R))
    c = memory_per_rank(m, shape, [plan], R, MemoryOptions(optimizer_shard=R, recompute=True))
    weights_elems = a["parts"]["weights"] / 2
    assert a["parts"]["gradients"] == pytest.approx(weights_elems * 4)
    assert a["parts"]["optimizer"] > b["parts"]["optimizer"]
    assert c["parts"]["activations"] < b["parts"]["activations"]
    # routed-expert activations grow with the rank's rows: each row's input and three intermediates
    rows = plan.rows_R().astype(float)
    diff = memory_per_rank(m, shape, [plan], R)["parts_max"]["activations"]
    assert diff >= rows.max() * (m.dispatch_hidden + 3 * m.expert_ffn) * 2 * m.moe_layers


def test_profile_replaces_the_defaults_and_missing_ops_are_one_line(tmp_path, capsys):
    topo = load_topology("h800-cx7")
    from moonep_sim.step.compose import all_ops, stack_ops
    from moonep_sim.step.costs import read_profile

    shape = step_shape(SMALL, "prefill", 32, None)
    rows = ["op,shape,time_us"] + [f'{o.name},"{o.shape}",7' for o in all_ops(stack_ops(SMALL, shape), False)]
    rows += ["expert,rows=1,1", "expert,rows=100,10"]
    f = tmp_path / "prof.csv"
    f.write_text("\n".join(rows) + "\n")
    out = _step(SMALL, topo, ["alltoall"], "prefill", 32, costs=CostModel(topo, profile=read_profile(f)))
    tl = out["_timelines"]["alltoall"]
    assert {float(e.end_R[0] - e.start_R[0]) for e in tl.events if e.name == "attn_proj"} == {7.0}
    f.write_text("\n".join(rows[:3]) + "\n")
    code = main(["step", "--gen", "model=olmoe-1b-7b,maxvio=1,tokens-per-rank=32", "--ranks", "8", "--mode", "prefill",
                 "--strategies", "alltoall", "--compute-profile", str(f)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "must time every op of the step: missing" in err[0]


def test_bad_modes_and_contexts_are_one_line(capsys):
    with pytest.raises(ConfigError, match="mode \\(decode\\) must be run by a model with attention"):
        step_shape(BARE, "decode", 8, None)
    with pytest.raises(ConfigError, match="must be <= the model's max context"):
        step_shape(SMALL, "decode", 8, 5000)
    code = main(["step", "--gen", "model=olmoe-1b-7b,maxvio=1,tokens-per-rank=32", "--ranks", "8", "--mode", "decode",
                 "--context", "100000", "--strategies", "alltoall"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "max context (4096" in err[0]


def test_cli_step_writes_json_timeline_and_gantt(tmp_path, capsys):
    j, t, g = tmp_path / "s.json", tmp_path / "t.json", tmp_path / "g.png"
    code = main(["step", "--gen", "model=olmoe-1b-7b,maxvio=2,tokens-per-rank=64", "--ranks", "8", "--mode", "train",
                 "--strategies", "alltoall,moonep", "--overlap", "shared-expert", "--distinct-layers", "2",
                 "--json", str(j), "--timeline", str(t), "--gantt", str(g)])
    assert code == 0
    doc = json.loads(j.read_text())
    for s in ("alltoall", "moonep"):
        d = doc["strategies"][s]
        for k in ("step_time_us", "tokens_per_s_per_gpu", "mfu", "exposed_comm_us", "peak_memory_bytes",
                  "gpu_memory_bytes", "oom", "layers"):
            assert k in d
        assert len(d["layers"]) == 16 and {"kind", "time_us", "exposed_comm_us", "straggler"} <= set(d["layers"][0])
        assert d["distinct_layers_simulated"] == 2
    assert doc["setup"]["reused_layers"] == 14
    assert "reused" in doc["setup"]["layers_routing"][5]
    ev = json.loads(t.read_text())["traceEvents"]
    assert any(e.get("name") == "L3.dispatch" for e in ev) and g.stat().st_size > 1000
    assert "step time" in capsys.readouterr().out


def test_a_trace_shorter_than_the_model_gets_flagged_stand_ins(tmp_path):
    from moonep_sim.experiments import Scenario
    from moonep_sim.routing.generators import generate_trace

    f = tmp_path / "t.safetensors"
    generate_trace(f, 64, 8, 8 * 32, 0, model="olmoe-1b-7b", layers=3, maxvio=2.0)
    res = Scenario(routing=str(f), cluster=8, strategies=["alltoall"]).step("prefill", distinct_layers=0)
    prov = res.setup["layers_routing"]
    assert prov[:3] == ["trace layer 0", "trace layer 1", "trace layer 2"]
    assert all(p.startswith("STAND-IN") for p in prov[3:]) and res.setup["stand_ins"] == 13


def test_relabelled_layers_keep_the_skew_and_move_the_hot_experts():
    from moonep_sim.experiments.step import relabel_experts

    r = _routing(SMALL, 64, maxvio=3.0)
    q = relabel_experts(r, 5)
    assert sorted(q.counts_E().tolist()) == sorted(r.counts_E().tolist())
    assert not np.array_equal(q.counts_E(), r.counts_E())
    assert (np.sort(q.topk_ids_TK, axis=1) != np.sort(r.topk_ids_TK, axis=1)).any()
    assert (np.diff(np.sort(q.topk_ids_TK, axis=1), axis=1) > 0).all()  # still K distinct experts per token
    # expert groups stay whole: every token's experts span as many groups as before
    g = relabel_experts(r, 5, groups=4)
    span = lambda x: np.array([np.unique(t // 8).size for t in x.topk_ids_TK])
    assert (span(g) == span(r)).all()


def test_each_recorded_step_of_a_trace_is_its_own_step(tmp_path):
    from moonep_sim.experiments import Scenario
    from moonep_sim.routing.generators import generate_trace

    f = tmp_path / "steps.safetensors"
    generate_trace(f, 64, 8, 8 * 16, 0, model="olmoe-1b-7b", layers=2, steps=3, maxvio=1.0)
    res = Scenario(routing=str(f), cluster=8, strategies=["alltoall"]).step("prefill")
    assert isinstance(res, list) and len(res) == 3
    assert all(r.setup["tokens_per_rank"] == 16 and r.setup["step_tokens"] == 128 for r in res)
    one = Scenario(routing=str(f), cluster=8, strategies=["alltoall"], steps="1").step("prefill")
    assert not isinstance(one, list) and one.setup["tokens_per_rank"] == 16


def test_profile_script_writes_a_profile_the_step_accepts(tmp_path, monkeypatch):
    import runpy
    import sys

    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({"name": "tiny", "num_experts": 16, "top_k": 2, "hidden": 32, "expert_ffn": 16,
                                 "layers": 2, "moe_layers": 1, "shared_experts": 1, "attention": "gqa", "heads": 2,
                                 "kv_heads": 1, "head_dim": 16, "max_context": 256, "vocab": 50, "dense_ffn": 32}))
    out = tmp_path / "prof.csv"
    monkeypatch.setattr(sys, "argv", ["profile_ops.py", "--model", str(model), "--mode", "train", "--tokens", "8",
                                      "--reps", "1", "--device", "cpu", "-o", str(out)])
    runpy.run_path(str(__import__("pathlib").Path(__file__).parents[1] / "benchmarks" / "profile_ops.py"),
                   run_name="__main__")
    assert main(["step", "--gen", f"model={model},maxvio=1,tokens-per-rank=8", "--ranks", "4", "--mode", "train",
                 "--strategies", "alltoall", "--compute-profile", str(out), "--json", str(tmp_path / "o.json")]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["setup"]["compute_profile"] == str(out)


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("distinct", [3, 0])  # 0: every layer generated in the worker that plans it
def test_jobs_give_the_same_step_as_serial(distinct):
    from moonep_sim.experiments import Scenario

    sc = Scenario(routing="gen:model=olmoe-1b-7b,maxvio=2,tokens-per-rank=32", cluster=8,
                  strategies=["alltoall", "moonep"])
    a = sc.step("train", "shared-expert", distinct_layers=distinct)
    b = sc.step("train", "shared-expert", distinct_layers=distinct, jobs=2)
    for s in ("alltoall", "moonep"):
        assert a.figures[s]["step_time_us"] == b.figures[s]["step_time_us"]
        assert a.figures[s]["peak_memory_bytes"] == b.figures[s]["peak_memory_bytes"]
        assert [l["time_us"] for l in a.figures[s]["layers"]] == [l["time_us"] for l in b.figures[s]["layers"]]


def test_each_distinct_routing_is_built_once_for_every_strategy():
    """A source's builders: one call per distinct key, shared by the strategies and micro-batches."""
    topo = load_topology("h800-cx7")
    model = dataclasses.replace(SMALL, layers=5, moe_layers=4)
    built = []

    def builder(seed):
        def build():
            built.append(seed)
            return _routing(model, 16, seed=seed)
        return build

    b = [builder(0), builder(1)]
    cfg = StepConfig(model, topo, _ctx(model, topo), (("alltoall", {}), ("moonep", {})),
                     step_shape(model, "train", 16, None), "two-batch")
    out = simulate_step(cfg, lambda i: (i % 2, b[i % 2], f"layer {i}"))
    assert sorted(built) == [0, 1]
    for s in ("alltoall", "moonep"):
        assert out["strategies"][s]["distinct_layers_simulated"] == 4      # 2 routings x 2 micro-batches
        assert out["strategies"][s]["wall_seconds"]["routing"] > 0
        cpu = out["strategies"][s]["cpu_seconds"]
        assert set(cpu) == {"routing", "plan", "simulate", "compose", "layers"} and cpu["plan"] > 0 and cpu["simulate"] > 0
    # a builder gives the same step as the routing it builds
    same = simulate_step(cfg, lambda i: (i % 2, _routing(model, 16, seed=i % 2), f"layer {i}"))
    assert same["strategies"]["moonep"]["step_time_us"] == out["strategies"]["moonep"]["step_time_us"]


def test_generated_layers_travel_as_picklable_builders():
    import pickle

    from moonep_sim.experiments import GeneratorSpec, Scenario
    from moonep_sim.experiments.step import GeneratedLayer, layer_source

    src = Scenario(routing=GeneratorSpec(model="olmoe-1b-7b", maxvio=2.0, tokens_per_rank=16), cluster=8,
                   strategies=["alltoall"]).resolved.source
    key, b, how = layer_source(src, 8, 16, 16)(5)
    assert key == ("gen", 5) and isinstance(b, GeneratedLayer) and how == "generated layer 5"
    r, r2 = b(), pickle.loads(pickle.dumps(b))()
    np.testing.assert_array_equal(r.topk_ids_TK, r2.topk_ids_TK)
    np.testing.assert_array_equal(r.topk_ids_TK, src.global_routing(5, 8).topk_ids_TK)
    assert r.tokens_per_rank_R.tolist() == [16] * 8


def test_a_comm_kernel_slows_the_compute_beside_it_by_its_sm_share():
    from moonep_sim.step.schedule import Timeline

    tl = Timeline(2)
    tl.comm("dispatch", np.array([10.0, 10.0]), 0, "forward", share=0.25)  # 0..10 us, a quarter of the SMs
    e = tl.compute("shared_expert", np.array([6.0, 9.0]), 0, "forward")
    # rank 0: 6 us of work at 0.75 rate ends at 8 us; rank 1: 7.5 us done by 10, 1.5 us more after
    np.testing.assert_allclose(e, [8.0, 11.5])
    tl2 = Timeline(1)
    tl2.comm("dispatch_ll", np.array([5.0]), 0, "forward", share=1.0)  # every SM: no compute beside it
    np.testing.assert_allclose(tl2.compute("x", 2.0, 0, "forward"), [7.0])
    np.testing.assert_allclose(Timeline(1).compute("x", 2.0, 0, "forward"), [2.0])


def test_stack_ops_share_one_build_per_attention_kind_and_equal_the_per_layer_ops():
    from moonep_sim.models import get_model
    from moonep_sim.step.compose import all_ops, stack_ops
    from moonep_sim.step.stack import backward_op, layer_ops

    m = get_model("kimi-k3")   # 1 dense layer, then linear x3 + gated-mla cycles
    shape = step_shape(m, "train", 512, None)
    ot = stack_ops(m, shape)
    assert [lo == layer_ops(m, l, shape) for l, lo in enumerate(ot.layers)] == [True] * m.layers
    kinds = {(m.attention_kind(l), l >= m.dense_layers) for l in range(m.layers)}
    assert len({id(lo) for lo in ot.layers}) == len(kinds) == 3
    fwd = all_ops(ot, False)
    assert all_ops(ot, True) == fwd + [backward_op(o) for o in fwd]


def test_step_metrics_equal_a_per_event_account_bit_for_bit():
    # the per-layer spans, compute and stream sums, read event by event (the plain form of step_metrics)
    topo = load_topology("h800-cx7")
    out = _step(SMALL, topo, ["alltoall"], "train", 64, "two-batch")
    fig, tl = out["strategies"]["alltoall"], out["_timelines"]["alltoall"]
    r = fig["slowest_rank"]
    busy = {s: sum((e.end_R - e.start_R for e in tl.events if e.stream == s), np.zeros(tl.R))
            for s in ("compute", "comm")}
    assert (fig["compute_us"], fig["comm_us"]) == (float(busy["compute"][r]), float(busy["comm"][r]))
    for row in fig["layers"]:
        ev = [e for e in tl.events if e.layer == row["layer"]]
        fwd, bwd = [e for e in ev if e.direction == "forward"], [e for e in ev if e.direction == "backward"]
        span = lambda es: np.max([e.end_R for e in es], axis=0) - np.min([e.start_R for e in es], axis=0)
        dur_R = span(fwd) + (span(bwd) if bwd else 0.0)
        comp = sum((e.end_R - e.start_R for e in ev if e.stream == "compute"), np.zeros(tl.R))
        slow = int(np.argmax(dur_R))
        assert row["time_us"] == float(dur_R[slow])
        assert row["exposed_comm_us"] == float(max(dur_R[slow] - comp[slow], 0.0))
