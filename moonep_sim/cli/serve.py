"""``moonep-sim serve``: requests through a deployment per dispatch strategy, or a deployment search.

A thin adapter over :func:`moonep_sim.experiments.serve.run_serve` and
:func:`moonep_sim.experiments.serve_search.search` (docs/serving.md).
"""

from __future__ import annotations


from moonep_sim.errors import ConfigError, require

#: what ``serve --out DIR`` writes
OUT_FILES = ("report.json", "report.html", "latency_cdf.png", "pareto.png")


def register(sub) -> None:
    p = sub.add_parser("serve", help="requests through a serving deployment per strategy: TTFT, TPOT, "
                                     "throughput, SLO goodput, cost; or --search for the best deployment")
    p.add_argument("--model", required=True, help="model preset or file")
    p.add_argument("--topology", default="h800-cx7", help="preset name or .toml file")
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the deployment (checked; --search: the budget)")
    dep = p.add_mutually_exclusive_group()
    dep.add_argument("--deployment", metavar="FILE.toml", help="a deployment file (docs/serving.md)")
    dep.add_argument("--worker", metavar="K=V,...", help="an aggregated deployment's workers, e.g. "
                                                          "workers=2,dp=16,ep=16,max_running=64 (scheduler=prefill-first: "
                                                          "SGLang's separate prefill and decode batches)")
    p.add_argument("--prefill", metavar="K=V,...", help="a disaggregated deployment's prefill pool (with --decode)")
    p.add_argument("--decode", metavar="K=V,...", help="a disaggregated deployment's decode pool (with --prefill)")
    p.add_argument("--mtp", metavar="TOKENS:ACCEPT", default=None, help="MTP draft tokens and acceptance, e.g. 1:0.8")
    p.add_argument("--eplb-every", type=int, default=0, help="EPLB rebalancing (weight copy) every N iterations")
    p.add_argument("--strategies", default="alltoall,deepep", help="comma-separated dispatch strategies")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", default=None, help="open-loop arrivals, requests/s (a comma list: one run each)")
    load.add_argument("--concurrency", default=None, help="closed loop of C clients (a comma list: one run each)")
    load.add_argument("--requests", metavar="FILE.jsonl", default=None,
                      help="a request trace (JSONL: arrival_s, input_len, output_len, prefix_hit; or Mooncake's)")
    p.add_argument("--num-requests", type=int, default=1000, help="requests of a generated load")
    p.add_argument("--isl", default="1024", help="input lengths: N, uniform:LO:HI, lognormal:MEAN:SIGMA, exp:MEAN")
    p.add_argument("--osl", default="1024", help="output lengths (as --isl)")
    p.add_argument("--arrival-cv", type=float, default=1.0, help="gamma arrivals' coefficient of variation (1: Poisson)")
    p.add_argument("--prefix-hit", type=float, default=0.0, help="share of each generated prompt in the prefix cache")
    rt = p.add_mutually_exclusive_group()
    rt.add_argument("--trace", metavar="ROUTING", default=None,
                    help="recorded routing (.safetensors): each iteration's routing resampled from its steps in order")
    rt.add_argument("--gen", metavar="K=V,...", default=None,
                    help="generated routing per iteration, e.g. sigma=0.5 (default; docs/traces.md)")
    p.add_argument("--slo", default=None, help="e.g. ttft=200ms,tpot=50ms (units s, ms, us)")
    p.add_argument("--gpu-hour-price", type=float, default=None, help="USD per GPU-hour: $ per million tokens")
    p.add_argument("--overlap", default="none", help="the step's overlap schedule (none, shared-expert, two-batch)")
    p.add_argument("--gemm-dtype", choices=("bf16", "fp8"), default="bf16", help="the step's GEMM peak (fp8: FP8 "
                                                                                   "weights' tensor-core rate)")
    p.add_argument("--draws", type=int, default=3, help="routing draws per step-time grid point")
    p.add_argument("--distinct-layers", type=int, default=1, help="distinct MoE-layer routings per simulated step")
    p.add_argument("--direct", action="store_true", help="time every iteration shape with the step model itself")
    p.add_argument("--cache", default=None, help="step-time cache folder (default ~/.cache/moonep-sim/steptime)")
    p.add_argument("--no-cache", action="store_true", help="build the step-time model afresh, store nothing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--search", action="store_true", help="enumerate deployments of --gpus that fit and simulate them")
    p.add_argument("--max-deployments", type=int, default=100, help="--search: at most this many deployments")
    p.add_argument("--jobs", type=int, default=1, help="N worker processes: the step-time models' pieces and, with "
                                                       "--search, the deployments")
    p.add_argument("--cluster", default=None, metavar="ADDR", help="--search: ... or on a Dask cluster at ADDR")
    from moonep_sim.cli.common import add_output_flags

    add_output_flags(p, out_help="write report.json, latency_cdf.png, pareto.png and report.html under DIR")
    p.set_defaults(func=run)


