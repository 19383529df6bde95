"""The planners of ``capacity``, ``hierarchical``, ``deepep``, ``allgather`` and ``eplb`` (and the
multi-hop builders behind them) equal their slow references element-wise.

``ref_*`` below are the strategies' first, straightforward implementations (argsort/lexsort over
int64 keys), built on the reference builders (:mod:`moonep_sim.plan.reference`, ``tests/plan_reference.py``); the
references themselves are checked against the named invariants and the routing
(``test_references_are_valid_plans``). Every field of the package's Plans (values and dtypes, hops included; not
``plan_seconds``) must equal the reference's, on named small cases, on hypothesis-drawn routings
(uneven ranks, padding, custom placements with replicas, every option variant) and on a
medium-sized skewed layer. ``plan_from_slots``, ``slot_layout`` and ``single_hop_messages`` are
pinned the same way in ``tests/test_plan_builders.py``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_routing
from moonep_sim.errors import ConfigError, PlanError, require
from moonep_sim.perf import PerfConfig
from moonep_sim.plan import (INDEX, ClusterShape, Entries, GlobalRouting, Hop, Padding, Placement, Plan, RowCosts,
                             Route, Slots, validate)
from moonep_sim.strategies import PlanContext, make_plan

# Notation: T tokens, K top-k, E experts, R ranks, G GPUs per node, N = T*K entries, S slots.

# ==================================================================================================
# references (the original implementations)
# ==================================================================================================

# --- moonep_sim.plan.multihop ------------------------------------------------------------------

# the references of the builders: the package's readable primitives (moonep_sim.plan.reference) and
# tests/plan_reference.py's compositions of them; the strategies' references below call them with
# the strategy's name and options, as make_plan stamps them

import plan_reference  # noqa: E402
from moonep_sim.plan import reference  # noqa: E402

ref_route_hop, ref_dup_flags = reference.route_hop, reference.dup_flags
from moonep_sim.plan import home_slots as ref_home_slots  # noqa: E402  (a placement's home slots: one plain form)
from conftest import tokens_per_expert_RE  # noqa: E402


def ref_assemble_plan(strategy: str, options: dict[str, Any], *args, started: float | None = None, **kw) -> Plan:
    """``plan_reference.assemble_plan``, stamped as ``make_plan`` stamps a Plan."""
    p = plan_reference.assemble_plan(*args, options=options, **kw)
    return dataclasses.replace(p, strategy=strategy, plan_seconds=time.perf_counter() - started if started else 0.0)


def ref_plan_from_routes(strategy: str, options: dict[str, Any], *args, started: float | None = None,
                         **kw) -> Plan:
    """``plan_reference.plan_from_routes``, stamped as ``make_plan`` stamps a Plan."""
    p = plan_reference.plan_from_routes(*args, options=options, **kw)
    return dataclasses.replace(p, strategy=strategy, plan_seconds=time.perf_counter() - started if started else 0.0)


# --- moonep_sim.strategies.capacity ------------------------------------------------------------

def ref_capacity_per_rank_R(tokens_per_rank_R: np.ndarray, top_k: int, num_experts: int, cf: float) -> np.ndarray:
    """int64 [R]: rows each source rank may send each expert, ``ceil(s_r*K/E*cf)``."""
    s = np.asarray(tokens_per_rank_R, dtype=np.int64)
    # exact ceil of s*K*cf/E, guarding float noise (e.g. 0.1*30 = 3.0000000000000004)
    x = s * top_k * float(cf) / num_experts
    return np.ceil(np.round(x, 9)).astype(np.int64)


def ref_keep_mask_N(ids_N: np.ndarray, weights_N: np.ndarray, src_N: np.ndarray, cap_R: np.ndarray,
                num_experts: int, drop: str) -> np.ndarray:
    """bool [N]: which entries fit their (source rank, expert) capacity (vectorised).

    drop=weight keeps the highest weights (ties: earlier entry first); drop=position keeps the
    earliest entries (token order, then k).
    """
    n = ids_N.size
    group = src_N * num_experts + ids_N
    if drop == "weight":
        # lexsort is stable: equal (group, weight) keep entry order, so earlier entries win ties
        order = np.lexsort((-weights_N.astype(np.float64), group))
    else:
        order = np.argsort(group, kind="stable")
    gs = group[order]
    cnt = np.bincount(gs, minlength=int(cap_R.size) * num_experts) if n else np.zeros(0, np.int64)
    start = np.cumsum(cnt) - cnt
    rank_in_group = np.arange(n, dtype=np.int64) - start[gs]
    keep = np.empty(n, dtype=bool)
    keep[order] = rank_in_group < cap_R[gs // num_experts]
    return keep


def ref_capacity(routing: GlobalRouting, ctx: PlanContext, cf: float = 1.0, drop: str = "weight", pad: bool = True) -> Plan:
    t0 = time.perf_counter()
    require(cf > 0 and math.isfinite(cf), f"cf ({cf:g}) must be > 0: the capacity factor scales the "
                                          "rows each expert takes")
    if drop not in ("weight", "position"):
        raise ConfigError(f"drop ({drop!r}) must be 'weight' or 'position'")
    T, K = routing.topk_ids_TK.shape
    E, R = routing.num_experts, ctx.cluster.ranks
    sr, se, slot_of = ref_home_slots(ctx.placement)
    S = sr.size
    cap_R = ref_capacity_per_rank_R(routing.tokens_per_rank_R, K, E, cf)
    ids = routing.topk_ids_TK.ravel()
    src = np.repeat(routing.src_rank_T(), K)
    keep = ref_keep_mask_N(ids, routing.topk_weights_TK.ravel(), src, cap_R, E, drop)
    entry_slot = np.where(keep, slot_of[ids], -1)
    kept = np.flatnonzero(keep)
    tok = kept // max(K, 1)
    k_slot = entry_slot[kept]
    k_src = src[kept]
    k_dst = sr[k_slot]
    # receive buffer on each destination: blocks (src rank, slot in rank order), each C_src rows when
    # padding (kept rows first, zero rows after), or only the kept rows without padding
    per_rs = np.bincount(k_src * S + k_slot, minlength=R * S).reshape(R, S)  # kept rows per (src, slot)
    block_RS = np.broadcast_to(cap_R[:, None], (R, S)) if pad else per_rs
    # offset of block (r, s) within its destination buffer: blocks ordered by (src r, slot s)
    dst_of_S = sr
    blk_dst = np.broadcast_to(dst_of_S[None, :], (R, S)).ravel()
    blk_len = np.ascontiguousarray(block_RS).ravel().astype(np.int64)
    blk_key = blk_dst * (R * S) + np.arange(R * S)  # (dst, src, slot) order
    o = np.argsort(blk_key, kind="stable")
    lens = blk_len[o]
    cum = np.cumsum(lens) - lens
    dst_start = np.concatenate([[0], np.cumsum(np.bincount(blk_dst, weights=blk_len, minlength=R))]).astype(np.int64)
    blk_off = np.empty(R * S, dtype=np.int64)
    blk_off[o] = cum - dst_start[blk_dst[o]]
    dst_rows_R = np.bincount(blk_dst, weights=blk_len, minlength=R).astype(np.int64)
    # position of each kept entry within its (src, slot) block: global order (layout order)
    b = k_src * S + k_slot
    ob = np.argsort(b, kind="stable")
    cnt_b = per_rs.ravel()
    pos = np.empty(kept.size, dtype=np.int64)
    pos[ob] = np.arange(kept.size) - (np.cumsum(cnt_b) - cnt_b)[b[ob]]
    e_buf_row = blk_off[b] + pos
    # messages: kept rows, plus zero rows (C_r - kept) of each block when padding
    m_src = [k_src]
    m_srow = [tok - routing.tok_off_R()[k_src]]
    m_dst = [k_dst]
    m_row = [e_buf_row]
    pad_slot = pad_row = np.zeros(0, np.int64)
    if pad:
        zeros = (block_RS - per_rs).ravel()
        zb = np.repeat(np.arange(R * S), zeros)
        zj = np.arange(zb.size) - np.repeat(np.cumsum(zeros) - zeros, zeros)
        pad_row = blk_off[zb] + cnt_b[zb] + zj
        pad_slot = zb % S
        m_src.append(zb // S)
        m_srow.append(np.full(zb.size, -1, np.int64))
        m_dst.append(dst_of_S[pad_slot])
        m_row.append(pad_row)
    ms, mr, md, mw = (np.concatenate(a) for a in (m_src, m_srow, m_dst, m_row))
    # (src, dst, dst_row) order; dst rows are unique per dst, so one int64 key sorts them
    om = np.argsort((ms * R + md) * (int(dst_rows_R.max()) + 1) + mw)
    hop = Hop("global", ms[om], mr[om], md[om], mw[om], dst_rows_R)
    entry_buf_row = np.full(T * K, -1, dtype=np.int64)
    entry_buf_row[kept] = e_buf_row
    # static capacity: per slot sum_r C_r rows, rounded up to token_padding
    tp = max(int(ctx.token_padding), 1)
    slot_cap = np.full(S, int(cap_R.sum()), dtype=np.int64)
    slot_cap = (slot_cap + tp - 1) // tp * tp
    capacity_R = np.bincount(sr, weights=slot_cap, minlength=R).astype(np.int64)
    return ref_assemble_plan("capacity", {"cf": cf, "drop": drop, "pad": pad,
                                      "capacity_per_source_rank": int(cap_R.max()) if R else 0},
                         routing, ctx.cluster, ctx.costs, Slots(sr, se, sr),
                         Entries(entry_slot, entry_buf_row, np.zeros(T * K, dtype=bool)), [hop],
                         padding=Padding(tp, slot_cap if pad else None, pad_slot, pad_row), capacity_R=capacity_R,
                         started=t0)


# --- moonep_sim.strategies.hierarchical --------------------------------------------------------

def ref_hierarchical(routing: GlobalRouting, ctx: PlanContext, dedup: bool = False) -> Plan:
    t0 = time.perf_counter()
    G = ctx.cluster.gpus_per_node
    sr, se, slot_of = ref_home_slots(ctx.placement)
    entry_slot = slot_of[routing.topk_ids_TK].ravel()
    dst = sr[entry_slot]
    src = np.repeat(routing.src_rank_T(), routing.top_k)
    via = (src // G) * G + dst % G  # same node as the source, local index of the destination
    return ref_plan_from_routes("hierarchical", {"dedup": dedup}, routing, ctx.cluster, ctx.costs, Slots(sr, se, sr),
                                entry_slot.reshape(routing.topk_ids_TK.shape),
                                Route([via], ("intra_node", "inter_node"), (dedup, dedup)),
                                token_padding=ctx.token_padding, started=t0)


# --- moonep_sim.strategies.deepep --------------------------------------------------------------

def ref_nodes_per_token_T(node_TK: np.ndarray) -> np.ndarray:
    """int64 [T]: distinct nodes among each token's K destinations."""
    if node_TK.size == 0:
        return np.zeros(node_TK.shape[0], dtype=np.int64)
    s = np.sort(node_TK, axis=1)
    return 1 + (s[:, 1:] != s[:, :-1]).sum(axis=1).astype(np.int64)


