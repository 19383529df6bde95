"""A finished simulation read back: phase spans, the straggler, the busiest port, the result.

Notation: R ranks, F flows, P ports. Times in microseconds of simulated time.

Phases are selected by their :class:`~moonep_sim.plan.kinds.PhaseKind` (each flow's phase carries
a :class:`~moonep_sim.sim.engine.PhaseTag`, each span its kind), never by parsing phase names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.plan.kinds import COMM_KINDS, Direction, PhaseKind
from moonep_sim.sim.engine import StepSim
from moonep_sim.sim.lower_bound import lower_bound
from moonep_sim.sim.network import FlowNetwork
from moonep_sim.sim.perfetto import trace_events

# straggler cause of a flow bottlenecked by a port at its nominal bandwidth, by the flow's kind
_LOAD_CAUSE = {PhaseKind.DISPATCH: "tokens received", PhaseKind.COMBINE: "tokens received",
               PhaseKind.PREFETCH: "weight traffic", PhaseKind.MIGRATE: "weight traffic",
               PhaseKind.GRAD_REDUCE: "gradient traffic"}  # (the detail says which side the port is)


@dataclass
class SimResult:
    """One simulation's outcome (see :meth:`to_dict` for the JSON form).

    layer_time_us: from 0 to the last rank's end (all layers and directions simulated).
    phases_us: phase name -> span (first start to last end, over ranks and chunks) in us.
    lower_bound_us / ratio_to_lower_bound: DESIGN section 6 (``moonep_sim.sim.lower_bound``);
        0 / 0 in ``isolate`` mode.
    straggler: {rank, cause, phase, detail} (see :func:`straggler`).  busiest_port: {name, bytes, utilisation, busy_us}.
    per_rank: lists over ranks (end_us, compute_us, recv_rows ...) of the first stage (layer 0,
        forward).  layers_us: per layer span.
    stages: per stage (one direction of one layer, in run order) its critical rank's parts of the
        run (:func:`stage_parts`); they sum to ``layer_time_us``. In ``to_dict`` only for a chain
        (more than one stage): a single stage's parts are ``per_rank``'s figures.
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
    stages: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "strategy", "topology", "ranks", "layer_time_us", "phases_us", "lower_bound_us", "ratio_to_lower_bound",
            "lower_bound", "straggler", "busiest_port", "layers_us", "per_rank", "sim_stats", "options")}
        d["sim_wall_seconds"] = self.sim_stats.get("wall_seconds", 0.0)
        d["topology_constants"] = self.topology_constants
        if len(self.stages) > 1:
            d["stages"] = [dict(s) for s in self.stages]
        return d


def phase_spans(net: FlowNetwork, rec: dict[str, np.ndarray], spans) -> dict[str, float]:
    """Phase name (chunk suffix ``#j`` dropped) -> span in us, first start to last end over ranks
    and chunks: network phases from the flow records, local work (planning, expert compute,
    stalls, host copies) from the spans."""
    out: dict[str, tuple[float, float]] = {}

    def add(name, a, b):
        lo, hi = out.get(name, (np.inf, -np.inf))
        out[name] = (min(lo, a), max(hi, b))

    if rec["phase"].size:
        for pid in np.unique(rec["phase"]).tolist():
            m = rec["phase"] == pid
            base = net.phase_name(pid).split("#")[0]
            add(base, float(rec["start"][m].min()), float(rec["end"][m].max()))
    for s in spans:
        if s.kind not in COMM_KINDS:
            add(s.name.split("#")[0], s.start_us, s.end_us)
    return {k: float(b - a) for k, (a, b) in out.items()}


def _flows_of_phases(sim: StepSim, rec, keep) -> np.ndarray:
    """bool [F]: the flows whose phase's :class:`PhaseTag` satisfies ``keep`` (decided once per
    phase, then read per flow)."""
    keep_P = np.array([bool(keep(sim.net.phase_tag(p))) for p in range(sim.net.num_phases)] or [False])
    return keep_P[rec["phase"].astype(np.int64)]


def _label(tag) -> str:
    """``combine``, or ``grad_reduce (backward)``: a flow's kind, with its direction if backward."""
    return tag.kind.value + (" (backward)" if tag.direction == Direction.BACKWARD else "")


