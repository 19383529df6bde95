"""``moonep-sim compare``: every strategy on one routing, simulated (and replayed for real).

A thin adapter over :meth:`moonep_sim.experiments.Scenario.compare`; the tables and plots come from
:mod:`moonep_sim.report`.
"""

from __future__ import annotations

import math
from pathlib import Path

from moonep_sim.cli.common import (add_output_flags, add_steps, check_cluster_args, add_dispatch_dtype, add_layers, add_strategies,
                                   add_redundant_experts, emit_json, output_rule, print_warnings,
                                   steps_footer)
from moonep_sim.errors import require
from moonep_sim.progress import tracker
from moonep_sim.experiments.scenario import DEFAULT_STRATEGIES as _DEFAULTS
from moonep_sim.report.tables import wide_console as console

DEFAULT_STRATEGIES = ",".join(_DEFAULTS)
#: the longest --real-timeout (a week)
MAX_TIMEOUT_S = 7 * 86400.0


def add_cluster_args(p, topology_default: str = "h800-cx7", multi: bool = False) -> None:
    add_strategies(p, DEFAULT_STRATEGIES)
    p.add_argument("--topology", default=topology_default,
                   help=f"simulated cluster: a preset (`moonep-sim topologies`) or a TOML file (default {topology_default})"
                        + ("; compare: a comma list runs the same compare on each cluster, one table" if multi else ""))
    p.add_argument("--ranks", type=int, default=None, help="EP size R (default: --nproc with --real, else 8 or the "
                                                           "largest divisor of E up to 8)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the topology's, at most R)")
    add_dispatch_dtype(p)
    add_redundant_experts(p)
    p.add_argument("--token-padding", type=int, default=1, help="pad each expert segment to a multiple of this")


def register(sub) -> None:
    p = sub.add_parser("compare", help="compare strategies on one trace: table, JSON report and plots",
                       description="Plan every strategy on the same layers, time each plan on a simulated "
                                   "cluster, optionally replay them for real over gloo, and report side by side.")
    p.add_argument("--trace", required=True,
                   help="trace file, or generated routing gen:model=kimi-k3,maxvio=10,tokens-per-rank=512[,layers=1,seed=0]")
    add_cluster_args(p, multi=True)
    add_steps(p)
    add_layers(p)
    p.add_argument("--model", default=None, help="model preset for row and weight sizes (default: the trace's)")
    p.add_argument("--real", action="store_true", help="also replay every strategy over gloo with --nproc processes")
    p.add_argument("--nproc", type=int, default=4, help="processes for --real (default 4; EP size = nproc)")
    p.add_argument("--real-timeout", type=float, default=600.0, help="seconds allowed for the real replay")
    p.add_argument("--iters", type=int, default=10, help="timed iterations of the real replay (default 10), every "
                                                         "strategy in turn: matched samples for the rank test")
    add_output_flags(p, out_default="moonep-sim-out/compare", out_help="the report folder: report.json, the PNG "
                                                                       "plots and report.html", json_help="the JSON report")
    from moonep_sim.cli.sweep import add_parallel
    add_parallel(p)
    from moonep_sim.cli.step import add_step_options
    add_step_options(p, level=True)
    p.set_defaults(func=run)


def scenario(args, routing=None, layers=None):
    """The Scenario these arguments describe; checked (one line on bad input) before any work."""
    from moonep_sim.experiments import Scenario
    from moonep_sim.experiments.spec import parse_int_list, parse_opt_items, split_names

    names = split_names(args.strategies)
    check_cluster_args(args)
    if args.real:
        require(2 <= args.nproc <= 64, f"--nproc ({args.nproc}) must lie in [2, 64]")
        require(args.iters >= 1, f"--iters ({args.iters}) must be >= 1")
        require(args.ranks in (None, args.nproc),
                f"--ranks ({args.ranks}) must equal --nproc ({args.nproc}) with --real: each process is one EP rank")
    sc = Scenario(routing=routing or args.trace, model=getattr(args, "model", None),
                  cluster=((args.nproc if args.real else args.ranks) or 0, args.gpus_per_node or 0),
                  topology=args.topology, strategies=names, options=parse_opt_items(args.opt, names),
                  layers=layers if layers is not None else parse_int_list(getattr(args, "layers", None), "--layers"),
                  steps=getattr(args, "steps", None),
                  dispatch_dtype=args.dispatch_dtype, token_padding=args.token_padding,
                  redundant_experts=getattr(args, "redundant_experts", 0))
    sc.resolved  # noqa: B018 -- check everything now (a real replay's local-gloo: Scenario.compare, before any work)
    return sc


