"""The block solver: exact max-min fair rates from counts of active transfers per (sender,
receiver) pair, for port maps without half-duplex pair ports (:class:`BlockCounts`).

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

Notation and units: ``moonep_sim.sim.ports``.
"""

from __future__ import annotations

import copy

import numpy as np

from moonep_sim.sim.fill_kernels import SolverTables, count_transfers
from moonep_sim.sim.tick_kernels import plain
from moonep_sim.sim.ports import Block, PortMap, block_kind

RUN_MAX = 256    # ports considered for one run of the block solver's filling


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

    The fill (``fill_kernels.fill_levels`` over these counts and :attr:`_kernel_static`, run by the
    network's one-kernel tick) and the counts run compiled at every width; the numpy code they
    replaced is their test reference (``tests/blocks_reference.py``, with the network's numpy tick).
    """

    def __init__(self, ports: PortMap):
        self.ports = ports
        R, G = ports.ranks, ports.gpus_per_node
        self.R, self.G = R, G
        src_BRK, dst_BRK = ports.side_ports()
        B = ports.num_blocks
        self.B = B
        # the kind of each block (SM-driven blocks: the kind they copy), as Block and as an array
        self.kinds = tuple(Block(block_kind(b)) for b in range(B))
        self.kind_B = np.asarray(self.kinds, dtype=np.int64)
        self.blocks = [b for b in range(B) if self.kinds[b] != Block.NIC_SPINE or ports.spine_binds]
        width_of = {Block.LOCAL: 1, Block.NVLINK: G, Block.NIC: R, Block.NIC_SPINE: R}
        self.width = tuple(width_of[k] for k in self.kinds)
        # the blocks' M matrices are views of one flat buffer, so a cell of any block is one gather
        self.m_off = np.concatenate([[0], np.cumsum([R * w for w in self.width])]).astype(np.int64)
        T = int(self.m_off[-1])
        self.T = T
        # M cells, then MT cells, then one cell that stays 0 (the padding of the reference's cell tables)
        self._reset_counts()
        self.width_B = np.asarray(self.width, dtype=np.int64)
        r = np.arange(R)
        geo = self.cluster = ports.cluster
        # rank of row r's column j (node blocks: r's node), clipped: columns past R hold 0 counts
        self.node_cols_RG = np.minimum(geo.rank_at(geo.node_of(r)[:, None], np.arange(G)[None, :]), R - 1)
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
        self.pps = np.flatnonzero(self.port_one >= 0)
        self.nps = self.port_one[self.pps]
        # port -> its nodes, padded with -1 ([P + 1, most nodes on a port])
        deg = int(per_port.max(initial=1))
        self.port_nodes = np.full((P1, max(deg, 1)), -1, dtype=np.int64)
        col = np.arange(self.pn_nodes.size) - np.repeat(self.pn_ptr[:-1], per_port)
        self.port_nodes[np.repeat(np.arange(P1), per_port), col] = self.pn_nodes
        # per node (sender nodes 0..BR-1, then receiver nodes; block x R + rank on each side): the
        # key two nodes of an active cell share (block, and the node for NVLink blocks or the rank
        # for local ones), the node's rank's column in its block's M / MT rows and the first index
        # of its rank's row in ``m_flat`` / ``mt_flat`` (cell (s, d) of block b: row[bR + s] +
        # col[bR + d] in ``m_flat``, row[bR + d] + col[bR + s] in ``mt_flat``)
        b_N, r_N = np.divmod(np.arange(2 * B * R) % (B * R), R)
        kind_N = self.kind_B[b_N]
        self.cell_key_N = b_N * R + np.where(kind_N >= Block.NIC, 0,
                                             np.where(kind_N == Block.NVLINK, geo.node_of(r_N), r_N))
        self.cell_col_N = np.where(kind_N >= Block.NIC, r_N, np.where(kind_N == Block.NVLINK, geo.local_index(r_N), 0))
        self.mt_row_N = self.m_off[b_N] + r_N * self.width_B[b_N]
        c = lambda x: np.ascontiguousarray(x, dtype=np.int64)  # noqa: E731   (the kernels' dtype)
        #: int64 [2N] contiguous copies of ``mt_row_N`` / ``cell_col_N`` for the kernels
        self.row_U, self.col_U = c(self.mt_row_N), c(self.cell_col_N)
        #: the solver's tables as the kernels read them (as a plain tuple: ``tick_kernels.plain``)
        self._kernel_static = plain(SolverTables(bool(self.simple), int(dm), RUN_MAX, c(self.pall), c(self.port_nodes),
                                                 c(self.pps), c(self.nps), c(self.cell_key_N), self.row_U, self.col_U,
                                                 *(c(x) for x in self._node_rows())))

    def fresh(self) -> "BlockCounts":
        """A BlockCounts of the same port map with nothing counted: this one's tables (built once
        per port map, never written after ``__init__``) shared, its counts new."""
        new = copy.copy(self)
        new._reset_counts()
        return new

    def _reset_counts(self) -> None:
        """Zero counts: the flat buffer ``mm`` (M cells, MT cells, the zero cell), its block views
        and the node totals."""
        R, T, B = self.R, self.T, self.B
        self.mm = np.zeros(2 * T + 1)
        self.m_flat = self.mm[:T]
        self.M = [self.m_flat[self.m_off[b]:self.m_off[b + 1]].reshape(R, w) for b, w in enumerate(self.width)]
        self.mt_flat = self.mm[T:2 * T]
        self.MT = [self.mt_flat[self.m_off[b]:self.m_off[b + 1]].reshape(R, w) for b, w in enumerate(self.width)]
        self.cnt_src = np.zeros(B * R)   # active transfers per sender node (block-major)
        self.cnt_dst = np.zeros(B * R)

    def _node_rows(self) -> tuple[np.ndarray, ...]:
        """(cbase_U, wid_U, obase_U, qbase_U, cols_RG): the cells of each node (and of the spare node
        2N: none) as the compiled freeze derives them (``fill_kernels._freeze``): its row's first
        cell in :attr:`mm`, its row's width (0 for an unused block), the other side's first node of
        its block, and its cells' first rank there (-1 - r for an NVLink node of rank r, whose
        cells' ranks are ``node_cols_RG[r]``) -- what the numpy reference's cell tables hold."""
        R, N = self.R, self.B * self.R
        u = np.arange(2 * N)
        side, (b_N, r_N) = u // N, np.divmod(u % N, R)
        kind_N = self.kind_B[b_N]
        used = np.zeros(self.B, dtype=bool)
        used[self.blocks] = True
        qbase = np.where(kind_N >= Block.NIC, 0, np.where(kind_N == Block.NVLINK, -1 - r_N, r_N))
        spare = lambda x: np.append(x, 0)  # noqa: E731
        return (spare(side * self.T + self.mt_row_N), spare(np.where(used[b_N], self.width_B[b_N], 0)),
                spare((1 - side) * N + b_N * R), spare(qbase), self.node_cols_RG)

    def add(self, ns_F: np.ndarray, nd_F: np.ndarray, sign: float) -> None:
        """Count transfers in (sign = 1) or out (sign = -1); ``ns_F`` / ``nd_F``: int64 [F] their
        sender and receiver nodes (block x R + rank, the same numbering on both sides): one
        compiled pass (counts are whole numbers, so the order of the additions does not matter)."""
        if ns_F.size:
            count_transfers(self.mm, self.T, self.row_U, self.col_U, self.cnt_src, self.cnt_dst, ns_F, nd_F, sign)


__all__ = ["BlockCounts", "RUN_MAX"]
