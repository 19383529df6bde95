"""The shared Plan builders equal their slow references element-wise.

The references of ``slot_layout`` and ``single_hop_messages`` are the package's
:mod:`moonep_sim.plan.reference` (argsort-based, int64 throughout), ``plan_from_slots``'s is
``tests/plan_reference.py``'s composition of them: the fast builders
must return identical arrays (values and dtypes) on literal small cases and on hypothesis-drawn
ones (drops, padding, minimum rows, dedup on/off). ``ref_validate`` below is the first
implementation of ``validate``, kept as its reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moonep_sim.plan import ClusterShape, GlobalRouting, Plan, RowCosts, plan_from_slots, single_hop_messages, \
    slot_layout, validate
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import INDEX, SCOPES, Hop, Slots


# --- references (the original implementations) ---------------------------------------------------

# the slow references of the builders: moonep_sim.plan.reference and tests/plan_reference.py
from moonep_sim.plan.reference import slot_layout as ref_slot_layout  # noqa: E402
from plan_reference import plan_from_slots as ref_plan_from_slots  # noqa: E402
from moonep_sim.plan.reference import single_hop_messages as ref_single_hop_messages  # noqa: E402


def ref_validate(plan: Plan) -> list[str]:
    """Check a Plan's invariants; returns the violated ones as sentences (empty list: valid).

    Holds for every strategy: shapes agree; slots sorted by rank, contiguous and padded as stated;
    every kept entry computed exactly once, at a slot of its expert, at the row it names; every
    hop well-formed (sorted, in range, in scope, each destination row written once); every final
    row traces back through the hops to its entry's token (so no row is misrouted); duplicates
    share a destination with an earlier entry of their token; copies come from a resident home;
    capacity respected.
    """
    v: list[str] = []
    R, E, K = plan.ranks, plan.num_experts, plan.top_k
    T = plan.num_tokens
    N = T * K
    if plan.tokens_per_rank_R.shape != (R,) or int(plan.tokens_per_rank_R.sum()) != T:
        return [f"tokens_per_rank ({plan.tokens_per_rank_R.tolist()}) must have R={R} entries summing to T={T}"]
    for name in ("entry_rank_TK", "entry_row_TK", "entry_dup_TK", "entry_weight_TK"):
        if getattr(plan, name).shape != (T, K):
            v.append(f"{name} shape {list(getattr(plan, name).shape)} must be [{T}, {K}]")
    S = plan.slot_rank_S.size
    for name in ("slot_expert_S", "slot_home_S", "slot_offset_S", "slot_rows_S", "slot_padded_S"):
        if getattr(plan, name).shape != (S,):
            v.append(f"{name} must have S={S} entries")
    if v:
        return v
    if S and ((plan.slot_rank_S < 0) | (plan.slot_rank_S >= R)).any():
        return ["slot ranks must lie in [0, R)"]
    if (np.diff(plan.slot_rank_S) < 0).any():
        v.append("slots must be sorted by rank")
    if ((plan.slot_expert_S < 0) | (plan.slot_expert_S >= E)).any():
        v.append("slot experts must lie in [0, E)")
    if (plan.slot_padded_S < plan.slot_rows_S).any():
        v.append("slot_padded must be >= slot_rows")
    if plan.token_padding > 1 and (plan.slot_padded_S % plan.token_padding).any():
        v.append(f"slot_padded must be a multiple of token_padding ({plan.token_padding})")
    rows_R = plan.rows_R()
    first = np.searchsorted(plan.slot_rank_S, np.arange(R))
    exp_off = np.cumsum(plan.slot_padded_S) - plan.slot_padded_S
    exp_off = exp_off - np.concatenate([[0], np.cumsum(plan.slot_padded_S)])[first][plan.slot_rank_S]
    if not np.array_equal(exp_off, plan.slot_offset_S):
        v.append("slot_offset must be the running sum of slot_padded within each rank")
    if v:
        return v
    W = int(rows_R.sum())
    if plan.row_entry_W.shape != (W,) or plan.expand_src_row_W.shape != (W,):
        return [f"row_entry and expand_src_row must have W={W} rows (sum of padded slot rows)"]
    row_off = plan.row_off_R()

    # entries <-> rows
    rank_e = plan.entry_rank_TK.ravel()
    row_e = plan.entry_row_TK.ravel()
    kept = rank_e >= 0
    if ((rank_e < -1) | (rank_e >= R)).any():
        v.append("entry_rank must be -1 or a rank in [0, R)")
        return v
    if (row_e[kept] < 0).any() or (row_e[kept] >= rows_R[rank_e[kept]]).any() or (row_e[~kept] != -1).any():
        v.append("entry_row must be a row of the destination rank (or -1 when dropped)")
        return v
    grow = row_off[rank_e[kept]] + row_e[kept]
    eid = np.flatnonzero(kept)
    if not np.array_equal(plan.row_entry_W[grow], eid):
        v.append("row_entry must name, at each kept entry's row, that entry (conservation)")
    real_rows = plan.row_entry_W >= 0
    if int(real_rows.sum()) != eid.size:
        v.append(f"final rows holding entries ({int(real_rows.sum())}) must equal kept entries ({eid.size}): "
                 "every kept entry lands exactly once")
    # row -> slot -> expert must match the entry's expert
    row_rank = np.repeat(np.arange(R), rows_R)
    row_slot = np.repeat(np.arange(S), plan.slot_padded_S)
    pos_in_slot = np.arange(W) - row_off[row_rank] - plan.slot_offset_S[row_slot]
    is_real_pos = pos_in_slot < plan.slot_rows_S[row_slot]
    if not np.array_equal(is_real_pos, real_rows):
        v.append("each slot's first slot_rows rows must hold entries and the rest be padding")
    # the entry's expert is recovered from the routing only via the plan's slots
    if (np.bincount(row_slot[real_rows], minlength=S) != plan.slot_rows_S).any():
        v.append("slot_rows must count the entries in each slot")
    # duplicates share the rank of an earlier entry of the same token
    dup = plan.entry_dup_TK
    if dup.any():
        ranks_TK = plan.entry_rank_TK
        same = (ranks_TK[:, :, None] == ranks_TK[:, None, :]) & np.tri(K, k=-1, dtype=bool)[None]
        ok = same.any(axis=2) & (ranks_TK >= 0)
        if (dup & ~ok).any():
            v.append("a duplicate entry must share its destination rank with an earlier entry of its token")
    # copies: home must hold the expert
    cp = plan.slot_home_S != plan.slot_rank_S
    if cp.any():
        resident = set(zip(plan.slot_rank_S[~cp].tolist(), plan.slot_expert_S[~cp].tolist()))
        bad = [(int(h), int(e)) for h, e in zip(plan.slot_home_S[cp], plan.slot_expert_S[cp]) if (int(h), int(e)) not in resident]
        if bad:
            v.append(f"copied experts must be resident on their home rank; (home, expert) {bad[:4]} are not")
    if plan.capacity_R is not None and (rows_R > plan.capacity_R).any():
        r = int(np.argmax(rows_R > plan.capacity_R))
        v.append(f"rank {r} rows ({int(rows_R[r])}) must be <= capacity ({int(plan.capacity_R[r])})")

    # hops: well-formed and provenance
    node = plan.cluster.node_of_rank()
    local = np.arange(R) % plan.cluster.gpus_per_node
    origin = np.arange(T, dtype=np.int64)  # buffer 0: token ids, ranks concatenated
    buf_off = plan.tok_off_R()
    for i, h in enumerate(plan.hops):
        m = h.src_rank_M.size
        if not all(a.shape == (m,) for a in (h.src_row_M, h.dst_rank_M, h.dst_row_M)) or h.dst_rows_R.shape != (R,):
            v.append(f"hop {i}: message arrays must share one length and dst_rows_R have R entries")
            return v
        if h.scope not in SCOPES:
            v.append(f"hop {i}: scope ({h.scope!r}) must be one of {SCOPES}")
        if m and (((h.src_rank_M < 0) | (h.src_rank_M >= R) | (h.dst_rank_M < 0) | (h.dst_rank_M >= R)).any()):
            v.append(f"hop {i}: ranks must lie in [0, R)")
            return v
        key = h.src_rank_M * R + h.dst_rank_M
        if (np.diff(key) < 0).any():
            v.append(f"hop {i}: messages must be sorted by (src_rank, dst_rank)")
        src_rows = np.diff(buf_off)
        if m and ((h.src_row_M < -1) | (h.src_row_M >= src_rows[h.src_rank_M])).any():
            v.append(f"hop {i}: src_row must be -1 or a row of the source buffer")
            return v
        if m and ((h.dst_row_M < 0) | (h.dst_row_M >= h.dst_rows_R[h.dst_rank_M])).any():
            v.append(f"hop {i}: dst_row must be a row of the destination buffer")
            return v
        dst_off = np.concatenate([[0], np.cumsum(h.dst_rows_R)])
        gdst = dst_off[h.dst_rank_M] + h.dst_row_M
        if np.unique(gdst).size != m:
            v.append(f"hop {i}: each destination row must be written once")
        if h.scope == "intra_node" and (node[h.src_rank_M] != node[h.dst_rank_M]).any():
            v.append(f"hop {i}: intra_node scope must not cross nodes")
        if h.scope == "inter_node" and (local[h.src_rank_M] != local[h.dst_rank_M]).any():
            v.append(f"hop {i}: inter_node scope must connect equal local indices only")
        new_origin = np.full(int(dst_off[-1]), -2, dtype=np.int64)  # -2 never written, -1 zero row
        src_g = buf_off[h.src_rank_M] + h.src_row_M
        new_origin[gdst] = np.where(h.src_row_M >= 0, origin[np.maximum(src_g, 0)], -1)
        origin, buf_off = new_origin, dst_off
    # final gather
    last_rows = np.diff(buf_off)
    exp = plan.expand_src_row_W
    if ((exp < -1) | (exp >= last_rows[row_rank])).any():
        v.append("expand_src_row must be -1 or a row of the last buffer on the same rank")
        return v
    final_origin = np.where(exp >= 0, origin[np.maximum(buf_off[row_rank] + exp, 0)], -1)
    want = np.where(real_rows, plan.row_entry_W // max(K, 1), -1)
    if (real_rows & (exp < 0)).any():
        v.append("every real row must be gathered from a buffer row")
    bad = real_rows & (final_origin != want)
    if bad.any():
        w = int(np.argmax(bad))
        v.append(f"row {w} of rank {int(row_rank[w])} must hold token {int(want[w])} but receives "
                 f"{'nothing' if final_origin[w] == -2 else 'token ' + str(int(final_origin[w]))} (misrouted)")
    return v


# --- literal pins ----------------------------------------------------------------------------------
# 2 ranks (3 + 2 tokens), K=2, slots: rank 0 -> s0, s1; rank 1 -> s2, s3; entry 6 dropped.
SLOT_RANK = np.array([0, 0, 1, 1])
ENTRY_SLOT = np.array([0, 2, 1, 3, 2, 3, -1, 0, 3, 1])
SRC_RANK_T = np.array([0, 0, 0, 1, 1])
TOK_OFF = np.array([0, 3, 5])


def _eq(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_array_equal(a, b)


def _layout4(lay):
    """A SlotLayout's (slot_rows_S, slot_padded_S, slot_offset_S, entry_row_N)."""
    return lay.slot_rows_S, lay.slot_padded_S, lay.slot_offset_S, lay.entry_row_N


