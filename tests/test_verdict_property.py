"""Verdicts never contradict themselves (moonep_sim.analysis.verdict, measured_verdict), over many
generated cases: a tie names no mechanism of a difference and its sentence explains none; a named
mechanism is a term the runner-up spends more on; a byte mechanism never says both strategies move
the same bytes as if that were the difference."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from moonep_sim.analysis.measured_verdict import measured_verdict
from moonep_sim.analysis.verdict import MECHANISMS, step_verdict, verdict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_measured_verdict import _entry, _rep  # noqa: E402

#: words only a mechanism's sentence uses (a tie's sentence must use none of them)
_MECH_WORDS = ("moves", "copies", "computes", "spends", "fixed kernel", "padding", "drops", "token traffic")
_SAME_BYTES = re.compile(r"(\w+) moves ([\d.]+ [MG]iB) of token rows .* where (\w+) moves ([\d.]+ [MG]iB)")


def _consistent(v) -> None:
    for o in [v, *v.get("others", [])]:
        if o.get("runner_up", o.get("strategy")) is None:
            continue
        if o["tie"]:
            assert o["mechanism"] is None, o
            # the tie's own sentence (a tie at the top may go on to say what the tied ones beat, and why)
            own = o["why"].split(f"; {v['winner']} beats ")[0]
            assert not any(word in own for word in _MECH_WORDS), o["why"]
        elif o["mechanism"] is not None:
            assert o["mechanism"] in MECHANISMS or o["mechanism"] in ("memory", "exposed communication", "compute")
        m = _SAME_BYTES.search(o["why"])
        assert m is None or m.group(2) != m.group(4), o["why"]  # "a moves 0.846 MiB where b moves 0.846 MiB"


_BYTES = st.sampled_from([0, 4096, 887_095, 887_096, 2**20, 3 * 2**20])


@st.composite
def _figures(draw, n_units: int):
    terms_us = {k: draw(st.floats(0.0, 200.0)) for k in MECHANISMS if k != "dropped rows"}
    terms_us["dropped rows"] = 0.0
    t = sum(terms_us.values()) + 1.0
    f = {"time_us": t, "terms_us": terms_us, "inter_node_bytes": draw(_BYTES), "intra_node_bytes": draw(_BYTES),
         "duplicates_avoided": draw(st.sampled_from([0, 10])), "hops": draw(st.sampled_from([1, 2])),
         "weight_copies": draw(st.integers(0, 3)), "migrations": 0, "weight_bytes": 2**20, "rows_max": 64.0,
         "rows_mean": 32.0, "crit_rows": 64.0, "crit_real_rows": 48.0, "dropped": 0, "entries": 128}
    noise = draw(st.floats(0.0, 0.3))
    series = [t * (1 + noise * draw(st.floats(-1.0, 1.0))) for _ in range(n_units)]
    return f, series


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 6).flatmap(lambda n: st.lists(_figures(n), min_size=2, max_size=4)), st.booleans())
def test_a_simulated_verdict_never_contradicts_itself(cases, same):
    if same:  # identical figures or times: the tie at the threshold
        cases = [cases[0]] + [(dict(cases[0][0]), list(cases[0][1])) for _ in cases[1:]]
    names = "abcd"[: len(cases)]
    figs = {n: f for n, (f, _) in zip(names, cases)}
    series = {n: s for n, (_, s) in zip(names, cases)}
    v = verdict(figs, series=series, unit="step")
    _consistent(v)
    if v["tie"]:
        assert v["mechanism"] is None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(0.5, 3.0), min_size=2, max_size=10), st.floats(0.0, 1.0), st.floats(0.0, 0.5),
       st.sampled_from([0, 2**20]), st.sampled_from(["rows", "prefetch", "plan", "expert"]))
def test_a_measured_verdict_never_contradicts_itself(base, gap, noise, inter, phase):
    """Two strategies replayed: the second slower by ``gap`` in one phase, with noise; whether the
    tests resolve it or not, the verdict's sentence agrees with its tie and mechanism."""
    fast = [float(x) for x in base]
    slow = [x * (1 + gap) + noise * ((i % 3) - 1) for i, x in enumerate(fast)]
    kw = {"rows": 1.0 * gap + 0.2} if phase == "rows" else {phase: 0.3 + gap}
    if phase == "prefetch":
        kw["copies"] = 1
    reps = {"a": _rep([_entry(iters=fast, inter=inter, intra=inter)], fast),
            "b": _rep([_entry(iters=slow, inter=inter, intra=inter, **kw)], slow)}
    _consistent(measured_verdict(reps, where="2 processes"))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(1.0, 1e5), st.floats(0.0, 1e5), st.floats(0.0, 1e5), st.booleans()),
                min_size=2, max_size=4))
def test_a_step_verdict_never_contradicts_itself(rows):
    figs = {n: {"step_time_us": t, "exposed_comm_us": c, "compute_us": k, "oom": oom, "dropped": 0,
                "peak_memory_bytes": 1.0, "gpu_memory_bytes": 2.0, "rows_max_mean": 1.0}
            for n, (t, c, k, oom) in zip("abcd", rows)}
    _consistent(step_verdict(figs))


def test_a_step_verdict_names_host_time_when_the_host_holds_the_runner_up_back():
    """A layout step whose runner-up loses by time its GPUs wait on the host (``host_bound_us``, a
    part of ``exposed_comm_us``: launches, syncs, host-proxy calls) names "host time", not exposed
    communication; the same step gap as real communication is still exposed communication."""
    base = {"oom": False, "dropped": 0, "peak_memory_bytes": 1.0, "gpu_memory_bytes": 2.0, "rows_max_mean": 1.0,
            "compute_us": 5e6}
    nccl = dict(base, step_time_us=8.3e6, exposed_comm_us=3.3e6, host_bound_us=2.5e6)
    uccl = dict(base, step_time_us=14.7e6, exposed_comm_us=9.7e6, host_bound_us=8.6e6)
    v = step_verdict({"alltoall": nccl, "deepep": uccl})
    assert (v["winner"], v["runner_up"], v["mechanism"]) == ("alltoall", "deepep", "host time")
    assert "wait" in v["why"] and "host-proxy" in v["why"]
    comm = dict(uccl, host_bound_us=2.6e6)
    v = step_verdict({"alltoall": nccl, "deepep": comm})
    assert v["mechanism"] == "exposed communication"
