"""One job's two-thread pipeline (moonep_sim.step.layer_work.pipelined_layer_work): the same step as the
serial loop, the first error in the serial order raised, nothing left running."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from moonep_sim.cli import main
from moonep_sim.errors import ConfigError
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.routing.generators import generate_layer
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import StepConfig, simulate_step, step_shape
from moonep_sim.step import layer_work as step_work
from moonep_sim.step.costs import CostModel
from moonep_sim.strategies import PlanContext

R, G = 8, 4
SMALL = ModelSpec("small", 5, 4, 32, 4, 2, 256, 128, attention="gqa", heads=4, kv_heads=2, head_dim=64,
                  max_context=4096, vocab=1000, dense_ffn=512)
#: what differs between two runs of the same step: the seconds it took
TIMING = {"plan_seconds", "wall_seconds", "cpu_seconds", "plan_s", "sim_s", "plan_cpu_s", "sim_cpu_s", "routing_s",
          "routing_cpu_s", "pipeline"}


def _ctx(topo):
    return PlanContext(ClusterShape(R, G), Placement.home_groups(SMALL.num_experts, R),
                       RowCosts.from_model(SMALL), 1, topo)


def _routing(tokens_per_rank, seed):
    lr = generate_layer(SMALL.num_experts, SMALL.top_k, tokens_per_rank * R, seed, maxvio=2.0)
    return GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, SMALL.num_experts, R)


class Builder:
    """A picklable-style routing builder that counts its calls and may fail."""

    def __init__(self, tokens, seed, fail=False):
        self.tokens, self.seed, self.fail = tokens, seed, fail

    def __call__(self):
        if self.fail:
            raise ConfigError(f"routing of layer seed {self.seed} failed")
        return _routing(self.tokens, self.seed)


def _cfg(mode, tokens, overlap, strategies, static=None, context=None):
    topo = load_topology("h800-cx7")
    return StepConfig(SMALL, topo, _ctx(topo), tuple((s, {}) for s in strategies),
                      step_shape(SMALL, mode, tokens, context), overlap, static_tokens=static or {})


def _source(tokens, fail_at=None):
    return lambda i: (i, Builder(tokens, i, fail=(i == fail_at)), f"layer {i}")


def _same(a, b, where="result"):
    """a == b, arrays bit for bit, floats exactly, timing fields skipped."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            if f.name not in TIMING:
                _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            if k not in TIMING:
                _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _no_step_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("moonep-step")]


CASES = [  # mode, tokens per rank, overlap (two-batch: two micro-batches per strategy), strategies, static buffer
    ("train", 32, "two-batch", ("alltoall", "moonep", "deepep"), {"moonep": 64}),
    ("train", 24, "shared-expert", ("alltoall", "moonep"), None),
    ("decode", 8, "none", ("alltoall", "moonep"), {"moonep": 32}),
]


@pytest.mark.parametrize("mode,tokens,overlap,strategies,static", CASES)
def test_pipelined_step_equals_the_serial_step(mode, tokens, overlap, strategies, static):
    cfg = _cfg(mode, tokens, overlap, strategies, static, context=512 if mode == "decode" else None)
    serial = simulate_step(cfg, _source(tokens), pipeline=False)
    piped = simulate_step(cfg, _source(tokens), pipeline=True)
    assert serial["pipeline"] is None and piped["pipeline"]["threads"] == 2
    st, pt = serial.pop("_timelines"), piped.pop("_timelines")
    _same(serial, piped)
    for s in strategies:
        assert [e.end_R.tolist() for e in st[s].events] == [e.end_R.tolist() for e in pt[s].events]
        for d in (serial, piped):
            cpu = d["strategies"][s]["cpu_seconds"]
            assert cpu["plan"] > 0 and cpu["simulate"] > 0 and cpu["routing"] > 0 and cpu["layers"] > 0
        assert piped["strategies"][s]["wall_seconds"]["pipeline_wait"] >= 0
    assert not _no_step_threads()


