"""``llep``: Least-Loaded Expert Parallelism (LLEP, ICML 2026), as its public code behaves.

Anchor: SalesforceAIResearch/LeastLoadedEP (``compute_llep_lpt_plan``; ``../shared/ANCHORS.md``).
Ranks all-reduce their per-expert counts; the planner then runs on the host, in Python, once per
layer:

1. ``counts_E``: global tokens per expert; each rank's native load is its home group's total.
2. Fallback: if the per-GPU max/mean native load is below ``lambda`` (default 1.3), plain EP (every
   entry at its expert's home rank, no weight moved).
3. Capacity ``cap = int(alpha * (N // R))`` entries per rank (alpha 1.0-1.1; default 1.1).
4. Experts in decreasing load order (ties: lower id). For expert e of home h: remove e from h's
   *pending* native load; h keeps ``min(count, cap - effective(h))`` where
   ``effective(r) = assigned(r) + pending(r)`` (what r already took plus its own experts not yet
   processed); the excess is spilled, chunk by chunk, to the other rank with the least effective
   load: each chunk is ``min(remaining, cap - effective(helper))``; a helper whose chunk would be
   smaller than ``m`` (default 1024) is skipped unless the chunk is the last one; when no helper
   has room the rest goes to the least-loaded one anyway (the code's two spill loops, "partial
   native" and "native full", are reproduced: the first re-sorts the helpers after every chunk, the
   second sorts them once).
5. Each helper receives the expert's weights point-to-point from the home (a Plan copy: prefetch
   charged in forward, the fp32 gradient sent back home in backward).

Transport: one variable-size all-to-all of (token, k) rows to the computing rank (``dedup``: a token
once per destination rank). Entries of expert e are split over its ranks in rank order (the
planning reference's token ranges cover counts only, so any split with the same counts is the same
plan for every cost).

Host cost (``Plan.host_plan_us``, charged by the simulator in the planning step): LLEP reads the
counts back to the host (one device-to-host sync) and plans in a Python loop of ``O(E)`` iterations,
a spilling one building and sorting the list of R helpers. Modelled, with assumed constants (not
measured on a GPU host): ``HOST_SYNC_US`` once per layer, ``HOST_US_PER_EXPERT`` per expert with
tokens, ``HOST_US_PER_HELPER`` per helper considered in a spill round; the plain-EP fallback pays
the sync only (the imbalance check reads one scalar back).

Notation: R ranks, E experts, ``epn = E / R``, T tokens, K top-k, N = T*K entries.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.errors import ConfigError
from moonep_sim.plan import GlobalRouting, Plan
from moonep_sim.strategies import Option, PlanContext, register
from moonep_sim.strategies.moonep import plan_from_alloc, require_home_groups

#: assumed: one device-to-host copy of the counts plus the per-layer barrier on the EP group
HOST_SYNC_US = 30.0
#: assumed: one iteration of the Python loop over experts (no spill)
HOST_US_PER_EXPERT = 1.0
#: assumed: per helper considered in one spill round (list building and sorting of R ranks)
HOST_US_PER_HELPER = 0.5


def native_alloc(counts_E: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Plain EP, the start of every balancing planner: (counts int64 [E], home int64 [E] = e // (E /
    ranks), alloc_ER int64 [E, R] with every expert's entries on its home, load_R int64 [R])."""
    counts = np.asarray(counts_E, dtype=np.int64)
    E, R = counts.size, int(ranks)
    epn = E // R
    home = np.arange(E) // epn
    alloc = np.zeros((E, R), dtype=np.int64)
    alloc[np.arange(E), home] = counts
    return counts, home, alloc, counts.reshape(R, epn).sum(axis=1)


