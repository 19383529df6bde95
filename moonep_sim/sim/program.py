"""The program of one direction of one layer, read from the Plan's phases by kind.

Notation: R ranks. Times in microseconds of simulated time.

:func:`stage_program` groups ``plan.phases(direction)`` by :class:`~moonep_sim.plan.kinds.PhaseKind`
(DISPATCH before compute, PREFETCH / MIGRATE weights before compute, COMBINE after it,
GRAD_REDUCE after the backward compute) and prices the local work around them: each rank's expert
compute, the planning cost (forward only) and the executor's host passes over rows and weights.
The engine (``moonep_sim.sim.engine``) runs such programs; it never looks at the strategy's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import ClusterShape, CommPhase, Plan
from moonep_sim.plan.direct import last_hop_is_direct
from moonep_sim.plan.kernel import chunk_for
from moonep_sim.plan.kinds import COMM_KINDS, WEIGHT_KINDS, Direction, PhaseKind
from moonep_sim.sim.compute import rank_compute_us
from moonep_sim.sim.faults import FaultState
from moonep_sim.sim.kernels import (dispatch_epilogue_us, epilogue_rows_R, expand_read_bytes_per_us, kernel_fixed_us, kernel_sms,
                                    message_us, nic_message_cost_us, receive_copy_us, reduce_bytes_per_us,
                                    proxy_nic_share, relay_active, relay_hop_rows, relay_rows, sm_cap_bytes_per_us,
                                    weight_copy_bytes_per_us)
from moonep_sim.sim.kernels import planning_us as kernel_planning_us
from moonep_sim.sim.options import SimOptions
from moonep_sim.sim.topology import Topology


@dataclass
class StageProgram:
    """One direction of one layer, as the engine runs it on every rank.

    pre: DISPATCH phases (hops before compute) in order.  weights: PREFETCH / MIGRATE phases.
    post: COMBINE phases (hops after compute) in order.  after: GRAD_REDUCE phases.
    compute_R: [R] one chunk's compute work per rank (us of one core / GPU; faults applied).
    plan_cpu_us: planning work (us of one core / GPU).  plan_comm_us: the planning all-gather.
    pre_copy / post_copy: [hop] -> [R] us of the host pass before sending / after receiving a
        dispatch hop; post_pre_copy / post_post_copy: the same for combine hops.
    w_pre_R / w_post_R: [R] us of the home's pass over the weights it sends / the receiver's pass
        over the weights it receives (None: no such pass).
    p2p_RR: [R, R] time scale of the point-to-point hop's flows (None: none).

    GPU kernel terms (``moonep_sim.sim.kernels``; all neutral when the topology leaves them 0):
    pre_scale / post_scale: [hop] -> [R, R] time scale of each hop's flows (point-to-point
        efficiency, per-message NIC cost) or None.  w_scale_RR: the same for weight copies (their
        own link efficiency and engine).
    fixed_pre_us / fixed_post_us: fixed cost of one dispatch / combine kernel launch.
    relayed: one kernel per direction whose relays forward as rows arrive (pays its fixed cost
        once); else every hop is a launch of its own.
    relay_pre / relay_post: [hop] -> [R, R] us from a sender starting (or a relay finishing) its
        part of the hop to the receiver holding one message of it (latency + one message) when
        relayed, else None.  sm: the hops' flows cross the SM send / receive ports.
    nic_only: the hops' flows between ranks of one node take the NIC path (pure-RDMA kernels).
    """

    direction: Direction
    pre: list[CommPhase]
    weights: list[CommPhase]
    post: list[CommPhase]
    after: list[CommPhase]
    compute_R: np.ndarray
    plan_cpu_us: float
    plan_comm_us: float
    pre_copy: list[np.ndarray] = field(default_factory=list)
    post_copy: list[np.ndarray] = field(default_factory=list)
    post_pre_copy: list[np.ndarray] = field(default_factory=list)
    post_post_copy: list[np.ndarray] = field(default_factory=list)
    w_pre_R: np.ndarray | None = None
    w_post_R: np.ndarray | None = None
    p2p_RR: np.ndarray | None = None
    pre_scale: list = field(default_factory=list)
    post_scale: list = field(default_factory=list)
    w_scale_RR: np.ndarray | None = None
    fixed_pre_us: float = 0.0
    fixed_post_us: float = 0.0
    relayed: bool = False
    relay_pre: list | None = None
    relay_post: list | None = None
    sm: bool = False
    nic_only: bool = False


def host_copy_us(plan: Plan, topo: Topology, direction: Direction, pre: list[CommPhase],
                 post: list[CommPhase]) -> tuple[list, list, list, list]:
    """Per hop and rank, the executor's local passes over rows (``host_copy_bandwidth_GBps``):
    a gather of the rows a rank sends before each hop and a pass over the rows it receives after
    it; the last dispatch hop's pass is the expand into the rank's final rows and the first
    combine hop's the weighted gather of them. Zero when the rate is 0 (GPU presets)."""
    rate = topo.copy_bytes_per_us
    R = plan.ranks
    if rate <= 0:
        return [np.zeros(R) for _ in pre], [np.zeros(R) for _ in pre], [np.zeros(R) for _ in post], \
            [np.zeros(R) for _ in post]
    rows_R = plan.rows_R().astype(np.float64)
    fwd = direction == Direction.FORWARD
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


