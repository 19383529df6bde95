"""The ops the step used to miss: FP8 casts, the router's top-k, the token permutation around the
routed experts -- by hand against their byte counts."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.models import get_model
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import CostModel, step_shape
from moonep_sim.step.costs import PERMUTE_PASSES, Profile
from moonep_sim.step.stack import backward_op, layer_ops
from moonep_sim.strategies import make_plan
from tests.test_step import SMALL, _ctx, _routing


def test_casts_and_top_k_by_hand():
    m = get_model("deepseek-v3")
    T, H = 4096, m.hidden
    lo = layer_ops(m, m.dense_layers, step_shape(m, "train", T, T))
    names = [o.name for o in lo.before]
    assert names.count("quantize") == 2 and names[-1] == "router_topk"   # attention input, MoE input
    q, qm = [o for o in lo.before if o.name == "quantize"]
    topo = load_topology("h800-cx7")
    mem = topo.mem_bytes_per_us
    # every distinct FP8 GEMM input of MLA's projections: the layer input, q and kv latents, the heads' output
    width = H + m.q_lora_rank + m.kv_lora_rank + m.heads * (m.v_head_dim or m.head_dim)
    assert CostModel(topo, "fp8").op_us(q) == pytest.approx(T * width * (2 + 1 + 4 / 128) / mem)
    # the MoE input and the shared expert's intermediate rows
    assert CostModel(topo, "fp8").op_us(qm) == pytest.approx(T * (H + m.expert_ffn) * (2 + 1 + 4 / 128) / mem)
    assert CostModel(topo, "bf16").op_us(q) == 0.0                       # no FP8 GEMM, no cast
    assert CostModel(topo, "fp8").op_us(backward_op(q)) == pytest.approx(2 * CostModel(topo, "fp8").op_us(q))
    topk = lo.before[-1]
    assert CostModel(topo).op_us(topk) == pytest.approx(3.0 * T * m.num_experts * 4 / mem)


def test_a_profile_may_leave_the_casts_out():
    topo = load_topology("h800-cx7")
    lo = layer_ops(SMALL, SMALL.dense_layers, step_shape(SMALL, "prefill", 64, None))
    prof = Profile("p.csv", {(o.name, "*"): 1.0 for o in (*lo.before, lo.router, lo.shared) if o is not None
                             and o.name not in ("quantize", "router_topk")})
    cm = CostModel(topo, "fp8", profile=prof)
    assert cm.missing_ops([*lo.before, lo.router]) == []
    q = next(o for o in lo.before if o.name == "quantize")
    assert cm.op_us(q) == cm.roofline_op_us(q) and cm.op_source(q) == "roofline-compute"


def test_permutation_is_charged_per_routed_row_except_for_a_zero_copy_kernel():
    topo = load_topology("h800-cx7")
    r = _routing(SMALL, 64)
    for strategy, pays in (("deepep", True), ("moonep", False)):
        plan = make_plan(strategy, r, _ctx(SMALL, topo))
        base = CostModel(topo).expert_us_R(plan, SMALL)
        got = CostModel(topo, permute=True).expert_us_R(plan, SMALL)
        rows = np.bincount(plan.slot_rank_S, weights=plan.slot_padded_S.astype(float), minlength=plan.ranks)
        want = rows * PERMUTE_PASSES * SMALL.dispatch_hidden * 2.0 / topo.mem_bytes_per_us if pays else 0 * rows
        np.testing.assert_allclose(got - base, want, rtol=1e-9, atol=1e-9)


def test_projections_are_read_one_gemm_at_a_time_from_a_measured_table():
    pytest.importorskip("aiconfigurator_core")
    from moonep_sim.step.measured import load_measured

    m = get_model("deepseek-v3")
    lo = layer_ops(m, m.dense_layers, step_shape(m, "prefill", 512, 512))
    proj = next(o for o in lo.before if o.name == "attn_proj")
    H, n = m.hidden, m.heads
    assert proj.parts == ((m.q_lora_rank, H), (n * (m.head_dim + m.qk_rope_dim), m.q_lora_rank),
                          (m.kv_lora_rank + m.qk_rope_dim, H), (n * (m.head_dim + (m.v_head_dim or m.head_dim)),
                                                               m.kv_lora_rank), (H, n * (m.v_head_dim or m.head_dim)))
    topo = load_topology("h100-cx7")
    meas = load_measured(topo)
    want = sum(float(meas.gemm_us("bf16", 512, a, b)) for a, b in proj.parts)
    assert CostModel(topo, measured=meas).op_us(proj) == pytest.approx(want, rel=1e-12)
    bwd = sum(float(meas.gemm_us("bf16", 512, b, a)) + float(meas.gemm_us("bf16", b, a, 512)) for a, b in proj.parts)
    # the weight gradients accumulate into FP32: 8 bytes per weight read and written over HBM
    from moonep_sim.step.costs import WGRAD_ACC_BYTES

    cm = CostModel(topo, measured=meas)
    bwd += WGRAD_ACC_BYTES * sum(a * b for a, b in proj.parts) / cm.gemm_mem_bytes_per_us
    assert cm.op_us(backward_op(proj)) == pytest.approx(bwd, rel=1e-12)


def test_launch_costs_per_kernel_eager_and_in_a_cuda_graph():
    from moonep_sim.step.costs import HOST_LAUNCH_US, KERNEL_GAP_GRAPH_US, KERNEL_GAP_STREAM_US
    from moonep_sim.step.ops import Op

    topo = load_topology("h100-cx7")
    tiny = Op("router", "gemm", 2.0 * 8 * 64 * 64, 64 * 64 * 2.0, 8, "tokens=8", 64)
    big = Op("dense_ffn", "gemm", 2.0 * 4096 * 3 * 7168 * 18432, 3 * 7168 * 18432 * 2.0, 4096, "tokens=4096", 7168,
             ((2 * 18432, 7168), (7168, 18432)))
    base = CostModel(topo)
    assert CostModel(topo, launch="graph").op_us(big) == pytest.approx(base.op_us(big) + 2 * KERNEL_GAP_GRAPH_US)
    assert CostModel(topo, launch="eager").op_us(big) == pytest.approx(base.op_us(big) + 2 * KERNEL_GAP_STREAM_US)
    assert CostModel(topo, launch="eager").op_us(tiny) == HOST_LAUNCH_US          # bound by the host's submit
    assert CostModel(topo, launch="eager").op_us(backward_op(big)) >= 4 * HOST_LAUNCH_US


def test_the_legacy_cost_model_prices_as_the_step_did_before_these_terms():
    """``legacy``: no cast or top-k cost, FP8 at exactly twice the BF16 roofline, no measured
    tables or launches whatever ``step_cost_model`` would pick; its layers hold the SMs and pay no
    host wait."""
    from moonep_sim.step.costs import cost_model_preset, step_cost_model
    from moonep_sim.step.layer_sim import simulate_moe_layer

    m = get_model("deepseek-v3")
    T = 4096
    lo = layer_ops(m, m.dense_layers, step_shape(m, "train", T, T))
    q, topk = [o for o in lo.before if o.name == "quantize"][0], lo.before[-1]
    topo = load_topology("h800-cx7")
    with cost_model_preset("legacy"):
        legacy = step_cost_model(topo, "fp8", mode="train")
    assert legacy.legacy and legacy.measured is None and legacy.launch == "none" and not legacy.permute
    assert legacy.op_us(q) == 0.0 and legacy.op_us(topk) == 0.0
    assert legacy.gemm_flops_per_us == pytest.approx(2 * topo.gpu_tflops * topo.gpu_compute_efficiency * 1e6)
    assert not step_cost_model(topo, "fp8", mode="train").legacy      # the preset ends with its block
    with pytest.raises(Exception, match="must be one of"):
        with cost_model_preset("old"):
            pass
    t = load_topology("h800-cx7")
    r = _routing(SMALL, 32, seed=3)
    for name in ("deepep", "deepep-ll"):
        plan = make_plan(name, r, _ctx(SMALL, t))
        now = simulate_moe_layer(plan, SMALL, t, CostModel(t), False)
        old = simulate_moe_layer(plan, SMALL, t, CostModel(t, legacy=True), False)
        assert old.holds_sms and old.host_wait_us == 0.0
        assert now.host_wait_us == (plan.kernel.host_wait_us if plan.kernel is not None else 0.0)
    assert not now.holds_sms   # deepep-ll frees its SMs in flight under the current model
