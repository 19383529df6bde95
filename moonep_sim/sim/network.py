"""Flow-level network model on simpy: ports shared max-min fairly by concurrent transfers.

Notation: R ranks, G GPUs per node, F flows (one per (phase, source, destination) with bytes > 0),
P ports, L = 9 ports per path at most (shorter paths are padded with a dummy port of infinite
capacity). Units: bytes, microseconds, bytes per microsecond.

Ports
-----
Every rank has an NVLink port out and in, a NIC port out and in, and a local-copy port (its HBM,
used by diagonal bytes that cross no link). Every rail (local GPU index) has a spine-up and a
spine-down port. Paths:

- same rank: ``hbm[r]`` at half the memory bandwidth (read + write);
- same node: ``nvlink_out[src] -> nvlink_in[dst]``;
- other node, same rail: ``nic_out[src] -> nic_in[dst]`` (the rail's leaf switch is non-blocking);
- other node, other rail: ``nic_out[src] -> spine_up[rail(src)] -> spine_down[rail(dst)] -> nic_in[dst]``;
  a spine port carries ``nodes * nic_bandwidth / oversubscription``.

With ``duplex = "half"`` on a link class, every pair of ranks {a, b} joined by that class also has
a *pair* port, appended to the path of both ``a -> b`` and ``b -> a``: the two directions of the
pair's connection share one capacity (the class's per-direction bandwidth, scaled by the slower
end's degradation), as a gloo TCP pair whose one thread alternately writes and reads. Pair ports
exist only when some class is half duplex (the GPU presets have none).

SM-limited copies: when a kernel's SM budget caps its copy rate (``sm_bytes_per_us`` finite, see
``moonep_sim.sim.kernels``), every rank also has an ``sm_send`` and an ``sm_recv`` port of that
capacity, and the flows of phases registered with ``sm=True`` cross the sender's ``sm_send`` and
the receiver's ``sm_recv`` (local copies included): the SMs driving a kernel limit what a GPU
moves, separately from its links. Flows of other phases (copy-engine weight copies) skip them.

With ``nic.attach = "node"`` a node's ranks share one network link (processes behind one
interface): every inter-node flow also crosses ``node<n>.nic_out`` of its source node and
``node<n>.nic_in`` of its destination node, each of ``G x nic bandwidth``, and each rank's own NIC
ports get that same capacity (one rank alone may use the whole link).

Each flow waits the path's latency (plus ``host_message_us`` per other rank its sender sends to in
that phase: a serial per-message cost, 0 on the GPU presets), then transmits; concurrent flows get
the max-min fair allocation (progressive filling: all unfrozen flows grow together until a port
saturates; flows through it freeze).

Solver
------
Every path is its sender's ports followed by its receiver's (``PortMap.side_ports``; a half-duplex
pair port is the one exception). So the allocation depends only on how many active flows each
(block, sender, receiver) cell holds, and a flow's rate is ``min(level of its sender node, level of
its receiver node)``. :class:`BlockCounts` keeps those counts (dense [R, R] per other-node block,
[R, G] for NVLink) updated as flows start and end, and fills by *runs*: the ports of one side, each
its own node's, in increasing share order, saturate one after another without changing each
other's shares, so a whole run freezes in one step and only the rows of nodes that freeze are
read. A fill costs O(steps x (nodes + ports log ports) + R x frozen nodes) instead of
O(iterations x active flows), and is exact (equal to per-flow water-filling with ``tol = 0``;
tested on random and adversarial patterns). Per active flow the network keeps (rate, remaining
bytes at t0, t0, finish time) and touches it only when its rate changes. With pair ports (the CPU
gloo presets, a few ranks) the per-flow :func:`waterfill` is used instead.

Events and coalescing
---------------------
Rates are recomputed only at *ticks*: when a flow finishes or becomes ready. Everything that
happens at one simulated instant is handled by one tick (all flows submitted together are batched
into one recomputation). With tolerance ``tol > 0`` ticks are additionally kept at least
``tol * max(now, drain horizon)`` apart: a flow that finishes between ticks is completed at the
next tick (its receiver learns of it late and it keeps its share of its ports meanwhile), and a flow that
becomes ready between ticks starts at the next tick. (The per-flow :func:`waterfill` also freezes
ports whose shares lie within ``tol`` of the bottleneck together; the block solver is exact.)
Every approximation only delays events, never moves one earlier, and the number of rate
recomputations drops from O(F) to O(log(t_end) / tol). The end is still not bounded below by the
exact model's (``tol = 0``): max-min sharing is not monotone (a transfer completed late keeps its
share of a port, the ones sharing that port run slower, so the ones competing with *them* run
faster), and no ``c x tol`` bound holds for every plan (a constructed case ends 1.6 x tol early,
one of its transfers 9.8 x tol; docs/simulator.md). Tested on random and adversarial families:
between (1 - tol) and (1 + 20 x tol) times the exact end (a chain of phases pays up to two gaps
per hop: measured up to 13 x tol late on small staggered two-phase cases, well under 1% at the
default 0.002 on MoE layers). Stale completion events are invalidated by a
version counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from moonep_sim.errors import require
from moonep_sim.sim.topology import Topology

L_PATH = 9
RUN_MAX = 256    # ports considered for one run of the block solver's filling
_DONE_REL = 1e-9


@dataclass(frozen=True)
class PortMap:
    """Port indices, capacities (bytes/us) and names for R ranks on a topology.

    cap_P: float64 [P+1]; the last port is the dummy (infinite capacity) that pads paths.
    """

    ranks: int
    gpus_per_node: int
    rails: int
    nodes: int
    cap_P: np.ndarray
    nominal_cap_P: np.ndarray
    lat_nvlink_us: float
    lat_nic_us: float
    lat_spine_us: float
    spine_binds: bool = True
    pairs: bool = False
    node_links: bool = False
    message_us: float = 0.0
    sm_ports: bool = False

    KINDS = ("nvlink_out", "nvlink_in", "nic_out", "nic_in", "hbm")

    @classmethod
    def build(cls, topo: Topology, ranks: int, nvlink_factor_R: np.ndarray | None = None,
              nic_factor_R: np.ndarray | None = None, sm_bytes_per_us: float = np.inf) -> "PortMap":
        """Ports of ``ranks`` GPUs on ``topo``; ``sm_bytes_per_us`` finite adds each rank's SM send
        and receive ports of that capacity (the Plan's kernel SM cap)."""
        R = ranks
        G = min(topo.gpus_per_node, R)
        nodes = topo.num_nodes(R)
        rails = G
        # a spine port carries at most its rail's NIC traffic; with no oversubscription (and no
        # NIC above nominal) it can never bind, so paths skip it (exact, and halves the path length)
        spine_binds = topo.fabric_oversubscription > 1 or (nic_factor_R is not None and np.max(nic_factor_R) > 1)
        nvf = np.ones(R) if nvlink_factor_R is None else np.asarray(nvlink_factor_R, float)
        nicf = np.ones(R) if nic_factor_R is None else np.asarray(nic_factor_R, float)
        nv, nic = topo.nvlink_bytes_per_us, topo.nic_bytes_per_us
        hbm = topo.mem_bytes_per_us / 2.0
        spine = nodes * nic / topo.fabric_oversubscription
        pairs = topo.nvlink_duplex == "half" or topo.nic_duplex == "half"
        node_links = topo.nic_attach == "node" and nodes > 1
        if topo.nic_attach == "node":  # one link per node; any of its ranks may use all of it
            nic = nic * G
        pair_nom = np.zeros(0)
        pair_cap = np.zeros(0)
        if pairs:  # port base + a * R + b (a < b) for the pair {a, b}; unused slots never bind
            a, b = np.divmod(np.arange(R * R), R)
            same_node = (a // G) == (b // G)
            half = np.where(same_node, topo.nvlink_duplex == "half", topo.nic_duplex == "half")
            pair_nom = np.where(half & (a < b), np.where(same_node, nv, nic), np.inf)
            fac = np.where(same_node, np.minimum(nvf[a], nvf[b]), np.minimum(nicf[a], nicf[b]))
            pair_cap = np.where(np.isfinite(pair_nom), pair_nom * fac, np.inf)
        node_nom = np.full(2 * nodes, nic) if node_links else np.zeros(0)
        node_cap = node_nom.copy()
        if node_links:  # a node link is as fast as its slowest rank's NIC factor
            nf = np.array([nicf[n * G:(n + 1) * G].min() for n in range(nodes)])
            node_cap = node_nom * np.concatenate([nf, nf])
        sm_ports = bool(np.isfinite(sm_bytes_per_us))
        sm_nom = np.full(2 * R, float(sm_bytes_per_us)) if sm_ports else np.zeros(0)
        nominal = np.concatenate([np.full(R, nv), np.full(R, nv), np.full(R, nic), np.full(R, nic), np.full(R, hbm),
                                  np.full(2 * rails, spine), pair_nom, node_nom, sm_nom, [np.inf]])
        cap = nominal.copy()
        cap[0:R] *= nvf
        cap[R:2 * R] *= nvf
        cap[2 * R:3 * R] *= nicf
        cap[3 * R:4 * R] *= nicf
        base = 5 * R + 2 * rails
        if pairs:
            cap[base:base + R * R] = pair_cap
        nb = base + (R * R if pairs else 0)
        if node_links:
            cap[nb:nb + 2 * nodes] = node_cap
        return cls(R, G, rails, nodes, cap, nominal, topo.nvlink_latency_us, topo.nic_latency_us,
                   topo.nic_latency_us + topo.fabric_latency_us, bool(spine_binds), bool(pairs), bool(node_links),
                   float(topo.host_message_us), sm_ports)

    @property
    def pair_base(self) -> int:
        return 5 * self.ranks + 2 * self.rails

    @property
    def node_base(self) -> int:
        return self.pair_base + (self.ranks * self.ranks if self.pairs else 0)

    @property
    def sm_base(self) -> int:
        """First SM port: ``sm_base + r`` is rank r's ``sm_send``, ``sm_base + R + r`` its ``sm_recv``."""
        return self.node_base + (2 * self.nodes if self.node_links else 0)

    @property
    def num_ports(self) -> int:
        return self.cap_P.size - 1

    @property
    def dummy(self) -> int:
        return self.cap_P.size - 1

    def name(self, p: int) -> str:
        R = self.ranks
        if p < 5 * R:
            return f"rank{p % R}.{self.KINDS[p // R]}"
        if self.sm_ports and p >= self.sm_base:
            q = p - self.sm_base
            return f"rank{q % R}.{'sm_send' if q < R else 'sm_recv'}"
        if p >= self.node_base:
            n = p - self.node_base
            return f"node{n % self.nodes}.nic_{'out' if n < self.nodes else 'in'}"
        if p >= self.pair_base:
            a, b = divmod(p - self.pair_base, R)
            return f"pair{a}-{b}"
        p -= 5 * R
        return f"rail{p % self.rails}.spine_{'up' if p < self.rails else 'down'}"

    def kind(self, p: int) -> str:
        R = self.ranks
        if self.sm_ports and p >= self.sm_base:
            return "sm_send" if p - self.sm_base < R else "sm_recv"
        if p >= self.node_base:
            return "node_nic_out" if p - self.node_base < self.nodes else "node_nic_in"
        if p >= self.pair_base:
            return "pair"
        return self.KINDS[p // R] if p < 5 * R else ("spine_up" if p - 5 * R < self.rails else "spine_down")

    def physical(self, p: int) -> bool:
        """Whether port p is a rank's, a spine's or a node link's (not a half-duplex pair's)."""
        return p < self.pair_base or p >= self.node_base

    def owner(self, p: int) -> int | None:
        """The rank whose own port p is (NVLink, NIC, HBM and SM ports), else None."""
        R = self.ranks
        if 0 <= p < 5 * R:
            return int(p % R)
        if self.sm_ports and self.sm_base <= p < self.sm_base + 2 * R:
            return int((p - self.sm_base) % R)
        return None

    # -- sender / receiver sides ----------------------------------------------------------
    # Every path is the sender's ports of its block followed by the receiver's ports of its block
    # (plus the pair port of a half-duplex link). Blocks: 0 same rank (HBM copy), 1 same node
    # (NVLink), 2 other node (NIC; same rail only when the spine can bind), 3 other node, other
    # rail (NIC and spine; only when the spine can bind); with SM ports, blocks 4-7 are the same
    # for flows of SM-driven phases, which also cross the sender's sm_send and the receiver's
    # sm_recv. A port added to the model must be listed here on the side of the rank it belongs
    # to: ``paths`` and the simulator's solver (:class:`BlockCounts`) both read these tables.
    BLOCKS = ("local", "nvlink", "nic", "nic_spine")

    @property
    def num_blocks(self) -> int:
        return 8 if self.sm_ports else 4

    def _over_nvlink(self, src_F: np.ndarray, dst_F: np.ndarray,
                     nic_F: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src_F, dst_F as int64 [F], same_node_F bool [F]): the transfer stays in its node, over
        NVLink (flows with ``nic_F`` True take the NIC path between ranks of one node too)."""
        src_F = np.asarray(src_F, dtype=np.int64)
        dst_F = np.asarray(dst_F, dtype=np.int64)
        G = self.gpus_per_node
        same_node = (src_F // G) == (dst_F // G)
        if nic_F is not None:
            same_node &= ~np.asarray(nic_F, dtype=bool)
        return src_F, dst_F, same_node

    def pair_class(self, src_F: np.ndarray, dst_F: np.ndarray, sm_F: np.ndarray | None = None,
                   nic_F: np.ndarray | None = None) -> np.ndarray:
        """int64 [F]: the block of each transfer ``src -> dst`` (``BLOCKS`` index, + 4 for flows of
        SM-driven phases when the map has SM ports; flows with ``nic_F`` True take the NIC path
        between ranks of one node too)."""
        src_F, dst_F, same_node = self._over_nvlink(src_F, dst_F, nic_F)
        G = self.gpus_per_node
        cls = np.where(src_F == dst_F, 0, np.where(same_node, 1, 2))
        if self.spine_binds:
            cls = np.where((cls == 2) & (src_F % G != dst_F % G), 3, cls)
        if self.sm_ports and sm_F is not None:
            cls = cls + 4 * np.asarray(sm_F, dtype=np.int64)
        return cls

    def side_ports(self) -> tuple[np.ndarray, np.ndarray]:
        """(src_BRK int64 [B, R, Ks], dst_BRK int64 [B, R, Kd]): per block b and rank r, the ports
        r's transfers of that block cross as sender (src) and as receiver (dst), padded with the
        dummy port. B = ``num_blocks``."""
        R, G = self.ranks, self.gpus_per_node
        r = np.arange(R)
        dm = self.dummy
        node, rail = r // G, r % G
        col = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
        src: list[list[np.ndarray]] = [[col(4 * R + r)], [col(r)], [col(2 * R + r)], [col(2 * R + r)]]
        dst: list[list[np.ndarray]] = [[], [col(R + r)], [col(3 * R + r)], [col(3 * R + r)]]
        if self.spine_binds:
            src[3].append(col(5 * R + rail))
            dst[3].insert(0, col(5 * R + self.rails + rail))
        if self.node_links:
            for b in (2, 3):
                src[b].append(col(self.node_base + node))
                dst[b].append(col(self.node_base + self.nodes + node))
        if self.sm_ports:
            src += [c + [col(self.sm_base + r)] for c in src]
            dst += [c + [col(self.sm_base + R + r)] for c in dst]
        B = len(src)
        ks = max(len(c) for c in src)
        kd = max(max(len(c) for c in dst), 1)
        src_BRK = np.full((B, R, ks), dm, dtype=np.int64)
        dst_BRK = np.full((B, R, kd), dm, dtype=np.int64)
        for b in range(B):
            for k, c in enumerate(src[b]):
                src_BRK[b, :, k] = c
            for k, c in enumerate(dst[b]):
                dst_BRK[b, :, k] = c
        return src_BRK, dst_BRK

    def latency(self, src_F: np.ndarray, dst_F: np.ndarray, nic_F: np.ndarray | None = None) -> np.ndarray:
        """float64 [F]: path latency (us) of transfers ``src -> dst``: none on the same rank, NVLink's
        in a node (unless ``nic_F``), the NIC's on one rail, NIC + fabric across rails."""
        src_F, dst_F, same_node = self._over_nvlink(src_F, dst_F, nic_F)
        G = self.gpus_per_node
        lat = np.where(src_F == dst_F, 0.0, np.where(same_node, self.lat_nvlink_us, self.lat_nic_us))
        return np.where(~same_node & (src_F % G != dst_F % G), self.lat_spine_us, lat)

    def paths(self, src_F: np.ndarray, dst_F: np.ndarray, sm_F: np.ndarray | None = None,
              nic_F: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(path_FL int64 [F, L_PATH], latency_F float64 [F]) of transfers ``src -> dst`` (vectorised).

        Columns: the sender's ports of the transfer's block, then the receiver's (``side_ports``;
        SM send / receive ports for flows with ``sm_F`` True when the map has them), then the pair
        port (half duplex) where it exists; padded with the dummy port. Flows with ``nic_F`` True
        take the NIC path between ranks of one node too (pure-RDMA kernels). Latency: ``latency``."""
        src_F = np.asarray(src_F, dtype=np.int64)
        dst_F = np.asarray(dst_F, dtype=np.int64)
        F = src_F.size
        src_BRK, dst_BRK = self.side_ports()
        cls = self.pair_class(src_F, dst_F, sm_F, nic_F)
        lat = self.latency(src_F, dst_F, nic_F)
        cols = [src_BRK[cls, src_F], dst_BRK[cls, dst_F]]
        if self.pairs:
            lo, hi = np.minimum(src_F, dst_F), np.maximum(src_F, dst_F)
            cols.append(np.where(src_F != dst_F, self.pair_base + lo * self.ranks + hi, self.dummy)[:, None])
        cat = np.concatenate(cols, axis=1)
        path = np.full((F, L_PATH), self.dummy, dtype=np.int64)
        path[:, :cat.shape[1]] = cat
        return path, lat

    def route(self, src_F: np.ndarray, dst_F: np.ndarray, sm_F: np.ndarray | None = None,
              nic_F: np.ndarray | None = None) -> np.ndarray:
        """path_FL including spine ports even where they cannot bind (for byte accounting)."""
        full = PortMap(**{**self.__dict__, "spine_binds": True})
        return full.paths(src_F, dst_F, sm_F, nic_F)[0]


def waterfill(path_FL: np.ndarray, cap_P: np.ndarray, tol: float = 0.0) -> tuple[np.ndarray, np.ndarray, int]:
    """Max-min fair rates of flows over ports (progressive filling, vectorised).

    path_FL: int64 [F, L] port indices; the last port of ``cap_P`` is a dummy of infinite capacity.
    cap_P: float64 [P+1] capacities (bytes/us).  tol: ports whose fair share lies within ``tol``
    (relative) of the current bottleneck freeze with it (0 = exact).
    Returns (rate_F, bottleneck_port_F, iterations). Every flow must cross a real port.
    """
    F = path_FL.shape[0]
    P1 = cap_P.size
    rate = np.zeros(F)
    bneck = np.full(F, -1, dtype=np.int64)
    if F == 0:
        return rate, bneck, 0
    cap = cap_P.astype(np.float64).copy()
    idx = np.arange(F)
    used = (path_FL != P1 - 1).any(axis=0)
    p = path_FL[:, : int(np.flatnonzero(used).max()) + 1] if used.any() else path_FL
    level = 0.0
    it = 0
    while idx.size:
        it += 1
        n = np.bincount(p.ravel(), minlength=P1).astype(np.float64)
        n[-1] = 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(n > 0, cap / n, np.inf)
        inc = float(share.min())
        if not np.isfinite(inc):  # pragma: no cover - every path has a real port
            raise RuntimeError("flows without a finite-capacity port")
        sat = share <= inc + tol * (level + inc) + 1e-12 * (level + inc)
        level += inc
        cap -= inc * n
        hit = sat[p]
        frozen = hit.any(axis=1)
        fi = idx[frozen]
        rate[fi] = level
        pf = p[frozen]
        # name the most contended saturated port of each flow (ties: first on the path)
        score = np.where(hit[frozen], n[pf], -1.0)
        bneck[fi] = pf[np.arange(fi.size), score.argmax(axis=1)]
        keep = ~frozen
        idx = idx[keep]
        p = p[keep]
    return rate, bneck, it


class BlockCounts:
    """Active transfers counted per (sender, receiver) pair, one dense matrix per block, and their
    exact max-min fair rates (the solver for port maps without half-duplex pair ports).

    Every path is the sender's ``side_ports`` of its block followed by the receiver's, so a
    transfer's rate is ``min(level of its sender node, level of its receiver node)``, where a
    *node* is (block, rank) on one side; a node freezes when the first of its ports saturates.

    Progressive filling, batched: the shares ``(cap - frozen load) / unfrozen count`` of the ports
    are sorted; a run of ports of one side, each belonging to its own node (no two of them share a
    transfer), saturate one after another at their own shares (freezing one can only raise the
    shares of ports it shares transfers with, never those of the others in the run), so the whole
    run freezes in one step; then shares are recomputed. Only the rows (columns) of the nodes that
    freeze are read. One fill costs O(steps x (nodes + ports log ports) + R x frozen nodes),
    against O(iterations x active flows) for :func:`waterfill`; the rates equal :func:`waterfill`
    's with ``tol = 0`` (tested).

    Storage per block: ``M`` [R, W] counts of active transfers by sender row and receiver column
    (W = R for other-node blocks; G for the NVLink block, column j meaning rank node*G + j; 1 for
    the local block) and its transpose ``MT`` [R, W] by receiver row.
    """

    def __init__(self, ports: PortMap):
        self.ports = ports
        R, G = ports.ranks, ports.gpus_per_node
        self.R, self.G = R, G
        src_BRK, dst_BRK = ports.side_ports()
        B = ports.num_blocks
        self.B = B
        self.blocks = [b for b in range(B) if b % 4 != 3 or ports.spine_binds]
        self.width = tuple((1, G, R, R)[b % 4] for b in range(B))
        # the blocks' M matrices are views of one flat buffer, so a cell of any block is one gather
        self.m_off = np.concatenate([[0], np.cumsum([R * w for w in self.width])]).astype(np.int64)
        self.m_flat = np.zeros(int(self.m_off[-1]))
        self.M = [self.m_flat[self.m_off[b]:self.m_off[b + 1]].reshape(R, w) for b, w in enumerate(self.width)]
        self.width_B = np.asarray(self.width, dtype=np.int64)
        self.mt_flat = np.zeros(int(self.m_off[-1]))
        self.MT = [self.mt_flat[self.m_off[b]:self.m_off[b + 1]].reshape(R, w) for b, w in enumerate(self.width)]
        self.cnt_src = np.zeros(B * R)   # active transfers per sender node (block-major)
        self.cnt_dst = np.zeros(B * R)
        r = np.arange(R)
        # rank of row r's column j (node blocks: r's node), clipped: columns past R hold 0 counts
        self.node_cols_RG = np.minimum((r // G)[:, None] * G + np.arange(G)[None, :], R - 1)
        self.self_cols_R1 = r[:, None]
        dm = ports.dummy
        P1 = ports.cap_P.size
        unused = np.ones(B, dtype=bool)
        unused[self.blocks] = False
        src_BRK = src_BRK.copy()
        dst_BRK = dst_BRK.copy()
        src_BRK[unused] = dm
        dst_BRK[unused] = dm
        self.ps = src_BRK.reshape(B * R, -1)   # ports of each sender node
        self.pd = dst_BRK.reshape(B * R, -1)
        k = max(self.ps.shape[1], self.pd.shape[1])
        pad = lambda pp: np.concatenate([pp, np.full((pp.shape[0], k - pp.shape[1]), dm)], axis=1)  # noqa: E731
        self.pall = np.concatenate([pad(self.ps), pad(self.pd)])   # ports of sender nodes, then receiver nodes
        # port -> nodes (sender nodes 0..BR-1, receiver nodes BR..2BR-1), CSR
        g = np.repeat(np.arange(self.pall.shape[0]), self.pall.shape[1])
        flat = self.pall.ravel()
        real = flat != dm
        o = np.argsort(flat[real], kind="stable")
        self.pn_nodes = g[real][o]
        self.pn_ptr = np.concatenate([[0], np.cumsum(np.bincount(flat[real], minlength=P1))])
        # simple: every node has one port and every port one node (no SM ports, spine or node links)
        per_port = np.diff(self.pn_ptr)
        self.simple = self.pall.shape[1] == 1 and int(per_port.max(initial=0)) <= 1
        self.port_one = np.full(P1, -1, dtype=np.int64)
        self.port_one[flat[real]] = g[real]
        # simple case: the nodes that have a port, in port order, and their ports
        self.block_starts = np.arange(B + 1) * R
        self.pps = np.flatnonzero(self.port_one >= 0)
        self.nps = self.port_one[self.pps]

    def cells(self, blk_F, src_F, dst_F):
        """Columns of transfers in M (sender row) and in MT (receiver row)."""
        G = self.G
        c = blk_F % 4
        j = np.where(c >= 2, dst_F, np.where(c == 1, dst_F % G, 0))
        i = np.where(c >= 2, src_F, np.where(c == 1, src_F % G, 0))
        return j, i

    def add(self, blk_F, src_F, dst_F, sign: float) -> None:
        """Count transfers in (sign = 1) or out (sign = -1)."""
        if blk_F.size == 0:
            return
        j, i = self.cells(blk_F, src_F, dst_F)
        R = self.R
        # every block's matrix is a view of one flat buffer: one scatter per side (counts are
        # whole numbers, so the order of the additions does not matter)
        off, w = self.m_off[blk_F], self.width_B[blk_F]
        np.add.at(self.m_flat, off + src_F * w + j, sign)
        np.add.at(self.mt_flat, off + dst_F * w + i, sign)
        n = self.B * R
        self.cnt_src += sign * np.bincount(blk_F * R + src_F, minlength=n)
        self.cnt_dst += sign * np.bincount(blk_F * R + dst_F, minlength=n)

    def _cols(self, b: int, rows: np.ndarray) -> np.ndarray | None:
        """Rank index of each column of rows ``rows`` of block b (None: the identity, all ranks)."""
        if b % 4 == 0:
            return self.self_cols_R1[rows]
        if b % 4 == 1:
            return self.node_cols_RG[rows]
        return None

    def fill(self, cap_P: np.ndarray):
        """Exact max-min fair levels of the counted transfers (batched progressive filling).

        Returns (level_src [BR], level_dst [BR], port_src [BR], port_dst [BR], steps): per node
        (block-major) the level (bytes/us) at which it froze (inf if it carried nothing unfrozen)
        and the saturated port that froze it (-1 if none)."""
        R = self.R
        N = self.B * R
        P1 = cap_P.size
        dm = self.ports.dummy
        cap = np.asarray(cap_P, dtype=np.float64)
        cnt = np.concatenate([self.cnt_src, self.cnt_dst])   # unfrozen transfers per node
        frz = np.zeros(2 * N)                                # frozen load (bytes/us) per node
        lev = np.full(2 * N, np.inf)
        bport = np.full(2 * N, -1, dtype=np.int64)
        free = np.ones(2 * N, dtype=bool)
        if self.simple:
            steps = self._fill_simple(cap, cnt, frz, lev, bport, free)
            return lev[:N], lev[N:], bport[:N], bport[N:], steps
        pall, K = self.pall, self.pall.shape[1]
        pflat = pall.ravel()
        hit = np.full(P1, -1, dtype=np.int64)
        steps = 0
        while cnt.any():
            steps += 1
            w = cnt if K == 1 else np.repeat(cnt, K)
            n = np.bincount(pflat, weights=w, minlength=P1)
            fr = np.bincount(pflat, weights=frz if K == 1 else np.repeat(frz, K), minlength=P1)
            n[dm] = 0.0
            cand = np.flatnonzero(n)
            share = (cap[cand] - fr[cand]) / n[cand]
            order = np.argsort(share, kind="stable")
            cand, share = cand[order], share[order]
            # the run: a prefix of ports whose nodes are all distinct with no active cell between
            # two of them (then no port of the run shares a transfer with an earlier one)
            for width in (8, 64, RUN_MAX):  # short runs are the common case: try small prefixes first
                cut = self._run_cut(cand[:width])
                if cut < width or width >= cand.size:
                    break
            run, lv = cand[:cut], share[:cut]
            # the run's nodes (a node's first saturating port freezes it), side by side
            hit[run] = np.arange(cut)
            if K == 1:
                k_N = hit[pall[:, 0]]
                k_N[k_N < 0] = cut
            else:
                k_NK = hit[pall]
                k_N = np.where(k_NK >= 0, k_NK, cut).min(axis=1)
            hit[run] = -1
            hit[dm] = -1
            frozen_any = False
            for s0 in (0, 1):
                lo, hi = s0 * N, (s0 + 1) * N
                nodes = np.flatnonzero((k_N[lo:hi] < cut) & (cnt[lo:hi] > 0))
                if nodes.size:
                    frozen_any = True
                    self._freeze(nodes, k_N[lo:hi][nodes], s0, run, lv, lev, bport, free, frz, cnt)
            if not frozen_any:  # pragma: no cover - the run's ports carry unfrozen transfers
                raise RuntimeError("progressive filling made no progress")
        return lev[:N], lev[N:], bport[:N], bport[N:], steps

    def _fill_simple(self, cap, cnt, frz, lev, bport, free) -> int:
        """:meth:`fill` when every node has one port and every port one node (``simple``): the
        same steps and arithmetic, in node space (a port's count and frozen load are its node's;
        ties in share order still go to the lower port). Returns the steps."""
        N = self.B * self.R
        nps, pps = self.nps, self.pps
        cap_n = cap[pps]
        steps = 0
        while cnt.any():
            steps += 1
            live = cnt[nps] != 0
            cn = nps[live]
            share = (cap_n[live] - frz[cn]) / cnt[cn]
            order = np.argsort(share, kind="stable")
            cn, share = cn[order], share[order]
            cut = self._switch_cut(cn[:RUN_MAX])
            if cut is None:
                cand = pps[live][order]
                for width in (8, 64, RUN_MAX):  # short runs are the common case: try small prefixes first
                    cut = self._run_cut(cand[:width])
                    if cut < width or width >= cand.size:
                        break
            rn, lv = cn[:cut], share[:cut]
            run = pps[live][order[:cut]]
            s_first = bool(rn[0] < N)
            if bool(rn[-1] < N) == s_first and ((rn < N) == s_first).all():
                # one side (the usual run): its nodes all carry unfrozen transfers (they are live
                # and nothing froze yet in this step)
                s0 = 0 if s_first else 1
                kn = np.argsort(rn)              # nodes in increasing order, as :meth:`fill` visits them
                self._freeze(rn[kn] - s0 * N, kn, s0, run, lv, lev, bport, free, frz, cnt)
                continue
            frozen_any = False
            for s0 in (0, 1):
                lo = s0 * N
                side = (rn >= lo) & (rn < lo + N)
                if not side.any():
                    continue
                nodes, kn = rn[side] - lo, np.flatnonzero(side)
                o = np.argsort(nodes)            # nodes in increasing order, as :meth:`fill` visits them
                nodes, kn = nodes[o], kn[o]
                keep = cnt[lo + nodes] > 0
                if not keep.all():
                    nodes, kn = nodes[keep], kn[keep]
                if nodes.size:
                    frozen_any = True
                    self._freeze(nodes, kn, s0, run, lv, lev, bport, free, frz, cnt)
            if not frozen_any:  # pragma: no cover - the run's ports carry unfrozen transfers
                raise RuntimeError("progressive filling made no progress")
        return steps

    def _switch_cut(self, node: np.ndarray) -> int | None:
        """The run's length in the simple case (one node per port; ``node``: the ports' nodes in
        share order) when it ends where the ports first switch side: all of one side (no two of
        them can share a transfer), or the first port of the other side has an active cell with a
        port before it. None when that port has none (then :meth:`_run_cut` decides). Same answer
        as :meth:`_run_cut`, which cuts at the first port sharing a transfer with an earlier one,
        in a few array operations."""
        N, R, G = self.B * self.R, self.R, self.G
        is_s = node < N
        sw = np.flatnonzero(is_s != is_s[0])
        if sw.size == 0:
            return node.size
        q = int(sw[0])
        x = int(node[q])
        if is_s[0]:   # senders before q, a receiver at q
            b, d = divmod(x - N, R)
            bb, s_ = np.divmod(node[:q], R)
        else:
            b, s = divmod(x, R)
            bb, d_ = np.divmod(node[:q] - N, R)
        ys = np.flatnonzero(bb == b)
        if ys.size == 0:
            return None
        kind, w, off = b % 4, int(self.width_B[b]), int(self.m_off[b])
        if is_s[0]:
            s_ = s_[ys]
            col = d if kind >= 2 else (d % G if kind == 1 else 0)
            c = self.m_flat[off + s_ * w + col]
            valid = True if kind >= 2 else ((s_ // G == d // G) if kind == 1 else (s_ == d))
        else:
            d_ = d_[ys]
            col = d_ if kind >= 2 else (d_ % G if kind == 1 else 0)
            c = self.m_flat[off + s * w + col]
            valid = True if kind >= 2 else ((s // G == d_ // G) if kind == 1 else (s == d_))
        return q if bool(np.any(valid & (c > 0))) else None

    def _run_cut(self, cand: np.ndarray) -> int:
        """Length of the run: the longest prefix of ports ``cand`` (in share order) in which no
        node belongs to two ports and no node has an active cell with a node of an earlier port
        on the other side (at least 1)."""
        R, N, G = self.R, self.B * self.R, self.G
        cut = cand.size
        if self.simple:  # one node per port, one port per node: no node can repeat
            node, pos = self.port_one[cand], np.arange(cand.size)
        else:
            ptr, pn = self.pn_ptr, self.pn_nodes
            lens = ptr[cand + 1] - ptr[cand]
            tot = int(lens.sum())
            start = np.repeat(ptr[cand] - np.cumsum(lens) + lens, lens)
            node = pn[start + np.arange(tot)]
            pos = np.repeat(np.arange(cand.size), lens)
            # a node of two ports: cut at the later one
            o = np.argsort(node, kind="stable")
            sn, sp = node[o], pos[o]
            dup = np.flatnonzero(sn[1:] == sn[:-1])
            if dup.size:
                cut = int(sp[dup + 1].min())
            keep = pos < cut
            node, pos = node[keep], pos[keep]
        is_s = node < N
        if not is_s.any() or is_s.all():
            return max(cut, 1)
        bs, rs = np.divmod(node[is_s], R)
        bd, rd = np.divmod(node[~is_s] - N, R)
        ii, jj = np.nonzero(bs[:, None] == bd[None, :])   # sender/receiver node pairs of one block
        if ii.size:
            b, s_, d_ = bs[ii], rs[ii], rd[jj]
            kind = b % 4
            col = np.where(kind >= 2, d_, np.where(kind == 1, d_ % G, 0))
            valid = (kind >= 2) | ((kind == 1) & (s_ // G == d_ // G)) | ((kind == 0) & (s_ == d_))
            c = self.m_flat[self.m_off[b] + s_ * self.width_B[b] + col]
            hit = np.flatnonzero(valid & (c > 0))
            if hit.size:
                cut = min(cut, int(np.maximum(pos[is_s][ii[hit]], pos[~is_s][jj[hit]]).min()))
        return max(cut, 1)

    def _freeze(self, nodes, kn, s0, run, lv, lev, bport, free, frz, cnt) -> None:
        """Freeze side-``s0`` nodes at the levels of their run ports; their cells leave the other
        side's free nodes (counts, and load at the cells' level)."""
        R, N = self.R, self.B * self.R
        lo = s0 * N
        lvn = lv[kn]
        g = lo + nodes
        lev[g] = lvn
        bport[g] = run[kn]
        free[g] = False
        frz[g] += lvn * cnt[g]
        cnt[g] = 0.0
        # their cells leave the other side's free nodes: counts, and load at the cells' level
        mats = self.M if s0 == 0 else self.MT
        olo = N - lo
        rows = nodes % R
        bounds = np.searchsorted(nodes, self.block_starts).tolist()   # nodes are sorted: a block is a slice
        for b in self.blocks:
            i0, i1 = bounds[b], bounds[b + 1]
            if i0 == i1:
                continue
            rb = rows[i0:i1]
            lb = lvn[i0:i1]
            base = olo + b * R
            of = free[base:base + R]
            if b % 4 == 0:   # a local block: each node's one cell is its own rank's
                z = mats[b][rb, 0] * of[rb]
                cnt[base + rb] -= z
                frz[base + rb] += lb * z
                continue
            cols = self._cols(b, rb)
            Mrb = mats[b][rb]
            if cols is None:
                both = np.stack([np.ones(rb.size), lb]) @ Mrb
                cnt[base:base + R] -= both[0] * of
                frz[base:base + R] += both[1] * of
            else:
                Z = Mrb * of[cols]
                cnt[base:base + R] -= np.bincount(cols.ravel(), weights=Z.ravel(), minlength=R)
                frz[base:base + R] += np.bincount(cols.ravel(), weights=(lb[:, None] * Z).ravel(), minlength=R)

    def rates(self, filled, blk_F, src_F, dst_F) -> tuple[np.ndarray, np.ndarray]:
        """(rate_F, bottleneck_port_F) of transfers from a :meth:`fill` result."""
        lev_s, lev_d, bp_s, bp_d, _ = filled
        a = blk_F * self.R + src_F
        c = blk_F * self.R + dst_F
        ls, ld = lev_s[a], lev_d[c]
        use_src = ls <= ld
        return np.where(use_src, ls, ld), np.where(use_src, bp_s[a], bp_d[c])


class _Buffer:
    """Growable columns of active flows: slots [0, n) are in use; dead slots are dropped in bulk."""

    def __init__(self, cols: dict[str, tuple]):
        self.cols = cols
        self.n = 0
        self.data = {k: np.zeros((16,) + shape, dtype=dt) for k, (dt, shape) in cols.items()}

    def __getattr__(self, k):
        d = self.__dict__.get("data")
        if d is None or k not in d:
            raise AttributeError(k)
        return d[k][:self.n]

    def append(self, **vals) -> None:
        m = next(iter(vals.values())).shape[0]
        need = self.n + m
        cap = next(iter(self.data.values())).shape[0]
        if need > cap:
            new = max(need, 2 * cap)
            for k, arr in self.data.items():
                grown = np.zeros((new,) + arr.shape[1:], dtype=arr.dtype)
                grown[:self.n] = arr[:self.n]
                self.data[k] = grown
        for k, v in vals.items():
            self.data[k][self.n:need] = v
        self.n = need

    def keep(self, mask: np.ndarray) -> None:
        m = int(mask.sum())
        for k, arr in self.data.items():
            arr[:m] = arr[:self.n][mask]
        self.n = m


class FlowNetwork:
    """Transfers of a simulation, on a simpy Environment (see the module docstring).

    Usage: ``expect(phase, count_R)`` once per phase instance (how many flows each rank will
    receive), then ranks call ``submit(phase, src, dst_F, bytes_F, eff_bytes_F)`` when they send,
    and wait on ``received(phase, dst)``. Records one row per finished flow for reports.

    Solver: :class:`BlockCounts` (exact max-min fair levels from per-pair counts) unless the port
    map has half-duplex pair ports, then :func:`waterfill` over per-flow paths (``solver``: "auto",
    "blocks" or "paths"). Per active flow the state is (rate, remaining bytes at t0, t0, finish
    time); a tick touches a flow's state only when its rate changed.
    """

    def __init__(self, env: simpy.Environment, ports: PortMap, tol: float = 0.0, record_util: bool = False,
                 solver: str = "auto"):
        require(solver in ("auto", "blocks", "paths"), f"solver ({solver!r}) must be 'auto', 'blocks' or 'paths'")
        require(not (solver == "blocks" and ports.pairs),
                "solver ('blocks') must not be used with half-duplex pair ports: their paths are not per-side")
        self.env = env
        self.ports = ports
        self.tol = float(tol)
        self.record_util = record_util
        self._left = np.zeros(0, dtype=np.int64)   # flows still to arrive per (phase, receiver): pid * R + dst
        self._group_events: list[list[simpy.Event]] = []
        self._phase_names: list[str] = []
        self._phase_tags: list[Any] = []  # per phase id: the caller's tag (the timeline's PhaseTag)
        self._phase_sm: list[bool] = []   # per phase id: its flows cross the SM send / receive ports
        self._phase_nic: list[bool] = []  # per phase id: same-node flows take the NIC path
        use_blocks = solver == "blocks" or (solver == "auto" and not ports.pairs)
        self._blocks = BlockCounts(ports) if use_blocks else None
        cols = dict(rate=(np.float64, ()), rem0=(np.float64, ()), t0=(np.float64, ()), fin=(np.float64, ()),
                    id=(np.int64, ()), key=(np.int64, ()), src=(np.int64, ()), dst=(np.int64, ()),
                    blk=(np.int64, ()), alive=(np.bool_, ()),
                    ns=(np.int64, ()), nd=(np.int64, ()))   # sender / receiver node (block * R + rank)
        if not use_blocks:
            cols["path"] = (np.int64, (L_PATH,))
        self._a = _Buffer(cols)
        self._dead = 0
        self._sentinel = ports.num_blocks * ports.ranks   # node index of finished flows (level 0)
        self._filled = None
        # pending (submitted, waiting for latency): lists of arrays
        self._pend: list[tuple[np.ndarray, ...]] = []  # (ready, path, eff, id, key, src, dst, blk)
        # per-flow records (by id)
        self._rec_src: list[np.ndarray] = []
        self._rec_dst: list[np.ndarray] = []
        self._rec_phase: list[np.ndarray] = []
        self._rec_bytes: list[np.ndarray] = []
        self._rec_start: list[np.ndarray] = []
        self._n_flows = 0
        self._end = np.zeros(0)
        self._bneck = np.zeros(0, dtype=np.int64)
        self._ready = np.zeros(0)
        self._last_fill = -np.inf
        self._horizon = 0.0  # when the active traffic would drain at the current rates (time scale)
        self._version = 0
        self._next_tick = np.inf
        self.ticks = 0
        self.fill_iterations = 0
        self.util_samples: list[tuple[float, np.ndarray]] = []

    # -- phases and receive groups ---------------------------------------------------------
    def expect(self, name: str, count_R: np.ndarray, tag: Any = None, sm: bool = False, nic_only: bool = False) -> int:
        """Register a phase instance; ``count_R[d]`` flows will arrive at rank d. Returns its id.

        tag: carried with the phase (and so with every flow of it) for the caller's analyses.
        sm: its flows cross the SM send / receive ports (when the port map has them).
        nic_only: its flows between ranks of one node take the NIC path, not NVLink."""
        pid = len(self._phase_names)
        self._phase_names.append(name)
        self._phase_tags.append(tag)
        self._phase_sm.append(bool(sm))
        self._phase_nic.append(bool(nic_only))
        left = np.asarray(count_R, dtype=np.int64).ravel().copy()
        require(left.size == self.ports.ranks, f"count_R size ({left.size}) must equal the ranks ({self.ports.ranks})")
        evs = [self.env.event() for _ in range(left.size)]
        for d in np.flatnonzero(left == 0):
            evs[d].succeed()
        self._left = np.concatenate([self._left, left])
        self._group_events.append(evs)
        return pid

    def received(self, pid: int, dst: int) -> simpy.Event:
        """Event that fires when rank ``dst`` has received every flow of phase ``pid``."""
        return self._group_events[pid][dst]

    def phase_name(self, pid: int) -> str:
        return self._phase_names[pid]

    def phase_tag(self, pid: int) -> Any:
        """The ``tag`` phase ``pid`` was registered with."""
        return self._phase_tags[pid]

    @property
    def num_phases(self) -> int:
        return len(self._phase_names)

    # -- sending -------------------------------------------------------------------------
    def submit(self, pid: int, src: int, dst_F: np.ndarray, bytes_F: np.ndarray, eff_bytes_F: np.ndarray) -> None:
        """Rank ``src`` starts sending ``bytes_F`` to ``dst_F`` now (entries with 0 bytes are skipped).

        eff_bytes_F: the bytes the flow is timed for (bytes x jitter factor).
        """
        keep = bytes_F > 0
        dst = np.asarray(dst_F, dtype=np.int64)[keep]
        if dst.size == 0:
            return
        src_F = np.full(dst.size, src, dtype=np.int64)
        sm_F = np.full(dst.size, self._phase_sm[pid]) if self.ports.sm_ports else None
        nic_F = np.full(dst.size, True) if self._phase_nic[pid] else None
        blk = self.ports.pair_class(src_F, dst, sm_F, nic_F)
        lat = self.ports.latency(src_F, dst, nic_F)
        path = np.zeros((dst.size, 0), dtype=np.int64) if self._blocks is not None else \
            self.ports.paths(src_F, dst, sm_F, nic_F)[0]
        if self.ports.message_us > 0:  # the sender's serial per-message cost (host_message_us)
            remote = dst != src
            lat = lat + np.where(remote, self.ports.message_us * float(remote.sum()), 0.0)
        now = self.env.now
        ids = np.arange(self._n_flows, self._n_flows + dst.size)
        self._n_flows += dst.size
        self._rec_src.append(src_F)
        self._rec_dst.append(dst)
        self._rec_phase.append(np.full(dst.size, pid, dtype=np.int64))
        self._rec_bytes.append(np.asarray(bytes_F, dtype=np.float64)[keep])
        self._rec_start.append(np.full(dst.size, float(now)))
        ready = now + lat
        self._pend.append((ready, path, np.asarray(eff_bytes_F, dtype=np.float64)[keep], ids,
                           pid * self.ports.ranks + dst, src_F, dst, blk))
        self._request_tick(float(ready.min()))

    def _grow(self) -> None:
        n = self._n_flows
        if self._end.size < n:
            extra = max(n - self._end.size, self._end.size)
            self._end = np.concatenate([self._end, np.full(extra, np.nan)])
            self._bneck = np.concatenate([self._bneck, np.full(extra, -1, dtype=np.int64)])
            self._ready = np.concatenate([self._ready, np.full(extra, np.nan)])

    # -- the tick machinery --------------------------------------------------------------
    def _gap(self, t: float) -> float:
        return self.tol * max(t, self._horizon)

    def _request_tick(self, t: float) -> None:
        if np.isfinite(self._last_fill):
            t = max(t, self._last_fill + self._gap(self._last_fill))
        t = max(t, self.env.now)
        if t < self._next_tick:
            self._next_tick = t
            self._version += 1
            v = self._version
            ev = self.env.timeout(t - self.env.now)
            ev.callbacks.append(lambda _e, v=v: self._tick(v))

    def _bottlenecks(self, sel: np.ndarray) -> np.ndarray:
        """Bottleneck port of active flows ``sel`` under the last fill."""
        a = self._a
        if self._blocks is None:
            return self._filled[sel]
        lev_s, lev_d, bp_s, bp_d, _ = self._filled
        i = a.ns[sel]
        j = a.nd[sel]
        return np.where(lev_s[i] <= lev_d[j], bp_s[i], bp_d[j])

    def _tick(self, version: int) -> None:
        if version != self._version:
            return  # stale: superseded by a later rate change
        self._next_tick = np.inf
        t = float(self.env.now)
        self.ticks += 1
        self._grow()
        a = self._a
        # 1. completions (a flow's finish time is exact at its current rate)
        if a.n:
            sel = np.flatnonzero(a.fin <= t + 2e-9 * max(t, 1.0))
            if sel.size:
                self._complete(a.id[sel], self._bottlenecks(sel), a.key[sel], t)
                if self._blocks is not None:
                    self._blocks.add(a.blk[sel], a.src[sel], a.dst[sel], -1.0)
                a.alive[sel] = False
                a.fin[sel] = np.inf
                a.rem0[sel] = np.inf
                a.rate[sel] = 0.0          # dead: rate 0 at the sentinel node (level 0), never changes
                a.ns[sel] = self._sentinel
                a.nd[sel] = self._sentinel
                self._dead += sel.size
                if 2 * self._dead > a.n:
                    a.keep(a.alive.copy())
                    self._dead = 0
        # 2. activations
        if self._pend:
            still = []
            add: list[tuple[np.ndarray, ...]] = []
            for item in self._pend:
                ok = item[0] <= t + 1e-9
                if ok.all():
                    add.append(item)
                elif ok.any():
                    add.append(tuple(x[ok] for x in item))
                    still.append(tuple(x[~ok] for x in item))
                else:
                    still.append(item)
            self._pend = still
            if add:
                cat = lambda k: np.concatenate([x[k] for x in add])  # noqa: E731
                ids = cat(3)
                self._ready[ids] = t
                m = ids.size
                src_F, dst_F, blk_F = cat(5), cat(6), cat(7)
                extra = {} if self._blocks is not None else dict(path=cat(1))
                a.append(rate=np.zeros(m), rem0=cat(2), t0=np.full(m, t), fin=np.full(m, np.inf), id=ids,
                         key=cat(4), src=src_F, dst=dst_F, blk=blk_F, alive=np.ones(m, dtype=bool),
                         ns=blk_F * self.ports.ranks + src_F, nd=blk_F * self.ports.ranks + dst_F, **extra)
                if self._blocks is not None:
                    self._blocks.add(blk_F, src_F, dst_F, 1.0)
        # 3. rates: exact max-min levels, then only flows whose rate changed are touched
        if self._blocks is not None:
            self._filled = self._blocks.fill(self.ports.cap_P)
            lev_s, lev_d = self._filled[0], self._filled[1]
            rate = np.minimum(np.take(np.append(lev_s, 0.0), a.ns), np.take(np.append(lev_d, 0.0), a.nd))
            it = self._filled[-1]
        else:
            live = np.flatnonzero(a.alive)
            r_live, b_live, it = waterfill(a.path[live], self.ports.cap_P, self.tol)
            rate = np.zeros(a.n)
            rate[live] = r_live
            bneck = np.full(a.n, -1, dtype=np.int64)
            bneck[live] = b_live
            self._filled = bneck
        self.fill_iterations += it
        self._last_fill = t
        ch = np.flatnonzero(rate != a.rate)   # dead flows keep rate 0
        if ch.size:
            rem = a.rem0[ch] - a.rate[ch] * (t - a.t0[ch])
            a.rem0[ch] = rem
            a.t0[ch] = t
            r_ch = rate[ch]
            a.rate[ch] = r_ch
            fin = t + rem / r_ch
            a.fin[ch] = fin
            fin_max = float(fin.max())
            if np.isfinite(fin_max):
                self._horizon = max(self._horizon, fin_max)
            else:
                fin_live = fin[np.isfinite(fin)]
                if fin_live.size:
                    self._horizon = max(self._horizon, float(fin_live.max()))
        if self.record_util:
            live = np.flatnonzero(a.alive)
            if self._blocks is None:
                path = a.path[live]
            else:
                bc, R = self._blocks, self.ports.ranks
                path = np.concatenate([bc.ps[a.blk[live] * R + a.src[live]], bc.pd[a.blk[live] * R + a.dst[live]]], axis=1)
            use = np.bincount(path.ravel(), weights=np.repeat(a.rate[live], path.shape[1]),
                              minlength=self.ports.cap_P.size)[:-1]
            self.util_samples.append((t, use / self.ports.cap_P[:-1]))
        # 4. next tick
        nxt = float(a.fin.min()) if a.n else np.inf
        if self._pend:
            nxt = min(nxt, min(float(item[0].min()) for item in self._pend))
        if np.isfinite(nxt):
            self._request_tick(nxt)

    def active_rates(self) -> np.ndarray:
        """float64 [active flows]: the current rate (bytes/us) of every transferring flow."""
        return self._a.rate[self._a.alive].copy()

    def _complete(self, ids: np.ndarray, bneck: np.ndarray, key: np.ndarray, t: float) -> None:
        self._end[ids] = t
        self._bneck[ids] = bneck
        uk, cnt = np.unique(key, return_counts=True)
        R = self.ports.ranks
        left = self._left
        left[uk] -= cnt
        for k in uk[left[uk] == 0].tolist():   # receive groups complete in key order
            p, d = divmod(k, R)
            self._group_events[p][d].succeed()

    # -- results ---------------------------------------------------------------------------
    def records(self) -> dict[str, np.ndarray]:
        """Per finished flow: src, dst, phase id, bytes, start (submit), ready, end, bottleneck port."""
        n = self._n_flows
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
        return dict(src=cat(self._rec_src, np.int64), dst=cat(self._rec_dst, np.int64),
                    phase=cat(self._rec_phase, np.int64), bytes=cat(self._rec_bytes, np.float64),
                    start=cat(self._rec_start, np.float64), ready=self._ready[:n].copy(),
                    end=self._end[:n].copy(), bneck=self._bneck[:n].copy())

    def port_bytes(self, rec: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """float64 [P]: bytes that crossed each port (``rec``: :meth:`records`, if already read).

        Whole-byte flows (the usual case) are summed per sender and receiver side first, then
        spread over the sides' ports (``PortMap.side_ports``): sums of whole numbers below 2^53
        are exact in any order, so this equals the per-flow sum over every flow's route."""
        rec = self.records() if rec is None else rec
        if rec["src"].size == 0:
            return np.zeros(self.ports.num_ports)
        b, src, dst = rec["bytes"], rec["src"], rec["dst"]
        sm, nic = self.flow_sm(rec), self.flow_nic(rec)
        P1 = self.ports.cap_P.size
        if not (np.all(b == np.floor(b)) and float(b.sum()) < 2.0 ** 53):
            path = self.ports.route(src, dst, sm, nic)
            return np.bincount(path.ravel(), weights=np.repeat(b, L_PATH), minlength=P1)[:-1]
        full = PortMap(**{**self.ports.__dict__, "spine_binds": True})   # as route(): spine ports counted
        R = self.ports.ranks
        blk = full.pair_class(src, dst, sm, nic)
        out = np.zeros(P1)
        for side_BRK, rank_F in zip(full.side_ports(), (src, dst)):
            B, _, k = side_BRK.shape
            node_b = np.bincount(blk * R + rank_F, weights=b, minlength=B * R)
            out += np.bincount(side_BRK.reshape(B * R, k).ravel(), weights=np.repeat(node_b, k), minlength=P1)
        if self.ports.pairs:   # the pair port of a half-duplex link, as in paths()
            remote = src != dst
            lo, hi = np.minimum(src, dst)[remote], np.maximum(src, dst)[remote]
            out += np.bincount(self.ports.pair_base + lo * R + hi, weights=b[remote], minlength=P1)
        return out[:-1]

    def flow_sm(self, rec: dict[str, np.ndarray]) -> np.ndarray | None:
        """bool [F]: which recorded flows crossed SM ports (None when the port map has none)."""
        if not self.ports.sm_ports:
            return None
        return np.asarray(self._phase_sm, dtype=bool)[rec["phase"]] if rec["phase"].size else np.zeros(0, bool)

    def flow_nic(self, rec: dict[str, np.ndarray]) -> np.ndarray | None:
        """bool [F]: which recorded flows took the NIC path inside a node (None when no phase did)."""
        if not any(self._phase_nic):
            return None
        return np.asarray(self._phase_nic, dtype=bool)[rec["phase"]] if rec["phase"].size else np.zeros(0, bool)

    @property
    def idle(self) -> bool:
        return not self._a.alive.any() and not self._pend


__all__ = ["FlowNetwork", "PortMap", "waterfill"]
