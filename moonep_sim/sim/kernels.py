"""GPU kernel terms of the simulator, in closed form (each is off on a topology that leaves it 0).

Units: bytes, microseconds, bytes per microsecond (1 GB/s = 1e3 bytes/us). Every function here is
what the timeline (``moonep_sim.sim.timeline``) charges for one kernel, one relay or one copy when
nothing else competes; the unit tests compare the simulator against them. Constants live on
:class:`moonep_sim.sim.topology.Topology` (tables ``[kernel]``, ``[sm]``, ``[weights]`` and the
planning terms), each with its source and status in the preset's ``[sources]``.

- **Fixed cost per kernel** (``kernel_dispatch_fixed_us`` / ``kernel_combine_fixed_us``): launch,
  count notification and flag polling of one kernel, paid by each rank before it sends; a Plan of
  separate per-hop collectives pays it per hop, a relayed Plan once (:func:`kernel_launches`).
- **SM-limited copies** (``sm_count``, ``sm_copy_GBps``): a kernel on b SMs sends and receives at
  most ``min(b, sm_count) x sm_copy_GBps`` per GPU (:func:`sm_cap_bytes_per_us`), whatever the
  links allow; the network carries it as one send and one receive port per rank.
- **Relayed forwarding** (``kernel_relay_message_rows``): a relay forwards rows as they arrive in
  messages of m rows, so hop h+1 overlaps hop h (:func:`relay_two_hop_us`); a chunked kernel
  (DeepEP V1) forwards in ``channels x chunk`` rows per hop class and direction (:func:`relay_hop_rows`).
- **Per-message NIC cost** (``kernel_nic_message_us``): one RDMA write per row for the low-latency
  kernels (:func:`row_messages_us`).
- **Receive copy** (DeepEP V1, ``KernelSpec.recv_copy``): the receivers copy each arrived chunk
  out of their buffer into the output as it arrives, so the last message's copy is exposed
  (:func:`receive_copy_us`), as the last message's reduce of a ``"fused"`` combine is
  (:func:`combine_reduce_us`); for a chunked kernel the message is ``channels x chunk`` rows.
- **Copy epilogue** (DeepEP V2, ``KernelSpec.epilogue``): after the dispatch kernel, a kernel on
  every SM writes the received rows into the output, once per (token, rank) or -- expanded -- once
  per (token, local expert) (:func:`dispatch_epilogue_us`); an expanded combine first reads every
  expanded row (:func:`expand_read_bytes_per_us`). Charged in a layer, not in an isolated kernel
  (the library's test times the epilogue apart; ``simulate --isolate`` prints it beside).
- **Planning as a function of the work** (:func:`planning_us`).
- **Weight copies** (``[weights]``): one expert copy over NVLink or the NIC, by copy engine or SMs
  (:func:`weight_copy_us`), what prefetch, migration and gradient reduce move.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from moonep_sim.plan.kernel import ALL_SMS, KernelSpec, chunk_for
from moonep_sim.plan.ir import Plan
from moonep_sim.plan.kinds import PhaseKind
from moonep_sim.sim.topology import Topology


def kernel_sms(topo: Topology, spec: KernelSpec | None) -> int:
    """SMs a Plan's kernels use on ``topo``: 0 = no SM cap (none declared, or SM limits off)."""
    if spec is None or spec.sms == 0 or topo.sm_count <= 0:
        return 0
    return topo.sm_count if spec.sms == ALL_SMS else min(int(spec.sms), topo.sm_count)


def sm_cap_bytes_per_us(topo: Topology, spec: KernelSpec | None) -> float:
    """Per-rank send (and, separately, receive) cap of the Plan's kernels; ``inf`` = none:
    ``sms x sm_copy_GBps x`` the family's ``sm_copy_factor``."""
    return topo.sm_bytes_per_us(kernel_sms(topo, spec)) * (spec.sm_copy_factor if spec is not None else 1.0)


