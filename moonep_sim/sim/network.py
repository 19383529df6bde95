"""Flow-level network model on simpy: ports shared max-min fairly by concurrent transfers.

Notation: R ranks, G GPUs per node, F flows (one per (phase, source, destination) with bytes > 0),
P ports, L = 9 ports per path at most (shorter paths are padded with a dummy port of infinite
capacity). Units: bytes, microseconds, bytes per microsecond.

The ports and paths: ``moonep_sim.sim.ports``; the solvers: ``moonep_sim.sim.blocks`` (exact,
from per-pair counts) and ``moonep_sim.sim.waterfill`` (per flow, for half-duplex pair ports); the
columns of pending and active transfers: ``moonep_sim.sim.flows``. This module is the tick loop
(:class:`FlowNetwork`) and re-exports ``PortMap`` and ``waterfill``.

Each flow waits the path's latency (plus ``host_message_us`` per other rank its sender sends to in
that phase: a serial per-message cost, 0 on the GPU presets), then transmits; concurrent flows get
the max-min fair allocation (progressive filling: all unfrozen flows grow together until a port
saturates; flows through it freeze).

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

import math
import threading
from typing import Any, NamedTuple

import numpy as np
import simpy

from moonep_sim.errors import require
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.sim.blocks import BlockCounts
from moonep_sim.sim.flows import ActiveFlows, FlowLog, Pending
from moonep_sim.sim.ports import L_PATH, Block, PortMap, block_kind
from moonep_sim.sim.tick_kernels import LogCols, plain, set_rates, submit_flows, tick_blocks, tick_records, wait_cols
from moonep_sim.sim.waterfill import waterfill


STATIC_CACHE_SIZE = 8      # port maps whose solver tables and pair tables are kept (most recent first)
# per (port map, performance settings) (the map held, so its id is not reused): (BlockCounts with
# nothing counted, pair tables); a network takes a fresh copy of the former (``BlockCounts.fresh``)
# and reads the latter (read-only)
_STATIC: list[tuple[PortMap, PerfConfig, list, dict]] = []
_STATIC_LOCK = threading.Lock()   # (the template and the tables themselves are never written once made)


def _static(ports: PortMap, perf: PerfConfig) -> tuple[list, dict]:
    """The cached ([BlockCounts template or None], pair tables) of ``ports`` under ``perf`` (created
    empty on first use)."""
    with _STATIC_LOCK:
        for i, (pm, pf, tmpl, tabs) in enumerate(_STATIC):
            if pm is ports and pf == perf:
                if i:
                    _STATIC.insert(0, _STATIC.pop(i))
                return tmpl, tabs
        tmpl, tabs = [], {}
        _STATIC.insert(0, (ports, perf, tmpl, tabs))
        del _STATIC[STATIC_CACHE_SIZE:]
        return tmpl, tabs


class UtilSample(NamedTuple):
    """Port utilisation at a tick (``record_util``): the time and, per port, rate / capacity."""

    t_us: float
    util_P: np.ndarray


class FlowNetwork:
    """Transfers of a simulation, on a simpy Environment (see the module docstring).

    Usage: ``expect(phase, count_R)`` once per phase instance (how many flows each rank will
    receive), then ranks call ``submit(phase, src, dst_F, bytes_F, eff_bytes_F)`` when they send,
    and wait on ``received(phase, dst)``. Records one row per finished flow for reports.

    Solver: :class:`BlockCounts` (exact max-min fair levels from per-pair counts) unless the port
    map has half-duplex pair ports, then :func:`waterfill` over per-flow paths (``solver``: "auto",
    "blocks" or "paths"). Per active flow the state is (rate, remaining bytes at t0, t0, finish
    time); a tick touches a flow's state only when its rate changed.

    perf: up to how many (sender, receiver) pairs the network builds its pair tables, read by the
    compiled submission (``PerfConfig.pair_table_max``; the same records with or without them).
    """

    def __init__(self, env: simpy.Environment, ports: PortMap, tol: float = 0.0, record_util: bool = False,
                 solver: str = "auto", perf: PerfConfig = DEFAULT_PERF):
        require(solver in ("auto", "blocks", "paths"), f"solver ({solver!r}) must be 'auto', 'blocks' or 'paths'")
        require(not (solver == "blocks" and ports.per_flow),
                "solver ('blocks') must not be used with half-duplex pair or mesh ports: their paths are not per-side")
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
        self._phase_tab: list = []        # per phase id: its pair tables (``_pair_table``), once looked up
        self._R, self._message_us = ports.ranks, float(ports.message_us)
        # the solver's tables and the pair tables do not depend on the flows: built once per port map
        self._pair_max = perf.pair_table_max
        tmpl, self._pair_tables = _static(ports, perf)
        use_blocks = solver == "blocks" or (solver == "auto" and not ports.per_flow)
        self._blocks = None
        if use_blocks:
            if not tmpl:
                tmpl.append(BlockCounts(ports))
            self._blocks = tmpl[0].fresh()
        self._a = ActiveFlows(with_path=not use_blocks, path_len=L_PATH)
        self._dead = 0
        self._sentinel = ports.num_blocks * ports.ranks   # node index of finished flows (level 0)
        # the last fill of the block solver: lev_U1, bport_U1 [2N + 1] (each fill writes them in place)
        self._node_levels = (np.zeros(2 * self._sentinel + 1), np.full(2 * self._sentinel + 1, -1, dtype=np.int64))
        self._done = np.empty(32, dtype=np.int64)  # scratch of the compiled completions
        self._bneck_paths: np.ndarray | None = None   # the last fill of the per-flow solver: bottleneck per slot
        # flows waiting for their latency, in submission order
        self._pend = Pending(with_path=not use_blocks, path_len=L_PATH)
        self._pend_min = np.inf   # the earliest ready time of every waiting flow (inf: none)
        self._sargs: tuple | None = None   # the compiled submission's buffers (None: to gather again)
        self._targs: tuple | None = None   # the compiled tick's
        self._log = FlowLog()
        self._last_fill = -np.inf
        self._horizon = 0.0  # when the active traffic would drain at the current rates (time scale)
        self._version = 0
        self._next_tick = np.inf
        self.ticks = 0
        self.fill_iterations = 0
        self.util_samples: list[UtilSample] = []

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
        self._phase_tab.append(False)   # its pair tables (False: not looked up yet)
        left = np.asarray(count_R, dtype=np.int64).ravel().copy()
        require(left.size == self.ports.ranks, f"count_R size ({left.size}) must equal the ranks ({self.ports.ranks})")
        evs = [self.env.event() for _ in range(left.size)]
        for d in np.flatnonzero(left == 0):
            evs[d].succeed()
        self._left = np.concatenate([self._left, left])
        self._targs = None   # the compiled tick reads the new counts
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
        tab = self._phase_tab[pid]
        sm, nic = self.ports.sm_ports and self._phase_sm[pid], self._phase_nic[pid]
        if tab is False:   # the phase's pair tables, looked up at its first submission
            tab = self._phase_tab[pid] = self._pair_table(sm, nic)
        R = self._R
        # the sender's rows of the pair tables (classified here above ``perf.pair_table_max`` pairs)
        blk_R, lat_R = tab[src] if tab is not None else self._pairs(np.full(R, src), np.arange(R), sm, nic)
        dst_F = np.asarray(dst_F, dtype=np.int64)
        F = dst_F.size
        p, log = self._pend, self._log
        if p.n + F > p.capacity or log.n + F > log.capacity or self._sargs is None:
            p.reserve(p.n + F)
            log.reserve(log.n + F)
            # (the records as plain tuples in their fields' order: numba types a plain tuple in C at
            # each call, a NamedTuple field by field in Python -- ~20 us a tick, 15% of a layer)
            self._sargs = (plain(wait_cols(p)), plain(LogCols(log.block("src"), log.block("bytes"))))
            self._targs = None   # the tick's buffers too
        # one kernel: the entries with bytes, their cells of the sender's rows
        m, first = submit_flows((src, pid, float(self.env.now), self._message_us), dst_F,   # a Submission
                                np.ascontiguousarray(bytes_F, dtype=np.float64),   # (one layout: one compile)
                                np.ascontiguousarray(eff_bytes_F, dtype=np.float64),
                                blk_R, lat_R, R, p.n, log.n, *self._sargs)
        if m == 0:
            return
        p.n += m
        log.n += m
        if self._blocks is None:   # the per-flow solver's paths
            new = slice(p.n - m, p.n)
            p.data["path"][new] = self.ports.paths(np.full(m, src), p.data["dst"][new],
                                                   np.full(m, sm) if self.ports.sm_ports else None,
                                                   np.full(m, True) if nic else None)
        self._pend_min = min(self._pend_min, first)
        self._request_tick(first)

    def _pair_table(self, sm: bool, nic: bool) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Per sender, its rows (block_R, latency_R) of :meth:`_pairs` of every (sender, receiver)
        (built on first use, kept per port map; a rank's submission then reads its rows instead of
        classifying its transfers again). None above ``perf.pair_table_max`` pairs."""
        key = (sm, nic)
        if key not in self._pair_tables:
            R = self.ports.ranks
            tab = None
            if R * R <= self._pair_max:   # (read-only: shared by the networks of this port map)
                tab = list(zip(*(x.reshape(R, R) for x in self._pairs(*np.divmod(np.arange(R * R), R), sm, nic))))
            self._pair_tables[key] = tab
        return self._pair_tables[key]

    def _pairs(self, src_F: np.ndarray, dst_F: np.ndarray, sm: bool, nic: bool) -> tuple[np.ndarray, np.ndarray]:
        """(block_F int64, latency_F float64), read-only: ``PortMap.pair_class`` and ``latency`` of
        transfers ``src -> dst`` of a phase with these flags."""
        F = src_F.size
        nic_F = np.full(F, True) if nic else None
        out = (self.ports.pair_class(src_F, dst_F, np.full(F, sm) if self.ports.sm_ports else None, nic_F),
               self.ports.latency(src_F, dst_F, nic_F))
        for x in out:
            x.setflags(write=False)
        return out

    # -- the tick machinery --------------------------------------------------------------
    def _request_tick(self, t: float) -> None:
        lf = self._last_fill
        if math.isfinite(lf):   # no tick sooner than tol x max(last fill, horizon) after the last fill
            t = max(t, lf + self.tol * max(lf, self._horizon))
        now = self.env.now
        t = max(t, now)
        if t < self._next_tick:
            self._next_tick = t
            self._version += 1
            v = self._version
            ev = self.env.timeout(t - now)
            ev.callbacks.append(lambda _e, v=v: self._tick(v))

    def _tick(self, version: int) -> None:
        if version != self._version:
            return  # stale: superseded by a later rate change
        self._next_tick = np.inf
        t = float(self.env.now)
        self.ticks += 1
        a = self._a
        nxt = self._tick_compiled(t) if self._blocks is not None else self._tick_paths(t)
        if self.record_util:
            live = np.flatnonzero(a.alive)
            if self._blocks is None:
                path = a.path[live]
            else:
                bc, R = self._blocks, self.ports.ranks
                path = np.concatenate([bc.ps[a.blk[live] * R + a.src[live]], bc.pd[a.blk[live] * R + a.dst[live]]], axis=1)
            use = np.bincount(path.ravel(), weights=np.repeat(a.rate[live], path.shape[1]),
                              minlength=self.ports.cap_P.size)[:-1]
            self.util_samples.append(UtilSample(t, use / self.ports.cap_P[:-1]))
        # the next tick
        if self._pend.n:
            nxt = min(nxt, self._pend_min)
        if math.isfinite(nxt):
            self._request_tick(nxt)

    def _tick_compiled(self, t: float) -> float:
        """The tick's completions, activations, fill and rates in one kernel
        (``tick_kernels.tick_blocks``); the receive groups it completes fire here, in key order.
        Returns the earliest finish time."""
        a, p = self._a, self._pend
        if self._done.size < 2 * a.n or a.n + p.n > a.capacity or self._targs is None:
            if self._done.size < 2 * a.n:
                self._done = np.empty(2 * a.capacity, dtype=np.int64)
            a.reserve(a.n + p.n)
            book = (self._sentinel, self.ports.ranks, self._left, self._done, *self._node_levels)
            recs = tick_records(a, p, self._log.data, book, self.ports.cap_P, self._blocks)
            self._targs = tuple(plain(r) for r in recs) + (self._blocks._kernel_static,)
        # (a TickState, as a plain tuple: see _sargs)
        out = tick_blocks(t, (a.n, self._dead, p.n, self._pend_min), *self._targs)
        a.n, self._dead, p.n, self._pend_min = out.n, out.dead, out.pn, out.pend_min
        if out.steps < 0:  # pragma: no cover - the run's ports carry unfrozen transfers
            raise RuntimeError("progressive filling made no progress")
        if out.groups:   # the groups' keys, ascending and unique
            self._succeed_groups(self._done[out.completed:out.completed + out.groups])
        self.fill_iterations += out.steps
        self._last_fill = t
        if out.fin_max > -np.inf:
            self._horizon = max(self._horizon, out.fin_max)
        return out.next_finish

    def _tick_paths(self, t: float) -> float:
        """The per-flow solver's tick, in numpy: (1) the active flows due by now complete (a flow's
        finish time is exact at its current rate), (2) the waiting flows ready by now start, in
        submission order, (3) :func:`waterfill` rates them and ``tick_kernels.set_rates`` re-times
        those whose rate changed. Returns the earliest finish time."""
        a = self._a
        if a.n:
            sel = np.flatnonzero(a.fin <= t + 2e-9 * max(t, 1.0))
            if sel.size:
                self._complete(sel, self._bneck_paths[sel], t)
        cols = self._start_ready(t)
        if cols is not None:
            a.append(**cols)
        live = np.flatnonzero(a.alive)
        r_live, b_live, it = waterfill(a.path[live], self.ports.cap_P, self.tol)
        rate = np.zeros(a.n)
        rate[live] = r_live
        self._bneck_paths = np.full(a.n, -1, dtype=np.int64)
        self._bneck_paths[live] = b_live
        self.fill_iterations += it
        self._last_fill = t
        d = a.data
        fin_max, nxt = set_rates(rate, a.n, d["rate"], d["rem0"], d["t0"], d["fin"], t)
        if fin_max > -np.inf:
            self._horizon = max(self._horizon, fin_max)
        return nxt

    def _start_ready(self, t: float) -> dict[str, np.ndarray] | None:
        """The waiting flows ready by t, taken in submission order (their log rows marked ready at
        t), as the active columns they start with (and their paths, for the per-flow solver); None
        when none is."""
        if self._pend_min > t + 1e-9:
            return None
        p = self._pend
        add = p.take(p.ready <= t + 1e-9)
        self._pend_min = float(p.ready.min()) if p.n else np.inf
        m = add["id"].size
        if not m:
            return None
        self._log.ready[add["id"]] = t
        del add["ready"]
        add["rem0"] = add.pop("eff")
        return dict(add, rate=np.zeros(m), t0=np.full(m, t), fin=np.full(m, np.inf), alive=np.ones(m, dtype=bool))

    def _complete(self, sel: np.ndarray, bneck: np.ndarray, t: float) -> None:
        """Complete the active slots ``sel`` at t (``bneck``: their bottleneck ports): their log
        rows, their receive groups, and the slots dead (rate 0, never changing); the dead slots are
        dropped in bulk once they are more than half."""
        a = self._a
        ids, key = a.id[sel], a.key[sel]
        self._log.end[ids] = t
        self._log.bneck[ids] = bneck
        left = self._left
        np.subtract.at(left, key, 1)
        full = key[left[key] == 0]
        if full.size:
            self._succeed_groups(np.unique(full))
        a.alive[sel] = False
        a.fin[sel] = np.inf
        a.rem0[sel] = np.inf
        a.rate[sel] = 0.0
        self._dead += sel.size
        if 2 * self._dead > a.n:
            a.keep(a.alive.copy())
            self._dead = 0

    def _succeed_groups(self, keys: np.ndarray) -> None:
        """Fire the receive groups of ``keys`` (phase id x R + dst; ascending and unique), in that order."""
        R, evs = self.ports.ranks, self._group_events
        for k in keys.tolist():
            p, d = divmod(k, R)
            evs[p][d].succeed()

    # -- results ---------------------------------------------------------------------------
    def records(self) -> dict[str, np.ndarray]:
        """Per finished flow: src, dst, phase id, bytes, start (submit), ready, end, bottleneck port."""
        return self._log.records()

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
        if self.ports.mesh:    # the direct link of a transfer inside a node, as in paths()
            over = block_kind(blk) == Block.NVLINK
            out += np.bincount(self.ports.mesh_base + src[over] * R + dst[over], weights=b[over], minlength=P1)
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



__all__ = ["FlowNetwork", "PortMap", "UtilSample", "waterfill"]
