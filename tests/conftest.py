"""Shared fixtures: tiny routings and contexts."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"

# keep torch single-threaded in tests: the machine has 2 cores and many tests spawn processes
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