def test_pipelined_layer_results_equal_simulate_layer_work_unit_by_unit():
    cfg = _cfg("train", 32, "two-batch", ("alltoall", "moonep"), {"moonep": 48})
    strategies = (("alltoall", {}, 0), ("moonep", {}, 24))
    work = [step_work.LayerWork(Builder(32, i), strategies, 2, cfg.ctx, SMALL, cfg.topology, CostModel(cfg.topology),
                               True, None) for i in range(3)]
    serial = [step_work.simulate_layer_work(w) for w in work]
    piped, figures = step_work.pipelined_layer_work(list(work), ahead=2)
    _same(serial, piped)
    assert sorted(piped[0].done) == [("alltoall", 0), ("alltoall", 1), ("moonep", 0), ("moonep", 1)]
    assert figures["layers_cpu_s"] > 0 and figures["main_cpu_s"] > 0
    assert set(figures) == {"wait_s", "routings_here", "layers_cpu_s", "main_cpu_s", "second_cpu_s", "second_wait_s"}
    with pytest.raises(ConfigError, match="lookahead"):
        step_work.pipelined_layer_work(list(work), ahead=0)


def _error(fn):
    with pytest.raises(Exception) as e:
        fn()
    return type(e.value), str(e.value)


def test_a_routing_failing_on_the_second_thread_is_the_serial_error_and_nothing_is_left_running():
    cfg = _cfg("train", 16, "none", ("alltoall", "moonep"))
    serial = _error(lambda: simulate_step(cfg, _source(16, fail_at=2), pipeline=False))
    piped = _error(lambda: simulate_step(cfg, _source(16, fail_at=2), pipeline=True))
    assert serial == piped == (ConfigError, "routing of layer seed 2 failed")
    assert not _no_step_threads()


@pytest.mark.parametrize("where", ["plan", "simulate"])
def test_a_failure_in_either_thread_is_the_first_serial_error(monkeypatch, where):
    """A Plan failing on the second thread, or a simulation failing on this one while the next Plan
    is built: the error the serial loop raises, the units behind it never started."""
    import moonep_sim.strategies as strategies

    calls = {"plan": 0, "simulate": 0}
    make, sim = strategies.make_plan, step_work.simulate_moe_layer
    fail_at = 3  # the third unit in the serial order: layer 1's alltoall

    def make_plan(name, routing, ctx, **opts):
        calls["plan"] += 1
        if where == "plan" and calls["plan"] == fail_at:
            raise ConfigError(f"plan {calls['plan']} ({name}) failed")
        return make(name, routing, ctx, **opts)

    def simulate(plan, *a):
        calls["simulate"] += 1
        if where == "simulate" and calls["simulate"] == fail_at:
            raise ConfigError(f"simulation {calls['simulate']} failed")
        return sim(plan, *a)

    monkeypatch.setattr(strategies, "make_plan", make_plan)
    monkeypatch.setattr(step_work, "simulate_moe_layer", simulate)
    cfg = _cfg("train", 16, "none", ("alltoall", "moonep"))
    got = {}
    for pipeline in (False, True):
        calls.update(plan=0, simulate=0)
        got[pipeline] = _error(lambda: simulate_step(cfg, _source(16), pipeline=pipeline)), dict(calls)
        assert not _no_step_threads()
    assert got[False][0] == got[True][0]
    assert got[False][0][1] == (f"plan {fail_at} (alltoall) failed" if where == "plan" else f"simulation {fail_at} failed")
    # serially nothing past the failing unit ran; pipelined at most the one Plan built ahead of it
    assert got[False][1] == {"plan": fail_at, "simulate": fail_at - (where == "plan")}
    assert got[True][1]["simulate"] == got[False][1]["simulate"]
    assert got[False][1]["plan"] <= got[True][1]["plan"] <= got[False][1]["plan"] + step_work.PIPELINE_AHEAD