def _same_layout(a, b):
    """Two SlotLayouts equal field by field (values and dtypes; None where either is)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None or y is None or np.isscalar(x) or isinstance(x, int):
            assert x is y or x == y, f.name
        else:
            _eq(x, y)


@pytest.mark.parametrize("min_compiled", [0, 1 << 62], ids=["compiled", "readable"])
def test_slot_layout_literal(min_compiled):
    perf = PerfConfig(plan_compiled_min=min_compiled)
    rows, padded, off, row = _layout4(slot_layout(ENTRY_SLOT, SLOT_RANK, 2, perf=perf))
    for got, want, dt in zip((rows, padded, off, row), ([2, 2, 2, 3], [2, 2, 2, 4], [0, 2, 0, 2],
                                                       [0, 0, 2, 2, 1, 3, -1, 1, 4, 3]),
                             (np.int64, np.int64, np.int64, INDEX)):  # per-slot int64, per-entry INDEX
        _eq(got, np.array(want, dtype=dt))
    rows, padded, off, row = _layout4(slot_layout(ENTRY_SLOT, SLOT_RANK, 1, np.array([0, 3, 0, 0]), perf=perf))
    _eq(padded, np.array([2, 3, 2, 3]))
    _eq(off, np.array([0, 2, 0, 2]))


def test_single_hop_messages_literal():
    er = np.where(ENTRY_SLOT >= 0, SLOT_RANK[np.maximum(ENTRY_SLOT, 0)], -1)
    hop, br, dup = single_hop_messages(er, SRC_RANK_T, TOK_OFF, 2, 2, True)
    _eq(hop.src_rank_M, np.array([0, 0, 0, 0, 0, 1, 1, 1], dtype=INDEX))
    _eq(hop.src_row_M, np.array([0, 1, 0, 1, 2, 0, 1, 1], dtype=INDEX))
    _eq(hop.dst_rank_M, np.array([0, 0, 1, 1, 1, 0, 0, 1], dtype=INDEX))
    _eq(hop.dst_row_M, np.array([0, 1, 0, 1, 2, 2, 3, 3], dtype=INDEX))
    _eq(hop.dst_rows_R, np.array([4, 4]))
    _eq(br, np.array([0, 0, 1, 1, 2, 2, -1, 2, 3, 3], dtype=INDEX))
    _eq(dup, np.array([0, 0, 0, 0, 0, 1, 0, 0, 0, 0], dtype=bool))
    hop, br, dup = single_hop_messages(er, SRC_RANK_T, TOK_OFF, 2, 2, False)
    _eq(hop.dst_row_M, np.array([0, 1, 0, 1, 2, 3, 2, 3, 4], dtype=INDEX))
    _eq(hop.dst_rows_R, np.array([4, 5]))
    _eq(br, np.array([0, 0, 1, 1, 2, 3, -1, 2, 4, 3], dtype=INDEX))
    assert not dup.any()


# --- hypothesis: optimised == reference ------------------------------------------------------------

@st.composite
def slot_cases(draw):
    R = draw(st.integers(1, 5))
    per_rank = draw(st.lists(st.integers(0, 4), min_size=R, max_size=R))
    if sum(per_rank) == 0:
        per_rank[0] = 1
    slot_rank = np.repeat(np.arange(R), per_rank).astype(np.int64)
    S = slot_rank.size
    tpr = np.array(draw(st.lists(st.integers(0, 6), min_size=R, max_size=R)), dtype=np.int64)
    K = draw(st.integers(1, 4))
    T = int(tpr.sum())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    entry_slot = rng.integers(-1 if draw(st.booleans()) else 0, S, T * K).astype(np.int64)
    tp = draw(st.sampled_from([1, 2, 3, 8]))
    min_rows = rng.integers(0, 5, S).astype(np.int64) if draw(st.booleans()) else None
    # shuffled source ranks (tokens not in rank order) take the general sort path
    shuffle = draw(st.booleans())
    return R, slot_rank, tpr, K, entry_slot, tp, min_rows, bool(draw(st.booleans())), shuffle, seed


@settings(max_examples=150, deadline=None)
@given(slot_cases())
def test_builders_match_reference(case):
    R, slot_rank, tpr, K, entry_slot, tp, min_rows, dedup, shuffle, seed = case
    for with_ranks in (False, True):
        _same_layout(slot_layout(entry_slot, slot_rank, tp, min_rows, R, with_ranks=with_ranks,
                                 perf=PerfConfig(plan_compiled_min=0)),
                     ref_slot_layout(entry_slot, slot_rank, tp, min_rows, R, with_ranks))
    entry_rank = np.where(entry_slot >= 0, slot_rank[np.maximum(entry_slot, 0)], -1)
    src_T = np.repeat(np.arange(R), tpr)
    if shuffle:
        src_T = np.random.default_rng(seed + 1).permutation(src_T)
    off = np.concatenate([[0], np.cumsum(tpr)])
    hop, br, dup = single_hop_messages(entry_rank, src_T, off, K, R, dedup)
    rhop, rbr, rdup = ref_single_hop_messages(entry_rank, src_T, off, K, R, dedup)
    for f in dataclasses.fields(Hop):
        if f.name != "scope":
            _eq(getattr(hop, f.name), getattr(rhop, f.name))
    _eq(br, rbr)
    _eq(dup, rdup)
    if shuffle:
        return
    # the whole Plan
    T = int(tpr.sum())
    E = int(slot_rank.size)
    ids = np.tile(np.arange(K), (T, 1))  # routing ids only feed shapes here; slots are given
    routing = GlobalRouting(ids, np.ones((T, K), np.float32), tpr, max(E, K))
    cl = ClusterShape(R, 1)
    costs = RowCosts(4, 2, 100, 200)
    args = (routing, cl, costs, Slots(slot_rank, np.zeros(E, np.int64), slot_rank), entry_slot.reshape(T, K))
    kw = dict(dedup=dedup, token_padding=tp, min_rows_S=min_rows)
    # builders leave strategy and options to the registry (make_plan stamps them)
    # the compiled builder against the readable one (its body below perf.plan_compiled_min entries)
    p, q = plan_from_slots(*args, perf=PerfConfig(plan_compiled_min=0), **kw), ref_plan_from_slots(*args, **kw)
    for f in dataclasses.fields(Plan):
        a, b = getattr(p, f.name), getattr(q, f.name)
        if f.name == "hops":
            for ha, hb in zip(a, b):
                for g in dataclasses.fields(Hop):
                    if g.name != "scope":
                        _eq(getattr(ha, g.name), getattr(hb, g.name))
        elif isinstance(a, np.ndarray):
            _eq(a, b)


def test_single_hop_many_ranks_matches_reference():
    """More than 256 ranks: the compiled single-hop pass (``fused.single_hop_plan``, every slot its
    rank's) sends the reference's messages and flags its duplicates."""
    from moonep_sim.plan import fused

    R, K = 300, 3
    rng = np.random.default_rng(7)
    tpr = rng.integers(0, 3, R)
    src_T = np.repeat(np.arange(R), tpr)
    off = np.concatenate([[0], np.cumsum(tpr)])
    entry_rank = rng.integers(-1, R, src_T.size * K)
    entry_rank[::K] = entry_rank[1::K]  # some duplicates for dedup
    for dedup in (False, True):
        lay, hop, dup, _, _ = fused.single_hop_plan(entry_rank, np.arange(R), off, K, R, dedup)
        want = ref_single_hop_messages(entry_rank, src_T, off, K, R, dedup)
        for f in dataclasses.fields(Hop):
            if f.name != "scope":
                _eq(getattr(hop, f.name), getattr(want[0], f.name))
        _eq(dup, want[2])
        _eq(lay.entry_rank_N, np.where(entry_rank >= 0, entry_rank, -1).astype(INDEX))


_INT_FIELDS = ("entry_rank_TK", "entry_row_TK", "slot_offset_S", "slot_rows_S", "slot_padded_S", "row_entry_W",
               "expand_src_row_W")
_HOP_FIELDS = ("src_rank_M", "src_row_M", "dst_rank_M", "dst_row_M")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(_INT_FIELDS + _HOP_FIELDS + ("entry_dup_TK", "none")),
       st.integers(-2, 2), st.booleans(), st.sampled_from([1, 4]), st.sampled_from([0, 1, 3, 7]),
       st.sampled_from(["alltoall", "capacity", "deepep"]))
def test_validate_matches_reference_on_corrupted_plans(seed, field, delta, dedup, tp, chunk, strategy):
    """validate() reports exactly what the original implementation reports, valid or corrupted,
    whatever the chunk its checks walk messages, entries and rows in (``chunk`` 0: the default),
    on single-hop plans, plans with dropped entries and padding rows (capacity) and two hops."""
    from conftest import random_routing
    from moonep_sim.strategies import PlanContext, make_plan
    rng = np.random.default_rng(seed)
    R, E, K = 4, 8, 3
    ids, w = random_routing(int(rng.integers(1, 30)), K, E, seed=seed % 1000, skew=1.0)
    routing = GlobalRouting.split_evenly(ids, w, E, R)
    opts = {"alltoall": {"dedup": dedup}, "capacity": {"cf": 0.5 if dedup else 1.0}, "deepep": {}}[strategy]
    p = make_plan(strategy, routing, PlanContext.default(E, R, 2, token_padding=tp), **opts)
    if field in _HOP_FIELDS:
        a = getattr(p.hops[0], field).copy()
        if a.size:
            a[rng.integers(a.size)] += delta
        p = dataclasses.replace(p, hops=(dataclasses.replace(p.hops[0], **{field: a}),))
    elif field == "entry_dup_TK":
        a = p.entry_dup_TK.copy()
        a.flat[rng.integers(a.size)] ^= True
        p = dataclasses.replace(p, entry_dup_TK=a)
    elif field != "none":
        a = getattr(p, field).copy()
        if a.size:
            a.flat[rng.integers(a.size)] += delta
        p = dataclasses.replace(p, **{field: a})
    assert validate(p, _walk_perf(chunk)) == ref_validate(p)


def _walk_perf(chunk: int):
    """validate's settings for a drawn ``chunk`` (0: the default chunk; odd: the block walk for every
    sorted hop too)."""
    return PerfConfig(validate_chunk=chunk or DEFAULT_PERF.validate_chunk,
                       block_walk_min_mean=0 if chunk % 2 else DEFAULT_PERF.block_walk_min_mean)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(_HOP_FIELDS + ("entry_row_TK", "expand_src_row_W", "none")),
       st.integers(-2, 2), st.sampled_from([0, 1, 3, 7]), st.sampled_from(["alltoall", "capacity", "deepep"]))
def test_validate_counting_counts_each_hops_rows(seed, field, delta, chunk, strategy):
    """``validate_counting`` reports what ``validate`` reports and, where it walked every hop, each
    hop's ``rows_RR`` exactly (valid or corrupted hops, block walk and chunk walk); on a valid plan
    it always walks every hop, and ``Plan.summary``'s bytes equal ``bytes_summary``'s own count."""
    from conftest import random_routing
    from moonep_sim.plan.validate import validate_counting
    from moonep_sim.strategies import PlanContext, make_plan
    rng = np.random.default_rng(seed)
    R, E, K = 4, 8, 3
    ids, w = random_routing(int(rng.integers(1, 30)), K, E, seed=seed % 1000, skew=1.0)
    routing = GlobalRouting.split_evenly(ids, w, E, R)
    p = make_plan(strategy, routing, PlanContext.default(E, R, 2))
    valid = field == "none"
    if field in _HOP_FIELDS:
        a = getattr(p.hops[-1], field).copy()
        if a.size:
            a[rng.integers(a.size)] += delta
        p = dataclasses.replace(p, hops=p.hops[:-1] + (dataclasses.replace(p.hops[-1], **{field: a}),))
    elif not valid:
        a = getattr(p, field).copy()
        if a.size:
            a.flat[rng.integers(a.size)] += delta
        p = dataclasses.replace(p, **{field: a})
    errs, rows = validate_counting(p, _walk_perf(chunk))
    assert errs == validate(p, _walk_perf(chunk))
    summary = p.summary() if rows is not None else None  # (a hop with ranks out of range has no rows_RR)
    if valid:
        assert errs == [] and rows is not None
    if rows is not None:
        assert len(rows) == len(p.hops)
        for h, got in zip(p.hops, rows):
            _eq(got, h.rows_RR(R))
        assert summary["invariant_violations"] == errs and summary["bytes"] == p.bytes_summary()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 6)), max_size=12))
def test_segment_ranges_matches_repeat_arange(segs):
    """``segment_ranges`` (one array, cumulative sum in place) equals the two-temporary form, empty
    segments and negative starts included."""
    from moonep_sim.plan.order import segment_ranges
    first = np.array([f for f, _ in segs], dtype=np.int64)
    lens = np.array([n for _, n in segs], dtype=np.int64)
    start = np.cumsum(lens) - lens
    want = np.repeat(first - start, lens) + np.arange(int(lens.sum()), dtype=np.int64)
    got = segment_ranges(first, lens)
    assert got.dtype == np.int64 and np.array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 40)), max_size=12), st.booleans())
def test_segment_ranges_into_a_given_array_equal_repeat_arange(segs, given_out):
    """``segment_ranges`` equals the two-temporary form, long segments too, into a given array or a
    new one."""
    from moonep_sim.plan.order import segment_ranges
    first = np.array([f for f, _ in segs], dtype=np.int64)
    lens = np.array([n for _, n in segs], dtype=np.int64)
    start = np.cumsum(lens) - lens
    want = np.repeat(first - start, lens) + np.arange(int(lens.sum()), dtype=np.int64)
    out = np.full(want.size, 7, dtype=np.int64) if given_out else None
    got = segment_ranges(first, lens, out=out)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert out is None or got is out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=12), st.integers(0, 4))
def test_segment_mask_matches_reference(gaps_lens, tail):
    """``segment_mask`` marks exactly the disjoint segments, adjacent and empty ones included."""
    from moonep_sim.plan.order import segment_mask
    start, pos = [], 0
    for gap, n in gaps_lens:
        pos += gap
        start.append(pos)
        pos += n
    lens = [n for _, n in gaps_lens]
    n_total = pos + tail
    want = np.zeros(n_total, dtype=bool)
    for a, n in zip(start, lens):
        want[a:a + n] = True
    got = segment_mask(np.array(start, dtype=np.int64), np.array(lens, dtype=np.int64), n_total)
    assert got.dtype == bool and np.array_equal(got, want)