def ref_deepep(routing: GlobalRouting, ctx: PlanContext, max_nodes: int = 0, sms: int | None = None,
               impl: str = "deepep-v1") -> Plan:
    t0 = time.perf_counter()
    require(max_nodes >= 0, f"max_nodes ({max_nodes}) must be >= 0 (0 = no limit)")
    G = ctx.cluster.gpus_per_node
    sr, se, slot_of = ref_home_slots(ctx.placement)
    ids = routing.topk_ids_TK
    entry_slot = slot_of[ids]
    dst_TK = sr[entry_slot]
    npt = ref_nodes_per_token_T(dst_TK // G)
    if max_nodes and npt.size and int(npt.max()) > max_nodes:
        t = int(np.argmax(npt > max_nodes))
        raise PlanError(f"nodes of token {t} ({int(npt[t])}) must be <= max_nodes ({max_nodes}): the given "
                        "routing is not node-limited; route from logits with node_limited_topk")
    src = np.repeat(routing.src_rank_T(), routing.top_k)
    via = (dst_TK.ravel() // G) * G + src % G  # destination node, the source's local index
    # the registry stamps every declared option (sms, the kernel's SM budget, included)
    opts = {"max_nodes": max_nodes, "sms": sms, "impl": impl,
            "max_nodes_per_token": int(npt.max()) if npt.size else 0,
            "mean_nodes_per_token": float(npt.mean()) if npt.size else 0.0}
    return ref_plan_from_routes("deepep", opts, routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), entry_slot,
                                Route([via], ("inter_node", "intra_node"), (True, True)),
                                token_padding=ctx.token_padding, started=t0)


# --- moonep_sim.strategies.allgather -----------------------------------------------------------

def ref_allgather(routing: GlobalRouting, ctx: PlanContext) -> Plan:
    t0 = time.perf_counter()
    R, T, K = ctx.cluster.ranks, routing.num_tokens, routing.top_k
    sr, se, slot_of = ref_home_slots(ctx.placement)
    # messages sorted by (src, dst, token): src r sends its tokens [off_r, off_r + s_r) to every dst
    tok_off = routing.tok_off_R()
    tpr = routing.tokens_per_rank_R
    src_T = routing.src_rank_T()
    # for each source rank, its token block repeated for every destination
    tok = np.concatenate([np.tile(np.arange(tok_off[r], tok_off[r + 1]), R) for r in range(R)]) if T \
        else np.zeros(0, np.int64)  # loop over ranks only; sizes grow with tokens inside numpy
    src = src_T[tok] if T else tok
    dst = np.concatenate([np.repeat(np.arange(R), tpr[r]) for r in range(R)]) if T else tok
    hop = Hop("global", src.astype(np.int64), (tok - tok_off[src]).astype(np.int64), dst.astype(np.int64),
              tok.astype(np.int64), np.full(R, T, dtype=np.int64))
    entry_slot = slot_of[routing.topk_ids_TK].ravel()
    entry_rank = sr[entry_slot]
    entry_buf_row = np.repeat(np.arange(T, dtype=np.int64), K)  # every rank's buffer holds token t at row t
    return ref_assemble_plan("allgather", {}, routing, ctx.cluster, ctx.costs, Slots(sr, se, sr),
                             Entries(entry_slot, entry_buf_row, ref_dup_flags(entry_rank, K)), [hop],
                             padding=Padding(ctx.token_padding), started=t0)


# --- moonep_sim.strategies.eplb ----------------------------------------------------------------

def ref_choose_replicas(ids_N: np.ndarray, slot_expert_S: np.ndarray, num_experts: int, choice: str) -> np.ndarray:
    """int64 [N]: the slot each entry uses. The j-th entry of expert e in global order takes
    replica ``j % c_e`` (round_robin) or ``j * c_e // n_e`` (contiguous: equal consecutive shares)."""
    E = num_experts
    rep = np.argsort(slot_expert_S, kind="stable")  # slots grouped by expert, in slot order
    c = np.bincount(slot_expert_S, minlength=E)
    c_start = np.cumsum(c) - c
    n_e = np.bincount(ids_N, minlength=E)
    order = np.argsort(ids_N, kind="stable")
    j = np.empty(ids_N.size, dtype=np.int64)
    j[order] = np.arange(ids_N.size) - (np.cumsum(n_e) - n_e)[ids_N[order]]
    if choice == "round_robin":
        r = j % c[ids_N]
    elif choice == "contiguous":
        r = j * c[ids_N] // np.maximum(n_e[ids_N], 1)
    else:
        raise ConfigError(f"choice ({choice!r}) must be 'round_robin' or 'contiguous'")
    return rep[c_start[ids_N] + r]


def ref_eplb(routing: GlobalRouting, ctx: PlanContext, **opts) -> Plan:
    """eplb's planning body was not rewritten, only its replica choice: run the module's own body
    with the reference choice swapped in for its pass over the experts' runs."""
    import moonep_sim.strategies.eplb as eplb_mod

    def ref_slots(ids_N, slot_expert_S, num_experts, choice, perf=None):
        return ref_choose_replicas(ids_N, slot_expert_S, num_experts, choice).astype(INDEX)

    fast = eplb_mod.replica_slots
    eplb_mod.replica_slots = ref_slots
    try:
        return make_plan("eplb", routing, ctx, **opts)  # the registry stamps name, options and time
    finally:
        eplb_mod.replica_slots = fast


# ==================================================================================================
# comparison
# ==================================================================================================

REFS = {"capacity": ref_capacity, "hierarchical": ref_hierarchical, "deepep": ref_deepep,
        "allgather": ref_allgather, "eplb": ref_eplb}
VARIANTS = {
    "capacity": [{}, {"cf": 0.5, "drop": "position"}, {"cf": 2.0, "pad": False}, {"cf": 0.25},
                 {"cf": 0.7, "pad": False, "drop": "position"}],
    "hierarchical": [{}, {"dedup": True}],
    "deepep": [{}],
    "allgather": [{}],
    "eplb": [{}, {"choice": "contiguous", "dedup": True}, {"num_redundant": 0}],
}
COSTS = RowCosts(dispatch_row_bytes=7, combine_row_bytes=5, weight_bytes=11, grad_bytes=13)


def _eq(name: str, a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != reference {b.dtype}"
    assert a.shape == b.shape, f"{name}: shape {a.shape} != reference {b.shape}"
    if not np.array_equal(a, b):
        bad = np.flatnonzero((a != b).ravel())
        raise AssertionError(f"{name}: {bad.size} elements differ from the reference, first at flat index "
                             f"{int(bad[0])}: {a.ravel()[bad[0]]} != {b.ravel()[bad[0]]}")


def assert_same_plan(p: Plan, q: Plan) -> None:
    """Every field of two Plans equal (arrays: values, shapes and dtypes), plan_seconds and kernel
    excepted (the kernel spec says what GPU kernel carries the rows, not what the planner decided)."""
    for f in dataclasses.fields(Plan):
        a, b = getattr(p, f.name), getattr(q, f.name)
        if f.name in ("plan_seconds", "kernel"):
            continue
        if f.name == "hops":
            assert len(a) == len(b), f"hops: {len(a)} != reference {len(b)}"
            for i, (ha, hb) in enumerate(zip(a, b)):
                assert ha.scope == hb.scope, f"hop {i} scope {ha.scope} != reference {hb.scope}"
                for g in dataclasses.fields(Hop):
                    if g.name != "scope":
                        _eq(f"hop {i} {g.name}", getattr(ha, g.name), getattr(hb, g.name))
        elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            if a is None or b is None:
                assert a is b, f"{f.name}: {a!r} != reference {b!r}"
            else:
                _eq(f.name, a, b)
        else:
            assert a == b, f"{f.name}: {a!r} != reference {b!r}"


def compare(name: str, routing: GlobalRouting, ctx: PlanContext, **opts) -> Plan:
    p = make_plan(name, routing, ctx, **opts)
    q = REFS[name](routing, ctx, **opts)
    assert_same_plan(p, q)
    return p


def _routing(T_per_rank, K: int, E: int, seed: int, skew: float = 1.0) -> GlobalRouting:
    tpr = np.asarray(T_per_rank, dtype=np.int64)
    ids, w = random_routing(int(tpr.sum()), K, E, seed, skew)
    return GlobalRouting(ids, w.astype(np.float32), tpr, E)


# --- named cases ----------------------------------------------------------------------------------

def _named_cases():
    rng = np.random.default_rng(5)
    out = {}
    out["even_R8_G4"] = (_routing([40] * 8, 4, 32, 1), PlanContext(ClusterShape(8, 4), Placement.home_groups(32, 8),
                                                                  COSTS, 1))
    out["uneven_R4_G2_pad4"] = (_routing([0, 7, 31, 3], 3, 12, 2, 2.0),
                                PlanContext(ClusterShape(4, 2), Placement.home_groups(12, 4), COSTS, 4))
    out["one_token"] = (_routing([1, 0], 2, 4, 3), PlanContext(ClusterShape(2, 1), Placement.home_groups(4, 2),
                                                              COSTS, 1))
    out["no_tokens"] = (_routing([0, 0, 0, 0], 2, 8, 4), PlanContext(ClusterShape(4, 2), Placement.home_groups(8, 4),
                                                                    COSTS, 2))
    ids = np.tile(np.array([5, 1, 2]), (30, 1))  # every token on the same experts
    out["same_experts"] = (GlobalRouting(ids, rng.random((30, 3)).astype(np.float32), np.array([10, 10, 5, 5]), 8),
                           PlanContext(ClusterShape(4, 2), Placement.home_groups(8, 4), COSTS, 1))
    w = np.round(rng.random((48, 2)).astype(np.float32) * 4) / 4  # many equal weights: tie order matters
    ids = np.stack([rng.permutation(6)[:2] for _ in range(48)])
    out["weight_ties"] = (GlobalRouting(ids, w, np.array([24, 12, 6, 6]), 8),
                          PlanContext(ClusterShape(4, 4), Placement.home_groups(8, 4), COSTS, 1))
    # a custom placement whose home slots are not in expert order, with replicas (ignored by these
    # strategies, but their slot indices shift the home slots')
    E, R = 8, 4
    slot_rank = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3])
    slot_expert = np.array([3, 0, 5, 6, 1, 2, 7, 3, 4, 5, 1])
    home = np.array([0, 3, 2, 2, 3, 0, 1, 2])
    out["custom_placement"] = (_routing([9, 3, 12, 6], 3, E, 6, 1.5),
                               PlanContext(ClusterShape(R, 2), Placement(E, R, slot_rank, slot_expert, home),
                                           COSTS, 2))
    return out


