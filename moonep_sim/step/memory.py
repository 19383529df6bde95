"""Memory per rank and per pipeline stage under a parallel layout: weights, gradients, optimizer
state, activations, communication buffers, KV cache.

Notation: the layout's degrees tp, pp, vpp, cp, dp, ep, etp and edp
(:class:`~moonep_sim.step.parallel.Parallel`); L layers; T the tokens of one micro-batch of one
data-parallel replica (``StepShape.tokens``: a TP x CP group shares them; under the default
``pure_ep(R)`` layout, a rank's tokens); K top-k; H hidden; D the dispatched row width; F the
expert FFN width; E routed experts. Bytes.

:func:`memory_for_layout` (the account a layout search calls; pure: model, shape, layout, the
strategy's Plan footprints or a balanced stand-in, options) gives every part on every pipeline
stage, each part on the EP rank where the stage's total is largest:

- ``weights``: the stage's layers (pipeline rank r holds chunks ``r, r + pp, ...``; ``dualpipe``
  its stage and the mirror stage ``pp - 1 - r``, DeepSeek-V3's two copies), the embedding on the
  rank holding the first chunk and the LM head on the one holding the last. Attention, shared
  experts, dense FFNs, embedding and head split over tp (norms and the router replicated); the
  routed experts' slots over ep (``E / ep`` home slots, each ``3 D F / etp``), plus the static
  replicas a strategy keeps (a Plan's extra slots not copied per step: EPLB-style). The layers'
  GEMM weights in ``weight_dtype`` (bytes per element with its block scales,
  :mod:`moonep_sim.step.dtypes`); embedding, norms and router bf16. ZeRO-3 keeps ``1 / (dp x cp)``
  of the dense weights (``1 / edp`` of the experts) plus the largest layer gathered whole.
- ``gradients`` (train): ``grad_bytes_per_param`` (fp32: 4) per weight held; over the DP group
  with ZeRO >= 2 (dense: ``dp x cp`` ranks, Megatron's distributed-optimizer group; experts: edp).
- ``optimizer`` (train): ``optimizer_bytes_per_param`` (mixed-precision Adam: fp32 master and two
  moments, 12; DeepSeek-V3's bf16 moments: 8) per weight held, over the DP group with ZeRO >= 1
  (``optimizer_shard`` overrides the dense group); with optimizer CPU offload
  (``optimizer_offload``, :mod:`moonep_sim.step.offload`) only ``1 - f`` of it: the rest, with a
  pinned fp32 gradient copy, is ``host_bytes_per_gpu`` (host memory, not HBM).
- ``activations`` (train): the micro-batches the schedule keeps alive on the rank
  (:func:`moonep_sim.step.activations.chunks_in_flight`: 1F1B pp on the first stage, interleaved
  Megatron's count, DualPipe pp + 1), each layer's saved tensors per token
  (:mod:`moonep_sim.step.activations`: Korthikanti et al.'s account, split over TP with sequence
  parallelism and over CP), the routed experts' received rows (from the Plans: they grow with the
  rank's load under a dropless strategy), and one micro-batch's fp32 logits on the last stage.
  Full recompute keeps each layer's input plus one layer's activations while it is recomputed.
- ``buffers``: the strategy's communication buffers as the library sizes them: a static buffer
  (``Plan.capacity_R``: MoonEP's ``S x K`` rows, a capacity factor's padded rows) once at its size;
  a dropless strategy's receive buffer the rows it is routed; DeepEP's normal kernels their NVLink
  and RDMA buffers from its recommended ``Config`` for the EP size (:func:`deepep_normal_buffer_bytes`);
  DeepEP's low-latency kernels their double-buffered send / receive layout
  (:func:`deepep_ll_buffer_bytes`); per-step copies (MoonEP's prefetch slots, and in train as many
  fp32 gradient slots); with pp > 1 the stage's activation send and receive buffers.
- ``kv_cache`` (prefill / decode): K/V (MLA latents, a linear layer's fp32 state) of every
  sequence on the rank for the stage's layers, in ``kv_dtype``; split over tp as the kind's
  ``cache_shards`` says (GQA heads, linear states), MLA latents whole (why wide-EP serving runs attention DP).

:func:`memory_per_rank` is the same account under ``pure_ep(R)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import Plan
from moonep_sim.step.activations import (DEFAULT_SELECTIVE, RECOMPUTE, ActivationOptions, full_recompute_saved,
                                         layer_saved, rank_chunks, chunks_in_flight, routed_row_saved)
from moonep_sim.step.dtypes import KV_DTYPES, WEIGHT_DTYPES, get_dtype
from moonep_sim.step.offload import check_offload, host_bytes_per_param
from moonep_sim.step.parallel import Parallel, pure_ep
from moonep_sim.step.attention import attention_kind
from moonep_sim.step.stack import BF16, StepShape, attention_params

#: Mixed-precision Adam: fp32 master weights, first and second moments (ZeRO's K = 12).
ADAM_BYTES_PER_PARAM = 12
GRAD_BYTES_PER_PARAM = 4
#: DeepEP's ``Buffer.num_sms`` default (its normal kernels run num_sms / 2 channels).
DEEPEP_NUM_SMS = 20
#: DeepEP's recommended normal-kernel ``Config`` per EP size (deep_ep/buffer.py,
#: ``get_dispatch_config`` / ``get_combine_config``): ranks -> (NVL receive tokens per channel,
#: dispatch RDMA send, combine RDMA send); RDMA receive tokens are 128 in both, rounded up to a
#: multiple of the send chunk as its Config does.
DEEPEP_CONFIGS = {2: (256, 6, 6), 4: (256, 6, 6), 8: (256, 6, 6), 16: (288, 16, 2), 24: (288, 32, 20),
                  32: (288, 32, 20), 64: (288, 28, 20), 128: (560, 32, 12), 144: (720, 12, 8), 160: (720, 12, 8)}
_NVL_PEERS, _MAX_TOPK, _MAX_SCALES, _SOURCE_META = 8, 128, 128, 8


def deepep_normal_buffer_bytes(ranks: int, hidden_bytes: int, num_sms: int = DEEPEP_NUM_SMS) -> tuple[float, str]:
    """NVLink + RDMA bytes of DeepEP's normal-kernel Buffer for an EP group of ``ranks`` rows of
    ``hidden_bytes`` (its ``Config.get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint`` at
    the recommended config, the larger of dispatch and combine, as Megatron sizes it), and a note:
    the EP size whose config was used when DeepEP tunes none for ``ranks``."""
    keys = sorted(DEEPEP_CONFIGS)
    key = next((k for k in keys if k >= ranks), keys[-1])
    nvl_recv, *rdma_send = DEEPEP_CONFIGS[key]
    ch = num_sms // 2
    nvl_r, rdma_r = min(ranks, _NVL_PEERS), max(ranks // _NVL_PEERS, 1)
    per_tok = hidden_bytes + _SOURCE_META + _MAX_TOPK * 12 + _MAX_SCALES * 4
    nvl = ch * nvl_r * (2 * rdma_r + 3) * 4 + ch * nvl_r * nvl_recv * per_tok
    nvl = -(-nvl // 128) * 128
    rdma = 0
    if ranks > _NVL_PEERS:
        recv = max(-(-128 // s) * s for s in rdma_send)
        rdma = ch * rdma_r * (_NVL_PEERS * 2 + 2) * 2 * 4 + ch * rdma_r * recv * (per_tok + 16) * 2 + 1048576
        rdma = -(-rdma // 128) * 128
    note = "" if key == ranks else f"DeepEP tunes no config for EP{ranks}: EP{key}'s used"
    return float(nvl + rdma), note


def deepep_ll_buffer_bytes(max_tokens: int, hidden: int, ranks: int, experts: int) -> float:
    """Bytes of DeepEP's low-latency RDMA buffer (``get_low_latency_rdma_size_hint``): odd/even send
    and receive buffers of per-expert slots of ``max_tokens`` messages (bf16 rows with a 16-byte
    header, or fp8 rows with their per-128 scales; combine messages bf16 with per-128 min/max), and
    the signalling buffers."""
    scales = hidden // 128
    d_msg = 16 + max(hidden * 2, hidden + scales * 4)
    c_msg = scales * 4 + hidden * 2
    send = max(max_tokens * d_msg, experts * max_tokens * c_msg)
    recv = experts * max_tokens * max(d_msg, c_msg)
    sig = -(-(experts * 8 + (experts // max(ranks, 1)) * 4) // 128) * 128
    return float(-(-(2 * (send + recv + sig)) // 128) * 128)


@dataclass(frozen=True)
class MemoryOptions:
    """optimizer_bytes_per_param: optimizer state per parameter (12 = mixed-precision Adam).
    optimizer_shard: ranks the dense weights' optimizer state is sharded over (0 = the layout's
    ZeRO group: dp x cp with ZeRO >= 1).  recompute: ``none``, ``selective`` or ``full`` (True =
    selective, False = none).  recompute_modules: what selective recompute recomputes (default the
    attention core, the norms and MLA's up-projections).  weight_dtype / kv_dtype: stored formats
    (:mod:`moonep_sim.step.dtypes`).  gemm_dtype: the GEMMs' (their saved inputs in fp8 with fp8
    GEMMs).  grad_bytes_per_param: 4 (fp32 gradients).  flash / dropout: see
    :class:`~moonep_sim.step.activations.ActivationOptions`.  optimizer_offload: the fraction of
    each rank's optimizer state held and stepped on the host (Megatron's
    ``--optimizer-offload-fraction``; :mod:`moonep_sim.step.offload`); offload_overlap: its copies
    and CPU step pipelined (``--overlap-cpu-optimizer-d2h-h2d``)."""

    optimizer_bytes_per_param: float = ADAM_BYTES_PER_PARAM
    optimizer_shard: int = 0
    recompute: "bool | str" = False
    recompute_modules: tuple[str, ...] = ("core_attn", "layernorm", "mla_up_proj")
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    gemm_dtype: str = "bf16"
    grad_bytes_per_param: float = GRAD_BYTES_PER_PARAM
    flash: bool = True
    dropout: bool = False
    optimizer_offload: float = 0.0
    offload_overlap: bool = False

    def __post_init__(self) -> None:
        require(self.optimizer_bytes_per_param >= 0,
                f"optimizer bytes per param ({self.optimizer_bytes_per_param}) must be >= 0")
        require(self.optimizer_shard >= 0, f"optimizer shard ({self.optimizer_shard}) must be >= 0 (0 = the layout's)")
        require(self.grad_bytes_per_param >= 0, f"grad bytes per param ({self.grad_bytes_per_param}) must be >= 0")
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute", "selective" if self.recompute else "none")
        require(self.recompute in RECOMPUTE, f"recompute ({self.recompute!r}) must be one of {', '.join(RECOMPUTE)}")
        object.__setattr__(self, "optimizer_offload", check_offload(self.optimizer_offload, "optimizer offload"))
        require(isinstance(self.offload_overlap, bool), f"offload overlap ({self.offload_overlap!r}) must be true or false")
        get_dtype(self.weight_dtype, "weight dtype", WEIGHT_DTYPES)
        get_dtype(self.kv_dtype, "kv dtype", KV_DTYPES)
        require(self.gemm_dtype in ("bf16", "fp8"), f"gemm dtype ({self.gemm_dtype!r}) must be bf16 or fp8")
        self.activations()

    def activations(self) -> ActivationOptions:
        g = get_dtype("fp8").row_bytes if self.gemm_dtype == "fp8" else BF16
        return ActivationOptions(self.recompute, tuple(self.recompute_modules) or DEFAULT_SELECTIVE, self.flash,
                                 self.dropout, "swiglu", g)

    def describe(self) -> str:
        return (f"weights {self.weight_dtype}, KV {self.kv_dtype}, GEMMs {self.gemm_dtype}; optimizer "
                f"{self.optimizer_bytes_per_param:g} B/param"
                + (f" ({self.optimizer_offload:g} of it on the host, CPU Adam"
                   + (", copies overlapped" if self.offload_overlap else "") + ")" if self.optimizer_offload else "")
                + f", gradients {self.grad_bytes_per_param:g} B/param; "
                f"recompute {self.recompute}" + (f" ({', '.join(self.recompute_modules)})"
                                                 if self.recompute == "selective" else ""))


@dataclass(frozen=True)
class PlanFootprint:
    """What the memory account reads from one Plan ([R] arrays over the EP group): slots and
    per-step copies per rank, the static buffer rows (``Plan.capacity_R``, None = dropless), the
    rows received (padded), the dispatch + combine bytes of one row, and the library buffers its
    kernels need (``kind``: ``relay`` = DeepEP's normal kernels, ``ll`` = its low-latency kernels,
    whose ``max_tokens`` per rank size them). Small and picklable (worker processes return it)."""

    slots_R: np.ndarray
    copies_R: np.ndarray
    capacity_R: np.ndarray | None
    rows_R: np.ndarray
    row_bytes: int
    relay: bool
    kind: str = ""
    max_tokens: int = 0

    @classmethod
    def of(cls, p: Plan) -> "PlanFootprint":
        R = p.ranks
        k = p.kernel
        kind = "relay" if (k is not None and k.relay) else ("ll" if (k is not None and k.row_messages and not k.planned)
                                                            else "")
        return cls(np.bincount(p.slot_rank_S, minlength=R).astype(np.float64),
                   np.bincount(p.slot_rank_S[p.is_copy_S()], minlength=R).astype(np.float64),
                   None if p.capacity_R is None else p.capacity_R.astype(np.float64),
                   p.rows_R().astype(np.float64), int(p.costs.dispatch_row_bytes + p.costs.combine_row_bytes),
                   kind == "relay", kind, int((p.options or {}).get("max_tokens", 0) or 0))

    @classmethod
    def balanced(cls, model: ModelSpec, ep: int, tokens: int, slots: int = 0, dispatch_bytes: int = 0) -> "PlanFootprint":
        """A stand-in for a dropless strategy's Plan on perfectly balanced routing: ``slots``
        (default E) spread over ``ep`` ranks, each receiving ``tokens x K`` rows (``tokens`` per EP
        rank). What a layout search uses before planning any layer."""
        s = float(slots or model.num_experts) / ep
        rows = float(tokens) * model.top_k
        row = (dispatch_bytes or model.row_bytes_bf16) + model.combine_row_bytes
        return cls(np.full(ep, s), np.zeros(ep), None, np.full(ep, rows), int(row), False)


@dataclass
class _Stage:
    chunks: list[int]
    layers: list[int]
    embed: bool
    head: bool


def _layer_weights(model: ModelSpec, l: int, tp: int, wb: float) -> float:
    """Bytes of layer ``l``'s non-expert weights on one TP rank (GEMM weights in ``wb`` bytes)."""
    H = model.hidden
    gemm = attention_params(model, model.attention_kind(l)) if model.attention_kind(l) not in ("", "none") else 0
    rep = 2 * H * BF16
    if l < model.dense_layers:
        gemm += 3 * H * model.dense_ffn
    else:
        gemm += model.shared_experts * 3 * H * model.expert_ffn
        rep += H * model.num_experts * BF16
    return gemm / tp * wb + rep


