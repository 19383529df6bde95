"""Pipeline schedules (moonep_sim.step.pipelines): closed-form bubbles and the ordering invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.step.pipelines import get_schedule
from moonep_sim.step.pipelines.base import ChunkTimes, run_schedule


def _equal(s, F=3.0, B=5.0, send=0.0):
    n = s.chunks()
    return run_schedule(s, ChunkTimes([F / s.vpp] * n, [B / s.vpp] * n, send_us=lambda a, b: send))


@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (4, 8), (8, 3), (16, 120)])
def test_1f1b_bubble_closed_form(p, m):
    run = _equal(get_schedule("1f1b", p, 1, m))
    assert run.makespan_us == pytest.approx((m + p - 1) * 8.0)
    assert run.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (4, 2, 8), (4, 3, 4), (8, 4, 16)])
def test_interleaved_bubble_closed_form(p, v, m):
    run = _equal(get_schedule("interleaved", p, v, m))
    assert run.makespan_us == pytest.approx((m + (p - 1) / v) * 8.0)
    assert run.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_1f1b_sends_on_the_critical_path():
    # one micro-batch crosses each of the p-1 boundaries once forward and once backward
    p, send = 4, 0.5
    run = _equal(get_schedule("1f1b", p, 1, 1), send=send)
    assert run.makespan_us == pytest.approx(p * 8.0 + 2 * (p - 1) * send)
    # with more micro-batches the sends cost at least that much (the steady state waits on them too)
    assert _equal(get_schedule("1f1b", p, 1, 6), send=send).makespan_us >= (6 + p - 1) * 8.0 + 2 * (p - 1) * send


def test_phases_are_data():
    run = _equal(get_schedule("1f1b", 4, 1, 8))
    # rank 0 warms up with 3 forwards before its first backward, which waits for the pipeline's round trip
    assert run.warmup_us[0] == pytest.approx(4 * 3.0 + 3 * 5.0)
    assert run.cooldown_us[3] == pytest.approx(4 * 5.0)     # its last backward, then the wave back to rank 0
    for r in range(4):
        assert run.warmup_us[r] + run.steady_us[r] + run.cooldown_us[r] == pytest.approx(run.makespan_us)


def test_dualpipe_overlap_hides_communication():
    # forward 3 = 2 compute + 1 exposed comm, backward 5 = 4 + 1: a pair costs max(6, 2) = 6, not 8
    p, m = 4, 16
    s = get_schedule("dualpipe", p, 1, m)
    n = s.chunks()
    t = ChunkTimes([3.0] * n, [5.0] * n, [2.0] * n, [4.0] * n)
    assert t.fb_us(0, 1) == 6.0
    dual = run_schedule(s, t)
    one = _equal(get_schedule("1f1b", p, 1, m))
    assert dual.makespan_us < one.makespan_us
    # every rank holds stages r and p-1-r, and no rank keeps more than p+1 micro-batches in flight
    assert sorted(s.stage_of(c) for c in range(n) if s.rank_of(c) == 1) == [1, 2]
    _check_invariants(s, dual, inflight=p + 1)


def test_bad_schedules_are_one_line():
    with pytest.raises(ConfigError, match=r"micro-batches \(6\) must be a multiple of pp \(4\)"):
        get_schedule("interleaved", 4, 2, 6)
    with pytest.raises(ConfigError, match=r"pp \(3\) must be even for dualpipe"):
        get_schedule("dualpipe", 3, 1, 4)
    with pytest.raises(ConfigError, match=r"micro-batches \(3\) must be even for dualpipe"):
        get_schedule("dualpipe", 2, 1, 3)
    with pytest.raises(ConfigError, match=r"pp schedule \('gpipe'\) must be one of"):
        get_schedule("gpipe", 2, 1, 2)


def _check_invariants(s, run, inflight=None):
    start, end = {}, {}
    per_rank: dict[int, list] = {}
    for r, kind, mb, c, mb2, c2, a, b in run.ops:
        per_rank.setdefault(r, []).append((a, b))
        parts = [("F", mb, c), ("B", mb2, c2)] if kind == "FB" else [(kind, mb, c)]
        for k, x, ch in parts:
            assert (k, x, ch) not in start, "an op ran twice"
            assert s.rank_of(ch) == r
            start[(k, x, ch)], end[(k, x, ch)] = a, b
    # no rank runs two ops at once
    for spans in per_rank.values():
        spans.sort()
        for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
            assert a1 >= b0 - 1e-9
    for mb in range(s.m):
        path = s.path(mb)
        for i, c in enumerate(path):
            # every op ran; each micro-batch's forward precedes its backward on each chunk
            assert end[("F", mb, c)] <= start[("B", mb, c)] + 1e-9
            if i:  # stage order: forward along the path, backward against it
                assert start[("F", mb, c)] >= end[("F", mb, path[i - 1])] - 1e-9
                assert start[("B", mb, path[i - 1])] >= end[("B", mb, c)] - 1e-9
    if inflight is not None:
        for r in per_rank:
            events = sorted([(start[k], 1) for k in start if k[0] == "F" and s.rank_of(k[2]) == r]
                            + [(end[k], -1) for k in end if k[0] == "B" and s.rank_of(k[2]) == r])
            live = peak = 0
            for _, d in events:
                live += d
                peak = max(peak, live)
            assert peak <= inflight


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["1f1b", "interleaved", "dualpipe"]), st.integers(1, 6), st.integers(1, 3), st.integers(1, 6),
       st.lists(st.floats(0.1, 5.0), min_size=4, max_size=4), st.floats(0.0, 1.0))
def test_schedules_keep_their_order(name, p, v, k, times, send):
    if name == "interleaved":
        p, m = max(p, 2), max(p, 2) * k
        v = max(v, 2)
    elif name == "dualpipe":
        p, v, m = 2 * ((p + 1) // 2), 1, 2 * k
    else:
        v, m = 1, k
    s = get_schedule(name, p, v, m)
    n = s.chunks()
    f = [times[c % 4] for c in range(n)]
    b = [times[(c + 1) % 4] * 2 for c in range(n)]
    run = run_schedule(s, ChunkTimes(f, b, [x * 0.7 for x in f], [x * 0.7 for x in b], send_us=lambda a, c: send))
    _check_invariants(s, run)
    assert len(run.ops) <= 2 * m * n
    assert sum(run.busy_us) <= p * run.makespan_us + 1e-6


# --------------------------------------------------------------- Megatron's combined 1F1B (EP a2a overlap)
def _split(s, fc, fx, bc, bx):
    n = s.chunks()
    return run_schedule(s, ChunkTimes([fc + fx] * n, [bc + bx] * n, [fc] * n, [bc] * n))


def _hidden_ops(p, v, m):
    """FB ops of the last pipeline rank: v m less its (v - 1) p + 1 warm-up forwards."""
    return v * m - min((v - 1) * p + 1, v * m)


def test_combined_1f1b_hand_count():
    # p=2, v=2, m=2; forward 4 = 3 compute + 1 EP comm, backward 8 = 6 + 2. Rank 1 (chunks 1, 3) warms up with
    # 3 forwards [4-8] [8-12] [12-16], then F(mb1, c3) + B(mb0, c3) as one op of max(3 + 6, 1 + 2) = 9 [16-25],
    # then B(mb1,c3) [25-33], B(mb0,c1) [33-41], B(mb1,c1) [41-49]; rank 0 ends with B(mb1, c0) [49-57].
    s = get_schedule("combined-1f1b", 2, 2, 2)
    o = s.orders()
    assert [op.kind for op in o[1]] == ["F", "F", "F", "FB", "B", "B", "B"]
    assert [op.kind for op in o[0]] == ["F"] * 4 + ["B"] * 4
    assert (o[1][3].mb, o[1][3].chunk, o[1][3].mb2, o[1][3].chunk2) == (1, 3, 0, 3)
    run = _split(s, 3.0, 1.0, 6.0, 2.0)
    assert run.makespan_us == 57.0
    assert _split(get_schedule("interleaved", 2, 2, 2), 3.0, 1.0, 6.0, 2.0).makespan_us == 60.0   # (2 + 1/2)(8 + 16)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), v=st.integers(2, 4), k=st.integers(1, 4), fc=st.floats(1.0, 5.0),
       share=st.floats(0.0, 0.5))
def test_combined_1f1b_hides_the_last_ranks_dispatch_and_combine(p, v, k, fc, share):
    # The rule: equal chunks, free sends, backward twice the forward (compute and EP comm each) and the EP comm at
    # most half the compute: the step is the interleaved step less the EP comm of the last rank's FB ops,
    # (v (m - p) + p - 1) (fx + bx); the steady state keeps every rank busy (each FB op's compute covers the
    # round trip of its inputs).
    m, fx = p * k, share * fc
    inter = _split(get_schedule("interleaved", p, v, m), fc, fx, 2 * fc, 2 * fx).makespan_us
    comb = _split(get_schedule("combined-1f1b", p, v, m), fc, fx, 2 * fc, 2 * fx).makespan_us
    assert comb == pytest.approx(inter - _hidden_ops(p, v, m) * 3 * fx)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 5), v=st.integers(2, 3), k=st.integers(1, 3), fc=st.floats(1.0, 5.0),
       fx=st.floats(0.0, 5.0), bc=st.floats(1.0, 10.0), bx=st.floats(0.0, 10.0))
def test_combined_1f1b_hides_at_most_that(p, v, k, fc, fx, bc, bx):
    # outside the rule the steady state may wait on its neighbours: the saving is never more than the rule's,
    # and the combined schedule is never slower than the interleaved one it reorders
    m = p * k
    inter = _split(get_schedule("interleaved", p, v, m), fc, fx, bc, bx).makespan_us
    comb = _split(get_schedule("combined-1f1b", p, v, m), fc, fx, bc, bx).makespan_us
    assert inter - comb <= _hidden_ops(p, v, m) * (fx + bx) + 1e-6
    assert comb <= inter + 1e-6


def test_fb_parts_keep_tp_and_host_serial():
    from moonep_sim.step.pipelines.base import FBParts

    # forward 2 compute + 1 EP comm + 0.5 TP, backward 4 + 2 + 1: the pair is max(6, 3) + 1.5 = 7.5 ...
    t = ChunkTimes([3.5], [7.0], [2.0], [4.0], fb=FBParts([1.0], [2.0], [0.5], [1.0], [0.0], [0.0]))
    assert t.fb_us(0, 0) == 7.5
    # ... unless the host's launches of both halves take longer: 5 + 4 = 9
    t = ChunkTimes([3.5], [7.0], [2.0], [4.0], fb=FBParts([1.0], [2.0], [0.5], [1.0], [5.0], [4.0]))
    assert t.fb_us(0, 0) == 9.0