NAMED = _named_cases()


@pytest.mark.parametrize("case", sorted(NAMED))
@pytest.mark.parametrize("name", sorted(REFS))
def test_named_cases_match_reference(name, case):
    routing, ctx = NAMED[case]
    for opts in VARIANTS[name]:
        compare(name, routing, ctx, **opts)


@pytest.mark.parametrize("case", sorted(NAMED))
@pytest.mark.parametrize("name", sorted(REFS))
def test_references_are_valid_plans(name, case):
    """The pair of the equality tests: a reference's Plan is right on its own terms -- it passes
    every named invariant, each kept entry is computed at a slot of its own expert, the rows per
    expert conserve the kept entries, and dropless strategies keep every entry."""
    routing, ctx = NAMED[case]
    for opts in VARIANTS[name]:
        q = REFS[name](routing, ctx, **opts)
        assert validate(q) == [], (name, case, opts, validate(q))
        slot = np.full(q.entry_rank_TK.size, -1, dtype=np.int64)
        kept = q.entry_rank_TK.ravel() >= 0
        g = q.row_off_R()[q.entry_rank_TK.ravel()[kept]] + q.entry_row_TK.ravel()[kept]
        slot_of_row = np.repeat(np.arange(q.slot_rank_S.size), q.slot_padded_S)
        slot[kept] = slot_of_row[g]
        np.testing.assert_array_equal(q.slot_expert_S[slot[kept]], routing.topk_ids_TK.ravel()[kept])
        per_e = np.bincount(routing.topk_ids_TK.ravel()[kept], minlength=routing.num_experts)
        np.testing.assert_array_equal(tokens_per_expert_RE(q).sum(axis=0), per_e)
        if name != "capacity":
            assert q.dropped == 0, (name, case, opts)


