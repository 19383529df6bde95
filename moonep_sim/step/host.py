"""The host's side of an eager training step: the CPU launches every kernel, and where the library
reads a device value back (a device-to-host sync) the CPU stops until the GPU has drained, so the
kernels launched after it pay their launch cost with the GPU idle.

Notation: n kernels of one block, h the host's time per launched kernel, g a kernel's GPU time.
Times in microseconds.

**The host timeline** (:func:`host_timeline_us`). A chunk of a step is a sequence of blocks (an
attention block, an MoE block, the embedding, the head), each ``n`` kernels whose GPU time ``G``
is spread evenly over them (``g = G / n``). The host issues kernel j at ``t0 + j h``; the GPU
starts it once it is issued and the previous kernel ended: over a segment of kernels the GPU
finishes at ``max_j (issue_j + sum_{k >= j} g_k)``. A block marked ``sync`` starts a new segment:
the host first waits until the GPU has run everything issued before it (the sync), then issues
on. Within a segment the host runs ahead of a GPU busy with long kernels; across a sync it
cannot, so a layer of many short kernels costs its launches (``n h``) and a layer of long
kernels its GPU time -- and a step that alternates the two pays both.

Where the syncs are (:data:`SYNC_BEFORE_DISPATCH`): Megatron-Core's all-to-all token dispatcher
(``MoEAlltoAllTokenDispatcher``, the ``alltoall`` strategy) copies the token counts to the host
and waits for them before every forward all-to-all (``_maybe_dtoh_and_synchronize`` at
``before_ep_alltoall``: the splits of ``all_to_all`` are host lists); its all-gather dispatcher
(``allgather``) reads ``tokens_per_expert`` with ``.cpu()`` and ``num_out_tokens`` with
``.item()``; DeepEP's normal kernels busy-wait on the host for the received counts
(``KernelSpec.host_wait_us``, seen as a ``host_wait`` event of the step's timeline). The backward
reuses the forward's host-side splits: no sync. Each pipeline op starts synchronised (Megatron's
``batch_p2p_sync``: ``torch.cuda.synchronize()`` after every batched p2p exchange, its default).

The constants are measured in DeepSeek's H800 pretraining trace (``../shared/profiles``: one
DualPipe chunk pair of 4 MoE layers, PyTorch eager, annotated per block): the host launches a
kernel every 28.5 us (median gap between consecutive ``cudaLaunchKernel`` calls of the forward
thread; 29 us on the autograd thread), and a layer launches 62 kernels in its attention block
forward (norms, projections, RoPE, casts, attention, the gate and its top-k: ``attn(F)``), 25 in
its MoE block forward (``dispatch(F)`` 3 + ``mlp(F)`` 20 + ``combine(F)`` 2), 98 in the attention
block backward (``attn(B)`` 93 + ``attn(W)`` 5) and 46 in the MoE block backward (``mlp(B)`` 29 +
``mlp(W)`` 12 + ``dispatch(B)`` 2 + ``combine(B)`` 3). ASSUMED: Megatron-Core launches as
many kernels per block; its host time per launch is FITTED on a development row
(:data:`MEGATRON_HOST_LAUNCH_US`), no Megatron trace being at hand; a dense FFN block launches
the MoE block's ``mlp`` kernels (20 / 41); the embedding 2 / 2 and the head with its fused loss
6 / 8.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Sequence

import dataclasses

import numpy as np

from moonep_sim.errors import require

#: Host time per launched kernel (us): the median gap between consecutive kernel launches of the
#: forward thread in DeepSeek's H800 pretraining trace (29 us on its autograd thread). The layout
#: step uses it for DeepSeek's own schedule (``dualpipe``).
HOST_LAUNCH_GAP_US = 28.5
#: Megatron-Core's host time per launched kernel (us), FITTED on ANCHORS development row 2
#: (Megatron-Bridge, Qwen3-30B-A3B on 64 H100 of p5.48xlarge: its 17 published iteration times,
#: the median absolute log error; leave-one-out and the check on row 1 in
#: docs/results/host-launch-fit.md, ``python benchmarks/fidelity_steps.py --fit-host``): at
#: DeepSeek's kernel counts per block, the time Megatron's Python modules, TransformerEngine's
#: wrappers and autograd spend per kernel. Not measured: no Megatron trace is at hand.
MEGATRON_HOST_LAUNCH_US = 82.0
#: Kernels a block launches, forward and backward, counted per annotated block in the same trace
#: (module docstring); the dense FFN, embedding and head counts are ASSUMED.
KERNELS = {"attention": (62, 98), "moe": (25, 46), "dense_ffn": (20, 41), "embed": (2, 2), "head": (6, 8)}
#: Strategies whose library syncs the host before each forward dispatch (module docstring); a
#: kernel family with a host wait (a ``host_wait`` event on the step's timeline) syncs too.
SYNC_BEFORE_DISPATCH = ("alltoall", "allgather")


_LAUNCH_US: ContextVar[float | None] = ContextVar("moonep_sim_host_launch_us", default=None)


@contextmanager
def host_launch_cost(us: float):
    """Within the block, the host timeline of every step priced in this thread launches at ``us``
    per kernel (``benchmarks/fidelity_steps.py`` prices its sensitivity this way)."""
    require(us >= 0, f"host launch cost ({us}) must be >= 0 us")
    token = _LAUNCH_US.set(float(us))
    try:
        yield
    finally:
        _LAUNCH_US.reset(token)


def launch_us(pp_schedule: str = "1f1b") -> float:
    """The host's time per launched kernel in force: the one :func:`host_launch_cost` set, else the
    framework's that runs ``pp_schedule`` -- DeepSeek's (:data:`HOST_LAUNCH_GAP_US`, measured) for
    ``dualpipe``, Megatron-Core's (:data:`MEGATRON_HOST_LAUNCH_US`, FITTED on row 2) otherwise."""
    v = _LAUNCH_US.get()
    if v is not None:
        return v
    return HOST_LAUNCH_GAP_US if pp_schedule == "dualpipe" else MEGATRON_HOST_LAUNCH_US