def planning_us(plan: Plan, topo: Topology) -> tuple[float, float]:
    """(planning work on one core / GPU, the planning all-gather) in us: a fixed cost, the Plan's
    ``host_plan_us`` (plus the measured planner time scaled by ``plan_measured_factor``) and an all-gather of the per-expert
    counts (or of every token's routing, with ``plan_routing_bytes_per_entry``). Nothing for a Plan
    whose kernels need no planning step (``KernelSpec.planned`` False)."""
    if plan.kernel is not None and not plan.kernel.planned:
        return 0.0, 0.0
    R = plan.ranks
    counts_bytes = (R - 1) * plan.num_experts * 4.0  # everyone's int32 per-expert counts
    if topo.plan_routing_bytes_per_entry > 0:  # every token's routing, padded to the largest rank
        counts_bytes = (R - 1) * float(np.max(plan.tokens_per_rank_R)) * plan.top_k * \
            topo.plan_routing_bytes_per_entry
    slow_bw, lat = (topo.nic_bytes_per_us, topo.nic_latency_us) if topo.num_nodes(R) > 1 else \
        (topo.nvlink_bytes_per_us, topo.nvlink_latency_us)
    steps = int(np.ceil(np.log2(R))) if R > 1 else 0
    plan_comm = steps * lat + (counts_bytes / slow_bw if R > 1 else 0.0)
    plan_comm += topo.host_message_us * (R - 1)  # every rank's message to each other rank
    entries = float(np.max(plan.tokens_per_rank_R)) * plan.top_k if R else 0.0
    # a fixed cost plus the work (moonep_sim.sim.kernels.planning_us), and a host-side planner's own work
    plan_cpu = kernel_planning_us(topo, entries, plan.num_experts, R, plan.kernel) + float(plan.host_plan_us)
    if topo.plan_measured_factor > 0:  # every rank plans the same global Plan (on the shared cores)
        plan_cpu += topo.plan_measured_factor * float(plan.plan_seconds) * 1e6
    return plan_cpu, plan_comm


