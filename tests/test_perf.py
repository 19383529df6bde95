"""PerfConfig: one frozen value with documented defaults, overridden by passing a value."""

from __future__ import annotations

import dataclasses

import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig


def test_overrides_make_a_new_value_and_leave_the_defaults():
    p = PerfConfig(plan_compiled_min=0, thread_min=5)
    assert (p.plan_compiled_min, p.thread_min, p.pair_rows_compiled_min) == (0, 5, DEFAULT_PERF.pair_rows_compiled_min)
    assert DEFAULT_PERF == PerfConfig() and DEFAULT_PERF.plan_compiled_min == 1 << 16
    assert DEFAULT_PERF.pair_table_max == 1 << 18
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_PERF.plan_compiled_min = 0  # type: ignore[misc]


@pytest.mark.parametrize("field, value", [("plan_compiled_min", -1), ("thread_min", 1.5), ("pair_rows_compiled_min", None),
                                          ("pair_table_max", True), ("pair_table_max", -2), ("validate_chunk", -1)])
def test_a_bad_setting_is_refused_with_its_name(field, value):
    with pytest.raises(ConfigError, match=rf"^{field} \({value!r}\) must be an integer >= 0$"):
        PerfConfig(**{field: value})
    with pytest.raises(TypeError):
        PerfConfig(no_such_setting=1)


def test_validate_chunk_must_hold_an_entry():
    with pytest.raises(ConfigError, match=r"^validate_chunk \(0\) must be >= 1: entries per chunk$"):
        PerfConfig(validate_chunk=0)
