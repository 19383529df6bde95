"""``moonep-sim step``: a whole training iteration, prefill chunk or decode pass, per strategy.

A thin adapter over :meth:`moonep_sim.experiments.Scenario.step` (the step model:
``moonep_sim.step``, docs/steps.md). The table puts the step time first and says what share of it
each strategy's communication is (the part compute does not hide).
"""

from __future__ import annotations

import dataclasses

from moonep_sim.cli.common import (add_dispatch_dtype, add_output_flags, add_redundant_experts, add_steps,
                                   add_strategies, check_cluster_args)
from moonep_sim.errors import ConfigError, require


def register(sub) -> None:
    p = sub.add_parser("step", help="a whole train / prefill / decode step per strategy: time, overlap, memory, OOM")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="token-level trace (.safetensors): MoE layer i is its i-th layer; missing "
                                     "layers are stand-ins drawn at the skew measured over the whole trace (flagged)")
    src.add_argument("--gen", metavar="K=V,...", help="generated routing, e.g. model=kimi-k3,maxvio=2 (one layer "
                                                       "per MoE layer; docs/traces.md)")
    p.add_argument("--model", default=None, help="model preset or file (default: the trace's or the --gen model)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks of a pure-EP step (default: 8, or the largest "
                                                           "divisor of E below); under a layout give --ep and --gpus")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="the job's GPUs under a layout (default: the layout's tp x cp x dp x pp) or for --search")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the topology's, at most R)")
    p.add_argument("--topology", default="h800-cx7", help="preset name or .toml file (see `moonep-sim topologies`)")
    add_strategies(p, "alltoall,deepep,moonep")
    p.add_argument("--search", action="store_true",
                   help="search the parallel layouts of the model on --gpus GPUs: every valid tp/pp/dp/ep split priced "
                        "from a few layer simulations, those that fit ranked per strategy by tokens/s per GPU")
    p.add_argument("--top", type=int, default=5, metavar="K", help="--search: the best K layouts per strategy")
    add_step_options(p)
    p.add_argument("--jobs", type=int, default=1, help="plan and simulate the distinct layers in N worker processes")
    p.add_argument("--cluster", default=None, metavar="ADDR", help="... or on a Dask cluster at ADDR")
    p.add_argument("--pipeline", choices=("auto", "on", "off"), default="auto",
                   help="one job: build the next layer's routing and Plans on a second thread while this one "
                        "simulates (auto: on 2+ cores, for layers of >= 2^20 routed entries; same results; docs/steps.md)")
    add_steps(p)
    add_dispatch_dtype(p)
    add_redundant_experts(p)
    p.add_argument("--timeline", metavar="OUT.json", default=None,
                   help="write a Perfetto trace of every op (compute and comm streams per rank)")
    p.add_argument("--gantt", metavar="PNG", default=None,
                   help="write a Gantt chart of the first strategy (compute and comm per rank, slowest first)")
    add_output_flags(p, out_help="write report.json, the step-time and Gantt PNGs and a self-contained report.html "
                                 "(tables, plots, verdict, flags, the command and versions) under DIR")
    p.set_defaults(func=run)


#: what ``step --out DIR`` writes (the output rule checks them against the inputs before the run);
#: several recorded steps: step_time_0.png, step_time_1.png, ... (one per step)
OUT_FILES = ("report.json", "report.html", "step_time.png", "step_time_*.png", "gantt.png")


#: (flag, dest, default at `moonep-sim step`): the step options compare and sweep take at --level step
STEP_FLAGS = (("--mode", "mode", "train"), ("--tokens-per-rank", "tokens_per_rank", None),
              ("--context", "context", None), ("--overlap", "overlap", "none"),
              ("--distinct-layers", "distinct_layers", 0), ("--static-buffer", "static_buffer", []),
              ("--compute-profile", "compute_profile", None), ("--gemm-dtype", "gemm_dtype", "bf16"),
              ("--weight-dtype", "weight_dtype", "bf16"), ("--kv-dtype", "kv_dtype", "bf16"),
              ("--mtp-depth", "mtp_depth", 0), ("--mtp-acceptance", "mtp_acceptance", 0.8),
              ("--recompute", "recompute", False), ("--optimizer-shard", "optimizer_shard", 0),
              ("--optimizer-bytes-per-param", "optimizer_bytes_per_param", 12.0),
              ("--optimizer-offload-fraction", "optimizer_offload", 0.0),
              ("--overlap-cpu-optimizer-d2h-h2d", "offload_overlap", False))