def test_named_cases_cover_their_regimes():
    """The table holds what it claims: drops and padding, empty ranks, padding of slots, duplicates."""
    r, ctx = NAMED["uneven_R4_G2_pad4"]
    assert (r.tokens_per_rank_R == 0).any() and ctx.token_padding > 1
    cap = make_plan("capacity", *NAMED["same_experts"], cf=0.5)
    assert cap.dropped > 0 and cap.padded > 0
    assert make_plan("capacity", *NAMED["even_R8_G4"], cf=8.0).dropped == 0  # 40 rows per (rank, expert): no drop
    w = NAMED["weight_ties"][0].topk_weights_TK
    assert np.unique(w).size < w.size // 2
    dp = make_plan("deepep", *NAMED["even_R8_G4"])
    assert dp.entry_dup_TK.any() and len(dp.hops) == 2
    assert NAMED["no_tokens"][0].num_tokens == 0
    p = NAMED["custom_placement"][1].placement
    assert (p.slot_rank_S != p.home_E[p.slot_expert_S]).any()  # replicas present


# --- hypothesis ------------------------------------------------------------------------------------

@st.composite
def cases(draw):
    G = draw(st.sampled_from([1, 2, 4]))
    R = G * draw(st.integers(1, 3))
    E = R * draw(st.integers(1, 4))
    K = draw(st.integers(1, min(E, 5)))
    tpr = np.array(draw(st.lists(st.integers(0, 20), min_size=R, max_size=R)), dtype=np.int64)
    T = int(tpr.sum())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    skew = draw(st.sampled_from([0.0, 1.0, 3.0]))
    if T:
        g = rng.normal(0, skew, E)[None, :] + rng.gumbel(size=(T, E))
        ids = np.argsort(-g, axis=1)[:, :K].astype(np.int64)
    else:
        ids = np.zeros((0, K), np.int64)
    # quantised weights make ties common (drop=weight breaks them by entry order)
    levels = draw(st.sampled_from([0, 3]))
    w = rng.random((T, K)).astype(np.float32)
    if levels:
        w = np.floor(w * levels).astype(np.float32)
    tp = draw(st.sampled_from([1, 3, 4]))
    return GlobalRouting(ids, w, tpr, E), PlanContext(ClusterShape(R, G), Placement.home_groups(E, R), COSTS, tp)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(sorted(REFS)), st.integers(0, 4))
