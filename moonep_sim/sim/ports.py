"""The network's ports and paths: :class:`PortMap` (indices, capacities, names) and the blocks
(:class:`Block`) a transfer's path belongs to.

Notation: R ranks, G GPUs per node, F transfers, P ports, L = ``L_PATH`` ports per path at most
(shorter paths are padded with a dummy port of infinite capacity). Units: bytes, microseconds,
bytes per microsecond. The flow model that shares these ports: ``moonep_sim.sim.network``.

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
ports get that same capacity (one rank alone may use the whole link). Fewer NICs than GPUs
(``nic.rails_per_node`` a divisor of G) is the same structure for groups of ``G / rails`` ranks
(``link_group``): ``nic<n>.shared_out`` / ``shared_in``, each one NIC's bandwidth.

A full-mesh scale-up (``nvlink.peer_GBps`` > 0, AMD Infinity Fabric) gives every ordered pair of
ranks in a node its own link, ``mesh<a>-<b>``, appended to the path of ``a -> b`` (peer bandwidth
x NVLink efficiency, scaled by the slower end's degradation); such maps are solved per flow
(``moonep_sim.sim.waterfill``), as the half-duplex pair ports are.

"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from moonep_sim.plan.placement import ClusterShape
from moonep_sim.sim.topology import Topology

L_PATH = 9
BUILD_CACHE_SIZE = 8   # port maps kept by ``PortMap.build`` (most recent first)
_BUILT: list[tuple[Topology, tuple, "PortMap"]] = []
_BUILT_LOCK = threading.Lock()


class Block(IntEnum):
    """Which ports a transfer crosses, by where its receiver is (``PortMap.pair_class``).

    LOCAL: the same rank (its HBM copy port); NVLINK: the same node; NIC: another node (on the
    same rail only when the spine can bind); NIC_SPINE: another node, another rail, when the spine
    can bind (NIC and spine ports). With SM ports a transfer of an SM-driven phase is in block
    ``kind + SM_BLOCK`` (:func:`block_kind` recovers the kind): the same ports plus the sender's
    ``sm_send`` and the receiver's ``sm_recv``."""

    LOCAL = 0
    NVLINK = 1
    NIC = 2
    NIC_SPINE = 3


SM_BLOCK = len(Block)   # offset of the SM-driven copy of each block


class RankPort(IntEnum):
    """A rank's own link ports: rank r's port of kind k is index ``k * R + r`` (the first 5 R
    ports of a :class:`PortMap`)."""

    NVLINK_OUT = 0
    NVLINK_IN = 1
    NIC_OUT = 2
    NIC_IN = 3
    HBM = 4


