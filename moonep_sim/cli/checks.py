"""Argument checks the step commands share, run before any work: every step option within its
bounds and consistent with the others (``moonep-sim step``, and ``compare`` / ``sweep`` at
``--level step``). One line each, naming the flag, its value and what was expected (exit 2)."""

from __future__ import annotations

import math
import os

from moonep_sim.errors import ConfigError, require

#: optimizer state per parameter (bytes): mixed-precision Adam is 12, with fp32 gradients 16
MAX_OPTIMIZER_BYTES_PER_PARAM = 1024.0
#: worker processes of one command
MAX_JOBS = 4096


def check_step_flags(args) -> None:
    """The step options as given (None: not given), before the scenario is opened."""
    from moonep_sim.io import check_input_file
    from moonep_sim.limits import MAX_CONTEXT, MAX_LAYERS, MAX_TOKENS_PER_RANK

    def bounded(dest: str, flag: str, lo: int, hi: int, meaning: str) -> None:
        v = getattr(args, dest, None)
        if v is not None:
            require(lo <= v <= hi, f"{flag} ({v}) must be in [{lo}, {hi}]: {meaning}")

    bounded("tokens_per_rank", "--tokens-per-rank", 1, MAX_TOKENS_PER_RANK, "tokens on each rank (decode: sequences)")
    bounded("context", "--context", 1, MAX_CONTEXT, "keys per sequence")
    bounded("distinct_layers", "--distinct-layers", 0, MAX_LAYERS, "0 = every layer its own")
    bounded("optimizer_shard", "--optimizer-shard", 0, 1 << 30, "ranks the optimizer state is sharded over (0 = all)")
    bounded("jobs", "--jobs", 1, MAX_JOBS, "worker processes")
    b = getattr(args, "optimizer_bytes_per_param", None)
    if b is not None:
        require(math.isfinite(b) and 0 <= b <= MAX_OPTIMIZER_BYTES_PER_PARAM,
                f"--optimizer-bytes-per-param ({b:g}) must be a number in [0, {MAX_OPTIMIZER_BYTES_PER_PARAM:g}]: "
                "optimizer state per parameter (12 = mixed-precision Adam)")
    mode = getattr(args, "mode", None) or "train"
    if getattr(args, "recompute", None) not in (None, False, "none"):
        from moonep_sim.experiments.layout import recompute_options

        recompute_options(args.recompute)
        require(mode == "train", f"--recompute must not be given with --mode {mode}: recomputation replays the "
                                 f"forward in a training step's backward, and a {mode} step has none")
    for item in getattr(args, "static_buffer", None) or []:
        name, _, tokens = item.partition("=")
        try:
            n = int(tokens)
        except ValueError:
            continue  # the parser of --static-buffer words this one
        require(1 <= n <= MAX_TOKENS_PER_RANK, f"--static-buffer ({item}) must size the buffer for 1 to "
                                               f"{MAX_TOKENS_PER_RANK} tokens per rank")
    if getattr(args, "compute_profile", None):
        check_input_file(args.compute_profile, "--compute-profile")  # a pipe or a device would block the reader


def check_step_routing(args) -> None:
    """``step``: the routing flags agree -- --steps selects a trace's steps (not generated routing's),
    and a --gen spec that names a model names the --model given (:func:`check_gen_model`)."""
    if not getattr(args, "gen", None):
        return
    require(getattr(args, "steps", None) is None,
            f"--steps ({args.steps}) must not be given with --gen: it selects recorded steps of a --trace, and "
            "generated routing is one step")
    check_gen_model(args.gen, getattr(args, "model", None))


def check_gen_model(gen: str | None, model) -> None:
    """A generated routing spec (``gen:model=X,...`` or ``model=X,...``; None: not generated) that
    names a model names the ``--model`` given (or --model is left out): routing generated for one
    model is never costed for another. Models equal in every field but their names agree."""
    if not gen or model is None:
        return
    from moonep_sim.experiments import GeneratorSpec
    from moonep_sim.models import resolve_model

    body = gen[4:] if gen.startswith("gen:") else gen
    named = [p.split("=", 1)[1].strip() for p in body.split(",") if p.strip().startswith("model=")]
    if not named:
        return
    a, b = resolve_model(GeneratorSpec.parse(gen).model), resolve_model(model)
    same = (os.fspath(model) == named[-1] or a == b
            or {k: v for k, v in vars(a).items() if k not in ("name", "source", "note", "stack_source")}
            == {k: v for k, v in vars(b).items() if k not in ("name", "source", "note", "stack_source")})
    if not same:
        raise ConfigError(f"--model ({model}) must be the --gen model ({named[-1]}) or be left out: the routing "
                          "would be generated for one model and costed for another")


def check_step_ranks(args, ranks: int) -> None:
    """The step options that depend on the EP size, once it is known."""
    shard = getattr(args, "optimizer_shard", None)
    if shard:
        require(shard <= ranks, f"--optimizer-shard ({shard}) must be at most the ranks ({ranks}): the optimizer "
                                "state is sharded over ranks of this step (0 = all of them)")
