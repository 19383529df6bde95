"""Shared fixtures: tiny routings and contexts."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"

# keep torch single-threaded in tests: the machine has 2 cores and many tests spawn processes
os.environ.setdefault("OMP_NUM_THREADS", "1")

# no hypothesis test may fail on its 200 ms deadline or its too-slow health check (a timing of the
# example generation) because the machine is loaded; each @settings says deadline=None as well, this
# holds for one that forgets. The suite draws the same examples on every run (derandomize: a green
# main stays green); MOONEP_SIM_HYPOTHESIS=explore draws new ones, more of them, to look for cases
settings.register_profile("moonep-sim-tests", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          max_examples=200)
settings.load_profile(os.environ.get("MOONEP_SIM_HYPOTHESIS", "moonep-sim-tests"))


def pytest_configure(config):
    """No test reads or writes the machine user's files: the calibrated local-gloo topology
    (``~/.cache/moonep-sim/local-gloo.toml``, which any ``moonep-sim calibrate`` on the machine rewrites)
    and the step-time cache live in a folder of this run (child processes inherit it); a test that
    needs its own sets its own."""
    config._moonep_sim_home = tempfile.mkdtemp(prefix="moonep-sim-tests-")
    os.environ["MOONEP_SIM_HOME"] = config._moonep_sim_home
    os.environ["MOONEP_SIM_CACHE"] = os.path.join(config._moonep_sim_home, "cache")


def pytest_unconfigure(config):
    home = getattr(config, "_moonep_sim_home", None)
    if home:
        shutil.rmtree(home, ignore_errors=True)


def ref_entry_slots(ids_N: np.ndarray, alloc_ER: np.ndarray, slot_rank_S: np.ndarray,
                    slot_expert_S: np.ndarray) -> np.ndarray:
    """int64 [N] the slot of each entry when expert e's entries, in global order, are cut into
    consecutive pieces of ``alloc[e, 0], alloc[e, 1], ...`` entries, piece d going to e's slot on
    rank d (moonep's and costaware's split; the reference of ``plan.runs.split_runs`` as they call it)."""
    E, R = alloc_ER.shape
    slot_of_ER = np.full((E, R), -1, dtype=np.int64)
    slot_of_ER[slot_expert_S, slot_rank_S] = np.arange(slot_rank_S.size)
    out = np.empty(ids_N.size, dtype=np.int64)
    out[np.argsort(ids_N, kind="stable")] = np.repeat(slot_of_ER.ravel(), alloc_ER.ravel())
    return out


def tokens_per_expert_RE(plan) -> np.ndarray:
    """int64 [R, E] real rows each rank of ``plan`` computes per expert (copies included)."""
    flat = plan.slot_rank_S * plan.num_experts + plan.slot_expert_S
    return np.bincount(flat, weights=plan.slot_rows_S,
                       minlength=plan.ranks * plan.num_experts).reshape(plan.ranks, plan.num_experts).astype(np.int64)


def random_routing(T: int, K: int, E: int, seed: int = 0, skew: float = 0.0):
    """[T, K] distinct ids (Gumbel top-k over a popularity with lognormal ``skew``), weights."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(0, skew, E) if skew > 0 else np.zeros(E)
    g = logp[None, :] + rng.gumbel(size=(T, E))
    ids = np.argsort(-g, axis=1)[:, :K]
    w = rng.random((T, K)).astype(np.float32)
    return ids.astype(np.int64), w / w.sum(1, keepdims=True)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
