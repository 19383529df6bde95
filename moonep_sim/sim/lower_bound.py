"""A layer's lower bound: ``max(comm_LB, compute_LB)`` (DESIGN section 6), sound for every strategy.

Notation: R ranks, E experts, N nodes; ``n[r, e]`` = kept (token, k) entries of rank r's tokens
routed to expert e (distinct tokens: a token picks an expert once). Row sizes: D dispatch row,
C combine (and gradient) row; W one expert's weights, Gb its fp32 gradient.

compute_LB
    The plan's real rows' FLOPs, and the weights of every expert with rows read once, spread
    perfectly evenly over the R GPUs at the achievable peak (roofline of the totals), plus one
    launch (``compute.compute_lower_bound_us``). Dropped entries are not computed by anyone, so
    they are not counted (a dropping strategy solves a smaller problem; the bound is the plan's).

comm_LB (per rank, then per node; the maximum is taken)
    Let ``n_1 >= n_2 >= ...`` be rank r's counts for the experts *not resident* on r (resident =
    a non-copy slot of the plan on r). Whatever a strategy does, for each such expert either its
    weights come to r (W bytes into r) or every token of r routed to it leaves r (one row out
    each, and at least one result row back). Bringing the j largest experts' weights leaves at
    least ``L_j = max(n_{j+1}, T_r - (n_1 + ... + n_j))`` distinct tokens that must go out and come
    back (T_r: r's tokens with at least one non-resident expert; j experts' weights can keep at
    most ``n_1 + ... + n_j`` of them home), so r's ports carry at least ``in_j = j*W + C*L_j`` and
    ``out_j = D*L_j`` bytes. The bound for r is
    ``min_j max(in_j / in_bw, out_j / out_bw)`` plus one link latency when it is non-zero, where
    in_bw / out_bw are r's NVLink plus NIC bandwidths (as the simulator's effective rates; the
    NIC only when there are several nodes, NVLink only when the node has several GPUs).
    The node bound is the same with counts summed over the node's ranks, resident = on any of
    its ranks, and bandwidth = the node's NICs. With backward included (a training step) the
    same choice also costs ``j*Gb`` out (the copies' gradients go home) and the tokens' gradient
    rows go both ways: ``in_j = j*W + 2C*n``, ``out_j = j*Gb + (D + C)*n``.
    Dedup (a token sent once for several experts) cannot beat it: ``n_{j+1}`` counts distinct
    tokens of *one* expert. Copies of copies cannot beat it: any weight bytes enter r's ports.

The bound is for nominal hardware: faults only slow the simulation down; jitter, which can be
faster than nominal on a draw, is the one input under which the bound may be beaten.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from moonep_sim.models import ModelSpec
from moonep_sim.plan import Plan
from moonep_sim.sim.compute import compute_lower_bound_us
from moonep_sim.sim.topology import Topology


@dataclass(frozen=True)
class LowerBound:
    lower_bound_us: float
    comm_us: float
    compute_us: float
    binding: str        # "compute" | "rank R ports" | "node N NICs"

    def to_dict(self) -> dict:
        return asdict(self)


CHUNK = 1 << 20   # entries per pass of the per-entry loops: their temporaries stay small and reused


class _Entries:
    """The plan's kept entries as (token, expert, source rank) arrays, read from its rows.

    Per entry only what the bound needs is kept: its token ``tok`` and its (source rank, expert)
    cell ``key = src * E + exp`` (int32 where they fit). These have one element per entry (8M at
    EP256 with 1M tokens of top-8), so the bound's cost is mostly fresh memory: the key is built
    in the buffer of the experts, and the per-entry work runs in chunks of ``chunk`` entries (the
    same counts whatever it is)."""

    def __init__(self, plan: Plan, chunk: int = CHUNK):
        R, E, K = plan.ranks, plan.num_experts, plan.top_k
        self.R, self.E, self.T, self.chunk = R, E, plan.num_tokens, int(chunk)
        i_tok = np.int32 if self.T * K < 2**31 else np.int64
        i_key = np.int32 if R * E < 2**31 else np.int64
        key = np.repeat(plan.slot_expert_S.astype(i_key), plan.slot_padded_S)   # the expert, for now
        ent = plan.row_entry_W
        if plan.padded:
            real = ent >= 0
            ent, key = ent[real], key[real]
        self.tok = ent.astype(i_tok)
        self.tok //= i_tok(K)
        # tokens are numbered rank by rank: rank r's are [off[r], off[r + 1])
        self.tok_off_R1 = plan.tok_off_R().astype(np.int64, copy=False)
        tpr = np.asarray(plan.tokens_per_rank_R)
        even = bool(tpr.size and (tpr == tpr[0]).all() and tpr[0] > 0)
        src_T = None if even else np.repeat(np.arange(R, dtype=i_key), tpr)
        for c0 in range(0, key.size, chunk):
            tok = self.tok[c0:c0 + chunk]
            # even split: a division; else np.take (fancy indexing with 32-bit indices is slower)
            src = (tok // i_tok(tpr[0])).astype(i_key, copy=False) if even else np.take(src_T, tok)
            src *= i_key(E)
            key[c0:c0 + chunk] += src
        self.key = key
        self.n_RE = np.bincount(self.key, minlength=R * E).reshape(R, E)

    def tokens_needing(self, resident_RE: np.ndarray) -> np.ndarray:
        """int64 [R]: tokens of each rank with a kept entry whose expert ``resident_RE`` (bool
        [R, E], per source rank) does not hold."""
        away = (~np.asarray(resident_RE, dtype=bool)).ravel()
        flag = np.zeros(self.T, dtype=bool)
        for c0 in range(0, self.key.size, self.chunk):
            need = np.take(away, self.key[c0:c0 + self.chunk])
            np.put(flag, self.tok[c0:c0 + self.chunk][need], True)
        c = np.concatenate([[0], np.cumsum(flag, dtype=np.int64)])
        return c[self.tok_off_R1[1:]] - c[self.tok_off_R1[:-1]]


def _choice_bound(n_XE: np.ndarray, resident_XE: np.ndarray, a_in: float, b_in: float, a_out: float,
                  b_out: float, bw_in, bw_out, tokens_X: np.ndarray | None = None) -> np.ndarray:
    """[X] min over j of max(in_j / bw_in, out_j / bw_out) (see the module docstring); ``bw_in`` /
    ``bw_out``: one bandwidth, or float64 [X, 1] one per row."""
    m = np.where(resident_XE, 0, n_XE).astype(np.float64)
    srt = -np.sort(-m, axis=1)
    X, E = srt.shape
    nxt = np.concatenate([srt, np.zeros((X, 1))], axis=1)  # n_{j+1} for j = 0..E
    if tokens_X is not None:  # tokens left uncovered by any j experts' weights
        covered = np.concatenate([np.zeros((X, 1)), np.cumsum(srt, axis=1)], axis=1)
        nxt = np.maximum(nxt, np.asarray(tokens_X, np.float64)[:, None] - covered)
    j = np.arange(E + 1, dtype=np.float64)[None, :]
    t_in = (j * a_in + b_in * nxt) / bw_in
    t_out = (j * a_out + b_out * nxt) / bw_out
    # fetching weights for experts with zero tokens is never useful: j beyond the non-zero count adds cost only
    return np.maximum(t_in, t_out).min(axis=1)


def lower_bound(plan: Plan, model: ModelSpec, topo: Topology, backward: bool = False) -> LowerBound:
    """The layer's lower bound (forward, or forward + backward when ``backward``)."""
    R, E = plan.ranks, plan.num_experts
    c = plan.costs
    D, C, W, Gb = float(c.dispatch_row_bytes), float(c.combine_row_bytes), float(c.weight_bytes), float(c.grad_bytes)
    if backward:
        a_in, b_in, a_out, b_out = W, 2 * C, Gb, D + C
    else:
        a_in, b_in, a_out, b_out = W, C, 0.0, D
    comp = compute_lower_bound_us(plan, model, topo, False)
    if backward:
        comp += compute_lower_bound_us(plan, model, topo, True)
    res = np.zeros((R, E), dtype=bool)
    home = ~plan.is_copy_S()
    res[plan.slot_rank_S[home], plan.slot_expert_S[home]] = True
    ents = _Entries(plan)
    n_RE, tok_R = ents.n_RE, ents.tokens_needing(res)
    geo = topo.cluster(R)
    G, nodes = geo.gpus_per_node, geo.num_nodes
    comm, binding = 0.0, "compute"
    nic_rank = topo.nic_bytes_per_us * (G if topo.nic_attach == "node" else 1)  # a node's link: any rank may use it all
    bw = (topo.nvlink_bytes_per_us if G > 1 else 0.0) + (nic_rank if nodes > 1 else 0.0)
    if bw > 0:
        lat = min(topo.nvlink_latency_us if G > 1 else np.inf, topo.nic_latency_us if nodes > 1 else np.inf)
        t_R = _choice_bound(n_RE, res, a_in, b_in, a_out, b_out, bw, bw, tok_R)
        t_R = np.where(t_R > 0, t_R + lat, 0.0)
        r = int(np.argmax(t_R))
        comm, binding = float(t_R[r]), f"rank {r} ports"
    if nodes > 1:
        node = geo.node_of(np.arange(R))
        n_NE = np.zeros((nodes, E), dtype=np.int64)
        np.add.at(n_NE, node, n_RE)
        res_NE = np.zeros((nodes, E), dtype=bool)
        np.logical_or.at(res_NE, node, res)
        tok_N = np.bincount(node, weights=ents.tokens_needing(res_NE[node]), minlength=nodes).astype(np.int64)
        gpus_N = np.bincount(node, minlength=nodes).astype(np.float64)
        bwn = (gpus_N * topo.nic_bytes_per_us)[:, None]   # each node's NICs
        t_N = _choice_bound(n_NE, res_NE, a_in, b_in, a_out, b_out, bwn, bwn, tok_N)
        t_N = np.where(t_N > 0, t_N + topo.nic_latency_us, 0.0)
        k = int(np.argmax(t_N))
        if t_N[k] > comm:
            comm, binding = float(t_N[k]), f"node {k} NICs"
    lb = max(comm, comp)
    return LowerBound(lb, comm, comp, binding if comm >= comp else "compute")


__all__ = ["LowerBound", "lower_bound"]