def straggler(sim: StepSim, rec, end_R: np.ndarray) -> dict[str, Any]:
    """Name the rank, the cause and the phase kind behind the end time (docs/simulator.md, faults
    and stragglers).

    On the rank whose first-stage compute ended last, the longest of three segments decides:
    its compute (cause ``compute``), the wait before it (``dispatch``: an injected stall, the
    copies' weights, or the latest DISPATCH / PREFETCH flow into it of the first stage) or the
    tail after it to the step's end (the latest-ending COMBINE or GRAD_REDUCE flow of any stage).
    For a flow, the port on its path that was busy longest decides the cause: ``slow port`` if
    degraded, else the load it carries by the flow's kind (``tokens received``, ``weight
    traffic``, ``gradient traffic``; the detail says whether the port's rank sends or receives
    it). ``phase`` is that flow's :class:`PhaseKind` value.
    """
    ports, fs = sim.ports, sim.fs
    si = 0
    plan = sim.plans[0]

    last_rank = int(np.argmax(end_R))
    if sim.opts.isolate is not None or rec["end"].size == 0:
        if rec["end"].size == 0:
            return dict(rank=last_rank, cause="none", phase=None, detail="no transfers")
        f = int(np.nanargmax(rec["end"]))
        p = critical_port(sim, rec, f)
        owner = port_owner(sim, rec, p, f)
        tag = sim.net.phase_tag(int(rec["phase"][f]))
        return dict(rank=owner, cause=port_cause(sim, p, tag.kind), phase=tag.kind.value,
                    detail=f"last transfer {int(rec['src'][f])}->{int(rec['dst'][f])} limited by {ports.name(p)}")
    c_end, c_start = sim.compute_end[si], sim.compute_start[si]
    rc = int(np.argmax(c_end))
    dur = c_end[rc] - c_start[rc]
    t_disp = c_start[rc] - sim.stage_start[si, rc]
    t_tail = float(end_R.max()) - c_end[rc]
    gate = sim.compute_gate[si][rc]
    stall = sum(us for (r, _), us in fs.stall_us.items() if r == rc)
    seg = max(("compute", dur), ("dispatch", t_disp), ("combine", t_tail), key=lambda x: x[1])[0]
    if stall > 0 and stall >= 0.25 * max(dur, t_disp, t_tail):
        return dict(rank=rc, cause="stall", phase=PhaseKind.STALL.value, detail=f"rank {rc} stalled {stall:.1f} us")
    if seg == "compute":
        sp = fs.gpu_speed_R[rc]
        rows = plan.real_rows_R()
        mean_rows = max(float(rows.mean()), 1e-9)
        det = (f"expert compute {dur:.1f} us on {int(rows[rc])} rows ({rows[rc] / mean_rows:.2f}x mean)"
               + (f", GPU at {sp:g}x speed" if sp != 1 else ""))
        return dict(rank=rc, cause="compute", phase=PhaseKind.EXPERT_COMPUTE.value, detail=det)
    if seg == "dispatch" and gate == "weights":
        return dict(rank=rc, cause="weight prefetch", phase=PhaseKind.PREFETCH.value,
                    detail=f"rank {rc} waited for copied expert weights")
    # the latest-ending flow of the segment's phases decides the port
    if seg == "combine":
        m = _flows_of_phases(sim, rec, lambda t: t.kind in (PhaseKind.COMBINE, PhaseKind.GRAD_REDUCE))
    else:  # the first stage's (layer 0, forward) flows into rc before its compute
        m = _flows_of_phases(sim, rec, lambda t: t.kind in (PhaseKind.DISPATCH, PhaseKind.PREFETCH)
                             and t.direction == Direction.FORWARD and t.layer == 0) & (rec["dst"] == rc)
    if not m.any():
        m = np.ones(rec["end"].size, dtype=bool)
    if (m & (rec["src"] != rec["dst"])).any():  # a rank's copy to itself crosses no link
        m = m & (rec["src"] != rec["dst"])
    idx = np.flatnonzero(m)
    f = int(idx[np.nanargmax(rec["end"][idx])])
    tag = sim.net.phase_tag(int(rec["phase"][f]))
    p = critical_port(sim, rec, f)
    cause = port_cause(sim, p, tag.kind)
    owner = port_owner(sim, rec, p, f)
    what = _label(tag)
    if cause == "tokens received":
        into = tag.kind == PhaseKind.DISPATCH
        rows = np.zeros(sim.R) if into else plan.real_rows_R()
        if into and plan.hops:   # rows each rank receives in the last hop
            rows = np.bincount(plan.hops[-1].dst_rank_M, minlength=sim.R).astype(float)
        rr = rows[owner]
        det = (f"{what}: rank {owner} {'receives' if into else 'returns'} {int(rr)} rows "
               f"({rr / max(float(rows.mean()), 1e-9):.2f}x mean); "
               f"port {ports.name(p)} is the bottleneck")
    elif cause in ("weight traffic", "gradient traffic"):
        # the port's owner sends these bytes (its out port) or receives them; count its side
        sends = owner == int(rec["src"][f]) and owner != int(rec["dst"][f])
        pm = rec["phase"] == rec["phase"][f]
        side = rec["src"] if sends else rec["dst"]
        by_R = np.bincount(side[pm].astype(np.int64), weights=rec["bytes"][pm], minlength=sim.R)
        nz = by_R[by_R > 0]
        det = (f"{what}: rank {owner} {'sends' if sends else 'receives'} {by_R[owner] / 2**20:.1f} MiB of expert "
               f"{'gradients' if tag.kind == PhaseKind.GRAD_REDUCE else 'weights'} "
               f"({by_R[owner] / max(float(nz.mean()) if nz.size else 0.0, 1e-9):.2f}x the mean "
               f"{'sender' if sends else 'receiver'}); port {ports.name(p)} is the bottleneck")
    else:
        det = f"{what}: port {ports.name(p)} at {ports.cap_P[p] / ports.nominal_cap_P[p]:.2g}x bandwidth limits the last transfer"
    return dict(rank=owner, cause=cause, phase=tag.kind.value, detail=det)