@dataclass(frozen=True)
class Block:
    """``kernels`` launched for ``gpu_us`` of GPU time; ``sync``: the host waits for the GPU to
    drain before launching them; ``host_us``: host time the block spends beyond its launches (a
    host-proxy family's per-call cost, :func:`moonep_sim.sim.kernels.proxy_host_us`), spread evenly
    over its launches."""

    kind: str
    kernels: int
    gpu_us: float
    sync: bool = False
    host_us: float = 0.0


def host_timeline_us(blocks: Sequence[Block], launch: float | None = None) -> float:
    """When the GPU finishes ``blocks`` launched by one host thread at ``launch`` us per kernel
    (default :func:`launch_us`), starting with host and GPU idle (module docstring); with
    ``launch`` 0, the blocks' GPU time."""
    h = launch_us() if launch is None else launch
    require(h >= 0, f"host launch cost ({h}) must be >= 0 us")
    t = 0.0
    seg: list[Block] = []
    for b in list(blocks) + [Block("end", 0, 0.0, True)]:
        if b.sync and seg:
            t += _segment_us(seg, h)
            seg = []
        if b.kernels > 0:
            seg.append(b)
    return t


def _segment_us(seg: Sequence[Block], h: float) -> float:
    """GPU finish time of one segment from a synchronised start: ``max_j (issue_j + sum_{k >= j} g_k)``,
    kernel j issued once the host spent ``h`` plus its block's share of ``host_us`` on it and on
    every kernel before it (``issue_j = j h`` without host time)."""
    n = np.array([b.kernels for b in seg], dtype=np.int64)
    g = np.repeat(np.array([max(b.gpu_us, 0.0) for b in seg]) / n, n)
    issue = h * np.arange(1, g.size + 1) + np.cumsum(np.repeat(np.array([max(b.host_us, 0.0) for b in seg]) / n, n))
    tail = np.cumsum(g[::-1])[::-1]   # sum of g_k for k >= j
    return float(np.max(issue + tail))


def layer_blocks(attention: float, moe: float, is_moe: bool, sync: bool, backward: bool) -> list[Block]:
    """One layer's blocks in launch order: forward the attention block (up to the dispatch) then the
    MoE (or dense FFN) block, ``sync`` before the MoE block; backward the MoE block first, no sync."""
    d = int(backward)
    ffn = "moe" if is_moe else "dense_ffn"
    a = Block("attention", KERNELS["attention"][d], attention)
    f = Block(ffn, KERNELS[ffn][d], moe, sync and is_moe and not backward)
    return [f, a] if backward else [a, f]


#: Timeline events of a layer's MoE block (forward: from the host wait or dispatch on; backward: up
#: to the gradients' combine and the copies' reduce) and of a dense layer's FFN.
_MOE_FWD = ("host_wait", "dispatch")
_MOE_BWD_END = ("dispatch_bwd", "grad_reduce")