def test_random_cases_match_reference(case, name, variant):
    routing, ctx = case
    opts = VARIANTS[name][variant % len(VARIANTS[name])]
    compare(name, routing, ctx, **opts)


@pytest.mark.parametrize("K", [6, 8])
def test_medium_layer_matches_reference(K):
    """A skewed layer big enough for every fast path: R=16 (G=4), E=64, K=6 or 8 (a power of two:
    tokens by a shift, the table-route path of ``plan_from_routes``), uneven tokens."""
    rng = np.random.default_rng(11)
    tpr = rng.integers(100, 400, 16)
    routing = _routing(tpr, K, 64, 12, 1.2)
    for tp in (1, 8):
        ctx = PlanContext(ClusterShape(16, 4), Placement.home_groups(64, 16), COSTS, tp)
        for name in sorted(REFS):
            for opts in VARIANTS[name]:
                compare(name, routing, ctx, **opts)


def test_many_ranks_match_reference():
    """More than 256 ranks: rank ids no longer fit a byte and (src, dst) keys no longer 16 bits, so
    the route hops and capacity's groups take their wide-key paths."""
    R, G, E = 264, 8, 264
    rng = np.random.default_rng(5)
    routing = _routing(rng.integers(0, 4, R), 4, E, 3, 1.0)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(E, R), COSTS, 1)
    for name in ("deepep", "hierarchical", "capacity"):
        for opts in VARIANTS[name]:
            compare(name, routing, ctx, **opts)


