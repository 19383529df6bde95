"""Processor sharing of a host's cores (``moonep_sim.sim.cpu.HostCPU``): hand-worked schedules and
properties (work conserved, no job faster than a core to itself, order by size)."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_sim.sim.cpu import HostCPU


def _run(cores: float, jobs: list[tuple[float, float]]) -> tuple[list[float], HostCPU]:
    """jobs: (arrival us, work us) -> completion times."""
    env = simpy.Environment()
    cpu = HostCPU(env, cores)
    done = [None] * len(jobs)

    def job(i, at, work):
        yield env.timeout(at)
        yield cpu.run(work)
        done[i] = env.now

    for i, (at, work) in enumerate(jobs):
        env.process(job(i, at, work))
    env.run()
    return done, cpu


@pytest.mark.parametrize("cores, jobs, want", [
    (2, [(0, 100)], [100]),                                       # alone: a core to itself
    (2, [(0, 100)] * 4, [200] * 4),                               # 4 on 2 cores: half speed
    (2, [(0, 100), (0, 100), (0, 100), (0, 300)], [200, 200, 200, 400]),  # the big one speeds up when alone
    (1, [(0, 100), (50, 100)], [150, 200]),                       # an arrival halves the running job's rate
    (4, [(0, 100), (0, 100)], [100, 100]),                        # more cores than jobs
    (2, [(0, 0), (0, 50)], [0, 50]),                              # no work: done at once
])
def test_hand_worked_schedules(cores, jobs, want):
    done, _ = _run(cores, jobs)
    assert done == pytest.approx(want)


def test_rejects_no_cores():
    with pytest.raises(ValueError, match=r"cores \(0\) must be > 0"):
        HostCPU(simpy.Environment(), 0)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 500), st.integers(1, 1000)), min_size=1, max_size=12))
def test_properties(cores, jobs):
    done, cpu = _run(float(cores), [(float(a), float(w)) for a, w in jobs])
    total = sum(w for _, w in jobs)
    assert cpu.busy_core_us == pytest.approx(total, rel=1e-9)  # every job's work done, nothing more
    for (a, w), t in zip(jobs, done):
        assert t >= a + w - 1e-6  # never faster than a core to itself
    assert max(done) >= min(a for a, _ in jobs) + total / cores - 1e-6  # never more than `cores` cores
    # jobs arriving together finish in the order of their work
    for (a1, w1), t1 in zip(jobs, done):
        for (a2, w2), t2 in zip(jobs, done):
            if a1 == a2 and w1 < w2:
                assert t1 <= t2 + 1e-6
