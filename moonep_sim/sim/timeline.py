"""Layer and step timelines: any Plan timed on a topology, with the real executor's dependencies.

Notation: R ranks, H hops, c chunks. Times in microseconds of simulated time.

The simulator reads only the Plan's data: ``plan.phases(direction)`` (per-phase [R, R] bytes with
a kind), its slots (rows per expert per rank, padding included) and the copies. It never looks at
the strategy's name. Per direction the phases are grouped by kind:

- ``dispatch`` kind (forward ``dispatch.h``; backward ``combine_bwd.h``): the hops before expert
  compute, in order;
- ``prefetch`` / ``migrate``: expert weights that must arrive before compute;
- ``combine`` kind (forward ``combine.h``; backward ``dispatch_bwd.h``): the hops after compute,
  in the order listed (reversed hops);
- ``grad_reduce``: the copies' weight gradients, sent home after the backward compute.

Dependencies per rank r (as the real executor runs them):
planning (forward only: a fixed cost, the Plan's ``host_plan_us``, plus an all-gather of the per-expert counts) -> r sends its
hop-0 rows; r sends hop h+1 rows once it has received all its hop-h rows -> weights: sent by the
home at planning end (``overlap_prefetch``) or once the home has received its last dispatch hop ->
expert compute on r once its last-hop rows and its copies' weights arrived -> r sends its first
combine hop when its compute ends; later combine hops once it received the previous one. With
``chunks = c`` every dispatch and combine phase is split in c equal parts: rank r sends chunk j+1
of a hop once it received chunk j of it, computes chunk j once chunk j arrived, and combines chunk
j after computing it (a pipeline). ``backward`` runs the backward direction after the forward on
each rank (a training step). :func:`simulate_layers` chains several layers on each rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import simpy

from moonep_sim.errors import ConfigError, require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import CommPhase, Plan
from moonep_sim.sim.compute import rank_compute_us
from moonep_sim.sim.cpu import HostCPU
from moonep_sim.sim.faults import FaultState, lognormal_factors
from moonep_sim.sim.lower_bound import lower_bound
from moonep_sim.sim.network import FlowNetwork, PortMap
from moonep_sim.sim.topology import Topology

DEFAULT_TOL = 0.002


@dataclass(frozen=True)
class SimOptions:
    """How to simulate.

    backward: also run the backward direction after the forward (a training step).
    overlap_prefetch: send copied weights at planning end, concurrently with dispatch (else after
        the home received its dispatch rows).
    chunks: pipeline dispatch, compute and combine in this many chunks (1 = no pipelining).
    seed: seeds the jitter draws.  jitter: coefficient of variation of the lognormal (mean 1)
        factor stretching every compute and transfer (0 = none).
    faults: SlowGPU / DegradedLink / Stall objects (``moonep_sim.sim.faults``).
    tol: network coalescing tolerance (``moonep_sim.sim.network``): 0 = exact flow-level model;
        the default 0.002 is at most ~1.5% slower than exact (tested: <= 6 x tol) and much faster at large R.
    isolate: ``"dispatch"`` or ``"combine"``: time only those phases, all ranks starting at 0,
        no planning and no compute (how DeepEP times a kernel alone).
    timeline: record per-rank spans and port utilisation counters for a Perfetto trace.
    planning: include the planning cost in the forward.
    """

    backward: bool = False
    overlap_prefetch: bool = True
    chunks: int = 1
    seed: int = 0
    faults: tuple = ()
    jitter: float = 0.0
    tol: float = DEFAULT_TOL
    isolate: str | None = None
    timeline: bool = False
    planning: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults or ()))
        require(self.chunks >= 1, f"chunks ({self.chunks}) must be >= 1")
        require(self.jitter >= 0, f"jitter ({self.jitter}) must be >= 0 (a coefficient of variation)")
        require(0 <= self.tol < 0.2, f"tol ({self.tol}) must lie in [0, 0.2)")
        require(self.isolate in (None, "dispatch", "combine"),
                f"isolate ({self.isolate!r}) must be None, 'dispatch' or 'combine'")


@dataclass
class SimResult:
    """One simulation's outcome (see :meth:`to_dict` for the JSON form).

    layer_time_us: from 0 to the last rank's end (all layers and directions simulated).
    phases_us: phase name -> span (first start to last end, over ranks and chunks) in us.
    lower_bound_us / ratio_to_lower_bound: DESIGN section 6 (``moonep_sim.sim.lower_bound``);
        0 / 0 in ``isolate`` mode.
    straggler: {rank, cause, detail}.  busiest_port: {name, bytes, utilisation, busy_us}.
    per_rank: lists over ranks (end_us, compute_us, recv_rows ...).  layers_us: per layer span.
    timeline_events: Trace Event Format events (``moonep_sim.sim.perfetto``), when recorded.
    """

    strategy: str
    topology: str
    ranks: int
    layer_time_us: float
    phases_us: dict[str, float]
    lower_bound_us: float
    ratio_to_lower_bound: float
    lower_bound: dict[str, Any]
    straggler: dict[str, Any]
    busiest_port: dict[str, Any]
    per_rank: dict[str, list]
    port_bytes: dict[str, float]
    flow_bytes: float
    layers_us: list[float]
    sim_stats: dict[str, Any]
    topology_constants: dict[str, Any]
    options: dict[str, Any]
    timeline_events: list[dict] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "strategy", "topology", "ranks", "layer_time_us", "phases_us", "lower_bound_us", "ratio_to_lower_bound",
            "lower_bound", "straggler", "busiest_port", "layers_us", "per_rank", "sim_stats", "options")}
        d["sim_wall_seconds"] = self.sim_stats.get("wall_seconds", 0.0)
        d["topology_constants"] = self.topology_constants
        return d


# ------------------------------------------------------------------------------------------
# The program of one direction of one layer, from the Plan's phases
# ------------------------------------------------------------------------------------------
@dataclass
class _Direction:
    direction: str
    pre: list[CommPhase]
    weights: list[CommPhase]
    post: list[CommPhase]
    after: list[CommPhase]
    compute_R: np.ndarray          # one chunk's compute work per rank (us of one core / GPU; faults applied)
    plan_cpu_us: float             # planning work (us of one core / GPU)
    plan_comm_us: float            # the planning all-gather (latency and bytes)
    pre_copy: list[np.ndarray] = field(default_factory=list)    # [hop] -> [R] us before sending (gather)
    post_copy: list[np.ndarray] = field(default_factory=list)   # [hop] -> [R] us after receiving
    post_pre_copy: list[np.ndarray] = field(default_factory=list)   # combine hops: before sending
    post_post_copy: list[np.ndarray] = field(default_factory=list)  # combine hops: after receiving
    w_pre_R: np.ndarray | None = None    # us: the home's pass over the expert weights it sends
    w_post_R: np.ndarray | None = None   # us: the receiver's pass over the weights it receives
    p2p_RR: np.ndarray | None = None     # [R, R] time scale of the point-to-point hop's flows (None: none)


def _copy_us(plan: Plan, topo: Topology, direction: str, pre: list[CommPhase],
             post: list[CommPhase]) -> tuple[list, list, list, list]:
    """Per hop and rank, the executor's local passes over rows (``host_copy_bandwidth_GBps``):
    a gather of the rows a rank sends before each hop and a pass over the rows it receives after
    it; the last dispatch hop's pass is the expand into the rank's final rows and the first
    combine hop's the weighted gather of them. Zero when the rate is 0 (GPU presets)."""
    rate = topo.copy_bytes_per_us
    R = plan.ranks
    if rate <= 0:
        z = [np.zeros(R) for _ in pre], [np.zeros(R) for _ in pre], [np.zeros(R) for _ in post], \
            [np.zeros(R) for _ in post]
        return z
    rows_R = plan.rows_R().astype(np.float64)
    fwd = direction == "forward"
    disp_row = plan.costs.dispatch_row_bytes if fwd else plan.costs.combine_row_bytes
    comb_row = plan.costs.combine_row_bytes
    k = 1.0 / rate
    d_pre = [p.bytes_RR.sum(axis=1) * k for p in pre]
    d_post = [p.bytes_RR.sum(axis=0) * k for p in pre]
    if d_post:
        d_post[-1] = rows_R * disp_row * k
    c_pre = [p.bytes_RR.sum(axis=1) * k for p in post]
    c_post = [p.bytes_RR.sum(axis=0) * k for p in post]
    if c_pre:
        c_pre[0] = rows_R * comb_row * k
    return d_pre, d_post, c_pre, c_post


