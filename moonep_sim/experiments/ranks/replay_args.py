"""The gloo replay's command line: its parser, the typed spec it may read instead, and the argument checks
every rank would make alike, run once before any rank starts (``launch/replay.py``; the rank
program is :mod:`~moonep_sim.experiments.ranks.replay_rank`)."""

from __future__ import annotations

import argparse
from typing import Sequence

from moonep_sim.errors import ConfigError, OneLineArgumentParser, require
from moonep_sim.experiments.spec import REPLAY_DTYPES, ReplaySpec, dtype_name, parse_int_list, parse_opt_items


def torch_dtype_name(text: str) -> str:
    """Any accepted spelling (``moonep_sim.experiments.spec``) -> the torch dtype's name."""
    return REPLAY_DTYPES[dtype_name(text, tuple(REPLAY_DTYPES), "--dispatch-dtype")]


def build_parser() -> argparse.ArgumentParser:
    """The replay's command line (``launch/replay.py``; also rendered into docs/cli.md)."""
    ap = OneLineArgumentParser(prog="launch/replay.py",
                               description="Replay a trace over gloo: on N local ranks with --nproc N, or as "
                                           "one rank under torchrun.")
    ap.add_argument("--nproc", type=int, default=None,
                    help="start N local ranks (store and gloo on loopback; exit status and error line of "
                         "the failing rank); without it, run as one rank of a torchrun job")
    ap.add_argument("--spec", default=None, metavar="SPEC.json",
                    help="run the typed replay spec written by moonep_sim.experiments (every other option then "
                         "comes from it, except --nproc and --json)")
    ap.add_argument("--trace", default=None, help="trace file (moonep-sim safetensors format); required without --spec")
    ap.add_argument("--strategy", default="moonep", help="strategy, or several comma-separated (interleaved)")
    ap.add_argument("--opt", action="append", default=[], metavar="[S.]K=V",
                    help="strategy option (repeatable): S.K=V for strategy S only, K=V for all")
    ap.add_argument("--layers", default=None,
                    help="layer ids to replay (the trace's layer_ids, as everywhere else), e.g. 0,5-7 (default: all)")
    ap.add_argument("--hidden", type=int, default=64, help="H (default 64)")
    ap.add_argument("--ffn", type=int, default=128, help="expert intermediate width F (default 128)")
    ap.add_argument("--steps", default=None, metavar="SEL",
                    help="steps of the trace, each replayed as its own batch: N, A-B, A-, a comma list (default: "
                         "every step); merged or merged:SEL replays them as one concatenated batch")
    ap.add_argument("--max-tokens", type=int, default=0, help="use only the first N tokens of each layer "
                                                              "(of the selected steps)")
    ap.add_argument("--backward", action="store_true", help="also run and time the backward pass")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="ranks per node for two-hop strategies (0 = one node)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the report here (atomically, by rank 0)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective is declared failed")
    ap.add_argument("--dispatch-dtype", default="float32", type=torch_dtype_name, choices=sorted(REPLAY_DTYPES.values()),
                    help="dtype of the dispatched rows (bf16 is accepted for bfloat16, fp32 for float32)")
    ap.add_argument("--token-padding", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", dest="check", action="store_true", default=None,
                    help="compare with the dense reference (default: on when T*H <= 2**22)")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--quiet", action="store_true")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.spec is not None:
        sp = ReplaySpec.read(args.spec)
        names = [n for n, _ in sp.strategies]
        args.__dict__.update(trace=sp.trace, strategy=",".join(names), opt=[], options={n: dict(o) for n, o in sp.strategies},
                             layers=",".join(map(str, sp.layers)) if sp.layers is not None else None, steps=sp.steps,
                             hidden=sp.hidden, ffn=sp.ffn, iters=sp.iters, warmup=sp.warmup,
                             gpus_per_node=sp.gpus_per_node, token_padding=sp.token_padding, backward=sp.backward,
                             check=sp.check, max_tokens=sp.max_tokens, dispatch_dtype=torch_dtype_name(sp.dispatch_dtype),
                             seed=sp.seed, timeout=sp.timeout_s, quiet=True)
    require(args.trace is not None, "--trace (none given) must name a trace file (or give --spec)")
    return args