def host_blocks(tl, sync: bool, call_us: float = 0.0) -> tuple[tuple, tuple]:
    """(forward, backward) ``(layer, Block)`` of a stage's timeline for the host timeline
    (:mod:`moonep_sim.step.host`): per layer its attention block and its MoE (or dense FFN) block,
    each the GPU span it takes on the rank that ends last, with the kernels it launches (times the
    micro-batches the timeline runs together), the embedding (layer -1) first and the head (layer
    ``L``) last. ``sync``: the strategy's library syncs the host before each forward dispatch; a
    ``host_wait`` event (DeepEP's normal kernels) syncs as well. ``call_us``: the host's time per
    dispatch or combine call (a host-proxy family's, ``moonep_sim.sim.kernels.proxy_host_us``),
    charged to each MoE block for its two calls per micro-batch."""
    if not tl.events:
        return (), ()
    r = int(np.argmax(tl.end_R()))
    mbs = len({e.micro_batch for e in tl.events})
    sync = sync or any(e.name == "host_wait" for e in tl.events)
    by: dict[tuple[int, str], list] = {}
    last = max(e.layer for e in tl.events)
    for e in tl.events:
        layer = e.layer if e.layer >= 0 else (-1 if e.name.startswith("embed") else last + 1)
        by.setdefault((layer, e.direction), []).append(e)

    def span(evs) -> tuple[float, float]:
        return min(float(e.start_R[r]) for e in evs), max(float(e.end_R[r]) for e in evs)

    def blk(kind: str, gpu: float, bwd: bool, s: bool = False) -> Block:
        return Block(kind, KERNELS[kind][int(bwd)] * mbs, max(gpu, 0.0), s, 2 * mbs * call_us if kind == "moe" else 0.0)

    fwd, bwd = [], []
    for (layer, direction), evs in sorted(by.items()):
        a, b = span(evs)
        back = direction != "forward"
        out = bwd if back else fwd
        if layer < 0 or layer > last:
            out.append((layer, blk("embed" if layer < 0 else "head", b - a, back)))
            continue
        moe = any(e.name in _MOE_FWD or e.name.startswith("expert") for e in evs)
        ffn = "moe" if moe else "dense_ffn"
        if not back:
            cut = [float(e.start_R[r]) for e in evs if e.name in (_MOE_FWD if moe else ("dense_ffn",))]
            c = min(cut) if cut else b
            out += [(layer, blk("attention", c - a, False)), (layer, blk(ffn, b - c, False, sync and moe))]
        else:
            cut = [float(e.end_R[r]) for e in evs if e.name in (_MOE_BWD_END if moe else ("dense_ffn_bwd",))]
            c = max(cut) if cut else a
            out += [(layer, blk(ffn, c - a, True)), (layer, blk("attention", b - c, True))]
    bwd.sort(key=lambda x: -x[0])
    return tuple(fwd), tuple(bwd)


def stacked_host_blocks(progs: list) -> tuple[tuple, tuple]:
    """(forward, backward) host blocks of a stage made of one-layer programs ``progs`` in layer
    order (the layout search's :func:`~moonep_sim.experiments.layout_search.priced_stages`): layer
    i's blocks from program i, the embedding from the first, the head from the last (after the
    stage's last layer)."""
    n = len(progs)

    def stack(attr: str, backward: bool) -> tuple:
        out = []
        for i, sp in enumerate(progs):
            for l, b in getattr(sp, attr):
                if l == 0:
                    out.append((i, b))
                elif (l < 0 and i == 0) or (l > 0 and i == n - 1):
                    out.append((n if l > 0 else -1, b))
        return tuple(sorted(out, key=lambda x: -x[0] if backward else x[0]))
    return stack("host_forward", False), stack("host_backward", True)


def host_excess_us(blocks: tuple, keep, tp_us: float = 0.0, tp_kernels: int = 0, launch: float | None = None) -> float:
    """What the host timeline adds to the GPU time of the ``(layer, Block)`` pairs whose layer
    ``keep`` accepts: ``host_timeline_us`` less the blocks' GPU time; ``tp_us`` (and
    ``tp_kernels`` launches) of the chunk's TP collectives spread evenly over its layer blocks;
    ``launch``: us per launch (default :func:`launch_us`)."""
    bl = [b for l, b in blocks if keep(l)]
    h = launch_us() if launch is None else launch
    if h <= 0:
        return 0.0
    inner = [i for i, b in enumerate(bl) if b.kind in ("attention", "moe", "dense_ffn")]
    if not bl:
        return 0.0
    if inner and (tp_us > 0 or tp_kernels > 0):
        n = len(inner)
        add = {i: (tp_us / n, tp_kernels // n + (1 if j < tp_kernels % n else 0)) for j, i in enumerate(inner)}
        bl = [dataclasses.replace(b, gpu_us=b.gpu_us + add[i][0], kernels=b.kernels + add[i][1]) if i in add else b
              for i, b in enumerate(bl)]
    return max(host_timeline_us(bl, h) - sum(b.gpu_us for b in bl), 0.0)


__all__ = ["Block", "HOST_LAUNCH_GAP_US", "KERNELS", "MEGATRON_HOST_LAUNCH_US", "SYNC_BEFORE_DISPATCH", "host_blocks", "host_excess_us",
           "host_launch_cost", "host_timeline_us", "launch_us", "layer_blocks", "stacked_host_blocks"]
