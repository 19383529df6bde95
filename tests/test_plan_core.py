"""The Plan model's shared builders and validate(): valid plans pass, corrupted ones are caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import random_routing
from moonep_sim.errors import ConfigError, PlanError
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, validate
from moonep_sim.strategies import PlanContext, make_plan


def _plan(dedup=True, token_padding=4):
    ids, w = random_routing(48, 3, 8, seed=3, skew=1.0)
    r = GlobalRouting.split_evenly(ids, w, 8, 4)
    return make_plan("alltoall", r, PlanContext.default(8, 4, 2, token_padding=token_padding), dedup=dedup)


def test_alltoall_plan_valid_and_rows_trace_back():
    for dedup in (False, True):
        p = _plan(dedup)
        assert validate(p) == []
        assert p.real_rows_R().sum() == 48 * 3
        # dedup: a message per (token, rank) pair
        pairs = {(t, int(r)) for t in range(48) for r in p.entry_rank_TK[t]}
        assert p.hops[0].src_rank_M.size == (len(pairs) if dedup else 48 * 3)


def test_validate_catches_misrouted_row():
    p = _plan()
    h = p.hops[0]
    bad_src_row = h.src_row_M.copy()
    bad_src_row[0] = (bad_src_row[0] + 1) % int(p.tokens_per_rank_R[h.src_rank_M[0]])
    bad = dataclasses.replace(p, hops=(dataclasses.replace(h, src_row_M=bad_src_row),))
    errs = validate(bad)
    assert any("misrouted" in e for e in errs)


def test_validate_catches_lost_entry_and_bad_layout():
    p = _plan()
    re = p.row_entry_W.copy()
    re[np.flatnonzero(re >= 0)[0]] = -1
    assert any("conservation" in e for e in validate(dataclasses.replace(p, row_entry_W=re)))
    off = p.slot_offset_S.copy()
    off[1] += 1
    assert any("slot_offset" in e for e in validate(dataclasses.replace(p, slot_offset_S=off)))


def test_validate_catches_capacity_and_scope():
    p = _plan()
    cap = p.rows_R() - 1
    assert any("capacity" in e for e in validate(dataclasses.replace(p, capacity_R=cap)))
    h = dataclasses.replace(p.hops[0], scope="intra_node")
    assert any("cross nodes" in e for e in validate(dataclasses.replace(p, hops=(h,))))


@pytest.mark.parametrize("corrupt, check_name, match", [
    (lambda p: dataclasses.replace(p, entry_row_TK=p.entry_row_TK[:-1]), "shapes", r"entry_row_TK shape"),
    (lambda p: dataclasses.replace(p, slot_rank_S=p.slot_rank_S[::-1].copy()), "slots", r"sorted by rank"),
    (lambda p: dataclasses.replace(p, row_entry_W=np.where(p.row_entry_W == 0, -1, p.row_entry_W)), "entries",
     r"conservation"),
    (lambda p: dataclasses.replace(p, entry_dup_TK=np.ones_like(p.entry_dup_TK)), "duplicates",
     r"duplicate entry must share"),
    (lambda p: dataclasses.replace(p, slot_home_S=(p.slot_home_S + 1) % 4), "copies", r"resident on their home"),
    (lambda p: dataclasses.replace(p, capacity_R=p.rows_R() - 1), "capacity", r"must be <= capacity"),
    (lambda p: dataclasses.replace(p, hops=(dataclasses.replace(p.hops[0], scope="sideways"),)), "hop_provenance",
     r"scope \('sideways'\) must be one of"),
])
def test_check_names_the_failed_check(corrupt, check_name, match):
    from moonep_sim.plan import CHECKS, check, violations

    assert check_name in [name for name, _ in CHECKS]
    bad = corrupt(_plan())
    found = violations(bad)
    assert found and found[0].check == check_name, found
    with pytest.raises(PlanError, match=rf"^plan of strategy 'alltoall' fails check\(s\) {check_name}\b.*"
                                        rf"\[{check_name}\] .*{match}"):
        check(bad)
    assert check(_plan()) is not None


def test_phases_bytes_follow_hops():
    p = _plan(dedup=True)
    fwd = p.phases("forward")
    assert [ph.name for ph in fwd] == ["dispatch.0", "prefetch", "combine.0"]
    np.testing.assert_array_equal(fwd[0].msgs_RR, fwd[2].msgs_RR.T)
    bwd = p.phases("backward")
    assert [ph.name for ph in bwd] == ["combine_bwd.0", "dispatch_bwd.0", "grad_reduce"]
    assert fwd[0].msgs_RR.sum() == p.hops[0].src_rank_M.size


@pytest.mark.parametrize("kwargs, match", [
    (dict(ids=[[0, 9]], E=8), r"expert id \(9\) must lie in \[0, 8\)"),
    (dict(ids=[[-1, 2]], E=8), r"expert id \(-1\) must lie"),
    (dict(ids=[[3, 3]], E=8), r"must be distinct experts"),
    (dict(ids=[[0, 1, 2]], E=2), r"top_k \(3\) must be <= num_experts \(2\)"),
])
def test_bad_routing_rejected(kwargs, match):
    ids = np.array(kwargs["ids"])
    with pytest.raises(PlanError, match=match):
        GlobalRouting(ids, np.ones(ids.shape, np.float32), [ids.shape[0]], kwargs["E"])


def test_bad_shapes_rejected():
    with pytest.raises(ConfigError, match=r"ranks \(6\) must be divisible by gpus_per_node \(4\)"):
        ClusterShape(6, 4)
    with pytest.raises(ConfigError, match=r"num_experts \(10\) must be divisible by ranks \(4\)"):
        Placement.home_groups(10, 4)


def test_plan_index_dtype_and_its_bound():
    """The Plan's per-entry, per-message and per-row arrays are INDEX (int32) whatever integer dtype
    a builder hands over; values or sizes that do not fit are refused with one line naming them."""
    from moonep_sim.plan import INDEX, Hop, Scope
    from moonep_sim.plan.kinds import INDEX_MAX, as_index, require_index
    z = np.zeros(3, dtype=np.int64)
    h = Hop(Scope.GLOBAL, z, z - 1, z, np.arange(3), np.array([3]))
    for a in (h.src_rank_M, h.src_row_M, h.dst_rank_M, h.dst_row_M):
        assert a.dtype == INDEX
    assert h.dst_rows_R.dtype == np.int64
    same = np.arange(4, dtype=INDEX)
    assert as_index(same) is same  # already the index dtype: not copied
    with pytest.raises(PlanError, match=r"hop dst_row_M values \(0\.\.2147483648\) must fit int32"):
        Hop(Scope.GLOBAL, z[:2], z[:2], z[:2], np.array([0, INDEX_MAX + 1]), np.array([2]))
    with pytest.raises(PlanError, match=r"rows of a hop's buffer, all ranks together \(2147483648\) must be <= "
                                         r"2147483647: the Plan's index arrays are int32"):
        Hop(Scope.GLOBAL, z[:0], z[:0], z[:0], z[:0], np.array([INDEX_MAX, 1]))
    with pytest.raises(PlanError, match=r"entries \(tokens x top-k\) \(4294967296\) must be <= 2147483647"):
        require_index(1 << 32, "entries (tokens x top-k)")


_CORRUPTIBLE = ("entry_rank_TK", "entry_row_TK", "row_entry_W", "expand_src_row_W", "slot_rows_S", "src_rank_M",
                "src_row_M", "dst_rank_M", "dst_row_M", "none")


@pytest.mark.parametrize("strategy", ["alltoall", "capacity", "deepep"])
@pytest.mark.parametrize("field", _CORRUPTIBLE)
def test_validate_on_two_threads_reports_what_one_thread_does(strategy, field):
    """With the hop check on a second thread (``perf.thread_min`` 0) validate reports exactly the
    sequential run's violations, in its order, and counts hop rows only where that run walked
    every hop -- on valid plans and on plans corrupted where an earlier check stops the run."""
    from moonep_sim.perf import PerfConfig
    from moonep_sim.plan.validate import validate_counting
    R, E, K = 4, 8, 3
    for seed in range(6):
        rng = np.random.default_rng(seed)
        ids, w = random_routing(int(rng.integers(5, 40)), K, E, seed=seed, skew=1.0)
        p = make_plan(strategy, GlobalRouting.split_evenly(ids, w, E, R), PlanContext.default(E, R, 2))
        if field in ("src_rank_M", "src_row_M", "dst_rank_M", "dst_row_M"):
            a = getattr(p.hops[-1], field).copy()
            a[rng.integers(a.size)] += int(rng.choice([-2, -1, 1, 2, 50]))
            p = dataclasses.replace(p, hops=p.hops[:-1] + (dataclasses.replace(p.hops[-1], **{field: a}),))
        elif field != "none":
            a = getattr(p, field).copy()
            a.flat[rng.integers(a.size)] += int(rng.choice([-2, -1, 1, 2, 50]))
            p = dataclasses.replace(p, **{field: a})
        one = validate_counting(p, PerfConfig(thread_min=1 << 62))
        two = validate_counting(p, PerfConfig(thread_min=0))
        assert two[0] == one[0], (field, seed)
        assert (two[1] is None) == (one[1] is None), (field, seed)
        if one[1] is not None:
            for x, y in zip(one[1], two[1]):
                np.testing.assert_array_equal(x, y)
        if field == "none":
            assert one[0] == []


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("tp", [1, 4])
def test_plan_from_slots_compiled_equals_the_reference(dedup, tp):
    """``plan_from_slots`` by its compiled passes (``perf.plan_compiled_min`` 0) gives the
    reference's Plan, dropped entries and padding included."""
    from moonep_sim.perf import PerfConfig
    from moonep_sim.plan import RowCosts, Slots, plan_from_slots
    import plan_reference as reference
    for seed in range(4):
        rng = np.random.default_rng(seed)
        R, K, S = 4, 3, 9
        tpr = rng.integers(0, 12, R)
        T = int(tpr.sum())
        slot_rank = np.sort(rng.integers(0, R, S))
        entry_slot = rng.integers(-1, S, (T, K))
        routing = GlobalRouting(np.tile(np.arange(K), (T, 1)), np.ones((T, K), np.float32), tpr, max(S, K))
        args = (routing, ClusterShape(R, 2), RowCosts(4, 2, 8, 16), Slots(slot_rank, np.zeros(S, np.int64), slot_rank),
                entry_slot)
        p, q = plan_from_slots(*args, dedup=dedup, token_padding=tp, perf=PerfConfig(plan_compiled_min=0)), \
            reference.plan_from_slots(*args, dedup=dedup, token_padding=tp)
        for f in dataclasses.fields(p):
            a, b = getattr(p, f.name), getattr(q, f.name)
            if f.name == "hops":
                for ha, hb in zip(a, b):
                    for g in ("src_rank_M", "src_row_M", "dst_rank_M", "dst_row_M", "dst_rows_R"):
                        x, y = getattr(ha, g), getattr(hb, g)
                        assert x.dtype == y.dtype and np.array_equal(x, y), (seed, g)
            elif isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), (seed, f.name)


def test_beside_returns_or_raises_what_its_function_does():
    from moonep_sim.plan.threads import Beside

    def boom(x):
        raise PlanError(f"bad ({x})")
    assert Beside(lambda a, b: a + b, 2, 3).result() == 5
    assert Beside(lambda a, b: a + b, 2, 3, run=False).result() == 5
    with pytest.raises(PlanError, match=r"bad \(7\)"):
        Beside(boom, 7).result()
    Beside(boom, 7).discard()  # (an error nobody needs is dropped)


def test_beside_as_a_block_waits_for_its_piece_when_the_block_fails():
    import threading

    from moonep_sim.plan.threads import Beside

    started, release, finished = threading.Event(), threading.Event(), []

    def piece():
        started.set()
        release.wait(timeout=10)
        finished.append(True)
        return 1

    with pytest.raises(PlanError, match="the build failed"):
        with Beside(piece) as job:
            started.wait(timeout=10)
            release.set()
            raise PlanError("the build failed")
    assert finished == [True]  # the block's exception waited for the piece before it propagated
    with Beside(lambda: 4) as job:
        pass
    assert job.result() == 4