# --- the builders on their own, beyond what the strategies pass them -------------------------------

def keep_mask_N(ids_N: np.ndarray, weights_N: np.ndarray, src_N: np.ndarray, cap_R: np.ndarray,
                num_experts: int, drop: str) -> np.ndarray:
    """bool [N]: which entries fit their (source rank, expert) capacity by capacity's own rules --
    ``_keep_heaviest_A`` (drop=weight: the highest weights, ties by earlier entry) or the first
    ``cap`` of each group (drop=position) -- over every (source rank, expert) group at once."""
    from moonep_sim.plan.order import segment_mask
    from moonep_sim.strategies.capacity import _keep_heaviest_A
    ids_N, src_N, cap_R = (np.asarray(a, dtype=np.int64) for a in (ids_N, src_N, cap_R))
    n, n_groups = ids_N.size, int(cap_R.size) * num_experts
    group = src_N * num_experts + ids_N
    A = np.argsort(group, kind="stable")  # (group, entry) order
    cnt = np.bincount(group, minlength=n_groups).astype(np.int64) if n else np.zeros(n_groups, np.int64)
    cap_G = np.repeat(cap_R, num_experts)
    keep = np.empty(n, dtype=bool)
    if drop == "weight":
        keep[A] = _keep_heaviest_A(A, cnt, cap_G, weights_N)
    else:  # the sorted entries of group g sit at [start_g, start_g + cnt_g); the first cap_g stay
        keep[A] = segment_mask(np.cumsum(cnt) - cnt, np.minimum(cnt, np.maximum(cap_G, 0)), n)
    return keep