def stage_program(plan: Plan, model: ModelSpec, topo: Topology, direction: Direction, opts: SimOptions,
                  fs: FaultState, hop_rows: list[np.ndarray] | None = None) -> StageProgram:
    """The program of ``plan``'s ``direction`` (see the module docstring); ``hop_rows``: each
    hop's ``Hop.rows_RR`` if already counted (``Plan.phases``)."""
    direction = Direction(direction)
    ph = plan.phases(direction, hop_rows)
    for p in ph:
        require(p.kind in COMM_KINDS, f"phase {p.name} kind ({p.kind!r}) must be one of "
                f"{sorted(k.value for k in COMM_KINDS)}", ConfigError)
    pre = [p for p in ph if p.kind == PhaseKind.DISPATCH]
    weights = [p for p in ph if p.kind in WEIGHT_KINDS]
    post = [p for p in ph if p.kind == PhaseKind.COMBINE]
    after = [p for p in ph if p.kind == PhaseKind.GRAD_REDUCE]
    if opts.isolate == "dispatch":
        weights, post, after = [], [], []
    elif opts.isolate == "combine":
        pre, weights, after = [], [], []
    comp = rank_compute_us(plan, model, topo, backward=(direction == Direction.BACKWARD), chunks=opts.chunks,
                           speed_R=fs.gpu_speed_R)
    plan_cpu = plan_comm = 0.0
    if direction == Direction.FORWARD and opts.planning and opts.isolate is None:
        plan_cpu, plan_comm = planning_us(plan, topo)
    d_pre, d_post, c_pre, c_post = host_copy_us(plan, topo, direction, pre, post)
    w_pre = w_post = None
    w_rate = topo.host_weight_copy_bandwidth_GBps * 1e3 or topo.copy_bytes_per_us
    if w_rate > 0 and weights:  # weights too are gathered to send and placed on arrival
        k = 1.0 / w_rate
        w_pre = sum(p.bytes_RR.sum(axis=1) for p in weights) * k
        w_post = sum(p.bytes_RR.sum(axis=0) for p in weights) * k
    p2p = p2p_scale(plan, topo) if plan.hops else None
    prog = StageProgram(direction, pre, weights, post, after, comp, plan_cpu, plan_comm, d_pre, d_post, c_pre,
                        c_post, w_pre, w_post, p2p)
    kernel_terms(prog, plan, topo)
    if opts.isolate is None:  # the library's test times a copy epilogue apart from its kernel
        epilogue_terms(prog, plan, topo)
    return prog


def epilogue_terms(prog: StageProgram, plan: Plan, topo: Topology) -> None:
    """Charge a kernel family's copy epilogue (``moonep_sim.sim.kernels.dispatch_epilogue_us``)
    after the last dispatch-side hop, and an expanded combine's read of its expanded rows before
    the first combine hop (GPU presets only: off when ``sm_count`` is 0)."""
    recv_R, out_R = epilogue_rows_R(plan)
    if recv_R is None or topo.sm_count <= 0:
        return
    if prog.pre:
        row = _row_bytes(prog.pre[-1])
        prog.post_copy[-1] = prog.post_copy[-1] + dispatch_epilogue_us(recv_R, out_R, row, topo.mem_bytes_per_us)
    if prog.post and plan.kernel.epilogue == "expand":
        row = _row_bytes(prog.post[0])
        prog.post_pre_copy[0] = prog.post_pre_copy[0] + out_R * row / expand_read_bytes_per_us(topo, plan.kernel)


def _row_bytes(phase: CommPhase) -> float:
    """Bytes per row of ``phase``, over all its rows (0 when it moves none)."""
    rows = float(phase.msgs_RR.sum())
    return float(phase.bytes_RR.sum()) / rows if rows > 0 else 0.0


def _cross_node_RR(plan: Plan, topo: Topology) -> np.ndarray:
    """bool [R, R] (read-only): True where source and destination sit on different nodes of
    ``topo`` (``Topology.cluster``). Read a dozen times per stage program; kept per geometry."""
    return _cross_node_of(topo.cluster(plan.ranks), int(plan.ranks))


@lru_cache(maxsize=16)
def _cross_node_of(cluster: ClusterShape, ranks: int) -> np.ndarray:
    """:func:`_cross_node_RR` of ``ranks`` ranks on ``cluster`` (a frozen value: the key is the
    geometry itself; a few geometries per process, so 16 entries of at most R*R bytes)."""
    r = np.arange(ranks)
    out = ~cluster.same_node(r[:, None], r[None, :])
    out.flags.writeable = False
    return out


