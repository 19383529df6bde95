"""``moonep-sim sweep``: layer time per strategy versus imbalance, EP size or a topology constant.

A thin adapter over :meth:`moonep_sim.experiments.Scenario.sweep`.
"""

from __future__ import annotations

import json
from pathlib import Path

from moonep_sim.cli.common import (output_rule, add_dispatch_dtype, add_strategies, check_cluster_args, check_int, parse_strategy_opts,
                                   print_json, progress, to_jsonable)
from moonep_sim.limits import MAX_TOKENS_PER_RANK
from moonep_sim.errors import ConfigError
from moonep_sim.experiments.routing import GEN_DEFAULTS
from moonep_sim.report.tables import wide_console as console


def register(sub) -> None:
    from moonep_sim.cli.compare import DEFAULT_STRATEGIES

    p = sub.add_parser("sweep", help="sweep maxvio, EP size or a topology constant; line plots + JSON",
                       description="Generate routing for a model preset (MoonEP's method: lognormal expert "
                                   "popularity, sigma bisected to hit each target maxvio), plan every strategy "
                                   "at every value, simulate, and plot layer time and its ratio to the lower bound.")
    p.add_argument("--model", required=True, help="model preset (`moonep-sim models`)")
    p.add_argument("--over", required=True,
                   help="maxvio | ep | a numeric topology constant (e.g. nic_bandwidth_GBps, fabric_oversubscription)")
    p.add_argument("--values", default=None,
                   help="comma-separated values (default: maxvio 0.2,1,10,20 where the model's E/K allows, else "
                        "filled with 5,2,0.5; ep 8,16,32,64 that divide E; required for a topology constant)")
    add_strategies(p, DEFAULT_STRATEGIES)
    p.add_argument("--topology", default="h800-cx7", help="simulated cluster preset or TOML file (default h800-cx7)")
    p.add_argument("--ranks", type=int, default=64, help="EP size when not sweeping it (default 64)")
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
    p.add_argument("--out", default="moonep-sim-out/sweep", help="directory for sweep.json and sweep.png")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--by", default=None, choices=BY_KNOBS,
                   help="a second knob (rows): sweep --over once per --by-values value and write a winner map "
                        "(winner.png, winner.json, winner.md: the fastest strategy per cell and its margin over "
                        "the runner-up)")
    p.add_argument("--by-values", default=None, help="comma-separated values of --by (required with --by)")
    add_parallel(p)
    p.set_defaults(func=run)


def add_parallel(p) -> None:
    """--jobs / --cluster: where independent points run (``moonep_sim.experiments.parallel``)."""
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes for independent points (default: the cores; 1 = serial)")
    p.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="run the points on a Dask scheduler (tcp://host:8786; pip install 'moonep-sim[cluster]')")


#: second knobs of a winner map: the SweepConfig field each one sets
BY_KNOBS = ("tokens-per-rank", "maxvio", "ep")


