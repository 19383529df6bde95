"""``moonep-sim step``: a whole training iteration, prefill chunk or decode pass, per strategy.

A thin adapter over :meth:`moonep_sim.experiments.Scenario.step` (the step model:
``moonep_sim.step``, docs/steps.md). The table puts the step time first and says what share of it
each strategy's communication is (the part compute does not hide).
"""

from __future__ import annotations

import dataclasses
import json

from moonep_sim.cli.common import (add_dispatch_dtype, add_steps, add_strategies, check_cluster_args,
                                   parse_strategy_opts)
from moonep_sim.errors import ConfigError, require


def register(sub) -> None:
    p = sub.add_parser("step", help="a whole train / prefill / decode step per strategy: time, overlap, memory, OOM")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="token-level trace (.safetensors): MoE layer i is its i-th layer; missing "
                                     "layers are stand-ins generated at its measured skew (flagged)")
    src.add_argument("--gen", metavar="K=V,...", help="generated routing, e.g. model=kimi-k3,maxvio=2 (one layer "
                                                       "per MoE layer; docs/traces.md)")
    p.add_argument("--model", default=None, help="model preset or file (default: the trace's or the --gen model)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: 8, or the largest divisor of E below)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the topology's, at most R)")
    p.add_argument("--topology", default="h800-cx7", help="preset name or .toml file (see `moonep-sim topologies`)")
    add_strategies(p, "alltoall,deepep,moonep")
    p.add_argument("--mode", choices=("train", "prefill", "decode"), default="train",
                   help="train (forward + backward), prefill (a chunk) or decode (one token per sequence)")
    p.add_argument("--tokens-per-rank", type=int, default=None,
                   help="tokens per rank (decode: sequences per rank); default the --gen spec's, a trace's own")
    p.add_argument("--context", type=int, default=None,
                   help="keys per sequence (train/prefill: the sequence length, default the tokens; decode: the "
                        "KV context, default 4096)")
    p.add_argument("--overlap", choices=("none", "shared-expert", "two-batch"), default="none",
                   help="overlap schedule (docs/steps.md)")
    p.add_argument("--distinct-layers", type=int, default=0, metavar="N",
                   help="generated routing: plan and simulate only N layers, MoE layer i reusing layer i mod N "
                        "(flagged; 0 = every layer its own, the default)")
    p.add_argument("--static-buffer", action="append", default=[], metavar="STRATEGY=TOKENS",
                   help="the strategy's Buffer is static, sized for TOKENS per rank: every pass is padded to it "
                        "(e.g. moonep=8192; repeatable)")
    p.add_argument("--compute-profile", default=None, metavar="CSV",
                   help="measured op times (op,shape,time_us) replacing the roofline defaults; every op must be in "
                        "it (benchmarks/profile_ops.py writes one)")
    p.add_argument("--gemm-dtype", choices=("bf16", "fp8"), default="bf16", help="GEMM peak: BF16 or FP8")
    p.add_argument("--recompute", action="store_true", help="train: recompute attention and norms in the backward")
    p.add_argument("--optimizer-shard", type=int, default=0, metavar="N",
                   help="ranks the dense weights' optimizer state is sharded over (0 = all ranks)")
    p.add_argument("--optimizer-bytes-per-param", type=float, default=12.0,
                   help="optimizer state per parameter (12 = mixed-precision Adam: fp32 master, m, v)")
    p.add_argument("--jobs", type=int, default=1, help="plan and simulate the distinct layers in N worker processes")
    p.add_argument("--cluster", default=None, metavar="ADDR", help="... or on a Dask cluster at ADDR")
    add_steps(p)
    add_dispatch_dtype(p)
    p.add_argument("--json", metavar="OUT", default=None, help="write the JSON result to OUT ('-' = stdout)")
    p.add_argument("--timeline", metavar="OUT.json", default=None,
                   help="write a Perfetto trace of every op (compute and comm streams per rank)")
    p.add_argument("--gantt", metavar="PNG", default=None,
                   help="write a Gantt chart of the first strategy (compute and comm per rank, slowest first)")
    p.set_defaults(func=run)


def scenario(args):
    from moonep_sim.experiments import GeneratorSpec, Scenario

    check_cluster_args(args)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    opts = parse_strategy_opts(args.opt, names)
    if args.gen:
        spec = GeneratorSpec.parse(args.gen)
        if args.tokens_per_rank:
            spec = dataclasses.replace(spec, tokens_per_rank=args.tokens_per_rank)
        routing = spec
    else:
        require(args.tokens_per_rank is None, "--tokens-per-rank must not be given with --trace: the trace's tokens "
                                              "over the ranks set the batch")
        routing = args.trace
    return Scenario(routing=routing, model=args.model, cluster=(args.ranks or 0, args.gpus_per_node or 0),
                    topology=args.topology, strategies=[(n, opts[n]) for n in names],
                    steps=args.steps if not args.gen else None, dispatch_dtype=args.dispatch_dtype)


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
    from moonep_sim.cli.common import output_rule
    from moonep_sim.io import to_jsonable, write_text_atomic

    output_rule(args, files=("json", "timeline", "gantt"))  # no output over an input; before any work
    sc = scenario(args)
    sc.resolved  # every input checked before any work
    res = sc.step(mode=args.mode, overlap=args.overlap, context=args.context, distinct_layers=args.distinct_layers,
                  compute_profile=args.compute_profile, gemm_dtype=args.gemm_dtype, recompute=args.recompute,
                  optimizer_shard=args.optimizer_shard, optimizer_bytes_per_param=args.optimizer_bytes_per_param,
                  static_tokens=_static(args.static_buffer), tokens_per_rank=args.tokens_per_rank if args.gen else None,
                  jobs=args.jobs, cluster=args.cluster)
    results = res if isinstance(res, list) else [res]
    docs = [r.to_dict() for r in results]
    doc = docs[0] if len(docs) == 1 else {"steps": docs}
    if args.json:
        text = json.dumps(to_jsonable(doc, lenient=True), indent=1)
        if args.json == "-":
            print(text)
        else:
            write_text_atomic(args.json, text, what="--json")
    if args.json != "-":
        from moonep_sim.report.steps import step_footer, step_table
        from moonep_sim.report.tables import wide_console

        c = wide_console()
        for i, d in enumerate(docs):
            if len(docs) > 1:
                c.print(f"recorded step {i}")
            c.print(step_table(d))
            for line in step_footer(d):
                c.print(line)
            from moonep_sim.report.tables import flag_lines, verdict_lines

            for line in verdict_lines(d) + flag_lines(d):  # computed verdict, then the flags
                c.print(line, highlight=False, markup=False)
    first = results[0]
    name = first.strategies[0]
    tl = first.timelines[name]
    if args.timeline:
        from moonep_sim.sim.perfetto import write_trace
        from moonep_sim.step.schedule import perfetto_events

        ends = tl.end_R()
        ranks = sorted(range(tl.R), key=lambda r: -ends[r])[:16]
        write_trace(args.timeline, perfetto_events(tl, sorted(ranks)),
                    {"strategy": name, "ranks_shown": sorted(ranks), "note": "the 16 slowest ranks" if tl.R > 16 else ""})
    if args.gantt:
        from moonep_sim.report.steps import step_gantt
        from moonep_sim.step.schedule import timeline_records

        ends = tl.end_R()
        ranks = sorted(range(tl.R), key=lambda r: -ends[r])[:8]
        step_gantt(timeline_records(tl, ranks), {r: float(ends[r]) for r in ranks}, args.gantt,
                   title=f"{name}: {args.mode} step, overlap {args.overlap} (slowest rank first)")
    return 0