def test_the_pipeline_is_the_default_for_large_layers_only():
    assert step_work.pipeline_pays(2, step_work.PIPELINE_MIN_ENTRIES, cores=2)
    assert not step_work.pipeline_pays(1, 1 << 30, cores=2)           # one layer: nothing to overlap
    assert not step_work.pipeline_pays(92, step_work.PIPELINE_MIN_ENTRIES - 1, cores=2)
    assert not step_work.pipeline_pays(92, 1 << 30, cores=1)          # one core: nothing to overlap on
    cfg = _cfg("train", 16, "none", ("alltoall",))
    assert simulate_step(cfg, _source(16))["pipeline"] is None     # 16 x 8 x 4 entries: serial
    assert simulate_step(cfg, _source(16), map_fn=lambda f, xs: [f(x) for x in xs], pipeline=True)["pipeline"] is None


def test_cli_step_pipeline_option_and_a_second_thread_error_is_one_line(monkeypatch, capsys, tmp_path):
    import json

    import moonep_sim.strategies as strategies

    make = strategies.make_plan
    where, fail = [], []

    def make_plan(name, routing, ctx, **opts):
        where.append(threading.current_thread() is threading.main_thread())
        if name in fail:
            raise ConfigError(f"{name} plan (injected) must fail here")
        return make(name, routing, ctx, **opts)

    monkeypatch.setattr(strategies, "make_plan", make_plan)
    gen = "model=olmoe-1b-7b,maxvio=2,tokens-per-rank=16"
    base = ["step", "--gen", gen, "--ranks", "8", "--strategies", "alltoall,moonep", "--mode", "train"]
    out, on_main = {}, {}
    for p in ("on", "off"):
        where.clear()
        assert main(base + ["--pipeline", p, "--json", str(tmp_path / f"{p}.json")]) == 0
        out[p], on_main[p] = json.loads((tmp_path / f"{p}.json").read_text()), list(where)
    assert out["on"]["setup"]["pipeline"]["threads"] == 2 and out["off"]["setup"]["pipeline"] is None
    assert len(on_main["on"]) == len(on_main["off"]) == 2 * 16               # 16 MoE layers x 2 strategies
    assert all(on_main["off"]) and not all(on_main["on"])                    # pipelined: Plans on the second thread
    for s in ("alltoall", "moonep"):
        assert out["on"]["strategies"][s]["step_time_us"] == out["off"]["strategies"][s]["step_time_us"]
        assert out["on"]["strategies"][s]["layers"] == out["off"]["strategies"][s]["layers"]
    capsys.readouterr()
    fail.append("moonep")
    err = {}
    for p in ("on", "off"):
        assert main(base + ["--pipeline", p]) == 2
        err[p] = capsys.readouterr().err.strip().splitlines()
        assert not _no_step_threads()
    assert err["on"] == err["off"] == ["moonep-sim: error: moonep plan (injected) must fail here"]


def test_the_lookahead_bound_holds(monkeypatch):
    """While a Plan is simulated, at most PIPELINE_AHEAD more Plans and three layers' routings are
    alive (serially: one Plan, one routing)."""
    import gc
    import weakref

    import moonep_sim.strategies as strategies

    plans, routings, seen = [], [], []   # weak references (Plans and routings are unhashable)
    alive = lambda refs: sum(1 for w in refs if w() is not None)
    make, sim = strategies.make_plan, step_work.simulate_moe_layer

    class Tracked(Builder):
        def __call__(self):
            r = super().__call__()
            routings.append(weakref.ref(r))
            return r

    def make_plan(name, routing, ctx, **opts):
        plan = make(name, routing, ctx, **opts)
        plans.append(weakref.ref(plan))
        return plan

    def simulate(plan, *a):
        gc.collect()
        seen.append((alive(plans), alive(routings)))
        return sim(plan, *a)

    monkeypatch.setattr(strategies, "make_plan", make_plan)
    monkeypatch.setattr(step_work, "simulate_moe_layer", simulate)
    cfg = _cfg("train", 16, "none", ("alltoall",))
    for pipeline, most in ((False, (1, 1)), (True, (1 + step_work.PIPELINE_AHEAD, 3))):
        seen.clear()
        simulate_step(cfg, lambda i: (i, Tracked(16, i), f"layer {i}"), pipeline=pipeline)
        assert len(seen) == SMALL.moe_layers
        assert max(p for p, _ in seen) <= most[0] and max(r for _, r in seen) <= most[1], (pipeline, seen)
