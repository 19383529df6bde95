"""Closed-form collectives of a parallel layout over the topology's links: TP, DP and PP traffic.

Notation: n ranks in a group, S bytes (the whole tensor each rank holds before a reduce-scatter or
an all-reduce; after an all-gather), B the link's effective bandwidth (bytes/us), a its latency
(us). Times in microseconds.

The ring formulas (NCCL's ring algorithm; what its bus-bandwidth figures assume):

- all-reduce: ``2 (n-1)/n x S / B + 2 (n-1) a``
- reduce-scatter and all-gather: ``(n-1)/n x S / B + (n-1) a``
- a point-to-point send (a pipeline stage's activations or their gradient): ``S / B + a``

The link is NVLink when the group lies inside one node (the topology's ``gpus_per_node`` GPUs: an
NVLink domain, 72 GPUs on a GB200 NVL72) and the GPU's NIC otherwise: a ring across nodes is
bounded by its slowest hop, each GPU's rail NIC (ASSUMED: one ring per rail, no in-network
reduction).

NCCL does not always run the ring: its tuner (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``) prices every algorithm x protocol pair as ``latency + S / algorithm
bandwidth`` and runs the fastest. :func:`choose` does the same over the pairs the group can run
(``algorithm="auto"``, the default of the public functions): the ring above in protocol Simple (the
closed form, with the topology's link), the ring in LL and LL128, the tree all-reduce (a double
binary tree across nodes, a chain inside one) in LL, LL128 and Simple, NVLS inside one NVSwitch
node (all-reduce, reduce-scatter, all-gather) and NVLS-tree across nodes (all-reduce). The pairs
other than ring/Simple take NCCL's own constants (:data:`NCCL_BASE_LATENCY_US`,
:data:`NCCL_HW_LATENCY_US`, its protocol bandwidth factors and tree correction table) over the
topology's link bandwidths. ASSUMED: NCCL's per-channel bandwidth caps (``perChMax*Bws``,
``llMaxBws``) are left out (they need its channel count); the bus bandwidth is the slowest link's;
NVLS needs a Hopper or Blackwell NVSwitch node (:func:`nvls_capable`, by the topology's name); no
CollNet (SHARP) and no PAT (one GPU per node only).

Where the groups sit (:func:`group_span`): ranks are numbered in Megatron-Core's default order,
TP fastest, then CP, then DP, PP slowest (``tp-cp-dp-pp``); the expert grid of a stage numbers its
ranks ETP fastest, then EP, then expert-DP. So a TP group is ``tp`` consecutive ranks, a DP group
``dp`` ranks ``tp x cp`` apart, an EP group ``ep`` ranks ``etp`` apart, and a pipeline stage
``tp x cp x dp`` consecutive ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moonep_sim.errors import require

#: Algorithms a collective may be asked for: ``auto`` runs NCCL's choice (:func:`choose`).
ALGORITHMS = ("auto", "ring", "tree", "nvls")
#: NCCL's protocols, in its order (the columns of the tables below).
PROTOCOLS = ("ll", "ll128", "simple")
# NCCL src/graph/tuning.cc (NVIDIA/nccl 5067397c), ncclTunerConstantsDefaults:
#: ``baseLatencies`` (us) per algorithm, columns LL, LL128, Simple.
NCCL_BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0),
                        "nvls_tree": (0.0, 0.0, 0.0)}
#: ``hwLatencies`` (us per step) for the NVLINK and NET hardware, per algorithm, columns LL, LL128, Simple.
NCCL_HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0), "nvls_tree": (0.0, 0.0, 25.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0), "nvls_tree": (0.0, 0.0, 20.9)},
}
#: ``nvlsEfficiency`` for Hopper and Blackwell.
NCCL_NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}
#: ``treeCorrectionFactor[protocol][log2(bytes / 64)]`` for the tree all-reduce (1 outside the table).
NCCL_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
#: NCCL's NVLS channels on an NVSwitch node (ASSUMED 16: the ``(nChannels - 1) / nChannels`` term).
NVLS_CHANNELS = 16
# NCCL's host network overhead per ring step across nodes (``getNetOverhead``: 1 us, x3 for Simple).
_NET_OVERHEAD_US = 1.0


@dataclass(frozen=True)
class Link:
    """One link class a collective runs over: ``name`` (nvlink / nic), effective bandwidth in
    bytes per microsecond and latency per hop in microseconds."""

    name: str
    bytes_per_us: float
    latency_us: float


def nvlink(topo) -> Link:
    """The topology's NVLink (bandwidth x efficiency, its latency)."""
    return Link("nvlink", topo.nvlink_bytes_per_us, topo.nvlink_latency_us)


