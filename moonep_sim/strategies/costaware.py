"""``costaware``: node-deduplicated two-hop transport, plus balance bought only where it pays.

Ours (no published anchor). DeepEP-style transport for the tokens (a token crosses the network
once per destination node, to the GPU with its own local index there, then NVLink to each target
GPU), and MoonEP-style per-step copies of hot experts -- but a copy is planned only when the
straggler time it removes exceeds what its weight bytes cost on the critical path, priced with the
modelled cluster's rates (``PlanContext.topology``: NVLink and NIC bandwidth x efficiency, GPU
FLOP/s and memory bandwidth; weight-copy rates where the topology has them), the model's expert
bytes, in forward (prefetch) and, with ``mode="training"``, backward (fp32 gradient reduce).

Notation
--------
R ranks, G GPUs per node, E experts, ``epn = E / R`` (rank h owns experts ``[h*epn, (h+1)*epn)``),
T tokens, K top-k, N = T*K entries, W one expert's weight bytes, F FLOP/us, M memory bytes/us.

Cost model (estimates in us; the simulator then times the Plan itself)
----------------------------------------------------------------------
- Expert compute of a slot with x rows: ``max(x * W / F, W / M)`` (forward FLOPs per row equal
  the bf16 weight bytes: 2 FLOPs per weight element per row; an active slot reads its weights
  once). Training adds the backward: twice the FLOPs, weights read again.
- NVLink rows, ``(G-1)/G`` of a rank's rows from or to other GPUs, at the NVLink rate capped by
  the kernels' SMs (``sms``). Across nodes the relayed kernel forwards the dispatch over NVLink
  while it crosses the network (the network hop ``H``, estimated from the node shares of the
  entries), so after that hop a rank's path is its compute plus its outputs over NVLink to the
  relays; the network then carries every rank's outputs, so the layer cannot end before the mean
  rank's compute plus the combine's network hop (a floor no balancing lowers: mild imbalance
  hides under it). On one node both the dispatch and the combine rows cross NVLink.
- A copy of W bytes over NVLink (same node) or the NIC (other node) occupies the home's out-port
  and the receiver's in-port (at the topology's weight-copy rates). Weights are sent at planning
  end: a rank's NVLink port is free for them during the network hop for the part its own token
  rows leave; NIC copies share the NIC with that hop and cost their full time. A receiver's
  estimate grows by the wait for its copies beyond its window (its in-port, and its donor's
  out-port that all the donor's copies share); the layer's by the busiest home's NIC copies,
  which hold back that home's tokens on the network hop. Training adds each copy's fp32 gradient (``grad_bytes``) on the
  reverse path, with no window.

Planner
-------
1. Candidates: no copy (exactly ``deepep``); for each target ``tau`` on a grid of rows per rank
   between the mean and the largest home load, two allocations -- copies inside the node only,
   and node-first with cross-node copies allowed; and MoonEP's exact balance (``moonep``'s
   greedy). For a target (:func:`target_alloc`), the rank furthest above it gives a receiver
   below it that receiver's whole room (MoonEP's rule; same node first, the tightest room that
   holds the excess, else the largest), so each receiver is fed by **one** donor rank and holds
   at most ``epn`` copy slots (MoonEP's structural bound: static buffers), and a donor that
   overshoots is left with room a later donor fills. A donor's quota is taken from its experts,
   largest remaining first.
2. The candidate with the smallest estimate wins; one with copies must beat the no-copy estimate
   by at least ``min_gain`` (relative) -- so a balanced routing plans exactly ``deepep``. Under
   heavy skew the winning targets approach balance inside nodes, and exact balance where copies
   are cheap against the compute they move (on one node, MoonEP's plan itself); across nodes only
   where a NIC copy still pays.
3. Entries of expert e are split over its ranks in rank order; the route is ``deepep``'s. On one
   node there is no network hop to deduplicate: the tokens take one NVLink hop, sent once per
   destination GPU (``moonep``'s transport), so exact balance there is ``moonep``'s plan.

The Plan's options report what was accepted and why: the target, copies inside and across
nodes, the residual max/mean rows, the estimates of the chosen plan, of no copy and of exact
balance, and a sentence naming the reason. Cross-node copies of one expert to several GPUs of one
node are relayed (:func:`relay_sources`, the Plan's ``slot_src_S``): the home sends it once over
the NIC to the lowest such rank (stage 0), which fans it out over NVLink (stage 1) once it has
arrived; gradients take the reverse path (stage 1 summed into the relay, then one NIC transfer
home). The cost model prices exactly that (NIC once per node, then the relay's NVLink fan-out);
both executors run it (the simulator gates the relay's sends on its arrival, gloo runs two rounds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from moonep_sim.plan import ClusterShape, GlobalRouting, Plan, Slots, Scope, plan_from_hops, to_final, to_node_of_final
from moonep_sim.plan.kernel import FAMILIES, KernelSpec, family_spec
from moonep_sim.strategies import Option, PlanContext, register
from moonep_sim.strategies.llep import native_alloc
from moonep_sim.plan.ir import even_tokens_per_rank
from moonep_sim.strategies.moonep import (alloc_entry_slots, copy_slots, greedy_quotas, plan_from_alloc,
                                          require_home_groups, split_quotas)

MODES = ("forward", "training")


@dataclass(frozen=True)
class Rates:
    """What the cost model prices with, in bytes or FLOP per microsecond.

    nvlink / nic: token rows.  weight_nvlink / weight_nic: expert weight copies (the topology's
    weight-copy rates -- ``weights_nvlink_bytes_per_us`` / ``weights_nic_bytes_per_us``, capped
    by the SMs of an SM copy kernel -- where it has them, else the link's).  flops / mem: one GPU's achievable rates.
    source: where they came from (a topology name, or the documented defaults).
    """

    nvlink: float
    nic: float
    weight_nvlink: float
    weight_nic: float
    flops: float
    mem: float
    source: str

    @classmethod
    def of(cls, topology: Any, sms: int = 0) -> "Rates":
        """Rates from a topology object (duck-typed), or, for None, from the default preset's file
        (:data:`DEFAULT_PRESET`, read as shipped: the constants the simulator times plans with).
        ``sms``: the kernels' SM budget (0 = none, -1 = all): token rows over NVLink are capped by
        what that many SMs copy (the topology's ``sm_bytes_per_us``), as the simulator caps them."""
        if topology is None:
            r = cls.of(preset_constants(DEFAULT_PRESET), sms)
            return dataclasses.replace(r, source=f"defaults ({DEFAULT_PRESET} preset; no topology in the plan context)")
        t = topology
        nv = float(t.nvlink_bandwidth_GBps) * float(t.nvlink_efficiency) * 1e3
        nic = float(t.nic_bandwidth_GBps) * float(t.nic_efficiency) * 1e3
        if sms and hasattr(t, "sm_bytes_per_us") and int(getattr(t, "sm_count", 0)) > 0:
            nv = min(nv, float(t.sm_bytes_per_us(int(t.sm_count) if sms < 0 else int(sms))))
        # the weight-copy rates of a topology that models them (its ``weights_*`` terms: the
        # engine's achieved fraction of each link, an SM kernel's cap), else the links' rates
        w_nv = _rate(t, "weights_nvlink_bytes_per_us") or _rate(t, "weight_copy_nvlink_GBps") * 1e3 or nv
        w_nic = _rate(t, "weights_nic_bytes_per_us") or _rate(t, "weight_copy_rdma_GBps") * 1e3 or nic
        if getattr(t, "weights_engine", "copy_engine") == "sm" and hasattr(t, "sm_bytes_per_us"):
            cap = float(t.sm_bytes_per_us(int(getattr(t, "weights_sms", 0))))
            w_nv, w_nic = min(w_nv, cap), min(w_nic, cap)
        flops = float(t.gpu_tflops) * float(t.gpu_compute_efficiency) * 1e6
        mem = float(t.gpu_mem_bandwidth_GBps) * float(t.gpu_mem_efficiency) * 1e3
        return cls(nv, nic, w_nv, w_nic, flops, mem, str(getattr(t, "name", "topology")))


#: the preset whose constants price copies when the plan context has no topology: the simulator's
#: and ``moonep-sim plan``'s default (``moonep_sim.experiments.DEFAULT_TOPOLOGY``; a test holds them equal)
DEFAULT_PRESET = "h800-cx7"


def preset_constants(name: str) -> Any:
    """A shipped preset's constants, read from its TOML file (``moonep_sim/data``) as the attributes
    :meth:`Rates.of` reads off a ``moonep_sim.sim.Topology`` (``[nvlink] bandwidth_GBps`` ->
    ``nvlink_bandwidth_GBps``), with the Topology's two derived weight-copy rates and its SM copy
    cap. The planners sit below the simulator, so they read the file, not the class; a test holds
    ``Rates.of(None)`` equal to ``Rates.of(load_topology(DEFAULT_PRESET))``."""
    from types import SimpleNamespace

    from moonep_sim.io import data_toml

    doc = data_toml(f"topology-{name}.toml")
    c = SimpleNamespace(name=doc.get("name", name), **{f"{sec}_{k}": v for sec, tbl in doc.items()
                                                       if isinstance(tbl, dict) and sec != "sources"
                                                       for k, v in tbl.items()})
    c.weights_nvlink_bytes_per_us = c.nvlink_bandwidth_GBps * (getattr(c, "weights_nvlink_efficiency", 0.0)
                                                               or c.nvlink_efficiency) * 1e3
    c.weights_nic_bytes_per_us = c.nic_bandwidth_GBps * (getattr(c, "weights_nic_efficiency", 0.0)
                                                         or c.nic_efficiency) * 1e3
    n_sm, per_sm = int(getattr(c, "sm_count", 0)), float(getattr(c, "sm_copy_GBps", 0.0))
    c.sm_bytes_per_us = lambda sms: float("inf") if n_sm <= 0 or sms <= 0 else min(int(sms), n_sm) * per_sm * 1e3
    return c


def _rate(t: Any, name: str) -> float:
    """A topology's rate attribute as it is given (0 = absent or not positive)."""
    v = getattr(t, name, None)
    return float(v) if isinstance(v, (int, float)) and v > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    """The estimates of the module doc for one layer (all times in us).

    window_us: the dispatch's network hop (0 on one node); combine_window_us: the combine's.
    Across nodes the relayed kernel forwards rows over NVLink while they cross the network, so
    after compute a rank still sends its own rows' outputs over NVLink to the relays, while the
    network carries everyone's: the layer ends at the later of the straggler's compute plus its
    NVLink combine, and the mean rank's compute plus the combine's network hop (a floor no
    balancing lowers). On one node every row crosses NVLink before and after compute.
    """

    rates: Rates
    gpus_per_node: int
    weight_bytes: float
    grad_bytes: float
    dispatch_row_bytes: float
    combine_row_bytes: float
    window_us: float
    combine_window_us: float
    training: bool

    def _comp_us(self, alloc_ER: np.ndarray) -> np.ndarray:
        r, W = self.rates, self.weight_bytes
        x = alloc_ER.astype(np.float64)
        f = 3.0 if self.training else 1.0  # backward: twice the forward FLOPs
        m = 2.0 if self.training else 1.0  # backward reads the weights again
        return np.maximum(x * (f * W / r.flops), (x > 0) * (m * W / r.mem)).sum(axis=0)

    def _nv_us(self, alloc_ER: np.ndarray, row_bytes: float) -> np.ndarray:
        G = self.gpus_per_node
        return alloc_ER.sum(axis=0).astype(np.float64) * row_bytes * ((G - 1) / G) / self.rates.nvlink

    def rank_us(self, alloc_ER: np.ndarray) -> np.ndarray:
        """float64 [R]: each rank's compute plus the NVLink rows on its critical path."""
        b = 2.0 if self.training else 1.0  # backward moves the same rows again
        nv = self._nv_us(alloc_ER, self.combine_row_bytes)
        if self.window_us <= 0:  # one node: the dispatch's NVLink rows too
            nv = nv + self._nv_us(alloc_ER, self.dispatch_row_bytes)
        return self._comp_us(alloc_ER) + b * nv

    def floor_us(self, alloc_ER: np.ndarray) -> float:
        """What no balancing lowers: the mean rank's compute plus the combine's network hop."""
        b = 2.0 if self.training else 1.0
        return float(self._comp_us(alloc_ER).mean()) + b * self.combine_window_us

    def copy_us(self, alloc_ER: np.ndarray, epn: int) -> tuple[np.ndarray, float]:
        """Per rank the wait for its copies beyond the window (float64 [R]: its own in-port and its
        donor's out-port), and the busiest home's NIC copy time (a delay of the network hop every
        rank waits on). Copies of one expert to several ranks of one remote node are relayed
        (:func:`relay_sources`): one NIC copy to the relay, then NVLink copies from it."""
        E, R = alloc_ER.shape
        home = np.arange(E) // epn
        ce, cd = np.nonzero(alloc_ER > 0)
        cp = home[ce] != cd
        ce, cd = ce[cp], cd[cp]
        ch = home[ce]
        geo = ClusterShape(R, self.gpus_per_node)
        src = relay_sources(ce, cd, ch, geo)
        fan = src != ch  # stage 1: from the relay over NVLink, after the relay's NIC copy arrived
        cross = ~geo.same_node(ch, cd) & ~fan
        r = self.rates
        t_w = np.where(cross, self.weight_bytes / r.weight_nic, self.weight_bytes / r.weight_nvlink)
        s0 = ~fan
        # NVLink and NIC are separate ports: sum per (rank, port class), window off the NVLink part
        in_nv = np.bincount(cd[s0 & ~cross], weights=t_w[s0 & ~cross], minlength=R)
        in_nic = np.bincount(cd[cross], weights=t_w[cross], minlength=R)
        out_nv = np.bincount(ch[s0 & ~cross], weights=t_w[s0 & ~cross], minlength=R)
        out_nic = np.bincount(ch[cross], weights=t_w[cross], minlength=R)
        # the relayed kernel forwards tokens over NVLink while they cross the network: a rank's NVLink
        # port is free for weights only for the part of the window its own token rows leave
        w = np.maximum(self.window_us - self._nv_us(alloc_ER, self.dispatch_row_bytes), 0.0)
        # a receiver's weights arrive when both its in-port and its (one) donor's out-port have
        # moved them: the donor's copies share its port, so each of its receivers waits for all
        donor = np.full(R, -1, dtype=np.int64)
        donor[cd] = ch
        has = donor >= 0
        d_nv = np.where(has, out_nv[np.maximum(donor, 0)], 0.0)
        d_nic = np.where(has, out_nic[np.maximum(donor, 0)], 0.0)
        nic_arrive = np.maximum(in_nic, d_nic)
        per_in = np.maximum(np.maximum(in_nv, d_nv) - w, 0.0) + nic_arrive
        if fan.any():  # a fan-out copy starts when its relay's NIC copies arrived, then shares the
            # relay's NVLink out-port with its other fan-out copies and the receiver's in-port
            f_out = np.bincount(src[fan], weights=t_w[fan], minlength=R)
            f_in = np.bincount(cd[fan], weights=t_w[fan], minlength=R)
            t_f = nic_arrive[src[fan]] + np.maximum(f_out[src[fan]], f_in[cd[fan]])
            np.maximum.at(per_in, cd[fan], t_f)
        # NIC copies also hold back the donor's own tokens on the network hop every rank waits on
        out = float(out_nic.max()) if R else 0.0
        if self.training and ce.size:  # fp32 gradients: fan-out ones into the relay, then home
            g = self.grad_bytes
            tg = np.where(cross, g / r.weight_nic, g / r.weight_nvlink)
            per_in = per_in + np.bincount(cd, weights=tg, minlength=R)  # the receiver sends its gradient
            if fan.any():  # the relay receives its fan-out gradients before it sends its own home
                per_in = per_in + np.bincount(src[fan], weights=tg[fan], minlength=R)
            out += float(np.bincount(ch[s0], weights=tg[s0], minlength=R).max())  # the home receives them
        return per_in, out

    def estimate_us(self, alloc_ER: np.ndarray, epn: int) -> float:
        """The layer's estimate after the dispatch's network hop (the part balancing can change)."""
        per_in, out = self.copy_us(alloc_ER, epn)
        return max(float(np.max(self.rank_us(alloc_ER) + per_in)), self.floor_us(alloc_ER)) + out


def relay_sources(expert_C: np.ndarray, rank_C: np.ndarray, home_C: np.ndarray, geo: ClusterShape) -> np.ndarray:
    """int64 [C]: where each copy's weights come from. Copies of one expert to several ranks of one
    node other than its home's are relayed: the lowest such rank (the relay) gets it from the home
    over the NIC (stage 0), the others from the relay over NVLink (stage 1). Every other copy comes
    from its home. C copies, given as (expert, receiving rank, home rank); ``geo``: the cluster,
    saying which node a rank is on."""
    src = np.asarray(home_C, dtype=np.int64).copy()
    if src.size == 0:
        return src
    cross = ~geo.same_node(home_C, rank_C)
    if not cross.any():
        return src
    idx = np.flatnonzero(cross)
    node_C = geo.node_of(rank_C[idx])
    key = expert_C[idx].astype(np.int64) * (int(geo.node_of(int(rank_C.max()))) + 1) + node_C
    o = np.lexsort((rank_C[idx], key))  # by (expert, node), lowest rank first
    ks = key[o]
    first = np.ones(ks.size, dtype=bool)
    first[1:] = ks[1:] != ks[:-1]
    lead = np.maximum.accumulate(np.where(first, np.arange(ks.size), 0))  # each group's relay
    src[idx[o]] = np.where(first, src[idx[o]], rank_C[idx[o[lead]]])
    return src


def network_window_us(counts_E: np.ndarray, tokens_per_rank_R: np.ndarray, top_k: int, gpus_per_node: int,
                      ranks: int, dispatch_row_bytes: float, nic_Bpus: float) -> float:
    """Estimated time the dispatch's network hop keeps NVLink idle (0 on one node): a rank's tokens
    times the expected remote nodes per token (node shares of the entries, K draws) over the NIC."""
    nodes = ClusterShape(ranks, gpus_per_node).num_nodes
    if nodes <= 1 or counts_E.sum() == 0:
        return 0.0
    share = counts_E.reshape(nodes, -1).sum(axis=1) / float(counts_E.sum())
    per_node_hit = 1.0 - (1.0 - np.minimum(share, 1.0)) ** top_k  # P(a token touches node n)
    remote = float(per_node_hit.sum()) * (nodes - 1) / nodes
    return float(np.mean(tokens_per_rank_R)) * remote * dispatch_row_bytes / nic_Bpus


def target_alloc(counts_E: np.ndarray, ranks: int, gpus_per_node: int, tau: int, cross_node: bool) -> np.ndarray:
    """int64 [E, R]: the allocation that brings ranks to at most ``tau`` rows where receivers allow
    (step 1 of the module doc; at most R rounds over ranks, never a loop over tokens).

    Each round takes the rank furthest above ``tau`` (h) and an open receiver u below it -- same
    node first (cross-node only with ``cross_node``), the smallest room that holds h's excess, else
    the largest room -- and moves *u's whole room* from h to u (MoonEP's rule): u is then full and
    closed (fed by one donor), and when h overshoots it is left with room a later donor can fill,
    so no receiver's room is stranded. At ``tau`` = the mean load this reaches exact balance.
    """
    counts, home, alloc, load = native_alloc(counts_E, ranks)
    E, R = alloc.shape
    epn = E // R
    left = counts.copy()  # entries of each expert still at its home
    node = ClusterShape(R, gpus_per_node).node_of_rank()
    open_ = np.ones(R, dtype=bool)  # never fed by a donor yet
    blocked = np.zeros(R, dtype=bool)  # donors with no receiver left
    for _ in range(2 * R + 1):
        over = np.where(blocked, -1, load - tau)
        h = int(np.argmax(over))
        excess = int(over[h])
        if excess <= 0:
            break
        room = tau - load
        ok = open_ & (room > 0)
        ok[h] = False
        same = ok & (node == node[h])
        cand = np.flatnonzero(same) if same.any() else (np.flatnonzero(ok) if cross_node else np.zeros(0, int))
        if cand.size == 0:
            blocked[h] = True
            continue
        rc = room[cand]
        fits = rc >= excess
        u = int(cand[np.argmin(np.where(fits, rc, np.inf))]) if fits.any() else int(cand[np.argmax(rc)])
        q = min(int(room[u]), int(alloc[h * epn:(h + 1) * epn, h].sum()))
        open_[u] = False  # one donor per receiver: at most epn copy slots there
        own = left[h * epn:(h + 1) * epn]  # a view: the quota from h's experts, largest remaining first
        while q > 0:
            le = int(np.argmax(own))
            take = min(q, int(own[le]))
            if take <= 0:
                break
            e = h * epn + le
            alloc[e, u] += take
            alloc[e, h] -= take
            own[le] -= take
            load[u] += take
            load[h] -= take
            q -= take
    return alloc


def costaware_assign(counts_E: np.ndarray, ranks: int, gpus_per_node: int, model: CostModel, grid: int = 24,
                     min_gain: float = 0.01, cross_node: bool = True) -> tuple[np.ndarray, dict]:
    """Pick the allocation with the smallest estimate (steps 1-2). Returns (alloc_ER, info).

    Without ``cross_node`` no candidate copies across nodes (exact balance only on one node)."""
    counts, _, base, load = native_alloc(counts_E, ranks)
    E, R = base.shape
    epn = E // R
    est_none = model.estimate_us(base, epn)
    best, best_est, best_kind, best_tau = base, est_none, "none", int(load.max()) if R else 0
    mean = float(load.sum()) / max(R, 1)
    exact = None
    multi = R > gpus_per_node
    if R > 1 and load.sum() > 0:
        if cross_node or not multi:
            z = greedy_quotas(load, even_tokens_per_rank(int(load.sum()), R))
            exact = split_quotas(counts, z, epn)
            est_exact = model.estimate_us(exact, epn)
            if est_exact < best_est * (1.0 - min_gain):
                best, best_est, best_kind, best_tau = exact, est_exact, "exact", int(np.ceil(mean))
        lo, hi = int(np.ceil(mean)), int(load.max())
        taus = sorted({int(round(v)) for v in np.linspace(lo, hi, grid + 1)[:-1]})
        for cross in ((False, True) if multi and cross_node else (False,)):
            for tau in taus:
                a = target_alloc(counts, R, gpus_per_node, tau, cross)
                est = model.estimate_us(a, epn)
                if est < best_est * (1.0 - (min_gain if best_kind == "none" else 0.0)) - 1e-9:
                    best, best_est, best_kind, best_tau = a, est, "cross-node" if cross else "intra-node", tau
    return best, {"kind": best_kind, "target_rows": best_tau, "estimate_us": best_est,
                  "estimate_no_copy_us": est_none,
                  "estimate_exact_us": model.estimate_us(exact, epn) if exact is not None else est_none}


def _why(info: dict, residual: float) -> str:
    n, x, b = info["estimate_no_copy_us"], info["estimate_exact_us"], info["estimate_us"]
    if info["kind"] == "none":
        return (f"no copy: the best balancing estimate does not beat the no-copy one ({n:.0f} us) by the "
                f"required margin; exact balance would be {x:.0f} us")
    if info["kind"] == "exact":
        return f"exact balance pays: {x:.0f} us estimated against {n:.0f} us without copies"
    return (f"kept max/mean rows {residual:.3f}: {b:.0f} us estimated, against {n:.0f} us without copies and "
            f"{x:.0f} us at exact balance (the further copies cost more than the straggler time they remove)")


@register("costaware", summary="ours: node-dedup two-hop transport plus expert copies only where they pay "
                               "(priced with the topology's NVLink/NIC/GPU rates)",
          options={"sms": Option(int, -2, "SMs its kernels use: -2 = DeepEP's 24 across nodes and MoonEP's 32 on "
                                          "one node; 0 = no SM cap, -1 = all",
                                 check=lambda v: v >= -2, constraint="must be >= -2 (-2 = auto, -1 = all SMs)"),
                   "mode": Option(str, "forward", "price the forward (prefetch) or training (also the fp32 "
                                                  "gradient reduce and backward compute): forward | training",
                                  choices=MODES),
                   "min_gain": Option(float, 0.01, "relative estimated gain a plan with copies must show over none",
                                      check=lambda v: 0 <= v < 1, constraint="must lie in [0, 1): a relative gain"),
                   "grid": Option(int, 24, "targets tried between the mean and the largest home load",
                                  check=lambda v: v >= 1, constraint="must be >= 1 (targets tried)"),
                   "cross_node": Option(bool, True, "allow copies to other nodes when they still pay")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, sms: int, mode: str, min_gain: float, grid: int,
         cross_node: bool) -> Plan:
    epn = require_home_groups(routing, ctx, "costaware")
    R, G = ctx.cluster.ranks, ctx.cluster.gpus_per_node
    one_node = ctx.cluster.num_nodes == 1
    sms_used = sms if sms != -2 else (32 if one_node else 24)
    rates = Rates.of(ctx.topology, sms_used)
    c = ctx.costs
    counts = routing.counts_E()
    window = network_window_us(counts, routing.tokens_per_rank_R, routing.top_k, G, R, c.dispatch_row_bytes, rates.nic)
    comb_window = window * c.combine_row_bytes / max(c.dispatch_row_bytes, 1)
    model = CostModel(rates, G, float(c.weight_bytes), float(c.grad_bytes), float(c.dispatch_row_bytes),
                      float(c.combine_row_bytes), window, comb_window, mode == "training")
    alloc, info = costaware_assign(counts, R, G, model, grid, min_gain, cross_node)
    slot_rank, slot_expert, slot_home = copy_slots(alloc, epn)
    rows = alloc.sum(axis=0)
    copies = slot_home != slot_rank
    cross = ~ctx.cluster.same_node(slot_home, slot_rank)
    residual = float(rows.max() / max(rows.mean(), 1e-12)) if rows.size else 0.0
    opts = {"rates": rates.source, "chosen": info["kind"], "target_rows": int(info["target_rows"]),
            "copies_intra_node": int((copies & ~cross).sum()), "copies_cross_node": int((copies & cross).sum()),
            "residual_max_over_mean": residual, "estimate_us": round(info["estimate_us"], 1),
            "estimate_no_copy_us": round(info["estimate_no_copy_us"], 1),
            "estimate_exact_us": round(info["estimate_exact_us"], 1), "network_window_us": round(window, 1),
            "why": _why(info, residual)}
    opts["sms_used"] = sms_used
    if one_node:  # no network hop to dedup: one NVLink hop, MoonEP's transport and kernel
        return plan_from_alloc(routing, ctx, alloc, epn, True, options=opts, kernel=KernelSpec(sms=sms_used))
    src = slot_home.copy()  # (a slot that is not a copy is on its home)
    src[copies] = relay_sources(slot_expert[copies], slot_rank[copies], slot_home[copies], ctx.cluster)
    relayed = copies & (src != slot_home)
    opts["copies_relayed"] = int(relayed.sum())  # of copies_cross_node: fed over NVLink by a relay
    ids = routing.topk_ids_TK
    if copies.any():
        entry_slot = alloc_entry_slots(ids.ravel(), alloc, slot_rank, slot_expert, ctx.perf).reshape(ids.shape)
    else:  # no copy: every entry at its expert's home slot (slots are the experts in order)
        entry_slot = ids
    # deepep's route and kernel: the relay (same local index on the destination node) forwards rows
    # as they arrive
    hops = [to_node_of_final(ctx.cluster, dedup=True), to_final(Scope.INTRA_NODE, dedup=True)]
    p = plan_from_hops(routing, ctx.cluster, c, Slots(slot_rank, slot_expert, slot_home), entry_slot, hops,
                       token_padding=ctx.token_padding, options=opts, perf=ctx.perf,
                       kernel=family_spec(FAMILIES["deepep-v1"], sms=sms_used, relay=True))
    return dataclasses.replace(p, slot_src_S=src) if relayed.any() else p
