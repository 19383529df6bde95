"""The fused MoE kernel family (``fused-moe``): its layer time's closed form, by hand and against
the low-latency kernels' simulated segments on the same routing; its refusals and its flag."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.analysis.flags import strategy_flags
from moonep_sim.errors import ConfigError
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import CostModel
from moonep_sim.step.fused_moe import arch_of, fuse_direction, fused_layer_R
from moonep_sim.step.layer_sim import DirectionComm, simulate_moe_layer
from moonep_sim.strategies import make_plan
from moonep_sim.strategies.fused_moe import FUSED_KERNELS
from tests.test_step import SMALL, _ctx, _routing


def test_closed_form_by_hand():
    """max(dispatch + combine - their fixed costs, GEMM) + floor per rank; the layer ends at the
    slowest rank's kernel."""
    pre, exp, post = np.array([10.0, 30.0]), np.array([50.0, 20.0]), np.array([5.0, 5.0])
    assert fused_layer_R(pre, exp, post, 20.0).tolist() == [70.0, 55.0]
    d = DirectionComm(pre, exp, post, np.zeros(2), np.array([3.0, 3.0]), 85.0)
    f = fuse_direction(d, 20.0)
    assert f.pre_R.tolist() == [0.0, 0.0] and f.expert_R.tolist() == [70.0, 55.0]
    assert f.post_R.tolist() == [0.0, 15.0] and f.layer_us == 70.0 and f.plan_R.tolist() == [0.0, 0.0]
    assert (f.pre_R + f.expert_R + f.post_R).tolist() == [70.0, 70.0]   # less than the unfused 85 us
    # the kernels' fixed costs at their start (held heads) are replaced by the floor: rank 1 hides
    # 30 + 5 - (8 + 2) = 25 us of movement behind its 20 us GEMM -> 25 + 20
    held = DirectionComm(pre, exp, post, np.zeros(2), np.zeros(2), 85.0, pre_held=(np.array([8.0, 8.0]), np.zeros(2)),
                         post_held=(np.array([2.0, 2.0]), np.array([1.0, 1.0])))
    assert fuse_direction(held, 20.0).expert_R.tolist() == [70.0, 45.0]


def test_fused_layer_is_the_low_latency_segments_overlapped():
    """The same routing through deepep-ll and fused-moe: the fused kernel's time per rank is the
    closed form on the low-latency kernels' simulated dispatch, GEMM and combine, their fixed
    costs replaced by the one floor."""
    topo = load_topology("h200-cx7")
    r = _routing(SMALL, 32, seed=3)
    cm = CostModel(topo, "fp8")
    ll = simulate_moe_layer(make_plan("deepep-ll", r, _ctx(SMALL, topo)), SMALL, topo, cm, False)
    plan = make_plan("fused-moe", r, _ctx(SMALL, topo))
    fu = simulate_moe_layer(plan, SMALL, topo, cm, False)
    floor = FUSED_KERNELS["deepgemm-mega"].floor_us
    assert plan.options["floor_us"] == floor and plan.options["dtype"] == "fp8"
    lf = ll.forward
    fixed = lf.pre_held[0] + lf.post_held[0]      # the two kernels' launch and send issue
    assert (fixed > 0).all()
    want = np.maximum(lf.pre_R + lf.post_R - fixed, lf.expert_R) + floor
    np.testing.assert_allclose(fu.forward.expert_R, want, rtol=1e-12)
    np.testing.assert_allclose(fu.forward.pre_R + fu.forward.expert_R + fu.forward.post_R, want.max(), rtol=1e-12)
    assert fu.sm_share == 1.0 and fu.holds_sms and fu.host_wait_us == 0.0
    own = simulate_moe_layer(make_plan("fused-moe", r, _ctx(SMALL, topo), floor_us=0.0), SMALL, topo, cm, False)
    np.testing.assert_allclose(own.forward.expert_R, want - floor, rtol=1e-12)


def test_refuses_a_dtype_or_gpu_the_kernel_does_not_run():
    topo = load_topology("h200-cx7")
    r = _routing(SMALL, 16, seed=1)
    with pytest.raises(ConfigError, match=r"dtype \(bf16\) must be one of fp8"):
        make_plan("fused-moe", r, _ctx(SMALL, topo), dtype="bf16")
    with pytest.raises(ConfigError, match=r"floor_us"):
        make_plan("fused-moe", r, _ctx(SMALL, topo), floor_us=-3.0)
    with pytest.raises(ConfigError, match=r"gemm dtype \(bf16\) must be fp8 for fused-moe.kernel=deepgemm-mega"):
        simulate_moe_layer(make_plan("fused-moe", r, _ctx(SMALL, topo)), SMALL, topo, CostModel(topo, "bf16"), False)
    with pytest.raises(ConfigError, match=r"mode \(train\) must be decode or prefill for fused-moe.kernel=deepgemm"):
        simulate_moe_layer(make_plan("fused-moe", r, _ctx(SMALL, topo)), SMALL, topo, CostModel(topo, "fp8"), True)
    amd = load_topology("mi300x-cx7")
    plan = make_plan("fused-moe", r, _ctx(SMALL, amd))
    with pytest.raises(ConfigError, match=r"topology \(mi300x-cx7\) must have a GPU of hopper, blackwell"):
        simulate_moe_layer(plan, SMALL, amd, CostModel(amd, "fp8"), False)
    # Primus-Turbo's kernels: bf16 on gfx950 (MI350X) run; fp8 activations are refused
    mi350 = load_topology("mi350x")
    pt = make_plan("fused-moe", r, _ctx(SMALL, mi350), kernel="primus-turbo")
    assert pt.options["dtype"] == "bf16" and pt.options["floor_us"] == 40.0
    trained = simulate_moe_layer(pt, SMALL, mi350, CostModel(mi350, "bf16"), True)   # a training kernel
    assert trained.forward.layer_us > 40.0 and trained.backward.layer_us > 40.0
    with pytest.raises(ConfigError, match=r"dtype \(fp8\) must be one of bf16"):
        make_plan("fused-moe", r, _ctx(SMALL, mi350), kernel="primus-turbo", dtype="fp8")
    assert arch_of("mi350x") == "gfx950" and arch_of("gb200-nvl72") == "blackwell" and arch_of("mine.toml") == ""


def test_flagged_outside_one_nvlink_domain():
    assert [f["code"] for f in strategy_flags("fused-moe", {}, nodes=4)] == ["outside-library"]
    assert strategy_flags("fused-moe", {}, nodes=1) == []


@pytest.mark.parametrize("args", [["--opt", "fused-moe.kernel=nope"], ["--topology", "mi300x-cx7"],
                                  ["--gemm-dtype", "bf16"]])
def test_cli_bad_input_is_one_line_exit_2(args, capsys):
    from moonep_sim.cli import main
    base = ["step", "--gen", "model=deepseek-v3,maxvio=1", "--ranks", "8", "--mode", "decode", "--gemm-dtype", "fp8",
            "--tokens-per-rank", "8", "--strategies", "fused-moe", "--distinct-layers", "1", "--no-plots"]
    if "--topology" not in args:
        base += ["--topology", "h200-cx7"]
    try:
        rc = main(base + args)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