def _kv(text: str, flag: str) -> dict:
    """``workers=2,dp=16,ep=16,dp_attention=true`` -> a pool table (layout keys under ``layout``)."""
    from moonep_sim.serve.deployment import POOL_KEYS

    pool: dict = {"layout": {"dp_attention": True}}
    for part in text.split(","):
        k, sep, v = part.strip().partition("=")
        k = k.strip().replace("-", "_")
        require(sep == "=" and k, f"{flag} ({part.strip()!r}) must be KEY=VALUE, e.g. dp=16")
        v = v.strip()
        val: object = v.lower() == "true" if v.lower() in ("true", "false") else v
        if k == "scheduler":     # a policy name (moonep_sim.serve.policies), checked by the pool
            val = v
        elif not isinstance(val, bool):
            try:
                val = int(v)
            except ValueError:
                raise ConfigError(f"{flag} {k} ({v!r}) must be an integer or true/false") from None
        (pool if k in POOL_KEYS else pool["layout"])[k] = val
    return pool


def deployment(args):
    from moonep_sim.serve.deployment import deployment_from_dict, read_deployment

    if args.deployment:
        require(not (args.prefill or args.decode), "--deployment must not be given with --prefill/--decode")
        dep = read_deployment(args.deployment)
    else:
        require(bool(args.prefill) == bool(args.decode), "--prefill and --decode must be given together")
        require(bool(args.worker) or bool(args.prefill), "a deployment is needed: --deployment FILE.toml, --worker "
                                                         "K=V,... or --prefill/--decode K=V,...")
        doc = {"worker": _kv(args.worker, "--worker")} if args.worker else \
            {"prefill": _kv(args.prefill, "--prefill"), "decode": _kv(args.decode, "--decode")}
        dep = deployment_from_dict(doc, "flags")
    import dataclasses

    if args.mtp:
        a, sep, b = args.mtp.partition(":")
        try:
            dep = dataclasses.replace(dep, mtp_tokens=int(a), mtp_accept=float(b) if sep else 0.0)
        except ValueError:
            raise ConfigError(f"--mtp ({args.mtp!r}) must be TOKENS:ACCEPT, e.g. 1:0.8") from None
    if args.eplb_every:
        dep = dataclasses.replace(dep, eplb_every=args.eplb_every)
    return dep


def _floats(text: str, flag: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} ({text!r}) must be a number or a comma list of numbers") from None
    require(out and all(x > 0 for x in out), f"{flag} ({text}) must be > 0")
    return out


def requests(args):
    """The load(s): one :class:`Requests` per rate or concurrency, or the request trace; and labels."""
    from moonep_sim.serve.requests import read_request_trace, synthetic

    require(args.num_requests >= 1, f"--num-requests ({args.num_requests}) must be >= 1")
    if args.requests:
        return [read_request_trace(args.requests)], [f"request trace {args.requests}"]
    if args.concurrency:
        cs = [int(c) for c in _floats(args.concurrency, "--concurrency")]
        return ([synthetic(args.num_requests, args.isl, args.osl, args.seed, concurrency=c, hit=args.prefix_hit)
                 for c in cs], [f"concurrency {c}" for c in cs])
    rates = _floats(args.rate or "10", "--rate")
    return ([synthetic(args.num_requests, args.isl, args.osl, args.seed, rate=r, cv=args.arrival_cv,
                       hit=args.prefix_hit) for r in rates], [f"rate {r:g}/s" for r in rates])


def options(args):
    from moonep_sim.experiments.serve import DEFAULT_GEN, ServeOptions, default_cache
    from moonep_sim.serve.metrics import parse_slo

    names = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    require(bool(names), "--strategies must name at least one strategy")
    require(args.draws >= 1, f"--draws ({args.draws}) must be >= 1")
    require(args.jobs >= 1, f"--jobs ({args.jobs}) must be >= 1: worker processes")
    require(args.distinct_layers >= 1, f"--distinct-layers ({args.distinct_layers}) must be >= 1")
    require(args.gpu_hour_price is None or args.gpu_hour_price > 0, f"--gpu-hour-price ({args.gpu_hour_price}) must "
                                                                     "be > 0")
    routing = args.trace if args.trace else "gen:" + (args.gen or DEFAULT_GEN)
    if args.gen and "model=" not in args.gen:
        routing += f",model={args.model}"
    elif not args.trace:
        routing += f",model={args.model}"
    from moonep_sim.experiments import Scenario

    base = Scenario(routing if routing.startswith("gen:") else routing, model=args.model, cluster=8,
                    topology=args.topology, strategies=list(names))
    return ServeOptions(model=args.model, topology=args.topology, strategies=names, routing=routing, scenario=base,
                        overlap=args.overlap, draws=args.draws, distinct_layers=args.distinct_layers,
                        cache=None if args.no_cache else (args.cache or default_cache()), direct=args.direct,
                        slo=parse_slo(args.slo), price=args.gpu_hour_price, seed=args.seed,
                        gemm_dtype=args.gemm_dtype, jobs=args.jobs)