def _row_messages_scale(phase: CommPhase, plan: Plan, topo: Topology, direction: str = "dispatch") -> np.ndarray | None:
    """[R, R] time scale that charges a serial cost per NIC message of the phase's inter-node
    flows, at the NIC's rate; None when off. Kernels that send one message per row pay
    ``moonep_sim.sim.kernels.nic_message_cost_us`` per row; relayed kernels, where the NIC's message
    rate or the family's own per-message cost (a CPU proxy) is set, pay it per relayed message
    (a chunked kernel: one RDMA write per channel's chunk, its RDMA chunk in ``direction``, the
    pair's rows split evenly over the kernel's ``sms x channels_per_sm`` channels). A host-proxy
    kernel whose proxy threads each post on one NIC also stretches its inter-node bytes by
    ``1 / moonep_sim.sim.kernels.proxy_nic_share`` (its busiest NIC binds)."""
    spec = plan.kernel
    if spec is None:
        return None
    msgs = phase.msgs_RR.astype(np.float64)
    share = proxy_nic_share(topo, spec)
    cost = 0.0
    if spec.row_messages:
        cost = nic_message_cost_us(topo, spec)
    elif spec.relay and relay_rows(topo, spec) > 0 and (topo.nic_message_us > 0 or spec.message_us > 0):
        cost = topo.nic_message_us + spec.message_us
        c = chunk_for(spec.chunks, plan.ranks)
        if c is None:
            msgs = np.ceil(msgs / relay_rows(topo, spec))
        else:  # each channel sends its own share of the pair's rows in chunks (DeepEP internode.cu)
            ch = max(1.0, float(np.floor(kernel_sms(topo, spec) * spec.channels_per_sm)))
            msgs = ch * np.ceil(msgs / (ch * c.rows(direction, True)))
    if cost <= 0 and share >= 1.0:
        return None
    cross = _cross_node_RR(plan, topo)
    if spec.nic_only:
        cross = ~np.eye(plan.ranks, dtype=bool)
    extra = msgs * cost * topo.nic_bytes_per_us
    b = phase.bytes_RR.astype(np.float64)
    # a proxy's busiest NIC (proxy_nic_share) stretches every inter-node byte, then the messages' own time
    return np.where(cross & (b > 0), 1.0 / share + np.divide(extra, b, out=np.zeros_like(b), where=b > 0), 1.0)


def broadcast_scale(phase: CommPhase, plan: Plan, topo: Topology, direction: str = "dispatch") -> np.ndarray | None:
    """[R, R] time scale of a broadcast kernel's inter-node hop (``KernelSpec.broadcast``, mori's
    InterNodeV1LL), None when off or the phase has no cross-node pair: every token goes to the relay
    of every other node, needed or not, so a cross-node pair carries the token owner's token count
    (the sender's in dispatch, the receiver's in combine) where the routing needs ``msgs`` rows:
    its bytes are stretched by ``tokens / msgs``. A pair the routing leaves empty is not charged."""
    spec = plan.kernel
    if spec is None or not spec.broadcast:
        return None
    cross = _cross_node_RR(plan, topo)
    msgs = phase.msgs_RR.astype(np.float64)
    live = cross & (msgs > 0)
    if not live.any():
        return None
    tokens = np.asarray(plan.tokens_per_rank_R, dtype=np.float64)
    owner = tokens[:, None] if direction == "dispatch" else tokens[None, :]
    rows = np.broadcast_to(owner, msgs.shape)
    return np.where(live, np.maximum(rows, msgs) / np.where(live, msgs, 1.0), 1.0)


