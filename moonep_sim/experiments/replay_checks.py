"""The replay's argument checks, run before any rank starts (by the launcher, ``--nproc N``) and
again by every rank: numeric ranges, the layers and steps of the trace, the strategies and their
options, and the EP size against the trace's experts. See ``moonep_sim.experiments.replay_rank``."""

from __future__ import annotations

import argparse
from typing import Sequence

from moonep_sim.errors import ConfigError, require


def int_list(text: str, what: str) -> list[int]:
    """``"0,2,5-7"`` -> ``[0, 2, 5, 6, 7]``."""
    out: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            a, sep, b = part.partition("-")
            out.extend(range(int(a), int(b) + 1) if sep and a else [int(part)])
    except ValueError:
        raise ConfigError(f"{what} ({text!r}) must be a list of integers like 0,2,5-7") from None
    return out


def parse_layers(text: str | None, trace) -> list[int]:
    """``--layers 0,2,5-7`` (layer ids, as in every command) -> their positions in the trace, each checked."""
    if text is None:
        return list(range(trace.num_layers))
    ids = int_list(text, "--layers")
    require(ids, f"--layers ({text!r}) must name at least one layer id")
    return [trace.layer_index(lid) for lid in ids]  # an id the trace lacks: one line naming its layer ids


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

    names = [n.strip() for n in str(args.strategy).split(",") if n.strip()]
    require(len(names) >= 1 and len(set(names)) == len(names),
            f"--strategy ({args.strategy!r}) must name one or more distinct strategies, comma-separated")
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


def strategy_opts(names: Sequence[str], items: Sequence[str]) -> dict[str, dict[str, str]]:
    """``--opt`` items per strategy: ``STRATEGY.key=value`` (where STRATEGY is one of ``names``)
    applies to that strategy, a plain ``key=value`` to every one (``experiments.spec.parse_opt_items``)."""
    from moonep_sim.experiments.spec import parse_opt_items

    return parse_opt_items(items, names, plain="all")