def _direction(plan: Plan, model: ModelSpec, topo: Topology, direction: str, opts: SimOptions,
               fs: FaultState) -> _Direction:
    ph = plan.phases(direction)
    kinds = {"dispatch", "prefetch", "migrate", "combine", "grad_reduce"}
    for p in ph:
        require(p.kind in kinds, f"phase {p.name} kind ({p.kind!r}) must be one of {sorted(kinds)}", ConfigError)
    pre = [p for p in ph if p.kind == "dispatch"]
    weights = [p for p in ph if p.kind in ("prefetch", "migrate")]
    post = [p for p in ph if p.kind == "combine"]
    after = [p for p in ph if p.kind == "grad_reduce"]
    if opts.isolate == "dispatch":
        weights, post, after = [], [], []
    elif opts.isolate == "combine":
        pre, weights, after = [], [], []
    comp = rank_compute_us(plan, model, topo, backward=(direction == "backward"), chunks=opts.chunks,
                           speed_R=fs.gpu_speed_R)
    plan_cpu = plan_comm = 0.0
    if direction == "forward" and opts.planning and opts.isolate is None:
        R = plan.ranks
        counts_bytes = (R - 1) * plan.num_experts * 4.0  # everyone's int32 per-expert counts
        if topo.plan_routing_bytes_per_entry > 0:  # every token's routing, padded to the largest rank
            counts_bytes = (R - 1) * float(np.max(plan.tokens_per_rank_R)) * plan.top_k * \
                topo.plan_routing_bytes_per_entry
        G = min(topo.gpus_per_node, R)
        slow_bw, lat = (topo.nic_bytes_per_us, topo.nic_latency_us) if topo.num_nodes(R) > 1 else \
            (topo.nvlink_bytes_per_us, topo.nvlink_latency_us)
        steps = int(np.ceil(np.log2(R))) if R > 1 else 0
        plan_comm = steps * lat + (counts_bytes / slow_bw if R > 1 and G >= 1 else 0.0)
        plan_comm += topo.host_message_us * (R - 1)  # every rank's message to each other rank
        plan_cpu = topo.plan_fixed_us + float(plan.host_plan_us)  # a host-side planner's own work
        if topo.plan_measured_factor > 0:  # every rank plans the same global Plan (on the shared cores)
            plan_cpu += topo.plan_measured_factor * float(plan.plan_seconds) * 1e6
    d_pre, d_post, c_pre, c_post = _copy_us(plan, topo, direction, pre, post)
    w_pre = w_post = None
    w_rate = topo.host_weight_copy_bandwidth_GBps * 1e3 or topo.copy_bytes_per_us
    if w_rate > 0 and weights:  # weights too are gathered to send and placed on arrival
        k = 1.0 / w_rate
        w_pre = sum(p.bytes_RR.sum(axis=1) for p in weights) * k
        w_post = sum(p.bytes_RR.sum(axis=0) for p in weights) * k
    return _Direction(direction, pre, weights, post, after, comp, plan_cpu, plan_comm, d_pre, d_post, c_pre, c_post,
                      w_pre, w_post, _p2p_scale(plan, topo) if plan.hops else None)


