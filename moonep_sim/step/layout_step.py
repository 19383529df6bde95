"""The step under a parallel layout: stage programs from today's step, scheduled over a pipeline,
with the TP, CP, PP and DP collectives and the optimizer step around them.

Notation: p pipeline ranks, v chunks per rank, m micro-batches, t tp, c cp, d dp, e ep.
Times in microseconds; bytes.

A layout (:class:`~moonep_sim.step.parallel.Parallel`) wraps today's step, never replaces it:

1. **Stage programs.** Each pipeline chunk's layers (``Parallel.stage_layers``, uneven first and
   last stages included) are a model of their own (:func:`stage_model`), and one micro-batch of it
   is today's step (:func:`moonep_sim.step.run.simulate_step`): its MoE layers planned per strategy
   and simulated over the **EP group** (e ranks placed as the layout puts them: ETP fastest, so
   ``G / etp`` of a node's G GPUs per node), on the tokens each rank of the stage's expert grid
   holds, ``micro_batch_size x seq / (t x c)`` (Megatron splits the TP group's tokens for the
   dispatch; the dense GEMMs' FLOPs per rank are those of the TP shard). The composed timeline
   gives the chunk's forward and backward time (and their compute share); the embedding and the
   LM head (and loss) are kept on the first / last chunk only.
2. **TP (and SP, ETP, CP) collectives** per layer, on the stage's critical path (ASSUMED exposed:
   no TP-communication overlap): two all-reduces of the TP group's activations
   (``mbs x seq/c x H`` bf16) forward and two backward (with sequence parallelism a reduce-scatter
   and an all-gather each: the same bytes); with etp > 1 each MoE layer adds an all-reduce of its
   expert rows over the ETP group; with c > 1 every layer with a per-token cache passes its chunk
   of it (a TP rank's ``cache_shards`` share) around the CP ring (c - 1 sends forward, twice that backward; ASSUMED not overlapped with the
   attention: an upper bound). Each all-reduce, reduce-scatter and all-gather runs NCCL's fastest
   algorithm and protocol for its size and span (:func:`~moonep_sim.step.collectives.choose`).
3. **The pipeline**: the chunk times are scheduled by the layout's pp schedule
   (:mod:`moonep_sim.step.pipelines`: 1F1B, interleaved, DualPipe), each boundary's activation send
   (``mbs x seq/c x H`` bf16, divided by t with SP) over the link it crosses
   (:func:`~moonep_sim.step.collectives.stage_boundary_links`). With
   ``overlap_moe_expert_parallel_comm`` (training) the interleaved pipeline runs as Megatron-Core's
   combined 1F1B (``combined-1f1b``): each steady forward-backward pair one op of
   ``max(max(compute F + compute B, EP comm F + EP comm B) + TP F + TP B, launches F + launches B)``
   (:class:`~moonep_sim.step.pipelines.base.FBParts`): the dispatch and combine of each half
   hidden behind the other's compute, the TP collectives still on the compute stream, and the host
   launching both halves' kernels (its syncs ASSUMED hidden behind queued GPU work); warm-up and
   cool-down ops as before.
4. **DP**: after its last backward each pipeline rank reduces its gradients over its data-parallel
   group (the dense share over ``d x c`` ranks ``t`` apart; the experts over ``edp`` ranks ``e x
   etp`` apart): an all-reduce with ZeRO 0, a reduce-scatter with the distributed optimizer
   (ZeRO >= 1), then its parameter all-gather; with ZeRO 3 the parameters stay sharded, gathered
   before each chunk's forward and backward of every micro-batch and prefetched behind the rank's
   compute (only what exceeds the rank's busy time is exposed, added at its end). Gradients are reduced in fp32, parameters
   gathered in bf16 (Megatron's defaults). With ``overlap_grad_reduce`` the reduce of all but the
   last micro-batch's backward is hidden behind it (only what exceeds that window is exposed).
5. **The optimizer step**: memory-bound over the rank's optimizer shard
   (:data:`OPTIMIZER_BYTES_PER_PARAM` per parameter at the GPU's memory bandwidth x efficiency),
   with the gradient norm's read of the shard and the zeroing of the rank's whole fp32 gradient
   buffer (:data:`GRAD_NORM_BYTES_PER_PARAM`, :data:`GRAD_BUFFER_ZERO_BYTES_PER_PARAM`); with
   optimizer CPU offload part of the step on the host (:mod:`moonep_sim.step.offload`: the PCIe
   copies and a CPU Adam), and the node's host memory checked beside the GPU's.
6. **The host** (training, eager launches): each chunk's forward and backward run on the host
   timeline of :mod:`moonep_sim.step.host` -- the CPU launches every block's kernels (counts from
   DeepSeek's trace) at the framework's cost per launch (Megatron-Core's FITTED on development row
   2; DeepSeek's measured, for DualPipe) and waits for the GPU at each device-to-host sync (Megatron's all-to-all
   dispatcher before every forward all-to-all, DeepEP's count wait), so a stage of short kernels
   costs its launches; what that adds to the chunk's GPU time is ``host_bound_us`` per stage
   (its TP collectives, one launch each, spread over the layers). Serving runs CUDA graphs: none.
7. **Serving under TP attention** (:func:`moe_input_replicated`): the attention's all-reduce leaves
   every token on every TP rank, so an EP group inside the TP group runs its experts on them and
   sums in the layer's second TP all-reduce: the MoE's dispatch and combine are not run (the
   stage's forward is its compute; the TP all-reduces stay).

The step ends on the pipeline rank that finishes last. Memory per pipeline rank: the layout's account
(:func:`moonep_sim.step.memory.memory_for_layout`, via :func:`layout_memory`) over the Plans of
every MoE layer the stages ran, in the step's weight, KV and GEMM dtypes with its recompute.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.step import collectives as coll
from moonep_sim.step.attention import attention_kind
from moonep_sim.step.host import SYNC_BEFORE_DISPATCH, host_blocks, host_excess_us, launch_us
from moonep_sim.step.parallel import Parallel
from moonep_sim.step.pipelines import get_schedule
from moonep_sim.step.offload import GPU_ADAM_BYTES_PER_PARAM, host_check, optimizer_step_us
from moonep_sim.step.pipelines.base import ChunkTimes, FBParts, run_schedule
from moonep_sim.step.stack import BF16, StepShape, attention_params, backward_op, head_ops, kv_elems_per_token

#: The optimizer step's bytes per parameter on the GPU (:data:`moonep_sim.step.offload.GPU_ADAM_BYTES_PER_PARAM`).
OPTIMIZER_BYTES_PER_PARAM = GPU_ADAM_BYTES_PER_PARAM
#: Megatron-Core's step around the optimizer, per parameter: the gradient norm reads each fp32 main
#: gradient of the rank's optimizer shard (``get_grad_norm_fp32``, every step, for the clipping and
#: the log), and every iteration starts by zeroing the fp32 gradient buffer of all the rank's local
#: parameters (``zero_grad_buffer`` in ``megatron/training/training.py``): 4 bytes each.
GRAD_NORM_BYTES_PER_PARAM = 4
GRAD_BUFFER_ZERO_BYTES_PER_PARAM = 4
#: Megatron's defaults: gradients reduced in fp32, parameters gathered in bf16.
GRAD_REDUCE_BYTES = 4
PARAM_GATHER_BYTES = BF16


@functools.lru_cache(maxsize=4096)
def stage_model(model: ModelSpec, start: int, stop: int) -> ModelSpec:
    """Layers ``[start, stop)`` of ``model`` as a model of their own (the dense layers first, each
    layer's attention kind kept)."""
    require(0 <= start < stop <= model.layers, f"stage layers ({start}..{stop}) must lie in 0..{model.layers}")
    kinds = [model.attention_kind(l) for l in range(start, stop)]
    moe = sum(1 for l in range(start, stop) if l >= model.dense_layers)
    return dataclasses.replace(model, name=f"{model.name}[{start}:{stop}]", layers=stop - start, moe_layers=moe,
                               attention=",".join(kinds))


@functools.lru_cache(maxsize=1024)
def dense_probe_model(model: ModelSpec, start: int, stop: int) -> ModelSpec:
    """Dense layers ``[start, stop)`` of ``model`` followed by its first MoE layer: a model the step
    can run (a model needs an MoE layer); the dense layers' program is this model's less the MoE
    layer's alone (:func:`stage_model` of it)."""
    require(stop <= model.dense_layers and model.moe_layers >= 1,
            f"dense layers ({start}..{stop}) must lie in the model's first {model.dense_layers} layers")
    kinds = [model.attention_kind(l) for l in range(start, stop)] + [model.attention_kind(model.dense_layers)]
    return dataclasses.replace(model, name=f"{model.name}[{start}:{stop}]+moe", layers=stop - start + 1, moe_layers=1,
                               attention=",".join(kinds))


def program_difference(with_moe: "StageProgram", moe: "StageProgram", head: tuple[float, float, float, float]
                       ) -> "StageProgram":
    """The dense layers' program of a :func:`dense_probe_model`: its program less the MoE layer's
    alone (both ran the embedding and the head once, so they are added back once); memory: the
    difference of activations and KV, no buffers of its own."""
    ef, hf, eb, hb = head
    a, b = with_moe.memory["parts"], moe.memory["parts"]
    parts = {"weights": max(a["weights"] - b["weights"], 0.0), "buffers": 0.0}
    if "activations" in a:
        parts["activations"] = a["activations"] - b["activations"]   # the logits cancel
    if "kv_cache" in a:
        parts["kv_cache"] = a["kv_cache"] - b["kv_cache"]
    n = max((l for l, _ in with_moe.host_forward), default=1) - 1   # the probe's MoE layer; the head after it

    def dense(blocks: tuple) -> tuple:
        return tuple((n if l > n else l, b) for l, b in blocks if l != n)
    return StageProgram(with_moe.forward_us - moe.forward_us + ef + hf, with_moe.backward_us - moe.backward_us + eb + hb,
                        with_moe.forward_compute_us - moe.forward_compute_us + ef + hf,
                        with_moe.backward_compute_us - moe.backward_compute_us + eb + hb,
                        {"parts": parts, "dense_only": True}, 0, 0,
                        host_forward=dense(with_moe.host_forward), host_backward=dense(with_moe.host_backward))


def expert_group_gpus_per_node(p: Parallel, gpus_per_node: int) -> int:
    """EP ranks per node of one EP group: ETP is the fastest dimension, so a node's G GPUs hold
    ``G / etp`` ranks of the group (at most ep)."""
    return max(1, min(p.ep, gpus_per_node // p.etp if gpus_per_node >= p.etp else 1))


def _head_us(model: ModelSpec, shape: StepShape, costs) -> tuple[float, float, float, float]:
    """(embed forward, head forward, embed backward, head backward) us of one micro-batch."""
    first, last = head_ops(model, shape)
    train = shape.mode == "train"
    ef = sum(costs.op_us(o) for o in first)
    hf = sum(costs.op_us(o) for o in last)
    eb = sum(costs.op_us(backward_op(o)) for o in first) if train else 0.0
    hb = sum(costs.op_us(backward_op(o)) for o in last) if train else 0.0
    return ef, hf, eb, hb


def _timeline_split(tl) -> tuple[float, float, float, float]:
    """(forward us, backward us, forward compute us, backward compute us) of a stage's timeline:
    the forward ends at its last forward event; compute on the rank that ends last."""
    import numpy as np

    end_R = tl.end_R()
    r = int(np.argmax(end_R))
    f_end = max((float(e.end_R.max()) for e in tl.events if e.direction == "forward"), default=0.0)
    total = float(end_R[r])
    fc = sum(float(e.end_R[r] - e.start_R[r]) for e in tl.events if e.stream == "compute" and e.direction == "forward")
    bc = sum(float(e.end_R[r] - e.start_R[r]) for e in tl.events if e.stream == "compute" and e.direction != "forward")
    return f_end, total - f_end, min(fc, f_end), min(bc, total - f_end)


def moe_input_replicated(p: Parallel, mode: str) -> bool:
    """Whether a serving step's MoE layers run on tokens every rank of their EP group already holds:
    under TP attention (no data-parallel attention) the layer's all-reduce leaves every token on
    every rank of the TP group, and an EP (x ETP) group inside it runs its local experts on them
    and sums their outputs in the layer's second TP all-reduce -- no all-to-all dispatch or combine
    (SGLang's and vLLM's expert parallelism under TP attention, TensorRT-LLM's MoE EP with attention
    TP). Training keeps Megatron's split of the TP group's tokens over the dispatch."""
    return mode != "train" and p.tp > 1 and not p.dp_attention and p.ep * p.etp <= p.tp


def tp_comm_us(model: ModelSpec, start: int, stop: int, p: Parallel, shape: StepShape, topo, tokens_tp: int,
               gpus_per_node: int) -> tuple[float, float]:
    """(forward, backward) us of one micro-batch's TP, ETP and CP collectives over layers
    ``[start, stop)`` (see the module docstring). ``tokens_tp``: the TP group's tokens."""
    H = model.hidden
    f = b = 0.0
    if p.tp > 1:
        link, sp = coll.group_link(topo, p.tp, 1, gpus_per_node), coll.group_shape(topo, p.tp, 1, gpus_per_node)
        S = tokens_tp * H * BF16
        one = (coll.reduce_scatter_us(S, p.tp, link, span=sp) + coll.all_gather_us(S, p.tp, link, span=sp)) \
            if p.sequence_parallel else coll.all_reduce_us(S, p.tp, link, span=sp)
        f += 2 * one * (stop - start)
        b += 2 * one * (stop - start)
    moe = sum(1 for l in range(start, stop) if l >= model.dense_layers)
    if p.etp > 1 and moe:
        link, sp = coll.group_link(topo, p.etp, 1, gpus_per_node), coll.group_shape(topo, p.etp, 1, gpus_per_node)
        rows = shape.tokens * model.top_k * p.etp  # an expert-TP rank's rows: its ETP group's tokens' routed rows
        one = coll.all_reduce_us(rows * model.dispatch_hidden * BF16, p.etp, link, span=sp)
        f += one * moe
        b += one * moe
    if p.cp > 1:
        link = coll.group_link(topo, p.cp, p.tp, gpus_per_node)
        for l in range(start, stop):
            kind = model.attention_kind(l)
            if kind and kv_elems_per_token(model, kind):   # a per-token cache (a fixed state stays put)
                # the rank's chunk (the TP group's tokens, already 1/cp of the sequence), its TP rank's share
                kv = tokens_tp * kv_elems_per_token(model, kind) / attention_kind(kind).cache_shards(model, p.tp) * BF16
                f += (p.cp - 1) * coll.send_us(kv, link)
                b += 2 * (p.cp - 1) * coll.send_us(kv, link)
    return f, b


@functools.lru_cache(maxsize=16384)
def chunk_params(model: ModelSpec, start: int, stop: int, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters (elements) of layers ``[start, stop)`` (the embedding on the first
    chunk, the LM head on the last), counted as :func:`~moonep_sim.step.stack.dense_params` counts
    a whole model's."""
    H, F = model.hidden, model.expert_ffn
    dense = 0.0
    moe = 0
    for l in range(start, stop):
        dense += attention_params(model, model.attention_kind(l)) + 2 * H
        if l < model.dense_layers:
            dense += 3 * H * model.dense_ffn
        else:
            moe += 1
            dense += model.shared_experts * 3 * H * F + H * model.num_experts
    dense += model.vocab * H * (int(first) + int(last))
    return float(dense), float(moe) * model.num_experts * 3.0 * model.dispatch_hidden * F


def layout_memory(cfg, p: Parallel, programs: list["StageProgram"]) -> dict:
    """Every pipeline rank's memory under layout ``p``: :func:`~moonep_sim.step.memory.memory_for_layout`
    on the whole model, the Plans (footprints) of every stage program's MoE layers over the EP group,
    the options of ``cfg.memory`` (weight and KV dtypes, GEMM dtype, recompute, optimizer bytes) and
    the expert slots the EP group holds. Its shape is one micro-batch of one data-parallel replica:
    the stage rank's tokens (``cfg.shape.tokens``) times ``tp x cp``."""
    from moonep_sim.step.memory import memory_for_layout

    fps = [f for sp in programs for f in sp.footprints]
    slots = cfg.ctx.placement.num_slots if cfg.ctx is not None else 0
    return memory_for_layout(cfg.model, replica_shape(cfg, p), p, fps, cfg.memory, slots)


def replica_shape(cfg, p: Parallel) -> StepShape:
    """One micro-batch of one data-parallel replica (the shape the layout's memory account takes):
    a stage rank's tokens (``cfg.shape.tokens``) times ``tp x cp``, the step's context."""
    from moonep_sim.step.stack import step_shape

    return step_shape(cfg.model, cfg.shape.mode, cfg.shape.tokens * p.tp * p.cp, cfg.shape.context)


def attach_layout_fits(cfg, p: Parallel, out: dict, programs: dict[str, list["StageProgram"]]) -> None:
    """When every strategy of ``out`` (name -> figures) runs out of memory under layout ``p``, each
    one's smallest change that fits (``fit``: :func:`~moonep_sim.step.memory_fit.smallest_fit` on
    its stages' Plans, the layout and the step's memory options)."""
    if not out or not all(d.get("oom") for d in out.values()):
        return
    from moonep_sim.step.memory_fit import host_capacity, smallest_fit

    fp8 = float(getattr(cfg.topology, "gpu_tflops_fp8", 0) or 0) > 0
    slots = cfg.ctx.placement.num_slots if cfg.ctx is not None else 0
    for name, d in out.items():
        fps = [f for sp in programs[name] for f in sp.footprints]
        d["fit"] = smallest_fit(cfg.model, replica_shape(cfg, p), p, fps, cfg.memory, d["gpu_memory_bytes"],
                                fp8=fp8, expert_slots=slots, host_bytes_per_node=host_capacity(cfg.topology),
                                gpus_per_node=cfg.topology.gpus_per_node)


@dataclass(frozen=True)
class StageProgram:
    """One strategy's program of one pipeline stage for one micro-batch: its forward and backward
    time and their compute share (us; the stage's model, embedding and LM head included as today's
    step runs them), ``memory``: today's account of the stage's model over the EP group
    (``memory_per_rank``'s dict), and the routed entries it ran and dropped."""

    forward_us: float
    backward_us: float
    forward_compute_us: float
    backward_compute_us: float
    memory: dict
    dropped: int = 0
    entries: int = 0
    footprints: tuple = ()
    moe_layer_us: tuple = ()
    host_forward: tuple = ()
    host_backward: tuple = ()

    @classmethod
    def of(cls, res: dict, name: str) -> "StageProgram":
        """From :func:`~moonep_sim.step.run.simulate_step`'s result for strategy ``name``."""
        d = res["strategies"][name]
        tl = res["_timelines"][name]
        F, B, Fc, Bc = _timeline_split(tl)
        hf, hb = host_blocks(tl, name in SYNC_BEFORE_DISPATCH, float(d.get("proxy_host_us", 0.0)))
        return cls(F, B, Fc, Bc, d["memory"], int(d["dropped"]), int(d["entries"]),
                   tuple(res.get("_footprints", {}).get(name, ())),
                   tuple(float(x["time_us"]) for x in d.get("layers", ()) if str(x.get("kind", "")).startswith("moe")),
                   hf, hb)


def stage_bounds(model: ModelSpec, p: Parallel) -> list[tuple[int, int]]:
    """``[start, stop)`` layers of each model stage (``Parallel.stage_layers``)."""
    out, a = [], 0
    for n in p.stage_layers(model.layers):
        out.append((a, a + n))
        a += n
    return out


def simulate_stages(cfg, p: Parallel, source: Callable[[int], tuple], *, progress: Callable[[str], None] | None = None,
                    map_fn: Callable | None = None, pipeline: bool | None = None
                    ) -> tuple[list[dict[str, StageProgram]], list[str]]:
    """Each model stage's :class:`StageProgram` per strategy (today's step of its layers for one
    micro-batch) and the routing provenance of every MoE layer."""
    from moonep_sim.step.run import simulate_step

    m = cfg.model
    out, prov = [], []
    bounds = stage_bounds(m, p)

    def run(model: ModelSpec, off: int) -> dict:
        return simulate_step(dataclasses.replace(cfg, model=model), lambda i: source(off + i), None, map_fn, pipeline)

    for si, (a, b) in enumerate(bounds):
        moe_before = max(a - m.dense_layers, 0)
        if progress:
            progress(f"stage {si + 1} of {len(bounds)}: layers {a}..{b - 1}", si, len(bounds))
        if b > m.dense_layers:
            res = run(stage_model(m, a, b), moe_before)
            out.append({n: StageProgram.of(res, n) for n, _ in cfg.strategies})
            prov += res["layers_routing"]
            continue
        # a stage of dense layers only: with the first MoE layer appended, less that layer alone
        both, moe = run(dense_probe_model(m, a, b), 0), run(stage_model(m, m.dense_layers, m.dense_layers + 1), 0)
        head = _head_us(m, cfg.shape, cfg.costs)
        out.append({n: program_difference(StageProgram.of(both, n), StageProgram.of(moe, n), head)
                    for n, _ in cfg.strategies})
    return out, prov


def static_memory_bytes(model: ModelSpec, p: Parallel, shape: StepShape, opts) -> float:
    """The fullest pipeline rank's weights, gradients and optimizer state under layout ``p`` and
    memory options ``opts`` (no activations, buffers or KV cache; balanced routing): a lower bound of
    :func:`layout_memory`'s peak, known before any simulation (the layout search drops the layouts
    it rules out unpriced). ``shape``: one micro-batch of one data-parallel replica."""
    from moonep_sim.step.memory import memory_for_layout

    mem = memory_for_layout(model, shape, p, [], opts)
    return max(sum(st["parts"].get(k, 0.0) for k in ("weights", "gradients", "optimizer")) for st in mem["stages"])


def layout_step(cfg, p: Parallel, source: Callable[[int], tuple], gpus_per_node: int, *, progress=None,
                map_fn: Callable | None = None, pipeline: bool | None = None) -> dict:
    """Every strategy's step under layout ``p`` (see the module docstring).

    cfg: a :class:`~moonep_sim.step.run.StepConfig` whose ``ctx`` is one EP group's (``p.ep``
    ranks) and whose ``shape`` is one micro-batch on one rank of a stage's expert grid (tokens
    ``micro_batch_size x seq / (t x c)``; context the sequence length). source: MoE layer index
    of the whole model -> (key, routing over the EP group, provenance). gpus_per_node: the
    cluster's. Returns ``{"strategies": {name: figures}, "parallel": ..., ...}``."""
    from moonep_sim.step.memory import check_optimizer_shard

    check_optimizer_shard(p, cfg.memory.optimizer_shard)   # before any simulation
    programs, prov = simulate_stages(cfg, p, source, progress=progress, map_fn=map_fn, pipeline=pipeline)
    by_name = {n: [st[n] for st in programs] for n, _ in cfg.strategies}
    out = {n: schedule_layout(cfg, p, by_name[n], gpus_per_node) for n in by_name}
    attach_layout_fits(cfg, p, out, by_name)
    from moonep_sim.step.compose import all_ops, stack_ops

    train = cfg.shape.mode == "train"
    sources = cfg.costs.sources(all_ops(stack_ops(cfg.model, cfg.shape), train), train) if cfg.costs else None
    return {"strategies": out, "mode": cfg.shape.mode, "tokens_per_rank": cfg.shape.tokens,
            "context": cfg.shape.context, "overlap": cfg.overlap, "layers_routing": prov, "parallel": p.to_dict(),
            "compute_sources": sources,
            "layout": p.label(), "pipeline": None, "_timelines": {}}


def schedule_layout(cfg, p: Parallel, programs: list[StageProgram], gpus_per_node: int) -> dict:
    """One strategy's figures under layout ``p`` from its stage programs (one per model stage):
    the TP/CP collectives added, the pipeline scheduled, then DP, parameter gather and optimizer per
    pipeline rank; memory per pipeline rank (see the module docstring)."""
    from moonep_sim.step.run import useful_flops_per_rank

    m = cfg.model
    train = cfg.shape.mode == "train"
    topo = cfg.topology
    bounds = stage_bounds(m, p)
    M = p.micro_batches
    combined = train and p.overlap_moe_expert_parallel_comm   # Megatron's combined 1F1B (module docstring, 3.)
    sched = get_schedule("combined-1f1b" if combined else p.pp_schedule, p.pp, p.vpp, M)
    T = cfg.shape.tokens
    tokens_tp = T * p.tp   # the TP group's tokens of one micro-batch (after the CP split)
    ef, hf, eb, hb = _head_us(m, cfg.shape, cfg.costs)
    links = coll.stage_boundary_links(topo, p.tp * p.cp * p.dp, p.pp, gpus_per_node)
    act = tokens_tp * m.hidden * BF16 / (p.tp if p.sequence_parallel else 1)   # one micro-batch's activations
    send_link = {}
    for r in range(p.pp - 1):
        send_link[(r, r + 1)] = send_link[(r + 1, r)] = links[r]
    wrap = coll.nic(topo) if p.pp > 1 and p.world > gpus_per_node else coll.nvlink(topo)

    def send_us(c0: int, c1: int) -> float:
        r0, r1 = sched.rank_of(c0), sched.rank_of(c1)
        return 0.0 if r0 == r1 else coll.send_us(act, send_link.get((r0, r1), wrap))

    # eager launches in training: the host timeline (a training framework's launches, autograd and
    # syncs; serving engines' prefill and decode keep the cost model's own launch costs); TP
    # collectives launched per layer and direction
    host_bound = train and cfg.costs is not None and cfg.costs.launch == "eager"
    replicated = moe_input_replicated(p, cfg.shape.mode)
    tp_kernels = (4 if p.sequence_parallel else 2) if p.tp > 1 else 0
    h_us = launch_us(p.pp_schedule)
    f_us, b_us, fc_us, bc_us, stage_fig = [], [], [], [], []
    parts: list[tuple[float, ...]] = []   # per stage: EP comm, TP comm and host launches, forward and backward
    for (a, b), sp in zip(bounds, programs):
        F, B, Fc, Bc = sp.forward_us, sp.backward_us, sp.forward_compute_us, sp.backward_compute_us
        if replicated:   # no dispatch or combine: the stage's exposed MoE communication is not run (7.)
            F = Fc
        if a != 0:
            F, Fc, B, Bc = F - ef, Fc - ef, B - eb, Bc - eb
        if b != m.layers:
            F, Fc, B, Bc = F - hf, Fc - hf, B - hb, Bc - hb
        tf, tb = tp_comm_us(m, a, b, p, cfg.shape, topo, tokens_tp, gpus_per_node)
        hf_us = hb_us = lf_us = lb_us = 0.0
        if host_bound:   # the host's launches and syncs (module docstring, 6.)
            def keep(l: int, a=a, b=b) -> bool:
                return (l >= 0 or a == 0) and (l < b - a or b == m.layers)
            k = tp_kernels * (b - a) + (sum(1 for l in range(a, b) if l >= m.dense_layers) if p.etp > 1 else 0)
            hf_us = host_excess_us(sp.host_forward, keep, tf, k, h_us)
            hb_us = host_excess_us(sp.host_backward, keep, tb, k, h_us) if train else 0.0
            lf_us, lb_us = (_launches_us(blk, keep, k, h_us) for blk in (sp.host_forward, sp.host_backward))
        parts.append((max(F - Fc, 0.0), max(B - Bc, 0.0), tf, tb, lf_us, lb_us))
        F, B = F + tf + hf_us, (B + tb + hb_us if train else 0.0)
        f_us.append(F)
        b_us.append(B)
        fc_us.append(max(Fc, 0.0))
        bc_us.append(max(Bc, 0.0) if train else 0.0)
        stage_fig.append({"layers": [a, b], "forward_us": F, "backward_us": B, "tp_cp_comm_us": tf + (tb if train else 0.0),
                          "host_bound_us": hf_us + hb_us})
    ch = [sched.stage_of(c) for c in range(sched.chunks())]
    fb = FBParts(*([parts[s][i] for s in ch] for i in range(6))) if combined else None
    run = run_schedule(sched, ChunkTimes([f_us[s] for s in ch], [b_us[s] for s in ch], [fc_us[s] for s in ch],
                                         [bc_us[s] for s in ch], send_us, fb))
    ranks_chunks = [[c for c in range(sched.chunks()) if sched.rank_of(c) == r] for r in range(p.pp)]
    ends, last_b = [0.0] * p.pp, [0.0] * p.pp
    for r, kind, mb, c, mb2, c2, s0, s1 in run.ops:
        ends[r] = max(ends[r], s1)
        if "B" in kind:
            last_b[r] = s1 - s0
    per_rank = [_rank_tail(cfg, p, m, r, ranks_chunks[r], sched, bounds, ends[r], last_b[r], gpus_per_node, train,
                           run.busy_us[r])
                for r in range(p.pp)]
    slow = max(per_rank, key=lambda x: x["end_us"])
    step_us = slow["end_us"]
    tokens = M * p.dp * p.micro_batch_size * cfg.shape.context if train else p.dp * T * p.tp * p.cp
    tps = tokens / (step_us * 1e-6) / p.world if step_us > 0 else 0.0
    useful = useful_flops_per_rank(cfg)   # the whole model's FLOPs on one micro-batch of a stage rank's tokens
    mfu = useful * M / p.pp / (step_us * topo.gpu_tflops * 1e6) if step_us > 0 else 0.0
    mem = layout_memory(cfg, p, programs)
    cap = topo.gpu_memory_GiB * 2**30
    peak = mem["peak_bytes"]
    host = host_check(mem, topo, gpus_per_node, p.world)
    compute = (sum(fc_us) + sum(bc_us)) * M / p.pp
    host_us = sum(st["host_bound_us"] for st in stage_fig) * M / p.pp   # the GPU waiting on the host, per rank
    return {"step_time_us": step_us, "tokens_per_s_per_gpu": tps, "mfu": mfu, "compute_us": compute,
            "exposed_comm_us": max(step_us - compute, 0.0), "host_bound_us": host_us,
            "comm_share": max(step_us - compute, 0.0) / step_us if step_us > 0 else 0.0,
            "slowest_rank": slow["rank"], "pipeline": run.to_dict(), "stages": stage_fig, "pipeline_ranks": per_rank,
            "pp_send_us": [coll.send_us(act, lk) for lk in links], "pp_send_links": [lk.name for lk in links],
            "peak_memory_bytes": peak, "peak_memory_pp_rank": mem["peak_stage"], "gpu_memory_bytes": cap,
            "oom": ((peak > cap) if cap else None) or bool(host["oom"]), "memory": mem, "host_memory": host,
            "memory_per_pp_rank": [x["peak_bytes"] for x in mem["stages"]],
            "dropped": sum(sp.dropped for sp in programs), "entries": sum(sp.entries for sp in programs),
            "moe_layer_us_mean": _mean([t for sp in programs for t in sp.moe_layer_us]),
            "tokens_per_step": tokens}


def _launches_us(blocks: tuple, keep, tp_kernels: int, launch: float) -> float:
    """The host's time to launch the kept ``(layer, Block)`` pairs' kernels and ``tp_kernels`` more
    at ``launch`` us each, never waiting for the GPU (what one host thread spends on a chunk inside
    a combined 1F1B op, whose syncs wait on GPU work queued behind the other half: ASSUMED)."""
    bl = [b for l, b in blocks if keep(l)]
    return (sum(b.kernels for b in bl) + tp_kernels) * launch + sum(b.host_us for b in bl)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _rank_tail(cfg, p: Parallel, m: ModelSpec, r: int, chunks: list[int], sched, bounds, end_us: float,
               last_b_us: float, gpus_per_node: int, train: bool, busy_us: float = 0.0) -> dict:
    """Pipeline rank ``r``'s DP gradient reduce, parameter gather and optimizer step after its last op
    (``busy_us``: the rank's compute over the pipeline, behind which ZeRO 3 prefetches its gathers)."""
    topo = cfg.topology
    dense = expert = 0.0
    for c in chunks:
        a, b = bounds[sched.stage_of(c)]
        dn, ex = chunk_params(m, a, b, a == 0, b == m.layers)
        dense, expert = dense + dn / p.tp, expert + ex / p.ep / p.etp
    ddp, edp = p.dp * p.cp, p.edp
    dl = coll.group_link(topo, ddp, p.tp, gpus_per_node)
    el = coll.group_link(topo, edp, p.ep * p.etp, gpus_per_node)
    ds, es = coll.group_shape(topo, ddp, p.tp, gpus_per_node), coll.group_shape(topo, edp, p.ep * p.etp, gpus_per_node)
    grad = gather = opt = exposed = z3 = z3_exposed = 0.0
    offload: dict = {}
    if train:
        if p.zero == 0:
            grad = coll.all_reduce_us(dense * GRAD_REDUCE_BYTES, ddp, dl, span=ds) + \
                coll.all_reduce_us(expert * GRAD_REDUCE_BYTES, edp, el, span=es)
        else:
            grad = coll.reduce_scatter_us(dense * GRAD_REDUCE_BYTES, ddp, dl, span=ds) + \
                coll.reduce_scatter_us(expert * GRAD_REDUCE_BYTES, edp, el, span=es)
            gather = coll.all_gather_us(dense * PARAM_GATHER_BYTES, ddp, dl, span=ds) + \
                coll.all_gather_us(expert * PARAM_GATHER_BYTES, edp, el, span=es)
        if p.zero >= 3:
            # the parameters stay sharded: gathered before every chunk's forward and backward of every
            # micro-batch, prefetched behind the rank's compute (FSDP's prefetch; what exceeds it is exposed)
            z3 = 2 * p.micro_batches * gather
            z3_exposed = max(z3 - busy_us, 0.0)
            gather = 0.0
        exposed = max(grad - last_b_us, 0.0) if p.overlap_grad_reduce else grad
        dshard = cfg.memory.optimizer_shard or (ddp if p.zero >= 1 else 1)   # as the memory account shards it
        shard = dense / dshard + expert / (edp if p.zero >= 1 else 1)
        offload = optimizer_step_us(shard, cfg.memory.optimizer_offload, topo, gpus_per_node,
                                    cfg.memory.offload_overlap)
        # Megatron's gradient norm over the shard and the zeroing of the whole fp32 gradient buffer, on the GPU
        around = (shard * GRAD_NORM_BYTES_PER_PARAM + (dense + expert) * GRAD_BUFFER_ZERO_BYTES_PER_PARAM) \
            / (topo.gpu_mem_bandwidth_GBps * topo.gpu_mem_efficiency * 1e3)
        opt = offload["total_us"] + around
    return {"rank": r, "pipeline_end_us": end_us, "dp_grad_us": grad, "dp_grad_exposed_us": exposed,
            "param_gather_us": gather, "zero3_gather_us": z3, "zero3_gather_exposed_us": z3_exposed,
            "optimizer_us": opt, "optimizer_offload": offload if train and cfg.memory.optimizer_offload else None,
            "end_us": end_us + z3_exposed + exposed + gather + opt,
            "params_dense": dense, "params_expert": expert}


__all__ = ["GRAD_BUFFER_ZERO_BYTES_PER_PARAM", "GRAD_NORM_BYTES_PER_PARAM", "GRAD_REDUCE_BYTES", "OPTIMIZER_BYTES_PER_PARAM", "PARAM_GATHER_BYTES", "StageProgram", "attach_layout_fits",
           "chunk_params", "replica_shape",
           "static_memory_bytes",
           "expert_group_gpus_per_node", "layout_memory", "layout_step", "schedule_layout", "simulate_stages",
           "stage_bounds", "stage_model", "tp_comm_us"]
