"""The step's one options record: checked once when built, and what run_step and the layout search
refuse before any work."""

from __future__ import annotations

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.experiments import Scenario
from moonep_sim.experiments.layout_search import LayoutSpace, search_layouts
from moonep_sim.experiments.step import StepOptions, run_step
from moonep_sim.step.parallel import Parallel

SC = Scenario(routing="gen:model=mixtral-8x7b,tokens-per-rank=64", cluster=8, strategies="alltoall")


@pytest.mark.parametrize("kw, match", [
    (dict(mode="train", mtp_depth=1), r"^--mtp-depth \(1\) needs --mode decode \(mode train\)"),
    (dict(parallel=Parallel(dp=8, ep=8), static_tokens={"alltoall": 64}), r"^static buffers are not modelled under a layout"),
    (dict(mode="decode", contexts_R=[4096] * 8), r"^contexts per rank apply to a decode step under a layout"),
    (dict(mode="decode", parallel=Parallel(dp=8, ep=8), contexts_R=[4096] * 8),
     r"^contexts per rank \(8 given\) need a decode step under data-parallel attention"),
    (dict(mode="decode", parallel=Parallel(dp=8, ep=8, dp_attention=True), contexts_R=[4096] * 4),
     r"^contexts per rank \(4 given, least 4096\) must be one >= 1 per rank of the EP group \(8\)"),
    (dict(distinct_layers=-1), r"^distinct layers \(-1\) must be >= 0"),
])
def test_the_record_refuses_what_no_step_can_run(kw, match):
    with pytest.raises(ConfigError, match=match):
        StepOptions(**kw)


def test_contexts_are_kept_as_a_tuple_and_static_tokens_as_a_dict():
    o = StepOptions("decode", parallel=Parallel(dp=8, ep=8, dp_attention=True), contexts_R=[1, 2, 3, 4, 5, 6, 7, 8])
    assert o.contexts_R == (1, 2, 3, 4, 5, 6, 7, 8)
    assert StepOptions(static_tokens=None).static_tokens == {}
    assert "contexts_R" not in StepOptions().to_dict()          # the step document's keys as before


def test_run_step_and_the_search_take_the_records_only():
    with pytest.raises(ConfigError, match=r"^options \(str\) must be a StepOptions"):
        run_step(SC, "train")
    with pytest.raises(ConfigError, match=r"^space \(int\) and step \(str\) must be a LayoutSpace and a StepOptions"):
        search_layouts(SC, 8, "train")
    with pytest.raises(ConfigError, match=r"^step option compute_profile \('x.csv'\) does not apply to a layout search"):
        search_layouts(SC, LayoutSpace(8), StepOptions(compute_profile="x.csv"))
    with pytest.raises(ConfigError, match=r"^top \(0\) must be >= 1"):
        LayoutSpace(8, top=0)
