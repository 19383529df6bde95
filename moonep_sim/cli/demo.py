"""``moonep-sim demo``: the shipped Mixtral-8x7B trace through four strategies, for real over gloo
and simulated (this machine's local-gloo topology and an H800 cluster), side by side."""

from __future__ import annotations

import time
from pathlib import Path

from moonep_sim.report.tables import wide_console as console

DEMO_TRACE = "mixtral-8x7b_humaneval.safetensors"
DEMO_STRATEGIES = "alltoall,capacity,hierarchical,moonep"


def register(sub) -> None:
    p = sub.add_parser("demo", help="replay a shipped trace through four strategies, real (gloo) and simulated",
                       description="Replays the shipped Mixtral-8x7B HumanEval routing trace through the flat "
                                   "all-to-all, capacity, hierarchical and moonep strategies: for real over gloo "
                                   "with 4 local processes (2 emulated nodes of 2), simulated on this machine's "
                                   "calibrated local-gloo topology and on an H800 + CX7 cluster preset.")
    p.add_argument("--layers", default="0-3", help="trace layers to replay (default 0-3)")
    p.add_argument("--strategies", default=DEMO_STRATEGIES, help=f"default {DEMO_STRATEGIES}")
    p.add_argument("--nproc", type=int, default=4, help="gloo processes = EP ranks (default 4)")
    p.add_argument("--gpus-per-node", type=int, default=2, help="ranks per emulated node (default 2)")
    p.add_argument("--topology", default="h800-cx7", help="GPU-cluster preset for the simulated column (default h800-cx7)")
    p.add_argument("--out", default="moonep-sim-out/demo", help="directory for report.json and the plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-calibrate", action="store_true",
                   help="if no calibration file exists, use the shipped local-gloo defaults instead of a quick calibration")
    p.add_argument("--iters", type=int, default=10, help="timed iterations of the real replay (default 10)")
    p.add_argument("--fast", action="store_true", help="one layer, alltoall and moonep, 2 processes (a smoke test)")
    p.set_defaults(func=run)


def _trace_path() -> Path:
    """The shipped trace: the repository's ``traces/`` (source checkout), else the current directory's."""
    here = Path(__file__).resolve().parents[2] / "traces" / DEMO_TRACE
    return here if here.exists() else Path("traces") / DEMO_TRACE


def run(args) -> int:
    from moonep_sim.experiments.spec import parse_int_list
    from moonep_sim.progress import tracker
    from moonep_sim.cli.compare import write_outputs
    from moonep_sim.errors import require
    from moonep_sim.experiments import Scenario
    from moonep_sim.experiments import calibrate as cal
    from moonep_sim.report.tables import compare_footer, compare_table, resolved_line, verdict_lines

    from moonep_sim.cli.common import output_rule
    from moonep_sim.cli.compare import OUT_FILES

    output_rule(args, folders={"out": OUT_FILES})  # before the run, not after it
    t0 = time.perf_counter()
    c = console()
    require(2 <= args.nproc <= 64, f"--nproc ({args.nproc}) must lie in [2, 64]")  # as given, --fast or not
    require(args.iters >= 1, f"--iters ({args.iters}) must be >= 1")
    from moonep_sim.cli.common import check_int
    from moonep_sim.experiments.scenario import strategy_list
    strategy_list(args.strategies)  # an unknown strategy is refused even when --fast replaces the list
    check_int(args.gpus_per_node, "--gpus-per-node", 1, args.nproc, f"ranks per emulated node, at most --nproc ({args.nproc})")
    trace = _trace_path()
    require(trace.exists(), f"shipped trace ({trace}) must exist: run the demo from the repository root")
    if args.fast:  # the arguments as given are checked too (--layers 99 is wrong with --fast as well)
        Scenario(routing=str(trace), cluster=(args.nproc, args.gpus_per_node), topology=args.topology,
                 strategies=args.strategies, layers=parse_int_list(args.layers, "--layers")).resolved
        args.layers, args.strategies, args.nproc, args.gpus_per_node = "0", "alltoall,moonep", 2, 2
    sc = Scenario(routing=str(trace), cluster=(args.nproc, args.gpus_per_node), topology=args.topology,
                  strategies=args.strategies, layers=parse_int_list(args.layers, "--layers"))
    rs = sc.resolved  # everything checked before any work

    # the local topology: calibrated file, a quick calibration now, or the shipped defaults
    path = cal.calibrated_path()
    quality = cal.calibration_kind(path)
    if quality is not None:
        c.print(f"[dim]local-gloo: calibrated constants from {path} ({quality} calibration)[/dim]")
    elif args.no_calibrate or args.fast:
        quality = "none"
        c.print("[dim]local-gloo: no calibration file; using the shipped preset defaults "
                "(run `moonep-sim calibrate` to measure this machine)[/dim]")
    else:
        c.print(f"[dim]local-gloo: no calibration file at {path}; running a quick calibration "
                f"({args.nproc} processes) ...[/dim]")
        res = cal.calibrate((args.nproc,), cal.QUICK_SIZES_BYTES, cal.QUICK_SWIGLU_SHAPES, repeats=5,
                            target_nproc=args.nproc, kind="quick")
        quality = "quick"
        c.print(f"[dim]  measured in {res.seconds:.0f} s, wrote {res.path} (`moonep-sim calibrate` does a fuller job)[/dim]")

    names = [n for n, _ in rs.strategies]
    c.print(f"replaying {rs.source.label}, layers {args.layers}, through {', '.join(names)}: "
            f"gloo with {args.nproc} processes ({rs.cluster.num_nodes} emulated node(s) of {rs.cluster.gpus_per_node}), "
            f"and simulated on local-gloo and {args.topology}")
    with tracker("demo") as cb:
        rep = sc.compare(real=True, nproc=args.nproc, iters=args.iters, timeout_s=300.0, progress=cb).to_dict()
    files = write_outputs(rep, Path(args.out), plots=not args.no_plots)
    for t in compare_table(rep):
        c.print(t)
    for line in compare_footer(rep):
        c.print(f"[dim]{line}[/dim]")
    for line in [resolved_line(rep), *verdict_lines(rep)]:
        if line:
            c.print(line, highlight=False, markup=False)
    if quality in ("quick", "none"):
        c.print(f"[yellow]warning: the simulated local-gloo column uses {'a quick calibration' if quality == 'quick' else 'uncalibrated preset defaults'} "
                "of this machine; run `moonep-sim calibrate` (about 15 s) for the constants behind "
                "docs/results/fidelity.md[/yellow]")
    c.print(f"plots: {files['layer_time']}, {files['rows_per_rank']}, {files['traffic']}")
    c.print(f"report: {files['report']}, {files['html']}   (demo took {time.perf_counter() - t0:.0f} s)")
    bad = [n for n, r in rep["real"]["strategies"].items() if r.get("correct") is False]
    if bad:
        c.print(f"[red]gloo replay results differ from the dense reference for: {', '.join(bad)}[/red]")
        return 1
    return 0
