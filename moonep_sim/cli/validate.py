"""``moonep-sim validate``: simulated (calibrated local-gloo) versus measured (gloo) layer times.

A thin adapter over :func:`moonep_sim.experiments.validate.validate`.
"""

from __future__ import annotations

import json
from pathlib import Path

from moonep_sim.cli.common import print_json, to_jsonable
from moonep_sim.report.tables import wide_console as console


def register(sub) -> None:
    p = sub.add_parser("validate", help="fidelity: replay traces for real and simulated; error per case, rank agreement",
                       description="Replays shipped traces and generated routings through every strategy, for "
                                   "real over gloo and simulated on the calibrated local-gloo topology, and "
                                   "reports the error per case, the median absolute error and whether the "
                                   "simulator orders the strategies as the measurements do (every pair a sign "
                                   "test over matched, interleaved iterations resolves).")
    p.add_argument("--level", choices=("layer", "step"), default="layer",
                   help="layer: trace replays, one MoE layer at a time (default); step: whole training steps of "
                        "tiny Hugging Face MoE models with expert parallelism (launch/train_hf.py) against the "
                        "step model (needs transformers)")
    p.add_argument("--models", default=None, help="--level step: tiny models (default tiny-mixtral,tiny-qwen2-moe,"
                                                  "tiny-deepseek)")
    p.add_argument("--quick", action="store_true", help="two cases and four strategies (a few minutes)")
    p.add_argument("--strategies", default=None, help="comma-separated (default: all; --quick: alltoall,capacity,"
                                                      "hierarchical,moonep)")
    p.add_argument("--nproc", type=int, default=4, help="gloo processes (default 4)")
    p.add_argument("--iters", type=int, default=16, help="timed interleaved iterations per case (default 16: "
                                                         "enough for the Holm-corrected sign tests of 7 strategies)")
    p.add_argument("--traces-dir", default=None, help="where the shipped traces are (default: the repository's traces/)")
    p.add_argument("--out", default="moonep-sim-out/validate", help="directory for fidelity.json and fidelity.png")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--no-plots", action="store_true", help="skip fidelity.png")
    from moonep_sim.cli.sweep import add_parallel
    add_parallel(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from moonep_sim.progress import tracker
    from moonep_sim.cli.demo import _trace_path
    from moonep_sim.errors import require
    from moonep_sim.cli.common import output_rule
    from moonep_sim.io import dumps_strict, staged_dir, write_text_atomic
    from moonep_sim.experiments import calibrate as cal
    from moonep_sim.experiments import validate as F
    from moonep_sim.report.plots import fidelity_scatter
    from moonep_sim.report.tables import fidelity_table

    if args.level == "step":
        return _run_step(args)
    output_rule(args, folders={"out": ("fidelity.json", "fidelity.png")})  # before the run, not after it
    require(2 <= args.nproc <= 64, f"--nproc ({args.nproc}) must lie in [2, 64]")
    traces = args.traces_dir or str(_trace_path().parent)
    strategies = (args.strategies.split(",") if args.strategies
                  else list(F.QUICK_STRATEGIES) if args.quick else F.all_strategies())
    require(args.iters >= 1, f"--iters ({args.iters}) must be >= 1")
    from moonep_sim.experiments.parallel import check_jobs
    check_jobs(args.jobs)
    cfg = F.FidelityConfig(F.default_cases(args.quick, traces), [s.strip() for s in strategies if s.strip()],
                           args.nproc, iters=args.iters)
    c = console()
    path = cal.calibrated_path()
    calibrated = path.is_file()
    if not args.json:
        c.print(f"[dim]local-gloo constants: {path if calibrated else 'shipped preset defaults (no calibration file; run `moonep-sim calibrate` first)'}[/dim]")
    with tracker("validate") as cb:
        rep = F.validate(cfg, progress=cb, jobs=args.jobs, cluster=args.cluster)
    rep["calibrated"] = calibrated
    out = Path(args.out)
    png = out / "fidelity.png"
    with staged_dir(out, "--out") as tmp:
        if not args.no_plots:
            fidelity_scatter(rep["cases"], tmp / "fidelity.png", rep["topology"]["name"])
        rep["files"] = {"plot": str(png) if not args.no_plots else None, "report": str(out / "fidelity.json")}
        write_text_atomic(tmp / "fidelity.json", dumps_strict(rep, indent=1))
    if args.json:
        print_json({k: v for k, v in rep.items() if k != "compare_reports"})
        return 0
    c.print(fidelity_table(rep))
    for pc in rep["per_case"]:
        mark = "agrees" if pc["agrees"] else "DISAGREES"
        c.print(f"{pc['case']}: measured {pc['measured_order_text']}; simulated {' < '.join(pc['simulated_order'])} "
                f"({mark}: {pc['resolved_agree']}/{pc['resolved_pairs']} resolved pairs; exact order "
                f"{'same' if pc['same_order'] else 'different'}, Kendall tau {pc['kendall_tau']:.2f})")
        for d in pc["disagreements"]:
            c.print(f"  [yellow]{d}[/yellow]")
    s = rep["summary"]
    c.print(f"median |error| {s['median_abs_error'] * 100:.1f}% (max {s['max_abs_error'] * 100:.0f}%, "
            f"{s['within_25pct'] * 100:.0f}% of points within 25%); simulated order agrees with every resolved "
            f"measured pair in {s['rank_agree_cases']}/{s['cases']} cases ({s['resolved_agree']}/"
            f"{s['resolved_pairs']} resolved pairs of {s['pairs']}; without the Holm correction "
            f"{s['uncorrected_agree']}/{s['uncorrected_pairs']}); exact order in {s['same_order_cases']}/"
            f"{s['cases']} cases, mean Kendall tau {s['mean_kendall_tau']:.2f}; took {rep['seconds']:.0f} s")
    c.print("wrote " + ", ".join(str(f) for f in rep["files"].values() if f))
    return 0


def _run_step(args) -> int:
    """``--level step``: whole training steps measured against the step model (experiments.hf_step)."""
    from moonep_sim.cli.common import output_rule
    from moonep_sim.progress import tracker
    from moonep_sim.errors import require
    from moonep_sim.experiments import calibrate as cal
    from moonep_sim.experiments import hf_step
    from moonep_sim.integrations.hf import require_transformers
    from moonep_sim.integrations.tiny import check_model_spec
    from moonep_sim.io import staged_dir, write_text_atomic

    output_rule(args, folders={"out": ("fidelity-step.json", "routing-*.safetensors")})
    require(2 <= args.nproc <= 64, f"--nproc ({args.nproc}) must lie in [2, 64]")
    require(args.iters >= 1, f"--iters ({args.iters}) must be >= 1")
    require_transformers()
    models = [m.strip() for m in (args.models or ",".join(hf_step.STEP_CASES)).split(",") if m.strip()]
    for m in models:
        check_model_spec(m)
    strategies = [s.strip() for s in (args.strategies or ",".join(hf_step.STEP_STRATEGIES)).split(",") if s.strip()]
    c = console()
    path = cal.calibrated_path()
    if not args.json:
        c.print(f"[dim]local-gloo constants: {path if path.is_file() else 'shipped preset defaults (run `moonep-sim calibrate` first)'}[/dim]")
    out = Path(args.out)
    with staged_dir(out, "--out") as tmp, tracker("validate --level step") as cb:
        # each model's recorded routing is kept beside the report (routing-MODEL.safetensors)
        rep = hf_step.validate_steps(models, strategies, nproc=args.nproc, steps=args.iters, progress=cb,
                                     record_dir=str(tmp))
        rep["calibrated"] = path.is_file()
        for r in rep["reports"]:      # where the routing lies once the folder is in place
            r["train"]["record"]["path"] = str(out / Path(r["train"]["record"]["path"]).name)
        write_text_atomic(tmp / "fidelity-step.json", json.dumps(to_jsonable(rep), indent=1))
    if args.json:
        print_json({k: v for k, v in rep.items() if k != "reports"})
        return 0
    for r in rep["reports"]:
        c.print(f"[bold]{r['train']['model']}[/bold]")
        for line in hf_step.summary_lines(r["compare_sim"]):
            c.print(line, highlight=False, markup=False)
    for kind, s in rep["summary"].items():
        if s["median_abs_error"] is not None:
            c.print(f"{kind}: median |error| {s['median_abs_error'] * 100:.1f}% over {len(rep['points'])} points; "
                    f"resolved pairs ordered right {s['resolved_agree']}/{s['resolved_pairs']} (of {s['pairs']})")
    la = rep["load_average"]
    c.print(f"load average {la['start']} -> {la['end']}; took {rep['seconds']:.0f} s; wrote {out / 'fidelity-step.json'}")
    return 0
