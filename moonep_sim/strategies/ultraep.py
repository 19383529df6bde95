"""``ultraep``: a per-layer quota by threshold search, replicas inside the NVLink domain (UltraEP).

Anchor: UltraEP (arXiv 2606.04101; ``../shared/ANCHORS.md``): each layer and micro-batch, a quota
found by binary search on a global load threshold decides placement and re-routing together;
replicas only inside the NVLink domain, at most ``replica_cap`` tokens per replica (1024),
locality-aware; weights copied to the replicas. As read here:

1. ``load_R``: entries each rank computes under home groups (rank h owns ``[h*epn, (h+1)*epn)``).
2. For a threshold ``tau``, :func:`quota_for` tries to bring every rank to at most ``tau``: ranks
   over it, largest excess first, shed their hottest experts' entries into replicas on ranks of
   the same NVLink domain (``domain`` ranks, default a node) with room under ``tau`` -- the hot
   expert's own node first, then the rank with the most room -- each replica taking at most
   ``replica_cap`` entries, each rank holding at most ``max_replicas`` replicas (default epn).
   ``tau`` is feasible when every excess finds room.
3. Binary search on ``tau`` between the mean load (perfect balance) and the largest load (no
   replica), until the bracket is within ``epsilon`` (relative, default 0.01) of the upper end;
   the plan uses the smallest feasible ``tau`` found.
4. Weight sync: each replica fetches its expert's weights directly from the home (a Plan copy:
   prefetch charged in forward, the fp32 gradient reduced home in backward). UltraEP's relay tree
   is not modelled (the executors have no relayed weight copy); inside one node the direct copies
   use NVLink only.

Transport: one variable-size all-to-all to the computing rank (``dedup``: once per destination
rank). The solve runs on the GPU in the paper (67-78 us at EP64), so no host cost is charged
beyond the planning step every strategy pays.

Notation: R ranks, E experts, ``epn = E / R``, D ranks per NVLink domain, N = T*K entries.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.errors import require
from moonep_sim.plan import ClusterShape, GlobalRouting, Plan
from moonep_sim.strategies import Option, PlanContext, register
from moonep_sim.strategies.llep import native_alloc
from moonep_sim.strategies.moonep import plan_from_alloc, require_home_groups


def quota_for(counts_E: np.ndarray, ranks: int, domain: int, gpus_per_node: int, tau: float,
              replica_cap: int, max_replicas: int) -> tuple[np.ndarray, bool]:
    """Replicas that bring every rank to at most ``tau`` entries, if the domain allows (step 2).

    Returns (alloc_ER int64 [E, R], feasible). Infeasible allocations are still valid (every
    entry computed once); they just leave some rank above ``tau``.
    """
    counts, home, alloc, load = native_alloc(counts_E, ranks)
    E, R = alloc.shape
    epn = E // R
    cap_tau = int(np.floor(tau))
    n_rep = np.zeros(R, dtype=np.int64)
    feasible = True
    node = ClusterShape(R, max(gpus_per_node, 1)).node_of_rank()
    # donors, largest excess first (a loop over ranks and replicas, never over tokens)
    for h in np.argsort(-load, kind="stable").tolist():
        excess = int(load[h]) - cap_tau
        if excess <= 0:
            break
        lo = (h // domain) * domain
        peers = np.array([r for r in range(lo, min(lo + domain, R)) if r != h], dtype=np.int64)
        own = np.arange(h * epn, (h + 1) * epn)
        left = alloc[own, h].copy()  # entries of each own expert still at home
        while excess > 0:
            le = int(np.argmax(left))
            if left[le] <= 0 or peers.size == 0:
                feasible = False
                break
            e = int(own[le])
            room = cap_tau - load[peers]
            # a new replica of e: a peer with room, a free replica slot, and no replica of e yet
            ok = (room > 0) & (n_rep[peers] < max_replicas) & (alloc[e, peers] == 0)
            if not ok.any():
                left[le] = 0  # e cannot shed more; try the next hottest expert
                continue
            same = ok & (node[peers] == node[h])  # the hot expert's own node first
            cand = np.flatnonzero(same if same.any() else ok)
            u = int(peers[cand[int(np.argmax(room[cand]))]])  # then the most room (ties: lowest rank)
            take = min(excess, int(left[le]), int(cap_tau - load[u]))
            if replica_cap > 0:
                take = min(take, replica_cap)
            n_rep[u] += 1
            alloc[e, u] += take
            alloc[e, h] -= take
            left[le] -= take
            load[u] += take
            load[h] -= take
            excess -= take
    return alloc, feasible


def ultraep_assign(counts_E: np.ndarray, ranks: int, domain: int, gpus_per_node: int, replica_cap: int = 1024,
                   epsilon: float = 0.01, max_replicas: int | None = None) -> tuple[np.ndarray, dict]:
    """Binary search on the threshold (step 3). Returns (alloc_ER, info) with the threshold used,
    the search's iterations and whether perfect balance was reachable."""
    counts = np.asarray(counts_E, dtype=np.int64)
    E, R = counts.size, int(ranks)
    epn = E // R
    mr = epn if max_replicas is None else int(max_replicas)
    load = counts.reshape(R, epn).sum(axis=1)
    lo = float(load.sum()) / R
    hi = float(load.max()) if R else 0.0
    best, _ = quota_for(counts, R, domain, gpus_per_node, hi, replica_cap, mr)
    tau, it = hi, 0
    a, ok = quota_for(counts, R, domain, gpus_per_node, np.ceil(lo), replica_cap, mr)
    if ok:
        best, tau, hi = a, float(np.ceil(lo)), float(np.ceil(lo))
    while hi - lo > epsilon * max(hi, 1.0):
        it += 1
        mid = 0.5 * (lo + hi)
        a, ok = quota_for(counts, R, domain, gpus_per_node, mid, replica_cap, mr)
        if ok:
            best, tau, hi = a, mid, mid
        else:
            lo = mid
    return best, {"threshold": tau, "mean_load": float(load.sum()) / max(R, 1), "iterations": it,
                  "max_load_before": int(load.max()) if R else 0}


