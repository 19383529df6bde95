"""``moonep``: MoonEP's perfectly balanced dispatch via per-step redundant copies of hot experts.

Every rank computes exactly its share of the layer's ``N = T*K`` (token, k) entries, however
skewed the routing: the planner, run per layer on the live global routing, moves whole blocks of a
hot expert's entries to under-loaded ranks, which prefetch that expert's weights (and send its
weight gradient home in backward) instead of the tokens piling up on the home rank.

Notation
--------
R ranks, E experts, ``epn = E / R`` experts per home group (rank h owns experts
``[h*epn, (h+1)*epn)``), T tokens of all ranks (rank order), K top-k, N = T*K entries (flat id
``t*K + k``), S slots (home experts, then copies, rank by rank).

Algorithm (DESIGN.md section 3; the public MoonEP planning reference)
--------------------------------------------------------------------
1. ``counts_E``: global tokens per expert (the column sums of ``tpe[src_rank, expert]``).
2. Capacity ``cap_R``: N split as evenly as possible, the first ``N % R`` ranks taking one more.
   When every rank passes s tokens this is ``s*K`` on every rank (MoonEP's ``CAP``); when ranks pass
   different token counts, capacity comes from the total, not from each rank's own tokens.
   ``balance[h] = sum(counts of group h) - cap_R[h]`` (> 0 overloaded, < 0 room); it sums to 0.
3. Greedy: while some group is overloaded, take the most overloaded group h (``argmax``, lowest
   rank on ties) and the destination u with the most room (``argmin``, lowest rank on ties) and
   move *exactly u's room* from h to u: u is then full (balance 0) for good. When h's excess is
   smaller than u's room, h gives the full room anyway (it has the tokens: its load is
   ``cap + excess >= room``), overshoots, and is left with room that a later group fills. Moving
   only ``min(room, excess)`` instead would leave u with room that a second group could fill;
   moving the full room is what guarantees the load-bearing invariant: each rank is chosen as a
   destination at most once, so it receives migrated tokens from **at most one** remote home group
   and needs at most ``epn`` copy slots. Every rank ends with exactly ``cap_R`` real rows.
   At most R iterations, each an argmax/argmin over R values.
4. Within group h, its quotas ``z[h, d]`` are served largest quota first, each from the group's
   local experts with the most remaining tokens first (``min(remaining, quota)`` at a time) ->
   ``alloc[e, d]``. The rest of each expert stays home.
5. Slots of rank d: its ``epn`` home experts in expert order, then one copy slot per remote expert
   with ``alloc[e, d] > 0`` (largest allocation first, ties by larger expert id, as the public
   reference orders its prefetch slots); a copy's ``slot_home_S`` is the expert's home rank, so the
   Plan charges its weight prefetch and its fp32 gradient reduce.
6. Entries of expert e are taken in their global order (tokens of source ranks concatenated in rank
   order, then k) and split over e's destinations **in rank order** (the home rank sits at its own
   rank position, not first): the first ``alloc[e, 0]`` entries go to rank 0, the next
   ``alloc[e, 1]`` to rank 1, and so on (the reference's ``searchsorted(cumsum(alloc[e]), g)``).
   Rows are expert-grouped per rank in slot order, each segment padded to ``token_padding``;
   entries of one token landing on one rank are sent once (``dedup``) and expanded there.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.errors import ConfigError, PlanError, require
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import GlobalRouting, Plan, Slots, plan_from_slots
from moonep_sim.plan.ir import even_tokens_per_rank
from moonep_sim.plan.runs import split_runs
from moonep_sim.plan.kernel import KernelSpec
from moonep_sim.strategies import Option, PlanContext, register


def greedy_quotas(group_tokens_R: np.ndarray, cap_R: np.ndarray) -> np.ndarray:
    """int64 [R, R] ``z[h, d]``: tokens home group h migrates to rank d (step 3 of the module doc).

    group_tokens_R: tokens routed to each home group; cap_R: each rank's real-row target; the two
    must have equal sums. Each column of z has at most one non-zero entry (one remote group per
    destination); the diagonal is zero.
    """
    R = group_tokens_R.size
    balance = group_tokens_R.astype(np.int64) - cap_R
    if int(balance.sum()) != 0:
        raise PlanError(f"group tokens ({int(group_tokens_R.sum())}) must equal total capacity "
                        f"({int(cap_R.sum())}): every entry needs a row")
    z = np.zeros((R, R), dtype=np.int64)
    for _ in range(R + 1):  # each pass fills one rank for good: at most R passes
        h = int(np.argmax(balance))
        if balance[h] <= 0:
            break
        u = int(np.argmin(balance))  # balance sums to 0, so balance[u] < 0 and u != h
        room = -int(balance[u])
        z[h, u] = room
        balance[h] -= room
        balance[u] = 0
    # invariant: every rank is full and no rank took tokens from two groups
    if balance.any() or ((z > 0).sum(axis=0) > 1).any():
        raise PlanError("moonep greedy must fill every rank from at most one remote group (internal error)")
    return z


def split_quotas(counts_E: np.ndarray, z_RR: np.ndarray, epn: int) -> np.ndarray:
    """int64 [E, R] ``alloc[e, d]``: tokens of expert e computed on rank d (step 4 of the module doc).

    Group h serves its quotas ``z[h, :]`` largest first, each from its local experts with the most
    remaining tokens first; whatever is left of an expert stays on its home rank.
    """
    E, R = counts_E.size, z_RR.shape[0]
    alloc = np.zeros((E, R), dtype=np.int64)
    alloc[np.arange(E), np.arange(E) // epn] = counts_E
    for h in np.flatnonzero(z_RR.sum(axis=1)):
        remaining = [int(c) for c in counts_E[h * epn:(h + 1) * epn]]
        quotas = [int(q) for q in z_RR[h]]
        while True:  # at most (destinations + epn) passes: each empties a quota or an expert
            d = max(range(R), key=quotas.__getitem__)  # first index of the maximum
            if quotas[d] <= 0:
                break
            le = max(range(epn), key=remaining.__getitem__)
            take = min(remaining[le], quotas[d])
            if take <= 0:
                raise PlanError(f"home group {h} must hold the tokens it migrates (internal error)")
            e = h * epn + le
            alloc[e, d] += take
            alloc[e, h] -= take
            remaining[le] -= take
            quotas[d] -= take
    if not np.array_equal(alloc.sum(axis=1), counts_E):
        raise PlanError("moonep per-expert token conservation failed (internal error)")
    return alloc


def copy_slots(alloc_ER: np.ndarray, epn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slots of every rank: epn home experts, then copies (largest allocation first, ties by larger id).

    Returns (slot_rank_S, slot_expert_S, slot_home_S), sorted by rank.
    """
    E, R = alloc_ER.shape
    home_E = np.arange(E, dtype=np.int64) // epn
    ce, cd = np.nonzero((alloc_ER > 0) & (home_E[:, None] != np.arange(R)[None, :]))
    # order copies by (rank, -alloc, -expert)
    o = np.lexsort((-ce, -alloc_ER[ce, cd], cd))
    ce, cd = ce[o].astype(np.int64), cd[o].astype(np.int64)
    rank = np.concatenate([home_E, cd])
    expert = np.concatenate([np.arange(E, dtype=np.int64), ce])
    home = home_E[expert]
    o = np.argsort(rank, kind="stable")  # home slots of a rank first, then its copies in order
    return rank[o], expert[o], home[o]


