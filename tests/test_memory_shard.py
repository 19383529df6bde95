"""--optimizer-shard under a parallel layout: the dense weights' optimizer state sharded over the
ranks the flag names, in the memory account and in the optimizer step's time alike; a shard that
does not divide the ranks holding copies is one line, exit 2."""

from __future__ import annotations

import dataclasses

import pytest

from moonep_sim import cli
from moonep_sim.errors import ConfigError
from moonep_sim.experiments.scenario import Scenario
from moonep_sim.models import get_model
from moonep_sim.sim.topology import load_topology
from moonep_sim.step.layout_step import (GRAD_BUFFER_ZERO_BYTES_PER_PARAM, GRAD_NORM_BYTES_PER_PARAM,
                                         OPTIMIZER_BYTES_PER_PARAM, chunk_params)
from moonep_sim.step.memory import MemoryOptions, memory_for_layout
from moonep_sim.step.parallel import Parallel
from moonep_sim.step.stack import step_shape

PAR = Parallel(tp=2, pp=2, dp=4, ep=4, global_batch_size=8)


def _opt(shard: int) -> list[float]:
    m = get_model("deepseek-v3")
    mem = memory_for_layout(m, step_shape(m, "train", 4096, 4096), PAR, [], MemoryOptions(optimizer_shard=shard))
    return [st["parts"]["optimizer"] for st in mem["stages"]]


def test_optimizer_shard_divides_the_dense_optimizer_state_per_stage():
    one, two, four, default = _opt(1), _opt(2), _opt(4), _opt(0)
    assert default == four   # ZeRO-1's own group: dp x cp = 4
    for o1, o2, o4 in zip(one, two, four):
        dense = (o1 - o4) / (1 - 1 / 4)          # the stage's dense optimizer state, unsharded
        assert dense > 0
        assert o2 == pytest.approx(o4 + dense * (1 / 2 - 1 / 4))


def test_optimizer_shard_prices_the_optimizer_step_over_the_same_ranks():
    m = dataclasses.replace(get_model("olmoe-1b-7b"), name="olmoe-2l", layers=2, moe_layers=2)
    sc = Scenario(routing="gen:model=olmoe-1b-7b,maxvio=0.5,tokens-per-rank=128,seed=3", model=m, cluster=(4, 4),
                  topology="h800-cx7", strategies="alltoall")
    p = Parallel(dp=4, ep=4)
    topo = load_topology("h800-cx7")
    dense, expert = chunk_params(m, 0, 2, True, True)
    hbm = topo.gpu_mem_bandwidth_GBps * topo.gpu_mem_efficiency * 1e3
    for shard, over in ((0, 4), (2, 2), (1, 1)):
        f = sc.step("train", parallel=p, context=128, optimizer_shard=shard).figures["alltoall"]
        shard = dense / over + expert / 4
        want = (shard * (OPTIMIZER_BYTES_PER_PARAM + GRAD_NORM_BYTES_PER_PARAM)
                + (dense + expert / 4) * GRAD_BUFFER_ZERO_BYTES_PER_PARAM) / hbm
        assert f["pipeline_ranks"][0]["optimizer_us"] == pytest.approx(want, rel=1e-12)


def test_optimizer_shard_must_divide_the_ranks_holding_copies():
    m = get_model("deepseek-v3")
    with pytest.raises(ConfigError, match=r"--optimizer-shard \(3\) must divide dp x cp \(4 x 1 = 4\) of layout "
                                          r"TP2 PP2 DP4 EP4"):
        memory_for_layout(m, step_shape(m, "train", 4096, 4096), PAR, [], MemoryOptions(optimizer_shard=3))


def test_bad_optimizer_shard_under_a_layout_is_one_line(capsys):
    argv = ["step", "--gen", "model=olmoe-1b-7b,maxvio=1", "--strategies", "alltoall", "--distinct-layers", "1",
            "--tp", "2", "--dp", "4", "--ep", "4", "--optimizer-shard", "3"]
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--optimizer-shard (3) must divide dp x cp (4 x 1 = 4)" in err
