"""``moonep-sim simulate``: time a strategy's Plan of one or more layers on a simulated cluster.

Routing comes from a trace (``--trace``) or is generated (``--gen maxvio=10,model=kimi-k3,
tokens-per-rank=8192[,seed=0]``). Tokens of a layer are split evenly over ``--ranks`` (default:
one node of the topology). GPUs per node default to the topology's. The summary names the layer
time, the phases, the lower bound, the straggler (rank and cause) and the busiest port.
"""

from __future__ import annotations

import time

from moonep_sim.cli.common import console, parse_int_list, parse_kv, print_json
from moonep_sim.errors import ConfigError, require


def register(sub) -> None:
    p = sub.add_parser("simulate", help="time a strategy on a simulated GPU cluster (straggler, busiest port)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="token-level trace (.safetensors)")
    src.add_argument("--gen", metavar="K=V,...",
                     help="generated routing instead of a trace: maxvio=X (or sigma/zipf/uniform=1), model=PRESET, "
                          "tokens-per-rank=N, seed=S")
    p.add_argument("--strategy", required=True, help="strategy name")
    p.add_argument("--topology", default="h800-cx7", help="preset name or .toml file (see `moonep-sim topologies`)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: gpus per node of the topology)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override the topology's GPUs per node")
    p.add_argument("--layers", default=None, help="trace layer ids to chain in one step, e.g. 0,1,5-7 (default: first)")
    p.add_argument("--opt", action="append", default=[], metavar="K=V", help="strategy option (repeatable)")
    p.add_argument("--model", default=None, help="model preset (default: the trace's or the --gen model)")
    p.add_argument("--dispatch-dtype", choices=("bf16", "fp8"), default="bf16", help="dispatched row dtype")
    p.add_argument("--token-padding", type=int, default=1, help="pad each expert segment to a multiple of N rows")
    p.add_argument("--backward", action="store_true", help="also simulate the backward (a training step)")
    p.add_argument("--no-overlap-prefetch", action="store_true", help="send copied weights after dispatch")
    p.add_argument("--chunks", type=int, default=1, help="pipeline dispatch/compute/combine in N chunks")
    p.add_argument("--tol", type=float, default=None, help="network coalescing tolerance (0 = exact; default 0.002)")
    p.add_argument("--slow-gpu", action="append", default=[], metavar="RANK:FACTOR", help="rank computes at FACTOR speed")
    p.add_argument("--degrade-nic", action="append", default=[], metavar="RANK:FACTOR", help="rank's NIC at FACTOR bandwidth")
    p.add_argument("--degrade-nvlink", action="append", default=[], metavar="RANK:FACTOR",
                   help="rank's NVLink port at FACTOR bandwidth")
    p.add_argument("--stall", action="append", default=[], metavar="RANK:US[:PHASE]",
                   help="rank waits US microseconds before PHASE (dispatch|compute|combine; default compute)")
    p.add_argument("--jitter", type=float, default=0.0, metavar="CV", help="lognormal jitter (mean 1, this cv)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter (and of --gen unless given there)")
    p.add_argument("--timeline", metavar="OUT.json", default=None, help="write a Perfetto / Chrome trace")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _gen_routing(spec: str, ranks: int, seed: int):
    from moonep_sim.models import get_model
    kv = parse_kv([s for s in spec.split(",") if s.strip()], "--gen")
    model = get_model(kv.pop("model", "kimi-k3"))
    try:
        tpr = int(kv.pop("tokens_per_rank", "4096"))
        gseed = int(kv.pop("seed", seed))
        pop = {k: (True if k == "uniform" else float(v)) for k, v in kv.items()}
    except ValueError as e:
        raise ConfigError(f"--gen ({spec!r}) must hold numbers: {e}") from None
    if not pop:
        pop = {"maxvio": 1.0}
    require(tpr >= 1, f"--gen tokens-per-rank ({tpr}) must be >= 1")
    try:
        from moonep_sim.routing.generators import generate_layer
    except ImportError:  # pragma: no cover - generators ship with the package
        generate_layer = None
    if generate_layer is not None:
        lr = generate_layer(model.num_experts, model.top_k, tpr * ranks, gseed, **pop)
        return lr.topk_ids_TK, lr.topk_weights_TK, model, f"generated {spec}"
    raise ConfigError("--gen needs moonep_sim.routing.generators")  # pragma: no cover


def build_plans(args, topo):
    """(plans, model) from parsed arguments (shared with tests)."""
    from moonep_sim.models import custom_model, get_model
    from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
    from moonep_sim.strategies import PlanContext, get_strategy

    spec = get_strategy(args.strategy)
    opts = spec.parse_options(parse_kv(args.opt))
    R = args.ranks or topo.gpus_per_node
    require(R >= 1, f"--ranks ({R}) must be >= 1")
    require(args.token_padding >= 1, f"--token-padding ({args.token_padding}) must be >= 1")
    G = min(topo.gpus_per_node, R)
    require(R % G == 0, f"--ranks ({R}) must be a multiple of the GPUs per node ({G}) of topology {topo.name}")
    cluster = ClusterShape(R, G)
    layers_ids: list = []
    if args.trace:
        from moonep_sim.routing.trace import Trace
        trace = Trace(args.trace)
        m = trace.meta
        wanted = parse_int_list(args.layers, "--layers") or [m.layer_ids[0]]
        name = args.model or m.model
        model = get_model(name) if name else custom_model(m.num_experts, m.top_k)
        require((model.num_experts, model.top_k) == (m.num_experts, m.top_k),
                f"model {model.name} (E={model.num_experts}, K={model.top_k}) must match the trace "
                f"(E={m.num_experts}, K={m.top_k})")
        routings = []
        for lid in wanted:
            lr = trace.layer(trace.layer_index(lid))
            routings.append((lr.topk_ids_TK, lr.topk_weights_TK))
        layers_ids = wanted
        E = m.num_experts
    else:
        ids, w, model, _ = _gen_routing(args.gen, R, args.seed)
        if args.model:
            model = get_model(args.model)
        routings = [(ids, w)]
        E = model.num_experts
        layers_ids = [0]
    ctx = PlanContext(cluster, Placement.home_groups(E, R), RowCosts.from_model(model, args.dispatch_dtype),
                      args.token_padding, topo)
    plans = []
    for ids, w in routings:
        routing = GlobalRouting.split_evenly(ids, w, E, R)
        plans.append(spec.plan(routing, ctx, **opts))
    return plans, model, layers_ids


def run(args) -> int:
    from moonep_sim.sim import SimOptions, load_topology, parse_faults, simulate_layers
    from moonep_sim.sim.perfetto import write_trace
    from moonep_sim.sim.timeline import DEFAULT_TOL

    if args.timeline:
        from moonep_sim.io import check_output_path
        check_output_path(args.timeline, "--timeline")  # before the run, not after it
    topo = load_topology(args.topology, args.gpus_per_node)
    require(args.chunks >= 1, f"--chunks ({args.chunks}) must be >= 1")
    faults = parse_faults(args.slow_gpu, args.degrade_nic, args.degrade_nvlink, args.stall)
    t0 = time.perf_counter()
    plans, model, layer_ids = build_plans(args, topo)
    plan_s = time.perf_counter() - t0
    opts = SimOptions(backward=args.backward, overlap_prefetch=not args.no_overlap_prefetch, chunks=args.chunks,
                      seed=args.seed, faults=tuple(faults), jitter=args.jitter,
                      tol=DEFAULT_TOL if args.tol is None else args.tol, timeline=bool(args.timeline))
    res = simulate_layers(plans, topo, model, opts)
    if args.timeline:
        write_trace(args.timeline, res.timeline_events,
                    {"strategy": res.strategy, "topology": res.topology, "ranks": res.ranks,
                     "layer_time_us": res.layer_time_us})
    if args.json:
        d = res.to_dict()
        d.update(model=model.name, layers=layer_ids, plan_wall_seconds=plan_s)
        print_json(d)
        return 0
    c = console()
    c.print(f"[bold]{res.strategy}[/bold] on [bold]{topo.name}[/bold]: {res.ranks} ranks "
            f"({min(topo.gpus_per_node, res.ranks)} per node), model {model.name}, layers {layer_ids}"
            f"{', forward + backward' if args.backward else ', forward'}")
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
    if args.timeline:
        c.print(f"timeline written to {args.timeline} (open in ui.perfetto.dev)")
    return 0