#: How MoonEP's combine sums a token's K rows: ``"fused"``. Sourced from MoonEP's moonep/combine.py
#: (CombineKernel): a pull on the token's own rank -- one cooperative grid of ``num_sms`` CTAs (32 by
#: default), each with one warp issuing per-row TMA bulk loads (cp.async.bulk) of the token's rows
#: from the peers' NVLink-mapped buffers into a shared-memory pipeline, four warps accumulating each
#: row into fp32 registers as it lands, and one warp storing the bf16 sum -- so the K-way sum runs
#: on the same 32 SMs as the transfer, row by row, and only the pipeline's last rows are summed
#: after they arrived; duplicate (token, rank) entries are pre-summed on the expert's rank by the
#: combine prologue (moonep/combine_prologue.py). docs/results/moonep-combine.md.
COMBINE_REDUCE = "fused"


@register("moonep",
          summary="MoonEP: per-step redundant copies of hot experts on under-loaded ranks; exactly s*K rows per rank",
          options={"dedup": Option(bool, True, "send a token once per destination rank, expand there"),
                   "sms": Option(int, 32, "SMs its kernels use (MoonEP's benchmark gives it 32; 0 = no SM cap, -1 = all)",
                                 check=lambda v: v >= -1, constraint="must be >= 1, 0 (no SM cap) or -1 (all)")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, dedup: bool, sms: int) -> Plan:
    E, R = routing.num_experts, ctx.cluster.ranks
    epn = require_home_groups(routing, ctx, "moonep")
    ids_N = routing.topk_ids_TK.ravel()
    counts_E = np.bincount(ids_N, minlength=E).astype(np.int64)
    cap_R = even_tokens_per_rank(ids_N.size, R)  # N split as evenly as possible (step 2)
    z = greedy_quotas(counts_E.reshape(R, epn).sum(axis=1), cap_R)
    alloc = split_quotas(counts_E, z, epn)
    # static buffer: cap real rows plus padding of at most 2*epn segments (home + copies)
    capacity = cap_R + 2 * epn * (max(int(ctx.token_padding), 1) - 1)
    return plan_from_alloc(routing, ctx, alloc, epn, dedup, capacity_R=capacity,
                           kernel=KernelSpec(sms=sms, reduce=COMBINE_REDUCE, zero_copy=True))


def require_home_groups(routing: GlobalRouting, ctx: PlanContext, name: str) -> int:
    """epn; raises unless the placement is contiguous home groups (rank h owns [h*epn, (h+1)*epn))."""
    E, R = routing.num_experts, ctx.cluster.ranks
    require(routing.ranks == R, f"routing ranks ({routing.ranks}) must equal cluster ranks ({R})")
    if E % R:
        raise ConfigError(f"num_experts ({E}) must be divisible by ranks ({R}) for {name}'s home-group placement")
    epn = E // R
    p = ctx.placement
    if p.num_experts != E or p.num_slots != E or not np.array_equal(p.home_E, np.arange(E) // epn):
        raise ConfigError(f"placement must be home groups (rank h owns experts [h*{epn}, (h+1)*{epn})) for "
                          f"{name}: its copies are planned per step, not placed statically")
    return epn


def alloc_entry_slots(ids_N: np.ndarray, alloc_ER: np.ndarray, slot_rank_S: np.ndarray, slot_expert_S: np.ndarray,
                      perf: PerfConfig = DEFAULT_PERF) -> np.ndarray:
    """INDEX [N] the slot of each entry (experts ``ids_N`` int [N]) when expert e's entries, in global
    order, are cut into consecutive pieces of ``alloc[e, 0], alloc[e, 1], ...`` entries, piece d
    going to e's slot on rank d (``copy_slots``' slots): :func:`moonep_sim.plan.runs.split_runs`."""
    E, R = alloc_ER.shape
    slot_of_ER = np.full((E, R), -1, dtype=np.int64)
    slot_of_ER[slot_expert_S, slot_rank_S] = np.arange(slot_rank_S.size)
    pe, pd = np.nonzero(alloc_ER)
    if bool((slot_of_ER[pe, pd] < 0).any()):
        raise PlanError("every allocated (expert, rank) pair must have a slot (internal error)")
    return split_runs(ids_N, E, pe, alloc_ER[pe, pd], slot_of_ER[pe, pd], perf=perf)


def plan_from_alloc(routing: GlobalRouting, ctx: PlanContext, alloc_ER: np.ndarray, epn: int, dedup: bool,
                    options: dict | None = None, **extra) -> Plan:
    """The single-hop Plan computing ``alloc[e, r]`` entries of expert e on rank r (step 6 of the
    module doc; copies where r is not e's home) in the slots :func:`copy_slots` makes of it, each
    entry's slot its expert's run cut into pieces in rank order (:func:`alloc_entry_slots`).
    ``options``: what the planner reports (see :func:`moonep_sim.plan.plan_from_slots`); extra:
    further Plan fields."""
    slot_rank, slot_expert, slot_home = copy_slots(alloc_ER, epn)
    entry_slot = alloc_entry_slots(routing.topk_ids_TK.ravel(), alloc_ER, slot_rank, slot_expert, ctx.perf)
    return plan_from_slots(routing, ctx.cluster, ctx.costs, Slots(slot_rank, slot_expert, slot_home), entry_slot,
                           dedup=dedup, token_padding=max(int(ctx.token_padding), 1), options=options, perf=ctx.perf,
                           **extra)
