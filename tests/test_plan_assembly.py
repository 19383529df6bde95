"""``assemble_plan`` and its layout equal their slow references element-wise.

:func:`moonep_sim.plan.slot_layout` then ``final_rows`` return the same arrays (values and dtypes)
in both forms -- the compiled counting sort and the readable reference -- on layers above the
compiled threshold, with and without dropped entries, token padding, minimum rows and empty slots. ``assemble_plan`` (fed
the named records of ``moonep_sim.plan.assembly``) must equal
the reference ``assemble_plan`` of ``tests/plan_reference.py``, arrived padding rows included.
"""

from __future__ import annotations

import numpy as np
import pytest

from moonep_sim.errors import PlanError
from moonep_sim.plan import (ClusterShape, Entries, GlobalRouting, Padding, RowCosts, Slots, assemble_plan,
                             final_rows, slot_layout)
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
import plan_reference as reference

R = 8
CHUNK = 1 << 15  # a unit of the table's sizes: 2 * CHUNK is the compiled builders' threshold
COMPILED, READABLE = PerfConfig(plan_compiled_min=0), PerfConfig(plan_compiled_min=1 << 62)

# name: (entries, slots, drop share, token padding, minimum rows, empty slots)
CASES = {
    "all kept, no padding": (4 * CHUNK, 40, 0.0, 1, False, False),
    "dropped entries": (4 * CHUNK + 17, 40, 0.1, 1, False, False),
    "token padding": (5 * CHUNK, 24, 0.0, 8, False, False),
    "minimum rows and drops": (4 * CHUNK, 40, 0.05, 1, True, False),
    "empty slots, padding, drops": (6 * CHUNK + 3, 64, 0.2, 4, True, True),
    "small (plain path)": (1000, 16, 0.1, 2, False, False),
}


def _case(n, S, drop, seed, empty):
    rng = np.random.default_rng(seed)
    slot_rank = np.sort(rng.integers(0, R, S))
    slot_rank[0], slot_rank[-1] = 0, R - 1  # first and last rank hold a slot
    p = rng.random(S) + 0.05
    if empty:
        p[rng.choice(S, S // 4, replace=False)] = 0.0  # slots no entry picks
    entry_slot = rng.choice(S, n, p=p / p.sum()).astype(np.int64)
    entry_slot[rng.random(n) < drop] = -1
    buf_row = rng.integers(0, 10 * n, n).astype(np.int64)
    buf_row[entry_slot < 0] = -1
    return slot_rank.astype(np.int64), entry_slot, buf_row


def test_cases_cover_the_regimes():
    """The table reaches the compiled builders' threshold in every case but the small one, and each
    regime."""
    chunked = [n >= DEFAULT_PERF.plan_compiled_min for n, *_ in CASES.values()]
    assert sum(chunked) == len(CASES) - 1
    assert any(c[2] > 0 for c in CASES.values()) and any(c[3] > 1 for c in CASES.values())
    assert any(c[4] for c in CASES.values()) and any(c[5] for c in CASES.values())


@pytest.mark.parametrize("name", list(CASES))
def test_slot_layout_and_final_rows_are_the_same_compiled_and_readable(name):
    n, S, drop, tp, min_rows, empty = CASES[name]
    slot_rank, entry_slot, buf_row = _case(n, S, drop, list(CASES).index(name), empty)
    mins = np.random.default_rng(1).integers(0, 3 * n // S, S) if min_rows else None
    lay = slot_layout(entry_slot, slot_rank, tp, mins, R, perf=COMPILED)
    row_entry, expand = final_rows(lay, lay.order_N[lay.n_drop:], buf_row)
    want = slot_layout(entry_slot, slot_rank, tp, mins, R, perf=READABLE)
    want_entry, want_expand = final_rows(want, want.order_N[want.n_drop:], buf_row)
    for field in ("slot_rows_S", "slot_padded_S", "slot_offset_S", "entry_row_N", "order_N", "rows_R"):
        got, exp = getattr(lay, field), getattr(want, field)
        assert got.dtype == exp.dtype and np.array_equal(got, exp), field
    assert lay.n_drop == want.n_drop
    assert (lay.grow_K is None) == (want.grow_K is None)
    if want.grow_K is not None:
        assert np.array_equal(lay.grow_K, want.grow_K)
    for got, exp in ((row_entry, want_entry), (expand, want_expand)):
        assert got.dtype == exp.dtype and np.array_equal(got, exp)


def _routing(n_tokens, K, rng):
    ids = np.argsort(rng.random((n_tokens, 64)), axis=1)[:, :K].astype(np.int64)
    w = rng.random((n_tokens, K)).astype(np.float32)
    return GlobalRouting.split_evenly(ids, w, 64, R)


@pytest.mark.parametrize("tp, min_rows, drop", [(1, False, 0.0), (4, True, 0.1), (2, False, 0.3)])
def test_assemble_plan_matches_reference(tp, min_rows, drop):
    """Records in, the reference's Plan out: entries by slot, padding rows that arrived included."""
    rng = np.random.default_rng(tp)
    K, S = 4, 24
    routing = _routing(CHUNK + 5, K, rng)
    n = routing.num_tokens * K
    slot_rank, entry_slot, buf_row = _case(n, S, drop, tp, False)
    mins = rng.integers(0, 3 * n // S, S) if min_rows else None
    dup = rng.random(n) < 0.2
    lay = slot_layout(entry_slot, slot_rank, tp, mins, R)
    room = lay.slot_padded_S - lay.slot_rows_S
    pad_slot = np.repeat(np.arange(S), room // 2)[::-1].copy()  # half of each slot's padding, out of order
    pad_row = rng.integers(0, n, pad_slot.size)
    cluster, costs = ClusterShape(R, 4), RowCosts(64, 64)
    slots = Slots(slot_rank, np.arange(S) % 64, slot_rank)
    entries = Entries(entry_slot, buf_row, dup)
    padding = Padding(tp, mins, pad_slot, pad_row)
    got = assemble_plan(routing, cluster, costs, slots, entries, [], padding=padding, options={"x": 1})
    want = reference.assemble_plan(routing, cluster, costs, slots, entries, [], padding=padding, options={"x": 1})
    for field in ("entry_rank_TK", "entry_row_TK", "entry_dup_TK", "slot_offset_S", "slot_rows_S", "slot_padded_S",
                  "row_entry_W", "expand_src_row_W"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == w.dtype and np.array_equal(g, w), field
    assert got.options == want.options == {"x": 1} and got.token_padding == want.token_padding == tp


def test_assemble_plan_names_a_missing_record_field():
    rng = np.random.default_rng(0)
    routing = _routing(16, 2, rng)
    slots = Slots(np.arange(R), np.arange(R), np.arange(R))
    with pytest.raises(PlanError, match=r"entries.slot_N \(None\) must be given unless a layout and entries.rank_N are"):
        assemble_plan(routing, ClusterShape(R), RowCosts(8, 8), slots, Entries(None, None, np.zeros(32, bool)), [])
    with pytest.raises(PlanError, match=r"entries.buf_row_N \(None\) must be given"):
        assemble_plan(routing, ClusterShape(R), RowCosts(8, 8), slots,
                      Entries(np.zeros(32, np.int64), None, np.zeros(32, bool)), [])
