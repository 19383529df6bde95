"""The simpy processes that run a step: per rank a dispatcher, a computer and a combiner per stage.

Notation: R ranks, c chunks. Times in microseconds of simulated time.

A *stage* is one direction of one layer (a :class:`~moonep_sim.sim.program.StageProgram`); stages
are chained per rank (rank r starts stage s+1 once it finished stage s). Dependencies per rank r
(as the real executor runs them): planning (forward only) -> r sends its hop-0 rows; r sends hop
h+1 rows once it has received all its hop-h rows -> weights: sent by the home at planning end
(``overlap_prefetch``) or once the home has received its last dispatch hop -> expert compute on r
once its last-hop rows and its copies' weights arrived (a relay forwards a stage-1 copy once its
own stage-0 copy arrived; in backward it sends its reduced gradient home once its stage-1
receivers' gradients arrived) -> r sends its first combine hop when its
compute ends; later combine hops once it received the previous one -> the copies' gradients are
sent home after the backward compute. GPU kernel terms (``moonep_sim.sim.kernels``): a rank pays
a kernel's fixed cost before it sends each hop (once per direction for a relayed Plan); in a
relayed Plan a relay sends hop h+1 once the first message of hop h reached it (not once all of
it did), and a receiver holds hop h+1 only once every relay feeding it received its hop-h rows
and forwarded the last message. With ``chunks = c`` every dispatch and combine phase is split
in c equal parts: rank r sends chunk j+1 of a hop once it received chunk j of it, computes chunk j
once chunk j arrived, and combines chunk j after computing it (a pipeline).

Every network phase is registered with a :class:`PhaseTag` (kind, direction, scope, layer), so
each flow record names its phase's kind; every local span is a typed :class:`Span`.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Sequence

import numpy as np
import simpy

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import CommPhase, Plan
from moonep_sim.plan.kinds import Direction, PhaseKind, Scope
from moonep_sim.sim.cpu import HostCPU
from moonep_sim.sim.faults import FaultState, StallKey, lognormal_factors
from moonep_sim.sim.kernels import sm_cap_bytes_per_us
from moonep_sim.sim.network import FlowNetwork, PortMap
from moonep_sim.sim.options import SimOptions
from moonep_sim.sim.program import StageProgram, stage_program
from moonep_sim.sim.topology import Topology


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused inside, restored as it was on leaving. A
    simulation allocates per step an event, its callback list and a generator frame that it holds
    to its end, so the collections those allocations trigger find nothing to free (a V3 EP32
    decode step spent ~0.1 of its 0.5-0.6 CPU s outside the network's ticks in them). The run's
    own cycles are freed at the next collection after it. Nests, and is safe beside another
    thread doing the same (whoever found it enabled enables it again)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class PhaseTag:
    """What a registered network phase is: the Plan phase's kind, direction and scope, the layer
    (index into the simulated plans) and the Plan's phase name (e.g. ``combine_bwd.0``)."""

    kind: PhaseKind
    direction: Direction
    scope: Scope
    layer: int
    name: str


class PhaseRows(NamedTuple):
    """One registered phase instance (a phase, or one chunk of it): its network phase id, the
    bytes every rank sends every rank ([R, R], this chunk's share), the bytes each transfer is
    timed for (jitter and scale applied) and ``sends_R`` ([R] bool as a list): whether a rank
    sends anything in it (a rank that sends nothing submits nothing)."""

    pid: int
    bytes_RR: np.ndarray
    eff_RR: np.ndarray
    sends_R: list


class Side(str, Enum):
    """The hops of a stage before expert compute (PRE: dispatch) or after it (POST: combine)."""

    PRE = "pre"
    POST = "post"


class Gate(str, Enum):
    """What a rank's expert compute waited for last (``StepSim.compute_gate``): nothing (START),
    its dispatched rows (DISPATCH), its copies' weights (WEIGHTS) or an injected stall (STALL)."""

    START = "start"
    DISPATCH = "dispatch"
    WEIGHTS = "weights"
    STALL = "stall"


class Stage(NamedTuple):
    """One simulated stage: the layer (index into the simulated plans) and its program."""

    layer: int
    program: StageProgram