def add_step_options(p, *, level: bool = False, tokens: bool = True) -> None:
    """The step options (STEP_FLAGS). ``level``: for compare / sweep, with ``--level`` beside them;
    each defaults to None there (given or not is known: a step option at --level layer is refused).
    ``tokens``: add --tokens-per-rank (sweep has its own)."""
    d = {dest: (None if level else v) for _, dest, v in STEP_FLAGS}
    at = " (--level step)" if level else ""
    if level:
        p.add_argument("--level", choices=("layer", "step"), default="layer",
                       help="layer: one MoE layer's dispatch, experts and combine (the default); step: the whole "
                            "train / prefill / decode step per strategy, as `moonep-sim step` (docs/steps.md)")
    p.add_argument("--mode", choices=("train", "prefill", "decode"), default=d["mode"],
                   help="train (forward + backward), prefill (a chunk) or decode (one token per sequence)" + at)
    if tokens:
        p.add_argument("--tokens-per-rank", type=int, default=None,
                       help="tokens per rank (decode: sequences per rank); default the generator spec's, a trace's own"
                            + at)
    p.add_argument("--context", type=int, default=None,
                   help="keys per sequence (train/prefill: the sequence length, default the tokens; decode: the "
                        "KV context, default 4096)" + at)
    from moonep_sim.step.schedules import OVERLAPS  # the registry's schedules (no simulator import)

    p.add_argument("--overlap", choices=OVERLAPS, default=d["overlap"],
                   help="overlap schedule (docs/steps.md)" + at)
    p.add_argument("--distinct-layers", type=int, default=d["distinct_layers"], metavar="N",
                   help="generated routing: plan and simulate only N layers, MoE layer i reusing layer i mod N "
                        "(flagged; 0 = every layer its own, the default)" + at)
    p.add_argument("--static-buffer", action="append", default=d["static_buffer"], metavar="STRATEGY=TOKENS",
                   help="the strategy's Buffer is static, sized for TOKENS per rank: every pass is padded to it "
                        "(e.g. moonep=8192; repeatable)" + at)
    p.add_argument("--compute-profile", default=None, metavar="CSV",
                   help="measured op times (op,shape,time_us) replacing the roofline defaults; every op must be in "
                        "it (benchmarks/profile_ops.py writes one)" + at)
    p.add_argument("--gemm-dtype", choices=("bf16", "fp8"), default=d["gemm_dtype"],
                   help="GEMM peak: BF16 or FP8 (with fp8, training saves the GEMMs' inputs in fp8)" + at)
    p.add_argument("--weight-dtype", default=d["weight_dtype"], metavar="DTYPE",
                   help="stored weight format: bf16, fp16, fp32, fp8 (128x128 block scales), mxfp4, nvfp4 (= fp4); "
                        "prices memory and the memory-bound GEMMs by its bytes, scales included" + at)
    p.add_argument("--kv-dtype", default=d["kv_dtype"], metavar="DTYPE",
                   help="KV-cache format: bf16, fp16, fp8, mxfp4, nvfp4 (= fp4)" + at)
    p.add_argument("--mtp-depth", type=int, default=d["mtp_depth"], metavar="N",
                   help="decode: N draft tokens per step (multi-token prediction / speculative decoding; the main "
                        "model verifies 1 + N tokens per sequence, a draft layer runs N times; 0 = off)" + at)
    p.add_argument("--mtp-acceptance", type=float, default=d["mtp_acceptance"], metavar="P",
                   help="decode with --mtp-depth: the chance each draft is accepted (tokens per step 1 + P + ... + "
                        "P^N; default 0.8)" + at)
    p.add_argument("--recompute", nargs="?", const="selective", default=d["recompute"], metavar="LEVEL",
                   help="train: what the backward recomputes: selective (the flag alone: the attention core, norms "
                        "and MLA's up-projections), full (each layer from its input), none, or selective:MOD,... "
                        "(of core_attn, mla_up_proj, layernorm, moe_act)" + at)
    p.add_argument("--optimizer-shard", type=int, default=d["optimizer_shard"], metavar="N",
                   help="ranks the dense weights' optimizer state is sharded over (0 = all ranks)" + at)
    p.add_argument("--optimizer-bytes-per-param", type=float, default=d["optimizer_bytes_per_param"],
                   help="optimizer state per parameter (12 = mixed-precision Adam: fp32 master, m, v)" + at)
    p.add_argument("--optimizer-offload-fraction", dest="optimizer_offload", type=float, default=d["optimizer_offload"],
                   metavar="F",
                   help="train under a layout: the fraction of the optimizer state held and stepped on the host "
                        "(Megatron's optimizer CPU offload: fp32 master and moments in host memory, gradients and "
                        "updated weights over PCIe; 0 = none; --search: the least of 0, 0.5, 1 that fits)" + at)
    p.add_argument("--overlap-cpu-optimizer-d2h-h2d", dest="offload_overlap", action="store_true",
                   default=d["offload_overlap"],
                   help="with optimizer CPU offload: pipeline its copies and CPU step over parameters (Megatron's "
                        "flag; off: one after the other)" + at)
    from moonep_sim.cli.layout import add_layout_options

    add_layout_options(p, at=at)