def nic(topo) -> Link:
    """One GPU's NIC port (the topology's NIC bandwidth x efficiency; NIC + fabric latency)."""
    return Link("nic", topo.nic_bytes_per_us, topo.nic_latency_us + topo.fabric_latency_us)


@dataclass(frozen=True)
class Span:
    """Where a group's ``nodes x per_node`` ranks sit: ``intra`` the NVLink inside a node, ``inter``
    the NIC between nodes (None inside one node), ``nvls`` the NVSwitch generation (``hopper`` /
    ``blackwell``) when the node has NVLS, else ``""``."""

    nodes: int
    per_node: int
    intra: Link
    inter: Link | None = None
    nvls: str = ""


def nvls_capable(topo) -> str:
    """The NVLS generation of the topology's NVSwitch node (``hopper``, ``blackwell``) or ``""``
    (ASSUMED from its name: the NVIDIA H- and B- presets are NVSwitch nodes; others have no NVLS)."""
    name = str(topo.name).lower()
    if name.startswith(("b200", "gb200", "b300", "gb300")):
        return "blackwell"
    return "hopper" if name.startswith(("h100", "h200", "h800", "h20")) else ""


def group_shape(topo, size: int, stride: int = 1, gpus_per_node: int | None = None) -> Span:
    """The nodes a group of ``size`` ranks ``stride`` apart covers and its ranks per node (the
    layouts here align every group on its span, :func:`group_link`)."""
    G = gpus_per_node or topo.gpus_per_node
    span = group_span(size, stride)
    if span <= G:
        return Span(1, size, nvlink(topo), None, nvls_capable(topo))
    per_node = max(1, min(size, G // stride)) if stride < G else 1
    nodes = max(2, -(-size // per_node))   # it leaves the node: at least two
    return Span(nodes, per_node, nvlink(topo), nic(topo), nvls_capable(topo))


def _default_span(n: int, link: Link) -> Span:
    """A group over one link class: inside one node (NVLink) or one rank per node (a NIC), no NVLS."""
    if link.name == "nvlink":
        return Span(1, n, link)
    return Span(n, 1, link, link)


def _nccl_time(coll: str, algo: str, proto: int, S: float, n: int, sp: Span) -> float:
    """NCCL's modelled time (us) of ``coll`` (``allreduce``, ``reducescatter``, ``allgather``) of
    ``S`` bytes over ``n`` ranks in algorithm ``algo`` and protocol index ``proto``; ``inf`` where
    NCCL would not run the pair (``ncclTopoTuneModel``'s bandwidths and latencies, then
    ``ncclTopoGetAlgoTime``)."""
    ar = coll == "allreduce"
    nodes, ppn = sp.nodes, sp.per_node
    B = sp.inter.bytes_per_us if nodes > 1 else sp.intra.bytes_per_us   # the slowest hop's bus bandwidth
    nsteps = 2 * (n - 1) if ar else n - 1
    intra_hw = NCCL_HW_LATENCY_US["nvlink"]
    inter_lat = NCCL_HW_LATENCY_US["net"]["tree" if ppn == 1 else algo][proto]
    lat = NCCL_BASE_LATENCY_US[algo][proto]
    if algo == "ring":
        bus = B * (0.5 if proto == 0 else 0.92)
        alg = bus * n / nsteps
        intra_lat = intra_hw["ring"][proto]
        if nodes > 1:
            intra_lat = max(intra_lat, _NET_OVERHEAD_US * (3 if proto == 2 else 1))
        inter_steps = 0 if nodes == 1 else (2 if ar else 1) * (nodes - 1)
        lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
    elif algo == "tree":
        if not ar:
            return math.inf
        bus = B * 0.92
        bus *= (1 / 3.8, (7 / 9 if nodes == 1 else 120 / 128), 1.0)[proto]
        log_size = int(math.log2(max(S, 64) / 64))
        if 0 <= log_size < 23:
            bus *= NCCL_TREE_CORRECTION[proto][log_size]
        alg = bus * 0.5
        lat += 2 * ((ppn - 1) * intra_hw["tree"][proto] + int(math.log2(nodes)) * inter_lat)
    else:   # nvls inside a node, nvls_tree across nodes: Simple only, NVSwitch nodes only
        if proto != 2 or not sp.nvls or ppn < 2 or (nodes > 1 and (algo == "nvls" or not ar)) \
                or (nodes == 1 and algo == "nvls_tree"):
            return math.inf
        intra_bw = sp.intra.bytes_per_us * NCCL_NVLS_EFFICIENCY[sp.nvls] * (NVLS_CHANNELS - 1) / NVLS_CHANNELS
        intra_bw *= 2.0 if ar else (ppn - 1) / ppn
        bus = intra_bw if nodes == 1 else min(intra_bw, sp.inter.bytes_per_us * (2 if nodes <= 2 else 1))
        alg = bus * n / nsteps if ar else bus
        lat = intra_hw[algo][proto] + (0.0 if nodes == 1 else 2 * int(math.log2(nodes)) * inter_lat)
    return lat + S / alg


def _ring_us(coll: str, S: float, n: int, link: Link) -> float:
    """The closed-form ring (Simple) in us: ``k (n-1)/n S/B + k (n-1) a``, k = 2 for an all-reduce, else 1."""
    k = 2.0 if coll == "allreduce" else 1.0
    return k * (n - 1) / n * S / link.bytes_per_us + k * (n - 1) * link.latency_us


def choose(coll: str, S: float, n: int, link: Link, span: Span | None = None,
           algorithm: str = "auto") -> tuple[str, str, float]:
    """(algorithm, protocol, us) NCCL runs ``coll`` (``allreduce``, ``reducescatter``,
    ``allgather``) of ``S`` bytes over ``n`` ranks with: the fastest pair of ``algorithm`` (``auto``:
    of all; ``ring`` is the closed-form ring in Simple and NCCL's ring in LL / LL128 -- pinned to the
    closed form, Simple, when asked for by name; ``tree``; ``nvls``: NVLS or NVLS-tree). ``span``:
    where the ranks sit (:func:`group_shape`; default: all over ``link``). ``(ring, simple, 0)`` for
    nothing to move; ``inf`` us where NCCL would not run the asked algorithm (a tree reduce-scatter
    or all-gather, NVLS without an NVSwitch node or across nodes for those)."""
    require(algorithm in ALGORITHMS, f"algorithm ({algorithm!r}) must be one of {', '.join(ALGORITHMS)}")
    require(coll in ("allreduce", "reducescatter", "allgather"),
            f"collective ({coll!r}) must be allreduce, reducescatter or allgather")
    if n <= 1 or S <= 0:
        return "ring", "simple", 0.0
    ring = ("ring", "simple", _ring_us(coll, S, n, link))
    if algorithm == "ring":
        return ring
    sp = span or _default_span(n, link)
    algos = {"auto": ("ring", "tree", "nvls", "nvls_tree"), "tree": ("tree",), "nvls": ("nvls", "nvls_tree")}[algorithm]
    best = ring if algorithm == "auto" else (algos[0], "simple", math.inf)
    for a in algos:
        for pi, pn in enumerate(PROTOCOLS):
            if a == "ring" and pi == 2:
                continue   # ring Simple is the closed form above
            t = _nccl_time(coll, a, pi, S, n, sp)
            if t < best[2]:
                best = (a, pn, t)
    return best


def group_span(size: int, stride: int) -> int:
    """Consecutive ranks a group of ``size`` ranks ``stride`` apart spans (first to last + 1)."""
    require(size >= 1 and stride >= 1, f"group size ({size}) and stride ({stride}) must be >= 1")
    return (size - 1) * stride + 1


def group_link(topo, size: int, stride: int = 1, gpus_per_node: int | None = None) -> Link:
    """The link a group of ``size`` ranks ``stride`` apart runs over: NVLink when the group lies
    inside one node (its span within ``gpus_per_node``, default the topology's, and aligned: the
    layouts here start every group at a multiple of its span), else the NIC."""
    G = gpus_per_node or topo.gpus_per_node
    return nvlink(topo) if group_span(size, stride) <= G else nic(topo)


def all_reduce_us(S: float, n: int, link: Link, algorithm: str = "auto", span: Span | None = None) -> float:
    """All-reduce of ``S`` bytes over ``n`` ranks (0 for n = 1): the ring's ``2 (n-1)/n S/B + 2 (n-1) a``
    with ``algorithm="ring"``, else NCCL's choice (:func:`choose`; never slower than the ring)."""
    return choose("allreduce", S, n, link, span, algorithm)[2]


def reduce_scatter_us(S: float, n: int, link: Link, algorithm: str = "auto", span: Span | None = None) -> float:
    """Reduce-scatter of ``S`` bytes (each rank keeps S/n): the ring's ``(n-1)/n S/B + (n-1) a`` with
    ``algorithm="ring"``, else NCCL's choice (ring or NVLS inside a node)."""
    return choose("reducescatter", S, n, link, span, algorithm)[2]


def all_gather_us(S: float, n: int, link: Link, algorithm: str = "auto", span: Span | None = None) -> float:
    """All-gather to ``S`` bytes per rank (each contributes S/n): the reduce-scatter's time, its algorithms."""
    return choose("allgather", S, n, link, span, algorithm)[2]


def send_us(S: float, link: Link) -> float:
    """One point-to-point send of ``S`` bytes: ``S/B + a`` (0 for nothing)."""
    if S <= 0:
        return 0.0
    return S / link.bytes_per_us + link.latency_us


def stage_boundary_links(topo, stage_ranks: int, pp: int, gpus_per_node: int | None = None) -> list[Link]:
    """The link each of the ``pp - 1`` stage boundaries crosses: stage s holds ranks
    ``[s x stage_ranks, (s+1) x stage_ranks)`` and sends from each of its ranks to the rank
    ``stage_ranks`` above; NVLink when both stages lie in one node, else the NIC."""
    G = gpus_per_node or topo.gpus_per_node
    out = []
    for s in range(pp - 1):
        first, last = s * stage_ranks, (s + 2) * stage_ranks - 1   # the stage's first rank, the next's last
        out.append(nvlink(topo) if first // G == last // G else nic(topo))
    return out


__all__ = ["ALGORITHMS", "Link", "NCCL_BASE_LATENCY_US", "NCCL_HW_LATENCY_US", "NCCL_NVLS_EFFICIENCY",
           "NCCL_TREE_CORRECTION", "PROTOCOLS", "Span", "all_gather_us", "all_reduce_us", "choose", "group_link",
           "group_shape", "group_span", "nic", "nvlink", "nvls_capable", "reduce_scatter_us", "send_us",
           "stage_boundary_links"]
