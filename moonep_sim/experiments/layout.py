"""Steps under a parallel layout, from a scenario: the EP group's routing, then the layout's step
(:func:`moonep_sim.step.layout_step.layout_step`).

The scenario's cluster is the job's GPUs (N); the layout (:class:`~moonep_sim.step.parallel.Parallel`)
must multiply to N. Each MoE layer is planned over one EP group: ``ep`` ranks, ``G / etp`` of them
per node (the expert grid numbers ETP fastest), on the tokens one rank of a stage's expert grid holds
per micro-batch -- in train ``micro_batch_size x seq / (tp x cp)`` with ``seq`` the context
(default :data:`DEFAULT_TRAIN_SEQ`); in serving the scenario's tokens per (attention-DP) rank over
``tp x cp``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moonep_sim.errors import require

#: Sequence length of a layout's training step when no context is given (Megatron recipes' 4096).
DEFAULT_TRAIN_SEQ = 4096


def layout_tokens(parallel, mode: str, tokens_per_rank: int | None, context: int | None,
                  gen_tokens: int | None) -> tuple[int, int]:
    """(tokens per expert-grid rank of one micro-batch, context) of a layout's step (one-line
    errors for what the layout sets)."""
    p = parallel
    if mode == "train":
        require(tokens_per_rank is None, f"tokens per rank ({tokens_per_rank}) is set by the layout in train: "
                                         "micro-batch size x sequence / (tp x cp); give the sequence as the context")
        seq = int(context or DEFAULT_TRAIN_SEQ)
        p.check(seq_len=seq)
        n = p.micro_batch_size * seq
        require(n % (p.tp * p.cp) == 0, f"micro-batch tokens ({p.micro_batch_size} x {seq}) must be a multiple of "
                                         f"tp x cp ({p.tp} x {p.cp}): each TP/CP rank takes its share")
        return n // (p.tp * p.cp), seq
    T = int(tokens_per_rank or gen_tokens or 0)
    require(T >= 1, "tokens per rank must be given for a serving step under a layout")
    require(T % (p.tp * p.cp) == 0, f"tokens per rank ({T}) must be a multiple of tp x cp ({p.tp} x {p.cp}) "
                                    "under the layout: each TP/CP rank takes its share of the MoE tokens")
    return T // (p.tp * p.cp), context


def recompute_options(value: "bool | str") -> dict:
    """``MemoryOptions``' recompute keywords from a recompute setting: False / True (none /
    selective), ``none``, ``selective``, ``full``, or ``selective:MOD,MOD`` naming what selective
    recompute recomputes (``core_attn``, ``mla_up_proj``, ``layernorm``, ``moe_act``)."""
    if isinstance(value, bool) or value is None:
        return {"recompute": bool(value)}
    level, _, mods = str(value).partition(":")
    from moonep_sim.step.activations import RECOMPUTE, RECOMPUTE_MODULES

    require(level in RECOMPUTE, f"--recompute ({value!r}) must be none, selective, full or selective:MOD,... "
                                "(what a training backward recomputes)")
    if not mods:
        return {"recompute": level}
    names = tuple(x for x in mods.split(",") if x)
    bad = [x for x in names if x not in RECOMPUTE_MODULES]
    require(level == "selective" and names and not bad,
            f"--recompute ({value!r}) modules must follow selective: and be among {', '.join(RECOMPUTE_MODULES)}")
    return {"recompute": level, "recompute_modules": names}


def ep_group(scenario: Any, p, model=None) -> tuple[Any, int, int]:
    """(one EP group's Resolved, the job's GPUs N, GPUs per node G) of a scenario (or its
    Resolved) under layout ``p``. A Scenario's cluster names the job (default N: the layout's
    product; G: the topology's GPUs per node) and is not itself resolved (N need not divide the
    experts: only ``ep`` must); a Resolved's cluster is the job's."""
    from moonep_sim.experiments.spec import parse_cluster
    from moonep_sim.step.layout_step import expert_group_gpus_per_node

    if hasattr(scenario, "source"):   # a Resolved (a Scenario has a routing, not yet a source)
        rs = scenario
        N, G = rs.cluster.ranks, rs.cluster.gpus_per_node
        p.check(N, model or rs.source.model)
        from moonep_sim.experiments.compare import check_cluster
        from moonep_sim.plan.placement import Placement
        from moonep_sim.strategies import PlanContext

        cl = check_cluster(rs.source, p.ep, expert_group_gpus_per_node(p, G))
        place = Placement.home_groups(rs.source.num_experts, p.ep)
        ctx = PlanContext(cl, place, rs.ctx.costs, rs.ctx.token_padding, rs.topology)
        return dataclasses.replace(rs, cluster=cl, ctx=ctx), N, G
    from moonep_sim.experiments.compare import load_topology

    N, G = parse_cluster(scenario.cluster)
    N = N or p.world
    G = G or load_topology(scenario.topology).gpus_per_node
    require(N == p.world, f"tp x cp x dp x pp ({p.tp} x {p.cp} x {p.dp} x {p.pp} = {p.world}) must equal the GPUs ({N})")
    require(N % G == 0 or N < G, f"GPUs ({N}) must be a multiple of the GPUs per node ({G})")
    probe = dataclasses.replace(scenario, cluster=(1, 1)).resolved   # the model, before the EP group is resolved
    p.check(N, model or probe.source.model)
    group = dataclasses.replace(scenario, cluster=(p.ep, expert_group_gpus_per_node(p, min(G, N)))).resolved
    return group, N, min(G, N)


def run_layout_step(scenario: Any, options, *, model=None, progress=None, jobs: int | None = 1,
                    cluster: str | None = None, pipeline: bool | None = None, layer_source=None):
    """``(figures, setup, timelines)`` of ``scenario``'s step under ``options.parallel`` (see the module
    docstring; ``options`` a :class:`~moonep_sim.experiments.step.StepOptions`, the other keywords
    :func:`~moonep_sim.experiments.step.run_step`'s, which wraps them in its ``StepResult``;
    ``layer_source`` its routing source builder). ``options.contexts_R``: decode under data-parallel
    attention, each rank's KV context over the EP group's ``ep`` ranks (ASSUMED alike in every EP
    group): each rank's attention at its own context, every MoE dispatch waiting for the slowest; the
    KV cache counted at the longest). ``options.mtp_depth`` / ``mtp_acceptance``: decode with
    multi-token prediction, as today's step adds it (:func:`add_layout_mtp`)."""
    from moonep_sim.step import StepConfig, step_shape
    from moonep_sim.step.layout_step import layout_step

    o = options
    p = o.parallel
    group, N, G = ep_group(scenario, p, model)
    src = group.source
    m = model or src.model
    require(src.gen is not None, "a step under a layout runs on generated routing (gen:...): a trace's tokens are "
                                 "one EP group's, not a layout's")
    p.check(N, m)
    T, ctx = layout_tokens(p, o.mode, o.tokens_per_rank, o.context, src.gen.tokens_per_rank)
    shape = dataclasses.replace(step_shape(m, o.mode, T, ctx), shards=p.tp * p.cp, tp=p.tp)
    if o.contexts_R is not None:
        shape = dataclasses.replace(shape, context=max(o.contexts_R), contexts=o.contexts_R)
    g_ep = group.cluster.gpus_per_node
    rs = group
    costs, mem = o.priced(rs.topology)
    cfg = StepConfig(m, group.topology, group.ctx, group.strategies, shape, o.overlap, costs, mem, {})
    pool = None
    if cluster or (jobs or 1) != 1:
        from moonep_sim.experiments.parallel import run_points

        pool = lambda fn, items: run_points(fn, items, jobs=jobs, cluster=cluster)
    from moonep_sim.step.mtp import MTP

    mtp = MTP(o.mtp_depth, o.mtp_acceptance)
    route = T * mtp.verify_tokens if mtp.depth else T   # each sequence verifies 1 + depth tokens
    res = layout_step(cfg, p, layer_source(group.source, p.ep, route, m.moe_layers, o.distinct_layers), G,
                      progress=progress, map_fn=pool, pipeline=pipeline)
    if mtp.depth:
        res["mtp"] = add_layout_mtp(res["strategies"], cfg, p, mtp)
    timelines = res.pop("_timelines")
    setup = {k: v for k, v in res.items() if k != "strategies"}
    setup.update(model=m.name, ranks=N, gpus=N, ep_group_ranks=p.ep, ep_group_gpus_per_node=g_ep, gpus_per_node=G,
                 topology=rs.topology.name, routing=src.describe(), gemm_dtype=o.gemm_dtype,
                 weight_dtype=o.weight_dtype, kv_dtype=o.kv_dtype, memory_options=mem.describe(),
                 compute_profile=o.compute_profile, distinct_layers=o.distinct_layers, recompute=mem.recompute,
                 jobs=jobs, cluster=cluster, options={n: {k: str(v) for k, v in opt.items()} for n, opt in rs.strategies},
                 stand_ins=0, reused_layers=sum(1 for x in res["layers_routing"] if "reused" in x),
                 step_tokens=None, gpu_tflops=rs.topology.gpu_tflops, gpu_memory_GiB=rs.topology.gpu_memory_GiB,
                 assumptions=LAYOUT_ASSUMPTIONS)
    return res["strategies"], setup, timelines