def step_level(args, *, layer_only: dict[str, bool] | None = None, tokens: bool = True) -> bool:
    """compare / sweep: True at --level step. A step option at --level layer, or a layer-only
    option (``layer_only``: flag -> given) at --level step, is one line (exit 2). ``tokens``:
    --tokens-per-rank is a step option (False: the command's own flag)."""
    from moonep_sim.cli.layout import layout_given

    given = [f for f, dest, _ in STEP_FLAGS if getattr(args, dest, None) not in (None, [])
             and (tokens or dest != "tokens_per_rank")] + layout_given(args)
    if args.level == "layer":
        if given:
            raise ConfigError(f"{given[0]} applies to --level step only (the layer level has no step options; "
                              "add --level step)")
        return False
    for flag, on in (layer_only or {}).items():
        if on:
            raise ConfigError(f"{flag} applies to --level layer only (not to --level step: {_WHY.get(flag, '')})")
    return True


_WHY = {"--real": "a real replay runs one layer over gloo; a step is simulated",
        "--layers": "a step runs every layer of the model",
        "--seeds": "the spread over seeds is layer-level; a step sweep runs the --seed given"}


def step_options(args, *, tokens: bool = True):
    """The typed step options these arguments give (defaults: `moonep-sim step`'s; ``tokens``
    False: --tokens-per-rank is the command's own flag, not a step option)."""
    from moonep_sim.cli.checks import check_step_flags
    from moonep_sim.experiments.step import StepOptions

    check_step_flags(args)
    kw = {}
    for _, dest, default in STEP_FLAGS:
        if dest == "tokens_per_rank" and not tokens:
            kw[dest] = None
            continue
        v = getattr(args, dest, None)
        kw[dest] = default if v is None or (v == [] and default == []) else v
    static = _static(kw.pop("static_buffer"))
    from moonep_sim.cli.layout import layout_from_args

    gpus = getattr(args, "gpus", None) or getattr(args, "ranks", None)
    return StepOptions(static_tokens=static, parallel=layout_from_args(args, gpus), **kw)


def scenario(args):
    from moonep_sim.experiments import GeneratorSpec, Scenario
    from moonep_sim.experiments.spec import parse_opt_items, split_names

    from moonep_sim.cli.layout import layout_given

    check_cluster_args(args)
    layout = bool(layout_given(args))
    if getattr(args, "gpus", None) is not None:
        require(args.gpus >= 1, f"--gpus ({args.gpus}) must be >= 1")
        require(layout or getattr(args, "search", False), "--gpus applies to a layout (--tp, --pp, --dp, --ep, ...) "
                                                          "or --search; a pure-EP step takes --ranks")
    if layout and hasattr(args, "gpus"):
        require(args.ranks is None, f"--ranks ({args.ranks}) is a pure-EP step's EP size: under a layout give --ep "
                                    "and --gpus")
    names = split_names(args.strategies)
    opts = parse_opt_items(args.opt, names)
    if args.gen:
        spec = GeneratorSpec.parse(args.gen)
        if args.tokens_per_rank is not None:
            spec = dataclasses.replace(spec, tokens_per_rank=args.tokens_per_rank)
        routing = spec
    else:
        require(args.tokens_per_rank is None, "--tokens-per-rank must not be given with --trace: the trace's tokens "
                                              "over the ranks set the batch")
        routing = args.trace
    ranks = (getattr(args, "gpus", None) or 0) if layout and hasattr(args, "gpus") else (args.ranks or 0)
    return Scenario(routing=routing, model=args.model, cluster=(ranks, args.gpus_per_node or 0),
                    topology=args.topology, strategies=[(n, opts[n]) for n in names],
                    steps=args.steps if not args.gen else None, dispatch_dtype=args.dispatch_dtype,
                    redundant_experts=getattr(args, "redundant_experts", 0))