def run(args) -> int:
    from moonep_sim.cli.common import emit_json, output_rule
    from moonep_sim.progress import tracker

    output_rule(args, files=("json",), folders={"out": OUT_FILES},
                inputs={k: v for k, v in (("--deployment", args.deployment), ("--requests", args.requests),
                                          ("--trace", args.trace)) if v})
    opts = options(args)
    reqs, loads = requests(args)
    if args.search:
        from moonep_sim.experiments.serve_search import search
        from moonep_sim.report.serve import print_search

        require(args.gpus is not None and args.gpus >= 1, "--search needs --gpus N (the GPU budget)")
        with tracker("search") as cb:
            doc = search(reqs[0], args.gpus, opts, max_deployments=args.max_deployments, jobs=args.jobs,
                         cluster=args.cluster, progress=cb, load=loads[0], argv=_argv(args))
    else:
        from moonep_sim.experiments.serve import run_serve

        dep = deployment(args)
        if args.gpus is not None:
            require(dep.gpus == args.gpus, f"deployment GPUs ({dep.gpus}: {dep.label()}) must equal --gpus "
                                           f"({args.gpus})")
        with tracker("serve") as cb:
            doc = run_serve(reqs, dep, opts, cb, loads)
    stdout = emit_json(args, doc, lenient=True)
    if not stdout:
        if args.search:
            print_search(doc)
        else:
            _print(doc)
    if args.out:
        files = write_outputs(doc, args)
        if not stdout:
            print("wrote " + ", ".join(files.values()))
    return 0


def _argv(args) -> list[str]:
    """The flags a search point's reproducing command keeps (everything but the deployment and search)."""
    out = ["moonep-sim", "serve", "--model", args.model, "--topology", args.topology, "--strategies", "{strategy}"]
    for flag, v in (("--rate", args.rate), ("--concurrency", args.concurrency), ("--requests", args.requests),
                    ("--isl", args.isl), ("--osl", args.osl), ("--trace", args.trace), ("--gen", args.gen),
                    ("--slo", args.slo), ("--gpu-hour-price", args.gpu_hour_price)):
        if v is not None:
            out += [flag, str(v)]
    if not args.requests:
        out += ["--num-requests", str(args.num_requests)]
    return out


def _print(doc) -> None:
    from moonep_sim.report.serve import serve_table
    from moonep_sim.report.tables import wide_console

    c = wide_console()
    for ld in doc["loads"]:
        c.print(serve_table(doc, ld))
        c.print("verdict: " + ld["verdict"].get("text", ""), highlight=False, markup=False)
    t = doc["timing"]
    err = doc.get("steptime_model_error")
    c.print(f"step-time model: built in {t['steptime_build_s']:.1f} s ({t['steptime_build_cpu_s']:.1f} CPU s; cached "
            f"pools cost 0), median held-out error {'-' if err is None else f'{err:.1%}'}; serving "
            f"{t['serve_s']:.2f} s", highlight=False, markup=False)
    for f in doc["flags"]:
        c.print(f"flag {f['code']}: {f['text']}", highlight=False, markup=False)


def write_outputs(doc, args) -> dict[str, str]:
    """``--out DIR``: report.json, latency_cdf.png and pareto.png (unless --no-plots), report.html;
    assembled beside DIR and moved in whole."""
    from pathlib import Path

    from moonep_sim.io import staged_dir
    from moonep_sim.report.html import write_report
    from moonep_sim.report.serve import latency_cdf, pareto_plot

    out = Path(args.out)
    figs = {}
    with staged_dir(out, "--out") as tmp:
        if not args.no_plots:
            if doc.get("cdf"):
                figs["latency_cdf"] = latency_cdf(doc, tmp / "latency_cdf.png")
            if doc.get("points"):
                figs["pareto"] = pareto_plot(doc["points"], tmp / "pareto.png")
        files = write_report(doc, tmp, out, figs)
    return files