def _relay_RR(phase: CommPhase, plan: Plan, topo: Topology, sm_cap: float, direction: str = "dispatch") -> np.ndarray:
    """[R, R] us for one relay message of ``phase`` to reach its receiver: path latency plus one
    message at the pair's link rate (capped by the SM rate): ``relay_rows`` rows (the family's,
    else the topology's), or for a chunked kernel ``channels x chunk`` of the hop's class (RDMA when
    the hop crosses nodes, its local-node copies included; else NVLink) in ``direction``
    (``moonep_sim.sim.kernels.relay_hop_rows``)."""
    cross = _cross_node_RR(plan, topo)
    row_bytes = _row_bytes(phase)
    same = np.eye(plan.ranks, dtype=bool)
    lat = np.where(cross, topo.nic_latency_us, topo.nvlink_latency_us)
    m = _message_rows(plan, topo, phase, direction)
    msg = np.where(cross, message_us(topo, row_bytes, True, sm_cap, m), message_us(topo, row_bytes, False, sm_cap, m))
    local = m * row_bytes / min(topo.mem_bytes_per_us / 2.0, sm_cap)
    return np.where(same, local, lat + msg)


def _weights_scale(plan: Plan, topo: Topology) -> np.ndarray | None:
    """[R, R] time scale of weight copies: their own link efficiency (``[weights]``) and engine
    against the link class's kernel rate that the network's ports run at; None when neutral."""
    cross = _cross_node_RR(plan, topo)
    nv = topo.nvlink_bytes_per_us / weight_copy_bytes_per_us(topo, False)
    nic = topo.nic_bytes_per_us / weight_copy_bytes_per_us(topo, True)
    if nv == 1.0 and nic == 1.0:
        return None
    sc = np.where(cross, nic, nv)
    np.fill_diagonal(sc, 1.0)
    return sc


def kernel_terms(prog: StageProgram, plan: Plan, topo: Topology) -> None:
    """Fill ``prog``'s GPU kernel terms from the Plan's :class:`~moonep_sim.plan.kernel.KernelSpec`
    and the topology (``moonep_sim.sim.kernels``)."""
    spec = plan.kernel
    sm_cap = sm_cap_bytes_per_us(topo, spec)
    prog.sm = bool(np.isfinite(sm_cap))
    prog.nic_only = bool(spec is not None and spec.nic_only)
    prog.fixed_pre_us = kernel_fixed_us(topo, "dispatch", spec)
    prog.fixed_post_us = kernel_fixed_us(topo, "combine", spec)
    prog.relayed = bool(spec is not None and spec.relay)

    def scales(phases: list[CommPhase], p2p_at: int, direction: str) -> list:
        out = []
        for i, ph in enumerate(phases):
            sc = prog.p2p_RR if (i == p2p_at and prog.p2p_RR is not None) else None
            for m in (_row_messages_scale(ph, plan, topo, direction), broadcast_scale(ph, plan, topo, direction)):
                if m is not None:
                    sc = m if sc is None else sc * m
            out.append(sc)
        return out

    prog.pre_scale = scales(prog.pre, len(prog.pre) - 1, "dispatch")
    prog.post_scale = scales(prog.post, 0, "combine")
    prog.w_scale_RR = _weights_scale(plan, topo) if prog.weights else None
    if relay_active(topo, spec):
        prog.relay_pre = [_relay_RR(p, plan, topo, sm_cap, "dispatch") for p in prog.pre]
        prog.relay_post = [_relay_RR(p, plan, topo, sm_cap, "combine") for p in prog.post]
    for h, us_R in enumerate(combine_reduce_R(plan, topo, prog.post)):
        prog.post_post_copy[h] = prog.post_post_copy[h] + us_R
    recv_copy = receive_copy_R(plan, topo, prog.pre)
    if recv_copy is not None:
        prog.post_copy[-1] = prog.post_copy[-1] + recv_copy