def _p2p_scale(plan: Plan, topo: Topology) -> np.ndarray | None:
    """[R, R] factor on the transfer time of the last dispatch hop (and its adjoint, the first
    combine hop) when the gloo executor sends it point-to-point and the topology gives such
    inter-node transfers their own efficiency (``nic_p2p_efficiency``); None otherwise."""
    if topo.nic_p2p_efficiency <= 0 or topo.nic_p2p_efficiency == topo.nic_efficiency:
        return None
    from moonep_sim.plan.direct import last_hop_is_direct

    if not last_hop_is_direct(plan, int(plan.costs.dispatch_row_bytes)):
        return None
    node_R = np.arange(plan.ranks) // min(topo.gpus_per_node, plan.ranks)
    cross = node_R[:, None] != node_R[None, :]
    return np.where(cross, topo.nic_efficiency / topo.nic_p2p_efficiency, 1.0)


class _Sim:
    """One simpy run over a sequence of (plan, direction) stages chained per rank."""

    def __init__(self, plans: Sequence[Plan], topo: Topology, model: ModelSpec, opts: SimOptions):
        self.plans, self.topo, self.model, self.opts = plans, topo, model, opts
        R = plans[0].ranks
        for p in plans:
            require(p.ranks == R, f"plan ranks ({p.ranks}) must all equal the first plan's ({R})")
        self.R = R
        topo.num_nodes(R)
        self.fs = FaultState.build(opts.faults, R)
        self.env = simpy.Environment()
        self.ports = PortMap.build(topo, R, self.fs.nvlink_factor_R, self.fs.nic_factor_R)
        self.net = FlowNetwork(self.env, self.ports, opts.tol, record_util=opts.timeline)
        self.rng = np.random.default_rng(opts.seed)
        host_R = topo.host_R(R)  # CPU processes sharing a host's cores (None on GPU presets)
        self.host_R = host_R
        self.share_R = topo.cpu_share_R(R)  # "static" sharing's stretch
        self.cpus = None if host_R is None or topo.host_sharing != "processor" else \
            [HostCPU(self.env, topo.host_cores) for _ in range(int(host_R.max()) + 1)]
        self.spans: list[tuple[int, str, float, float]] = []   # (rank, name, start, end)
        self.stages: list[tuple[int, _Direction]] = []
        for li, p in enumerate(plans):
            self.stages.append((li, _direction(p, model, topo, "forward", opts, self.fs)))
        if opts.backward and opts.isolate is None:
            for li in reversed(range(len(plans))):
                self.stages.append((li, _direction(plans[li], model, topo, "backward", opts, self.fs)))
        self.compute_start = np.zeros((len(self.stages), R))
        self.compute_end = np.zeros((len(self.stages), R))
        self.compute_gate: list[list[str]] = [["" for _ in range(R)] for _ in self.stages]
        self.stage_end = np.zeros((len(self.stages), R))
        self.stage_start = np.zeros((len(self.stages), R))
        self._busy: np.ndarray | None = None
        self._done_ev: dict[tuple, Any] = {}

    # -- helpers -------------------------------------------------------------------------
    def _work(self, r: int, us: float) -> simpy.Event:
        """Rank r's local work of ``us`` microseconds (of one core / its GPU): a delay stretched by
        the rank's static CPU share (1 on GPU presets), or a job on its host's processor-shared cores."""
        if self.cpus is None:
            return self.env.timeout(us * float(self.share_R[r]))
        return self.cpus[int(self.host_R[r])].run(us)

    def _jit(self, shape) -> np.ndarray:
        return lognormal_factors(self.rng, self.opts.jitter, shape)

    def _register(self, prefix: str, phases: list[CommPhase], chunks: int, scales: Sequence | None = None):
        """[phase][chunk] -> (pid, bytes_RR, eff_RR); ``scales[i]``: an [R, R] factor on phase i's
        transfer times (or None)."""
        out = []
        for i, p in enumerate(phases):
            row = []
            b = p.bytes_RR.astype(np.float64) / chunks
            cnt = (b > 0).sum(axis=0)
            for j in range(chunks):
                name = p.name if chunks == 1 else f"{p.name}#{j}"
                pid = self.net.expect(prefix + name, cnt)
                eff = b * self._jit(b.shape) if self.opts.jitter > 0 else b
                if scales is not None and scales[i] is not None:
                    eff = eff * scales[i]
                row.append((pid, b, eff))
            out.append(row)
        return out

    def _send(self, item, r: int) -> None:
        pid, b, eff = item
        self.net.submit(pid, r, np.arange(self.R), b[r], eff[r])

    # -- the processes -------------------------------------------------------------------
    def build(self) -> None:
        env, R, c = self.env, self.R, self.opts.chunks
        start = [env.event().succeed() for _ in range(R)]
        for si, (li, d) in enumerate(self.stages):
            prefix = f"L{li}." if len(self.plans) > 1 else ""
            if d.direction == "backward":
                prefix += "bwd." if not prefix else ""
            pre = self._register(prefix, d.pre, c, [None] * (len(d.pre) - 1) + [d.p2p_RR])
            wts = [row[0] for row in self._register(prefix, d.weights, 1)]
            post = self._register(prefix, d.post, c, [d.p2p_RR] + [None] * (len(d.post) - 1))
            aft = [row[0] for row in self._register(prefix, d.after, 1)]
            comp_jit = self._jit((c, R)) if self.opts.jitter > 0 else np.ones((c, R))
            done = []
            for r in range(R):
                comp_done = [env.event() for _ in range(c)]
                fin = env.event()
                env.process(self._dispatcher(si, d, r, start[r], pre, wts, prefix))
                env.process(self._computer(si, d, r, start[r], pre, wts, aft, comp_done, comp_jit[:, r], prefix))
                env.process(self._combiner(si, d, r, start[r], post, aft, comp_done, fin, prefix))
                done.append(fin)
            start = done

    def _stall(self, r: int, phase: str, stage_index: int):
        us = self.fs.stall_us.get((r, phase), 0.0) if stage_index == 0 else 0.0
        return us

    def _dispatcher(self, si, d: _Direction, r, start_ev, pre, wts, prefix):
        env = self.env
        yield start_ev
        self.stage_start[si, r] = env.now
        if d.plan_cpu_us > 0 or d.plan_comm_us > 0:
            t0 = env.now
            yield self._work(r, d.plan_cpu_us)
            yield env.timeout(d.plan_comm_us)
            self.spans.append((r, prefix + "plan", t0, env.now))
        self._planned(si, r).succeed()
        st = self._stall(r, "dispatch", si)
        if st > 0:
            t0 = env.now
            yield env.timeout(st)
            self.spans.append((r, prefix + "stall", t0, env.now))
        if self.opts.overlap_prefetch:
            yield from self._weight_pass(d, r, prefix)
            for w in wts:
                self._send(w, r)
        if pre:
            done = self._done(si, "pre", r, len(pre))
            procs = [env.process(self._hop(r, pre, h, None, prefix, d.pre_copy[h][r], d.post_copy[h][r], done))
                     for h in range(len(pre))]
            yield env.all_of(procs)
        if not self.opts.overlap_prefetch:
            yield from self._weight_pass(d, r, prefix)
            for w in wts:
                self._send(w, r)

    def _weight_pass(self, d: _Direction, r: int, prefix: str):
        """The home's local pass over the weights it sends (``host_copy_bandwidth_GBps``)."""
        if d.w_pre_R is not None and d.w_pre_R[r] > 0:
            t0 = self.env.now
            yield self._work(r, float(d.w_pre_R[r]))
            self.spans.append((r, prefix + "copy", t0, self.env.now))

    def _planned(self, si: int, r: int) -> simpy.Event:
        """Fires once rank r finished planning stage si (at once when there is no planning)."""
        key = (si, "planned", r)
        if key not in self._done_ev:
            self._done_ev[key] = self.env.event()
        return self._done_ev[key]

    def _done(self, si: int, side: str, r: int, hops: int) -> list[list[simpy.Event]]:
        """Per (hop, chunk): fires once rank r received that chunk and made its local pass over it."""
        key = (si, side, r)
        if key not in self._done_ev:
            self._done_ev[key] = [[self.env.event() for _ in range(self.opts.chunks)] for _ in range(hops)]
        return self._done_ev[key]

    def _hop(self, r, rows, h, first_gate, prefix, pre_us=0.0, post_us=0.0, done=None):
        """Rank r's part of hop h, chunk by chunk: chunk j is sent once r received chunk j of the
        previous hop and made its local pass over it (or ``first_gate[j]`` fired, for the first
        hop) and chunk j-1 of this hop; ``pre_us`` / ``post_us`` (whole hop, split over chunks) are
        the local gather before sending and the pass over the received rows."""
        env = self.env
        c = self.opts.chunks
        for j in range(c):
            if h > 0:
                yield done[h - 1][j] if done is not None else self.net.received(rows[h - 1][j][0], r)
            elif first_gate is not None:
                yield first_gate[j]
            if pre_us > 0:
                t0 = env.now
                yield self._work(r, float(pre_us) / c)
                self.spans.append((r, prefix + "copy", t0, env.now))
            t0 = env.now
            self._send(rows[h][j], r)
            yield self.net.received(rows[h][j][0], r)
            self.spans.append((r, prefix + self.net.phase_name(rows[h][j][0])[len(prefix):], t0, env.now))
            if post_us > 0:
                t0 = env.now
                yield self._work(r, float(post_us) / c)
                self.spans.append((r, prefix + "copy", t0, env.now))
            if done is not None:
                done[h][j].succeed()

    def _computer(self, si, d: _Direction, r, start_ev, pre, wts, aft, comp_done, jit, prefix):
        env = self.env
        yield start_ev
        yield self._planned(si, r)
        for j in range(self.opts.chunks):
            gate = "start"
            if pre:
                yield self._done(si, "pre", r, len(pre))[-1][j]
                gate = "dispatch"
            if j == 0 and wts:
                t_before = env.now
                yield env.all_of([self.net.received(w[0], r) for w in wts])
                if d.w_post_R is not None and d.w_post_R[r] > 0:
                    t0 = env.now
                    yield self._work(r, float(d.w_post_R[r]))
                    self.spans.append((r, prefix + "copy", t0, env.now))
                if env.now > t_before:
                    gate = "weights"
            if j == 0:
                st = self._stall(r, "compute", si)
                if st > 0:
                    t0 = env.now
                    yield env.timeout(st)
                    self.spans.append((r, prefix + "stall", t0, env.now))
                    gate = "stall"
                self.compute_start[si, r] = env.now
                self.compute_gate[si][r] = gate
            t0 = env.now
            if self.opts.isolate is None:
                yield self._work(r, float(d.compute_R[r] * jit[j]))
                self.spans.append((r, prefix + ("expert_bwd" if d.direction == "backward" else "expert"), t0, env.now))
            comp_done[j].succeed()
        self.compute_end[si, r] = env.now
        for a in aft:
            self._send(a, r)

    def _combiner(self, si, d: _Direction, r, start_ev, post, aft, comp_done, fin, prefix):
        env = self.env
        yield start_ev
        gate = None if self.opts.isolate == "combine" else comp_done
        st = self._stall(r, "combine", si)
        if st > 0:
            yield comp_done[0] if gate is not None else env.timeout(0)
            t0 = env.now
            yield env.timeout(st)
            self.spans.append((r, prefix + "stall", t0, env.now))
        if post:
            done = self._done(si, "post", r, len(post))
            procs = [env.process(self._hop(r, post, h, gate, prefix, d.post_pre_copy[h][r], d.post_post_copy[h][r],
                                           done)) for h in range(len(post))]
            yield env.all_of(procs)
        if aft:
            yield env.all_of([self.net.received(a[0], r) for a in aft])
        yield comp_done[-1]
        self.stage_end[si, r] = env.now
        fin.succeed()