def kernel_fixed_us(topo: Topology, kind: str, spec: KernelSpec | None = None) -> float:
    """Fixed cost of one ``"dispatch"`` or ``"combine"`` kernel launch on one rank: the kernel
    family's own (``spec``) where it sets one, else the topology's ``[kernel]`` value; plus the
    family's ``extra_fixed_us``."""
    if kind not in ("dispatch", "combine"):
        raise ValueError(f"kind ({kind!r}) must be 'dispatch' or 'combine'")
    own = None if spec is None else (spec.dispatch_fixed_us if kind == "dispatch" else spec.combine_fixed_us)
    extra = spec.extra_fixed_us if spec is not None else 0.0
    if own is not None:
        return float(own) + extra
    return (topo.kernel_dispatch_fixed_us if kind == "dispatch" else topo.kernel_combine_fixed_us) + extra


def relay_rows(topo: Topology, spec: KernelSpec | None = None) -> int:
    """Rows per relayed message: the family's own, else ``kernel_relay_message_rows``."""
    own = None if spec is None else spec.relay_message_rows
    return int(own) if own is not None else int(topo.kernel_relay_message_rows)


def relay_hop_rows(topo: Topology, spec: KernelSpec | None, ranks: int, direction: str, inter_node: bool) -> int:
    """Rows of one relayed "message" on a hop of that class (``inter_node``: RDMA, else NVLink) in
    ``direction`` (``"dispatch"`` / ``"combine"``): for a chunked kernel (``spec.chunks``, DeepEP
    V1's ``Config`` per EP size) ``channels x chunk`` -- its ``sms x channels_per_sm`` channels
    each send in chunks and share the link, so a relay holds every channel's first chunk (and a
    receiver every channel's last) only ``channels x chunk`` rows after the hop starts (ends);
    else :func:`relay_rows`."""
    c = chunk_for(spec.chunks, ranks) if spec is not None else None
    if c is None:
        return relay_rows(topo, spec)
    sms = kernel_sms(topo, spec)
    channels = max(1, int(sms * spec.channels_per_sm)) if sms else 1
    return channels * c.rows(direction, inter_node)


def proxy_nic_share(topo: Topology, spec: KernelSpec | None) -> float:
    """Fraction of the GPU's NIC rate a host-proxy kernel reaches when its channels are dealt to
    ``spec.proxy_nic_threads`` proxy threads, each posting on one NIC (channel c -> thread c mod T
    -> NIC thread mod N, N = ``Topology.nics_per_gpu``): every channel carries an equal share of the
    bytes, so the busiest NIC binds and the rate is ``(channels / N) / max channels per NIC``
    (UCCL-EP at 10 channels on 4 NICs: 2.5 / 3); 1 = none declared, one NIC, or balanced."""
    if spec is None or spec.proxy_nic_threads <= 0:
        return 1.0
    n = int(round(topo.nics_per_gpu))
    sms = kernel_sms(topo, spec)
    channels = max(1, int(sms * spec.channels_per_sm)) if sms else 1
    if n <= 1 or channels <= 0:
        return 1.0
    per_nic = np.bincount((np.arange(channels) % spec.proxy_nic_threads) % n, minlength=n)
    return float(channels / n / per_nic.max())


def proxy_host_us(plan: Plan) -> float:
    """Host time (us) a training step pays per dispatch or combine call of a host-proxy kernel family
    (``KernelSpec.proxy_call_us`` / ``proxy_GBps``) beyond its kernels' own time: the per-call cost
    plus the busiest rank's inter-node bytes of the forward dispatch (the rows a combine returns) at
    the proxy's rate, ``proxy_call_us + max_r inter_r / proxy_GBps``; 0 for any other family. The
    step charges it on its host timeline (``moonep_sim.step.host``), once per call."""
    spec = plan.kernel
    if spec is None or (spec.proxy_call_us <= 0 and spec.proxy_GBps <= 0):
        return 0.0
    per_byte = 0.0
    if spec.proxy_GBps > 0:
        inter = ~plan.cluster.intra_node_RR()
        sent_R = sum((p.bytes_RR * inter).sum(axis=1) for p in plan.phases("forward") if p.kind == PhaseKind.DISPATCH)
        per_byte = float(np.max(sent_R, initial=0.0)) / (spec.proxy_GBps * 1e3)
    return float(spec.proxy_call_us) + per_byte