def _layer_params(model: ModelSpec, l: int, tp: int) -> float:
    """Parameters of layer ``l``'s non-expert weights on one TP rank."""
    H = model.hidden
    gemm = attention_params(model, model.attention_kind(l)) if model.attention_kind(l) not in ("", "none") else 0
    rep = 2 * H
    if l < model.dense_layers:
        gemm += 3 * H * model.dense_ffn
    else:
        gemm += model.shared_experts * 3 * H * model.expert_ffn
        rep += H * model.num_experts
    return gemm / tp + rep


def _kv_per_seq(model: ModelSpec, l: int, ctx: int, tp: int, kvb: float) -> float:
    """Bytes of layer ``l``'s cache for one sequence of ``ctx`` keys on one TP rank."""
    name = model.attention_kind(l)
    if name in ("", "none"):
        return 0.0
    kind = attention_kind(name)
    if name == "linear":  # its fixed state, in its own dtype
        return kind.state_bytes(model) / kind.cache_shards(model, tp)
    return kind.cache_bytes(model, StepShape("decode", 1, ctx)) * kvb / BF16 / kind.cache_shards(model, tp)


def moe_layer_weight_bytes(model: ModelSpec, ranks: int, weight_dtype: str = "bf16") -> float:
    """Bytes one more MoE layer (the last layer's kind) adds on each of ``ranks`` EP ranks: its
    non-expert weights and ``E / ranks`` experts, GEMM weights in ``weight_dtype`` (an MTP draft
    layer: ``moonep_sim.step.mtp``)."""
    wb = get_dtype(weight_dtype, "weight dtype", WEIGHT_DTYPES).weight_bytes
    expert = model.num_experts / ranks * 3.0 * model.dispatch_hidden * model.expert_ffn * wb
    return _layer_weights(model, model.layers - 1, 1, wb) + expert