def llep_assign(counts_E: np.ndarray, ranks: int, alpha: float = 1.1, m: int = 1024,
                lam: float = 1.3) -> tuple[np.ndarray, dict]:
    """LLEP's least-loaded assignment (module doc, steps 2-4).

    counts_E: int64 [E] global entries per expert; home of e is ``e // (E / ranks)``.
    Returns (alloc_ER int64 [E, R]: entries of expert e computed on rank r; info dict with
    ``fallback`` (bool), ``imbalance`` (native max/mean), ``capacity``, ``spill_rounds`` and
    ``helpers_considered``).
    """
    counts, home, alloc, native = native_alloc(counts_E, ranks)
    E, R = alloc.shape
    mean = float(native.mean()) if R else 0.0
    imbalance = float(native.max() / mean) if mean > 0 else 1.0
    info = {"fallback": True, "imbalance": imbalance, "capacity": 0, "spill_rounds": 0, "helpers_considered": 0}
    if imbalance < lam or R == 1:
        return alloc, info
    alloc[:] = 0
    total = int(counts.sum())
    cap = max(int(alpha * (total // R)), 1)
    info.update(fallback=False, capacity=cap)
    pending = native.astype(np.int64).copy()
    assigned = np.zeros(R, dtype=np.int64)
    rounds = considered = 0

    def give(e: int, g: int, k: int) -> None:  # k entries of expert e computed on rank g
        alloc[e, g] += k
        assigned[g] += k

    # a loop over experts (E per layer), as the public planner runs on the host; not over tokens
    for e in np.argsort(-counts, kind="stable").tolist():
        n = int(counts[e])
        if n == 0:
            continue
        h = int(home[e])
        pending[h] -= n
        avail = cap - int(assigned[h] + pending[h])
        if avail >= n:
            give(e, h, n)
            continue
        if avail > 0:  # partial native, then spill with the helpers re-sorted every round
            give(e, h, avail)
            remaining = n - avail
            while remaining > 0:
                rounds += 1
                considered += R - 1
                eff = assigned + pending
                others = _helpers_by_load(eff, h)
                if not others:
                    give(e, h, remaining)
                    break
                # one chunk per round, to the least effective load that takes one (else it takes the rest)
                g, chunk = next(((g, c) for g in others if (c := _chunk(remaining, cap - int(eff[g]), m))),
                                (others[0], remaining))
                give(e, g, chunk)
                remaining -= chunk
        else:  # native full: spill everything, helpers sorted once
            rounds += 1
            considered += R - 1
            eff = assigned + pending
            others = _helpers_by_load(eff, h)
            remaining = n
            for g in others:
                if remaining <= 0:
                    break
                chunk = _chunk(remaining, cap - int(eff[g]), m)
                give(e, g, chunk)
                remaining -= chunk
            if remaining > 0:
                give(e, others[0] if others else h, remaining)
    info.update(spill_rounds=rounds, helpers_considered=considered)
    # invariant: per-expert conservation (every entry computed exactly once)
    if not np.array_equal(alloc.sum(axis=1), counts):
        raise ConfigError("llep per-expert conservation failed (internal error)")
    return alloc, info


def _helpers_by_load(eff_R: np.ndarray, home: int) -> list[int]:
    """Every rank but ``home``, least effective load (assigned + pending) first (stable)."""
    return [g for g in np.argsort(eff_R, kind="stable").tolist() if g != home]


def _chunk(remaining: int, room: int, m: int) -> int:
    """Entries a helper with ``room`` free slots takes of ``remaining``: as many as fit, but no
    piece smaller than ``m`` unless it is the last; 0 when the helper is skipped."""
    chunk = min(remaining, room)
    return chunk if room > 0 and (chunk >= m or remaining <= chunk) else 0


def host_plan_us(info: dict, num_experts_with_tokens: int) -> float:
    """The modelled host cost of one layer's LLEP planning (module doc)."""
    if info["fallback"]:
        return HOST_SYNC_US
    return (HOST_SYNC_US + HOST_US_PER_EXPERT * num_experts_with_tokens
            + HOST_US_PER_HELPER * info["helpers_considered"])


@register("llep", summary="LLEP (ICML 2026): spill each hot expert's excess to the least-loaded rank above "
                          "an imbalance threshold; weights point-to-point, host planning charged",
          options={"alpha": Option(float, 1.1, "per-rank capacity factor (capacity = alpha x N/R entries)",
                                   check=lambda v: v > 0 and np.isfinite(v),
                                   constraint="must be > 0: the per-rank capacity is alpha x N/R entries"),
                   "m": Option(int, 1024, "smallest spill chunk (entries) unless it is the last",
                               check=lambda v: v >= 0, constraint="must be >= 0 (entries)"),
                   "lambda": Option(float, 1.3, "plain EP below this per-GPU max/mean load",
                                    check=lambda v: v >= 0 and np.isfinite(v),
                                    constraint="must be >= 0 (a max/mean load ratio)"),
                   "dedup": Option(bool, False, "send a token once per destination rank, expand there")})
def plan(routing: GlobalRouting, ctx: PlanContext, **options) -> Plan:
    # ``lambda`` is a Python keyword: the options arrive as a mapping (all present, checked)
    alpha, m, lam, dedup = options["alpha"], options["m"], options["lambda"], options["dedup"]
    epn = require_home_groups(routing, ctx, "llep")
    counts = routing.counts_E()
    alloc, info = llep_assign(counts, ctx.cluster.ranks, alpha, m, lam)
    host_us = host_plan_us(info, int(np.count_nonzero(counts)))
    opts = {"fallback": info["fallback"], "native_max_over_mean": info["imbalance"], "capacity": info["capacity"],
            "spill_rounds": info["spill_rounds"], "host_plan_us": host_us}
    return plan_from_alloc(routing, ctx, alloc, epn, dedup, options=opts, host_plan_us=host_us)