def test_keep_mask_matches_reference_on_special_weights():
    """NaN, infinities, signed zeros, negatives, subnormals and many ties: the radix key orders
    weights exactly as the reference's float sort does."""
    rng = np.random.default_rng(3)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 0.5, -0.5, 1.0, 3.0e38],
                       dtype=np.float32)
    R, E, n = 3, 5, 4000
    ids = rng.integers(0, E, n)
    src = np.sort(rng.integers(0, R, n))
    few = np.array([0.0, -0.0, np.nan, -np.nan, -1e-45], dtype=np.float32)  # ties at every cut
    for w in (special[rng.integers(0, special.size, n)], few[rng.integers(0, few.size, n)],
              rng.normal(size=n).astype(np.float32)):
        for cap in (np.array([0, 3, 40]), np.array([500, 1, 7]), rng.integers(0, 300, R)):
            for drop in ("weight", "position"):
                _eq(f"keep {drop}", keep_mask_N(ids, w, src, cap, E, drop), ref_keep_mask_N(ids, w, src, cap, E, drop))
    # more than 2**16 (source rank, expert) groups: the group key takes two radix digits
    R, E, n = 300, 250, 20000
    ids, src = rng.integers(0, E, n), rng.integers(0, R, n)
    w = np.floor(rng.random(n) * 4).astype(np.float32)
    cap = rng.integers(0, 3, R)
    for drop in ("weight", "position"):
        _eq(f"keep {drop} wide", keep_mask_N(ids, w, src, cap, E, drop), ref_keep_mask_N(ids, w, src, cap, E, drop))


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([3, 8, 70, 300]))
def test_dup_flags_match_reference(seed, R):
    """``dup_flags`` (the bit-set path up to 64 ranks, the sort path beyond, with dropped entries).
    (``route_hop`` is the reference's own: the multi-hop builder is the readable one below the
    compiled threshold, ``tests/test_plan_fused.py`` holds the compiled two-hop route to it.)"""
    from moonep_sim.plan.multihop import dup_flags
    rng = np.random.default_rng(seed)
    K = int(rng.integers(1, 6))
    er = rng.integers(-1, R, K * int(rng.integers(0, 60)))
    er[::2] = np.maximum(er[::2], 0)
    _eq("dup", dup_flags(er, K), ref_dup_flags(er, K))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 2**31 - 1), st.sampled_from([2, 3]), st.booleans())