def port_owner(sim: StepSim, rec, p: int, f: int) -> int:
    """The rank a port belongs to: its own rank; for a node link's out port the flow's source (a
    rank of that node); for a pair, spine or node-in port the flow's destination."""
    own = sim.ports.owner(p)
    if own is not None:
        return own
    if sim.ports.node_links and sim.ports.node_base <= p < sim.ports.node_base + sim.ports.groups:
        return int(rec["src"][f])
    return int(rec["dst"][f])


def critical_port(sim: StepSim, rec, f: int) -> int:
    """The port on flow f's path that was busy longest over the run (bytes / its bandwidth): the
    resource that kept the flow's last bytes waiting (a degraded port's busy time grows with it)."""
    if sim.busy_P is None:
        sim.busy_P = sim.net.port_bytes(rec) / sim.ports.cap_P[:-1]
    one = {k: v[f:f + 1] for k, v in rec.items()}
    path = sim.ports.route(rec["src"][f:f + 1], rec["dst"][f:f + 1], sim.net.flow_sm(one), sim.net.flow_nic(one))[0]
    path = path[path < sim.ports.num_ports]
    phys = path[[sim.ports.physical(int(q)) for q in path]] if path.size else path
    path = phys if phys.size else path  # name a device's port, not a half-duplex pair
    if path.size == 0:
        return int(rec["bneck"][f])
    return int(path[np.argmax(sim.busy_P[path])])


def port_cause(sim: StepSim, p: int, kind: PhaseKind) -> str:
    """Why a flow of ``kind`` waited on port ``p``: ``latency`` (no port), ``slow port`` (degraded),
    else the load the port carried (by the flow's kind)."""
    if p < 0:
        return "latency"
    deg = sim.ports.cap_P[p] < sim.ports.nominal_cap_P[p] * (1 - 1e-9)
    return "slow port" if deg else _LOAD_CAUSE[kind]


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    """Length of [a, b] inside [lo, hi]."""
    return max(0.0, min(b, hi) - max(a, lo))