def nic_message_cost_us(topo: Topology, spec: KernelSpec | None = None) -> float:
    """Serial cost of one NIC message at the sending GPU: the slower of the kernel's own
    per-write cost (``kernel_nic_message_us``) and the GPU's share of its NICs' message rate
    (``Topology.nic_message_us``), plus the family's own per-message cost (a CPU proxy)."""
    return max(topo.kernel_nic_message_us, topo.nic_message_us) + (spec.message_us if spec is not None else 0.0)


def reduce_bytes_per_us(topo: Topology, spec: KernelSpec | None) -> float:
    """Rate of the combine receiver's reduce pass (bytes read + written per us): the HBM rate,
    capped for SM-driven kernels by the SMs the reduce takes (``reduce_sms``, else the kernels')."""
    rate = topo.mem_bytes_per_us
    if spec is not None:
        sms = spec.reduce_sms or spec.sms
        cap = sm_cap_bytes_per_us(topo, replace(spec, sms=sms)) if sms else math.inf
        rate = min(rate, cap)
    return rate


def combine_reduce_us(recv_bytes: float, out_bytes: float, rate: float, mode: str, tail_bytes: float = 0.0) -> float:
    """The combine receiver's reduce of one hop on one rank: reading the ``recv_bytes`` it was
    sent and writing the ``out_bytes`` of sums, at ``rate`` bytes/us. ``"after"`` (the pass runs
    once the rows arrived): ``(recv + out) / rate``; ``"fused"`` (summed as rows arrive): only the
    last message's, ``min(recv + out, tail_bytes) / rate``."""
    if rate <= 0 or not math.isfinite(rate):
        return 0.0
    work = float(recv_bytes) + float(out_bytes)
    return (work if mode == "after" else min(work, float(tail_bytes))) / rate


def receive_copy_us(recv_bytes, message_bytes: float, rate: float):
    """The last dispatch hop's receive copy on one rank (``KernelSpec.recv_copy``, DeepEP V1): the
    receiving SMs copy each arrived chunk out of the receive buffer into the output (read + write) as
    it arrives, so only the copy of the last message -- ``message_bytes``, ``channels x chunk`` rows
    of a chunked kernel -- is exposed: ``min(2 recv, 2 message) / rate`` (``rate``: bytes read +
    written per us, :func:`reduce_bytes_per_us`). ``recv_bytes`` may be a scalar or an [R] array."""
    import numpy as np

    if rate <= 0 or not math.isfinite(rate):
        return 0.0 * recv_bytes
    return np.minimum(2.0 * recv_bytes, 2.0 * float(message_bytes)) / rate


def dispatch_epilogue_us(recv_rows, out_rows, row_bytes: float, rate: float):
    """A dispatch's copy epilogue on one rank (DeepEP V2): it reads the ``recv_rows`` it received
    (one per (token, rank)) and writes ``out_rows`` -- the same rows (``epilogue="recv"``) or one per
    (token, local expert) selection (``"expand"``) -- at ``rate`` bytes/us (HBM: it runs on every SM):
    ``(recv + out) x row / rate``. Rows may be scalars or [R] arrays (one per rank)."""
    if rate <= 0 or not math.isfinite(rate):
        return 0.0 * (recv_rows + out_rows)
    return (recv_rows + out_rows) * float(row_bytes) / rate