def add_layout_mtp(figures: dict, cfg, p, mtp) -> dict:
    """The draft passes of MTP on every strategy's decode step under layout ``p`` (in place), as
    :func:`moonep_sim.step.mtp.apply_mtp` adds them to today's step: a draft pass costs the stages'
    mean MoE layer plus the LM head (of a TP rank's shard); the draft layer's weights over the EP
    group; the sequences per GPU the step's tokens over the GPUs. Returns the setup's ``mtp``."""
    from moonep_sim.step.memory import moe_layer_weight_bytes
    from moonep_sim.step.mtp import apply_mtp
    from moonep_sim.step.stack import head_ops

    head = sum(cfg.costs.op_us(op) for op in head_ops(cfg.model, cfg.shape)[1])
    wbytes = moe_layer_weight_bytes(cfg.model, p.ep, cfg.memory.weight_dtype) / p.etp
    seqs = 0
    for fig in figures.values():
        seqs = fig["tokens_per_step"] // p.world
        fig["layers"] = [{"kind": "moe", "time_us": fig["moe_layer_us_mean"]}]
        apply_mtp(fig, mtp, seqs, head, wbytes)
        del fig["layers"]
    return {"depth": mtp.depth, "acceptance": float(mtp.acceptance), "sequences_per_rank": seqs,
            "tokens_per_step": mtp.tokens_per_step}


