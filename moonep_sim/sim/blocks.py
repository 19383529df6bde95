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
from typing import NamedTuple

import numpy as np

from moonep_sim.sim.fill_kernels import count_transfers, fill_levels, solver_tables
from moonep_sim.sim.tick_kernels import plain
from moonep_sim.sim.ports import Block, PortMap, block_kind

RUN_MAX = 256    # ports considered for one run of the block solver's filling


class Levels(NamedTuple):
    """A :meth:`BlockCounts.fill` result, per node (block-major [B x R]) on each side: the level
    (bytes/us) at which it froze (inf if it carried nothing unfrozen) and the saturated port that
    froze it (-1 if none); ``steps``: the filling steps taken."""

    level_src: np.ndarray
    level_dst: np.ndarray
    port_src: np.ndarray
    port_dst: np.ndarray
    steps: int


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
        # M cells, then MT cells, then one cell that stays 0 (the padding of :attr:`cell_NW`)
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
        # port -> its nodes, padded with -1 ([P + 1, most nodes on a port]), and each row's position
        # in a prefix of candidate ports (for :meth:`_prefix_run`)
        deg = int(per_port.max(initial=1))
        self.port_nodes = np.full((P1, max(deg, 1)), -1, dtype=np.int64)
        col = np.arange(self.pn_nodes.size) - np.repeat(self.pn_ptr[:-1], per_port)
        self.port_nodes[np.repeat(np.arange(P1), per_port), col] = self.pn_nodes
        self.pos_WD = np.repeat(np.arange(RUN_MAX)[:, None], self.port_nodes.shape[1], axis=1)
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
        # per port: True when its nodes are receiver nodes (every port belongs to one side)
        self.port_side = np.zeros(P1, dtype=bool)
        side_of = self.pn_nodes >= B * R
        self.port_side[np.repeat(np.arange(P1), per_port)] = side_of
        mixed = np.bincount(np.repeat(np.arange(P1), per_port), weights=side_of, minlength=P1)
        if not np.all((mixed == 0) | (mixed == per_port)):  # pragma: no cover - side_ports lists a port on both sides
            raise RuntimeError("a port holds sender and receiver nodes")
        # per filling step, the run length of the last fill: its first prefix width is chosen above
        # it (consecutive fills are alike); any start gives the same run (:meth:`_run`)
        self._hint: list[int] = []
        # the numpy reference's cell tables ([2N, W] per node: :meth:`_node_cells`), built when it
        # first freezes; the compiled fill derives each node's cells from per-node values instead
        self.cell_NW = self.other_NW = None
        self._compiled = True
        c = np.ascontiguousarray
        #: int64 [2N] contiguous copies of ``mt_row_N`` / ``cell_col_N`` for the kernels
        self.row_U, self.col_U = c(self.mt_row_N, dtype=np.int64), c(self.cell_col_N, dtype=np.int64)
        #: the solver's tables as the kernels read them (fill_kernels.SolverTables, as a plain tuple:
        #: ``tick_kernels.plain``)
        self._kernel_static = plain(solver_tables(self.simple, dm, RUN_MAX, self.pall, self.port_nodes, self.pps, self.nps,
                                                  self.cell_key_N, self.row_U, self.col_U, self._node_rows()))

    def fresh(self) -> "BlockCounts":
        """A BlockCounts of the same port map with nothing counted: this one's tables (built once
        per port map, never written after ``__init__``) shared, its counts, hints and switches new."""
        new = copy.copy(self)
        new._reset_counts()
        new._hint = []
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

    @property
    def compiled(self) -> bool:
        """:meth:`fill` and :meth:`add` run the compiled kernels (``moonep_sim.sim.fill_kernels``,
        bit-identical to :meth:`fill_reference` and the numpy scatter), at every width. Settable:
        False runs the numpy code (the reference, for tests)."""
        return self._compiled

    @compiled.setter
    def compiled(self, on: bool) -> None:
        self._compiled = bool(on)

    def _node_rows(self) -> tuple[np.ndarray, ...]:
        """(cbase_U, wid_U, obase_U, qbase_U, cols_RG): the cells of each node (and of the spare node
        2N: none) as the compiled freeze derives them (``fill_kernels._freeze``): its row's first
        cell in :attr:`mm`, its row's width (0 for an unused block), the other side's first node of
        its block, and its cells' first rank there (-1 - r for an NVLink node of rank r, whose
        cells' ranks are ``node_cols_RG[r]``) -- what :meth:`_node_cells` tabulates."""
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

    def _node_cells(self, T: int) -> tuple[np.ndarray, np.ndarray]:
        """(cell_NW, other_NW): per node (sender nodes 0..N-1, then receiver nodes N..2N-1; N = B x R)
        and column w of its block's row (W: the widest used block), the index in :attr:`mm` of the
        cell the node shares with the other side's node ``other_NW`` (a sender node reads its ``M``
        row, a receiver node its ``MT`` row). Columns past the node's block width, and the nodes of
        unused blocks, point at the zero cell ``2 T`` and the spare node 2N. (The numpy reference's
        freeze reads them: [2N, W], built when it first freezes.)"""
        R, N = self.R, self.B * self.R
        W = max(self.width[b] for b in self.blocks) if self.blocks else 1
        u = np.arange(2 * N)
        side, (b_N, r_N) = u // N, np.divmod(u % N, R)
        w = np.arange(W)[None, :]
        kind_N = self.kind_B[b_N]
        rank_NW = np.where((kind_N >= Block.NIC)[:, None], w, np.where(
            (kind_N == Block.NVLINK)[:, None], self.node_cols_RG[r_N][:, np.minimum(w[0], self.G - 1)], r_N[:, None]))
        used = np.zeros(self.B, dtype=bool)
        used[self.blocks] = True
        ok = used[b_N][:, None] & (w < self.width_B[b_N][:, None])
        cell = np.where(ok, side[:, None] * T + self.mt_row_N[:, None] + w, 2 * T)
        other = np.where(ok, (1 - side)[:, None] * N + b_N[:, None] * R + rank_NW, 2 * N)
        return cell.astype(np.intp), other.astype(np.intp)

    def add(self, ns_F: np.ndarray, nd_F: np.ndarray, sign: float) -> None:
        """Count transfers in (sign = 1) or out (sign = -1); ``ns_F`` / ``nd_F``: int64 [F] their
        sender and receiver nodes (block x R + rank, the same numbering on both sides)."""
        if ns_F.size == 0:
            return
        if self.compiled:   # one compiled pass (the same whole-number sums)
            count_transfers(self.mm, self.T, self.row_U, self.col_U, self.cnt_src, self.cnt_dst, ns_F, nd_F, sign)
            return
        row, col = self.mt_row_N, self.cell_col_N
        # every block's matrix is a view of one flat buffer: one scatter per side (counts are
        # whole numbers, so the order of the additions does not matter)
        np.add.at(self.m_flat, row[ns_F] + col[nd_F], sign)
        np.add.at(self.mt_flat, row[nd_F] + col[ns_F], sign)
        np.add.at(self.cnt_src, ns_F, sign)
        np.add.at(self.cnt_dst, nd_F, sign)

    def fill(self, cap_P: np.ndarray) -> Levels:
        """Exact max-min fair levels of the counted transfers (batched progressive filling):
        per node, the level at which it froze and the port that froze it (:class:`Levels`).

        The compiled kernel (:func:`~moonep_sim.sim.fill_kernels.fill_levels`) where
        :attr:`compiled`, else :meth:`fill_reference`; the two are bit-identical (tested). One
        fill of a V3 EP32 decode layer's network: ~15x faster than the reference."""
        if not self.compiled:
            return self.fill_reference(cap_P)
        lev, bport, steps = self.fill_nodes(cap_P)
        N = self.B * self.R
        return Levels(lev[:N], lev[N:2 * N], bport[:N], bport[N:2 * N], steps)

    def fill_nodes(self, cap_P: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The compiled :meth:`fill` (only where :attr:`compiled`) as the kernel returns it: (lev_U1
        float64 [2N + 1], bport_U1 int64 [2N + 1], steps), the sender nodes' levels and ports, then
        the receiver nodes', then a spare node (inf, -1)."""
        lev, bport, steps = fill_levels(np.asarray(cap_P, dtype=np.float64), self.cnt_src, self.cnt_dst, self.mm,
                                        self._kernel_static)
        if steps < 0:  # pragma: no cover - the run's ports carry unfrozen transfers
            raise RuntimeError("progressive filling made no progress")
        return lev, bport, steps

    def fill_reference(self, cap_P: np.ndarray) -> Levels:
        """:meth:`fill` in numpy (the reference of the compiled kernel, and the solver where the
        cell tables are not built): the same steps, one array pass each."""
        R = self.R
        N = self.B * R
        P1 = cap_P.size
        dm = self.ports.dummy
        cap = np.asarray(cap_P, dtype=np.float64)
        # per node, and one spare node 2N that stays empty (the padding of the cell tables):
        # unfrozen transfers, frozen load (bytes/us), level, the port that froze it, free
        cnt_x = np.concatenate([self.cnt_src, self.cnt_dst, [0.0]])
        frz_x = np.zeros(2 * N + 1)
        lev_x = np.full(2 * N + 1, np.inf)
        bport_x = np.full(2 * N + 1, -1, dtype=np.int64)
        free_x = np.ones(2 * N + 1, dtype=bool)
        free_x[-1] = False
        state = (lev_x, bport_x, free_x, frz_x, cnt_x)
        cnt, frz = cnt_x[:2 * N], frz_x[:2 * N]
        lev, bport = lev_x[:2 * N], bport_x[:2 * N]
        if self.simple:
            steps = self._fill_simple(cap, state)
            return Levels(lev[:N], lev[N:], bport[:N], bport[N:], steps)
        pall, K = self.pall, self.pall.shape[1]
        pflat = pall.ravel()
        steps = 0
        while cnt.any():
            n = np.bincount(pflat, weights=cnt if K == 1 else cnt.repeat(K), minlength=P1)
            fr = np.bincount(pflat, weights=frz if K == 1 else frz.repeat(K), minlength=P1)
            n[dm] = 0.0
            cand = n.nonzero()[0]
            share = (cap[cand] - fr[cand]) / n[cand]
            order = share.argsort(kind="stable")
            cand, share = cand[order], share[order]
            # the run: a prefix of ports whose nodes are all distinct with no active cell between
            # two of them (then no port of the run shares a transfer with an earlier one)
            cut, node, pos = self._run(cand, steps)
            steps += 1
            # the run's nodes that carry unfrozen transfers (each on one run port: its first
            # saturating port freezes it), in increasing order; no two share a cell, so freezing
            # them together equals freezing one side after the other
            o = node.argsort()
            node, pos = node[o], pos[o]
            live = cnt[node] > 0
            if not live.all():
                node, pos = node[live], pos[live]
            if not node.size:  # pragma: no cover - the run's ports carry unfrozen transfers
                raise RuntimeError("progressive filling made no progress")
            self._freeze(node, share[pos], cand[pos], state)
        return Levels(lev[:N], lev[N:], bport[:N], bport[N:], steps)

    def _run(self, cand: np.ndarray, step: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(cut, node, pos): the run of filling step ``step`` over ports ``cand`` (in share order):
        its length (:meth:`_prefix_run` of the longest prefix tried) and its ports' nodes with
        their port's position in ``cand``.

        Short runs are the common case, so prefixes of 8, 64 and ``RUN_MAX`` ports are tried in
        turn, from the first width above this step's run length in the last fill (a prefix's cut
        is the whole run's whenever it falls inside the prefix, so every start gives the same run;
        the hint only skips prefixes that would be cut at their end: measured 1.3 calls per step
        instead of 1.7 on a K3 EP64 deepep layer)."""
        hint = self._hint[step] if step < len(self._hint) else 0
        for width in (8, 64, RUN_MAX):
            # the last width is always tried (a run of RUN_MAX ports in the last fill skipped them all)
            if width <= hint and width < cand.size and width < RUN_MAX:
                continue
            cut, node, pos = self._prefix_run(cand[:width])
            if cut < width or width >= cand.size:
                break
        if step < len(self._hint):
            self._hint[step] = cut
        else:
            self._hint.append(cut)
        keep = pos < cut
        return cut, node[keep], pos[keep]

    def _fill_simple(self, cap, state) -> int:
        """:meth:`fill` when every node has one port and every port one node (``simple``): the
        same steps, in node space (a port's count and frozen load are its node's; ties in share
        order still go to the lower port). ``state``: :meth:`fill`'s per-node arrays. Returns the
        steps."""
        cnt, frz = state[4], state[3]
        nps, pps = self.nps, self.pps
        cap_n = cap[pps]
        steps = 0
        while True:
            c_n = cnt[nps]
            li = c_n.nonzero()[0]
            if not li.size:   # every counted transfer crosses a port, so no node carries any now
                break
            steps += 1
            cn = nps[li]
            share = (cap_n[li] - frz[cn]) / c_n[li]
            order = share.argsort(kind="stable")
            cn = cn[order]
            cut = self._switch_cut(cn[:RUN_MAX])
            if cut is None:
                cand = pps[li[order]]
                for width in (8, 64, RUN_MAX):  # short runs are the common case: try small prefixes first
                    cut = self._run_cut(cand[:width])
                    if cut < width or width >= cand.size:
                        break
            # the run's nodes all carry unfrozen transfers (they are live and nothing froze yet in
            # this step) and share no cell: frozen together, in increasing order (a frozen node's
            # own load is never read again here: its port is its alone)
            o = cn[:cut].argsort()
            oo = order[o]
            self._freeze(cn[o], share[oo], pps[li[oo]], state, own_load=False)
        return steps

    def _switch_cut(self, node: np.ndarray) -> int | None:
        """The run's length in the simple case (one node per port; ``node``: the ports' nodes in
        share order) when it ends where the ports first switch side: all of one side (no two of
        them can share a transfer), or the first port of the other side has an active cell with a
        port before it. None when that port has none (then :meth:`_run_cut` decides). Same answer
        as :meth:`_run_cut`, which cuts at the first port sharing a transfer with an earlier one,
        in a few array operations."""
        is_s = node < self.B * self.R
        q = int((is_s != is_s[0]).argmax())   # 0: no switch
        if q == 0:
            return node.size
        x, prev = int(node[q]), node[:q]
        key, row, col = self.cell_key_N, self.mt_row_N, self.cell_col_N
        idx = row[prev] + col[x] if is_s[0] else row[x] + col[prev]   # cell (sender, receiver) in m_flat
        act = (key[prev] == key[x]) & (self.m_flat.take(idx, mode="clip") > 0)
        return q if bool(act.any()) else None

    def _run_cut(self, cand: np.ndarray) -> int:
        """Length of the run over ports ``cand`` (in share order): :meth:`_prefix_run`'s cut."""
        return self._prefix_run(cand)[0]

    def _prefix_run(self, cand: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """(cut, node, pos): the length of the run, the longest prefix of ports ``cand`` (in share
        order) in which no node belongs to two ports and no node has an active cell with a node of
        an earlier port on the other side (at least 1), and the nodes of the ports before the cut
        with their port's position in ``cand`` (ascending)."""
        w = cand.size
        nd_WD = self.port_nodes[cand]
        real = nd_WD >= 0
        node, pos = nd_WD[real], self.pos_WD[:w][real]
        cut = w
        if not self.simple:   # a node of two ports: cut at the later one
            o = node.argsort(kind="stable")
            sn = node[o]
            dup = sn[1:] == sn[:-1]
            if dup.any():
                cut = int(pos[o][dup.nonzero()[0] + 1].min())
                keep = pos < cut
                node, pos = node[keep], pos[keep]
            # ports before the first one of the other side share no cell; the run usually ends at
            # that port (9 in 10 fills of K3 EP64 deepep layers): check it alone first
            side = self.port_side[cand[:cut]]
            q = int((side != side[0]).argmax())
            if q == 0:
                return max(cut, 1), node, pos
            i0, i1 = pos.searchsorted(q), pos.searchsorted(q, "right")   # pos ascends
            x, prev = node[i0:i1], node[:i0]
            key, row, col = self.cell_key_N, self.mt_row_N, self.cell_col_N
            idx = row[prev][None, :] + col[x][:, None] if side[q] else row[x][:, None] + col[prev][None, :]
            if bool(((key[x][:, None] == key[prev][None, :]) & (np.take(self.m_flat, idx, mode="clip") > 0)).any()):
                return q, node, pos
        cut = self._cell_cut(node, pos, cut)
        return max(cut, 1), node, pos

    def _cell_cut(self, node: np.ndarray, pos: np.ndarray, cut: int) -> int:
        """``cut`` lowered to the first position at which a node has an active cell with a node of
        an earlier position on the other side (``node``, ``pos``: the prefix's nodes and their
        ports' positions, all below ``cut``). Each receiver's earliest connected sender is read
        from one gather of the [receivers, senders] cells of ``mt_flat`` (pairs of two blocks, or
        of two nodes for NVLink blocks, masked by their cell key): a fixed number of array
        operations whatever the blocks (2x faster than per block on K3 EP64 deepep layers)."""
        N = self.B * self.R
        is_s = node < N
        if not is_s.any() or is_s.all():
            return cut
        ns, nr = node[is_s], node[~is_s]
        act = self.cell_key_N[nr][:, None] == self.cell_key_N[ns][None, :]
        idx = self.mt_row_N[nr][:, None] + self.cell_col_N[ns][None, :]
        act &= np.take(self.mt_flat, idx, mode="clip") > 0   # pairs of two blocks may point past the buffer
        first = np.where(act, pos[is_s][None, :], cut).min(axis=1)   # per receiver: its earliest connected sender
        return min(cut, int(np.maximum(first, pos[~is_s]).min()))

    def _freeze(self, g: np.ndarray, lv: np.ndarray, port: np.ndarray, state, own_load: bool = True) -> None:
        """Freeze nodes ``g`` (int64, increasing; of either side, no two sharing a cell, each
        carrying unfrozen transfers) at levels ``lv`` (the shares of ``port``, the run ports that
        saturate them); their cells leave the other side's free nodes: counts, and load at the
        cells' level. ``state``: :meth:`fill`'s per-node arrays (lev, bport, free, frz, cnt);
        ``own_load``: add the nodes' own frozen load to ``frz`` (read by ports of several nodes).

        The cells of every frozen node are read from the cell tables (:meth:`_node_cells`, built
        here at the first freeze) in one gather and scattered in one count per quantity, whatever
        the blocks: the order of sums the compiled freeze (``fill_kernels._freeze``) keeps."""
        lev, bport, free, frz, cnt = state
        lev[g] = lv
        bport[g] = port
        free[g] = False
        if own_load:
            frz[g] += lv * cnt[g]
        cnt[g] = 0.0
        if self.cell_NW is None:
            self.cell_NW, self.other_NW = self._node_cells(self.T)
        other = self.other_NW[g]
        Z = self.mm[self.cell_NW[g]]
        Z *= free[other]
        t = other.ravel()
        cnt -= np.bincount(t, weights=Z.ravel(), minlength=cnt.size)
        frz += np.bincount(t, weights=(lv[:, None] * Z).ravel(), minlength=frz.size)

    def rates(self, filled: Levels, blk_F, src_F, dst_F) -> tuple[np.ndarray, np.ndarray]:
        """(rate_F, bottleneck_port_F) of transfers from a :meth:`fill` result."""
        a = blk_F * self.R + src_F
        c = blk_F * self.R + dst_F
        ls, ld = filled.level_src[a], filled.level_dst[c]
        use_src = ls <= ld
        return np.where(use_src, ls, ld), np.where(use_src, filled.port_src[a], filled.port_dst[c])


__all__ = ["BlockCounts", "Levels", "RUN_MAX"]