def print_steps(doc: dict) -> None:
    """A step document (:func:`moonep_sim.experiments.step.steps_document`) as tables: one step's
    table, footer, verdict and flags; several recorded steps' step times one row per step; then,
    on a trace, the per-step aggregate."""
    from moonep_sim.report.steps import (aggregate_lines, aggregate_table, per_step_table, step_footer,
                                         step_table)
    from moonep_sim.report.tables import flag_lines, verdict_lines, wide_console

    from moonep_sim.report.layout import layout_footer, layout_table

    c = wide_console()
    docs = doc["steps"] if doc.get("kind") == "steps" else [doc]
    layout = "layout" in docs[0]["setup"]
    if layout:
        c.print(layout_table(docs[0]))
    elif len(docs) == 1:
        c.print(step_table(docs[0]))
    else:
        c.print(per_step_table(docs))
    for line in layout_footer(docs[0]) if layout else step_footer(docs[0]):
        c.print(line)
    zero = [d["setup"].get("step_id") for d in docs[1:] if d["setup"].get("zero_token_ranks")]
    if zero:
        c.print(f"{len(zero)} more step(s) have ranks that hold no token (fewer tokens than ranks): steps "
                + ", ".join(map(str, zero[:12])) + (" ..." if len(zero) > 12 else ""))
    if len(docs) == 1:
        for line in verdict_lines(docs[0]):
            c.print(line, highlight=False, markup=False)
    if doc.get("aggregate"):
        c.print(aggregate_table(doc["aggregate"]))
        for line in aggregate_lines(doc["aggregate"]):
            c.print(line, highlight=False, markup=False)
    for line in flag_lines(doc):
        c.print(line, highlight=False, markup=False)


def _static(items) -> dict[str, int]:
    """``["moonep=8192"]`` -> ``{"moonep": 8192}``."""
    out = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        try:
            out[k.strip()] = int(v) if sep else int("x")
        except ValueError:
            raise ConfigError(f"--static-buffer ({it!r}) must look like STRATEGY=TOKENS, e.g. moonep=8192") from None
    return out


def run(args) -> int:
    from moonep_sim.cli.common import emit_json, output_rule, print_warnings
    from moonep_sim.progress import tracker
    from moonep_sim.experiments.step import steps_document

    from moonep_sim.cli.checks import check_step_ranks, check_step_routing

    output_rule(args, files=("json", "timeline", "gantt"), folders={"out": OUT_FILES})  # before any work
    if args.search:
        return run_search(args)
    check_step_routing(args)
    step_options(args)  # the step options' bounds, before the routing is opened
    sc = scenario(args)
    opts = dataclasses.replace(step_options(args), tokens_per_rank=args.tokens_per_rank if args.gen else None)
    if opts.parallel is not None:
        for flag, v in (("--timeline", args.timeline), ("--gantt", args.gantt)):
            require(v is None, f"{flag} ({v}) draws one EP group's ranks of a pure-EP step: not available under a "
                               "layout (its pipeline is in --json: strategies.*.pipeline)")
    else:
        rs = sc.resolved  # every input checked before any work (a layout's: its EP group, before any stage runs)
        check_step_ranks(args, rs.cluster.ranks)
        print_warnings(rs.warnings)
    from moonep_sim.experiments.step import run_step

    with tracker("step") as cb:
        results = run_step(sc, opts, jobs=args.jobs, cluster=args.cluster, progress=cb,
                           pipeline={"auto": None, "on": True, "off": False}[args.pipeline])
    doc = steps_document(results)
    on_stdout = emit_json(args, doc, lenient=True)
    if not on_stdout:
        print_steps(doc)
    first = results[0]
    name = first.strategies[0]
    if args.timeline:
        tl = first.timelines[name]
        from moonep_sim.sim.perfetto import write_trace
        from moonep_sim.step.schedule import perfetto_events

        ends = tl.end_R()
        ranks = sorted(range(tl.R), key=lambda r: -ends[r])[:16]
        write_trace(args.timeline, perfetto_events(tl, sorted(ranks)),
                    {"strategy": name, "ranks_shown": sorted(ranks), "note": "the 16 slowest ranks" if tl.R > 16 else ""})
    if args.gantt:
        _gantt(first, args, args.gantt)
    if args.out:
        files = write_outputs(doc, first, args)
        if not on_stdout:
            print("wrote " + ", ".join(files.values()))
    return 0


#: layout flags --search takes (the rest it chooses)
SEARCH_KEEPS = ("--micro-batch-size", "--global-batch-size", "--pp-schedule", "--zero")