@dataclass
class FirstMessage:
    """When a rank holds the first message of a relayed hop chunk: the event that fires then, and
    the earliest time any of its senders announced (``inf`` until one did)."""

    event: simpy.Event
    t_us: float = field(default=float("inf"))


class KernelTerms(NamedTuple):
    """The GPU kernel terms of one side of a stage, for :meth:`StepSim._hop`: the stage index, the
    side, its program, ``relay`` (per hop the [R, R] forward delay as nested lists of floats, read
    per message announced; or None: not relayed) and the fixed cost (us) paid before a hop's first
    chunk."""

    stage: int
    side: Side
    program: StageProgram
    relay: list | None
    fixed_us: float


class Span(NamedTuple):
    """A rank's span of local work or of one hop (from sending to having received), in us."""

    rank: int
    name: str
    kind: PhaseKind
    direction: Direction
    start_us: float
    end_us: float


class AllOrAny(simpy.Event):
    """Fires once all of ``events`` fired (``need_all``; simpy's ``AllOf``) or once one of them did
    (simpy's ``AnyOf``), failing as soon as one fails: simpy's ``Condition`` without the
    ``ConditionValue`` it builds when it fires (the engine never reads it). The event is scheduled
    at the same moment a Condition's is, so runs are unchanged; created, fired by two events and
    processed it takes 3.4 us against 4.3 for simpy's (there is one per rank and hop side, and
    per relayed hop chunk)."""

    def __init__(self, env: simpy.Environment, events: Sequence[simpy.Event], need_all: bool):
        super().__init__(env)
        self._left = len(events) if need_all else 1
        if not events:
            self.succeed()
            return
        for ev in events:
            if ev.callbacks is None:   # processed already: counted now
                self._check(ev)
            else:
                ev.callbacks.append(self._check)

    def _check(self, ev: simpy.Event) -> None:
        # (simpy's public Event API only: triggered, ok, defused, value)
        if self.triggered:
            return
        if not ev.ok:
            ev.defused = True
            self.fail(ev.value)
        else:
            self._left -= 1
            if self._left == 0:
                self.succeed()