#: The files compare (and demo) write into --out: what the output rule checks against the inputs.
OUT_FILES = ("report.json", "report.html", "layer_time.png", "rows_per_rank.png", "traffic.png", "step_time.png")


def write_outputs(report: dict, out_dir: Path, plots: bool = True) -> dict[str, str]:
    """report.json and the plots under ``out_dir``, assembled beside it and moved in when all are
    written (a failure leaves none of them); returns {what: path}."""
    from moonep_sim.io import dumps_strict, staged_dir, write_text_atomic
    from moonep_sim.report import plots as P

    files: dict[str, str] = {}
    with staged_dir(out_dir, "--out") as tmp:
        figs = {}
        if plots:
            for key, draw in (("layer_time", P.layer_time_bars), ("rows_per_rank", P.rows_per_rank),
                              ("traffic", P.traffic_heatmaps)):
                figs[key] = draw(report, tmp / f"{key}.png")
                files[key] = str(out_dir / f"{key}.png")
        from moonep_sim.report.html import provenance, write_html

        report.setdefault("provenance", provenance())
        report["files"] = dict(files, report=str(out_dir / "report.json"), html=str(out_dir / "report.html"))
        write_html(report, tmp / "report.html", figs)
        write_text_atomic(tmp / "report.json", dumps_strict(report, indent=1))
    files["html"] = str(out_dir / "report.html")
    files["report"] = str(out_dir / "report.json")
    return files


def run(args) -> int:
    from moonep_sim.report.tables import compare_footer, compare_table, verdict_lines

    from moonep_sim.cli.step import step_level

    from moonep_sim.cli.clusters import is_multi, run_clusters

    if is_multi(args):
        return run_clusters(args, scenario)
    output_rule(args, files=("json",), folders={"out": OUT_FILES})  # before the run ('-': stdout)
    require(math.isfinite(args.real_timeout) and 0 < args.real_timeout <= MAX_TIMEOUT_S,
            f"--real-timeout ({args.real_timeout:g}) must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    level = step_level(args, layer_only={"--real": args.real, "--layers": args.layers is not None})
    from moonep_sim.cli.checks import check_gen_model

    check_gen_model(args.trace if args.trace.startswith("gen:") else None, args.model)
    sc = scenario(args)
    c = console()
    from moonep_sim.experiments.parallel import check_jobs

    check_jobs(args.jobs)
    if level:
        return run_step_level(args, sc)
    kw = dict(real=args.real, nproc=args.nproc if args.real else None, iters=args.iters, timeout_s=args.real_timeout,
              jobs=args.jobs, cluster=args.cluster)
    with tracker("compare") as cb:
        rep = sc.compare(progress=cb, **kw).to_dict()
    files = write_outputs(rep, Path(args.out), plots=not args.no_plots)
    print_warnings(rep.get("warnings"))
    if emit_json(args, rep, stdout_indent=2):
        return 0
    for t in compare_table(rep):
        c.print(t)
    for line in verdict_lines(rep):
        c.print(line, highlight=False, markup=False)
    for line in compare_footer(rep) + steps_footer(rep):
        c.print(f"[dim]{line}[/dim]")
    c.print("wrote " + ", ".join(files.values()))
    return 0


def run_step_level(args, sc) -> int:
    """--level step: every strategy's whole step (``Scenario.compare(level="step")``, what
    `moonep-sim step` runs); report.json (the step document), report.html and step_time.png."""
    from moonep_sim.cli.step import print_steps, step_options
    from moonep_sim.report.save import save_report

    from moonep_sim.experiments.step import steps_document

    from moonep_sim.cli.checks import check_step_ranks

    opts = step_options(args)
    if opts.parallel is None:
        check_step_ranks(args, sc.resolved.cluster.ranks)  # before any work
    with tracker("compare --level step") as cb:
        res = sc.compare(level="step", step=opts, jobs=args.jobs, cluster=args.cluster, progress=cb)
    doc = steps_document(res if isinstance(res, list) else [res])
    files = save_report(doc, Path(args.out), plots=not args.no_plots)
    print_warnings(sc.resolved.warnings)
    if emit_json(args, doc, stdout_indent=2):
        return 0
    print_steps(doc)
    console().print("wrote " + ", ".join(files.values()))
    return 0
