"""benchmarks/fidelity_efa.py: the p5 per-layer rows counted and swept as DeepEP's internode test
does (hand counts of the test's grid and of its "RDMA" bytes; no full run of the bench)."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def fe(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("fidelity_efa")


def test_sweep_grids_are_the_tests_loops(fe):
    # dispatch: nvl 4, 8, ..., 44 (11) x rdma 4, 8, ..., 32 (8); combine: nvl 1..7 (7) x rdma 8..32 (7)
    assert len(fe.DISPATCH_GRID) == 11 * 8 and len(fe.COMBINE_GRID) == 7 * 7
    assert fe.DISPATCH_GRID[0] == (4, 4) and fe.DISPATCH_GRID[-1] == (44, 32)
    assert fe.COMBINE_GRID[0] == (1, 8) and fe.COMBINE_GRID[-1] == (7, 32)
    # every family's own Config at EP32 / EP64 is one point of the sweep, so the best is never slower
    from moonep_sim.plan.kernel import UCCL_CHUNKS, V1_CHUNKS, chunk_for

    for chunks in (V1_CHUNKS, UCCL_CHUNKS):
        for ep in (32, 64):
            c = chunk_for(chunks, ep)
            assert (c.dispatch_nvl, c.dispatch_rdma) in fe.DISPATCH_GRID
            assert (c.combine_nvl, c.combine_rdma) in fe.COMBINE_GRID


def _plan(impl="deepep-nvshmem-efa"):
    from moonep_sim.models import get_model
    from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
    from moonep_sim.strategies import PlanContext, make_plan

    # 16 ranks on 2 nodes, 16 experts per rank: rank 0 has two tokens, the first to experts of node 0
    # only (1 (token, node) pair), the second to both nodes (2 pairs)
    ids = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [0, 16, 128, 129, 144, 200, 250, 255]])
    tokens = np.zeros(16, np.int64)
    tokens[0] = 2
    g = GlobalRouting(ids, np.ones_like(ids, dtype=np.float32), tokens, 256)
    ctx = PlanContext(ClusterShape(16, 8), Placement.home_groups(256, 16),
                      RowCosts.from_model(get_model("deepseek-v3"), "bf16"), 1)
    return make_plan("deepep", g, ctx, sms=24, impl=impl)


def test_rdma_bytes_are_unique_token_node_pairs_own_node_included(fe):
    plan = _plan()
    assert fe.rdma_counted_bytes(plan) == pytest.approx(3 / 16 * 2 * 7168)


def test_with_chunk_sets_one_config_for_both_directions(fe):
    plan = fe.with_chunk(_plan("uccl-ep"), 4, 28)
    (c,) = plan.kernel.chunks
    assert (c.ranks, c.rows("dispatch", True), c.rows("dispatch", False)) == (16, 28, 4)
    assert (c.rows("combine", True), c.rows("combine", False)) == (28, 4)
    assert plan.kernel.family == "uccl-ep"


@pytest.mark.slow
def test_swept_point_is_never_slower_than_the_own_table(fe):
    # the family's own Config at EP32 is a point of the test's grid, so the test's best is at least it
    from moonep_sim.sim import load_topology

    r = fe.point("deepep-nvshmem-efa", 32, "dispatch", load_topology("h100-efa"))
    assert r["chunk"] in fe.DISPATCH_GRID
    assert r["swept"] >= r["own"] * (1 - 1e-12)