def check_optimizer_shard(par: Parallel, shard: int) -> None:
    """``--optimizer-shard`` under layout ``par``: it must divide ``dp x cp``, the ranks that hold
    copies of a stage's dense weights (what ZeRO shards their optimizer state over); one line
    otherwise. 0 = the layout's own group."""
    group = par.dp * par.cp
    require(not shard or group % shard == 0,
            f"--optimizer-shard ({shard}) must divide dp x cp ({par.dp} x {par.cp} = {group}) of layout {par.label()}: "
            "the optimizer state of a stage's dense weights is sharded over the ranks holding copies of them")


def stages_of(model: ModelSpec, par: Parallel) -> tuple[list[_Stage], tuple[int, ...], np.ndarray]:
    """Per pipeline rank: the chunks and layers it holds and whether it holds the embedding / head;
    the layers of each chunk; the chunks' first layers (and the end)."""
    counts = par.stage_layers(model.layers)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    last = len(counts) - 1
    out = []
    for r in range(par.pp):
        ch = rank_chunks(par.pp_schedule, par.pp, par.vpp, r)
        layers = [l for c in ch for l in range(off[c], off[c + 1])]
        out.append(_Stage(ch, layers, 0 in ch, last in ch))
    return out, counts, off


def _plans_in_memory(fps: "Sequence[PlanFootprint]", epn: float, D: int, notes: list[str]) -> tuple:
    """What the strategy's Plans put in memory, per rank of the EP group, over its MoE layers:
    ``(copy slots [R], static replicas [R], receive buffer bytes [R], rows received [R], the relay
    kernels' fixed buffer bytes)``; a note on how DeepEP's buffers were sized goes to ``notes``."""
    R = len(fps[0].slots_R)
    copy_slots, replicas, buf, act_rows = (np.zeros(R) for _ in range(4))
    fixed = 0.0
    for f in fps:
        replicas = np.maximum(replicas, np.maximum(f.slots_R - f.copies_R - epn, 0.0))
        copy_slots = np.maximum(copy_slots, f.copies_R)
        rows = f.capacity_R if f.capacity_R is not None else f.rows_R
        if f.kind == "ll" and f.max_tokens:
            buf = np.maximum(buf, deepep_ll_buffer_bytes(f.max_tokens, D, R, int(round(epn * R))))
        else:
            buf = np.maximum(buf, rows * f.row_bytes)
        act_rows = np.maximum(act_rows, f.rows_R)
        if f.kind == "relay":
            fixed, note = deepep_normal_buffer_bytes(R, D * BF16)
            if note and note not in notes:
                notes.append(note)
    return copy_slots, replicas, buf, act_rows, fixed


