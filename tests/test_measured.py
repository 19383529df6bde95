"""Measured op times from AIConfigurator's tables (moonep_sim.step.measured): the table read back
at its own grid points, the preset -> GPU mapping, the cost model's hook and the sources a step
reports; without the package everything stays on the roofline, flagged."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.sim.topology import load_topology
from moonep_sim.step import CostModel
from moonep_sim.step.costs import ROOFLINE
from moonep_sim.step.measured import load_measured, system_for
from moonep_sim.step.stack import Op


def test_presets_map_to_their_gpu_table_or_the_nearest_die():
    assert system_for("h100-efa") == ("h100_sxm", "own") and system_for("h200-cx7") == ("h200_sxm", "own")
    assert system_for("b200") == ("b200_sxm", "own") and system_for("gb200-nvl72") == ("gb200", "own")
    assert system_for("h800-cx7") == ("h100_sxm", "nearest-die") and system_for("h20-roce200")[1] == "nearest-die"
    assert system_for("mi300x-cx7") is None and system_for("local-gloo") is None


def test_without_the_package_every_op_is_on_the_roofline(monkeypatch):
    import moonep_sim.step.measured as meas

    monkeypatch.setattr(meas, "available", lambda: False)
    assert meas.load_measured(load_topology("h100-cx7")) is None
    cm = CostModel(load_topology("h100-cx7"))
    op = Op("attn_proj", "gemm", 2.0 * 64 * 7168 * 4096, 7168 * 4096 * 2.0, 64, "tokens=64", 7168)
    assert cm.op_source(op) == ROOFLINE and cm.expert_source() == ROOFLINE


def test_table_reads_back_its_own_grid_points_and_the_cost_model_uses_it():
    pytest.importorskip("aiconfigurator_core")
    pd = pytest.importorskip("pandas")
    topo = load_topology("h100-cx7")
    meas = load_measured(topo)
    tab = meas.gemm("bf16")
    assert tab is not None and "h100_sxm/gemm" in tab.source
    # a grid point comes back as the table's own median latency (ms -> us)
    path = tab.source.split()[1]
    df = pd.read_parquet(meas_root() / path / "gemm_perf.parquet")
    kern = tab.source.split()[2]
    row = df[(df.kernel_source == kern) & (df.m == 1024) & (df.n == 4096) & (df.k == 7168)]
    assert float(tab.us(1024, 4096, 7168)) == pytest.approx(float(row.latency.median()) * 1e3, rel=1e-9)
    # beyond the grid's n: the FLOP ratio of the last point
    assert float(tab.us(1024, 2 * 65536, 7168)) == pytest.approx(2 * float(tab.us(1024, 65536, 7168)), rel=1e-9)
    cm = CostModel(topo, measured=meas)
    op = Op("attn_proj", "gemm", 2.0 * 1024 * 4096 * 7168, 4096 * 7168 * 2.0, 1024, "tokens=1024", 7168)
    assert cm.op_us(op) == pytest.approx(float(tab.us(1024, 4096, 7168)), rel=1e-9)
    assert cm.op_source(op).startswith("measured")
    attn = Op("attn_core", "attention", 1e9, 1e6, 1024, "tokens=1024")
    assert cm.op_source(attn) == ROOFLINE and cm.op_us(attn) == cm.roofline_op_us(attn)
    # the held-out check: interior grid points interpolated from their neighbours in m
    h = tab.held_out()
    assert h["points"] > 1000 and 0 <= h["median_abs"] < 0.2


def test_nearest_die_scales_the_h100_table_by_the_roofline_ratio():
    pytest.importorskip("aiconfigurator_core")
    h20, h100 = load_topology("h20"), load_topology("h100-cx7")
    meas = load_measured(h20)
    assert meas.how == "nearest-die" and "nearest-die" in meas.label("bf16")
    op = Op("dense_ffn", "gemm", 2.0 * 4096 * 3 * 7168 * 18432, 3 * 7168 * 18432 * 2.0, 4096, "tokens=4096", 7168)
    own = CostModel(h100, measured=load_measured(h100)).op_us(op)
    got = CostModel(h20, measured=meas).op_us(op)
    ratio = CostModel(h20).roofline_op_us(op) / CostModel(h100).roofline_op_us(op)
    assert got == pytest.approx(own * ratio, rel=1e-9) and ratio > 3  # compute-bound: H20's far lower peak


def meas_root():
    from moonep_sim.step.measured import data_root

    return data_root()


def test_a_step_says_which_op_came_from_which_source():
    pytest.importorskip("aiconfigurator_core")
    from moonep_sim.step import StepConfig, simulate_step, step_shape
    from tests.test_step import SMALL, _ctx, _routing

    topo = load_topology("h100-cx7")
    r = _routing(SMALL, 64)
    cfg = StepConfig(SMALL, topo, _ctx(SMALL, topo), (("alltoall", {}),), step_shape(SMALL, "train", 64, None),
                     "none", CostModel(topo, measured=load_measured(topo)))
    src = simulate_step(cfg, lambda i: (0, r, "layer"))["compute_sources"]
    for op in ("attn_proj", "router", "lm_head", "dense_ffn", "attn_proj_bwd", "expert", "expert_bwd"):
        assert src[op].startswith("measured (aiconfigurator-core h100_sxm/gemm"), op
    assert src["attn_core"].startswith("measured (aiconfigurator-core h100_sxm/attention")   # GQA, 4 heads
    assert src["attn_core_bwd"].endswith("at 542/638 of the forward's rate (FlashAttention-3)")
    for op in ("norm", "embed", "loss"):
        assert src[op] == ROOFLINE, op
    plain = simulate_step(StepConfig(SMALL, topo, _ctx(SMALL, topo), (("alltoall", {}),),
                                     step_shape(SMALL, "train", 64, None), "none"), lambda i: (0, r, "layer"))
    assert {v for k, v in plain["compute_sources"].items() if k != "launch"} == {ROOFLINE}
    assert plain["compute_sources"]["launch"] == "not charged"


def test_fitted_constants_replace_the_assumed_ones_for_gemms_only():
    from moonep_sim.step.costs import fitted_constants

    topo = load_topology("h800-cx7")
    f = fitted_constants("h800-cx7", "bf16")
    assert f is not None and f["source"].startswith("FITTED on h100_sxm") and fitted_constants("mi300x", "bf16") is None
    cm = CostModel(topo, fitted=f)
    op = Op("attn_proj", "gemm", 2.0 * 256 * 7168 * 4096, 7168 * 4096 * 2.0, 256, "tokens=256", 7168)
    want = max(op.flops / (topo.gpu_tflops * f["compute_efficiency"] * 1e6 * 256 / (256 + f["half_rows"])),
               op.bytes / (topo.gpu_mem_bandwidth_GBps * f["mem_efficiency"] * 1e3))
    assert cm.op_us(op) == pytest.approx(want, rel=1e-12)
    norm = Op("norm", "bytes", 0.0, 1e6, 256, "tokens=256")
    assert cm.op_us(norm) == CostModel(topo).op_us(norm)       # not a GEMM: the topology's HBM efficiency
    assert cm.op_source(op).startswith("roofline-compute (GEMM constants FITTED on")


def test_gqa_attention_is_read_from_the_measured_tables_in_prefill_and_decode():
    pytest.importorskip("aiconfigurator_core")
    from moonep_sim.models import get_model
    from moonep_sim.step.measured import ATTN_BWD_FACTOR, attention_table
    from moonep_sim.step.stack import backward_op, layer_ops, step_shape

    m, topo = get_model("qwen3-30b-a3b"), load_topology("h100-cx7")
    cm = CostModel(topo, measured=load_measured(topo))
    ctx = attention_table("h100_sxm", "context")
    row = ctx[(ctx.num_heads == m.heads) & (ctx.num_key_value_heads == m.kv_heads) & (ctx.head_dim == m.head_dim)
              & (ctx.window_size == 0) & (ctx.batch_size == 1) & (ctx.isl == 4096)]
    assert len(row)  # a grid point: read back as measured
    op = next(o for o in layer_ops(m, 0, step_shape(m, "train", 4096, 4096)).before if o.name == "attn_core")
    assert cm.op_us(op) == pytest.approx(float(row.us.median()), rel=1e-9)
    assert cm.op_us(backward_op(op)) == pytest.approx(ATTN_BWD_FACTOR * float(row.us.median()), rel=1e-9)
    assert "fa3 context" in cm.op_source(op)
    dec = next(o for o in layer_ops(m, 0, step_shape(m, "decode", 128, 4096)).before if o.name == "attn_core")
    assert "fa3 generation" in cm.op_source(dec) and cm.op_us(dec) > 0
    # MLA has no attn dims: the roofline, flagged
    ds = get_model("deepseek-v3")
    mla = next(o for o in layer_ops(ds, 3, step_shape(ds, "decode", 128, 4096)).before if o.name == "attn_core")
    assert cm.op_source(mla) == ROOFLINE


def _balanced_plan(model, ranks: int, tokens: int, topo):
    """A ``deepep`` plan of a routing where token t picks experts t*K .. t*K+K-1 (mod E): every
    expert the same rows."""
    from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
    from moonep_sim.strategies import PlanContext, make_plan

    T = ranks * tokens
    ids = (np.arange(T)[:, None] * model.top_k + np.arange(model.top_k)[None, :]) % model.num_experts
    w = np.full(ids.shape, 1.0 / model.top_k, np.float32)
    routing = GlobalRouting.split_evenly(ids.astype(np.int64), w, model.num_experts, ranks)
    ctx = PlanContext(ClusterShape(ranks, 8), Placement.home_groups(model.num_experts, ranks),
                      RowCosts.from_model(model, "fp8"), 1, topo)
    return make_plan("deepep", routing, ctx)


def test_grouped_experts_read_as_one_gemm_match_the_measured_moe_table():
    """DeepSeek-V3 EP32 decode (64 tokens per rank: 8 experts of 64 rows on each rank, FP8): the
    rank's experts read from the GEMM table as one GEMM with their N side by side land within 10%
    of AIConfigurator's own measured DeepEP MoE table at that point (a different table: the
    grouped kernel as SGLang runs it), where reading them one expert at a time is > 25% over it."""
    pytest.importorskip("aiconfigurator_core")
    pd = pytest.importorskip("pandas")
    from moonep_sim.models import get_model
    from moonep_sim.step.measured import data_root

    f = data_root() / "h100_sxm" / "moe" / "sglang" / "0.5.10" / "wideep_generation_moe_perf.parquet"
    if not f.is_file():
        pytest.skip("no wideep MoE table in this aiconfigurator-core")
    d = pd.read_parquet(f)
    ref = float(d[(d.moe_ep_size == 32) & (d.num_tokens == 64) & (d.distribution == "uniform")].latency.iloc[0]) * 1e3
    topo = load_topology("h100-cx7")
    m = get_model("deepseek-v3")
    cm = CostModel(topo, "fp8", measured=load_measured(topo))
    plan = _balanced_plan(m, 32, 64, topo)
    assert (plan.slot_rows_S[plan.slot_rows_S > 0] == 64).all()
    grouped = float(cm.expert_us_R(plan, m).max()) - topo.gpu_launch_us
    D, F = m.hidden, m.expert_ffn
    one_at_a_time = 8 * float(cm.measured.gemm_us("fp8", 64, 2 * F, D) + cm.measured.gemm_us("fp8", 64, D, F))
    assert grouped == pytest.approx(ref, rel=0.10)
    assert one_at_a_time > 1.25 * ref


def test_grouped_experts_change_little_where_each_expert_fills_the_gpu():
    """At training sizes (8192 rows per expert) the experts side by side cost within 10% of one at a
    time: each expert's GEMM already fills the SMs."""
    pytest.importorskip("aiconfigurator_core")
    from moonep_sim.models import get_model

    topo = load_topology("h100-cx7")
    m = get_model("deepseek-v3")
    cm = CostModel(topo, "fp8", measured=load_measured(topo))
    plan = _balanced_plan(m, 64, 4096, topo)
    c = int((plan.slot_rows_S > 0).sum() // 64)
    rows = float(plan.slot_rows_S[plan.slot_rows_S > 0][0])
    grouped = float(cm.expert_us_R(plan, m).max()) - topo.gpu_launch_us
    D, F = m.hidden, m.expert_ffn
    one_at_a_time = c * float(cm.measured.gemm_us("fp8", rows, 2 * F, D) + cm.measured.gemm_us("fp8", rows, D, F))
    assert grouped == pytest.approx(one_at_a_time, rel=0.10)