#: What a layout step assumes (stated in its JSON setup; docs/steps.md explains each).
LAYOUT_ASSUMPTIONS = (
    "TP/SP/ETP/CP collectives exposed (no TP-communication overlap); CP ring traffic not overlapped with attention",
    "DP gradients reduced in fp32, parameters gathered in bf16 (ring, one per rail); optimizer step memory-bound "
    "at 30 B/param of the shard, its gradient norm 4 B/param, the fp32 gradient buffer zeroed (4 B/param); with "
    "optimizer CPU offload its host part over PCIe at 80% and a CPU Adam at half the node's DRAM bandwidth",
    "pipeline sends over the link the stage boundary crosses; DualPipe order by the rule of its figure, "
    "no zero-bubble weight split",
    "memory per pipeline rank by the layout's account (memory_for_layout) over the Plans of the layers simulated; "
    "recompute changes memory, not the priced time",
    "a TP rank's split GEMMs (attention projections, dense FFN, shared experts, LM head) run the TP group's rows "
    "through 1/tp of the weight (column-parallel shape); the router, latent projection and attention core run the "
    "rank's 1/tp share of the tokens (MLA's replicated latent cache read per rank not multiplied by tp)",
    "training launches eagerly: the host issues each block's kernels (counts from DeepSeek's H800 trace) and waits "
    "at every device-to-host sync (Megatron's all-to-all dispatcher, DeepEP's count wait); 82 us per launch for "
    "Megatron-Core FITTED on development row 2, 28.5 us measured in DeepSeek's trace for DualPipe (moonep_sim.step.host)",
    "serving under TP attention: an EP group inside the TP group runs its experts on the replicated tokens, no "
    "dispatch or combine (the TP all-reduces stay)",
)


__all__ = ["DEFAULT_TRAIN_SEQ", "LAYOUT_ASSUMPTIONS", "layout_tokens", "add_layout_mtp", "recompute_options", "run_layout_step"]