def epilogue_rows_R(plan) -> tuple:
    """([R] rows each rank received after the last dispatch hop, its own included; [R] rows its
    epilogue writes): the received rows again (``"recv"``), or the real rows of its expert-grouped
    layout, one per kept (token, expert) entry (``"expand"``); (None, None) without an epilogue."""
    spec = plan.kernel
    if spec is None or not spec.epilogue or not plan.hops:
        return None, None
    recv_R = plan.hops[-1].dst_rows_R.astype("float64")
    return recv_R, (recv_R if spec.epilogue == "recv" else plan.real_rows_R().astype("float64"))


def expand_read_bytes_per_us(topo: Topology, spec: KernelSpec | None) -> float:
    """Rate of an expanded combine's read of its expanded rows on one rank: HBM, capped by the
    kernel's SMs at the family's per-SM read rate (``sm_read_GBps``; 0 = its SM copy rate)."""
    rate = topo.mem_bytes_per_us
    if spec is None:
        return rate
    n = kernel_sms(topo, spec)
    if n and spec.sm_read_GBps > 0:
        rate = min(rate, n * spec.sm_read_GBps * 1e3)
    elif n:
        rate = min(rate, sm_cap_bytes_per_us(topo, spec))
    return rate


def kernel_launches(spec: KernelSpec | None, hops: int) -> int:
    """Kernel launches of one dispatch (or combine) of a ``hops``-hop Plan: 1 when relayed."""
    if hops <= 0:
        return 0
    return 1 if (spec is not None and spec.relay) else hops


def relay_active(topo: Topology, spec: KernelSpec | None) -> bool:
    """Whether relays forward as rows arrive (the Plan declares it and a message size is set)."""
    return spec is not None and spec.relay and relay_rows(topo, spec) > 0


def class_bytes_per_us(topo: Topology, inter_node: bool) -> float:
    """Effective rate of one link class (NIC when ``inter_node``, else NVLink)."""
    return topo.nic_bytes_per_us if inter_node else topo.nvlink_bytes_per_us


def message_us(topo: Topology, row_bytes: float, inter_node: bool, sms: float = math.inf, rows: int | None = None) -> float:
    """Time one relay message (``rows``, default ``kernel_relay_message_rows``) takes on a link of
    its class, alone, capped by the SM rate ``sms`` (bytes/us): the head start a relay waits
    before it forwards, and the tail it forwards after its last rows arrived."""
    rate = min(class_bytes_per_us(topo, inter_node), sms)
    return (topo.kernel_relay_message_rows if rows is None else rows) * float(row_bytes) / rate


def relay_two_hop_us(bytes0: float, rate0: float, lat0_us: float, bytes1: float, rate1: float, lat1_us: float,
                     msg0_us: float, msg1_us: float) -> float:
    """One source -> one relay -> one destination, nothing else on the links, rows forwarded in
    messages: the relay starts forwarding one message after hop 0 starts arriving, and its last
    message leaves once the last rows arrived.

    ``max(lat0 + msg0 + lat1 + bytes1 / rate1, lat0 + bytes0 / rate0 + lat1 + msg1)`` -- the
    pipeline bound: the slower stage's whole transfer plus one message of the other and both
    latencies. (Without relaying the same hops take ``lat0 + bytes0 / rate0 + lat1 + bytes1 / rate1``.)
    """
    return max(lat0_us + msg0_us + lat1_us + bytes1 / rate1, lat0_us + bytes0 / rate0 + lat1_us + msg1_us)


def row_messages_us(topo: Topology, messages: float, spec: KernelSpec | None = None) -> float:
    """Serial NIC cost of ``messages`` one-row RDMA writes from one rank (low-latency kernels)."""
    return nic_message_cost_us(topo, spec) * float(messages)


