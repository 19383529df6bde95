"""Overlap schedules as classes behind a registry (``moonep_sim.step.schedules``): the registry holds
the three built-in schedules, a bad name is one line, a copy of the registry takes a registration
of its own; and on drawn models every schedule issues the same work, one op at a time per stream,
collectives at once on every rank, ``none`` with no compute beside communication."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.routing.generators import generate_layer
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import OVERLAPS, StepConfig, get_overlap, simulate_step, step_shape
from moonep_sim.step.schedules import OVERLAP_SCHEDULES, LayerSchedule, Schedule
from moonep_sim.strategies import PlanContext


def test_the_registry_holds_the_built_in_schedules():
    assert OVERLAPS == ("none", "shared-expert", "two-batch") == OVERLAP_SCHEDULES.names()
    for name in OVERLAPS:
        s = get_overlap(name)
        assert isinstance(s, LayerSchedule) and s.name == name
    assert [get_overlap(n).micro_batches for n in OVERLAPS] == [1, 1, 2]


def test_an_unknown_schedule_is_one_line_naming_the_schedules():
    with pytest.raises(ConfigError) as e:
        get_overlap("dualpipe")
    msg = str(e.value)
    assert msg == "overlap ('dualpipe') must be one of none, shared-expert, two-batch"


def test_the_cli_offers_every_registered_schedule():
    from moonep_sim.cli import build_parser

    p = build_parser()
    step = next(a for a in p._subparsers._group_actions[0].choices["step"]._actions if a.dest == "overlap")
    assert tuple(step.choices) == OVERLAPS


def test_a_registration_twice_is_refused_and_a_copy_is_separate():
    class Again(Schedule):
        name = "none"

    with pytest.raises(ConfigError, match="registered once"):
        OVERLAP_SCHEDULES.register(Again)
    reg = OVERLAP_SCHEDULES.copy()

    @reg.register
    class Other(Schedule):
        name = "other"

    assert "other" in reg and "other" not in OVERLAP_SCHEDULES
    assert np.array_equal(reg.names()[:3], OVERLAPS)


# ------------------------------------------------------------------ every schedule's timeline, drawn
TOPO = load_topology("h800-cx7")


def _timelines(model, mode, tokens, strategy, seed):
    R = 4
    ctx = PlanContext(ClusterShape(R, 2), Placement.home_groups(model.num_experts, R), RowCosts.from_model(model), 1,
                      TOPO)
    lr = generate_layer(model.num_experts, model.top_k, tokens * R, seed, maxvio=2.0)
    r = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, model.num_experts, R)
    out = {}
    for overlap in OVERLAPS:
        cfg = StepConfig(model, TOPO, ctx, ((strategy, {}),), step_shape(model, mode, tokens, None), overlap, None)
        res = simulate_step(cfg, lambda i: (0, r, "layer"), pipeline=False)
        out[overlap] = (res["strategies"][strategy]["step_time_us"], res["_timelines"][strategy])
    return out


@settings(max_examples=6, deadline=None)
@given(layers=st.integers(1, 3), dense=st.integers(0, 1), shared=st.integers(0, 2),
       kinds=st.sampled_from(["gqa", "mla", "linear,gqa", "none"]), mode=st.sampled_from(["train", "prefill", "decode"]),
       tokens=st.integers(2, 24), strategy=st.sampled_from(["alltoall", "moonep"]), seed=st.integers(0, 9))
def test_every_schedule_issues_the_same_work_on_streams_that_never_overlap_themselves(
        layers, dense, shared, kinds, mode, tokens, strategy, seed):
    if mode == "decode" and kinds == "none":
        kinds = "gqa"
    m = ModelSpec("drawn", layers + dense, layers, 8, 2, shared, 64, 32, attention=kinds, heads=2, kv_heads=2,
                  head_dim=32, kv_lora_rank=16, qk_rope_dim=8, v_head_dim=32, max_context=4096, vocab=100,
                  dense_ffn=64)
    tls = _timelines(m, mode, tokens, strategy, seed)
    work = {}
    for name, (step_us, tl) in tls.items():
        end = np.zeros(tl.R)
        for stream in ("compute", "comm"):
            ev = [e for e in tl.events if e.stream == stream]
            for a, b in zip(ev, ev[1:]):  # each stream runs its ops in issue order, one at a time
                assert (b.start_R >= a.end_R - 1e-9).all(), (name, stream, a.name, b.name)
            for e in ev:
                assert (e.end_R >= e.start_R).all()
                end = np.maximum(end, e.end_R)
        for e in tl.events:
            if e.stream == "comm":  # a collective starts on every rank at once
                assert np.all(e.start_R == e.start_R[0])
        assert step_us == pytest.approx(float(end.max()))
        work[name] = Counter(e.name for e in tl.events)
    # the same ops in every schedule: two-batch issues each once per micro-batch
    assert work["none"] == work["shared-expert"]
    assert work["two-batch"] == Counter({k: 2 * v for k, v in work["none"].items()})
    # none runs everything in series: on no rank does compute run beside communication
    _, tl = tls["none"]
    comp = [e for e in tl.events if e.stream == "compute"]
    for c in (e for e in tl.events if e.stream == "comm"):
        for e in comp:
            assert not ((e.start_R < c.end_R - 1e-9) & (c.start_R < e.end_R - 1e-9)).any(), (e.name, c.name)