def parse_layers(text: str | None, trace) -> list[int]:
    """``--layers 0,2,5-7`` (layer ids, as in every command) -> their positions in the trace, each checked."""
    if text is None:
        return list(range(trace.num_layers))
    return [trace.layer_index(lid) for lid in parse_int_list(text, "--layers")]  # an id the trace lacks: one line naming its layer ids


def check_args(args: argparse.Namespace) -> None:
    """Every numeric argument in range, before any rank starts work."""
    import math

    from moonep_sim.limits import MAX_RANKS

    require(args.hidden >= 1 and args.ffn >= 1, f"--hidden ({args.hidden}) and --ffn ({args.ffn}) must be >= 1")
    require(args.hidden <= 1 << 16 and args.ffn <= 1 << 16,
            f"--hidden ({args.hidden}) and --ffn ({args.ffn}) must be <= 65536 (a CPU replay)")
    require(args.iters >= 1 and args.warmup >= 0, f"--iters ({args.iters}) must be >= 1 and --warmup ({args.warmup}) >= 0")
    require(args.iters + args.warmup <= 10000, f"--iters + --warmup ({args.iters + args.warmup}) must be <= 10000")
    require(args.max_tokens >= 0, f"--max-tokens ({args.max_tokens}) must be >= 0 (0: all tokens)")
    require(math.isfinite(args.timeout) and 0 < args.timeout <= 86400,
            f"--timeout ({args.timeout}) must be in (0, 86400] seconds")
    require(1 <= args.token_padding <= 1 << 16, f"--token-padding ({args.token_padding}) must be in [1, 65536]")
    require(args.gpus_per_node >= 0, f"--gpus-per-node ({args.gpus_per_node}) must be >= 0 (0: one node)")
    if args.nproc is not None:
        require(1 <= args.nproc <= min(MAX_RANKS, 256), f"--nproc ({args.nproc}) must be in [1, 256]")


def check_before_ranks(args: argparse.Namespace, R: int) -> None:
    """What every rank's :func:`run` would refuse alike, checked once before any rank starts: the
    strategies and their options, the trace (a token-level one), its layers and steps, and the EP
    size ``R`` against its experts and --gpus-per-node."""
    from moonep_sim.plan.placement import Placement
    from moonep_sim.routing.steps import step_batches
    from moonep_sim.routing.trace import Trace
    from moonep_sim.strategies import get_strategy

    names = strategy_names(args)
    opts = args.options if getattr(args, "options", None) is not None else strategy_opts(names, args.opt)
    for n in names:
        get_strategy(n).parse_options(opts.get(n, {}))
    trace = Trace(args.trace)
    meta = trace.meta
    require(meta.kind == "tokens", f"trace kind ({meta.kind!r}) must be 'tokens' for a replay (routing per token)")
    parse_layers(args.layers, trace)
    try:  # the placement the ranks use decides which EP sizes the experts allow
        Placement.home_groups(meta.num_experts, R)
    except ConfigError as e:
        raise ConfigError(f"--nproc ({R}): {e}") from None
    g = args.gpus_per_node or R
    require(1 <= g <= R and R % g == 0, f"--gpus-per-node ({args.gpus_per_node}) must divide --nproc ({R})")
    step_batches(trace.steps(), int(meta.num_tokens), getattr(args, "steps", None))


def strategy_names(args: argparse.Namespace) -> list[str]:
    """``--strategy a,b`` -> its names: one or more, none twice."""
    names = [n.strip() for n in str(args.strategy).split(",") if n.strip()]
    require(len(names) >= 1 and len(set(names)) == len(names),
            f"--strategy ({args.strategy!r}) must name one or more distinct strategies, comma-separated")
    return names


def strategy_opts(names: Sequence[str], items: Sequence[str]) -> dict[str, dict[str, str]]:
    """``--opt`` items per strategy: ``STRATEGY.key=value`` (where STRATEGY is one of ``names``)
    applies to that strategy, a plain ``key=value`` to every one (``experiments.spec.parse_opt_items``)."""
    return parse_opt_items(items, names, plain="all")