def planning_us(topo: Topology, entries_per_rank: float, experts: int, ranks: int,
                spec: KernelSpec | None = None) -> float:
    """Planning work on one GPU: ``plan_fixed_us + entries x per_entry_ns + E x R x per_cell_ns``
    (entries: (token, k) entries of the largest rank; the count all-gather is charged apart; the
    fixed cost is the kernel family's own where it sets one)."""
    fixed = spec.plan_fixed_us if spec is not None and spec.plan_fixed_us is not None else topo.plan_fixed_us
    return (fixed + float(entries_per_rank) * topo.plan_per_entry_ns * 1e-3
            + float(experts) * float(ranks) * topo.plan_per_cell_ns * 1e-3)


def weight_copy_bytes_per_us(topo: Topology, inter_node: bool, engine: str | None = None, sms: int | None = None) -> float:
    """Rate of one large expert-weight copy alone: the link class's weight rate (``[weights]``
    efficiency), capped by ``sms x sm_copy_GBps`` when an SM kernel copies (``engine`` ``"sm"``;
    default: the topology's ``weights_engine`` and ``weights_sms``)."""
    engine = engine or topo.weights_engine
    rate = topo.weights_nic_bytes_per_us if inter_node else topo.weights_nvlink_bytes_per_us
    if engine == "sm":
        rate = min(rate, topo.sm_bytes_per_us(topo.weights_sms if sms is None else sms))
    return rate


def weight_copy_us(topo: Topology, nbytes: float, inter_node: bool, engine: str | None = None,
                   sms: int | None = None) -> float:
    """Time of one copy of ``nbytes`` of expert weights between two GPUs with nothing else on the
    links: latency of the class plus bytes over :func:`weight_copy_bytes_per_us` (what a planner
    that prices copies should charge; the simulator shares the links with whatever else runs)."""
    lat = topo.nic_latency_us if inter_node else topo.nvlink_latency_us
    return lat + float(nbytes) / weight_copy_bytes_per_us(topo, inter_node, engine, sms)


__all__ = ["checked_on", "class_bytes_per_us", "dispatch_epilogue_us", "epilogue_rows_R", "expand_read_bytes_per_us",
           "kernel_checks", "combine_reduce_us", "kernel_fixed_us", "kernel_launches", "kernel_sms", "message_us",
           "nic_message_cost_us", "planning_us", "proxy_host_us", "proxy_nic_share", "receive_copy_us", "reduce_bytes_per_us", "relay_active", "relay_hop_rows", "relay_rows", "relay_two_hop_us",
           "row_messages_us", "sm_cap_bytes_per_us", "weight_copy_bytes_per_us", "weight_copy_us"]


def kernel_checks() -> list[dict]:
    """The rows of ``moonep_sim/data/kernel-checks.toml``: which kernel family was checked on which
    preset against which published rows (``benchmarks/fidelity_gpu.py``)."""
    from moonep_sim.io import data_toml

    return list(data_toml("kernel-checks.toml")["check"])


def checked_on(preset: str) -> list[tuple[str, str]]:
    """(family, against what) for every kernel family checked on ``preset`` (empty: none)."""
    return [(c["family"], f"{c['against']} ({len(c['rows'])} rows)") for c in kernel_checks() if c["preset"] == preset]


