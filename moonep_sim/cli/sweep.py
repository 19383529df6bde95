"""``moonep-sim sweep``: layer time per strategy versus imbalance, EP size or a topology constant.

A thin adapter over :meth:`moonep_sim.experiments.Scenario.sweep`.
"""

from __future__ import annotations

from pathlib import Path

from moonep_sim.cli.common import (output_rule, add_dispatch_dtype, add_output_flags, emit_json, add_steps,
                                   add_strategies, check_cluster_args, check_int)
from moonep_sim.limits import MAX_TOKENS_PER_RANK
from moonep_sim.errors import ConfigError
from moonep_sim.progress import tracker
from moonep_sim.experiments.routing import GEN_DEFAULTS
from moonep_sim.report.tables import wide_console as console


def register(sub) -> None:
    from moonep_sim.experiments.scenario import DEFAULT_STRATEGIES

    p = sub.add_parser("sweep", help="sweep maxvio, EP size or a topology constant (generated or a trace); line plots + JSON",
                       description="Plan every strategy at every value of one knob, simulate, and plot layer time "
                                   "and its ratio to the lower bound. With --model: generated routing (MoonEP's "
                                   "method: lognormal expert popularity, sigma bisected to hit each target maxvio). "
                                   "With --trace: the recorded routing, each step its own batch (docs/experiments.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model preset for generated routing (`moonep-sim models`)")
    src.add_argument("--trace", help="a trace file: sweep over the recorded routing (--over a topology constant, "
                                     "ranks, gpus_per_node, tokens_per_rank or maxvio, re-weighted)")
    p.add_argument("--over", required=True,
                   help="maxvio | ep (= ranks) | a numeric topology constant (e.g. nic_bandwidth_GBps, "
                        "fabric_oversubscription); with --trace also gpus_per_node and tokens_per_rank")
    p.add_argument("--values", default=None,
                   help="comma-separated values (default: derived from what is valid for the size, those left out "
                        "named: maxvio 0.2,1,10,20 above the sampling-noise floor and within E/K; ep 8,16,32,64 "
                        "that divide E; a topology constant: required for --model, 0.25x-4x the preset's for "
                        "--trace)")
    add_steps(p)
    p.add_argument("--layers", default=None, help="with --trace: layer ids, e.g. 0,5-7 (default: all)")
    add_strategies(p, ",".join(DEFAULT_STRATEGIES))   # as compare's (cli.compare imports this module)
    p.add_argument("--topology", default="h800-cx7", help="simulated cluster preset or TOML file (default h800-cx7)")
    p.add_argument("--ranks", type=int, default=None, help="EP size when not sweeping it (default 64; with --trace 8 "
                                                           "or the largest divisor of E up to 8)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the topology's)")
    p.add_argument("--tokens-per-rank", type=int, default=GEN_DEFAULTS["tokens_per_rank"],
                   help=f"tokens on each rank (default {GEN_DEFAULTS['tokens_per_rank']}, as for every generated routing)")
    p.add_argument("--maxvio", type=float, default=GEN_DEFAULTS["maxvio"],
                   help=f"imbalance when not sweeping it (default {GEN_DEFAULTS['maxvio']:g})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="run every point at this many seeds (from --seed); ties and confidence then rest on the "
                        "spread over seeds, and winner-map cells use the mean time (default 1)")
    add_dispatch_dtype(p)
    add_output_flags(p, out_default="moonep-sim-out/sweep", out_help="the report folder: sweep.json (winner.json "
                                                                   "with --by), the PNG plots and report.html",
                     json_help="the JSON report")
    p.add_argument("--by", default=None, metavar="KNOB",
                   help="a second knob (rows): sweep --over once per --by-values value and write a winner map "
                        "(winner.png, winner.json, winner.md: the fastest strategy per cell and its margin over "
                        "the runner-up): tokens-per-rank, maxvio or ep; with --trace any --over knob")
    p.add_argument("--by-values", default=None, help="comma-separated values of --by (required with --by)")
    add_parallel(p)
    from moonep_sim.cli.step import add_step_options
    add_step_options(p, level=True, tokens=False)
    p.set_defaults(func=run)