def _message_rows(plan: Plan, topo: Topology, phase: CommPhase, direction: str) -> int:
    """Rows of the phase's last message at its receiver: ``channels x chunk`` of the hop's class for a
    chunked kernel, else the relayed message (``moonep_sim.sim.kernels.relay_hop_rows``)."""
    cross = bool((phase.bytes_RR.astype(np.float64) * _cross_node_RR(plan, topo)).sum() > 0)
    return relay_hop_rows(topo, plan.kernel, plan.ranks, direction, cross)


def receive_copy_R(plan: Plan, topo: Topology, pre: list[CommPhase]) -> np.ndarray | None:
    """[R] us of the last dispatch hop's receive copy (``KernelSpec.recv_copy``; GPU presets only): the
    receivers copy each arrived chunk into the output, the last message's copy exposed
    (``moonep_sim.sim.kernels.receive_copy_us`` at ``reduce_bytes_per_us``); None when off."""
    spec = plan.kernel
    if spec is None or not spec.recv_copy or topo.sm_count <= 0 or not pre:
        return None
    ph = pre[-1]
    m = max(_message_rows(plan, topo, ph, "dispatch"), 1)
    recv_R = ph.bytes_RR.sum(axis=0).astype(np.float64)
    return receive_copy_us(recv_R, m * _row_bytes(ph), reduce_bytes_per_us(topo, spec))


def combine_reduce_R(plan: Plan, topo: Topology, post: list[CommPhase]) -> list[np.ndarray]:
    """[hop] -> [R] us of each combine hop's reduce at its receivers (GPU presets only: off when
    the topology's kernel terms are, ``sm_count`` 0): the rows a rank received in the hop are read
    and their per-token sums written -- the rows it sends in the next combine hop, or, after the
    last, one row per token it holds (``moonep_sim.sim.kernels.combine_reduce_us``, at
    ``reduce_bytes_per_us``: HBM, capped by the SMs of SM-driven kernels). The kernel family says
    whether that pass runs after the rows arrived or is fused into the receive (default: after); fused,
    the last message's reduce is exposed: ``channels x chunk`` rows of the hop's class for a chunked
    kernel (DeepEP V1's ``get_combine_config``), else the relayed message."""
    if topo.sm_count <= 0 or not post:
        return []
    spec = plan.kernel
    mode = (spec.reduce if spec is not None else None) or "after"
    rate = reduce_bytes_per_us(topo, spec)
    out = []
    for h, ph in enumerate(post):
        m = _message_rows(plan, topo, ph, "combine")
        recv_R = ph.bytes_RR.sum(axis=0).astype(np.float64)
        row = _row_bytes(ph)
        if h + 1 < len(post):
            sent_R = post[h + 1].bytes_RR.sum(axis=1).astype(np.float64)
        else:
            sent_R = plan.tokens_per_rank_R.astype(np.float64) * row
        work_R = recv_R + sent_R  # the closed form combine_reduce_us, over ranks
        exposed_R = work_R if mode == "after" else np.minimum(work_R, 2.0 * max(m, 1) * row)
        out.append(exposed_R / rate if np.isfinite(rate) and rate > 0 else np.zeros_like(work_R))
    return out


def p2p_scale(plan: Plan, topo: Topology) -> np.ndarray | None:
    """[R, R] factor on the transfer time of the last dispatch hop (and its adjoint, the first
    combine hop) when the gloo executor sends it point-to-point and the topology gives such
    inter-node transfers their own efficiency (``nic_p2p_efficiency``); None otherwise."""
    if topo.nic_p2p_efficiency <= 0 or topo.nic_p2p_efficiency == topo.nic_efficiency:
        return None
    if not last_hop_is_direct(plan, int(plan.costs.dispatch_row_bytes)):
        return None
    cross = _cross_node_RR(plan, topo)
    return np.where(cross, topo.nic_efficiency / topo.nic_p2p_efficiency, 1.0)


__all__ = ["StageProgram", "broadcast_scale", "combine_reduce_R", "epilogue_terms", "host_copy_us", "kernel_terms", "p2p_scale", "planning_us",
           "receive_copy_R", "stage_program"]
