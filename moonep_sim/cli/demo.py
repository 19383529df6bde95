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
    from moonep_sim.cli.common import parse_int_list
    from moonep_sim.cli.compare import progress_bar, write_outputs
    from moonep_sim.errors import require
    from moonep_sim.report import calibrate as cal
    from moonep_sim.report.compare import (CompareConfig, check_cluster, compare, load_topology, open_source,
                                           parse_strategies)
    from moonep_sim.report.tables import compare_footer, compare_table

    from moonep_sim.io import check_output_dir

    check_output_dir(args.out, "--out")  # before the run, not after it
    t0 = time.perf_counter()
    c = console()
    if args.fast:
        args.layers, args.strategies, args.nproc, args.gpus_per_node = "0", "alltoall,moonep", 2, 2
    trace = _trace_path()
    require(trace.exists(), f"shipped trace ({trace}) must exist: run the demo from the repository root")
    source = open_source(str(trace), parse_int_list(args.layers, "--layers"))
    strategies = parse_strategies(args.strategies)
    require(2 <= args.nproc <= 64, f"--nproc ({args.nproc}) must lie in [2, 64]")
    require(args.iters >= 1, f"--iters ({args.iters}) must be >= 1")
    cluster = check_cluster(source, args.nproc, args.gpus_per_node)
    load_topology(args.topology, cluster)

    # the local topology: calibrated file, a quick calibration now, or the shipped defaults
    path = cal.calibrated_path()
    if path.is_file():
        c.print(f"[dim]local-gloo: calibrated constants from {path}[/dim]")
    elif args.no_calibrate or args.fast:
        c.print("[dim]local-gloo: no calibration file; using the shipped preset defaults "
                "(run `moonep-sim calibrate` to measure this machine)[/dim]")
    else:
        c.print(f"[dim]local-gloo: no calibration file at {path}; running a quick calibration "
                f"({args.nproc} processes) ...[/dim]")
        res = cal.calibrate((args.nproc,), cal.QUICK_SIZES_BYTES, cal.QUICK_SWIGLU_SHAPES, repeats=5,
                            target_nproc=args.nproc)
        c.print(f"[dim]  measured in {res.seconds:.0f} s, wrote {res.path} (`moonep-sim calibrate` does a fuller job)[/dim]")

    cfg = CompareConfig(str(trace), strategies, args.topology, args.nproc, args.gpus_per_node, source.layer_ids,
                        source.model.name, real=True, nproc=args.nproc, real_timeout_s=300.0, real_iters=args.iters)
    c.print(f"replaying {source.label}, layers {args.layers}, through {', '.join(n for n, _ in strategies)}: "
            f"gloo with {args.nproc} processes ({cluster.num_nodes} emulated node(s) of {cluster.gpus_per_node}), "
            f"and simulated on local-gloo and {args.topology}")
    prog, cb = progress_bar(c, "demo")
    with prog:
        rep = compare(cfg, progress=cb, source=source)
    files = write_outputs(rep, Path(args.out))
    for t in compare_table(rep):
        c.print(t)
    for line in compare_footer(rep):
        c.print(f"[dim]{line}[/dim]")
    c.print(f"plots: {files['layer_time']}, {files['rows_per_rank']}, {files['traffic']}")
    c.print(f"report: {files['report']}   (demo took {time.perf_counter() - t0:.0f} s)")
    bad = [n for n, r in rep["real"]["strategies"].items() if r.get("correct") is False]
    if bad:
        c.print(f"[red]gloo replay results differ from the dense reference for: {', '.join(bad)}[/red]")
        return 1
    return 0
