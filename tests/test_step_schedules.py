"""Overlap schedules as classes behind a registry (``moonep_sim.step.schedules``): the registry holds
the three built-in schedules, a bad name is one line, and a schedule defined in a test runs through
``compose`` with nothing else changed."""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.step import OVERLAPS, get_overlap
from moonep_sim.step.schedules import OVERLAP_SCHEDULES, LayerSchedule, Schedule


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
