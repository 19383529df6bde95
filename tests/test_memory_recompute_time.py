"""Recompute priced in the step's time (moonep_sim.step.recompute): full recompute adds exactly one
forward of the recomputed layers' compute to the backward, selective its modules' ops only (MLA's
up-projections included); the embedding and head are never recomputed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moonep_sim.experiments.scenario import Scenario
from moonep_sim.models import get_model
from moonep_sim.sim.topology import load_topology
from moonep_sim.step.compose import stack_ops
from moonep_sim.step.costs import step_cost_model
from moonep_sim.step.recompute import mla_up_proj_op
from moonep_sim.step.stack import step_shape

T = 256


def _model():
    m = get_model("deepseek-v2-lite")   # MLA with a dense first layer
    return dataclasses.replace(m, name="v2-lite-3l", layers=3, moe_layers=2)


@pytest.fixture(scope="module")
def steps():
    sc = Scenario(routing="gen:model=deepseek-v2-lite,maxvio=0.5,tokens-per-rank=256,seed=3", model=_model(),
                  cluster=(2, 2), topology="h800-cx7", strategies="alltoall")
    return {rc: sc.step("train", tokens_per_rank=T, context=T, recompute=rc) for rc in ("none", "selective", "full")}


def _compute_R(res, direction: str, layers_only: bool = True, names=None) -> np.ndarray:
    tl = res.timelines["alltoall"]
    out = np.zeros(tl.R)
    for e in tl.events:
        if e.stream != "compute" or e.direction != direction or (layers_only and e.layer < 0):
            continue
        if names is not None and e.name not in names:
            continue
        out += e.end_R - e.start_R - (e.slowed_R if e.slowed_R is not None else 0.0)
    return out


def test_full_recompute_adds_exactly_one_forward_of_the_layers(steps):
    none, full = steps["none"], steps["full"]
    fwd = _compute_R(none, "forward")   # every layer's forward compute, routed experts included, per rank
    assert fwd.min() > 0
    added = _compute_R(full, "backward", layers_only=False) - _compute_R(none, "backward", layers_only=False)
    assert added == pytest.approx(fwd, rel=1e-9)
    # the forward itself, the embedding and the head are unchanged
    assert _compute_R(full, "forward", layers_only=False) == pytest.approx(_compute_R(none, "forward", False), rel=1e-12)
    assert full.figures["alltoall"]["step_time_us"] > none.figures["alltoall"]["step_time_us"]


def test_selective_recompute_adds_its_modules_forward(steps):
    none, sel = steps["none"], steps["selective"]
    # the default selective modules: the attention core, the norms, MLA's up-projections
    core_norms = _compute_R(none, "forward", names={"attn_core", "norm"})
    m = _model()
    costs = step_cost_model(load_topology("h800-cx7"), "bf16", mode="train")
    ops = stack_ops(m, step_shape(m, "train", T, T))
    up = sum(costs.op_us(mla_up_proj_op(m, next(o for o in lo.before if o.name == "attn_proj"))) for lo in ops.layers)
    assert up > 0
    added = _compute_R(sel, "backward", False) - _compute_R(none, "backward", False)
    assert added == pytest.approx(core_norms + up, rel=1e-9)
    assert (added < _compute_R(none, "forward")).all()   # less than the full forward


def test_mla_up_projection_op_is_the_latent_up_projections():
    m = get_model("deepseek-v3")
    proj = stack_ops(m, step_shape(m, "train", 1024, 4096)).layers[0].before[2]
    assert proj.name == "attn_proj"
    up = mla_up_proj_op(m, proj, tp=4)
    n = m.heads // 4
    w = n * (m.head_dim + m.qk_rope_dim) * m.q_lora_rank + n * (m.head_dim + m.v_head_dim) * m.kv_lora_rank
    assert up.flops == pytest.approx(2.0 * proj.rows * w)
    assert mla_up_proj_op(get_model("qwen3-30b-a3b"), proj) is None