# ------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------
def _phase_spans(net: FlowNetwork, rec: dict[str, np.ndarray], spans) -> dict[str, float]:
    out: dict[str, tuple[float, float]] = {}

    def add(name, a, b):
        lo, hi = out.get(name, (np.inf, -np.inf))
        out[name] = (min(lo, a), max(hi, b))

    if rec["phase"].size:
        for pid in np.unique(rec["phase"]).tolist():
            m = rec["phase"] == pid
            base = net.phase_name(pid).split("#")[0]
            add(base, float(rec["start"][m].min()), float(rec["end"][m].max()))
    for _, name, a, b in spans:
        base = name.split("#")[0]
        if base.endswith(("plan", "expert", "expert_bwd", "stall", "copy")):
            add(base, a, b)
    return {k: float(b - a) for k, (a, b) in out.items()}


def _straggler(sim: _Sim, rec, end_R: np.ndarray) -> dict[str, Any]:
    """Name the rank and cause behind the end time (see docs/simulator.md, faults and stragglers)."""
    ports, fs = sim.ports, sim.fs
    si = 0
    plan = sim.plans[0]
    rows_R = plan.real_rows_R()
    recv_rows = np.zeros(sim.R)
    for h in plan.hops[-1:]:
        recv_rows = np.bincount(h.dst_rank_M, minlength=sim.R).astype(float)
    last_rank = int(np.argmax(end_R))
    if sim.opts.isolate is not None or rec["end"].size == 0:
        if rec["end"].size == 0:
            return dict(rank=last_rank, cause="none", detail="no transfers")
        f = int(np.nanargmax(rec["end"]))
        p = _critical_port(sim, rec, f)
        owner = _port_owner(sim, rec, p, f)
        return dict(rank=owner, cause=_port_cause(sim, p),
                    detail=f"last transfer {int(rec['src'][f])}->{int(rec['dst'][f])} limited by {ports.name(p)}")
    c_end, c_start = sim.compute_end[si], sim.compute_start[si]
    rc = int(np.argmax(c_end))
    dur = c_end[rc] - c_start[rc]
    t_disp = c_start[rc] - sim.stage_start[si, rc]
    t_tail = float(end_R.max()) - c_end[rc]
    gate = sim.compute_gate[si][rc]
    stall = sum(us for (r, _), us in fs.stall_us.items() if r == rc)
    mean_rows = max(float(rows_R.mean()), 1e-9)
    seg = max(("compute", dur), ("dispatch", t_disp), ("combine", t_tail), key=lambda x: x[1])[0]
    if stall > 0 and stall >= 0.25 * max(dur, t_disp, t_tail):
        return dict(rank=rc, cause="stall", detail=f"rank {rc} stalled {stall:.1f} us")
    if seg == "compute":
        sp = fs.gpu_speed_R[rc]
        det = (f"expert compute {dur:.1f} us on {int(rows_R[rc])} rows ({rows_R[rc] / mean_rows:.2f}x mean)"
               + (f", GPU at {sp:g}x speed" if sp != 1 else ""))
        return dict(rank=rc, cause="compute", detail=det)
    if seg == "dispatch" and gate == "weights":
        return dict(rank=rc, cause="weight prefetch", detail=f"rank {rc} waited for copied expert weights")
    names = [sim.net.phase_name(int(p)) for p in range(len(sim.net._phase_names))]
    want = "combine" if seg == "combine" else "dispatch"
    # the latest-ending flow of the segment's phases decides the port
    if seg == "combine":
        m = np.array([("combine" in names[p]) or ("grad_reduce" in names[p]) for p in rec["phase"]])
    else:
        m = np.array([("dispatch" in names[p] or "prefetch" in names[p]) for p in rec["phase"]]) & (rec["dst"] == rc)
    if not m.any():
        m = np.ones(rec["end"].size, dtype=bool)
    idx = np.flatnonzero(m)
    f = int(idx[np.nanargmax(rec["end"][idx])])
    p = _critical_port(sim, rec, f)
    cause = _port_cause(sim, p)
    owner = _port_owner(sim, rec, p, f)
    if cause == "tokens received":
        rr = recv_rows[owner] if seg == "dispatch" else rows_R[owner]
        det = (f"{want}: rank {owner} {'receives' if seg == 'dispatch' else 'returns'} {int(rr)} rows "
               f"({rr / max(float(recv_rows.mean() if seg == 'dispatch' else mean_rows), 1e-9):.2f}x mean); "
               f"port {ports.name(p)} is the bottleneck")
    else:
        det = f"{want}: port {ports.name(p)} at {ports.cap_P[p] / ports.nominal_cap_P[p]:.2g}x bandwidth limits the last transfer"
    return dict(rank=owner, cause=cause, detail=det)