def run_search(args) -> int:
    """``step --search --gpus N``: :meth:`Scenario.search_layouts`, a progress bar, the ranked table."""
    from moonep_sim.cli.common import emit_json
    from moonep_sim.progress import tracker
    from moonep_sim.cli.layout import layout_given
    from moonep_sim.report.layout import search_table
    from moonep_sim.report.tables import wide_console

    require(args.gpus is not None, "--search needs --gpus N (the GPUs to lay the model out on)")
    require(args.gen is not None, "--search runs on generated routing: give --gen")
    require(args.top >= 1, f"--top ({args.top}) must be >= 1")
    chosen = [f for f in layout_given(args) if f not in SEARCH_KEEPS]
    require(not chosen, f"{chosen[0] if chosen else ''} is chosen by --search (it may keep only "
                        f"{', '.join(SEARCH_KEEPS)})")
    for flag, v in (("--timeline", args.timeline), ("--gantt", args.gantt), ("--out", args.out),
                    ("--tokens-per-rank", args.tokens_per_rank if args.mode == "train" else None)):
        require(v is None, f"{flag} ({v}) does not apply to --search")
    from moonep_sim.experiments.layout_search import SEARCH_STEP_OPTIONS

    for flag, dest, default in STEP_FLAGS:
        v = getattr(args, dest, None)
        require(dest in SEARCH_STEP_OPTIONS or v is None or v == default,
                f"{flag} ({v!r}) does not apply to --search: the search prices every layout with "
                f"{', '.join(f for f, d, _ in STEP_FLAGS if d in SEARCH_STEP_OPTIONS)} only")
    sc = scenario(args)
    c = wide_console()
    schedules = (args.pp_schedule,) if args.pp_schedule else ("1f1b", "interleaved", "dualpipe")
    from moonep_sim.experiments.layout_search import LayoutSpace, search_layouts
    from moonep_sim.experiments.step import StepOptions

    space = LayoutSpace(args.gpus, args.micro_batch_size or 1, args.global_batch_size or 0, schedules,
                        (args.zero,) if args.zero is not None else (1, 2, 3), args.top)
    step = StepOptions(args.mode, args.overlap or "none", args.tokens_per_rank, args.context or 4096,
                       gemm_dtype=args.gemm_dtype or "bf16", recompute=args.recompute or False,
                       weight_dtype=args.weight_dtype or "bf16", kv_dtype=args.kv_dtype or "bf16",
                       optimizer_bytes_per_param=(12.0 if args.optimizer_bytes_per_param is None
                                                  else args.optimizer_bytes_per_param),
                       optimizer_offload=args.optimizer_offload or 0.0, offload_overlap=bool(args.offload_overlap))
    with tracker("layouts") as cb:
        rep = search_layouts(sc, space, step, progress=lambda d, n: cb("priced" if d <= n else "", d, n))
    if emit_json(args, rep, lenient=True):
        return 0
    c.print(search_table(rep))
    for f in rep["flags"]:
        c.print(f"flag: {f}", highlight=False, markup=False)
    return 0


def _gantt(first, args, dest):
    """The Gantt chart of the first strategy's step (its 8 slowest ranks, slowest first)."""
    from moonep_sim.report.steps import step_gantt
    from moonep_sim.step.schedule import timeline_records

    name = first.strategies[0]
    tl = first.timelines[name]
    ends = tl.end_R()
    ranks = sorted(range(tl.R), key=lambda r: -ends[r])[:8]
    return step_gantt(timeline_records(tl, ranks), {r: float(ends[r]) for r in ranks}, dest,
                      title=f"{name}: {args.mode} step, overlap {args.overlap} (slowest rank first)")


def write_outputs(doc: dict, first, args) -> dict[str, str]:
    """``--out DIR``: report.json (one step's document, or ``{kind: steps, steps: [...]}``), the
    step-time plot of each step and the Gantt chart of the first strategy's (first) step unless
    --no-plots, and report.html embedding them; assembled beside DIR and moved in when all are
    written (a failure leaves none of them). Returns {what: path}."""
    from pathlib import Path

    from moonep_sim.io import staged_dir
    from moonep_sim.report.html import write_report
    from moonep_sim.report.plots import step_bars

    out = Path(args.out)
    docs = doc["steps"] if doc.get("kind") == "steps" else [doc]
    with staged_dir(out, "--out") as tmp:
        figs = {}
        if not args.no_plots:
            for i, d in enumerate(docs):
                stem = "step_time" if len(docs) == 1 else f"step_time_{i}"
                figs[stem] = step_bars(dict(d), tmp / f"{stem}.png")
            if first.timelines:    # a layout step has pipeline ranks, not one timeline
                figs["gantt"] = _gantt(first, args, tmp / "gantt.png")
        files = write_report(doc, tmp, out, figs)
    return files