def test_plan_from_routes_matches_reference(case, seed, H, table):
    """Routes given per entry (arbitrary intermediate ranks: a token's entries bound for one rank
    may pass different ranks) or as [R, R] tables, with dropped entries and every dedup choice."""
    from moonep_sim.plan import home_slots, plan_from_routes
    routing, ctx = case
    rng = np.random.default_rng(seed)
    R, (T, K) = ctx.cluster.ranks, routing.topk_ids_TK.shape
    sr, se, slot_of = home_slots(ctx.placement)
    entry_slot = slot_of[routing.topk_ids_TK]
    if rng.random() < 0.5:
        entry_slot = np.where(rng.random(entry_slot.shape) < 0.2, -1, entry_slot)
    dedup = tuple(bool(b) for b in rng.integers(0, 2, H))
    scopes = ("global",) * H
    if table:
        tabs = [rng.integers(0, R, (R, R)) for _ in range(H - 1)]
        src = np.repeat(routing.src_rank_T(), K)
        dst = sr[np.maximum(entry_slot.ravel(), 0)]
        vias = [t[src, dst] for t in tabs]
    else:
        vias = [rng.integers(0, R, T * K) for _ in range(H - 1)]
    args = (routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), entry_slot)
    # builders leave strategy and options to the registry (make_plan stamps them)
    want = ref_plan_from_routes("", {}, *args, Route(vias, scopes, dedup), token_padding=ctx.token_padding)
    got = plan_from_routes(*args, Route(tabs if table else vias, scopes, dedup, via_table=table),
                           token_padding=ctx.token_padding)
    assert_same_plan(got, want)


def test_nodes_per_token_matches_reference():
    from moonep_sim.routing.metrics import distinct_per_token
    rng = np.random.default_rng(9)
    for hi in (1, 8, 64, 200):  # bit-set path below 64 nodes, sort path from 64
        node = rng.integers(0, hi, (300, 6))
        _eq(f"nodes < {hi}", distinct_per_token(node, np.arange(hi)), ref_nodes_per_token_T(node))
    _eq("no tokens", distinct_per_token(np.zeros((0, 3), np.int64), np.arange(1)),
        ref_nodes_per_token_T(np.zeros((0, 3), np.int64)))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["round_robin", "contiguous"]))
def test_choose_replicas_matches_reference(seed, choice):
    """Each entry's replica (and the by-slot order eplb plans from) equals the reference's, with
    experts of one to several replicas and experts nobody picks."""
    from moonep_sim.plan import slot_layout
    from moonep_sim.strategies.eplb import replica_slots
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 12))
    slot_expert = np.concatenate([np.arange(E), rng.integers(0, E, int(rng.integers(0, 10)))])
    rng.shuffle(slot_expert)
    ids = rng.integers(0, E, int(rng.integers(0, 300)))
    want = ref_choose_replicas(ids, slot_expert, E, choice)
    for perf in (PerfConfig(plan_compiled_min=0), PerfConfig(plan_compiled_min=1 << 62)):
        got = replica_slots(ids, slot_expert, E, choice, perf=perf)
        _eq("entry_slot", got.astype(np.int64), want)
        lay = slot_layout(got, np.zeros(slot_expert.size, dtype=np.int64), perf=perf)  # one rank: the by-slot order
        _eq("order", lay.order_N.astype(np.int64), np.argsort(want, kind="stable"))
        _eq("slot_rows", lay.slot_rows_S, np.bincount(want, minlength=slot_expert.size))
