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
reduction, no tree algorithm).

Where the groups sit (:func:`group_span`): ranks are numbered in Megatron-Core's default order,
TP fastest, then CP, then DP, PP slowest (``tp-cp-dp-pp``); the expert grid of a stage numbers its
ranks ETP fastest, then EP, then expert-DP. So a TP group is ``tp`` consecutive ranks, a DP group
``dp`` ranks ``tp x cp`` apart, an EP group ``ep`` ranks ``etp`` apart, and a pipeline stage
``tp x cp x dp`` consecutive ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from moonep_sim.errors import require


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


def all_reduce_us(S: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``S`` bytes over ``n`` ranks: ``2 (n-1)/n S/B + 2 (n-1) a`` (0 for n = 1)."""
    if n <= 1 or S <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * S / link.bytes_per_us + 2.0 * (n - 1) * link.latency_us


def reduce_scatter_us(S: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of ``S`` bytes (each rank keeps S/n): ``(n-1)/n S/B + (n-1) a``."""
    if n <= 1 or S <= 0:
        return 0.0
    return (n - 1) / n * S / link.bytes_per_us + (n - 1) * link.latency_us


def all_gather_us(S: float, n: int, link: Link) -> float:
    """Ring all-gather to ``S`` bytes per rank (each contributes S/n): the reduce-scatter's time."""
    return reduce_scatter_us(S, n, link)


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


__all__ = ["Link", "all_gather_us", "all_reduce_us", "group_link", "group_span", "nic", "nvlink",
           "reduce_scatter_us", "send_us", "stage_boundary_links"]
