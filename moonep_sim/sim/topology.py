"""Cluster topologies: the hardware a Plan is timed on (TOML files and presets).

Notation: R ranks (GPUs), G GPUs per node, N nodes, P ports. Units: bandwidths in GB/s
(1 GB/s = 1e9 bytes per second = 1e3 bytes per microsecond) *per direction*, latencies in
microseconds, compute in TFLOP/s (1e12 FLOP per second). Simulated time is always microseconds.

A topology is a node of ``gpus_per_node`` GPUs joined by NVLink (each GPU has one NVLink port to a
switch, ``nvlink.bandwidth_GBps`` each way), and nodes joined by a rail-optimised fabric: GPU i of
every node has its own NIC (``nic.bandwidth_GBps`` each way) on leaf switch i ("rail" i); a
transfer between different rails climbs through the spine, whose per-rail up/down capacity is the
rail's total NIC bandwidth divided by ``fabric.oversubscription``. The file format is documented
in ``docs/topology.md``; :func:`load_topology` reads a preset name or a file.

``local-gloo`` models this machine's CPU processes; :func:`load_topology` prefers the calibrated
file that ``moonep-sim calibrate`` writes at :func:`calibrated_topology_path` when it exists.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.io import data_toml, read_toml
from moonep_sim.plan.placement import ClusterShape

MAX_CONSTANT = 1e15
"""The largest magnitude a topology constant may have (bandwidths in GB/s, latencies in us, counts)."""

_PRESET_PREFIX = "topology-"
#: TOML table -> (field prefix, keys). A key ``k`` of table ``t`` sets field ``{prefix}{k}``.
_TABLES = {
    "node": ("", ("gpus_per_node", "nodes")),
    "nvlink": ("nvlink_", ("bandwidth_GBps", "latency_us", "efficiency", "duplex", "peer_GBps")),
    "nic": ("nic_", ("bandwidth_GBps", "latency_us", "efficiency", "p2p_efficiency", "duplex", "attach", "rails_per_node",
                     "message_rate_Mps")),
    "fabric": ("fabric_", ("oversubscription", "latency_us")),
    "gpu": ("gpu_", ("tflops", "tflops_fp8", "tflops_fp4", "mem_bandwidth_GBps", "memory_GiB", "compute_efficiency", "mem_efficiency",
                     "launch_us", "slot_us", "padding_compute")),
    "host": ("host_", ("cores", "nodes_per_host", "sharing", "copy_bandwidth_GBps", "message_us",
                       "weight_copy_bandwidth_GBps")),
    "cpu": ("cpu_", ("memory_GiB", "pcie_GBps", "mem_bandwidth_GBps")),
    "planning": ("plan_", ("fixed_us", "measured_factor", "routing_bytes_per_entry", "per_entry_ns", "per_cell_ns")),
    "kernel": ("kernel_", ("dispatch_fixed_us", "combine_fixed_us", "relay_message_rows", "nic_message_us")),
    "sm": ("sm_", ("count", "copy_GBps")),
    "weights": ("weights_", ("engine", "nvlink_efficiency", "nic_efficiency", "sms")),
}
DUPLEX = ("full", "half")
ATTACH = ("gpu", "node")
SHARING = ("static", "processor")
WEIGHT_ENGINES = ("copy_engine", "sm")


@dataclass(frozen=True)
class Topology:
    """One cluster's constants (see the module docstring for units and the fabric model).

    name / description: identification.  sources: constant name -> where its value comes from.
    gpus_per_node (G): GPUs joined by NVLink.  nodes: 0 = as many as the plan's ranks need.
    nvlink_bandwidth_GBps, nvlink_latency_us, nvlink_efficiency: each GPU's NVLink port.
    nic_bandwidth_GBps, nic_latency_us, nic_efficiency: one NIC (one rail): by default one per GPU.
    nic_rails_per_node: NICs (rails) per node; 0 (default) = one per GPU. More rails than GPUs (a
        multiple of G: AWS p5's 32 EFA adapters for 8 GPUs) give each GPU ``rails / G`` NICs, which the
        simulator joins into one port of ``rails / G x bandwidth`` per GPU (a rail-optimised fabric
        keeps NIC j of every node on leaf j, so a GPU's NICs reach the same GPU index elsewhere); fewer
        (a divisor of G) make ``G / rails`` GPUs share one NIC (each GPU may use all of it, the group
        together at most one NIC's bandwidth).
    nic_message_rate_Mps: messages per microsecond one NIC can post (millions per second); 0 = no
        limit. A GPU's share is ``rate x rails / G``; kernels that send one message per row (the
        low-latency kernels) pay ``1 / share`` us per message at the sender when that exceeds the
        kernel's own per-message cost (``kernel_nic_message_us``).
    nvlink_peer_GBps: 0 (default) = GPUs of a node meet at a switch (NVSwitch): a GPU's port is
        ``nvlink_bandwidth_GBps`` to any mix of peers. > 0 = a full mesh of direct links (AMD
        Infinity Fabric): each ordered GPU pair has its own link of this bandwidth per direction
        (times ``nvlink_efficiency``), and ``nvlink_bandwidth_GBps`` is the sum over a GPU's links.
    fabric_oversubscription: >= 1; the spine carries (rail NIC bandwidth / this) per rail and
        direction. fabric_latency_us: extra latency of a cross-rail (spine) path.
    gpu_tflops, gpu_mem_bandwidth_GBps: dense bf16 peak and memory bandwidth of one GPU.
    gpu_tflops_fp8: dense FP8 peak (TFLOP/s) of one GPU; 0 = not given (FP8 GEMMs then run at
        the BF16 peak).  gpu_tflops_fp4: dense FP4 peak; 0 = the GPU has no FP4 tensor cores (fp4
        weights and KV caches are then refused: ``moonep_sim.step.dtypes``).  gpu_memory_GiB: HBM capacity of one GPU (GiB); 0 = not given (the step
        model then gives no out-of-memory verdict). Both are read by ``moonep_sim.step``.
    gpu_compute_efficiency, gpu_mem_efficiency: the achieved fraction of each in a grouped GEMM.
    gpu_launch_us: fixed cost of one grouped-GEMM launch.
    plan_fixed_us: fixed cost of planning on the GPU (besides the count all-gather).
    efficiency factors multiply the peak: the simulator uses ``bandwidth * efficiency``.

    Terms a cluster of CPU processes needs and a GPU cluster does not (all off by default, so the
    GPU presets ignore them; see ``docs/topology.md``):

    nvlink_duplex, nic_duplex: ``"full"`` (default) or ``"half"``: both directions of one rank
        pair's connection share one capacity (the link class's per-direction bandwidth), as a
        gloo TCP pair does (one thread alternately writes and reads).
    nic_p2p_efficiency: 0 (default) = ``nic_efficiency`` for every hop; else the efficiency of the
        inter-node transfers of hops the gloo executor sends point-to-point (its last hop when
        ``moonep_sim.plan.direct.last_hop_is_direct`` says so, and that hop's adjoint in combine):
        over shaped TCP links gloo's ``all_to_all_single`` and its ``isend``/``irecv`` reach
        different fractions of the link (the testbed probe measures both).
    nic_attach: ``"gpu"`` (default: one NIC per GPU, on its rail) or ``"node"``: one link per node
        of ``gpus_per_node x nic.bandwidth_GBps`` shared max-min by all the node's inter-node flows,
        any one rank able to use all of it (processes behind one network interface).
    host_cores: CPU cores of one host (0 = not modelled).  host_nodes_per_host: how many nodes
        share one host (0 = every node on one host, e.g. ranks emulating nodes on one machine;
        default 1). A rank's CPU work (expert compute, local copies, planning) shares its host's
        cores; ``gpu_tflops``, ``gpu_mem_bandwidth_GBps``, ``host_copy_bandwidth_GBps`` are then
        the rates of one process with a core to itself.
    host_sharing: how (when ``host_cores`` > 0). ``"static"`` (default): every rank's CPU work is
        stretched by ``max(1, ranks on its host / host_cores)`` at all times, as if every rank were
        always busy -- which also stands in for the CPU the ranks' loopback transfers need (gloo's
        TCP copies run on the same cores, so a collective some ranks leave for compute while
        others still wait on it is starved: see ``docs/topology.md``). ``"processor"``: exact
        processor sharing of the CPU work alone (``moonep_sim.sim.cpu``): while n of the host's
        ranks are busy each progresses at ``min(1, host_cores / n)``, a waiting rank uses nothing,
        and transfers use no CPU.
    host_copy_bandwidth_GBps: rate of one local pass over rows (a gather or scatter-add of row
        bytes) by the executor, 0 = free. Charged per rank and hop: a gather of the rows a rank
        sends before each hop, a pass over the rows it receives after each hop; the last dispatch
        hop's pass is the expand into the expert layout (the rank's final rows) and the first
        combine hop's the weighted gather of them.
    host_weight_copy_bandwidth_GBps: rate of the pass over copied expert weights (gathered at the
        home before sending, placed at the receiver): large, freshly allocated buffers; 0 = the
        row-pass rate.
    host_message_us: serial cost per message at the sender: in each phase a rank's transfers
        start after the path latency plus ``message_us x`` the number of other ranks it sends to
        (0 = none; the link latency then stands for a whole all-to-all, as on GPUs).
    cpu_memory_GiB / cpu_pcie_GBps / cpu_mem_bandwidth_GBps: the host side of a GPU node, what
        optimizer CPU offload uses (``moonep_sim.step.offload``): host DRAM per node (GiB; 0 = not
        given: offload refused), each GPU's PCIe link to the host (GB/s per direction), and the
        node's DRAM bandwidth (GB/s, all sockets), over which the CPU Adam step streams.
    gpu_slot_us: fixed cost per expert slot with rows (0 = one grouped GEMM per rank: only
        ``gpu_launch_us``); an executor that runs one matmul chain per expert pays it per slot.
    gpu_padding_compute: the fraction of padding rows that cost compute (1 = a static-shape
        grouped GEMM computes them, the default; 0 = the executor skips them).
    plan_measured_factor: 0 = off; else planning also costs ``factor x plan.plan_seconds`` (the
        planner's own measured CPU time for this Plan, made in the simulating process), run on
        the shared cores above -- every rank plans the same global Plan at once.
    plan_routing_bytes_per_entry: 0 = the planning all-gather moves per-expert counts (4 bytes x
        E per rank); > 0 = it moves every token's routing, this many bytes per (token, k) entry,
        padded to the largest rank's token count.

    GPU kernel terms (``moonep_sim.sim.kernels`` has their closed forms; every one is 0 = off, as on
    the CPU presets, which have not measured them):

    plan_per_entry_ns, plan_per_cell_ns: planning on the GPU grows with the work: ``per_entry_ns``
        per (token, k) entry of the largest rank (the local count and row-assignment passes) and
        ``per_cell_ns`` per cell of the ``E x R`` count matrix (the balancing solve), on top of
        ``plan_fixed_us``.
    kernel_dispatch_fixed_us, kernel_combine_fixed_us: fixed cost of one dispatch / combine kernel
        launch on a rank (launch, count notification, flag polling), paid before its first bytes
        move; a Plan whose hops are separate kernels pays it per hop, a relayed Plan (one kernel
        forwarding as rows arrive, ``moonep_sim.plan.kernel.KernelSpec.relay``) once.
    kernel_relay_message_rows: rows per message a relay rank forwards as they arrive (0 = relays
        wait for their whole hop, as separate collectives do). Only Plans that declare relayed hops
        use it.
    kernel_nic_message_us: serial NIC cost per message (one RDMA write per row) for Plans that send
        one message per row (``KernelSpec.row_messages``, the low-latency kernels).
    sm_count: SMs per GPU (0 = SM-limited copies off).  sm_copy_GBps: copy rate one SM drives
        (GB/s) in a GPU-initiated copy kernel. A Plan that declares an SM budget b
        (``KernelSpec.sms``) gets per-rank send and receive ports of ``min(b, sm_count) x
        sm_copy_GBps`` on every transfer of its dispatch and combine hops (local copies
        included), separately from the links' ``bandwidth x efficiency``.
    weights_engine: what copies expert weights (prefetch, migration, gradient reduce):
        ``"copy_engine"`` (default: DMA engines, no SM port) or ``"sm"`` (an SM kernel of
        ``weights_sms`` SMs, through the send/receive SM ports).
    weights_nvlink_efficiency, weights_nic_efficiency: the achieved fraction of the NVLink / NIC
        bandwidth of one large weight copy (0 = the link class's ``efficiency``): large DMA copies
        reach more of a link than a kernel's row messages.
    """

    # Defaults: the ``h800-cx7`` preset's constants (DeepEP's published test setup), so a Topology
    # built in code with a few fields changed is that cluster with those changes
    # (tests/test_sim_topology.py holds them equal; the preset file cites each one's source).
    name: str
    description: str = ""
    gpus_per_node: int = 8
    nodes: int = 0
    nvlink_bandwidth_GBps: float = 200.0
    nvlink_latency_us: float = 2.0
    nvlink_efficiency: float = 0.7021
    nvlink_peer_GBps: float = 0.0
    nic_bandwidth_GBps: float = 50.0
    nic_latency_us: float = 4.0
    nic_efficiency: float = 0.9
    nic_p2p_efficiency: float = 0.0
    nic_rails_per_node: int = 0
    nic_message_rate_Mps: float = 0.0
    fabric_oversubscription: float = 1.0
    fabric_latency_us: float = 1.0
    gpu_tflops: float = 989.0
    gpu_tflops_fp8: float = 1979.0
    gpu_tflops_fp4: float = 0.0
    gpu_mem_bandwidth_GBps: float = 3350.0
    gpu_memory_GiB: float = 80.0
    gpu_compute_efficiency: float = 0.6
    gpu_mem_efficiency: float = 0.8
    gpu_launch_us: float = 10.0
    plan_fixed_us: float = 20.0
    gpu_slot_us: float = 0.0
    gpu_padding_compute: float = 1.0
    nvlink_duplex: str = "full"
    nic_duplex: str = "full"
    nic_attach: str = "gpu"
    host_cores: float = 0.0
    host_nodes_per_host: int = 1
    host_sharing: str = "static"
    host_copy_bandwidth_GBps: float = 0.0
    host_message_us: float = 0.0
    host_weight_copy_bandwidth_GBps: float = 0.0
    cpu_memory_GiB: float = 2048.0
    cpu_pcie_GBps: float = 64.0
    cpu_mem_bandwidth_GBps: float = 614.4
    plan_measured_factor: float = 0.0
    plan_routing_bytes_per_entry: float = 0.0
    plan_per_entry_ns: float = 0.02
    plan_per_cell_ns: float = 3.124
    kernel_dispatch_fixed_us: float = 26.97
    kernel_combine_fixed_us: float = 11.86
    kernel_relay_message_rows: int = 16
    kernel_nic_message_us: float = 0.003
    sm_count: int = 132
    sm_copy_GBps: float = 20.88
    weights_engine: str = "copy_engine"
    weights_nvlink_efficiency: float = 1.0
    weights_nic_efficiency: float = 0.0
    weights_sms: int = 0
    sources: dict[str, str] = field(default_factory=dict)
    path: str = ""

    def __post_init__(self) -> None:
        require(self.gpus_per_node >= 1, f"gpus_per_node ({self.gpus_per_node}) must be >= 1 (topology {self.name})")
        require(self.host_nodes_per_host >= 0,
                f"host nodes_per_host ({self.host_nodes_per_host}) must be >= 0 (topology {self.name}): 0 = all on one host")
        require(self.nodes >= 0, f"nodes ({self.nodes}) must be >= 0 (topology {self.name}): 0 = derived from ranks")
        for f in ("nvlink_bandwidth_GBps", "nic_bandwidth_GBps", "gpu_tflops", "gpu_mem_bandwidth_GBps"):
            require(getattr(self, f) > 0, f"{f} ({getattr(self, f)}) must be > 0 (topology {self.name})")
        for f in ("nvlink_efficiency", "nic_efficiency", "gpu_compute_efficiency", "gpu_mem_efficiency"):
            v = getattr(self, f)
            require(0 < v <= 1, f"{f} ({v}) must lie in (0, 1] (topology {self.name})")
        require(self.nic_attach in ATTACH,
                f"nic_attach ({self.nic_attach!r}) must be one of {', '.join(ATTACH)} (topology {self.name})")
        require(0 <= self.nic_p2p_efficiency <= 1,
                f"nic p2p_efficiency ({self.nic_p2p_efficiency}) must lie in [0, 1] (topology {self.name}): "
                f"0 = nic efficiency")
        require(self.host_sharing in SHARING,
                f"host sharing ({self.host_sharing!r}) must be one of {', '.join(SHARING)} (topology {self.name})")
        for f in ("nvlink_duplex", "nic_duplex"):
            require(getattr(self, f) in DUPLEX,
                    f"{f} ({getattr(self, f)!r}) must be one of {', '.join(DUPLEX)} (topology {self.name})")
        for f in ("nvlink_latency_us", "nic_latency_us", "fabric_latency_us", "gpu_launch_us", "plan_fixed_us",
                  "host_cores", "host_nodes_per_host", "host_copy_bandwidth_GBps", "host_message_us", "host_weight_copy_bandwidth_GBps", "gpu_slot_us", "plan_measured_factor",
                  "plan_routing_bytes_per_entry", "plan_per_entry_ns", "plan_per_cell_ns", "kernel_dispatch_fixed_us",
                  "kernel_combine_fixed_us", "kernel_relay_message_rows", "kernel_nic_message_us", "sm_count",
                  "sm_copy_GBps", "weights_sms", "gpu_tflops_fp8", "gpu_tflops_fp4", "gpu_memory_GiB", "cpu_memory_GiB",
                  "cpu_pcie_GBps", "cpu_mem_bandwidth_GBps"):
            require(getattr(self, f) >= 0, f"{f} ({getattr(self, f)}) must be >= 0 (topology {self.name})")
        for f in ("weights_nvlink_efficiency", "weights_nic_efficiency"):
            v = getattr(self, f)
            require(0 <= v <= 1, f"{f} ({v}) must lie in [0, 1] (topology {self.name}): 0 = the link's efficiency")
        require(self.weights_engine in WEIGHT_ENGINES,
                f"weights engine ({self.weights_engine!r}) must be one of {', '.join(WEIGHT_ENGINES)} "
                f"(topology {self.name})")
        require((self.sm_count > 0) == (self.sm_copy_GBps > 0),
                f"sm count ({self.sm_count}) and sm copy_GBps ({self.sm_copy_GBps}) must be both 0 (off) or both "
                f"> 0 (topology {self.name})")
        require(self.weights_engine != "sm" or (self.weights_sms > 0 and self.sm_count > 0),
                f"weights sms ({self.weights_sms}) must be > 0, with [sm] count and copy_GBps set, when weights "
                f"engine is 'sm' (topology {self.name})")
        require(0 <= self.gpu_padding_compute <= 1,
                f"gpu padding_compute ({self.gpu_padding_compute}) must lie in [0, 1] (topology {self.name})")
        G, rails = self.gpus_per_node, self.nic_rails_per_node
        require(rails >= 0 and (rails == 0 or rails % G == 0 or G % rails == 0),
                f"nic rails_per_node ({rails}) must be 0 (one per GPU), a multiple or a divisor of gpus_per_node "
                f"({G}) (topology {self.name})")
        require(self.nic_message_rate_Mps >= 0,
                f"nic message_rate_Mps ({self.nic_message_rate_Mps}) must be >= 0 (topology {self.name}): 0 = no limit")
        require(self.nvlink_peer_GBps >= 0,
                f"nvlink peer_GBps ({self.nvlink_peer_GBps}) must be >= 0 (topology {self.name}): 0 = a switch")
        require(self.nvlink_peer_GBps == 0 or self.nvlink_duplex == "full",
                f"nvlink peer_GBps ({self.nvlink_peer_GBps}) needs nvlink duplex 'full' (topology {self.name})")
        require(self.fabric_oversubscription >= 1,
                f"fabric oversubscription ({self.fabric_oversubscription}) must be >= 1 (topology {self.name})")

    # -- effective rates (bytes per microsecond, FLOP per microsecond) --------------------
    @property
    def nvlink_bytes_per_us(self) -> float:
        return self.nvlink_bandwidth_GBps * self.nvlink_efficiency * 1e3

    @property
    def nics_per_gpu(self) -> float:
        """NICs per GPU: ``rails_per_node / gpus_per_node`` (1 when one per GPU; < 1 when shared)."""
        return self.nic_rails_per_node / self.gpus_per_node if self.nic_rails_per_node else 1.0

    @property
    def nic_share(self) -> int:
        """GPUs that share one NIC (1 unless ``nic_rails_per_node`` < ``gpus_per_node``)."""
        r = self.nic_rails_per_node
        return self.gpus_per_node // r if 0 < r < self.gpus_per_node else 1

    @property
    def nic_bytes_per_us(self) -> float:
        """One GPU's NIC port (bytes per microsecond): its NICs joined (``max(1, rails / G)`` of them);
        a NIC shared by ``nic_share`` GPUs is a port of one NIC per GPU, their group capped apart."""
        return self.nic_bandwidth_GBps * self.nic_efficiency * 1e3 * max(self.nics_per_gpu, 1.0)

    @property
    def nic_message_us(self) -> float:
        """Serial cost per NIC message at one GPU from the NIC's message rate: ``1 / (rate x rails /
        G)`` us; 0 = no limit."""
        if self.nic_message_rate_Mps <= 0:
            return 0.0
        return 1.0 / (self.nic_message_rate_Mps * self.nics_per_gpu)

    def gpus_per_node_for(self, ranks: int) -> int:
        """GPUs per node a run of ``ranks`` uses by default: ``min(G, R)`` when that tiles R, else the
        largest divisor of R below G (e.g. EP128 on 72-GPU NVLink domains: 2 domains of 64 GPUs), so
        every node holds the same number of ranks."""
        g = max(1, min(self.gpus_per_node, int(ranks)))
        while ranks % g:
            g -= 1
        return g

    @property
    def flops_per_us(self) -> float:
        return self.gpu_tflops * self.gpu_compute_efficiency * 1e6

    @property
    def mem_bytes_per_us(self) -> float:
        return self.gpu_mem_bandwidth_GBps * self.gpu_mem_efficiency * 1e3

    def sm_bytes_per_us(self, sms: int) -> float:
        """Copy rate (bytes per microsecond) of a kernel on ``sms`` SMs of one GPU: ``min(sms,
        sm_count) x sm_copy_GBps``; ``inf`` when SM limits are off (``sm_count`` 0) or ``sms`` is 0
        (the kernel declares no budget)."""
        if self.sm_count <= 0 or sms <= 0:
            return float("inf")
        return min(int(sms), self.sm_count) * self.sm_copy_GBps * 1e3

    @property
    def weights_nvlink_bytes_per_us(self) -> float:
        """Rate of one large expert-weight copy over NVLink (bytes per microsecond), before any SM cap."""
        return self.nvlink_bandwidth_GBps * (self.weights_nvlink_efficiency or self.nvlink_efficiency) * 1e3

    @property
    def weights_nic_bytes_per_us(self) -> float:
        """Rate of one large expert-weight copy over the NIC (bytes per microsecond), before any SM cap."""
        return self.nic_bandwidth_GBps * (self.weights_nic_efficiency or self.nic_efficiency) * 1e3 * max(self.nics_per_gpu, 1.0)

    @property
    def copy_bytes_per_us(self) -> float:
        """Local row-pass rate (bytes per microsecond); 0 = passes are free."""
        return self.host_copy_bandwidth_GBps * 1e3

    def cpu_share_R(self, ranks: int) -> np.ndarray:
        """float64 [R]: ``max(1, ranks on its host / host_cores)`` per rank (all ones when CPU
        sharing is not modelled): the stretch of ``"static"`` sharing."""
        host = self.host_R(ranks)
        if host is None:
            return np.ones(max(ranks, 0))
        return np.maximum(1.0, np.bincount(host)[host].astype(np.float64) / self.host_cores)

    def host_R(self, ranks: int) -> np.ndarray | None:
        """int64 [R]: the host (set of ``host_cores`` shared cores) each rank runs on; None when
        CPU sharing is not modelled (``host_cores`` 0, as on the GPU presets)."""
        if self.host_cores <= 0 or ranks <= 0:
            return None
        node_R = self.cluster(ranks).node_of(np.arange(ranks))
        return node_R // self.host_nodes_per_host if self.host_nodes_per_host > 0 else np.zeros(ranks, np.int64)

    def cluster(self, ranks: int) -> ClusterShape:
        """The cluster geometry ``ranks`` GPUs occupy here: nodes of ``min(G, R)`` consecutive ranks
        (``num_nodes`` of them; the last is partly used when R is not a multiple of G), a rank's
        rail its index in its node. The simulator asks it which node and which rail a rank is on."""
        G = max(1, min(self.gpus_per_node, ranks))
        return ClusterShape(self.num_nodes(ranks) * G, G)

    def num_nodes(self, ranks: int) -> int:
        """Nodes a run of ``ranks`` GPUs occupies (``nodes`` if fixed, else ceil(R / G))."""
        need = -(-ranks // self.gpus_per_node)
        if self.nodes:
            require(ranks <= self.nodes * self.gpus_per_node,
                    f"ranks ({ranks}) must be <= nodes x gpus_per_node ({self.nodes} x {self.gpus_per_node}) "
                    f"of topology {self.name}")
        return need

    def with_gpus_per_node(self, gpus_per_node: int | None) -> "Topology":
        if gpus_per_node is None or gpus_per_node == self.gpus_per_node:
            return self
        require(gpus_per_node >= 1, f"gpus_per_node ({gpus_per_node}) must be >= 1")
        g = int(gpus_per_node)
        rails = self.nic_rails_per_node
        if rails:  # each GPU keeps its NICs (or its share of one)
            per = self.nics_per_gpu * g
            require(abs(per - round(per)) < 1e-9 and round(per) >= 1,
                    f"gpus_per_node ({g}) must keep a whole number of NICs per node (topology {self.name}: "
                    f"{rails} rails for {self.gpus_per_node} GPUs)")
            rails = int(round(per))
        return replace(self, gpus_per_node=g, nic_rails_per_node=rails)

    def constants(self) -> dict[str, Any]:
        """Every constant, as a flat JSON-able dict (what reports print next to a figure)."""
        d = asdict(self)
        d.pop("path")
        return d

    def to_toml(self) -> str:
        """The topology as a TOML document in the ``docs/topology.md`` format."""
        import tomli_w

        doc = {"name": self.name, "description": self.description,
               **{table: {k: getattr(self, prefix + k) for k in keys} for table, (prefix, keys) in _TABLES.items()}}
        return tomli_w.dumps({**doc, "sources": self.sources} if self.sources else doc)


def topology_from_dict(doc: dict[str, Any], origin: str = "<dict>") -> Topology:
    """Build a :class:`Topology` from a parsed TOML document (unknown keys are errors). A key left
    out takes the class default."""
    kw: dict[str, Any] = {}
    names = {f.name: f for f in fields(Topology)}
    for key, val in doc.items():
        if key in ("name", "description"):
            require(isinstance(val, str), f"{origin}: {key}: expected a string, found {val!r}")
            kw[key] = val
        elif key == "sources":
            require(isinstance(val, dict) and all(isinstance(v, str) for v in val.values()),
                    f"{origin}: [sources] must be a table of strings (constant = \"where its value comes from\")")
            kw["sources"] = dict(val)
        elif key in _TABLES:
            prefix, keys = _TABLES[key]
            require(isinstance(val, dict), f"{origin}: {key} must be a table [{key}]")
            for k, v in val.items():
                require(k in keys, f"{origin}: [{key}] key ({k!r}) must be one of {', '.join(keys)}")
                typ = names[prefix + k].type
                if typ in (str, "str"):
                    require(isinstance(v, str), f"{origin}: [{key}] {k}: expected a string, found {v!r}")
                    kw[prefix + k] = v
                    continue
                want_int = typ in (int, "int")
                ok = isinstance(v, int) if want_int else isinstance(v, (int, float))
                require(ok and not isinstance(v, bool),
                        f"{origin}: [{key}] {k}: expected {'an integer' if want_int else 'a number'}, found {v!r}")
                require(math.isfinite(v) and abs(v) <= MAX_CONSTANT,  # inf as NaN: refused here, by name
                        f"{origin}: [{key}] {k}: expected a finite number of magnitude at most {MAX_CONSTANT:g}, "
                        f"found {v!r}")
                kw[prefix + k] = int(v) if want_int else float(v)
        else:
            require(False, f"{origin}: key ({key!r}) must be one of name, description, sources, "
                           f"{', '.join(_TABLES)}")
    require("name" in kw, f"{origin}: name must be given")
    try:
        return Topology(**kw, path=origin)
    except ConfigError as e:  # name the file, not its `name` field
        raise ConfigError(f"{origin}: " + str(e).replace(f" (topology {kw['name']})", "")) from None


def read_topology_file(path: str | os.PathLike) -> Topology:
    """A topology TOML file; a missing, special (pipe, folder, link loop), oversized or too deeply
    nested file is refused in one line naming it, as is every value (see :func:`topology_from_dict`)."""
    return topology_from_dict(read_toml(path, "topology file"), str(Path(path)))


def calibrated_topology_path() -> Path:
    """Where ``moonep-sim calibrate`` writes the measured ``local-gloo`` topology.

    ``$MOONEP_SIM_HOME/local-gloo.toml``, by default ``~/.cache/moonep-sim/local-gloo.toml``.
    """
    home = os.environ.get("MOONEP_SIM_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "moonep-sim"
    return base / "local-gloo.toml"


def _preset_files() -> dict[str, Any]:
    out = {}
    for entry in resources.files("moonep_sim.data").iterdir():
        n = entry.name
        if n.startswith(_PRESET_PREFIX) and n.endswith(".toml"):
            out[n[len(_PRESET_PREFIX):-5]] = entry
    return dict(sorted(out.items()))


#: Other names of presets: ``h200`` is the H200 + ConnectX-7 cluster (``h200-cx7``).
PRESET_ALIASES = {"h200": "h200-cx7"}


def list_topologies() -> list[str]:
    """Names of the shipped presets."""
    return list(_preset_files())


def load_topology(name_or_path: "str | os.PathLike | Topology", gpus_per_node: int | None = None) -> Topology:
    """A preset by name (:func:`list_topologies`; or an alias of one, :data:`PRESET_ALIASES`), a TOML
    file, or a :class:`Topology` (returned as is): the one loader every command uses.

    ``local-gloo`` is read from :func:`calibrated_topology_path` when that file exists (measured on
    this machine by ``moonep-sim calibrate``), else from the shipped defaults.
    ``gpus_per_node`` overrides the file's value (a plan's cluster passes its own).
    """
    if isinstance(name_or_path, Topology):
        return name_or_path.with_gpus_per_node(gpus_per_node)
    s = PRESET_ALIASES.get(str(name_or_path), str(name_or_path))
    presets = _preset_files()
    if s in presets:
        if s == "local-gloo" and calibrated_topology_path().is_file():
            topo = read_topology_file(calibrated_topology_path())
        else:
            topo = topology_from_dict(data_toml(presets[s].name), f"preset {s}")
    elif s.endswith(".toml") or os.path.sep in s or os.path.lexists(s):
        topo = read_topology_file(s)
    else:
        raise ConfigError(f"topology ({s!r}) must be a preset ({', '.join(presets)}) or a .toml file")
    return topo.with_gpus_per_node(gpus_per_node)


__all__ = ["PRESET_ALIASES", "Topology", "calibrated_topology_path", "list_topologies", "load_topology", "read_topology_file",
           "topology_from_dict"]