def stage_parts(sim: StepSim, rec, t_end: float) -> list[dict[str, Any]]:
    """Each stage's share of the run, along its critical rank, so that a chain of layers (and a
    backward) can be read part by part as one layer is.

    The run [0, t_end] is cut into one window per stage: stage s owns [E(s-1), E(s)], E(s) the
    last rank's end of stage s (E(-1) = 0; the last window ends at ``t_end``). Ranks chain their
    stages, so E never decreases and the windows sum to ``t_end``. In its window, stage s is read
    on its critical rank c (the one whose expert compute of s ends last): ``plan_us`` its planning,
    ``dispatch_us`` dispatch and any wait for copied weights until its compute starts,
    ``compute_us`` its expert compute, ``combine_us`` the rest of the window; each the part of c's
    interval inside the window (c's stage starts at its own end of s-1, at or before E(s-1), so
    the four parts sum to the window). Within the communication parts: ``fixed_us`` c's kernel
    launch spans of s inside the window, ``weights_us`` the span (first start to last end, over
    ranks) of s's weight flows (prefetch, migrate, gradient reduce) inside the window. (One
    stage's reading in ``moonep_sim.analysis.verdict`` stays the one from ``per_rank`` and the
    phase spans, which differs only in taking the planning span over all ranks.) One entry per
    stage: ``{layer, direction, start_us, end_us, critical_rank, plan_us, dispatch_us, compute_us,
    combine_us, fixed_us, weights_us}``.
    """
    n = len(sim.stages)
    if n == 0:
        return []
    sp = sim.spans
    s_rank = np.array([s.rank for s in sp], dtype=np.int64)
    s_start = np.array([s.start_us for s in sp], dtype=float)
    s_end = np.array([s.end_us for s in sp], dtype=float)
    s_kind = np.array([s.kind.value for s in sp], dtype=object)
    is_plan = np.isin(s_kind, [PhaseKind.PLANNING.value, PhaseKind.ROUTING_GATHER.value])
    is_fixed = s_kind == PhaseKind.KERNEL_FIXED.value
    tags = [sim.net.phase_tag(p) for p in range(sim.net.num_phases)]
    w_kinds = (PhaseKind.PREFETCH, PhaseKind.MIGRATE, PhaseKind.GRAD_REDUCE)
    ph = rec["phase"].astype(np.int64)
    out, lo = [], 0.0
    for si, (li, prog) in enumerate(sim.stages):
        hi = float(t_end) if si == n - 1 else float(sim.stage_end[si].max())
        c = int(np.argmax(sim.compute_end[si]))
        ss, se = float(sim.stage_start[si, c]), float(sim.stage_end[si, c])
        cs, ce = float(sim.compute_start[si, c]), float(sim.compute_end[si, c])
        mine = (s_rank == c) & (s_start >= ss) & ((s_start < se) | (s_start == ss))
        pe = float(s_end[mine & is_plan].max()) if (mine & is_plan).any() else ss
        pe = min(pe, cs)
        fixed = sum(_clip(a, b, lo, hi) for a, b in zip(s_start[mine & is_fixed], s_end[mine & is_fixed]))
        pids = [p for p, t in enumerate(tags) if t.layer == li and t.direction == prog.direction and t.kind in w_kinds]
        wm = np.isin(ph, pids) if pids else np.zeros(ph.size, dtype=bool)
        weights = _clip(float(rec["start"][wm].min()), float(rec["end"][wm].max()), lo, hi) if wm.any() else 0.0
        parts = dict(plan_us=_clip(ss, pe, lo, hi), dispatch_us=_clip(pe, cs, lo, hi), compute_us=_clip(cs, ce, lo, hi))
        # the three intervals are contiguous (ss <= pe <= cs <= ce <= E(s)): clipped, they fit the window
        require(sum(parts.values()) <= (hi - lo) * (1 + 1e-9) + 1e-9,
                f"stage {si}'s critical-rank parts ({sum(parts.values())} us) must fit its window ({hi - lo} us) "
                "(internal error)", ConfigError)
        parts["combine_us"] = max(hi - lo - sum(parts.values()), 0.0)
        out.append(dict(layer=int(li), direction=prog.direction.value, start_us=lo, end_us=hi, critical_rank=c,
                        **parts, fixed_us=float(fixed), weights_us=float(weights)))
        lo = hi
    return out


def sim_result(sim: StepSim, wall: float) -> SimResult:
    """Assemble the :class:`SimResult` of a finished run (``wall``: seconds it took)."""
    net, ports, R = sim.net, sim.ports, sim.R
    rec = net.records()
    require(not np.isnan(rec["end"]).any(), "simulation ended with unfinished transfers (internal error)", ConfigError)
    end_R = sim.stage_end[-1].copy()
    t_end = float(max(end_R.max() if end_R.size else 0.0, rec["end"].max() if rec["end"].size else 0.0))
    pb = net.port_bytes(rec)
    busy = pb / ports.cap_P[:-1]
    if sim.busy_P is None:   # critical_port reads it
        sim.busy_P = busy
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
    phases = phase_spans(net, rec, sim.spans)
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
    # (the performance settings decide how the records are computed, not what they are: not reported)
    opts = {k: (v if k != "faults" else [repr(f) for f in v]) for k, v in sim.opts.__dict__.items() if k != "perf"}
    res = SimResult(
        strategy=plan0.strategy, topology=sim.topo.name, ranks=R, layer_time_us=t_end, phases_us=phases,
        lower_bound_us=lb_us, ratio_to_lower_bound=(t_end / lb_us if lb_us > 0 else 0.0), lower_bound=lb,
        straggler=straggler(sim, rec, end_R), busiest_port=busiest, per_rank=per_rank,
        port_bytes={ports.name(int(p)): float(pb[p]) for p in top if pb[p] > 0},
        flow_bytes=float(rec["bytes"].sum()), layers_us=layers_us, sim_stats=stats,
        topology_constants=sim.topo.constants(), options=opts, stages=stage_parts(sim, rec, t_end))
    if sim.opts.timeline:
        res.timeline_events = trace_events(sim.spans, net, rec, R)
    return res


__all__ = ["SimResult", "critical_port", "phase_spans", "port_cause", "port_owner", "sim_result", "stage_parts",
           "straggler"]