def _port_owner(sim: _Sim, rec, p: int, f: int) -> int:
    """The rank a port belongs to: its own rank; for a node link's out port the flow's source (a
    rank of that node); for a pair, spine or node-in port the flow's destination."""
    if 0 <= p < 5 * sim.R:
        return int(p % sim.R)
    if sim.ports.node_links and sim.ports.node_base <= p < sim.ports.node_base + sim.ports.nodes:
        return int(rec["src"][f])
    return int(rec["dst"][f])


def _critical_port(sim: _Sim, rec, f: int) -> int:
    """The port on flow f's path that was busy longest over the run (bytes / its bandwidth): the
    resource that kept the flow's last bytes waiting (a degraded port's busy time grows with it)."""
    if sim._busy is None:
        sim._busy = sim.net.port_bytes() / sim.ports.cap_P[:-1]
    path = sim.ports.route(rec["src"][f:f + 1], rec["dst"][f:f + 1])[0]
    path = path[path < sim.ports.num_ports]
    phys = path[[sim.ports.physical(int(q)) for q in path]] if path.size else path
    path = phys if phys.size else path  # name a device's port, not a half-duplex pair
    if path.size == 0:
        return int(rec["bneck"][f])
    return int(path[np.argmax(sim._busy[path])])


def _port_cause(sim: _Sim, p: int) -> str:
    if p < 0:
        return "latency"
    deg = sim.ports.cap_P[p] < sim.ports.nominal_cap_P[p] * (1 - 1e-9)
    return "slow port" if deg else "tokens received"