def nic_group_of(cluster: ClusterShape, group: int, rank):
    """The shared network link of ``rank`` (int or integer array) when ``group`` ranks of a node
    share one (a divisor of G; G: the node's link, ``nic.attach = "node"``): its node's links in
    order, ``node x (G / group) + local index // group``."""
    G = cluster.gpus_per_node
    return cluster.node_of(rank) * (G // group) + cluster.local_index(rank) // group


def block_kind(blk):
    """The :class:`Block` kind of block index(es) ``blk`` (int or int64 array): SM-driven blocks
    map to the kind they copy."""
    return blk % SM_BLOCK


@dataclass(frozen=True)
class PortMap:
    """Port indices, capacities (bytes/us) and names for R ranks on a topology.

    cap_P: float64 [P+1]; the last port is the dummy (infinite capacity) that pads paths.
    cluster: which node and which rail each rank is on (``Topology.cluster``; built from ``ranks``,
    ``gpus_per_node`` and ``nodes`` when not given): every node / rail rule of the port map asks it.
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
    link_group: int = 0
    mesh: bool = False
    cluster: ClusterShape | None = None

    def __post_init__(self) -> None:
        if self.cluster is None:
            object.__setattr__(self, "cluster", ClusterShape(self.nodes * self.gpus_per_node, self.gpus_per_node))

    KINDS = tuple(k.name.lower() for k in RankPort)   # "nvlink_out", ... "hbm", by RankPort

    @classmethod
    def build(cls, topo: Topology, ranks: int, nvlink_factor_R: np.ndarray | None = None,
              nic_factor_R: np.ndarray | None = None, sm_bytes_per_us: float = np.inf) -> "PortMap":
        """Ports of ``ranks`` GPUs on ``topo``; ``sm_bytes_per_us`` finite adds each rank's SM send
        and receive ports of that capacity (the Plan's kernel SM cap).

        Kept for the last ``BUILD_CACHE_SIZE`` argument sets (the topology by identity: it is
        frozen; the factors by value): a step's layers on one cluster share one map, whose arrays
        are read-only."""
        key = (ranks, None if nvlink_factor_R is None else np.asarray(nvlink_factor_R, float).tobytes(),
               None if nic_factor_R is None else np.asarray(nic_factor_R, float).tobytes(), float(sm_bytes_per_us))
        with _BUILT_LOCK:
            for i, (t, k, pm) in enumerate(_BUILT):
                if t is topo and k == key:
                    if i:
                        _BUILT.insert(0, _BUILT.pop(i))
                    return pm
        pm = cls._build(topo, ranks, nvlink_factor_R, nic_factor_R, sm_bytes_per_us)
        pm.cap_P.setflags(write=False)
        pm.nominal_cap_P.setflags(write=False)
        with _BUILT_LOCK:
            _BUILT.insert(0, (topo, key, pm))   # (the topology held: its id cannot be reused meanwhile)
            del _BUILT[BUILD_CACHE_SIZE:]
        return pm

    @classmethod
    def _build(cls, topo: Topology, ranks: int, nvlink_factor_R: np.ndarray | None,
               nic_factor_R: np.ndarray | None, sm_bytes_per_us: float) -> "PortMap":
        """:meth:`build`, uncached."""
        R = ranks
        geo = topo.cluster(R)
        G = geo.gpus_per_node
        nodes = geo.num_nodes
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
        group = G
        if topo.nic_attach == "node":  # one link per node; any of its ranks may use all of it
            nic = nic * G
        elif topo.nic_share > 1 and nodes > 1:  # G / rails GPUs behind one NIC (of one NIC's rate)
            node_links, group = True, min(topo.nic_share, G)
        groups = -(-R // group)
        pair_nom = np.zeros(0)
        pair_cap = np.zeros(0)
        if pairs:  # port base + a * R + b (a < b) for the pair {a, b}; unused slots never bind
            a, b = np.divmod(np.arange(R * R), R)
            same_node = geo.same_node(a, b)
            half = np.where(same_node, topo.nvlink_duplex == "half", topo.nic_duplex == "half")
            pair_nom = np.where(half & (a < b), np.where(same_node, nv, nic), np.inf)
            fac = np.where(same_node, np.minimum(nvf[a], nvf[b]), np.minimum(nicf[a], nicf[b]))
            pair_cap = np.where(np.isfinite(pair_nom), pair_nom * fac, np.inf)
        node_nom = np.full(2 * groups, nic) if node_links else np.zeros(0)
        node_cap = node_nom.copy()
        if node_links:  # a shared link is as fast as its slowest rank's NIC factor
            nf = np.full(groups, np.inf)
            np.minimum.at(nf, nic_group_of(geo, group, np.arange(R)), nicf)
            node_cap = node_nom * np.concatenate([nf, nf])
        mesh = topo.nvlink_peer_GBps > 0 and G > 1
        mesh_nom = np.zeros(0)
        mesh_cap = np.zeros(0)
        if mesh:  # port mesh_base + a * R + b for a -> b in one node; other slots never bind
            a, b = np.divmod(np.arange(R * R), R)
            inside = geo.same_node(a, b) & (a != b)
            mesh_nom = np.where(inside, topo.nvlink_peer_GBps * topo.nvlink_efficiency * 1e3, np.inf)
            mesh_cap = np.where(inside, mesh_nom * np.minimum(nvf[a], nvf[b]), np.inf)
        sm_ports = bool(np.isfinite(sm_bytes_per_us))
        sm_nom = np.full(2 * R, float(sm_bytes_per_us)) if sm_ports else np.zeros(0)
        nominal = np.concatenate([np.full(R, nv), np.full(R, nv), np.full(R, nic), np.full(R, nic), np.full(R, hbm),
                                  np.full(2 * rails, spine), pair_nom, node_nom, sm_nom, mesh_nom, [np.inf]])
        cap = np.concatenate([np.full(R, nv) * nvf, np.full(R, nv) * nvf, np.full(R, nic) * nicf, np.full(R, nic) * nicf,
                              np.full(R, hbm), np.full(2 * rails, spine), pair_cap, node_cap, sm_nom, mesh_cap, [np.inf]])
        return cls(R, G, rails, nodes, cap, nominal, topo.nvlink_latency_us, topo.nic_latency_us,
                   topo.nic_latency_us + topo.fabric_latency_us, bool(spine_binds), bool(pairs), bool(node_links),
                   float(topo.host_message_us), sm_ports, group, bool(mesh), geo)

    @property
    def spine_base(self) -> int:
        """First spine port: ``spine_base + rail`` is the rail's ``spine_up``, ``+ rails`` its ``spine_down``."""
        return len(RankPort) * self.ranks

    @property
    def pair_base(self) -> int:
        return self.spine_base + 2 * self.rails

    @property
    def node_base(self) -> int:
        return self.pair_base + (self.ranks * self.ranks if self.pairs else 0)

    @property
    def groups(self) -> int:
        """Shared network links (node links, or NICs shared by ``link_group`` ranks) per direction."""
        return -(-self.ranks // (self.link_group or self.gpus_per_node))

    @property
    def sm_base(self) -> int:
        """First SM port: ``sm_base + r`` is rank r's ``sm_send``, ``sm_base + R + r`` its ``sm_recv``."""
        return self.node_base + (2 * self.groups if self.node_links else 0)

    @property
    def mesh_base(self) -> int:
        """First mesh port: ``mesh_base + a * R + b`` is the direct link a -> b inside a node."""
        return self.sm_base + (2 * self.ranks if self.sm_ports else 0)

    @property
    def per_flow(self) -> bool:
        """Whether paths hold ports of neither side (half-duplex pairs, mesh links): solved per flow."""
        return self.pairs or self.mesh

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
        if self.mesh and p >= self.mesh_base:
            a, b = divmod(p - self.mesh_base, R)
            return f"mesh{a}-{b}"
        if self.sm_ports and p >= self.sm_base:
            q = p - self.sm_base
            return f"rank{q % R}.{'sm_send' if q < R else 'sm_recv'}"
        if p >= self.node_base:
            n, k = p - self.node_base, self.groups
            if (self.link_group or self.gpus_per_node) < self.gpus_per_node:
                return f"nic{n % k}.shared_{'out' if n < k else 'in'}"
            return f"node{n % k}.nic_{'out' if n < k else 'in'}"
        if p >= self.pair_base:
            a, b = divmod(p - self.pair_base, R)
            return f"pair{a}-{b}"
        p -= 5 * R
        return f"rail{p % self.rails}.spine_{'up' if p < self.rails else 'down'}"

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
    # Every path is the sender's ports of its block (:class:`Block`) followed by the receiver's
    # ports of its block (plus the pair port of a half-duplex link); with SM ports, blocks
    # SM_BLOCK + kind are the same for flows of SM-driven phases, which also cross the sender's
    # sm_send and the receiver's sm_recv. A port added to the model must be listed here on the
    # side of the rank it belongs to: ``paths`` and the simulator's block solver
    # (``moonep_sim.sim.blocks``) both read these tables.

    @property
    def num_blocks(self) -> int:
        return 2 * SM_BLOCK if self.sm_ports else SM_BLOCK

    def _over_nvlink(self, src_F: np.ndarray, dst_F: np.ndarray,
                     nic_F: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src_F, dst_F as int64 [F], same_node_F bool [F]): the transfer stays in its node, over
        NVLink (flows with ``nic_F`` True take the NIC path between ranks of one node too)."""
        src_F = np.asarray(src_F, dtype=np.int64)
        dst_F = np.asarray(dst_F, dtype=np.int64)
        same_node = self.cluster.same_node(src_F, dst_F)
        if nic_F is not None:
            same_node &= ~np.asarray(nic_F, dtype=bool)
        return src_F, dst_F, same_node

    def pair_class(self, src_F: np.ndarray, dst_F: np.ndarray, sm_F: np.ndarray | None = None,
                   nic_F: np.ndarray | None = None) -> np.ndarray:
        """int64 [F]: the block of each transfer ``src -> dst`` (a :class:`Block`, + ``SM_BLOCK`` for
        flows of SM-driven phases when the map has SM ports; flows with ``nic_F`` True take the
        NIC path between ranks of one node too)."""
        src_F, dst_F, same_node = self._over_nvlink(src_F, dst_F, nic_F)
        cls = np.where(src_F == dst_F, int(Block.LOCAL), np.where(same_node, int(Block.NVLINK), int(Block.NIC)))
        if self.spine_binds:
            cls = np.where((cls == Block.NIC) & ~self.cluster.same_rail(src_F, dst_F), int(Block.NIC_SPINE), cls)
        if self.sm_ports and sm_F is not None:
            cls = cls + SM_BLOCK * np.asarray(sm_F, dtype=np.int64)
        return cls

    def side_ports(self) -> tuple[np.ndarray, np.ndarray]:
        """(src_BRK int64 [B, R, Ks], dst_BRK int64 [B, R, Kd]): per block b and rank r, the ports
        r's transfers of that block cross as sender (src) and as receiver (dst), padded with the
        dummy port. B = ``num_blocks``."""
        R, G = self.ranks, self.gpus_per_node
        r = np.arange(R)
        dm = self.dummy
        node, rail = nic_group_of(self.cluster, self.link_group or G, r), self.cluster.rail_of(r)
        col = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
        own = lambda k: col(k * R + r)  # noqa: E731   (every rank's port of kind k)
        # per Block, in Block order: the sender's ports, the receiver's ports
        src: list[list[np.ndarray]] = [[own(RankPort.HBM)], [own(RankPort.NVLINK_OUT)],
                                       [own(RankPort.NIC_OUT)], [own(RankPort.NIC_OUT)]]
        dst: list[list[np.ndarray]] = [[], [own(RankPort.NVLINK_IN)], [own(RankPort.NIC_IN)], [own(RankPort.NIC_IN)]]
        if self.spine_binds:
            src[Block.NIC_SPINE].append(col(self.spine_base + rail))
            dst[Block.NIC_SPINE].insert(0, col(self.spine_base + self.rails + rail))
        if self.node_links:
            for b in (Block.NIC, Block.NIC_SPINE):
                src[b].append(col(self.node_base + node))
                dst[b].append(col(self.node_base + self.groups + node))
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
        lat = np.where(src_F == dst_F, 0.0, np.where(same_node, self.lat_nvlink_us, self.lat_nic_us))
        return np.where(~same_node & ~self.cluster.same_rail(src_F, dst_F), self.lat_spine_us, lat)

    def paths(self, src_F: np.ndarray, dst_F: np.ndarray, sm_F: np.ndarray | None = None,
              nic_F: np.ndarray | None = None) -> np.ndarray:
        """path_FL int64 [F, L_PATH]: the ports of transfers ``src -> dst`` (vectorised; their
        latency: :meth:`latency`). Columns: the sender's ports of the transfer's block, then the
        receiver's (``side_ports``; SM send / receive ports for flows with ``sm_F`` True when the map
        has them), then the pair port (half duplex) where it exists; padded with the dummy port.
        Flows with ``nic_F`` True take the NIC path between ranks of one node too (pure-RDMA kernels)."""
        src_F = np.asarray(src_F, dtype=np.int64)
        dst_F = np.asarray(dst_F, dtype=np.int64)
        F = src_F.size
        src_BRK, dst_BRK = self.side_ports()
        cls = self.pair_class(src_F, dst_F, sm_F, nic_F)
        cols = [src_BRK[cls, src_F], dst_BRK[cls, dst_F]]
        if self.pairs:
            lo, hi = np.minimum(src_F, dst_F), np.maximum(src_F, dst_F)
            cols.append(np.where(src_F != dst_F, self.pair_base + lo * self.ranks + hi, self.dummy)[:, None])
        if self.mesh:  # the direct link of an NVLink-block transfer
            over = block_kind(cls) == Block.NVLINK
            cols.append(np.where(over, self.mesh_base + src_F * self.ranks + dst_F, self.dummy)[:, None])
        cat = np.concatenate(cols, axis=1)
        path = np.full((F, L_PATH), self.dummy, dtype=np.int64)
        path[:, :cat.shape[1]] = cat
        return path

    def route(self, src_F: np.ndarray, dst_F: np.ndarray, sm_F: np.ndarray | None = None,
              nic_F: np.ndarray | None = None) -> np.ndarray:
        """path_FL including spine ports even where they cannot bind (for byte accounting)."""
        full = PortMap(**{**self.__dict__, "spine_binds": True})
        return full.paths(src_F, dst_F, sm_F, nic_F)


__all__ = ["Block", "L_PATH", "PortMap", "RankPort", "SM_BLOCK", "block_kind", "nic_group_of"]