def _stage_activations(model: ModelSpec, par: Parallel, st, alive, off, aopts, keys: float, t_rank: float,
                       act_rows: np.ndarray, moe: int) -> np.ndarray:
    """[R] bytes a training stage ``st`` saves for its backward: every layer of the model chunks
    ``alive`` (indices into the chunk offsets ``off``) at ``t_rank`` tokens each, the routed rows
    its MoE layers received, and the head's fp32 logits (see the module docstring)."""
    tp, sp = par.tp, par.sequence_parallel
    per_tok = 0.0
    moe_alive = 0
    for c in alive:
        ls = range(off[c], off[c + 1])
        moe_alive += sum(1 for l in ls if l >= model.dense_layers)
        if aopts.recompute == "full":
            per_tok += len(ls) * full_recompute_saved(model).per_rank(tp, sp)
        else:
            per_tok += sum(layer_saved(model, l, keys, aopts).per_rank(tp, sp) for l in ls)
    act = np.full(len(act_rows), per_tok * t_rank)
    if aopts.recompute == "full":  # one layer's activations while it is recomputed
        live = ActivationOptions("none", (), aopts.flash, aopts.dropout, aopts.ffn, aopts.gemm_bytes)
        act = act + max(layer_saved(model, l, keys, live).per_rank(tp, sp) for l in st.layers) * t_rank \
            + (act_rows * routed_row_saved(model, live, par.etp) if moe else 0.0)
    else:
        act = act + act_rows * routed_row_saved(model, aopts, par.etp) * moe_alive
    if st.head and model.vocab:
        act = act + t_rank * model.vocab * 4.0 / tp  # one micro-batch's fp32 logits
    return act


