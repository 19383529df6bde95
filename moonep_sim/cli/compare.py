"""``moonep-sim compare``: every strategy on one routing, simulated (and replayed for real)."""

from __future__ import annotations

import json
from pathlib import Path

from moonep_sim.cli.common import parse_int_list, print_json, to_jsonable
from moonep_sim.report.tables import wide_console as console
from moonep_sim.errors import require

DEFAULT_STRATEGIES = "alltoall,capacity,hierarchical,moonep"


def add_cluster_args(p, topology_default: str = "h800-cx7") -> None:
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated strategies (default {DEFAULT_STRATEGIES}; see `moonep-sim plan --list`)")
    p.add_argument("--opt", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                   help="a strategy option, e.g. capacity.capacity_factor=1.25 (repeatable)")
    p.add_argument("--topology", default=topology_default,
                   help=f"simulated cluster: a preset (`moonep-sim topologies`) or a TOML file (default {topology_default})")
    p.add_argument("--ranks", type=int, default=None, help="EP size R (default: --nproc with --real, else 8 or the "
                                                           "largest divisor of E up to 8)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the topology's, at most R)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"), help="dispatch row dtype (default bf16)")
    p.add_argument("--token-padding", type=int, default=1, help="pad each expert segment to a multiple of this")


def register(sub) -> None:
    p = sub.add_parser("compare", help="compare strategies on one trace: table, JSON report and plots",
                       description="Plan every strategy on the same layers, time each plan on a simulated "
                                   "cluster, optionally replay them for real over gloo, and report side by side.")
    p.add_argument("--trace", required=True,
                   help="trace file, or generated routing gen:model=kimi-k3,maxvio=10,tokens-per-rank=512[,layers=1,seed=0]")
    add_cluster_args(p)
    p.add_argument("--layers", default=None, help="layer ids to compare, e.g. 0,5-7 (default: all of the trace)")
    p.add_argument("--model", default=None, help="model preset for row and weight sizes (default: the trace's)")
    p.add_argument("--real", action="store_true", help="also replay every strategy over gloo with --nproc processes")
    p.add_argument("--nproc", type=int, default=4, help="processes for --real (default 4; EP size = nproc)")
    p.add_argument("--real-timeout", type=float, default=600.0, help="seconds allowed for the real replay")
    p.add_argument("--iters", type=int, default=10, help="timed iterations of the real replay (default 10), every "
                                                         "strategy in turn: matched samples for the rank test")
    p.add_argument("--out", default="moonep-sim-out/compare", help="directory for report.json and the PNG plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.set_defaults(func=run)


def default_ranks(num_experts: int, real: bool, nproc: int) -> int:
    if real:
        return nproc
    for r in (8, 4, 2, 1):
        if num_experts % r == 0:
            return r
    return 1


def build_config(args, source):
    """Check every input (before any work) and build the CompareConfig."""
    from moonep_sim.report.compare import CompareConfig, check_cluster, load_topology, parse_strategies

    strategies = parse_strategies(args.strategies, args.opt)
    require(args.token_padding >= 1, f"--token-padding ({args.token_padding}) must be >= 1")
    if args.real:
        require(2 <= args.nproc <= 64, f"--nproc ({args.nproc}) must lie in [2, 64]")
        require(args.iters >= 1, f"--iters ({args.iters}) must be >= 1")
        require(args.ranks in (None, args.nproc),
                f"--ranks ({args.ranks}) must equal --nproc ({args.nproc}) with --real: each process is one EP rank")
    ranks = args.ranks or default_ranks(source.num_experts, args.real, args.nproc)
    topo = load_topology(args.topology)
    g = args.gpus_per_node or min(topo.gpus_per_node, ranks)
    check_cluster(source, ranks, g)
    if args.real:
        load_topology("local-gloo")
    return CompareConfig(args.trace, strategies, args.topology, ranks, g, source.layer_ids, source.model.name,
                         args.dtype, args.token_padding, args.real, args.nproc, args.real_timeout,
                         real_iters=args.iters)


def write_outputs(report: dict, out_dir: Path, plots: bool = True) -> dict[str, str]:
    """report.json and the plots under ``out_dir``; returns {what: path}."""
    from moonep_sim.io import make_output_dir, write_text_atomic
    from moonep_sim.report import plots as P

    make_output_dir(out_dir, "--out")
    files: dict[str, str] = {}
    if plots:
        files["layer_time"] = str(P.layer_time_bars(report, out_dir / "layer_time.png"))
        files["rows_per_rank"] = str(P.rows_per_rank(report, out_dir / "rows_per_rank.png"))
        files["traffic"] = str(P.traffic_heatmaps(report, out_dir / "traffic.png"))
    report["files"] = dict(files, report=str(out_dir / "report.json"))
    write_text_atomic(out_dir / "report.json", json.dumps(to_jsonable(report), indent=1))
    files["report"] = str(out_dir / "report.json")
    return files


def progress_bar(c, description: str):
    """A rich progress bar and a callback ``(msg, done, total)`` that advances it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=c, transient=True)
    task = prog.add_task(description, total=None, what="")

    def cb(msg: str, done: int, total: int) -> None:
        prog.update(task, completed=done, total=total, what=msg)

    return prog, cb


def run(args) -> int:
    from moonep_sim.report.compare import compare, open_source
    from moonep_sim.report.tables import compare_footer, compare_table

    from moonep_sim.io import check_output_dir

    check_output_dir(args.out, "--out")  # before the run, not after it
    layers = parse_int_list(args.layers, "--layers")
    source = open_source(args.trace, layers, args.model)
    cfg = build_config(args, source)
    c = console()
    if args.json:
        rep = compare(cfg, source=source)
        write_outputs(rep, Path(args.out), plots=not args.no_plots)
        print_json(rep)
        return 0
    prog, cb = progress_bar(c, "compare")
    with prog:
        rep = compare(cfg, progress=cb, source=source)
    files = write_outputs(rep, Path(args.out), plots=not args.no_plots)
    for t in compare_table(rep):
        c.print(t)
    for line in compare_footer(rep):
        c.print(f"[dim]{line}[/dim]")
    c.print("wrote " + ", ".join(files.values()))
    return 0
