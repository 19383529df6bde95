"""``moonep-sim calibrate``: measure this machine and write the ``local-gloo`` topology file."""

from __future__ import annotations

import re
import statistics

from moonep_sim.cli.common import console, print_json
from moonep_sim.experiments.spec import parse_int_list
from moonep_sim.errors import ConfigError

_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
           "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


#: the largest all-to-all message per peer a calibration sends
MAX_SIZE_BYTES = 1 << 30


def parse_sizes(text: str | None) -> list[int] | None:
    """``"4K,64K,1M"`` -> bytes (binary suffixes K, M, G)."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", part)
        if not m or m.group(2).lower() not in _SUFFIX:
            raise ConfigError(f"--sizes entry ({part!r}) must be a byte count like 4096, 64K or 2M")
        n = int(float(m.group(1)) * _SUFFIX[m.group(2).lower()])
        if not 1 <= n <= MAX_SIZE_BYTES:
            raise ConfigError(f"--sizes entry ({part!r}) must be a byte count in [1, 1G]: a message per peer")
        out.append(n)
    if not out:
        raise ConfigError(f"--sizes ({text!r}) must name at least one size, like 4K,64K,2M (leave it out for the "
                          "default sizes)")
    return out


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure gloo all-to-all and CPU SwiGLU here; write the local-gloo topology")
    p.add_argument("--nproc", default="2,4", help="process counts to measure (default 2,4)")
    p.add_argument("--sizes", default=None,
                   help="all-to-all message sizes per peer, e.g. 4K,64K,512K,4M (default; --quick: 4K,256K,2M)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per point; the median is kept (default 9, --quick 5)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 10 s)")
    p.add_argument("-o", "--out", default=None,
                   help="topology TOML to write (default: $MOONEP_SIM_HOME/local-gloo.toml, "
                        "~/.cache/moonep-sim/local-gloo.toml)")
    p.add_argument("--target-nproc", type=int, default=None,
                   help="process count the written constants are for (default: the largest --nproc)")
    p.add_argument("--dry-run", action="store_true", help="measure and fit, write nothing")
    p.add_argument("--json", action="store_true", help="print measurements and fit as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from moonep_sim.experiments import calibrate as cal

    if not args.dry_run:
        from pathlib import Path

        from moonep_sim.cli.common import output_rule
        from moonep_sim.experiments.calibrate import calibrated_path
        dest = Path(args.out) if args.out else calibrated_path()
        also = {"-o": str(dest), "the measurements file": str(dest.with_suffix(".measurements.json"))}
        if not args.out and not dest.parent.exists():
            also = {}  # a fresh machine: the calibration folder is created when the results are written
        output_rule(args, also=also, out_flag="-o")  # before measuring, not after
    from moonep_sim.cli.common import check_int
    check_int(args.repeats, "--repeats", 1, 1000, "repeats per point (the median is kept)")
    check_int(args.target_nproc, "--target-nproc", 2, 64, "the process count the constants are for")
    nprocs = parse_int_list(args.nproc, "--nproc") or []
    sizes = parse_sizes(args.sizes) or list(cal.QUICK_SIZES_BYTES if args.quick else cal.DEFAULT_SIZES_BYTES)
    shapes = cal.QUICK_SWIGLU_SHAPES if args.quick else cal.DEFAULT_SWIGLU_SHAPES
    repeats = args.repeats or (5 if args.quick else 9)
    c = console()
    log = None if args.json else (lambda msg: c.print(f"[dim]{msg}[/dim]"))
    res = cal.calibrate(nprocs, sizes, shapes, repeats=repeats, out=args.out, write=not args.dry_run, progress=log,
                        target_nproc=args.target_nproc)
    if args.json:
        print_json({"fit": res.fit.to_dict(), "measurements": res.measurements,
                    "topology": res.topology.constants() if res.topology is not None else None,
                    "path": str(res.path) if res.path else None, "seconds": res.seconds})
        return 0
    print_report(res, c)
    return 0


def print_report(res, c=None) -> None:
    from rich.table import Table

    c = c or console()
    f = res.fit
    t = Table(title="gloo all_to_all_single (median of repeats, slowest rank)")
    for col in ("processes", "bytes per peer", "median ms", "min ms", "GB/s per process", "fitted ms"):
        t.add_column(col, justify="right")
    for r in res.measurements["alltoall"]:
        P, m = r["nproc"], r["bytes_per_peer"]
        med = statistics.median(r["seconds"])
        fitted = f.latency_us_P[P] * 1e-6 + (P - 1) * m / (f.proc_gbps_P[P] * 1e9)
        t.add_row(str(P), f"{m:,}", f"{med * 1e3:.3f}", f"{min(r['seconds']) * 1e3:.3f}",
                  f"{(P - 1) * m / med / 1e9:.3f}", f"{fitted * 1e3:.3f}")
    c.print(t)
    t = Table(title="expert SwiGLU, float32, all processes at once (median, slowest rank)")
    for col in ("processes", "rows x hidden x ffn", "median ms", "GFLOP/s per process"):
        t.add_column(col, justify="right")
    for r in res.measurements["swiglu"]:
        med = statistics.median(r["seconds"])
        t.add_row(str(r["nproc"]), f"{r['rows']}x{r['hidden']}x{r['ffn']}", f"{med * 1e3:.3f}",
                  f"{r['flops'] / med / 1e9:.1f}")
    c.print(t)
    t = Table(title="fitted local-gloo constants")
    t.add_column("constant")
    t.add_column("value", justify="right")
    t.add_column("model")
    t.add_row("latency", f"{f.latency_base_us:.1f} us + {f.latency_per_peer_us:.1f} us x (P-1)",
              "per all-to-all, P processes")
    t.add_row("port bandwidth", f"{f.port_gbps:.3f} GB/s", "per process, alone")
    t.add_row("aggregate bandwidth", f"{f.aggregate_gbps:.3f} GB/s", "host-wide; per process min(port, aggregate/P)")
    for P in sorted(f.proc_gbps_P):
        t.add_row(f"  fitted at P={P}", f"{f.latency_us_P[P]:.1f} us, {f.proc_gbps_P[P]:.3f} GB/s", "latency, per-process bandwidth")
    t.add_row("compute", f"{f.compute_flops_per_s / 1e9:.1f} GFLOP/s",
              f"per process with {max(f.flops_per_s_P)} processes sharing {f.cpu_cores} cores")
    t.add_row("compute alone", f"{f.compute_flops_per_s_alone / 1e9:.1f} GFLOP/s", f"with {min(f.flops_per_s_P)} processes")
    t.add_row("launch", f"{f.launch_us:.1f} us", "fixed cost per expert GEMM chain")
    for P in sorted(f.mem_gbps_P):
        t.add_row(f"memory copy at P={P}", f"{f.mem_gbps_P[P]:.2f} GB/s", "per process, 32 MiB float32 copy")
    c.print(t)
    if res.topology is not None:
        tp = res.topology
        c.print(f"local-gloo constants written: port {tp.nvlink_bandwidth_GBps:.4f} GB/s per process, "
                f"latency {tp.nvlink_latency_us:.1f} us, compute {tp.gpu_tflops * 1e3:.2f} GFLOP/s, "
                f"memory {tp.gpu_mem_bandwidth_GBps:.2f} GB/s, launch {tp.gpu_launch_us:.1f} us "
                f"({tp.description})")
    where = f"wrote {res.path}" if res.path else "nothing written (--dry-run)"
    c.print(f"calibration took {res.seconds:.1f} s; {where}")