def memory_for_layout(model: ModelSpec, shape: StepShape, par: Parallel,
                      plans: "Sequence[Plan | PlanFootprint]" = (), opts: MemoryOptions = MemoryOptions(),
                      expert_slots: int = 0) -> dict:
    """Every part (see the module docstring) on every pipeline stage of layout ``par``.

    plans: the strategy's Plans (or :class:`PlanFootprint`) of the step's MoE layers over one EP
    group of ``par.ep`` ranks; empty: :meth:`PlanFootprint.balanced`. expert_slots: the expert
    slots resident per MoE layer (``E + redundant``; 0 = what the Plans use): a strategy that routes
    to home slots only still holds a deployment's redundant slots. Returns ``peak_bytes`` (the
    largest rank's total), ``peak_stage`` and ``peak_rank`` (its pipeline rank and EP rank),
    ``parts`` (its parts), ``parts_max`` (each part's largest over every rank), ``stages`` (per
    pipeline rank: its layers, MoE layers, micro-batch chunks alive, peak and parts), ``layout`` and
    ``assumptions``."""
    train = shape.mode == "train"
    H, ep = model.hidden, par.ep
    D, F = model.dispatch_hidden, model.expert_ffn
    tp, sp, cp = par.tp, par.sequence_parallel, par.cp
    wd = get_dtype(opts.weight_dtype, "weight dtype", WEIGHT_DTYPES)
    wb, kvb = wd.weight_bytes, get_dtype(opts.kv_dtype, "kv dtype", KV_DTYPES).row_bytes
    aopts = opts.activations()
    expert_elems = 3.0 * D * F / par.etp
    notes: list[str] = []
    t_rank = shape.tokens / cp  # tokens of one micro-batch on one rank of the TP x CP group
    if not plans:
        plans = [PlanFootprint.balanced(model, ep, int(np.ceil(t_rank / tp)), expert_slots)]  # MoE tokens over TP
        notes.append("balanced routing stand-in (no Plans)")
    fps = [p if isinstance(p, PlanFootprint) else PlanFootprint.of(p) for p in plans]
    R = len(fps[0].slots_R)
    require(R == ep, f"plans ({R} ranks) must span the layout's EP group (ep {ep})")
    epn = max(float(fps[0].slots_R.sum() - fps[0].copies_R.sum()), float(expert_slots)) / ep  # resident slots
    copy_slots, replicas, buf, act_rows, fixed = _plans_in_memory(fps, epn, D, notes)
    stages, counts, off = stages_of(model, par)
    check_optimizer_shard(par, opts.optimizer_shard)
    dense_group = opts.optimizer_shard or (par.dp * cp if par.zero >= 1 else 1)
    grad_group = par.dp * cp if par.zero >= 2 else 1
    param_group = par.dp * cp if par.zero >= 3 else 1
    e_opt = par.edp if par.zero >= 1 else 1
    e_grad = par.edp if par.zero >= 2 else 1
    e_param = par.edp if par.zero >= 3 else 1
    keys = shape.attended()
    emb_params = model.vocab * H / tp
    out_stages = []
    best = (-1.0, 0, 0)
    for s, st in enumerate(stages):
        moe = sum(1 for l in st.layers if l >= model.dense_layers)
        dense_p = sum(_layer_params(model, l, tp) for l in st.layers) + emb_params * (st.embed + st.head)
        dense_b = sum(_layer_weights(model, l, tp, wb) for l in st.layers) + emb_params * BF16 * st.embed \
            + emb_params * wb * st.head
        exp_p = (epn + replicas) * moe * expert_elems  # [R]
        weights = dense_b / param_group + exp_p * wb / e_param
        if param_group > 1 or e_param > 1:  # ZeRO-3: the largest layer gathered whole while it runs
            weights = weights + max(_layer_weights(model, l, tp, wb) for l in st.layers) \
                + (epn * expert_elems * wb if moe else 0.0)
        buffers = buf + fixed + copy_slots * expert_elems * (BF16 + (opts.grad_bytes_per_param if train else 0))
        if par.pp > 1:  # activation send/receive buffers between stages (forward and backward)
            buffers = buffers + 4.0 * t_rank * H * BF16 / (tp if sp else 1)
        parts: dict[str, np.ndarray] = {"weights": np.broadcast_to(weights, (R,)).astype(float),
                                        "buffers": np.broadcast_to(buffers, (R,)).astype(float)}
        alive = chunks_in_flight(par.pp_schedule, par.pp, par.vpp, s, par.micro_batches) if train else []
        if train:
            parts["activations"] = _stage_activations(model, par, st, alive, off, aopts, keys, t_rank, act_rows, moe)
            parts["gradients"] = np.broadcast_to(dense_p * opts.grad_bytes_per_param / grad_group
                                                 + exp_p * opts.grad_bytes_per_param / e_grad, (R,)).astype(float)
            shard = np.broadcast_to(dense_p / dense_group + exp_p / e_opt, (R,)).astype(float)   # optimizer params
            frac = opts.optimizer_offload
            parts["optimizer"] = shard * opts.optimizer_bytes_per_param * (1.0 - frac)
            host_R = shard * frac * host_bytes_per_param(opts.optimizer_bytes_per_param)
        else:
            host_R = np.zeros(R)
            ctx = shape.context if shape.mode == "decode" else max(shape.context, min(shape.tokens, shape.context))
            seqs = float(shape.sequences) * max(par.micro_batches, 1)
            kv = seqs * sum(_kv_per_seq(model, l, ctx, tp, kvb) for l in st.layers)
            parts["kv_cache"] = np.full(R, kv)
        total = sum(parts.values())
        r = int(np.argmax(total))
        rec = {"stage": s, "chunks": st.chunks, "layers": len(st.layers), "moe_layers": moe,
               "embedding": st.embed, "head": st.head, "chunks_alive": len(alive), "peak_bytes": float(total[r]),
               "peak_rank": r, "parts": {k: float(v[r]) for k, v in parts.items()}, "host_bytes": float(host_R.max()),
               "parts_max": {k: float(v.max()) for k, v in parts.items()}}
        out_stages.append(rec)
        if rec["peak_bytes"] > best[0]:
            best = (rec["peak_bytes"], s, r)
    top = out_stages[best[1]]
    parts_max = {k: max(st["parts_max"][k] for st in out_stages) for k in top["parts"]}
    return {"peak_bytes": best[0], "peak_stage": best[1], "peak_rank": best[2], "parts": top["parts"],
            "host_bytes_per_gpu": max(st["host_bytes"] for st in out_stages),
            "parts_max": parts_max, "stages": out_stages, "layout": par.to_dict(),
            "assumptions": (f"layout {par.label()} (ZeRO-{par.zero}, {par.pp_schedule}"
                            + (f", {par.micro_batches} micro-batches" if train and par.pp > 1 else "") + "); "
                            + opts.describe() + f"; optimizer state of the dense weights over {dense_group} ranks"
                            + (f"; {'; '.join(notes)}" if notes else ""))}


def memory_per_rank(model: ModelSpec, shape: StepShape, plans: "Sequence[Plan | PlanFootprint]", R: int,
                    opts: MemoryOptions = MemoryOptions(), expert_slots: int = 0) -> dict:
    """:func:`memory_for_layout` under ``pure_ep(R)``: every rank a data-parallel replica of the dense
    part (ZeRO-1: its optimizer state over the R ranks), the experts EP over all R."""
    d = memory_for_layout(model, shape, pure_ep(R), plans, opts, expert_slots)
    d.pop("stages")
    return d


__all__ = ["ADAM_BYTES_PER_PARAM", "DEEPEP_CONFIGS", "GRAD_BYTES_PER_PARAM", "MemoryOptions", "PlanFootprint",
           "deepep_ll_buffer_bytes", "deepep_normal_buffer_bytes", "memory_for_layout", "memory_per_rank",
           "check_optimizer_shard", "moe_layer_weight_bytes",
           "stages_of"]