def _result(sim: _Sim, wall: float) -> SimResult:
    net, ports, R = sim.net, sim.ports, sim.R
    rec = net.records()
    require(not np.isnan(rec["end"]).any(), "simulation ended with unfinished transfers (internal error)", ConfigError)
    end_R = sim.stage_end[-1].copy()
    t_end = float(max(end_R.max() if end_R.size else 0.0, rec["end"].max() if rec["end"].size else 0.0))
    pb = net.port_bytes()
    busy = pb / ports.cap_P[:-1]
    # rank, spine and node-link ports (the pair ports of half-duplex links are not a device's port)
    phys_busy = np.where([ports.physical(p) for p in range(busy.size)], busy, -np.inf) if busy.size else busy
    bp = int(np.argmax(phys_busy)) if pb.size else 0
    busiest = dict(name=ports.name(bp), bytes=float(pb[bp]), busy_us=float(busy[bp]),
                   utilisation=float(busy[bp] / t_end) if t_end > 0 else 0.0,
                   bandwidth_GBps=float(ports.cap_P[bp] / 1e3))
    plan0 = sim.plans[0]
    if sim.opts.isolate is None:
        lbs = [lower_bound(p, sim.model, sim.topo, backward=sim.opts.backward) for p in sim.plans]
        lb_us = float(sum(x.lower_bound_us for x in lbs))
        lb = lbs[0].to_dict() if len(lbs) == 1 else dict(lower_bound_us=lb_us, layers=[x.to_dict() for x in lbs])
    else:
        lb_us, lb = 0.0, {}
    phases = _phase_spans(net, rec, sim.spans)
    layers_us = []
    for li in range(len(sim.plans)):
        idx = [si for si, (l, _) in enumerate(sim.stages) if l == li]
        layers_us.append(float(sim.stage_end[idx].max() - sim.stage_start[idx].min()))
    top = np.argsort(-busy)[:8]
    per_rank = dict(end_us=end_R.tolist(),
                    compute_us=(sim.compute_end[0] - sim.compute_start[0]).tolist(),
                    compute_start_us=sim.compute_start[0].tolist(),
                    rows=plan0.real_rows_R().tolist(), padded_rows=plan0.rows_R().tolist())
    stats = dict(wall_seconds=wall, flows=int(rec["src"].size), ticks=net.ticks, fill_iterations=net.fill_iterations,
                 tol=sim.opts.tol)
    opts = {k: (v if k != "faults" else [repr(f) for f in v]) for k, v in sim.opts.__dict__.items()}
    res = SimResult(
        strategy=plan0.strategy, topology=sim.topo.name, ranks=R, layer_time_us=t_end, phases_us=phases,
        lower_bound_us=lb_us, ratio_to_lower_bound=(t_end / lb_us if lb_us > 0 else 0.0), lower_bound=lb,
        straggler=_straggler(sim, rec, end_R), busiest_port=busiest, per_rank=per_rank,
        port_bytes={ports.name(int(p)): float(pb[p]) for p in top if pb[p] > 0},
        flow_bytes=float(rec["bytes"].sum()), layers_us=layers_us, sim_stats=stats,
        topology_constants=sim.topo.constants(), options=opts)
    if sim.opts.timeline:
        from moonep_sim.sim.perfetto import trace_events
        res.timeline_events = trace_events(sim.spans, net, rec, R)
    return res


def simulate_layers(plans: Sequence[Plan], topo: Topology, model: ModelSpec, opts: SimOptions | None = None) -> SimResult:
    """Time several layers back to back (a step): each rank starts layer l+1 when it finished
    layer l; with ``opts.backward`` the backward runs after the last forward, layers reversed."""
    opts = opts or SimOptions()
    require(len(plans) >= 1, "plans must hold at least one layer")
    t0 = time.perf_counter()
    sim = _Sim(list(plans), topo, model, opts)
    sim.build()
    sim.env.run()
    res = _result(sim, 0.0)
    res.sim_stats["wall_seconds"] = time.perf_counter() - t0
    return res


def simulate_layer(plan: Plan, topo: Topology, model: ModelSpec, opts: SimOptions | None = None) -> SimResult:
    """Time one layer of ``plan`` on ``topo`` (see the module docstring for the dependencies)."""
    return simulate_layers([plan], topo, model, opts)


__all__ = ["DEFAULT_TOL", "SimOptions", "SimResult", "simulate_layer", "simulate_layers"]
