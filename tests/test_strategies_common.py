"""Properties every registered strategy must hold, checked with hypothesis over random and
adversarial routings (new strategies are covered automatically: the tests iterate over available()).

- validate(plan) is empty; every kept entry lands at a slot of *its own* expert (from the routing);
- only dropping strategies drop; entry weights are the routing's weights;
- byte matrices follow the hops (dispatch = messages x row bytes, combine = transpose);
- a reference executor (numpy, identity experts) gives combine(dispatch(x)) = sum_k w_tk * x_t over
  kept entries: deduplication never loses an entry's weight, and combine is dispatch's adjoint;
- planning is deterministic.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts, validate
from moonep_sim.strategies import PlanContext, available, get_strategy
from conftest import tokens_per_expert_RE

# Strategies that may drop entries (all others are dropless).
DROPPING = {"capacity"}
# Option variants exercised per strategy (a strategy not listed runs with its defaults).
VARIANTS = {
    "alltoall": [{}, {"dedup": True}],
    "capacity": [{}, {"cf": 0.5, "drop": "position"}, {"cf": 2.0, "pad": False}, {"cf": 0.25}],
    "hierarchical": [{}, {"dedup": True}],
    "eplb": [{}, {"choice": "contiguous", "dedup": True}, {"num_redundant": 0}],
    "llep": [{}, {"lambda": 0.0, "m": 0}, {"lambda": 0.0, "m": 3, "alpha": 1.0, "dedup": True}],
    "ultraep": [{}, {"replica_cap": 0}, {"replica_cap": 2, "dedup": True}, {"domain": 1}],
    "costaware": [{}, {"min_gain": 0.0}, {"mode": "training", "cross_node": False}, {"grid": 1}],
}
COSTS = RowCosts(dispatch_row_bytes=7, combine_row_bytes=5, weight_bytes=11, grad_bytes=13)
KINDS = ("random", "same_experts", "hot_group", "all_remote", "empty_experts")


def make_ids(kind: str, T: int, K: int, E: int, R: int, tpr, rng) -> np.ndarray:
    """[T, K] distinct expert ids of one adversarial kind."""
    if T == 0:
        return np.zeros((0, K), np.int64)
    if kind == "random":
        g = rng.normal(0, 2.0, E)[None, :] + rng.gumbel(size=(T, E))
        return np.argsort(-g, axis=1)[:, :K]
    if kind == "same_experts":  # every token picks the same K experts
        return np.tile(rng.permutation(E)[:K], (T, 1))
    if kind == "hot_group":  # rank 0's home experts first, then random others
        pri = rng.random((T, E)) + (np.arange(E) < E // R)[None, :] * 10
        return np.argsort(-pri, axis=1)[:, :K]
    if kind == "all_remote":  # a token avoids its own rank's experts when it can
        src = np.repeat(np.arange(R), tpr)
        own = (np.arange(E)[None, :] // (E // R)) == src[:, None]
        pri = rng.random((T, E)) - own * 10
        return np.argsort(-pri, axis=1)[:, :K]
    if kind == "empty_experts":  # only the first K experts are ever used
        return np.stack([rng.permutation(K) for _ in range(T)])
    raise ValueError(kind)


@st.composite
def cases(draw):
    R = draw(st.sampled_from([1, 2, 4]))
    G = draw(st.sampled_from([g for g in (1, 2, 4) if R % g == 0]))
    E = R * draw(st.integers(1, 3))
    K = draw(st.integers(1, min(E, 4)))
    T = draw(st.integers(0, 24))
    cuts = sorted(draw(st.lists(st.integers(0, T), min_size=R - 1, max_size=R - 1)))
    tpr = np.diff(np.array([0] + cuts + [T]))
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    ids = make_ids(kind, T, K, E, R, tpr, rng).astype(np.int64)
    w = rng.random((T, K)).astype(np.float32) + np.float32(0.01)
    routing = GlobalRouting(ids, w, tpr, E)
    tp = draw(st.sampled_from([1, 4]))
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(E, R), COSTS, tp)
    return routing, ctx


def run_plan(plan, x_TD: np.ndarray):
    """Reference executor: returns (final rows [W, D], combined output [T, D]) with identity experts."""
    R, D = plan.ranks, x_TD.shape[1]
    off = plan.tok_off_R()
    buf = x_TD.astype(np.float64)
    offs, idx = [], []
    for h in plan.hops:
        new_off = np.concatenate([[0], np.cumsum(h.dst_rows_R)])
        new = np.zeros((int(new_off[-1]), D))
        real = h.src_row_M >= 0
        src_g = off[h.src_rank_M] + h.src_row_M
        dst_g = new_off[h.dst_rank_M] + h.dst_row_M
        new[dst_g[real]] = buf[src_g[real]]
        offs.append(off)
        idx.append((src_g[real], dst_g[real]))
        buf, off = new, new_off
    rows_R = plan.rows_R()
    row_rank = np.repeat(np.arange(R), rows_R)
    exp = plan.expand_src_row_W
    g = off[row_rank] + exp
    final = np.zeros((exp.size, D))
    final[exp >= 0] = buf[g[exp >= 0]]
    w_flat = plan.entry_weight_TK.ravel().astype(np.float64)
    out = np.where((plan.row_entry_W >= 0)[:, None], final * w_flat[np.maximum(plan.row_entry_W, 0)][:, None], 0.0)
    acc = np.zeros_like(buf)
    np.add.at(acc, g[exp >= 0], out[exp >= 0])
    for (src_g, dst_g), prev_off in zip(reversed(idx), reversed(offs)):
        prev = np.zeros((int(prev_off[-1]), D))
        np.add.at(prev, src_g, acc[dst_g])
        acc = prev
    return final, acc


def entry_slot(plan) -> np.ndarray:
    """[N] slot holding each entry (-1 dropped), recovered from entry_rank/entry_row and the layout."""
    row_off = plan.row_off_R()
    slot_start = row_off[plan.slot_rank_S] + plan.slot_offset_S
    r = plan.entry_rank_TK.ravel()
    kept = r >= 0
    g = row_off[np.maximum(r, 0)] + plan.entry_row_TK.ravel()
    # the last slot starting at or before the row (an empty slot shares its start with the next one,
    # so side="right" skips it)
    s = np.searchsorted(slot_start, g, side="right") - 1
    return np.where(kept, s, -1)


def check_properties(name: str, plan, routing) -> None:
    assert validate(plan) == [], (name, validate(plan))
    T, K = routing.topk_ids_TK.shape
    assert plan.strategy == name
    # the slot each kept entry computes at runs the entry's expert (validate cannot see the routing)
    s = entry_slot(plan)
    kept = s >= 0
    np.testing.assert_array_equal(plan.slot_expert_S[s[kept]], routing.topk_ids_TK.ravel()[kept])
    assert (plan.slot_rows_S[s[kept]] > 0).all()
    if name not in DROPPING:
        assert plan.dropped == 0
    np.testing.assert_array_equal(plan.entry_weight_TK, routing.topk_weights_TK)
    # per-expert conservation: rows computed per expert == kept entries per expert
    per_e = np.bincount(routing.topk_ids_TK.ravel()[kept], minlength=routing.num_experts)
    np.testing.assert_array_equal(tokens_per_expert_RE(plan).sum(axis=0), per_e)
    # byte matrices consistent with the hops and the entries
    R = plan.ranks
    fwd = {p.name: p for p in plan.phases("forward")}
    bwd = {p.name: p for p in plan.phases("backward")}
    # a strategy may price its own wire format (deepep-ll: FP8 rows with scales and a header);
    # the combine row and the weights stay the context's
    assert plan.costs.dispatch_row_bytes >= 1
    assert (plan.costs.combine_row_bytes, plan.costs.weight_bytes, plan.costs.grad_bytes) == \
        (COSTS.combine_row_bytes, COSTS.weight_bytes, COSTS.grad_bytes)
    for i, h in enumerate(plan.hops):
        rr = h.rows_RR(R)
        assert rr.sum() == h.src_rank_M.size
        np.testing.assert_array_equal(fwd[f"dispatch.{i}"].msgs_RR, rr)
        np.testing.assert_array_equal(fwd[f"dispatch.{i}"].bytes_RR, rr * plan.costs.dispatch_row_bytes)
        np.testing.assert_array_equal(fwd[f"combine.{i}"].bytes_RR, rr.T * COSTS.combine_row_bytes)
        np.testing.assert_array_equal(bwd[f"combine_bwd.{i}"].bytes_RR, rr * COSTS.combine_row_bytes)
    copies = plan.is_copy_S()
    cp = np.zeros((R, R), np.int64)
    np.add.at(cp, (plan.slot_home_S[copies], plan.slot_rank_S[copies]), 1)
    np.testing.assert_array_equal(fwd["prefetch"].bytes_RR, cp * COSTS.weight_bytes)
    np.testing.assert_array_equal(bwd["grad_reduce"].bytes_RR, cp.T * COSTS.grad_bytes)
    # the last hop brings each (token, destination) pair of kept entries at least once
    if plan.hops and kept.any():
        last = plan.hops[-1]
        real_in = np.bincount(last.dst_rank_M[last.src_row_M >= 0], minlength=R)
        tok = np.flatnonzero(kept) // K
        pairs = np.unique(tok * R + plan.entry_rank_TK.ravel()[kept])
        assert (real_in >= np.bincount(pairs % R, minlength=R)).all()
    b = plan.bytes_summary()
    assert b["dispatch"] == sum(p.remote_bytes() for p in fwd.values() if p.kind == "dispatch")
    assert b["combine"] == sum(p.remote_bytes() for p in fwd.values() if p.kind == "combine")
    # reference executor: rows hold their token, combine returns sum of kept weights times x
    rng = np.random.default_rng(7)
    x = rng.normal(size=(T, 3))
    final, y = run_plan(plan, x)
    real = plan.row_entry_W >= 0
    np.testing.assert_allclose(final[real], x[plan.row_entry_W[real] // K])
    wk = np.where(plan.entry_rank_TK >= 0, plan.entry_weight_TK, 0).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(y, x * wk[:, None], rtol=1e-9, atol=1e-9)


def plans_equal(a, b) -> bool:
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.name == "plan_seconds":
            continue
        if f.name == "hops":
            if len(va) != len(vb):
                return False
            for ha, hb in zip(va, vb):
                for g in dataclasses.fields(ha):
                    x, y = getattr(ha, g.name), getattr(hb, g.name)
                    if not (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y):
                        return False
        elif isinstance(va, np.ndarray) or isinstance(vb, np.ndarray):
            if va is None or vb is None or not np.array_equal(va, vb):
                return False
        elif f.name == "options":
            if {k: v for k, v in va.items() if not isinstance(v, np.ndarray)} != \
                    {k: v for k, v in vb.items() if not isinstance(v, np.ndarray)}:
                return False
        elif va != vb:
            return False
    return True


def test_registry_covers_the_strategies():
    names = set(available())
    assert {"alltoall", "capacity", "allgather", "hierarchical", "deepep", "eplb"} <= names
    for n in names:
        spec = get_strategy(n)
        assert spec.summary and spec.plan_fn.__module__.startswith("moonep_sim.strategies.")


@pytest.mark.parametrize("name", sorted(available()))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), variant=st.integers(0, 10))
def test_strategy_properties(name, case, variant):
    routing, ctx = case
    spec = get_strategy(name)
    opts = VARIANTS.get(name, [{}])
    opts = opts[variant % len(opts)]
    p = spec.plan(routing, ctx, **opts)
    check_properties(name, p, routing)
    q = spec.plan(routing, ctx, **opts)
    assert plans_equal(p, q), "planning must be deterministic"


@pytest.mark.parametrize("name", sorted(available()))
def test_plan_summary_has_the_documented_keys(name):
    rng = np.random.default_rng(0)
    ids = make_ids("random", 40, 2, 8, 4, [10] * 4, rng)
    r = GlobalRouting.split_evenly(ids, np.full(ids.shape, 0.5, np.float32), 8, 4)
    s = get_strategy(name).plan(r, PlanContext(ClusterShape(4, 2), Placement.home_groups(8, 4), COSTS))
    s = s.summary()
    for k in ("strategy", "ranks", "recv_rows_per_rank", "dropped", "padded", "weight_copies", "bytes",
              "plan_seconds", "invariant_violations"):
        assert k in s
    for k in ("dispatch", "combine", "prefetch", "grad_reduce", "intra_node", "inter_node"):
        assert k in s["bytes"]
    assert s["invariant_violations"] == []