@register("ultraep", summary="UltraEP: per-layer quota by binary search on a load threshold; replicas inside "
                             "the NVLink domain, capped per replica; weights copied directly",
          options={"epsilon": Option(float, 0.01, "relative tolerance of the threshold search",
                                     check=lambda v: 0 < v < 1, constraint="must lie in (0, 1): a relative tolerance"),
                   "replica_cap": Option(int, 1024, "most entries one replica takes (0 = no cap)",
                                         check=lambda v: v >= 0, constraint="must be >= 0 (0 = no cap)"),
                   "domain": Option(int, 0, "ranks per NVLink domain (0 = one node)",
                                    check=lambda v: v >= 0, constraint="must be >= 0 (0 = one node)"),
                   "max_replicas": Option(int, -1, "most replicas one rank holds (-1 = E/R)",
                                          check=lambda v: v >= -1, constraint="must be >= 0, or -1 for E/R"),
                   "dedup": Option(bool, False, "send a token once per destination rank, expand there")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, epsilon: float, replica_cap: int, domain: int,
         max_replicas: int, dedup: bool) -> Plan:
    epn = require_home_groups(routing, ctx, "ultraep")
    R, G = ctx.cluster.ranks, ctx.cluster.gpus_per_node
    D = domain or G
    require(1 <= D and R % D == 0 and (D % G == 0 or G % D == 0),
            f"domain ({D}) must divide ranks ({R}) and align with nodes of {G} GPUs")
    alloc, info = ultraep_assign(routing.counts_E(), R, D, G, replica_cap, epsilon,
                                 None if max_replicas < 0 else max_replicas)
    rows = alloc.sum(axis=0)
    opts = {"domain": D, "threshold": info["threshold"], "search_iterations": info["iterations"],
            "max_over_mean": float(rows.max() / max(rows.mean(), 1e-12)) if rows.size else 0.0}
    return plan_from_alloc(routing, ctx, alloc, epn, dedup, options=opts)
