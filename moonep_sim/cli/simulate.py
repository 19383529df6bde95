"""``moonep-sim simulate``: time a strategy's Plan of one or more layers on a simulated cluster.

Routing comes from a trace (``--trace``) or is generated (``--gen maxvio=10,model=kimi-k3,
tokens-per-rank=8192[,seed=0]``, the grammar of :mod:`moonep_sim.experiments.routing`). Tokens of a
layer are split evenly over ``--ranks``. A thin adapter over
:meth:`moonep_sim.experiments.Scenario.simulate`. The summary names, per strategy, the layer
time, the phases, the lower bound, the straggler (rank and cause) and the busiest port; then the
verdict (several strategies: who wins, by how much, how sure and which term accounts for it) and
the flags.
"""

from __future__ import annotations

import dataclasses
import time

from moonep_sim.cli.common import (add_dispatch_dtype, add_output_flags, add_redundant_experts, add_steps,
                                   check_cluster_args, check_int, console)
from moonep_sim.limits import MAX_CHUNKS
from moonep_sim.errors import require


def register(sub) -> None:
    p = sub.add_parser("simulate", help="time a strategy on a simulated GPU cluster (straggler, busiest port)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="token-level trace (.safetensors), or gen:KEY=VALUE,... as --gen")
    src.add_argument("--gen", metavar="K=V,...",
                     help="generated routing instead of a trace, e.g. model=kimi-k3,maxvio=10,tokens-per-rank=4096 "
                          "(keys and defaults: docs/traces.md; default model=mixtral-8x7b,maxvio=1,"
                          "tokens-per-rank=512)")
    p.add_argument("--strategy", required=True,
                   help="strategy name, or several comma-separated (each simulated, then a verdict: who wins, by "
                        "how much and why); `moonep-sim strategies` lists them")
    p.add_argument("--topology", default="h800-cx7", help="preset name or .toml file (see `moonep-sim topologies`)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: 8, or the largest divisor of E below)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the topology's, at most R)")
    add_steps(p)
    p.add_argument("--layers", default=None,
                   help="layer ids to chain in one step, e.g. 0,1,5-7 (default: a trace's first layer; every layer of "
                        "--gen, layers=N)")
    p.add_argument("--opt", action="append", default=[], metavar="K=V", help="strategy option (repeatable)")
    p.add_argument("--model", default=None, help="model preset (default: the trace's or the --gen model)")
    add_dispatch_dtype(p)
    add_redundant_experts(p)
    p.add_argument("--token-padding", type=int, default=1, help="pad each expert segment to a multiple of N rows")
    p.add_argument("--backward", action="store_true", help="also simulate the backward (a training step)")
    p.add_argument("--no-overlap-prefetch", action="store_true", help="send copied weights after dispatch")
    p.add_argument("--chunks", type=int, default=1, help="pipeline dispatch/compute/combine in N chunks")
    p.add_argument("--isolate", choices=("dispatch", "combine"), default=None,
                   help="time that kernel alone (all ranks start together; no planning, no compute) and print its "
                        "bandwidth counted as DeepEP and MoonEP count it (docs/simulator.md)")
    p.add_argument("--tol", type=float, default=None, help="network coalescing tolerance (0 = exact; default 0.002)")
    p.add_argument("--slow-gpu", action="append", default=[], metavar="RANK:FACTOR", help="rank computes at FACTOR speed")
    p.add_argument("--degrade-nic", action="append", default=[], metavar="RANK:FACTOR", help="rank's NIC at FACTOR bandwidth")
    p.add_argument("--degrade-nvlink", action="append", default=[], metavar="RANK:FACTOR",
                   help="rank's NVLink port at FACTOR bandwidth")
    p.add_argument("--stall", action="append", default=[], metavar="RANK:US[:PHASE]",
                   help="rank waits US microseconds before PHASE (dispatch|compute|combine; default compute)")
    p.add_argument("--jitter", type=float, default=0.0, metavar="CV", help="lognormal jitter (mean 1, this cv)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter (and of --gen unless given there)")
    p.add_argument("--seeds", type=int, default=1,
                   help="with --gen: simulate at this many seeds of the routing (from its seed); the times are the "
                        "means and the verdict's tie and confidence rest on the spread over seeds (default 1)")
    p.add_argument("--timeline", metavar="OUT.json", default=None, help="write a Perfetto / Chrome trace")
    add_output_flags(p, out_help="also write report.json, layer_time.png and a self-contained report.html (tables, "
                                 "verdict, flags, the command and versions) under DIR (default: write nothing)")
    p.set_defaults(func=run)


def scenario(args):
    """The Scenario these arguments describe (shared with tests)."""
    from moonep_sim.experiments import GeneratorSpec, Scenario
    from moonep_sim.experiments.spec import parse_int_list, parse_opt_items, split_names

    check_cluster_args(args)
    if args.gen:
        spec = GeneratorSpec.parse(args.gen)
        if "seed" not in {k.strip().replace("_", "-") for k in (kv.split("=")[0] for kv in args.gen.split(","))}:
            spec = dataclasses.replace(spec, seed=args.seed)  # --seed seeds the routing unless the spec does
        # the spec's layers (layers=N: 0..N-1, each its own draw), or those --layers picks among them
        routing, layers = spec, parse_int_list(args.layers, "--layers") or list(range(spec.layers))
    else:
        routing, layers = args.trace, parse_int_list(args.layers, "--layers")
    names = split_names(args.strategy)
    opts = parse_opt_items(args.opt, names)
    sc = Scenario(routing=routing, model=args.model, cluster=(args.ranks or 0, args.gpus_per_node or 0),
                  topology=args.topology, strategies=[(n, opts[n]) for n in names], layers=layers,
                  steps=args.steps if not args.gen else None,
                  dispatch_dtype=args.dispatch_dtype, token_padding=args.token_padding,
                  redundant_experts=getattr(args, "redundant_experts", 0))
    if layers is None:  # a trace's first layer unless --layers says otherwise
        sc = dataclasses.replace(sc, layers=sc.resolved.source.layer_ids[:1])
    return sc


def run(args) -> int:
    from moonep_sim.sim import parse_faults
    from moonep_sim.sim.timeline import DEFAULT_TOL

    from moonep_sim.cli.common import emit_json, output_rule, print_warnings
    output_rule(args, files=("json", "timeline", "gantt"),  # before the run, not after it
                folders={"out": ("report.json", "report.html", "layer_time.png")})
    check_int(args.chunks, "--chunks", 1, MAX_CHUNKS, "pipeline chunks")
    check_int(args.seeds, "--seeds", 1, 64)
    require(args.seeds == 1 or args.gen, f"--seeds ({args.seeds}) applies to --gen routing: a trace's verdict rests "
                                         "on the spread over its steps")
    faults = parse_faults(args.slow_gpu, args.degrade_nic, args.degrade_nvlink, args.stall)
    from moonep_sim.cli.checks import check_gen_model

    check_gen_model(args.gen, args.model)
    sc = scenario(args)
    rs = sc.resolved  # everything checked before any work
    names = [n for n, _ in rs.strategies]
    layer_ids = list(rs.source.layer_ids)
    require(not args.isolate or len(layer_ids) == 1,
            f"--isolate times one layer's kernel: --layers must name one layer, not {len(layer_ids)}")
    require(len(names) == 1 or not (args.isolate or args.timeline),
            f"--{'isolate' if args.isolate else 'timeline'} takes one --strategy, not {len(names)} ({', '.join(names)})")
    t0 = time.perf_counter()
    from moonep_sim.progress import tracker

    with tracker("simulate") as cb:  # a bar on a terminal while the layers are planned
        out = sc.simulate(cb, backward=args.backward, overlap_prefetch=not args.no_overlap_prefetch,
                          chunks=args.chunks, seed=args.seed, faults=tuple(faults), jitter=args.jitter,
                          tol=DEFAULT_TOL if args.tol is None else args.tol, timeline=bool(args.timeline),
                          isolate=args.isolate, seeds=args.seeds)
    print_warnings(out.steps.get("warnings"))
    plan_s = time.perf_counter() - t0 - sum(out.raw[n].sim_stats["wall_seconds"] for n in names)
    kern = None
    if args.timeline:
        from moonep_sim.sim.perfetto import write_trace

        res = out.raw[names[0]]
        write_trace(args.timeline, res.timeline_events,
                    {"strategy": res.strategy, "topology": res.topology, "ranks": res.ranks,
                     "layer_time_us": res.layer_time_us})
    if args.isolate:
        from moonep_sim.sim.kernels import isolated_kernel_figures
        kern = isolated_kernel_figures(sc.plans().plan(names[0], step=out.per_strategy[names[0]]["step"]),
                                       out.raw[names[0]], args.isolate, rs.topology)
    files = out.save(args.out, plots=not args.no_plots) if args.out else {}
    if emit_json(args, _json(out, names, rs, plan_s, kern)):
        return 0
    c = console()
    if kern is not None:
        _print_kernel(c, args.isolate, kern)
    for n in names:
        _print_strategy(c, args, out, n, rs)
    from moonep_sim.report.tables import flag_lines, verdict_line, verdict_lines

    rep = out.to_dict()
    head = verdict_lines(rep) if len(names) > 1 else ([verdict_line(out.verdict)] if out.verdict else [])
    for line in head + flag_lines(rep):
        c.print(line, highlight=False, markup=False)
    if args.timeline:
        c.print(f"timeline written to {args.timeline} (open in ui.perfetto.dev)")
    if files:
        c.print("wrote " + ", ".join(files.values()))
    return 0


def _json(out, names: list[str], rs, plan_s: float, kern) -> dict:
    """``--json``: one strategy -- its simulator result, flat, with the steps, flags and verdict
    beside it; several -- ``kind: simulate`` with each strategy's result under ``strategies``."""
    if len(names) > 1:
        return dict(out.to_dict(), model=rs.source.model.name, layers=list(rs.source.layer_ids),
                    plan_wall_seconds=plan_s)
    per = out.per_strategy[names[0]]
    d = out.raw[names[0]].to_dict()
    d.update(model=rs.source.model.name, layers=list(rs.source.layer_ids), plan_wall_seconds=plan_s,
             step=per["step"], per_step=per["per_step"], steps_aggregate=per["steps_aggregate"], steps=dict(out.steps),
             flags=list(per["flags"]), verdict=out.verdict)
    if per.get("seeds"):  # layer_time_us: the first seed's; the mean over seeds beside it
        d.update(seeds=per["seeds"], seed_layer_time_us=per["seed_layer_time_us"],
                 mean_layer_time_us=out.layer_time_us[names[0]])
    if kern is not None:
        d["kernel"] = kern
    return d


def _print_kernel(c, what: str, kern: dict) -> None:
    c.print(f"[bold]{what} kernel alone[/bold]: {kern['rank_mean_us']:,.1f} us per rank (mean of each "
            f"rank's own kernel time, as DeepEP times it), {kern['span_us']:,.1f} us to the last rank; "
            f"row {kern['row_bytes']} B")
    hows = {"rows_received": "rows received per rank, own included (DeepEP V1 NVLink; internode: its NVL figure)",
            "node_pairs": "unique (token, node) pairs incl. the local node (DeepEP V1 internode / RDMA)",
            "scale_up": "rows sent to other GPUs of the node, every hop (DeepEP V2 scale-up)",
            "scale_out": "rows sent to other nodes, every hop (DeepEP V2 scale-out)",
            "selections": "every (token, expert) selection (low-latency tests; MoonEP's logical with 2H rows)"}
    mine = kern.get("library_counts", [])
    if kern.get("family"):
        c.print(f"  kernel family {kern['family']}: its library's own test counts "
                f"{' and '.join(mine) or 'none of these'} (marked *)")
    for k in sorted(hows, key=lambda k: k not in mine):
        if k in kern:
            c.print(f"{'*' if k in mine else ' '} {kern[k + '_GBps']:,.1f} GB/s  {hows[k]}: "
                    f"{kern[k] / 1e6:,.2f} MB per rank")
    if "epilogue_us" in kern:
        c.print(f"  copy epilogue ({kern['epilogue']}), timed apart as the library's test does: "
                f"{kern['epilogue_us']:,.1f} us per rank, {kern['epilogue_GBps']:,.1f} GB/s of rows read + "
                "written (not in the kernel time above)")


def _print_strategy(c, args, out, name: str, rs) -> None:
    """One strategy's block: the time and lower bound, phases, straggler, busiest port."""
    res, per, topo = out.raw[name], out.per_strategy[name], rs.topology
    c.print(f"[bold]{res.strategy}[/bold] on [bold]{topo.name}[/bold]: {res.ranks} ranks "
            f"({min(topo.gpus_per_node, res.ranks)} per node), model {rs.source.model.name}, layers "
            f"{list(rs.source.layer_ids)}{', forward + backward' if args.backward else ', forward'}")
    n_steps = len(per["per_step"]["step"])
    if per.get("seeds"):
        c.print(f"{len(per['seeds'])} seeds of the routing: time us mean {out.layer_time_us[name]:,.1f} (each: "
                + ", ".join(f"{t:,.1f}" for t in per["seed_layer_time_us"]) + "); below: the first seed")
    if n_steps > 1:
        a = per["steps_aggregate"]["layer_time_us"]
        c.print(f"{n_steps} steps, each its own batch: time us token-weighted mean {a['token_weighted_mean']:,.1f}, "
                f"median {a['median']:,.1f}, p90 {a['p90']:,.1f}, worst {a['worst']:,.1f} (step {a['worst_step']}); "
                f"below: the worst step")
    c.print(f"time {res.layer_time_us:,.1f} us   lower bound {res.lower_bound_us:,.1f} us "
            f"({res.lower_bound.get('binding', 'sum of layers')})   ratio {res.ratio_to_lower_bound:.2f}")
    c.print("phases (first start to last end, us): " +
            ", ".join(f"{k} {v:,.1f}" for k, v in res.phases_us.items()))
    s = res.straggler
    c.print(f"straggler: rank {s['rank']} ({s['cause']}): {s['detail']}")
    b = res.busiest_port
    c.print(f"busiest port: {b['name']} carries {b['bytes'] / 2**20:,.2f} MiB, busy {b['busy_us']:,.1f} us "
            f"({100 * b['utilisation']:.0f}% of the time) at {b['bandwidth_GBps']:g} GB/s")
    c.print(f"simulated in {res.sim_stats['wall_seconds']:.2f} s ({res.sim_stats['flows']} flows, "
            f"{res.sim_stats['ticks']} rate recomputations, tol {res.sim_stats['tol']})")
