"""``moonep-sim testbed``: an emulated multi-node cluster on this machine (root, Linux).

    moonep-sim testbed run --nodes 2 --gpus-per-node 2 --bandwidth 200mbit --trace T --strategy S [--json OUT]
    moonep-sim testbed probe --nodes 2 --bandwidth 200mbit [--gloo]
    moonep-sim testbed agree [--shapes 2x2,2x4] [--json OUT] [--markdown OUT]
    moonep-sim testbed cleanup [--all]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moonep_sim.cli.common import output_rule, print_json
from moonep_sim.errors import require


def register(sub) -> None:
    p = sub.add_parser("testbed", help="emulated multi-node cluster: network namespaces with tbf-shaped links (root)")
    s = p.add_subparsers(dest="testbed_cmd", metavar="ACTION")

    def shape_args(q, gpn: bool = True):
        q.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
        if gpn:
            q.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node (default 1)")
        q.add_argument("--bandwidth", default="200mbit", help="each node's link rate per direction (tbf), e.g. 200mbit")
        q.add_argument("--node-bandwidth", action="append", default=[], metavar="NODE:RATE",
                       help="a slower (or faster) link for one node, e.g. 1:50mbit (repeatable)")
        q.add_argument("--no-ingress-shaping", action="store_true", help="cap only what each node sends")
        q.add_argument("--tbf-latency-ms", type=float, default=100.0, help="tbf queue bound (default 100 ms)")

    r = s.add_parser("run", help="build the testbed, run a gloo replay across its nodes, tear it down")
    shape_args(r)
    r.add_argument("--trace", required=True)
    r.add_argument("--strategy", default="moonep")
    r.add_argument("--layers", default=None, help="layer ids, e.g. 0,5-7 (default: all of the trace)")
    r.add_argument("--hidden", type=int, default=512)
    r.add_argument("--ffn", type=int, default=64)
    r.add_argument("--max-tokens", type=int, default=0)
    r.add_argument("--iters", type=int, default=3)
    r.add_argument("--opt", action="append", default=[], metavar="K=V", help="strategy option (repeatable)")
    r.add_argument("--json", default=None, help="write the run report (testbed, probes, replay) here")
    r.add_argument("--topology-out", default=None, help="write the matching simulator topology TOML here")
    r.add_argument("--base-topology", default=None, help="intra-node constants (default: calibrated local-gloo)")
    r.add_argument("--gloo-probe", action="store_true", help="also measure gloo across the nodes (sets nic efficiency)")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds before the job is killed")
    r.add_argument("--keep", action="store_true", help="keep the per-node logs (the namespaces are always removed)")
    r.add_argument("replay_args", nargs="*", help="extra replay arguments after --")
    r.set_defaults(func=_run)

    pr = s.add_parser("probe", help="measure what the shaped links deliver (TCP; --gloo: gloo p2p and all-to-all)")
    shape_args(pr)
    pr.add_argument("--gloo", action="store_true")
    pr.add_argument("--topology-out", default=None)
    pr.add_argument("--base-topology", default=None)
    pr.set_defaults(func=_probe)

    a = s.add_parser("agree", help="measured vs simulated layer times across the testbed (the agreement table)")
    a.add_argument("--shapes", default="2x2,2x4", help="NODESxRANKS list (default 2x2,2x4)")
    a.add_argument("--strategies", default="alltoall,hierarchical,deepep,moonep")
    a.add_argument("--bandwidth", default="200mbit")
    a.add_argument("--hidden", type=int, default=512)
    a.add_argument("--ffn", type=int, default=64)
    a.add_argument("--iters", type=int, default=12,
                   help="timed interleaved iterations per routing (default 12: enough for the Holm-corrected "
                        "sign tests of 4 strategies)")
    a.add_argument("--degrade", default="1:50mbit", help="NODE:RATE of the straggler run ('' = none)")
    a.add_argument("--base-topology", default=None)
    a.add_argument("--work-dir", default=None, help="keep replays, logs, topologies here")
    a.add_argument("--json", default=None)
    a.add_argument("--markdown", default=None)
    a.set_defaults(func=_agree)

    c = s.add_parser("cleanup", help="remove testbed namespaces and temporary folders left by a killed run")
    c.add_argument("--all", action="store_true", help="also those of testbeds whose process still runs")
    c.set_defaults(func=_cleanup)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def _spec(args):
    from moonep_sim.testbed.netns import TestbedSpec, parse_node_rates, parse_rate
    rate = parse_rate(args.bandwidth)
    return TestbedSpec(nodes=args.nodes, rate_bps=rate, node_rate_bps=parse_node_rates(args.node_bandwidth, args.nodes),
                       shape_ingress=not args.no_ingress_shaping, latency_ms=args.tbf_latency_ms)


def _run(args) -> int:
    from moonep_sim.testbed.netns import check_host

    output_rule(args, files=("json", "topology_out"))  # unusable output paths refused before the (long) run
    check_host()
    spec = _spec(args)
    require(Path(args.trace).is_file(), f"--trace ({args.trace}) must be an existing trace file")
    import tempfile
    with tempfile.TemporaryDirectory(prefix=f"{spec.prefix}-replay-") as tmp:  # removed after the run
        return _run_in(args, spec, str(Path(tmp) / "replay.json"))


def _run_in(args, spec, out: str) -> int:
    from moonep_sim.testbed.run import LaunchSpec, run_testbed

    rargs = ["--trace", str(Path(args.trace).resolve()), "--strategy", args.strategy, "--hidden", str(args.hidden),
             "--ffn", str(args.ffn), "--iters", str(args.iters), "--gpus-per-node", str(args.gpus_per_node),
             "--quiet", "--json", out]
    if args.layers:
        rargs += ["--layers", args.layers]
    if args.max_tokens:
        rargs += ["--max-tokens", str(args.max_tokens)]
    for o in args.opt:
        rargs += ["--opt", o]
    rargs += list(args.replay_args)
    launch = LaunchSpec(args.gpus_per_node, module_args=tuple(rargs), timeout_s=args.timeout)
    res = run_testbed(spec, launch, probe_gloo=args.gloo_probe, keep_logs=args.keep,
                      topology_out=args.topology_out, topology_base=args.base_topology)
    d = res.to_dict()
    if args.json:
        from moonep_sim.io import write_text_atomic
        write_text_atomic(args.json, json.dumps(d, indent=2, default=str))
    summary = run_summary(res.replay or {})
    summary["tcp_mbit_per_s"] = [round(t["bits_per_s"] / 1e6, 1) for t in res.probes.get("tcp", [])]
    summary["topology"] = res.topology_path
    summary["logs"] = res.logs
    print_json(summary)
    return 0


_SUMMARY_KEYS = ("strategy", "world_size", "layers", "layer_ms_median", "dispatch_ms", "combine_ms", "total_ms",
                 "bytes_sent", "correct")


def run_summary(replay: dict) -> dict:
    """The replay's headline figures; with several strategies (``--strategy a,b``), one entry each."""
    from moonep_sim.gloo.launcher import reports_by_strategy

    if not replay:
        return {k: None for k in _SUMMARY_KEYS}
    per = reports_by_strategy(replay)
    if "strategies" not in replay:
        return {k: replay.get(k) for k in _SUMMARY_KEYS}
    return {"strategies": {n: {k: r.get(k) for k in _SUMMARY_KEYS if k != "strategy"} for n, r in per.items()},
            "order": replay.get("order"), "interleaved": replay.get("interleaved")}


