"""The numpy reference of the block solver's compiled fill and counts (``moonep_sim.sim.blocks``,
``moonep_sim.sim.fill_kernels``): the same progressive filling, one array pass per step, that the
kernels replaced and are held equal to, bit for bit (tests/test_sim_fill_kernels.py,
tests/test_sim_network*.py). A :class:`BlockCountsReference` is a ``BlockCounts`` with the numpy
fill; a flow network switched to it (:func:`numpy_tick`) ticks in numpy too
(:class:`NumpyTickNetwork`, the reference of the one-kernel tick)."""

from __future__ import annotations

import copy
from typing import NamedTuple

import numpy as np

from moonep_sim.sim.blocks import RUN_MAX, BlockCounts
from moonep_sim.sim.fill_kernels import fill_levels
from moonep_sim.sim.network import FlowNetwork
from moonep_sim.sim.ports import Block


class Levels(NamedTuple):
    """A fill's result, per node (block-major [B x R]) on each side: the level (bytes/us) at which
    it froze (inf if it carried nothing unfrozen) and the saturated port that froze it (-1 if
    none); ``steps``: the filling steps taken."""

    level_src: np.ndarray
    level_dst: np.ndarray
    port_src: np.ndarray
    port_dst: np.ndarray
    steps: int


def compiled_fill(bc: BlockCounts, cap_P: np.ndarray) -> Levels:
    """The exact max-min fair levels of ``bc``'s counted transfers by the compiled kernel the
    network's tick runs (``fill_kernels.fill_levels``, its levels and ports per sender node, per
    receiver node, then a spare node), as :class:`Levels`."""
    N = bc.B * bc.R
    lev, bport = np.empty(2 * N + 1), np.empty(2 * N + 1, dtype=np.int64)
    steps = fill_levels(np.asarray(cap_P, dtype=np.float64), bc.cnt_src, bc.cnt_dst, bc.mm, bc._kernel_static,
                        lev, bport)
    assert steps >= 0, "progressive filling made no progress"
    return Levels(lev[:N], lev[N:2 * N], bport[:N], bport[N:2 * N], steps)


class BlockCountsReference(BlockCounts):
    """:class:`~moonep_sim.sim.blocks.BlockCounts` with the numpy fill and counts. ``_hint``: per
    filling step, the run length of the last fill (its first prefix width is chosen above it:
    consecutive fills are alike; any start gives the same run, :meth:`_run`). ``cell_NW`` /
    ``other_NW``: the cell tables (:meth:`_node_cells`), built when it first freezes."""

    compiled = False

    def __init__(self, ports):
        super().__init__(ports)
        self._hint: list[int] = []
        self.cell_NW = self.other_NW = None
        self._positions()

    def _positions(self) -> None:
        """``pos_WD``: each row's position in a prefix of candidate ports, and ``port_side``: per port,
        True when its nodes are receiver nodes (every port belongs to one side), for :meth:`_prefix_run`."""
        self.pos_WD = np.repeat(np.arange(RUN_MAX)[:, None], self.port_nodes.shape[1], axis=1)
        recv = self.port_nodes >= self.B * self.R   # (the -1 padding is no receiver node)
        self.port_side = recv.any(axis=1)
        # every port's nodes on one side (``PortMap.side_ports`` lists each port on one side only)
        assert np.array_equal(recv.sum(axis=1), np.where(self.port_side, (self.port_nodes >= 0).sum(axis=1), 0))

    def fresh(self) -> "BlockCountsReference":
        new = super().fresh()
        new._hint = []
        return new

    def add(self, ns_F: np.ndarray, nd_F: np.ndarray, sign: float) -> None:
        """``BlockCounts.add`` in numpy: every block's matrix is a view of one flat buffer, so one
        scatter per side (counts are whole numbers, so the order of the additions does not matter)."""
        if ns_F.size == 0:
            return
        row, col = self.mt_row_N, self.cell_col_N
        np.add.at(self.m_flat, row[ns_F] + col[nd_F], sign)
        np.add.at(self.mt_flat, row[nd_F] + col[ns_F], sign)
        np.add.at(self.cnt_src, ns_F, sign)
        np.add.at(self.cnt_dst, nd_F, sign)

    def fill(self, cap_P: np.ndarray) -> Levels:
        return self.fill_reference(cap_P)

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


def reference(bc: BlockCounts) -> BlockCountsReference:
    """A numpy reference of ``bc`` (its port map's tables shared, its counts copied)."""
    new = copy.copy(bc)
    new.__class__ = BlockCountsReference
    new._reset_counts()
    new.mm[:] = bc.mm
    new.cnt_src[:] = bc.cnt_src
    new.cnt_dst[:] = bc.cnt_dst
    new._hint = []
    new.cell_NW = new.other_NW = None
    new._positions()
    return new


class NumpyTickNetwork(FlowNetwork):
    """A ``FlowNetwork`` of the block solver whose tick runs in numpy over its (numpy) block counts:
    the reference the one-kernel tick (``tick_kernels.tick_blocks``) is held equal to, the same
    steps in the same order. ``_levels``: the last fill's :class:`Levels` (None before the first)."""

    _levels: Levels | None = None

    def _tick_compiled(self, t: float) -> float:
        a, bc, R = self._a, self._blocks, self.ports.ranks
        # 1. completions (a flow's finish time is exact at its current rate), bottlenecked as the last fill said
        if a.n:
            sel = np.flatnonzero(a.fin <= t + 2e-9 * max(t, 1.0))
            if sel.size:
                lv, i, j = self._levels, a.ns[sel], a.nd[sel]
                bneck = np.where(lv.level_src[i] <= lv.level_dst[j], lv.port_src[i], lv.port_dst[j])
                bc.add(i, j, -1.0)
                a.ns[sel] = self._sentinel   # dead: rate 0 at the sentinel node (level 0), never changes
                a.nd[sel] = self._sentinel
                self._complete(sel, bneck, t)
        # 2. activations: the waiting flows ready by now, in submission order, counted in
        cols = self._start_ready(t)
        if cols is not None:
            ns_F, nd_F = cols["blk"] * R + cols["src"], cols["blk"] * R + cols["dst"]
            a.append(ns=ns_F, nd=nd_F, **cols)
            bc.add(ns_F, nd_F, 1.0)
        # 3. rates: exact max-min levels, then only flows whose rate changed are touched
        lv = self._levels = bc.fill(self.ports.cap_P)
        rate = np.minimum(np.take(np.append(lv.level_src, 0.0), a.ns), np.take(np.append(lv.level_dst, 0.0), a.nd))
        self.fill_iterations += lv.steps
        self._last_fill = t
        return self._set_rates(rate, t)

    def _set_rates(self, rate: np.ndarray, t: float) -> float:
        """Give the active flows the rates ``rate`` [n] of a fill at t: a flow whose rate changed
        gets its remaining bytes at t and its new finish time (the numpy reference of
        ``tick_kernels.set_rates``). Returns the earliest finish time (inf: none)."""
        a = self._a
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
        return float(a.fin.min()) if a.n else np.inf


def numpy_tick(net: FlowNetwork) -> FlowNetwork:
    """``net`` (of the block solver, before its first tick) switched to the numpy tick over a numpy
    reference of its block counts (:func:`reference`)."""
    net._blocks = reference(net._blocks)
    net.__class__ = NumpyTickNetwork
    return net