def _cluster_address(text: str) -> str:
    """--cluster checked as it is parsed: before any work, before Dask sees it."""
    import argparse

    from moonep_sim.experiments.checks import check_cluster_address
    try:
        return check_cluster_address(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parallel(p) -> None:
    """--jobs / --cluster: where independent points run (``moonep_sim.experiments.parallel``)."""
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes for independent points (default: the cores; 1 = serial)")
    p.add_argument("--cluster", default=None, metavar="ADDRESS", type=_cluster_address,
                   help="run the points on a Dask scheduler (tcp://host:8786; pip install 'moonep-sim[cluster]')")


def _by_values(args) -> list[float]:
    from moonep_sim.experiments.checks import check_axis_values
    from moonep_sim.experiments.sweep import BY_KNOBS

    if args.by is None:
        if args.by_values is not None:
            raise ConfigError("--by-values needs --by (the knob they are values of)")
        return []
    if args.by_values is None:
        raise ConfigError(f"--by-values must be given with --by ({args.by})")
    if args.by == args.over:
        raise ConfigError(f"--by ({args.by}) must differ from --over ({args.over})")
    if args.model is not None and args.by not in BY_KNOBS:
        raise ConfigError(f"--by ({args.by!r}) must be one of {', '.join(BY_KNOBS)} for generated routing")
    vals = _values(args.by_values, "--by-values")
    check_axis_values(args.by, vals, flag="--by-values")  # the same check as the flag it stands for
    return vals


#: The files sweep writes into --out (a winner map: the winner.* ones): what the output rule checks.
OUT_FILES = ("sweep.json", "sweep.png", "report.html", "winner.png", "winner.md", "winner.json")


def write_winner(args, m: dict, con) -> int:
    """winner.json, winner.md (and winner.png unless --no-plots) under --out; the table or JSON."""
    from moonep_sim.io import dumps_strict, staged_dir, write_text_atomic
    from moonep_sim.report.winner import winner_heatmap, winner_table_md

    out = Path(args.out)
    png = out / "winner.png"
    md = winner_table_md(m)
    title = None
    if m.get("level") == "step":   # say what a cell's time is: a whole step, OOM strategies ranked last
        st = m.get("step") or {}
        title = (f"fastest strategy per cell, whole {st.get('mode')} step (overlap {st.get('overlap')}; OOM ranks "
                 f"last) -- {m.get('model')}, {m.get('topology')}")
        md = f"{title}\n\n{md}"
    with staged_dir(out, "--out") as tmp:
        if not args.no_plots:
            winner_heatmap(m, tmp / "winner.png", title=title)
        write_text_atomic(tmp / "winner.md", md + "\n")
        from moonep_sim.report.html import provenance, write_html

        m["provenance"] = provenance()
        m["files"] = {"plot": str(png) if not args.no_plots else None, "report": str(out / "winner.json"),
                      "table": str(out / "winner.md"), "html": str(out / "report.html")}
        write_html({k: v for k, v in m.items() if k != "sweeps"}, tmp / "report.html",
                   {"winner": tmp / "winner.png"} if not args.no_plots else {})
        write_text_atomic(tmp / "winner.json", dumps_strict(m, indent=1))
    if emit_json(args, m):
        return 0
    con.print(md)
    from moonep_sim.report.tables import flag_lines

    for line in flag_lines(m):
        con.print(f"[dim]{line}[/dim]")
    con.print("wrote " + ", ".join(str(f) for f in m["files"].values() if f))
    return 0


def _values(text: str | None, flag: str = "--values") -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} ({text!r}) must be comma-separated numbers") from None


def scenario(args):
    from moonep_sim.experiments import GeneratorSpec, Scenario
    from moonep_sim.experiments.spec import parse_int_list, parse_opt_items, split_names

    names = split_names(args.strategies)
    check_cluster_args(args)
    opts = parse_opt_items(args.opt, names)
    if args.trace is not None:
        if args.seeds != 1:
            raise ConfigError(f"--seeds ({args.seeds}) applies to generated routing: a trace's verdicts rest on the "
                              "spread over its steps")
        sc = Scenario(routing=args.trace, cluster=(args.ranks or 0, args.gpus_per_node or 0), topology=args.topology,
                      strategies=names, options=opts, layers=parse_int_list(args.layers, "--layers"),
                      steps=args.steps, dispatch_dtype=args.dispatch_dtype)
        sc.resolved  # noqa: B018 -- check everything now
        return sc
    if args.steps is not None or args.layers is not None:
        raise ConfigError("--steps and --layers select from a trace: give --trace (generated routing has none)")
    check_int(args.tokens_per_rank, "--tokens-per-rank", 1, MAX_TOKENS_PER_RANK)
    check_int(args.seeds, "--seeds", 1, 64)
    spec = GeneratorSpec(model=args.model, maxvio=args.maxvio, tokens_per_rank=args.tokens_per_rank, seed=args.seed)
    return Scenario(routing=spec, cluster=(args.ranks or 64, args.gpus_per_node or 0), topology=args.topology,
                    strategies=names, options=opts, dispatch_dtype=args.dispatch_dtype)


