"""``moonep-sim plan``: plan one layer of a trace with one strategy and summarise the Plan.

Tokens of the layer are split evenly over the ranks (the first T % R ranks get one more). Row and
weight sizes come from ``--model``, else the trace's ``meta.model``, else a default shape
(``custom_model(E, K)``: hidden 1024, expert FFN 512, i.e. 2048-byte bf16 rows and 3 MiB experts).
For ``deepep`` with ``--opt max_nodes=M`` and a trace holding ``router_logits``, the tokens are
re-routed with node-limited selection (one expert group per node) before planning. A thin adapter
over :meth:`moonep_sim.experiments.Scenario.plans`.
"""

from __future__ import annotations

from moonep_sim.cli.common import add_dispatch_dtype, add_steps, check_cluster_args, console, print_json


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan one layer of a trace with a strategy and summarise it")
    p.add_argument("--trace", required=True,
                   help="token-level trace (.safetensors), or generated routing gen:model=...,maxvio=...")
    p.add_argument("--strategy", required=True, help="strategy name (`moonep-sim strategies` lists them)")
    p.add_argument("--ranks", type=int, required=True, help="EP ranks (GPUs)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: all ranks in one node)")
    p.add_argument("--topology", default=None,
                   help="preset name or .toml file whose link and kernel terms price weight copies for the planners "
                        "that weigh them (costaware, llep, ultraep); default: "
                        "h800-cx7 (`moonep-sim topologies` lists the presets)")
    add_steps(p)
    p.add_argument("--layer", type=int, default=None, help="layer id (default: the trace's first layer)")
    p.add_argument("--opt", action="append", default=[], metavar="K=V", help="strategy option (repeatable)")
    p.add_argument("--model", default=None, help="model preset for row/weight sizes (default: the trace's)")
    add_dispatch_dtype(p)
    p.add_argument("--token-padding", type=int, default=1, help="pad each expert segment to a multiple of N rows")
    p.add_argument("--placement", choices=("home", "round-robin"), default="home",
                   help="expert homes: contiguous groups (home) or expert e on rank e %% R (round-robin)")
    p.add_argument("--json", action="store_true", help="print Plan.summary() as JSON")
    p.set_defaults(func=run)


def scenario(args):
    """The Scenario these arguments describe (shared with tests)."""
    from moonep_sim.experiments import Scenario
    from moonep_sim.experiments.spec import parse_opt_items

    check_cluster_args(args, gpus_min=0)
    topology = {} if args.topology is None else {"topology": args.topology}
    return Scenario(routing=args.trace, model=args.model, cluster=(args.ranks, args.gpus_per_node or args.ranks),
                    **topology,
                    strategies=[(args.strategy, parse_opt_items(args.opt, [args.strategy])[args.strategy])],
                    layers=None if args.layer is None else [args.layer], steps=args.steps,
                    dispatch_dtype=args.dispatch_dtype,
                    token_padding=args.token_padding, placement=args.placement)


def build(args):
    """(plan, model name) from parsed arguments -- shared with tests. A trace of several steps is
    planned on one batch as a dispatch saw it: its first step unless --steps names one (the first
    of a selection), or every token with --steps merged."""
    import dataclasses

    sc = scenario(args)
    src = sc.resolved.source
    if src.num_batches > 1:
        sc = dataclasses.replace(sc, steps=str(src.batches[0][0]))
        args.planned_step = f"step {src.batches[0][0]} of {src.trace_steps}"
    elif src.merged:
        args.planned_step = f"all {src.trace_steps} steps merged"
    res = sc.plans()
    return res.items[0].plan, res.model


def _mib(b: int) -> str:
    return f"{b / 2**20:,.2f}"


def run(args) -> int:
    plan, model_name = build(args)
    s = plan.summary()
    if args.json:
        s["model"] = model_name
        s["layer"] = args.layer
        s["step"] = getattr(args, "planned_step", None)
        print_json(s)
        return 0 if not s["invariant_violations"] else 1
    from rich.table import Table
    c = console()
    rows = s["recv_rows_per_rank"]
    mean = sum(rows) / max(len(rows), 1)
    t = Table(title=f"plan: {s['strategy']} on {args.trace} (model {model_name}, R={s['ranks']}, "
                    f"G={s['gpus_per_node']}, E={s['num_experts']}, K={s['top_k']}, T={s['tokens']}"
                    + (f", {args.planned_step}" if getattr(args, "planned_step", None) else "") + ")")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("options", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in s["options"].items()) or "-")
    t.add_row("rows per rank (min / mean / max)", f"{min(rows)} / {mean:.1f} / {max(rows)}" if rows else "-")
    t.add_row("max / mean rows", f"{s['max_over_mean_rows']:.3f}")
    t.add_row("dropped entries", str(s["dropped"]))
    t.add_row("padded rows", str(s["padded"]))
    t.add_row("duplicates avoided", str(s["duplicates_avoided"]))
    t.add_row("weight copies / migrations", f"{s['weight_copies']} / {s['migrations']}")
    t.add_row("hops", str(s["hops"]))
    for k in ("dispatch", "combine", "prefetch", "migrate", "grad_reduce", "intra_node", "inter_node"):
        t.add_row(f"{k} MiB" + (" (fwd+bwd)" if k in ("intra_node", "inter_node") else ""), _mib(s["bytes"][k]))
    t.add_row("plan seconds", f"{s['plan_seconds']:.4f}")
    t.add_row("invariant violations", str(len(s["invariant_violations"])))
    c.print(t)
    for v in s["invariant_violations"]:
        c.print(f"[red]violation:[/red] {v}")
    return 0 if not s["invariant_violations"] else 1