def _by_values(args) -> list[float]:
    if args.by is None:
        if args.by_values is not None:
            raise ConfigError("--by-values needs --by (the knob they are values of)")
        return []
    if args.by_values is None:
        raise ConfigError(f"--by-values must be given with --by ({args.by})")
    if args.by == args.over or (args.by == "ep" and args.over == "ep"):
        raise ConfigError(f"--by ({args.by}) must differ from --over ({args.over})")
    try:
        vals = [float(v) for v in args.by_values.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--by-values ({args.by_values!r}) must be comma-separated numbers") from None
    if not vals:
        raise ConfigError("--by-values must hold at least one value")
    if args.by in ("tokens-per-rank", "ep"):
        for v in vals:
            if v != int(v) or v < 1:
                raise ConfigError(f"--by-values ({v:g}) must be positive integers for --by {args.by}")
    return vals


def _by_config(cfg, knob: str, v: float):
    from dataclasses import replace

    if knob == "tokens-per-rank":
        return replace(cfg, tokens_per_rank=int(v))
    if knob == "maxvio":
        return replace(cfg, maxvio=float(v))
    return replace(cfg, ranks=int(v))


#: The files sweep writes into --out (a winner map: the winner.* ones): what the output rule checks.
OUT_FILES = ("sweep.json", "sweep.png", "report.html", "winner.png", "winner.md", "winner.json")


def run_winner_map(args, cfg, by_vals: list[float]) -> int:
    """One sweep per --by value, then the winner map of them all."""
    from moonep_sim.experiments.seeds import sweep_seeds
    from moonep_sim.experiments.sweep import check, sweep
    from moonep_sim.io import staged_dir, write_text_atomic
    from moonep_sim.experiments.winner import winner_map
    from moonep_sim.report.winner import winner_heatmap, winner_table_md

    cfgs = [_by_config(cfg, args.by, v) for v in by_vals]
    for c in cfgs:
        check(c)  # every input checked before any work
    con = console()
    reps = []
    for v, c in zip(by_vals, cfgs):
        with progress(con, f"sweep {args.by}={v:g}", lines=args.json) as cb:
            reps.append((v, sweep_seeds(c, args.seeds, lambda c: sweep(c, progress=cb, jobs=args.jobs,
                                                                        cluster=args.cluster))))
    m = winner_map(reps, args.by)
    m["sweeps"] = [r for _, r in reps]
    out = Path(args.out)
    png = out / "winner.png"
    md = winner_table_md(m)
    with staged_dir(out, "--out") as tmp:
        winner_heatmap(m, tmp / "winner.png")
        write_text_atomic(tmp / "winner.md", md + "\n")
        from moonep_sim.report.html import provenance, write_html

        m["provenance"] = provenance()
        m["files"] = {"plot": str(png), "report": str(out / "winner.json"), "table": str(out / "winner.md"),
                      "html": str(out / "report.html")}
        write_html({k: v for k, v in m.items() if k != "sweeps"}, tmp / "report.html", {"winner": tmp / "winner.png"})
        write_text_atomic(tmp / "winner.json", json.dumps(to_jsonable(m), indent=1))
    if args.json:
        print_json(m)
        return 0
    con.print(md)
    from moonep_sim.report.tables import flag_lines

    for line in flag_lines(m):
        con.print(f"[dim]{line}[/dim]")
    con.print(f"wrote {png}, {out / 'winner.json'}, {out / 'winner.md'}, {out / 'report.html'}")
    return 0


def _values(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--values ({text!r}) must be comma-separated numbers") from None


def scenario(args):
    from moonep_sim.experiments import GeneratorSpec, Scenario

    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    check_cluster_args(args)
    check_int(args.tokens_per_rank, "--tokens-per-rank", 1, MAX_TOKENS_PER_RANK)
    check_int(args.seeds, "--seeds", 1, 64)
    spec = GeneratorSpec(model=args.model, maxvio=args.maxvio, tokens_per_rank=args.tokens_per_rank, seed=args.seed)
    return Scenario(routing=spec, cluster=(args.ranks, args.gpus_per_node or 0), topology=args.topology,
                    strategies=names, options=parse_strategy_opts(args.opt, names), dispatch_dtype=args.dispatch_dtype)


def run(args) -> int:
    from moonep_sim.experiments.parallel import check_jobs
    from moonep_sim.experiments.sweep import check
    from moonep_sim.io import staged_dir, write_text_atomic
    from moonep_sim.report import plots
    from moonep_sim.report.tables import flag_lines, sweep_table

    output_rule(args, folders={"out": OUT_FILES})  # before the run, not after it
    sc = scenario(args)
    cfg = sc.sweep_config(args.over, _values(args.values))
    by_vals = _by_values(args)
    if by_vals:
        return run_winner_map(args, cfg, by_vals)
    check(cfg)  # every input checked before any work
    check_jobs(args.jobs)
    c = console()
    with progress(c, "sweep", lines=args.json) as cb:
        rep = sc.sweep(args.over, cfg.values, progress=cb, jobs=args.jobs, cluster=args.cluster,
                       seeds=args.seeds).to_dict()
    out = Path(args.out)
    png = out / "sweep.png"
    with staged_dir(out, "--out") as tmp:
        plots.sweep_lines(rep, tmp / "sweep.png")
        from moonep_sim.report.html import provenance, write_html

        rep["provenance"] = provenance()
        rep["files"] = {"plot": str(png), "report": str(out / "sweep.json"), "html": str(out / "report.html")}
        write_html(rep, tmp / "report.html", {"sweep": tmp / "sweep.png"})
        write_text_atomic(tmp / "sweep.json", json.dumps(to_jsonable(rep), indent=1))
    if args.json:
        print_json(rep)
        return 0
    c.print(sweep_table(rep))
    for line in flag_lines(rep):
        c.print(f"[dim]{line}[/dim]")
    tp = rep["topology"]
    c.print(f"[dim]simulated on {tp['name']}: {tp['constants'].get('description', '')}; "
            f"{rep['tokens_per_rank']} tokens per rank; took {rep['seconds']:.1f} s[/dim]")
    c.print(f"wrote {png}, {out / 'sweep.json'}, {out / 'report.html'}")
    return 0