def run(args) -> int:
    from moonep_sim.experiments.parallel import check_jobs

    from moonep_sim.cli.step import step_level

    output_rule(args, files=("json",), folders={"out": OUT_FILES})  # before the run, not after it
    level = step_level(args, layer_only={"--layers": args.layers is not None, "--seeds": args.seeds != 1},
                       tokens=False)
    sc = scenario(args)
    check_jobs(args.jobs)
    if level:
        return run_step_level(args, sc)
    return run_points(args, sc, _values(args.values), _by_values(args), "sweep", seeds=args.seeds)


def run_step_level(args, sc) -> int:
    """--level step: a sweep (or, with --by, a winner map) whose every point is a whole step per
    strategy (:mod:`moonep_sim.experiments.step_levels`), on generated routing or a trace."""
    from moonep_sim.cli.step import step_options
    from moonep_sim.experiments.step_levels import check

    opts = step_options(args, tokens=False)
    vals = _values(args.values)
    by_vals = _by_values(args) or None
    check(sc, args.over, vals, opts, by=args.by if by_vals else None, by_values=by_vals)  # before any work
    if getattr(opts, "parallel", None) is None:  # --optimizer-shard against every EP size the sweep runs
        from moonep_sim.cli.checks import check_step_ranks

        ranks = list(vals) if args.over in ("ranks", "ep") else []
        if by_vals and args.by in ("ranks", "ep"):
            ranks += list(by_vals)
        for r in ranks or [sc.resolved.cluster.ranks]:
            check_step_ranks(args, int(r))
    return run_points(args, sc, vals, by_vals, "step sweep", level="step", step=opts)


def run_points(args, sc, vals, by_vals, label: str, **kw) -> int:
    """``Scenario.sweep`` over --values (or, with --by, ``Scenario.winner_map``) with ``kw``, on
    generated routing or a trace (then its warnings); then the files and the table (or JSON)."""
    from moonep_sim.cli.common import print_warnings

    c = console()
    with tracker(label) as cb:
        if by_vals:
            doc = sc.winner_map(args.over, vals, args.by, by_vals, progress=cb, jobs=args.jobs, cluster=args.cluster,
                                **kw)
        else:
            doc = sc.sweep(args.over, vals, progress=cb, jobs=args.jobs, cluster=args.cluster, **kw).to_dict()
    if sc.is_trace():
        print_warnings(sc.resolved.warnings)
    return write_winner(args, doc, c) if by_vals else write_sweep(args, doc, c)


def write_sweep(args, rep: dict, c) -> int:
    """sweep.json, report.html (and sweep.png unless --no-plots) under --out; the table or JSON."""
    from moonep_sim.io import dumps_strict, staged_dir, write_text_atomic
    from moonep_sim.report import plots
    from moonep_sim.report.tables import flag_lines, sweep_table

    out = Path(args.out)
    png = out / "sweep.png"
    step = rep.get("level") == "step"
    with staged_dir(out, "--out") as tmp:
        if not args.no_plots:
            if step:
                from moonep_sim.report.step_sweep import step_sweep_lines

                step_sweep_lines(rep, tmp / "sweep.png")
            else:
                plots.sweep_lines(rep, tmp / "sweep.png")
        from moonep_sim.report.html import provenance, write_html

        rep["provenance"] = provenance()
        rep["files"] = {"plot": str(png) if not args.no_plots else None, "report": str(out / "sweep.json"),
                        "html": str(out / "report.html")}
        write_html(rep, tmp / "report.html", {"sweep": tmp / "sweep.png"} if not args.no_plots else {})
        write_text_atomic(tmp / "sweep.json", dumps_strict(rep, indent=1))
    if emit_json(args, rep):
        return 0
    if step:
        from moonep_sim.report.step_sweep import step_sweep_footer, step_sweep_table

        c.print(step_sweep_table(rep))
        for line in step_sweep_footer(rep):
            c.print(f"[dim]{line}[/dim]")
    else:
        c.print(sweep_table(rep))
    for line in flag_lines(rep):
        c.print(f"[dim]{line}[/dim]")
    for lo in rep.get("left_out") or []:
        c.print(f"[dim]left out {rep['over']}={lo['value']:g}: {lo['reason']}[/dim]")
    tp = rep["topology"]
    how = (f"{rep['tokens_per_rank']} tokens per rank" if rep.get("tokens_per_rank") else
           f"trace {rep.get('trace')}: {rep.get('method')}")
    c.print(f"[dim]simulated on {tp['name']}: {tp['constants'].get('description', '')}; {how}; "
            f"took {rep['seconds']:.1f} s[/dim]")
    c.print("wrote " + ", ".join(str(f) for f in rep["files"].values() if f))
    return 0