class StepSim:
    """One simpy run over a sequence of (plan, direction) stages chained per rank.

    ``stages``: the :class:`Stage` records in run order. After ``build()`` and ``run()`` (or
    ``env.run()``):
    ``spans`` (typed :class:`Span` records of local work and hops), ``compute_start`` /
    ``compute_end`` / ``stage_start`` / ``stage_end`` ([stage, R] us), ``compute_gate``
    ([stage][R] :class:`Gate`: what compute waited for last) and the network's flow records, each
    flow's phase carrying a :class:`PhaseTag`.
    """

    def __init__(self, plans: Sequence[Plan], topo: Topology, model: ModelSpec, opts: SimOptions):
        self.plans, self.topo, self.model, self.opts = plans, topo, model, opts
        R = plans[0].ranks
        for p in plans:
            require(p.ranks == R, f"plan ranks ({p.ranks}) must all equal the first plan's ({R})")
        self.R = R
        topo.num_nodes(R)
        self.fs = FaultState.build(opts.faults, R)
        self.env = simpy.Environment()
        self.ports = PortMap.build(topo, R, self.fs.nvlink_factor_R, self.fs.nic_factor_R,
                                   sm_cap_bytes_per_us(topo, plans[0].kernel))
        self.net = FlowNetwork(self.env, self.ports, opts.tol, record_util=opts.timeline, perf=opts.perf)
        self.rng = np.random.default_rng(opts.seed)
        host_R = topo.host_R(R)  # CPU processes sharing a host's cores (None on GPU presets)
        self.host_R = host_R
        self.share_R = topo.cpu_share_R(R)  # "static" sharing's stretch
        self._share_l = [float(x) for x in self.share_R]   # (as Python floats: read per local span)
        self._dst_R = np.arange(R)   # every rank a submission sends to (zero-byte entries skipped)
        self._nz: dict[tuple[int, bool], list[list[int]]] = {}   # (pid, by column) -> ranks with bytes
        self.cpus = None if host_R is None or topo.host_sharing != "processor" else \
            [HostCPU(self.env, topo.host_cores) for _ in range(int(host_R.max()) + 1)]
        self.spans: list[Span] = []
        self.stages: list[Stage] = []
        backward = opts.backward and opts.isolate is None
        # each hop's rows per (src, dst), counted once for both directions (a pass over its messages)
        hop_rows = [[h.rows_RR(R) for h in p.hops] if backward else None for p in plans]
        for li, p in enumerate(plans):
            self.stages.append(Stage(li, stage_program(p, model, topo, Direction.FORWARD, opts, self.fs, hop_rows[li])))
        if backward:
            for li in reversed(range(len(plans))):
                self.stages.append(Stage(li, stage_program(plans[li], model, topo, Direction.BACKWARD, opts, self.fs,
                                                           hop_rows[li])))
        self.compute_start = np.zeros((len(self.stages), R))
        self.compute_end = np.zeros((len(self.stages), R))
        self.compute_gate: list[list[Gate]] = [[Gate.START for _ in range(R)] for _ in self.stages]
        self.stage_end = np.zeros((len(self.stages), R))
        self.stage_start = np.zeros((len(self.stages), R))
        self.busy_P: np.ndarray | None = None  # us each port was busy (set by the analysis)
        # [stage][rank]: fires once the rank finished planning the stage (at once when there is no planning)
        self._planned = [[self.env.event() for _ in range(R)] for _ in self.stages]
        # keyed by plain tuples (built per hop chunk): a side key (stage, side, rank) -- a rank's hops
        # on one side of a stage -- or a hop key (stage, side, hop, chunk, rank) -- one hop chunk of it
        self._done_ev: dict[tuple, list[list[simpy.Event]]] = {}   # side key -> [hop][chunk]
        self._done_t: dict[tuple, float] = {}    # hop key -> when the rank held that hop chunk
        self._first: dict[tuple, FirstMessage] = {}   # hop key -> its first message

    # -- helpers -------------------------------------------------------------------------
    def _work(self, r: int, us: float) -> simpy.Event:
        """Rank r's local work of ``us`` microseconds (of one core / its GPU): a delay stretched by
        the rank's static CPU share (1 on GPU presets), or a job on its host's processor-shared cores."""
        if self.cpus is None:
            return self.env.timeout(us * self._share_l[r])
        return self.cpus[int(self.host_R[r])].run(us)

    def _timed(self, r: int, ev: simpy.Event, name: str, kind: PhaseKind, direction: Direction):
        """Wait for ``ev`` (made now: rank r's local work or a delay) and record the span r spent in it."""
        t0 = self.env.now
        yield ev
        self.spans.append(Span(r, name, kind, direction, t0, self.env.now))

    def _jit(self, shape) -> np.ndarray:
        return lognormal_factors(self.rng, self.opts.jitter, shape)

    def _register(self, prefix: str, layer: int, phases: list[CommPhase], chunks: int,
                  scales: Sequence | None = None, sm: bool = False, nic_only: bool = False):
        """[phase][chunk] -> :class:`PhaseRows`; ``scales[i]``: an [R, R] factor on phase i's
        transfer times (or None). Each phase instance is registered with its :class:`PhaseTag`."""
        out = []
        for i, p in enumerate(phases):
            row = []
            b = p.bytes_RR.astype(np.float64) / chunks
            nz = b > 0
            cnt = nz.sum(axis=0)
            sends = nz.any(axis=1).tolist()
            for j in range(chunks):
                name = p.name if chunks == 1 else f"{p.name}#{j}"
                pid = self.net.expect(prefix + name, cnt, PhaseTag(p.kind, p.direction, p.scope, layer, p.name), sm=sm,
                                      nic_only=nic_only)
                eff = b * self._jit(b.shape) if self.opts.jitter > 0 else b
                if scales is not None and scales[i] is not None:
                    eff = eff * scales[i]
                row.append(PhaseRows(pid, b, eff, sends))
            out.append(row)
        return out

    def _send(self, item: PhaseRows, r: int) -> None:
        if not item.sends_R[r]:
            return  # nothing to send: the network would skip every entry
        self.net.submit(item.pid, r, self._dst_R, item.bytes_RR[r], item.eff_RR[r])

    def _nonzero(self, item: PhaseRows, column: bool) -> list[list[int]]:
        """Per rank, the ranks it sends bytes to in ``item`` (``column``: that send bytes to it),
        counted once per phase instance for every rank (relayed hops read them per chunk)."""
        key = (item.pid, column)
        out = self._nz.get(key)
        if out is None:
            nz = item.bytes_RR > 0
            a, b = np.nonzero(nz.T if column else nz)   # row-major: grouped by a, b ascending
            cut = np.searchsorted(a, np.arange(self.R + 1)).tolist()
            b_l = b.tolist()
            out = self._nz[key] = [b_l[cut[i]:cut[i + 1]] for i in range(self.R)]
        return out

    def run(self) -> None:
        """Run the built processes to the end (``env.run()``) with Python's cyclic garbage
        collector paused (:func:`collector_paused`)."""
        with collector_paused():
            self.env.run()

    # -- the processes -------------------------------------------------------------------
    def build(self) -> None:
        env, R, c = self.env, self.R, self.opts.chunks
        start = [env.event().succeed() for _ in range(R)]
        for si, (li, d) in enumerate(self.stages):
            prefix = f"L{li}." if len(self.plans) > 1 else ""
            if d.direction == Direction.BACKWARD:
                prefix += "bwd." if not prefix else ""
            pre = self._register(prefix, li, d.pre, c, d.pre_scale, sm=d.sm, nic_only=d.nic_only)
            wts = [row[0] for row in self._register(prefix, li, d.weights, 1, [d.w_scale_RR] * len(d.weights))]
            post = self._register(prefix, li, d.post, c, d.post_scale, sm=d.sm, nic_only=d.nic_only)
            aft = [row[0] for row in self._register(prefix, li, d.after, 1, [d.w_scale_RR] * len(d.after))]
            comp_jit = self._jit((c, R)) if self.opts.jitter > 0 else np.ones((c, R))
            kern_pre = KernelTerms(si, Side.PRE, d, _as_lists(d.relay_pre), d.fixed_pre_us)
            kern_post = KernelTerms(si, Side.POST, d, _as_lists(d.relay_post), d.fixed_post_us)
            done = []
            for r in range(R):
                comp_done = [env.event() for _ in range(c)]
                fin = env.event()
                env.process(self._dispatcher(si, d, r, start[r], pre, wts, prefix, kern_pre))
                env.process(self._computer(si, d, r, start[r], pre, wts, aft, comp_done, comp_jit[:, r], prefix))
                env.process(self._combiner(si, d, r, start[r], post, aft, comp_done, fin, prefix, kern_post))
                done.append(fin)
            start = done

    def _stall(self, r: int, phase: str, stage_index: int) -> float:
        """us rank r stalls before ``phase`` (injected stalls apply to the first stage only)."""
        return self.fs.stall_us.get(StallKey(r, phase), 0.0) if stage_index == 0 else 0.0

    def _dispatcher(self, si, d: StageProgram, r, start_ev, pre, wts, prefix, kern: KernelTerms):
        env = self.env
        yield start_ev
        self.stage_start[si, r] = env.now
        if d.plan_cpu_us > 0 or d.plan_comm_us > 0:
            yield from self._timed(r, self._work(r, d.plan_cpu_us), prefix + "plan", PhaseKind.PLANNING, d.direction)
            if d.plan_comm_us > 0:  # the all-gather of the routing: its own kind, in the same "plan" phase
                yield from self._timed(r, env.timeout(d.plan_comm_us), prefix + "plan", PhaseKind.ROUTING_GATHER,
                                       d.direction)
        self._planned[si][r].succeed()
        st = self._stall(r, "dispatch", si)
        if st > 0:
            yield from self._timed(r, env.timeout(st), prefix + "stall", PhaseKind.STALL, d.direction)
        if self.opts.overlap_prefetch:
            yield from self._send_weights(d, r, prefix, wts)
        if pre:
            procs = [env.process(self._hop(r, pre, h, None, prefix, d.pre_copy[h][r], d.post_copy[h][r], kern))
                     for h in range(len(pre))]
            yield AllOrAny(env, procs, True)
        if not self.opts.overlap_prefetch:
            yield from self._send_weights(d, r, prefix, wts)

    def _send_gated(self, phases, items, r: int) -> None:
        """Rank r sends its part of each phase now, or -- for a phase with ``after`` (a relay's
        stage) -- once r received every flow of the named phase (at once if it receives none)."""
        names = [p.name for p in phases]
        for p, it in zip(phases, items):
            if p.after is None or p.after not in names:
                self._send(it, r)
            else:
                self.env.process(self._send_after(items[names.index(p.after)], it, r))

    def _send_after(self, gate, item, r: int):
        yield self.net.received(gate.pid, r)
        self._send(item, r)

    def _send_weights(self, d: StageProgram, r: int, prefix: str, wts: list[PhaseRows]):
        """The home's local pass over the weights it sends (``host_copy_bandwidth_GBps``), then its sends."""
        if d.w_pre_R is not None and d.w_pre_R[r] > 0:
            yield from self._timed(r, self._work(r, float(d.w_pre_R[r])), prefix + "copy", PhaseKind.COPY, d.direction)
        self._send_gated(d.weights, wts, r)

    def _done(self, si: int, side: Side, r: int, hops: int) -> list[list[simpy.Event]]:
        """Per (hop, chunk): fires once rank r received that chunk and made its local pass over it."""
        key = (si, side, r)   # a side key
        out = self._done_ev.get(key)
        if out is None:
            out = self._done_ev[key] = [[self.env.event() for _ in range(self.opts.chunks)] for _ in range(hops)]
        return out

    def _first_message(self, key: tuple) -> FirstMessage:
        """The first message of a relayed hop chunk at a rank (``key``: a hop key)."""
        out = self._first.get(key)
        if out is None:
            out = self._first[key] = FirstMessage(self.env.event())
        return out

    def _announce(self, si, side, h, j, r, relay_RR, dst_l) -> None:
        """Rank r starts sending hop h chunk j: each receiver (``dst_l``: those it sends bytes to)
        holds its first message of it after ``relay_RR[r][d]`` us (the earliest sender decides)."""
        now = self.env.now
        row = relay_RR[r]
        for d in dst_l:
            slot = self._first_message((si, side, h, j, d))
            t = now + row[d]
            if t < slot.t_us:
                slot.t_us = t
                ev = slot.event
                self.env.timeout(t - now).callbacks.append(lambda _e, ev=ev: None if ev.triggered else ev.succeed())

    def _hop(self, r, rows, h, first_gate, prefix, pre_us, post_us, kern: KernelTerms):
        """Rank r's part of hop h, chunk by chunk: chunk j is sent once r received chunk j of the
        previous hop and made its local pass over it (or ``first_gate[j]`` fired, for the first
        hop) and chunk j-1 of this hop; ``pre_us`` / ``post_us`` (whole hop, split over chunks) are
        the local gather before sending and the pass over the received rows.

        ``kern``: the side's kernel terms (:class:`KernelTerms`). The fixed cost is paid
        before the first chunk of every hop (only hop 0 when relayed). With
        ``relay_RR``, hop h > 0 is sent once r holds the first message of hop h-1 (or all of it,
        if that is sooner), and r holds hop h once every relay v feeding it held its hop h-1
        chunk and forwarded the last message (``relay_RR[v][r]`` us after)."""
        env, net = self.env, self.net
        c = self.opts.chunks
        si, side, relay, fixed = kern.stage, kern.side, kern.relay, kern.fixed_us
        done = self._done(si, side, r, len(rows))
        pays_fixed = fixed > 0 and (h == 0 or not kern.program.relayed)
        copy_name = prefix + "copy"
        for j in range(c):
            item = rows[h][j]
            pid = item.pid
            tag = net.phase_tag(pid)
            if h > 0 and relay is not None:
                yield AllOrAny(env, [self._first_message((si, side, h - 1, j, r)).event, done[h - 1][j]], False)
            elif h > 0:
                yield done[h - 1][j]
            elif first_gate is not None:
                yield first_gate[j]
            if j == 0 and pays_fixed:
                # named after its hop (``dispatch.0.fixed``), so phases_us gives each launch's own span
                yield from self._timed(r, env.timeout(fixed), f"{prefix}{tag.name}.fixed", PhaseKind.KERNEL_FIXED,
                                       tag.direction)
            if pre_us > 0:
                yield from self._timed(r, self._work(r, float(pre_us) / c), copy_name, PhaseKind.COPY, tag.direction)
            t0 = env.now
            if relay is not None and h + 1 < len(rows):
                self._announce(si, side, h, j, r, relay[h], self._nonzero(item, False)[r])
            self._send(item, r)
            yield net.received(pid, r)
            if relay is not None and h > 0:
                # r holds hop h once the relays feeding it finished (their hop h-1 chunk j, then
                # the last message's forward delay); t_need starts at the time r received hop h
                t_need = env.now
                row = relay[h]
                done_t = self._done_t
                for v in self._nonzero(item, True)[r]:
                    yield self._done(si, side, v, len(rows))[h - 1][j]
                    t_need = max(t_need, done_t[(si, side, h - 1, j, v)] + row[v][r])
                if t_need > env.now:
                    yield env.timeout(t_need - env.now)
            self.spans.append(Span(r, net.phase_name(pid), tag.kind, tag.direction, t0, env.now))
            if post_us > 0:
                yield from self._timed(r, self._work(r, float(post_us) / c), copy_name, PhaseKind.COPY, tag.direction)
            self._done_t[(si, side, h, j, r)] = env.now
            done[h][j].succeed()

    def _computer(self, si, d: StageProgram, r, start_ev, pre, wts, aft, comp_done, jit, prefix):
        env = self.env
        yield start_ev
        yield self._planned[si][r]
        for j in range(self.opts.chunks):
            gate = Gate.START
            if pre:
                yield self._done(si, Side.PRE, r, len(pre))[-1][j]
                gate = Gate.DISPATCH
            if j == 0 and wts:
                t_before = env.now
                yield AllOrAny(env, [self.net.received(w.pid, r) for w in wts], True)
                if d.w_post_R is not None and d.w_post_R[r] > 0:
                    yield from self._timed(r, self._work(r, float(d.w_post_R[r])), prefix + "copy", PhaseKind.COPY,
                                           d.direction)
                if env.now > t_before:
                    gate = Gate.WEIGHTS
            if j == 0:
                st = self._stall(r, "compute", si)
                if st > 0:
                    yield from self._timed(r, env.timeout(st), prefix + "stall", PhaseKind.STALL, d.direction)
                    gate = Gate.STALL
                self.compute_start[si, r] = env.now
                self.compute_gate[si][r] = gate
            if self.opts.isolate is None:
                name = "expert_bwd" if d.direction == Direction.BACKWARD else "expert"
                yield from self._timed(r, self._work(r, float(d.compute_R[r] * jit[j])), prefix + name,
                                       PhaseKind.EXPERT_COMPUTE, d.direction)
            comp_done[j].succeed()
        self.compute_end[si, r] = env.now
        self._send_gated(d.after, aft, r)

    def _combiner(self, si, d: StageProgram, r, start_ev, post, aft, comp_done, fin, prefix, kern: KernelTerms):
        env = self.env
        yield start_ev
        gate = None if self.opts.isolate == "combine" else comp_done
        st = self._stall(r, "combine", si)
        if st > 0:
            yield comp_done[0] if gate is not None else env.timeout(0)
            yield from self._timed(r, env.timeout(st), prefix + "stall", PhaseKind.STALL, d.direction)
        if post:
            procs = [env.process(self._hop(r, post, h, gate, prefix, d.post_pre_copy[h][r], d.post_post_copy[h][r],
                                           kern))
                     for h in range(len(post))]
            yield AllOrAny(env, procs, True)
        if aft:
            yield AllOrAny(env, [self.net.received(a.pid, r) for a in aft], True)
        yield comp_done[-1]
        self.stage_end[si, r] = env.now
        fin.succeed()


def _as_lists(mats: list | None) -> list | None:
    """Per hop an [R, R] matrix as nested lists of floats (None stays None)."""
    return None if mats is None else [m.tolist() for m in mats]


__all__ = ["AllOrAny", "FirstMessage", "Gate", "KernelTerms", "PhaseRows", "PhaseTag", "Side", "Span",
           "Stage", "StepSim", "collector_paused"]
