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
that phase: a serial per-message cost, 0 on the GPU presets), then transmits; concurrent flows get the max-min fair
allocation (progressive filling: all unfrozen flows grow together until a port saturates; flows
through it freeze), computed vectorised over all active flows at once with numpy.

Events and coalescing
---------------------
Rates are recomputed only at *ticks*: when a flow finishes or becomes ready. Everything that
happens at one simulated instant is handled by one tick (all flows submitted together are batched
into one recomputation). With tolerance ``tol > 0`` ticks are additionally kept at least
``tol * now`` apart: a flow that finishes between ticks is completed at the next tick (its
receiver learns of it up to ``tol * now`` late and its capacity idles meanwhile), a flow that
becomes ready between ticks starts at the next tick, and ports whose fair shares lie within
``tol`` of the bottleneck's freeze together. Every approximation only delays: results are never
faster than the exact model (``tol = 0``) and are slower by at most a few ``tol`` relative (tested),
while the number of rate recomputations drops from O(F) to O(log(t_end) / tol).
Stale completion events are invalidated by a version counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from moonep_sim.sim.topology import Topology

L_PATH = 9
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

    def paths(self, src_F: np.ndarray, dst_F: np.ndarray, sm_F: np.ndarray | None = None,
              nic_F: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(path_FL int64 [F, L_PATH], latency_F float64 [F]) of transfers ``src -> dst`` (vectorised).

        Columns: the first port, the spine up/down (only when it can bind), the last port, then the
        pair port (half duplex), the node links (``nic.attach = "node"``) and the SM send / receive
        ports (of flows with ``sm_F`` True, when the map has SM ports) where they exist. Flows with
        ``nic_F`` True take the NIC path between ranks of one node too (pure-RDMA kernels)."""
        R, G = self.ranks, self.gpus_per_node
        F = src_F.size
        lat = np.zeros(F)
        same = src_F == dst_F
        same_node = (src_F // G == dst_F // G) & ~same
        if nic_F is not None:
            same_node &= ~np.asarray(nic_F, dtype=bool)
        rail_s, rail_d = src_F % G, dst_F % G
        inter = ~same & ~same_node
        cross = inter & (rail_s != rail_d)
        cols: list[np.ndarray] = []
        c0 = np.full(F, self.dummy, dtype=np.int64)
        c1 = np.full(F, self.dummy, dtype=np.int64)
        c0[same] = 4 * R + src_F[same]
        c0[same_node] = src_F[same_node]
        c1[same_node] = R + dst_F[same_node]
        lat[same_node] = self.lat_nvlink_us
        c0[inter] = 2 * R + src_F[inter]
        lat[inter] = self.lat_nic_us
        lat[cross] = self.lat_spine_us
        cols.append(c0)
        if self.spine_binds:
            up = np.full(F, self.dummy, dtype=np.int64)
            down = np.full(F, self.dummy, dtype=np.int64)
            up[cross] = 5 * R + rail_s[cross]
            down[cross] = 5 * R + self.rails + rail_d[cross]
            cols += [up, down]
        c1[inter] = 3 * R + dst_F[inter]
        cols.append(c1)
        if self.pairs:
            pc = np.full(F, self.dummy, dtype=np.int64)
            other = ~same
            lo, hi = np.minimum(src_F, dst_F), np.maximum(src_F, dst_F)
            pc[other] = self.pair_base + lo[other] * R + hi[other]
            cols.append(pc)
        if self.node_links:
            no = np.full(F, self.dummy, dtype=np.int64)
            ni = np.full(F, self.dummy, dtype=np.int64)
            no[inter] = self.node_base + src_F[inter] // G
            ni[inter] = self.node_base + self.nodes + dst_F[inter] // G
            cols += [no, ni]
        if self.sm_ports and sm_F is not None and np.any(sm_F):
            ss = np.full(F, self.dummy, dtype=np.int64)
            sr = np.full(F, self.dummy, dtype=np.int64)
            m = np.asarray(sm_F, dtype=bool)
            ss[m] = self.sm_base + src_F[m]
            sr[m] = self.sm_base + R + dst_F[m]
            cols += [ss, sr]
        path = np.full((F, L_PATH), self.dummy, dtype=np.int64)
        path[:, :len(cols)] = np.stack(cols, axis=1)
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


class FlowNetwork:
    """Transfers of a simulation, on a simpy Environment (see the module docstring).

    Usage: ``expect(phase, count_R)`` once per phase instance (how many flows each rank will
    receive), then ranks call ``submit(phase, src, dst_F, bytes_F, eff_bytes_F)`` when they send,
    and wait on ``received(phase, dst)``. Records one row per finished flow for reports.
    """

    def __init__(self, env: simpy.Environment, ports: PortMap, tol: float = 0.0, record_util: bool = False):
        self.env = env
        self.ports = ports
        self.tol = float(tol)
        self.record_util = record_util
        self._group_left: list[np.ndarray] = []
        self._group_events: list[list[simpy.Event]] = []
        self._phase_names: list[str] = []
        self._phase_tags: list[Any] = []  # per phase id: the caller's tag (the timeline's PhaseTag)
        self._phase_sm: list[bool] = []   # per phase id: its flows cross the SM send / receive ports
        self._phase_nic: list[bool] = []  # per phase id: same-node flows take the NIC path
        # active flows
        self._a_path = np.zeros((0, L_PATH), dtype=np.int64)
        self._a_rem = np.zeros(0)
        self._a_rate = np.zeros(0)
        self._a_bneck = np.zeros(0, dtype=np.int64)
        self._a_id = np.zeros(0, dtype=np.int64)
        self._a_key = np.zeros(0, dtype=np.int64)  # receive group: phase id * R + dst
        # pending (submitted, waiting for latency): lists of arrays
        self._pend: list[tuple[np.ndarray, ...]] = []  # (ready, path, eff, id, key)
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
        self._t_u = 0.0
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
        left = np.asarray(count_R, dtype=np.int64).copy()
        evs = [self.env.event() for _ in range(left.size)]
        for d in np.flatnonzero(left == 0):
            evs[d].succeed()
        self._group_left.append(left)
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
        path, lat = self.ports.paths(src_F, dst, np.full(dst.size, self._phase_sm[pid]) if self.ports.sm_ports else None,
                                     np.full(dst.size, True) if self._phase_nic[pid] else None)
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
                           pid * self.ports.ranks + dst))
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

    def _tick(self, version: int) -> None:
        if version != self._version:
            return  # stale: superseded by a later rate change
        self._next_tick = np.inf
        t = float(self.env.now)
        self.ticks += 1
        self._grow()
        # 1. advance
        dt = t - self._t_u
        if dt > 0 and self._a_rem.size:
            self._a_rem -= self._a_rate * dt
        self._t_u = t
        # 2. completions
        if self._a_rem.size:
            done = self._a_rem <= _DONE_REL * (self._a_rate + 1.0) * max(t, 1.0)
            if done.any():
                self._complete(self._a_id[done], self._a_bneck[done], self._a_key[done], t)
                keep = ~done
                self._a_path, self._a_rem = self._a_path[keep], self._a_rem[keep]
                self._a_rate, self._a_bneck, self._a_id = self._a_rate[keep], self._a_bneck[keep], self._a_id[keep]
                self._a_key = self._a_key[keep]
        # 3. activations
        if self._pend:
            still = []
            add: list[tuple[np.ndarray, ...]] = []
            for item in self._pend:
                ok = item[0] <= t + 1e-9
                if ok.all():
                    add.append(item)
                elif ok.any():
                    add.append(tuple(a[ok] for a in item))
                    still.append(tuple(a[~ok] for a in item))
                else:
                    still.append(item)
            self._pend = still
            if add:
                ids = np.concatenate([a[3] for a in add])
                self._ready[ids] = t
                self._a_path = np.concatenate([self._a_path] + [a[1] for a in add])
                self._a_rem = np.concatenate([self._a_rem] + [a[2] for a in add])
                self._a_id = np.concatenate([self._a_id, ids])
                self._a_key = np.concatenate([self._a_key] + [a[4] for a in add])
                self._a_rate = np.concatenate([self._a_rate, np.zeros(ids.size)])
                self._a_bneck = np.concatenate([self._a_bneck, np.full(ids.size, -1, dtype=np.int64)])
        # 4. rates
        rate, bneck, it = waterfill(self._a_path, self.ports.cap_P, self.tol)
        self._a_rate, self._a_bneck = rate, bneck
        self.fill_iterations += it
        self._last_fill = t
        if self.record_util:
            use = np.bincount(self._a_path.ravel(), weights=np.repeat(rate, L_PATH),
                              minlength=self.ports.cap_P.size)[:-1]
            self.util_samples.append((t, use / self.ports.cap_P[:-1]))
        # 5. next tick
        nxt = np.inf
        if self._a_rem.size:
            left = self._a_rem / rate
            nxt = t + float(left.min())
            self._horizon = max(self._horizon, t + float(left.max()))
        if self._pend:
            nxt = min(nxt, min(float(item[0].min()) for item in self._pend))
        if np.isfinite(nxt):
            self._request_tick(nxt)

    def _complete(self, ids: np.ndarray, bneck: np.ndarray, key: np.ndarray, t: float) -> None:
        self._end[ids] = t
        self._bneck[ids] = bneck
        uk, cnt = np.unique(key, return_counts=True)
        R = self.ports.ranks
        for k, c in zip(uk.tolist(), cnt.tolist()):
            p, d = divmod(k, R)
            left = self._group_left[p]
            left[d] -= c
            if left[d] == 0:
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

    def port_bytes(self) -> np.ndarray:
        """float64 [P]: bytes that crossed each port."""
        rec = self.records()
        if rec["src"].size == 0:
            return np.zeros(self.ports.num_ports)
        path = self.ports.route(rec["src"], rec["dst"], self.flow_sm(rec), self.flow_nic(rec))
        return np.bincount(path.ravel(), weights=np.repeat(rec["bytes"], L_PATH),
                           minlength=self.ports.cap_P.size)[:-1]

    def flow_sm(self, rec: dict[str, np.ndarray]) -> np.ndarray | None:
        """bool [F]: which recorded flows crossed SM ports (None when the port map has none)."""
        if not self.ports.sm_ports:
            return None
        return np.asarray(self._phase_sm, dtype=bool)[rec["phase"]] if rec["phase"].size else np.zeros(0, bool)

    def flow_nic(self, rec: dict[str, np.ndarray]) -> np.ndarray | None:
        """bool [F]: which recorded flows took the NIC path inside a node (None when none did)."""
        if not any(self._phase_nic):
            return None
        return np.asarray(self._phase_nic, dtype=bool)[rec["phase"]] if rec["phase"].size else np.zeros(0, bool)

    @property
    def idle(self) -> bool:
        return self._a_rem.size == 0 and not self._pend


__all__ = ["FlowNetwork", "PortMap", "waterfill"]
