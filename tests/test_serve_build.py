"""Building step-time models in pieces: the same grid whether built serially, in worker processes
or from the cache, and a simulator that keeps one (tokens, draw)'s routing over a grid's contexts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moonep_sim.experiments import Scenario
from moonep_sim.experiments.compare import load_topology
from moonep_sim.experiments.serve import ServeOptions, build_steptimes, step_simulator
from moonep_sim.models import get_model
from moonep_sim.serve import steptime as st
from moonep_sim.serve.deployment import Pool
from moonep_sim.step.parallel import Parallel

MODEL = "olmoe-1b-7b"
GRID = {"dec_T": [1, 4], "dec_C": [256, 1024], "pre_T": [16, 64], "pre_C": [256]}


def _opts(tmp_path, jobs=1, cache=True):
    base = Scenario(f"gen:model={MODEL},sigma=0.5", model=MODEL, cluster=8, topology="h100-cx7",
                    strategies=["alltoall", "deepep"])
    return ServeOptions(model=MODEL, topology="h100-cx7", strategies=("alltoall", "deepep"),
                        routing=f"gen:model={MODEL},sigma=0.5", draws=2, holdout=2,
                        cache=str(tmp_path / "c") if cache else None, scenario=base, jobs=jobs)


def _same(a, b):
    for s in a:
        for mode in ("decode", "prefill"):
            np.testing.assert_array_equal(getattr(a[s], mode).us_DTC, getattr(b[s], mode).us_DTC)


def test_routing_kept_over_contexts_gives_the_fresh_simulators_figures():
    base = Scenario(f"gen:model={MODEL},sigma=0.5", model=MODEL, cluster=8, topology="h100-cx7",
                    strategies=["alltoall"])
    m = get_model(MODEL)
    walk = step_simulator(base, m, 4, ["alltoall"], "none", 1, 0)
    walk("decode", 4, 256, 1)
    kept = walk("decode", 4, 1024, 1)              # same (T, draw): the routing drawn for C = 256 is reused
    fresh = step_simulator(base, m, 4, ["alltoall"], "none", 1, 0)("decode", 4, 1024, 1)
    assert kept == fresh


def test_pieces_assemble_to_the_serial_grid_and_the_cache_returns_it(tmp_path):
    m, topo = get_model(MODEL), load_topology("h100-cx7")
    pool = Pool("both", 1, Parallel(dp=4, ep=4, dp_attention=True))
    opts = _opts(tmp_path, cache=False)
    (got, info), = build_steptimes([(pool, GRID)], m, topo, opts)
    sim = step_simulator(opts.scenario, m, 4, opts.strategies, "none", 1, 0)
    want = st.build_grid(sim, opts.strategies, GRID["dec_T"], GRID["dec_C"], GRID["pre_T"], GRID["pre_C"], 2)
    _same(got, want)
    assert got["alltoall"].decode.us_DTC.shape == (2, 2, 2) and not info["cached"]
    assert set(info["holdout"]) == {"alltoall", "deepep"}
    c = _opts(tmp_path)
    (first, _), = build_steptimes([(pool, GRID)], m, topo, c)
    (again, info2), = build_steptimes([(pool, GRID)], m, topo, c)
    assert info2["cached"]
    _same(first, again)
    _same(first, want)


@pytest.mark.slow
def test_worker_processes_build_the_same_models(tmp_path):
    m, topo = get_model(MODEL), load_topology("h100-cx7")
    pools = [(Pool("both", 1, Parallel(dp=4, ep=4, dp_attention=True)), GRID),
             (Pool("both", 1, Parallel(dp=8, ep=8, dp_attention=True)), dict(GRID, dec_T=[1, 2]))]
    one = build_steptimes(pools, m, topo, _opts(tmp_path, cache=False))
    two = build_steptimes(pools, m, topo, dataclasses.replace(_opts(tmp_path, cache=False), jobs=2))
    for (a, ia), (b, ib) in zip(one, two):
        _same(a, b)
        assert ia["holdout"]["deepep"]["median_abs_rel_error"] == ib["holdout"]["deepep"]["median_abs_rel_error"]