def isolated_kernel_figures(plan, res, what: str, topo: Topology | None = None) -> dict:
    """A kernel timed alone (``SimOptions(isolate=what)``), counted the ways publishers count it.

    Times: ``rank_mean_us`` -- each rank's own kernel time (common start to holding its output),
    averaged over ranks, as DeepEP's tests time a kernel; ``span_us`` -- to the last rank.
    Bytes per rank (``row``: the kernel's row, ``plan.costs.dispatch_row_bytes`` for dispatch,
    ``combine_row_bytes`` for combine; FP8 rows are ``H (1 + 4/128)`` as DeepEP counts them):

    - ``rows_received``: rows the rank holds after the last hop, its own included, x row -- DeepEP
      V1's intranode (NVLink) bandwidth, and its internode test's "NVL" figure (tests/legacy/
      test_internode.py: ``recv_x.numel()``, printed beside the RDMA one);
    - ``node_pairs``: unique (token, destination node) pairs of the rank's tokens, the local node
      included, x row -- DeepEP V1's internode (RDMA) bandwidth (multi-node plans only);
    - ``scale_up`` / ``scale_out``: rows the rank sends, over every hop, to other GPUs of its node /
      to other nodes, x row -- DeepEP V2's per-rank scale-up and scale-out bytes;
    - ``selections``: every kept (token, expert) selection, x row -- the low-latency tests'
      bandwidth (whose FP8 row carries a 16-byte header) and, with a ``2H`` row, MoonEP's logical one.

    Each ``*_GBps`` is that byte count over ``rank_mean_us``. ``family`` / ``library_counts``: the
    Plan's kernel family and the keys its library's own test reports (``KernelFamily.counts``).
    With ``topo``, a dispatch whose family has a copy epilogue (DeepEP V2) also reports it as V2's
    test times it, apart from the kernel: ``epilogue_us`` (:func:`dispatch_epilogue_us` per rank,
    averaged), ``epilogue_bytes`` (rows read + rows written per rank x row, metadata not counted)
    and ``epilogue_GBps``; ``epilogue`` names the mode (``recv`` / ``expand``).
    """
    import numpy as np

    from moonep_sim.plan.kernel import FAMILIES

    R = plan.ranks
    row = plan.costs.dispatch_row_bytes if what == "dispatch" else plan.costs.combine_row_bytes
    t_mean = float(np.mean(res.per_rank["end_us"])) if R else 0.0
    out = dict(kernel=what, rank_mean_us=t_mean, span_us=float(res.layer_time_us), row_bytes=int(row))
    kept = plan.entry_rank_TK >= 0
    if plan.hops:
        out["rows_received"] = float(plan.hops[-1].dst_rows_R.mean()) * row
    out["selections"] = float(kept.sum()) / max(R, 1) * row
    geo = plan.cluster
    if R > geo.gpus_per_node:
        node = np.where(kept, geo.node_of(plan.entry_rank_TK), -1)
        s = np.sort(node, axis=1)
        uniq = ((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum(axis=1) + (s[:, :1] >= 0).sum(axis=1)
        out["node_pairs"] = float(uniq.sum()) / R * row
    up = sum(int((geo.same_node(h.src_rank_M, h.dst_rank_M) & (h.src_rank_M != h.dst_rank_M)).sum())
             for h in plan.hops)
    down = sum(int((~geo.same_node(h.src_rank_M, h.dst_rank_M)).sum()) for h in plan.hops)
    out["scale_up"] = up / max(R, 1) * row
    out["scale_out"] = down / max(R, 1) * row
    for k in ("rows_received", "node_pairs", "scale_up", "scale_out", "selections"):
        if k in out and t_mean > 0:
            out[k + "_GBps"] = out[k] / t_mean / 1e3
    recv_R, out_R = epilogue_rows_R(plan)
    if what == "dispatch" and recv_R is not None and topo is not None and topo.sm_count > 0:
        out["epilogue"] = plan.kernel.epilogue
        out["epilogue_us"] = dispatch_epilogue_us(float(recv_R.mean()), float(out_R.mean()), row, topo.mem_bytes_per_us)
        out["epilogue_bytes"] = float(np.mean(recv_R + out_R)) * row
        out["epilogue_GBps"] = out["epilogue_bytes"] / out["epilogue_us"] / 1e3 if out["epilogue_us"] > 0 else 0.0
    fam = FAMILIES.get(plan.kernel.family) if plan.kernel is not None else None
    out["family"] = fam.name if fam is not None else ""
    counts = fam.counts if fam is not None else ""
    out["library_counts"] = ({"deepep-v1": ["node_pairs", "rows_received"] if R > geo.gpus_per_node else ["rows_received"],
                              "deepep-v2": ["scale_up", "scale_out"], "selections": ["selections"]}.get(counts, []))
    return out