def _probe(args) -> int:
    from moonep_sim.testbed.netns import check_host
    from moonep_sim.testbed.run import run_testbed

    output_rule(args, files=("topology_out",))
    check_host()
    res = run_testbed(_spec(args), None, probe_gloo=args.gloo, topology_out=args.topology_out,
                      topology_base=args.base_topology, gpus_per_node=args.gpus_per_node)
    print_json({"testbed": res.testbed, "tcp": res.probes.get("tcp"), "gloo": res.probes.get("gloo"),
                "topology": res.topology_path})
    return 0


def _agree(args) -> int:
    from moonep_sim.testbed.agreement import AgreeConfig, markdown_table, run_agreement
    from moonep_sim.testbed.netns import check_host, parse_node_rates, parse_rate

    output_rule(args, files=("json", "markdown"))
    check_host()
    shapes = []
    for part in args.shapes.split(","):
        n, sep, g = part.strip().lower().partition("x")
        require(sep == "x" and n.isdigit() and g.isdigit(), f"--shapes item ({part!r}) must look like 2x4")
        shapes.append((int(n), int(g)))
    degrade = None
    if args.degrade:
        d = parse_node_rates([args.degrade], max(n for n, _ in shapes))
        degrade = next(iter(d.items()))
    cfg = AgreeConfig(shapes=shapes, strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
                      rate_bps=parse_rate(args.bandwidth), hidden=args.hidden, ffn=args.ffn, iters=args.iters,
                      degrade=degrade, base_topology=args.base_topology, work_dir=args.work_dir)
    rep = run_agreement(cfg, progress=lambda s: print(f"[testbed agree] {s}", file=sys.stderr, flush=True),
                        json_out=args.json)
    md = markdown_table(rep)
    if args.markdown:
        from moonep_sim.io import write_text_atomic
        write_text_atomic(args.markdown, md + "\n")
    print(md)
    return 0


def _cleanup(args) -> int:
    from moonep_sim.testbed.netns import cleanup, cleanup_folders
    removed = cleanup(all_tags=args.all)
    folders = cleanup_folders(all_tags=args.all)
    print(f"removed {len(removed)} namespace(s)" + (f": {', '.join(removed)}" if removed else "")
          + f"; {len(folders)} temporary folder(s)" + (f": {', '.join(folders)}" if folders else ""))
    return 0
