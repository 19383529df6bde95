"""What kind of GPU kernel carries a Plan's hops (read by the simulator; the gloo executor ignores it).

A strategy attaches a :class:`KernelSpec` to its Plan to say how the real kernels it stands for
move rows; the simulator times the Plan's bytes accordingly (``moonep_sim.sim.kernels``). Executors
still never look at the strategy's name: the spec is plain data, like the Plan's byte matrices.

**Kernel families** (:data:`FAMILIES`): each implementation of dispatch / combine -- DeepEP V1
normal and low-latency, DeepEP V2's ElasticBuffer, NCCL EP, pplx, UCCL-EP, NIXL EP, mori -- as one
:class:`KernelFamily` record of the terms the simulator prices (SM budget, relaying, one message
per row, fixed costs per launch and of planning, a per-message cost of its own, SM copy rate, how
the combine's receiver reduces), each with its source and status. ``deepep`` / ``deepep-ll`` take
``impl=<family>`` and build the family's spec with :func:`family_spec`. Values a family does not
set (``None``) are the topology's (``[kernel]``, ``[planning]``: DeepEP V1's fitted constants).
Only DeepEP V1's constants are fitted on published rows (and V2's SM rate, on one V2 row); every
other family's terms are *assumed* from its design, as its ``sources`` say: no published
dispatch/combine figure of those families was used to set or check them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moonep_sim.errors import ConfigError, require

#: ``KernelSpec.sms`` value meaning "every SM of the GPU" (the low-latency kernels).
ALL_SMS = -1
#: How a combine's receiver reduces the rows of one token: ``"fused"`` -- the receiving SMs sum
#: rows as they arrive (only the last message's reduce is exposed); ``"after"`` -- once every row
#: of the hop arrived, a pass reads them all and writes the sums (low-latency receive phases, and a
#: collective followed by a reduce kernel).
REDUCE_MODES = ("fused", "after")
#: How a library's own test counts a kernel's bandwidth (``moonep_sim.sim.kernels.isolated_kernel_figures``):
#: ``"deepep-v1"`` -- rows received per rank, own included (one node), or unique (token, node) pairs,
#: local node included (several), x the row (FP8 rows ``H (1 + 4/128)``); ``"deepep-v2"`` -- bytes
#: per rank to GPUs of its node (scale-up) and to other nodes (scale-out), reported apart;
#: ``"selections"`` -- every kept (token, expert) selection x the row (the low-latency tests).
COUNTS = ("deepep-v1", "deepep-v2", "selections")
#: What the dispatch's copy epilogue writes (a kernel of its own after the dispatch kernel, on every
#: SM: DeepEP V2's ``dispatch_copy_epilogue_impl``): ``""`` -- none (the receivers write the output
#: themselves, DeepEP V1); ``"recv"`` -- one row per received (token, rank), as it arrived;
#: ``"expand"`` -- one row per (token, local expert) selection, grouped by expert (V2's
#: ``do_expand=True``, the GEMM layout). The combine of an expanded layout reads every expanded row.
EPILOGUES = ("", "recv", "expand")


@dataclass(frozen=True)
class RelayChunk:
    """A relayed kernel's chunking at one EP size (DeepEP V1 ``Config``): tokens per chunk a channel
    sends over NVLink / RDMA, in dispatch and in combine. ``ranks``: the EP size it is tuned for."""

    ranks: int
    dispatch_nvl: int
    dispatch_rdma: int
    combine_nvl: int
    combine_rdma: int

    def rows(self, direction: str, inter_node: bool) -> int:
        """Tokens per chunk of one channel on a hop of that class (``direction``: dispatch / combine)."""
        if direction == "dispatch":
            return self.dispatch_rdma if inter_node else self.dispatch_nvl
        return self.combine_rdma if inter_node else self.combine_nvl


def chunk_for(chunks: tuple, ranks: int) -> "RelayChunk | None":
    """The chunking tuned for ``ranks`` (else for the largest EP size below it, else the smallest)."""
    if not chunks:
        return None
    below = [c for c in chunks if c.ranks <= ranks]
    return max(below, key=lambda c: c.ranks) if below else min(chunks, key=lambda c: c.ranks)


@dataclass(frozen=True)
class KernelSpec:
    """How a Plan's dispatch and combine kernels run on a GPU.

    sms: SMs the kernels use (their SM budget): 0 = not declared (no SM cap), ``ALL_SMS`` (-1) =
        every SM of the GPU, else that many. The simulator caps each rank's send and receive rate
        at ``sms x sm_copy_GBps`` of the topology (``moonep_sim.sim.topology.Topology``).
    relay: True = a multi-hop Plan runs as one kernel whose relay ranks forward rows as they
        arrive, in messages of ``kernel_relay_message_rows`` rows (DeepEP's normal kernels); False
        = every hop is a separate collective that starts once the previous one ended on that rank.
    row_messages: True = every row is its own message (one RDMA write per (token, expert)
        selection, as the low-latency kernels send), charged ``kernel_nic_message_us`` each at the
        sending NIC.
    nic_only: True = same-node peers also go through the NICs (pure-RDMA kernels), not NVLink.
    planned: False = the kernels need no planning step before they run: no count exchange and no
        layout (the low-latency kernels write into fixed buffers and carry the counts themselves),
        so the simulator charges no planning work and no planning all-gather.
    family: the :data:`FAMILIES` name the spec was built from ("" = none: the topology's terms).
    dispatch_fixed_us, combine_fixed_us, plan_fixed_us: the family's own fixed costs per launch
        and of planning (None = the topology's ``[kernel]`` / ``[planning]`` values).
    extra_fixed_us: added to every launch's fixed cost (e.g. a CPU proxy's command and completion
        round trips), whichever of the above applies (0 = none).
    message_us: the family's own serial cost per message at the sender (a CPU proxy posting each
        write), on top of the NIC's (0 = none).
    relay_message_rows: rows per relayed message (None = the topology's).
    sm_copy_factor: the family's per-SM copy rate over the topology's ``sm_copy_GBps`` (1 = the
        same kernel design as DeepEP V1's, on which it was fitted).
    reduce: how the combine's receiver reduces (:data:`REDUCE_MODES`; None = ``"after"`` for a
        Plan without a family).
    reduce_sms: SMs of that reduce (0 = the kernels' ``sms``; ``ALL_SMS`` = every SM).
    chunks: the relayed kernel's chunking per EP size (:class:`RelayChunk`; empty = relays forward
        in messages of ``relay_message_rows``): the kernel runs ``sms x channels_per_sm`` channels,
        each forwarding in chunks, so one relayed "message" is ``channels x chunk`` rows.
    channels_per_sm: channels per SM of a chunked kernel (DeepEP V1: ``num_sms / 2`` channels).
    epilogue: the dispatch's copy epilogue (:data:`EPILOGUES`; "" = none).
    sm_read_GBps: per-SM read rate of the kernel's own pass over local rows (the expanded
        combine's read of every expanded row); 0 = the SM copy rate (``sm_copy_GBps x sm_copy_factor``).
    recv_copy: True = the receiving SMs of the last dispatch hop copy each arrived chunk out of their
        receive buffer into the output (read + write) as it arrives -- the dispatch's counterpart of a
        ``"fused"`` combine reduce -- so the copy of the hop's last message (``channels x chunk`` rows
        of a chunked kernel, :func:`moonep_sim.sim.kernels.relay_hop_rows`) is exposed after its last
        rows arrived (:func:`moonep_sim.sim.kernels.receive_copy_us`); False = none (the rows land in
        the output, or a copy epilogue writes it).
    holds_sms: True = the kernels hold their SMs for the whole collective, data in flight included
        (normal kernels: their SMs move the bytes); False = they hold them only in their SM phases
        (launch and send issue, the receive copy or reduce) and free them while the data is in
        flight (DeepEP's low-latency kernels run with ``return_recv_hook``): an overlapping compute
        op is slowed only in those phases (``moonep_sim.step.schedule.Timeline.comm``).
    host_wait_us: the host's wait for the count exchange before each dispatch (the library's CPU
        busy-waits for the received counts, then allocates the outputs and launches the dispatch
        kernel): the GPU idles that long per dispatch (0 = none: the counts stay on the device).
    zero_copy: True = the rows land in their expert-grouped slots and the combine reads them there
        (MoonEP): no permutation pass around the experts (``moonep_sim.step.costs.PERMUTE_PASSES``).
    broadcast: True = the relayed inter-node hop carries every token to the relay of every other node,
        whether or not any of its experts is there (mori's InterNodeV1LL): each cross-node pair of that
        hop is priced at the token owner's token count, not at the rows it needs
        (``moonep_sim.sim.program.broadcast_scale``).
    proxy_nic_threads: CPU proxy threads per GPU, each posting on one of the GPU's NICs, that the
        kernel's channels are dealt to round-robin (channel c -> thread c mod T -> NIC thread mod N):
        the busiest NIC carries ``ceil``-many channels, so the GPU's inter-node rate is its NICs' x
        ``(channels / N) / max channels per NIC`` (:func:`moonep_sim.sim.kernels.proxy_nic_share`);
        0 = none (the bytes spread over every NIC).
    proxy_call_us, proxy_GBps: what a training step's host pays per dispatch or combine call of a
        host-proxy family beyond its kernels' own time: ``proxy_call_us`` plus the call's inter-node
        bytes at ``proxy_GBps`` (:func:`moonep_sim.sim.kernels.proxy_host_us`; charged on the step's
        host timeline, :mod:`moonep_sim.step.host`); 0 = none.
    """

    sms: int = 0
    relay: bool = False
    row_messages: bool = False
    nic_only: bool = False
    planned: bool = True
    family: str = ""
    dispatch_fixed_us: float | None = None
    combine_fixed_us: float | None = None
    plan_fixed_us: float | None = None
    extra_fixed_us: float = 0.0
    message_us: float = 0.0
    relay_message_rows: int | None = None
    sm_copy_factor: float = 1.0
    reduce: str | None = None
    reduce_sms: int = 0
    chunks: tuple = ()
    channels_per_sm: float = 0.5
    epilogue: str = ""
    sm_read_GBps: float = 0.0
    recv_copy: bool = False
    holds_sms: bool = True
    host_wait_us: float = 0.0
    zero_copy: bool = False
    proxy_nic_threads: int = 0
    broadcast: bool = False
    proxy_call_us: float = 0.0
    proxy_GBps: float = 0.0

    def __post_init__(self) -> None:
        require(self.proxy_nic_threads >= 0 and self.proxy_call_us >= 0 and self.proxy_GBps >= 0,
                f"kernel proxy_nic_threads ({self.proxy_nic_threads}), proxy_call_us ({self.proxy_call_us}) and "
                f"proxy_GBps ({self.proxy_GBps}) must be >= 0")
        require(self.epilogue in EPILOGUES, f"kernel epilogue ({self.epilogue!r}) must be one of {EPILOGUES}")
        require(self.channels_per_sm > 0, f"kernel channels_per_sm ({self.channels_per_sm}) must be > 0")
        require(self.sms >= ALL_SMS, f"kernel sms ({self.sms}) must be >= -1 (-1 = all SMs, 0 = not declared)")
        require(self.reduce is None or self.reduce in REDUCE_MODES,
                f"kernel reduce ({self.reduce!r}) must be one of {', '.join(REDUCE_MODES)}")
        require(self.sm_copy_factor > 0, f"kernel sm_copy_factor ({self.sm_copy_factor}) must be > 0")
        for f in ("dispatch_fixed_us", "combine_fixed_us", "plan_fixed_us", "relay_message_rows"):
            v = getattr(self, f)
            require(v is None or v >= 0, f"kernel {f} ({v}) must be >= 0 or None (the topology's)")
        require(self.message_us >= 0 and self.extra_fixed_us >= 0,
                f"kernel message_us ({self.message_us}) and extra_fixed_us ({self.extra_fixed_us}) must be >= 0")


@dataclass(frozen=True)
class KernelFamily:
    """One dispatch/combine implementation as the simulator prices it (see the module docstring).

    name: the ``impl=`` value.  library: the project it comes from.  mode: ``"normal"`` (node-
        deduplicated two-hop, relayed: ``deepep``) or ``"ll"`` (one message per selection straight
        to its rank: ``deepep-ll``).  vendor: ``"nvidia"`` or ``"amd"``.  transports: the
        inter-node transports it runs over (``ib``, ``roce``, ``efa``; ``-`` = one node only).
    sms: default SM budget (``ALL_SMS`` = every SM).  dedup_per_rank: ll mode only: one message
        per (token, destination rank) instead of per selection.
    counts: how the library's own test counts its bandwidth (:data:`COUNTS`), which ``simulate
        --isolate`` prints first.
    holds_sms: whether the kernels hold their SMs while data is in flight (:class:`KernelSpec`);
        default: normal kernels do, low-latency ones (run with their receive hook) do not.
    The pricing terms are :class:`KernelSpec`'s (``None`` = the topology's).
    sources: term -> where its value comes from, opening with its status (sourced / FITTED on
        <row> / assumed, set from ...).
    node_relay: ll mode only: the kernel relays through the same-index GPU of each node, as the
        normal kernels do (``deepep-ll`` then builds the two-hop relayed plan), instead of sending
        each row straight to its rank.  broadcast: see :class:`KernelSpec`.
    caveat: what a user should know before acting on a figure this family prices (a published
        measurement its pricing does not reproduce); shown with its ``host-proxy`` flag ("" = none).
    """

    name: str
    library: str
    mode: str
    vendor: str
    transports: tuple[str, ...]
    sms: int
    dispatch_fixed_us: float | None = None
    combine_fixed_us: float | None = None
    plan_fixed_us: float | None = None
    extra_fixed_us: float = 0.0
    message_us: float = 0.0
    relay_message_rows: int | None = None
    sm_copy_factor: float = 1.0
    reduce: str = "fused"
    reduce_sms: int = 0
    dedup_per_rank: bool = False
    counts: str = "deepep-v1"
    chunks: tuple = ()
    channels_per_sm: float = 0.5
    epilogue: str = ""
    sm_read_GBps: float = 0.0
    recv_copy: bool = False
    holds_sms: bool | None = None
    host_wait_us: float = 0.0
    proxy_nic_threads: int = 0
    node_relay: bool = False
    broadcast: bool = False
    proxy_call_us: float = 0.0
    proxy_GBps: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    caveat: str = ""

    @property
    def holds(self) -> bool:
        """``holds_sms``, defaulted by mode (normal: True; ll: False, the hook mode)."""
        return self.mode == "normal" if self.holds_sms is None else bool(self.holds_sms)

    def __post_init__(self) -> None:
        require(self.mode in ("normal", "ll"), f"kernel family {self.name} mode ({self.mode!r}) must be normal or ll")
        require(self.counts in COUNTS, f"kernel family {self.name} counts ({self.counts!r}) must be one of "
                f"{', '.join(COUNTS)}")
        require(self.epilogue in EPILOGUES, f"kernel family {self.name} epilogue ({self.epilogue!r}) must be one "
                f"of {EPILOGUES}")


_V1 = "deepseek-ai/DeepEP V1 ('legacy') kernels"
#: Host-proxy transports (a CPU thread posts each RDMA write the GPU asks for): proxy threads per
#: GPU, the CPU time one thread spends on one proxied operation, and the round trips a launch pays.
UCCL_PROXY_THREADS = 4
NVSHMEM_PROXY_THREADS = 1
#: ASSUMED, set from UCCL's proxy benchmark (uccl-project/uccl PR #47: 2.24 M operations/s through
#: its CPU proxy FIFO, read here as one proxy thread's rate): CPU us one proxy thread spends per
#: proxied operation (a libfabric / verbs post, applying a remote atomic, posting or reaping an ack).
PROXY_OP_US = 0.45
#: Proxied operations per RDMA chunk of DeepEP's normal kernels (one chunk = up to the RDMA send-chunk
#: tokens of one channel to one node; csrc/kernels/internode.cu: the RDMA sender posts the chunk's put
#: and a tail atomic, the receiving forwarder returns a head atomic once it consumed the chunk).
#: NVSHMEM over libfabric on EFA (the awslabs Megatron-Bridge build, deepep/setup_deepep_efa.sh: put and
#: tail fused into ``nvshmemx_qp_char_put_signal_nbi_warp``, head by ``nvshmem_int_atomic_add``, one
#: proxy endpoint per PE): EFA has no RDMA atomics, so NVSHMEM stages each signal and atomic through the
#: target's proxy thread, which applies it on the host (GDRCopy) and writes an ack back (NVSHMEM
#: src/modules/transport/libfabric/libfabric.cpp: perform_gdrcopy_amo, gdrcopy_amo_ack): posts 3 (put,
#: signal, head atomic) + at the target 2 x (apply + ack) + 2 ack completions = 9 on each GPU's one
#: thread (the traffic is symmetric: every GPU's thread does both ends' share).
NVSHMEM_EFA_OPS_PER_CHUNK = 9
#: UCCL-EP on EFA, as the development row's image builds it (uccl-project/uccl @0dc87eb, the commit the
#: awslabs Megatron-Bridge Dockerfile pins): the RDMA sender's tail rides on the chunk's write as its
#: immediate (ep/src/internode.cu ``#ifdef EFA``: the put carries the tail's offset and value, the
#: separate tail atomic is skipped), posted as one ``ibv_wr_rdma_write_imm`` (ep/src/rdma.cpp
#: post_rdma_async_batched_normal_mode) and applied by the receiving proxy from the completion, in
#: sequence order (remote_process_completions_normal_mode, a 16-entry reorder buffer: SRD does not
#: order); the forwarder's head atomic is its own write-with-immediate, applied the same way. Per chunk:
#: 2 posts + 2 send completions reaped + 2 immediates applied at the target = 6, spread over
#: UCCL_PROXY_THREADS threads.
UCCL_EFA_OPS_PER_CHUNK = 6
#: UCCL-EP's SM budget: its ``Buffer.num_sms`` (ep/bench/buffer.py, the deep_ep wrapper's Buffer), also
#: Megatron-Core's ``moe_deepep_num_sms`` default, which the row's flex dispatcher passes.
UCCL_SMS = 20
#: UCCL-EP's chunking on EFA (ep/bench/buffer.py @0dc87eb get_dispatch_config / get_combine_config:
#: ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``, RDMA receive 512 tokens on EFA at
#: EP16 and EP32): (ranks, dispatch NVLink, dispatch RDMA, combine NVLink, combine RDMA) send chunks.
UCCL_CHUNKS = tuple(RelayChunk(r, dn, dr, cn, cr) for r, dn, dr, cn, cr in (
    (2, 24, 6, 10, 6), (4, 6, 6, 9, 6), (8, 6, 6, 4, 6), (16, 36, 20, 4, 12), (24, 8, 32, 1, 8), (32, 32, 32, 1, 8),
    (64, 20, 28, 1, 20), (128, 20, 32, 1, 12), (144, 32, 12, 2, 8), (160, 28, 12, 2, 8)))
#: ASSUMED: two proxy round trips per launch (GPU command ring -> CPU thread -> completion back,
#: ~2.5 us each over PCIe with polling).
PROXY_ROUND_TRIP_US = 5.0
#: FITTED on ANCHORS development row 2 (Qwen3-30B-A3B, Megatron-Bridge on 64 H100 of p5.48xlarge, EFA:
#: each transport's step time relative to NCCL all-to-all in its published layouts;
#: ``benchmarks/fit_host_proxy.py``, leave-one-out by EP size in docs/results/host-proxy-fit.md): what a
#: training step's host pays per dispatch or combine call of the transport (``proxy_call_us``, us) and
#: the rate at which it pays for the call's inter-node bytes (``proxy_GBps``, GB/s) -- the host-proxy
#: per-call cost and throughput (``moonep_sim.sim.kernels.proxy_host_us``). Not measured: no trace of
#: the row is at hand, and the kernels alone are faster (docs/results/host-proxies.md).
UCCL_EFA_CALL_US, UCCL_EFA_PROXY_GBPS = 960.0, 2.92
NVSHMEM_EFA_CALL_US, NVSHMEM_EFA_PROXY_GBPS = 0.0, 7.02
_PROXY_FIT = ("FITTED on ANCHORS development row 2 (Qwen3-30B-A3B, Megatron-Bridge, 64 H100 p5.48xlarge, EFA): "
              "the transport's step time relative to NCCL all-to-all in the row's layouts (benchmarks/"
              "fit_host_proxy.py; leave-one-out by EP size in docs/results/host-proxy-fit.md): the host-proxy "
              "per-call cost and throughput a training step's host pays per dispatch or combine call, beyond the "
              "kernels' own time (moonep_sim.sim.kernels.proxy_host_us). Mechanism named, magnitude not sourced: "
              "UCCL-EP's Megatron guide at the row's commit (uccl 0dc87eb ep/bench/megatron/README.md, 'Known or "
              "potential Issues') says containers inflate its proxy threads' FIFO round trips and that NCCL's "
              "channels for the optimizer collectives congest EFA when UCCL-EP is active; the row ran in EKS "
              "pods without NCCL_MAX_NCHANNELS. The kernels alone, same images on p5.48xlarge, run at 30-46 GB/s "
              "per layer (awslabs/awsome-distributed-ai@40e398b micro-benchmarks/expert-parallelism/"
              "ep-backend-comparison/RESULTS-p5.md), so the cost is not the kernels'")
_PROXY_MSG = ("assumed: PROXY_OP_US = 0.45 CPU us per proxied operation per proxy thread, set from UCCL's proxy "
              "benchmark (uccl PR #47, 2.24 M ops/s, read as one thread's rate); no published dispatch/combine or "
              "step figure used")
_PROXY_FIXED = ("assumed: V1's (the topology's [kernel]) + PROXY_ROUND_TRIP_US = 5 us per launch, two proxy round "
                "trips (GPU command ring -> CPU thread -> completion back) of ~2.5 us each over PCIe with polling")
#: ASSUMED: what one dispatch of a normal kernel waits on the host for its count exchange: the
#: counters' device-to-host write (~1 us over PCIe), then the CPU allocating the receive tensors and
#: launching the dispatch kernel, which reaches the GPU ~5 us later (~15 us of eager op overhead).
HOST_WAIT_US = 20.0
_HOST_WAIT = ("sourced mechanism: DeepEP csrc/deep_ep.cpp (intranode_dispatch / internode_dispatch): after "
              "notify_dispatch the CPU busy-waits on the mapped moe_recv_counter (and per-expert counters) to size "
              "recv_x, unless num_worst_tokens is given; the GPU stream drains meanwhile and nothing after the "
              "dispatch can be enqueued (nor captured in a CUDA graph). assumed: HOST_WAIT_US = 20 us per "
              "dispatch (D2H counter write, tensor allocation, kernel launch)")
#: Why a low-latency family frees its SMs while its data is in flight.
_LL_HOOK = ("sourced: DeepEP README ('a hook-based communication-computation overlapping method that does not "
            "occupy any SM resource') and csrc/kernels/internode_ll.cu: with return_recv_hook=True the dispatch "
            "and combine kernels run only their send phase (buffer clean, FP8 cast, IBGDA writes) and return; "
            "the receive phase (wait, copy out or weighted sum) runs when the hook is called, so the SMs are "
            "held in the launch, send and receive phases only; DeepSeek's decode profile (deepseek-ai/"
            "profile-data README) overlaps two micro-batches this way")
#: DeepEP V2's per-SM copy rate over V1's: FITTED on its README row EP8 B200 24 SMs dispatch.
V2_SM_COPY_FACTOR = 1.762
_V2_EPILOGUE = ("sourced: DeepEP V2 csrc/buffers/ep.hpp + deep_ep/include/deep_ep/impls/ep/dispatch_copy_epilogue.cuh: "
                "after the dispatch kernel a copy epilogue on every SM reads each received token from the scale-up "
                "buffer and writes recv_x; its test times it apart (kineto 'dispatch_copy_epilogue_impl'); "
                "priced at the HBM rate")
#: DeepEP V1's chunking per EP size: ``Buffer.get_dispatch_config(R)`` / ``get_combine_config(R)``
#: (deep_ep/buffer.py), the NVLink and RDMA send-chunk tokens of their ``Config(num_sms,
#: nvl_send, nvl_recv, rdma_send, rdma_recv)``; each of the ``num_sms / 2`` channels forwards in
#: such chunks (csrc/kernels/internode.cu: the RDMA coordinator issues a chunk once that many
#: tokens are in its send buffer, the forwarder publishes its NVLink tail per chunk).
V1_CHUNKS = tuple(RelayChunk(r, dn, dr, cn, cr) for r, dn, dr, cn, cr in (
    (2, 24, 6, 10, 6), (4, 6, 6, 9, 6), (8, 6, 6, 4, 6), (16, 36, 20, 4, 12), (24, 32, 8, 1, 8), (32, 32, 8, 1, 8),
    (48, 32, 8, 1, 8), (64, 32, 8, 1, 8), (96, 20, 12, 1, 8), (128, 20, 12, 1, 8), (144, 32, 12, 2, 8),
    (160, 28, 12, 2, 8)))
#: Blocks (one workgroup per CU) mori's low-latency kernels run on: its test's ``block_num`` for
#: ``InterNodeV1LL`` (ROCm/mori examples/ops/dispatch_combine/test_low_latency.py).
MORI_LL_BLOCKS = 64
#: Tokens per put of mori's low-latency internode send: one warp-sized chunk (64 lanes on CDNA).
MORI_LL_CHUNK = 64
#: The kernel families, by ``impl=`` name. Fixed costs ``None`` = the topology's ``[kernel]``
#: values, which are FITTED on DeepEP V1's low-latency EP8 rows (H800): the V1 families use them as
#: they are; a family that says nothing else about its launch cost is *assumed* to pay the same.
FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (
    KernelFamily("deepep-v1", "DeepEP", "normal", "nvidia", ("ib", "roce"), sms=24, reduce="fused",
                 chunks=V1_CHUNKS, channels_per_sm=0.5, recv_copy=True, host_wait_us=HOST_WAIT_US, sources={
        "host_wait_us": _HOST_WAIT,
        "design": f"sourced: {_V1}: node-deduplicated RDMA then NVLink forwarding by relay SMs in one kernel; "
                  "the combine's receiving SMs sum the rows as they arrive",
        "chunks": "sourced: DeepEP V1 deep_ep/buffer.py get_dispatch_config / get_combine_config (send-chunk "
                  "tokens per EP size) and csrc/kernels/internode.cu (num_channels = num_sms / 2): a relay "
                  "forwards a hop once every channel's first chunk arrived, channels x chunk rows; a receiver "
                  "reduces (combine) the last channels x chunk rows of a hop after they arrived",
        "recv_copy": "sourced: DeepEP V1 csrc/kernels/intranode.cu (dispatch receivers) and internode.cu (NVL "
                     "receivers): the receiving SMs poll the channel's tail, which the sender publishes once per "
                     "chunk of get_dispatch_config's NVLink send tokens, and TMA-copy the arrived tokens from the "
                     "channel buffer into recv_x; the last chunk of every channel (channels x chunk rows) is "
                     "copied after it arrived, at the kernel's SM copy rate",
        "sms": "sourced: DeepEP's normal kernels use 20-24 SMs (ANCHORS; Buffer.num_sms = 24)",
        "fixed_us": "FITTED on DeepEP's low-latency EP8 rows (the topology's [kernel]); assumed the same launch "
                    "and notify cost for the normal kernels",
        "sm_copy_factor": "1: sm_copy_GBps is FITTED on DeepEP V1's B200 EP8 16-SM dispatch (ANCHORS)"}),
    KernelFamily("deepep-v1-ll", "DeepEP", "ll", "nvidia", ("ib", "roce"), sms=ALL_SMS,
                 reduce="after", counts="selections", sources={
        "design": f"sourced: {_V1} low-latency: one RDMA write per (token, expert) selection into fixed "
                  "buffers, NVLink for same-node peers; the combine's receive phase waits for its rows, then "
                  "reduces the K of each token",
        "fixed_us": "FITTED on DeepEP's low-latency EP8 dispatch / combine rows (the topology's [kernel])",
        "holds_sms": _LL_HOOK}),
    KernelFamily("deepep-v2", "DeepEP", "normal", "nvidia", ("ib", "roce", "efa"), sms=6, sm_copy_factor=V2_SM_COPY_FACTOR,
                 reduce="fused", counts="deepep-v2", epilogue="recv", sm_read_GBps=200.0, sources={
        "design": "sourced: DeepEP V2 ElasticBuffer (deep_ep/buffers/elastic.py) in hybrid mode: scale-out "
                  "(RDMA / NCCL GIN) once per (token, node), then forward warps issue the scale-up (NVLink) "
                  "rows, as get_theoretical_num_sms models its traffic -- V1's node-deduplicated movement, on "
                  "the relayed two-hop plan; its chunking is not modelled (the topology's relay message)",
        "sms": "sourced: 'DeepEP V2 needs 4-6 SMs for V3-style training' (ANCHORS)",
        "sm_copy_factor": "FITTED on DeepEP V2's README row EP8 B200 24 SMs dispatch (643 GB/s): V2's per-SM "
                          "copy rate over V1's (benchmarks/fidelity_gpu.py --fit); its other V2 rows are predictions",
        "fixed_us": "assumed: V1's (the topology's [kernel])",
        "epilogue": _V2_EPILOGUE + "; do_expand=False (the default): each received (token, rank) row written "
                    "once"}),
    KernelFamily("deepep-v2-expand", "DeepEP", "normal", "nvidia", ("ib", "roce", "efa"), sms=6,
                 sm_copy_factor=V2_SM_COPY_FACTOR, reduce="fused", counts="deepep-v2", epilogue="expand",
                 sm_read_GBps=200.0, sources={
        "design": "sourced: DeepEP V2 ElasticBuffer.dispatch(do_expand=True) (deep_ep/buffers/elastic.py): the "
                  "same scale-out / scale-up movement as deepep-v2 (the number of received tokens does not "
                  "change), then the expanding layout, one slot per (token, local expert), grouped by expert",
        "sms": "sourced: as deepep-v2", "sm_copy_factor": "as deepep-v2 (FITTED on its EP8 B200 24-SM row)",
        "fixed_us": "assumed: V1's (the topology's [kernel])",
        "epilogue": _V2_EPILOGUE + "; do_expand=True: each received row written once per local expert it "
                    "selected (the expert-grouped layout)",
        "sm_read_GBps": "sourced: ElasticBuffer.get_theoretical_num_sms's per-SM HBM read rate, 200 GB/s "
                        "(its default, for SM90): the expanded combine's SMs read every expanded row to "
                        "reduce a token's local experts before sending (allow_multiple_reduction, the default)"}),
    KernelFamily("nccl-ep", "NCCL EP", "normal", "nvidia", ("ib", "roce", "efa"), sms=16, reduce="fused", sources={
        "design": "assumed, set from NCCL's device-initiated (GIN) EP API: high-throughput mode moves rows as "
                  "DeepEP's normal kernels do (node-deduplicated, relayed)",
        "sms": "assumed: 16 SMs, set from the HybridEP comparison's 16-SM budget (ANCHORS)",
        "fixed_us": "assumed: V1's (the topology's [kernel])"}),
    KernelFamily("nccl-ep-ll", "NCCL EP", "ll", "nvidia", ("ib", "roce", "efa"), sms=ALL_SMS,
                 reduce="after", counts="selections", sources={
        "design": "assumed, set from NCCL EP's low-latency mode (DESIGN: 'DeepEP LL, NCCL EP LL: one message "
                  "per selection, fixed buffers, no relay')",
        "holds_sms": "assumed, set from DeepEP low-latency's hook mode, which NCCL EP's low-latency mode follows",
        "fixed_us": "assumed: DeepEP V1 low-latency's (the topology's [kernel])"}),
    KernelFamily("pplx", "pplx-kernels", "ll", "nvidia", ("ib", "roce"), sms=ALL_SMS, reduce="after",
                 dedup_per_rank=True, counts="selections", sources={
        "transports": "sourced: pplx-kernels' README lists NVLink, IBGDA, IBRC and EFA transports, all through "
                      "NVSHMEM: IBGDA is GPU-initiated (what this family prices), IBRC and EFA (NVSHMEM's libfabric "
                      "transport) go through NVSHMEM's CPU proxy thread, whose cost it does not price -- so EFA is "
                      "not native to it here (kernel-not-native)",
        "design": "assumed, set from pplx-kernels' all-to-all design: each token goes once to every rank "
                  "holding one of its experts (per-rank deduplication, no node relay) over NVSHMEM; the "
                  "receiver reduces after the rows arrived",
        "holds_sms": "assumed, set from pplx-kernels' split dispatch / combine (do_send / do_recv halves): the SMs are free between the halves",
        "fixed_us": "assumed: DeepEP V1 low-latency's (the topology's [kernel])"}),
    KernelFamily("uccl-ep", "UCCL-EP", "normal", "nvidia", ("ib", "roce", "efa"), sms=UCCL_SMS,
                 message_us=PROXY_OP_US * UCCL_EFA_OPS_PER_CHUNK / UCCL_PROXY_THREADS,
                 extra_fixed_us=PROXY_ROUND_TRIP_US, reduce="fused", chunks=UCCL_CHUNKS, channels_per_sm=0.5,
                 recv_copy=True, host_wait_us=HOST_WAIT_US, proxy_nic_threads=UCCL_PROXY_THREADS,
                 proxy_call_us=UCCL_EFA_CALL_US, proxy_GBps=UCCL_EFA_PROXY_GBPS, sources={
        "proxy_call_us": _PROXY_FIT, "proxy_GBps": _PROXY_FIT,
        "host_wait_us": _HOST_WAIT,
        "design": "sourced: UCCL-EP (arXiv 2512.19849; uccl-project/uccl ep/): DeepEP V1's internode kernels whose "
                  "GPU-issued 128-bit commands go through lock-free FIFO channels to multithreaded CPU proxies, "
                  "which post the RDMA writes (ibverbs; SRD queue pairs on EFA) on the GPU's behalf: no "
                  "GPU-initiated RDMA needed (EFA, RoCE, Broadcom)",
        "sms": "sourced: UCCL-EP ep/bench/buffer.py Buffer.num_sms = 20 (@0dc87eb), also Megatron-Core's "
               "moe_deepep_num_sms default",
        "chunks": "sourced: UCCL-EP ep/bench/buffer.py @0dc87eb get_dispatch_config / get_combine_config (its own "
                  "send-chunk tokens; EFA raises the RDMA receive ring to 512 tokens at EP16 / EP32), num_sms / 2 "
                  "channels (ep/src/internode.cu, DeepEP V1's kernel)",
        "recv_copy": "sourced: as deepep-v1 (the same receiver code in ep/src/internode.cu)",
        "message_us": f"{_PROXY_MSG}; per relayed message (chunk) UCCL_EFA_OPS_PER_CHUNK = 6 proxied operations, "
                      "sourced (uccl @0dc87eb ep/src/internode.cu, ep/src/rdma.cpp): on EFA the tail rides on the "
                      "chunk's write as its immediate and the head atomic is a second write-with-immediate, each "
                      "posted, its completion reaped, and applied by the receiving proxy in sequence order; over "
                      "UCCL_PROXY_THREADS = 4 (ep/include/common.hpp: kNumProxyThs = 4)",
        "proxy_nic_threads": "sourced: uccl @0dc87eb ep/include/uccl_ibgda.cuh (a channel's commands go to proxy "
                             "thread channel mod kNumProxyThs) and ep/src/rdma.cpp per_thread_rdma_init (on p5 "
                             "thread t posts on the GPU's NIC t mod 4, on p5en t mod 2): with 10 channels the "
                             "four NICs carry 3, 3, 2, 2 channels' bytes",
        "fixed_us": _PROXY_FIXED}, caveat=(
        "Its place behind DeepEP + NVSHMEM and NCCL all-to-all on EFA (ANCHORS row 2) comes from the host-proxy "
        "per-call cost and throughput FITTED on that row (in-sample there; leave-one-out by EP size in "
        "docs/results/host-proxy-fit.md): the costs UCCL-EP's code states alone would put it ahead of NCCL "
        "(docs/results/host-proxies.md)")),
    KernelFamily("uccl-ep-ll", "UCCL-EP", "ll", "nvidia", ("ib", "roce", "efa"), sms=ALL_SMS,
                 message_us=PROXY_OP_US / UCCL_PROXY_THREADS, extra_fixed_us=PROXY_ROUND_TRIP_US,
                 reduce="after", counts="selections", sources={
        "design": "sourced: UCCL-EP: DeepEP's low-latency kernels through the same CPU proxies",
        "message_us": f"{_PROXY_MSG}; one operation per message (row) over UCCL_PROXY_THREADS = 4",
        "holds_sms": "assumed, set from UCCL-EP's DeepEP-compatible low-latency API (return_recv_hook); its CPU "
                     "proxies, not SMs, move the data in flight",
        "fixed_us": _PROXY_FIXED}),
    KernelFamily("deepep-nvshmem-efa", "DeepEP over NVSHMEM (libfabric)", "normal", "nvidia", ("efa",), sms=24,
                 message_us=PROXY_OP_US * NVSHMEM_EFA_OPS_PER_CHUNK / NVSHMEM_PROXY_THREADS,
                 extra_fixed_us=PROXY_ROUND_TRIP_US, proxy_call_us=NVSHMEM_EFA_CALL_US, proxy_GBps=NVSHMEM_EFA_PROXY_GBPS,
                 reduce="fused", chunks=V1_CHUNKS, channels_per_sm=0.5, recv_copy=True, host_wait_us=HOST_WAIT_US, sources={
        "host_wait_us": _HOST_WAIT, "proxy_call_us": _PROXY_FIT, "proxy_GBps": _PROXY_FIT,
        "design": "sourced: DeepEP V1's normal kernels built on NVSHMEM's libfabric transport for EFA, which has no "
                  "GPU-initiated RDMA (IBGDA): each device-side put is handed to NVSHMEM's host proxy thread, which "
                  "posts it to the NIC (NVSHMEM docs, 'proxy' transports; the awslabs Megatron-Bridge rows in "
                  "ANCHORS run DeepEP this way)",
        "message_us": f"{_PROXY_MSG}; per RDMA chunk of one channel to one node NVSHMEM_EFA_OPS_PER_CHUNK = 9 "
                      "proxied operations, sourced: put + signal + head atomic posted, each signal / atomic staged "
                      "through the target's proxy (applied by GDRCopy, acked) since EFA has no RDMA atomics "
                      "(NVSHMEM libfabric.cpp perform_gdrcopy_amo / gdrcopy_amo_ack; awslabs Megatron-Bridge "
                      "deepep/setup_deepep_efa.sh: put_signal + nvshmem_int_atomic_add); NVSHMEM_PROXY_THREADS = 1 "
                      "is sourced (the same script: 'Libfabric has 1 proxy endpoint per PE')",
        "fixed_us": _PROXY_FIXED}, caveat=(
        "Its place between NCCL all-to-all and DeepEP + UCCL on EFA (ANCHORS row 2) comes from the host-proxy "
        "per-call cost and throughput FITTED on that row (in-sample there; leave-one-out by EP size in "
        "docs/results/host-proxy-fit.md), on top of PROXY_OP_US (ASSUMED 0.45 us per proxied operation)")),
    KernelFamily("nixl-ep", "NIXL EP", "ll", "nvidia", ("ib", "roce", "efa"), sms=ALL_SMS,
                 reduce="after", counts="selections", sources={
        "design": "assumed, set from NIXL EP's design: DeepEP-style low-latency kernels over NIXL's device API "
                  "(UCX / libfabric backends), one message per selection",
        "holds_sms": "assumed, set from DeepEP low-latency's hook mode, which NIXL EP's kernels derive from",
        "fixed_us": "assumed: DeepEP V1 low-latency's (the topology's [kernel])"}),
    KernelFamily("mori", "mori (ROCm)", "normal", "amd", ("ib", "roce"), sms=32, reduce="fused", sources={
        "design": "assumed, set from ROCm mori-EP's design: GPU-initiated (shmem-style) dispatch / combine, "
                  "node-deduplicated over RDMA then over Infinity Fabric, relayed",
        "sms": "assumed: 32 CUs, set from MoonEP's benchmark budget (ANCHORS); a CU stands for an SM",
        "fixed_us": "assumed: DeepEP V1's (the topology's [kernel])"}),
    KernelFamily("mori-ll", "mori (ROCm)", "ll", "amd", ("ib", "roce"), sms=MORI_LL_BLOCKS, holds_sms=True,
                 reduce="fused", node_relay=True, broadcast=True, relay_message_rows=MORI_LL_CHUNK,
                 counts="selections", sources={
        "design": "sourced: ROCm/mori src/ops/dispatch_combine/internode_v1.cpp, KernelType::InterNodeV1LL (the "
                  "internode mode of its low-latency test): a staging copy kernel on every CU "
                  "(EpDispatchCopyToStaging), then one kernel whose RDMA blocks put every token -- needed there "
                  "or not -- to the same-index GPU of every other node in warp-sized chunks with a signal each "
                  "(DispatchInterNodeLLSend), which forwards it over XGMI once per destination GPU of its node "
                  "(DispatchInterNodeLLRecv), while its XGMI blocks serve the local node; the combine runs it "
                  "backwards, each relay summing its node's rows of every token it was sent "
                  "(CombineInterNodeLLTyped, WarpAccum) before the put back: the node-relayed two-hop plan, its "
                  "inter-node hop a broadcast of T x (nodes - 1) rows per rank (broadcast)",
        "relay_message_rows": "sourced: one put per warp-sized chunk of tokens (64 lanes on CDNA), "
                              "DispatchInterNodeLLSend",
        "sms": "sourced: ROCm/mori examples/ops/dispatch_combine/test_low_latency.py launches InterNodeV1LL with "
               "block_num = 64 (32 of them RDMA blocks), one workgroup per CU",
        "holds_sms": "sourced: ROCm/mori src/ops/dispatch_combine/launch.cpp + internode_v1.cpp: InterNodeV1LL's "
                     "send, forward and receive run inside one kernel (EpDispatchInterNodeV1KernelLowLatency, then "
                     "DispatchSync), with no receive hook: it holds its blocks while data is in flight",
        "fixed_us": "assumed: DeepEP V1 low-latency's (the topology's [kernel])"}),
)}


def family(name: str, mode: str | None = None) -> KernelFamily:
    """The :data:`FAMILIES` record ``name``; with ``mode``, it must be of that mode."""
    names = [n for n, f in FAMILIES.items() if mode is None or f.mode == mode]
    if name not in names:
        raise ConfigError(f"impl ({name!r}) must be one of {', '.join(names)}"
                          + (f" (the {mode} kernel families)" if mode else ""))
    return FAMILIES[name]


def family_spec(fam: KernelFamily, **kw) -> KernelSpec:
    """A :class:`KernelSpec` carrying ``fam``'s pricing terms; ``kw`` sets the structural fields
    (``sms``, ``relay``, ``row_messages``, ``nic_only``, ``planned``)."""
    spec = KernelSpec(family=fam.name, dispatch_fixed_us=fam.dispatch_fixed_us, combine_fixed_us=fam.combine_fixed_us,
                      plan_fixed_us=fam.plan_fixed_us, extra_fixed_us=fam.extra_fixed_us, message_us=fam.message_us,
                      relay_message_rows=fam.relay_message_rows, sm_copy_factor=fam.sm_copy_factor, reduce=fam.reduce,
                      reduce_sms=fam.reduce_sms, chunks=fam.chunks, channels_per_sm=fam.channels_per_sm,
                      epilogue=fam.epilogue, sm_read_GBps=fam.sm_read_GBps, recv_copy=fam.recv_copy,
                      holds_sms=fam.holds, host_wait_us=fam.host_wait_us, proxy_nic_threads=fam.proxy_nic_threads,
                      broadcast=fam.broadcast, proxy_call_us=fam.proxy_call_us,
                      proxy_GBps=fam.proxy_GBps)
    return replace(spec, **kw)


__all__ = ["ALL_SMS", "COUNTS", "EPILOGUES", "FAMILIES", "KernelFamily", "KernelSpec", "REDUCE_MODES", "RelayChunk",
           "UCCL_CHUNKS", "V1_CHUNKS", "V2_SM_COPY_FACTOR", "chunk_for", "family", "family_spec"]
