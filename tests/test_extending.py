"""docs/extending.md's one-file examples of an attention kind and an overlap schedule run as written:
each registers into a copy of its registry (undone after the test) and a step runs with it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from moonep_sim import models
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.routing.generators import generate_layer
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import StepConfig, simulate_step, step_shape
from moonep_sim.step import attention, schedules
from moonep_sim.step.ops import StepShape
from moonep_sim.strategies import PlanContext

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
R, G = 8, 4


def _example(name: str) -> str:
    m = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```\n<!-- end example -->", DOC.read_text(), re.S)
    assert m, f"docs/extending.md lost its {name} example"
    return m.group(1)


def _step(model, mode, overlap, tokens=64, context=None):
    topo = load_topology("h800-cx7")
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(model.num_experts, R), RowCosts.from_model(model), 1,
                      topo)
    lr = generate_layer(model.num_experts, model.top_k, tokens * R, 0, maxvio=2.0)
    r = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, model.num_experts, R)
    cfg = StepConfig(model, topo, ctx, (("moonep", {}),), step_shape(model, mode, tokens, context), overlap, None)
    res = simulate_step(cfg, lambda i: (i, r, f"layer {i}"), pipeline=False)
    return res["strategies"]["moonep"], res["_timelines"]["moonep"]


def _model(kind: str) -> ModelSpec:
    return ModelSpec(f"m-{kind}", 3, 2, 32, 4, 2, 256, 128, attention=f"{kind},gqa", heads=4, kv_heads=2,
                     head_dim=64, sliding_window=64, max_context=8192, vocab=1000, dense_ffn=512)


@pytest.fixture
def chunked(monkeypatch):
    monkeypatch.setattr(attention, "ATTENTION", attention.ATTENTION.copy())
    monkeypatch.setattr(models, "ATTENTION_KINDS", models.ATTENTION_KINDS + ("chunked",))
    exec(compile(_example("chunked-attention"), str(DOC), "exec"), {"__name__": "chunked"})
    return attention.attention_kind("chunked")


def test_the_docs_attention_kind_runs_as_written(chunked):
    m, W = _model("chunked"), 64
    # decode: a query attends to its position in the current chunk; the cache holds one chunk
    C = 3 * W + 5
    op = chunked.core(m, StepShape("decode", 8, C))
    assert op.flops == 2.0 * 8 * 4 * 6 * 128
    assert chunked.cache_bytes(m, StepShape("decode", 8, C)) == 8 * W * (2 * 2 * 64) * 2
    # whole sequences of 2 chunks: the mean of (p mod W) + 1 is (W + 1) / 2
    assert chunked.keys(m, StepShape("prefill", 2 * W, 2 * W)) == (W + 1) / 2
    # within one chunk it is plain GQA: the same step, to the last bit of the op prices
    for mode in ("train", "prefill"):
        a, _ = _step(m, mode, "none", tokens=W)
        b, _ = _step(_model("gqa"), mode, "none", tokens=W)
        assert a["step_time_us"] == pytest.approx(b["step_time_us"], rel=1e-12)
        assert a["peak_memory_bytes"] == b["peak_memory_bytes"]
    # past one chunk it attends to fewer keys than full attention
    a, _ = _step(m, "decode", "none", tokens=16, context=C)
    b, _ = _step(_model("gqa"), "decode", "none", tokens=16, context=C)
    assert a["step_time_us"] < b["step_time_us"] and a["peak_memory_bytes"] < b["peak_memory_bytes"]


@pytest.fixture
def shared_combine(monkeypatch):
    monkeypatch.setattr(schedules, "OVERLAP_SCHEDULES", schedules.OVERLAP_SCHEDULES.copy())
    exec(compile(_example("shared-beside-combine"), str(DOC), "exec"), {"__name__": "shared_combine"})
    return schedules.get_overlap("shared-combine")


def test_the_docs_overlap_schedule_runs_as_written(shared_combine):
    m = _model("gqa")
    d, tl = _step(m, "prefill", "shared-combine")
    ev = {(e.name, e.layer): e for e in tl.events}
    for l in range(m.dense_layers, m.layers):
        ex, sh, cb = ev[("expert", l)], ev[("shared_expert", l)], ev[("combine", l)]
        np.testing.assert_array_equal(sh.start_R, ex.end_R)  # right after the routed experts ...
        assert (sh.start_R < cb.end_R).all()  # ... while the combine runs
    # the shared experts leave the dispatch's way: never later than all in series
    serial, _ = _step(m, "prefill", "none")
    assert d["step_time_us"] <= serial["step_time_us"]
    tr, _ = _step(m, "train", "shared-combine")
    assert tr["step_time_us"] > d["step_time_us"]
    assert "shared-combine" not in schedules.OVERLAPS
