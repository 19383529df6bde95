"""Whole steps from a scenario: each MoE layer's routing, then the step model (``moonep_sim.step``).

Notation: R ranks, T tokens per rank, L_moe MoE layers.

Routing per MoE layer i (:func:`layer_source`):

- generated routing (``gen:``): MoE layer i is generated layer i (seed ``seed * 1009 + i``), at
  the step's tokens per rank; with ``distinct_layers`` N > 0 (the fast path) only layer 0 is
  generated, N-1 more routings are layer 0 with its experts relabelled (:func:`relabel_experts`:
  same skew, other hot experts and ranks), those N are planned and simulated, and MoE layer i
  reuses routing ``i mod N`` (flagged per layer in the output). The default 0 gives every layer
  its own generated routing, generated where it is planned (:class:`GeneratedLayer`: in a worker
  with ``jobs``) and shared by every strategy;
- a trace: MoE layer i is the trace's i-th layer; a layer the trace does not have is a
  **stand-in**, flagged as such in the output: MoonEP's lognormal popularity (seed i) fitted to the
  trace's skew measured over the whole trace (:func:`standin_skew`: the recorded layers' maxvio
  with every recorded step pooled, never one pass's), then drawn at each pass's own token count (a
  pass of a dozen tokens cannot define a skew, and its own is not a target). A trace's tokens set T (its
  tokens of the selected steps over R); with several steps selected each is its own step
  (:func:`run_step` returns one result per step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.experiments.results import _TakeAway
from moonep_sim.experiments.routing import RoutingSource
from moonep_sim.models import ModelSpec
from moonep_sim.plan import GlobalRouting


@dataclass(frozen=True, repr=False)
class StepResult(_TakeAway):
    """Every strategy's step (``figures[name]``: the JSON contract of ``moonep-sim step``), the
    setup, and the composed timelines (``timelines[name]``, for ``--timeline`` / ``--gantt``)."""

    strategies: tuple[str, ...]
    figures: dict[str, dict[str, Any]]
    setup: dict[str, Any]
    timelines: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        from moonep_sim.analysis.flags import step_flags
        from moonep_sim.analysis.verdict import step_verdict

        opts = {n: {} for n in self.strategies} | dict(self.setup.get("options") or {})
        flags = step_flags(self.setup, opts, {"name": self.setup.get("model")}, self.figures)
        return {"kind": "step", "setup": self.setup, "strategies": self.figures, "flags": flags,
                "verdict": step_verdict(self.figures, flags)}


@dataclass(frozen=True)
class StepOptions:
    """How a step is run (``moonep-sim step``'s flags; :meth:`Scenario.step`'s keywords), checked
    once when built: mode (train, prefill, decode), overlap (none, shared-expert, two-batch), tokens
    per rank (None: the routing's), context, distinct layers (0: every layer its own routing), a
    compute profile CSV, the GEMM, weight and KV dtypes, multi-token prediction (depth, acceptance),
    recompute, optimizer sharding, bytes per parameter and CPU offload (the fraction of the optimizer
    state on the host, its copies overlapped or not: ``moonep_sim.step.offload``), static buffers
    (strategy -> tokens per rank), the parallel layout (None: pure EP) and, for a decode step under a layout with
    data-parallel attention, each EP rank's KV context (``contexts_R``). What :func:`run_step`,
    :func:`~moonep_sim.experiments.layout.run_layout_step`, the layout search and ``compare``,
    ``sweep`` and winner maps at ``level="step"`` take."""

    mode: str = "train"
    overlap: str = "none"
    tokens_per_rank: int | None = None
    context: int | None = None
    distinct_layers: int = 0
    compute_profile: str | None = None
    gemm_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    mtp_depth: int = 0
    mtp_acceptance: float = 0.8
    recompute: "bool | str" = False
    optimizer_shard: int = 0
    optimizer_bytes_per_param: float = 12.0
    optimizer_offload: float = 0.0
    offload_overlap: bool = False
    static_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    parallel: Any = None
    contexts_R: "tuple[int, ...] | None" = None

    def __post_init__(self) -> None:
        from moonep_sim.step.schedules import get_overlap
        from moonep_sim.step.stack import MODES

        require(self.mode in MODES, f"mode ({self.mode!r}) must be one of {', '.join(MODES)}")
        get_overlap(self.overlap)
        require(self.gemm_dtype in ("bf16", "fp8"), f"gemm dtype ({self.gemm_dtype!r}) must be bf16 or fp8")
        from moonep_sim.step.dtypes import KV_DTYPES, WEIGHT_DTYPES, get_dtype

        get_dtype(self.weight_dtype, "--weight-dtype", WEIGHT_DTYPES)
        get_dtype(self.kv_dtype, "--kv-dtype", KV_DTYPES)
        from moonep_sim.step.mtp import MTP

        mtp = MTP(self.mtp_depth, self.mtp_acceptance)
        require(not mtp.depth or self.mode == "decode", f"--mtp-depth ({mtp.depth}) needs --mode decode (mode "
                                                        f"{self.mode}): drafts are verified in decode steps")
        from moonep_sim.experiments.layout import recompute_options

        recompute_options(self.recompute)
        require(self.distinct_layers >= 0, f"distinct layers ({self.distinct_layers}) must be >= 0 (0 = every layer "
                                           "its own)")
        require(self.optimizer_shard >= 0, f"optimizer shard ({self.optimizer_shard}) must be >= 0 (0 = all ranks)")
        require(self.optimizer_bytes_per_param >= 0,
                f"optimizer bytes per parameter ({self.optimizer_bytes_per_param:g}) must be >= 0")
        from moonep_sim.step.offload import check_offload

        object.__setattr__(self, "optimizer_offload", check_offload(self.optimizer_offload))
        require(not self.optimizer_offload or self.mode == "train",
                f"--optimizer-offload-fraction ({self.optimizer_offload:g}) needs --mode train (mode {self.mode}): "
                "only training has an optimizer step")
        object.__setattr__(self, "static_tokens", dict(self.static_tokens or {}))
        if self.parallel is not None:
            from moonep_sim.step.parallel import Parallel

            require(isinstance(self.parallel, Parallel),
                    f"parallel ({type(self.parallel).__name__}) must be a Parallel (moonep_sim.step.parallel)")
            require(not self.static_tokens, "static buffers are not modelled under a layout yet")
        if self.contexts_R is not None:
            self._check_contexts()

    def _check_contexts(self) -> None:
        """Contexts per rank: a decode step under a layout with data-parallel attention, one >= 1 per
        rank of the EP group."""
        p = self.parallel
        require(p is not None, "contexts per rank apply to a decode step under a layout with data-parallel "
                               "attention (parallel=Parallel(..., dp_attention=True))")
        cs = tuple(int(c) for c in self.contexts_R)
        object.__setattr__(self, "contexts_R", cs)
        require(self.mode == "decode" and p.dp_attention,
                f"contexts per rank ({len(cs)} given) need a decode step under data-parallel attention "
                f"(--mode decode --dp-attention; mode {self.mode}, dp_attention {p.dp_attention})")
        require(len(cs) == p.ep and min(cs) >= 1,
                f"contexts per rank ({len(cs)} given, least {min(cs, default=0)}) must be one >= 1 per rank of the "
                f"EP group ({p.ep})")

    def priced(self, topology: Any) -> tuple[Any, Any]:
        """(the step's cost model, its memory options) on ``topology``, the weight and KV dtypes
        checked against what its GPU supports."""
        from moonep_sim.experiments.layout import recompute_options
        from moonep_sim.step import MemoryOptions
        from moonep_sim.step.costs import step_cost_model
        from moonep_sim.step.dtypes import KV_DTYPES, WEIGHT_DTYPES, check_supported, get_dtype

        wd = check_supported(get_dtype(self.weight_dtype, "--weight-dtype", WEIGHT_DTYPES), topology, "--weight-dtype")
        check_supported(get_dtype(self.kv_dtype, "--kv-dtype", KV_DTYPES), topology, "--kv-dtype")
        costs = step_cost_model(topology, self.gemm_dtype, self.compute_profile, mode=self.mode,
                                weight_bytes=wd.weight_bytes)
        from moonep_sim.step.offload import check_host

        check_host(topology, self.optimizer_offload, self.mode)
        return costs, MemoryOptions(self.optimizer_bytes_per_param, self.optimizer_shard, weight_dtype=self.weight_dtype,
                                    kv_dtype=self.kv_dtype, gemm_dtype=self.gemm_dtype,
                                    optimizer_offload=self.optimizer_offload, offload_overlap=self.offload_overlap,
                                    **recompute_options(self.recompute))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (dict(v) if isinstance(v, Mapping) else v.to_dict() if hasattr(v, "to_dict") else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]
                if f.name != "contexts_R" or v is not None}


def layer_source(source: RoutingSource, ranks: int, tokens: int, moe_layers: int, distinct: int = 0,
                 steps_T: np.ndarray | None = None, skew: dict[str, Any] | None = None,
                 pass_tokens: int | None = None) -> Callable[[int], tuple[Any, Any, str]]:
    """MoE layer index -> (key, routing, provenance) (see the module docstring). ``steps_T``: a
    trace's token indices of the one step to use (None: every selected token). ``skew``: the
    stand-ins' :func:`standin_skew` (None: measured here). ``pass_tokens``: the pass's tokens over
    all ranks, what a stand-in draws (None: ``tokens * ranks``)."""
    memo: dict[Any, GlobalRouting] = {}
    if source.gen is not None:
        g = dataclasses.replace(source.gen, tokens_per_rank=tokens)
        src = dataclasses.replace(source, gen=g)

        def gen(i: int):
            if not distinct:  # built where the layer is planned (a worker, with --jobs), once, then dropped
                return ("gen", i), GeneratedLayer(src, i, ranks), f"generated layer {i}"
            j = i % distinct
            if j not in memo:
                if 0 not in memo:
                    memo[0] = GeneratedLayer(src, 0, ranks)()
                memo[j] = memo[0] if j == 0 else relabel_experts(memo[0], g.seed * 1009 + j,
                                                                  g.groups or source.model.n_groups)
            how = "generated layer 0" if j == 0 else f"generated layer 0, experts relabelled (seed {g.seed * 1009 + j})"
            if j != i:
                how += f" (reused: --distinct-layers {distinct})"
            return ("gen", j), memo[j], how
        return gen
    ids = list(source.layer_ids)
    have = len(ids)
    n_pass = int(pass_tokens if pass_tokens is not None else tokens * ranks)

    def trace(i: int):
        if i < have:
            if i not in memo:
                memo[i] = _trace_layer(source, ids[i], ranks, steps_T)
            return ("trace", i), memo[i], f"trace layer {ids[i]}"
        if "skew" not in memo:
            memo["skew"] = skew or standin_skew(source, ranks)
        sk = memo["skew"]
        if ("standin", i) not in memo:
            from moonep_sim.routing.generators import generate_layer, sigma_for_maxvio

            seed = i * 1009 + i  # what GeneratorSpec(seed=i).layer(i) draws with
            sigma = sigma_for_maxvio(source.num_experts, source.top_k, sk["tokens"], sk["maxvio"], seed)
            lr = generate_layer(source.num_experts, source.top_k, n_pass, seed, sigma=sigma)
            memo[("standin", i)] = GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK,
                                                              source.num_experts, ranks)
        return ("standin", i), memo[("standin", i)], (f"STAND-IN: drawn at the trace's pooled maxvio "
                                                       f"{sk['maxvio']:.3g} ({sk['tokens']} tokens; the trace has "
                                                       f"{have} layer(s))")
    return trace


def standin_skew(source: RoutingSource, ranks: int) -> dict[str, Any]:
    """The skew stand-in layers are drawn at: each recorded layer's maxvio over the whole trace
    (every recorded step pooled, whatever ``--steps`` selects; never one pass: a pass of a dozen
    tokens cannot define a skew), their mean, and the pooled token count the popularity is fitted
    at (:func:`moonep_sim.routing.generators.sigma_for_maxvio`). ``{maxvio, tokens, layers}``."""
    from moonep_sim.routing.metrics import maxvio

    mvs, n = [], 0
    for l in source.layer_ids:
        if source._trace is not None and source.transform is None and not source._trace.has("token_mask"):
            from moonep_sim.routing.steps import read_layer

            ids = read_layer(source._trace, source._trace.layer_index(l)).topk_ids_TK
        else:
            ids = _trace_layer(source, l, ranks, None).topk_ids_TK
        mvs.append(maxvio(np.bincount(ids.ravel(), minlength=source.num_experts)))
        n = max(n, int(ids.shape[0]))
    return {"maxvio": float(np.mean(mvs)), "tokens": n, "layers": len(mvs)}


@dataclass(frozen=True)
class GeneratedLayer:
    """Generated layer ``layer``'s routing over ``ranks``, built when called: the picklable builder
    a step's layer work carries instead of the routing (``moonep_sim.step.layer_work.LayerWork``), so
    each layer is generated where it is planned and freed after it."""

    source: RoutingSource
    layer: int
    ranks: int

    def __call__(self) -> GlobalRouting:
        from moonep_sim.step.layer_work import trusted_routing

        # the generator's routing is valid by construction: not re-checked (trusted_routing)
        lr = self.source.layer(self.layer, self.ranks)
        return trusted_routing(lr.topk_ids_TK, lr.topk_weights_TK, self.source.num_experts, self.ranks)


def relabel_experts(r: GlobalRouting, seed: int, groups: int = 1) -> GlobalRouting:
    """``r`` with its experts renamed by a seeded random permutation: the same popularity
    statistics (the sorted per-expert counts, the maxvio, the co-selection structure), other hot
    experts on other home ranks. With expert groups (group-limited routing) the permutation keeps
    groups whole (groups permuted, experts permuted within them), so a token still spans its groups.
    One gather over the entries (ids not re-checked: trusted_routing): the per-layer stand-in for a fresh draw."""
    from moonep_sim.step.layer_work import trusted_routing

    E = r.num_experts
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 11]))
    G = max(int(groups), 1)
    per = E // G
    g_perm = rng.permutation(G)
    within = np.argsort(rng.random((G, per)), axis=1)
    perm_E = (g_perm[:, None] * per + within).reshape(-1)[np.arange(E).reshape(G, per).reshape(-1)]
    return trusted_routing(np.take(perm_E, r.topk_ids_TK), r.topk_weights_TK, E, r.tokens_per_rank_R)


def _trace_layer(source: RoutingSource, layer_id: int, ranks: int, steps_T: np.ndarray | None) -> GlobalRouting:
    if source._trace is not None:
        lr = source.selected_layer(layer_id)
        if source.transform is not None:  # a trace sweep's re-weighted popularity, drawn once over the steps
            lr = source.transform(lr, int(layer_id), 0)
    else:
        lr = source.layer(layer_id, ranks)
    ids, w = lr.topk_ids_TK, lr.topk_weights_TK
    if steps_T is not None:
        ids, w = ids[steps_T], w[steps_T]
    return GlobalRouting.split_evenly(ids, w, source.num_experts, ranks)


def run_step(scenario: Any, options: StepOptions, *, model: ModelSpec | None = None, progress=None,
             jobs: int | None = 1, cluster: str | None = None, pipeline: bool | None = None) -> list[StepResult]:
    """The step(s) of ``scenario`` (an :class:`~moonep_sim.experiments.scenario.Scenario`, or its
    ``Resolved``) run as ``options`` say (:class:`StepOptions`; ``model``: a model to run instead of
    the routing's, of the same experts and top-k): one result, or one per recorded step of a trace
    with several steps. The step's distinct MoE layers are planned and simulated in ``jobs`` worker
    processes or on a Dask ``cluster`` (:func:`moonep_sim.experiments.parallel.run_points`; each layer
    independently, same result). With one job, ``pipeline`` (None: when it pays,
    ``moonep_sim.step.layer_work.pipeline_pays``; False: off) builds the next layer's routing and
    Plans on a second thread while this one simulates. ``options.parallel``: a
    :class:`~moonep_sim.step.parallel.Parallel` layout over the scenario's GPUs
    (:mod:`moonep_sim.experiments.layout`); None: today's pure-EP step."""
    o = options
    require(isinstance(o, StepOptions), f"options ({type(o).__name__}) must be a StepOptions "
                                        "(moonep_sim.experiments.step)")
    if o.parallel is not None:
        from moonep_sim.experiments.layout import run_layout_step

        figs, setup, timelines = run_layout_step(scenario, o, model=model, progress=progress, jobs=jobs,
                                                 cluster=cluster, pipeline=pipeline, layer_source=layer_source)
        return [StepResult(tuple(figs), figs, setup, timelines)]
    rs = getattr(scenario, "resolved", scenario)
    src = rs.source
    m = model or src.model
    require((m.num_experts, m.top_k) == (src.num_experts, src.top_k),
            f"model ({m.name}: E={m.num_experts}, K={m.top_k}) must match the routing (E={src.num_experts}, "
            f"K={src.top_k})")
    R = rs.cluster.ranks
    names = [n for n, _ in rs.strategies]
    for s, S in o.static_tokens.items():
        require(s in names, f"static buffer strategy ({s!r}) must be one of the strategies ({', '.join(names)})")
        require(int(S) >= 1, f"static buffer tokens ({S}) of {s} must be >= 1")
    require(not o.optimizer_offload, f"--optimizer-offload-fraction ({o.optimizer_offload:g}) needs a parallel layout "
                                     "(--tp, --pp, --dp, --ep ...): only a layout step times the optimizer step")
    costs, mem = o.priced(rs.topology)
    from moonep_sim.step.mtp import MTP

    mtp = MTP(o.mtp_depth, o.mtp_acceptance)
    seqs = None
    if mtp.depth:
        require(src.gen is not None, f"--mtp-depth ({mtp.depth}) needs generated routing: a trace fixes the tokens "
                                     "each step verifies")
        seqs = int(o.tokens_per_rank or src.gen.tokens_per_rank)
    out = []
    skew = (standin_skew(src, R) if src.gen is None and m.moe_layers > len(src.layer_ids)
            else None)
    passes = trace_passes(src) if src.gen is None else [(None, None)]
    if o.context is None and src.gen is None and src.merged and o.mode != "decode":
        o = dataclasses.replace(o, context=_longest_pass(src, R))  # the passes' own sequence length
    shared = _Pass(o, costs, mem, skew, jobs, cluster, pipeline)
    from moonep_sim.progress import resolve

    with resolve(progress, "step") as report:
        for k, (step_id, steps_T) in enumerate(passes):
            cb = report
            if len(passes) > 1:
                cb = (lambda msg, d, t, k=k, sid=step_id:
                      report(f"recorded step {sid} ({k + 1} of {len(passes)}): {msg}", k * t + d, len(passes) * t))
            out.append(_one_pass(rs, m, shared, step_id, steps_T, cb, seqs * mtp.verify_tokens if mtp.depth else None))
    if mtp.depth:
        _add_mtp(out, m, mtp, seqs, costs, mem, R, o.context)
    return out


def _add_mtp(out: list, m: ModelSpec, mtp: Any, seqs: int, costs: Any, mem: Any, R: int, context: int | None) -> None:
    """The draft passes of MTP on every strategy's decode step (``moonep_sim.step.mtp``)."""
    from moonep_sim.step.memory import moe_layer_weight_bytes
    from moonep_sim.step.mtp import apply_mtp
    from moonep_sim.step.stack import head_ops, step_shape

    head = sum(costs.op_us(op) for op in head_ops(m, step_shape(m, "decode", seqs, context))[1])
    wbytes = moe_layer_weight_bytes(m, R, mem.weight_dtype)
    for res in out:
        for fig in res.figures.values():
            apply_mtp(fig, mtp, seqs, head, wbytes)
        res.setup["mtp"] = {"depth": mtp.depth, "acceptance": float(mtp.acceptance), "sequences_per_rank": seqs,
                            "tokens_per_step": mtp.tokens_per_step}


@dataclass(frozen=True)
class _Pass:
    """What every pass of :func:`run_step` shares: the step options (the context a merged trace's
    longest pass where none was given), the cost model and memory options built from them, the
    stand-in layers' skew (or None) and how the layers run."""

    options: StepOptions
    costs: Any
    mem: Any
    skew: Any
    jobs: int | None
    cluster: str | None
    pipeline: bool | None


def _one_pass(rs, m, shared: "_Pass", step_id, steps_T, progress, route_tokens: int | None = None) -> StepResult:
    """:func:`run_step`'s step of one recorded pass (or of the generated routing); ``shared``:
    the settings every pass shares. ``route_tokens``: tokens per rank the MoE layers route when not
    the step's (MTP: each sequence verifies 1 + depth tokens)."""
    from moonep_sim.step import StepConfig, simulate_step, step_shape

    src = rs.source
    o = shared.options
    R = rs.cluster.ranks
    n = None
    if src.gen is not None:
        T = int(o.tokens_per_rank or src.gen.tokens_per_rank)
    else:
        n = int(steps_T.size) if steps_T is not None else int(src.tokens or 0)
        require(o.tokens_per_rank is None or o.tokens_per_rank * R == n,
                f"tokens per rank ({o.tokens_per_rank}) must be the trace's tokens over the ranks ({n} / {R}): "
                "a trace sets the batch")
        require(n >= 1, f"trace tokens ({n}) must be >= 1")
        T = max(n // R, 1)  # fewer tokens than ranks: the busiest ranks hold one, the others none
    shape = step_shape(m, o.mode, T, o.context)
    for s, S in o.static_tokens.items():
        require(int(S) >= T, f"static buffer tokens ({S}) of {s} must be >= the tokens per rank ({T})")
    cfg = StepConfig(m, rs.topology, rs.ctx, rs.strategies, shape, o.overlap, shared.costs, shared.mem, o.static_tokens)
    pool = None
    if shared.cluster or (shared.jobs or 1) != 1:
        from moonep_sim.experiments.parallel import run_points

        pool = lambda fn, items: run_points(fn, items, jobs=shared.jobs, cluster=shared.cluster, progress=progress,
                                            label=lambda w: "layer")
    res = simulate_step(cfg, layer_source(src, R, route_tokens or T, m.moe_layers, o.distinct_layers, steps_T, shared.skew, n),
                        progress, pool, shared.pipeline)
    timelines = res.pop("_timelines")
    res.pop("_footprints", None)
    setup = {k: v for k, v in res.items() if k != "strategies"}
    setup.update(model=m.name, ranks=R, gpus_per_node=rs.cluster.gpus_per_node, topology=rs.topology.name,
                 routing=src.describe(), gemm_dtype=o.gemm_dtype, weight_dtype=shared.mem.weight_dtype,
                 kv_dtype=shared.mem.kv_dtype, compute_profile=o.compute_profile,
                 distinct_layers=o.distinct_layers, recompute=o.recompute, jobs=shared.jobs, cluster=shared.cluster,
                 options={name: {k: str(v) for k, v in opt.items()} for name, opt in rs.strategies},
                 stand_ins=sum(1 for p in res["layers_routing"] if p.startswith("STAND-IN")),
                 standin_skew=shared.skew,
                 reused_layers=sum(1 for p in res["layers_routing"] if "reused" in p),
                 step_id=step_id, step_tokens=n, merged=bool(src.gen is None and src.merged),
                 zero_token_ranks=max(R - n, 0) if n is not None else 0,
                 gpu_tflops=rs.topology.gpu_tflops, gpu_memory_GiB=rs.topology.gpu_memory_GiB)
    return StepResult(tuple(res["strategies"]), res["strategies"], setup, timelines)


def steps_document(results: Sequence[StepResult]) -> dict[str, Any]:
    """The document of a step run (``moonep-sim step``, ``compare --level step``): one step's
    :meth:`StepResult.to_dict`, or ``{kind: steps, steps: [...], setup, flags}`` for several
    recorded steps; on a trace, ``aggregate`` holds the per-step aggregate
    (:func:`moonep_sim.analysis.stepstats.step_aggregates`) for any selection, one step too."""
    from moonep_sim.analysis.stepstats import step_aggregates
    from moonep_sim.analysis.winner import dedup_flags

    docs = [r.to_dict() for r in results]
    if len(docs) == 1:
        doc = docs[0]
    else:
        doc = {"kind": "steps", "steps": docs, "setup": docs[0]["setup"],
               "flags": dedup_flags([f for d in docs for f in d.get("flags") or []])}
    if docs and docs[0]["setup"].get("step_tokens") is not None and not docs[0]["setup"].get("merged"):
        doc["aggregate"] = step_aggregates(docs)
    return doc


def trace_passes(source: RoutingSource) -> list[tuple[int | None, np.ndarray | None]]:
    """``(step id, token indices into the selected tokens)`` of each selected recorded step of a
    trace, in the selection's order; ``[(id, None)]`` for one batch (one step selected, a trace of
    one step, or ``merged``: id None)."""
    st = source.selected_steps_T()
    if st is None:
        return [(source.batches[0][0] if source.batches else None, None)]
    return [(int(s), np.flatnonzero(st == s)) for s, _ in source.batches]


def _longest_pass(source: RoutingSource, ranks: int) -> int:
    """Tokens per rank of the trace's longest recorded pass (a merged batch's sequence length)."""
    st = source._trace.steps() if source._trace is not None else None
    if st is None or not st.size:
        return max(-(-int(source.tokens or 1) // ranks), 1)
    return max(-(-int(np.bincount(st).max()) // ranks), 1)


__all__ = ["GeneratedLayer", "StepOptions", "StepResult", "layer_source", "relabel_experts", "run_step", "standin_skew",
           "steps_document", "trace_passes"]
