"""The parallel layout's flags (Megatron-Core's and vLLM/SGLang's names), shared by ``step``,
``compare --level step`` and ``sweep --level step``: ``--tp --pp --vpp --dp --cp --ep --etp
--micro-batch-size --global-batch-size --pp-schedule --zero --sequence-parallel --dp-attention``
(and ``--first-stage-layers --last-stage-layers --overlap-grad-reduce
--overlap-moe-expert-parallel-comm``). No layout flag: today's
pure-EP step. ``--dp`` left out is the GPUs over ``tp x cp x pp`` (Megatron derives it so)."""

from __future__ import annotations

from typing import Any

from moonep_sim.errors import ConfigError

#: (flag, dest, type) of every layout flag; None = not given
LAYOUT_FLAGS = (("--tp", "tp", int), ("--pp", "pp", int), ("--vpp", "vpp", int), ("--dp", "dp", int),
                ("--cp", "cp", int), ("--ep", "ep", int), ("--etp", "etp", int),
                ("--micro-batch-size", "micro_batch_size", int), ("--global-batch-size", "global_batch_size", int),
                ("--pp-schedule", "pp_schedule", str), ("--zero", "zero", int),
                ("--first-stage-layers", "first_stage_layers", int), ("--last-stage-layers", "last_stage_layers", int),
                ("--sequence-parallel", "sequence_parallel", bool), ("--dp-attention", "dp_attention", bool),
                ("--overlap-grad-reduce", "overlap_grad_reduce", bool),
                ("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm", bool))

_HELP = {
    "tp": "tensor-parallel size: attention and dense weights sharded over tp GPUs of a node",
    "pp": "pipeline stages", "vpp": "virtual stages (model chunks) per pipeline rank (--pp-schedule interleaved)",
    "dp": "data-parallel size (default: the GPUs over tp x cp x pp)", "cp": "context-parallel size (ring attention)",
    "ep": "expert-parallel size: the EP group the MoE layers are planned over (carved out of tp x cp x dp)",
    "etp": "expert tensor-parallel size", "micro_batch_size": "sequences per micro-batch",
    "global_batch_size": "sequences per training step (micro-batches = global / (dp x micro-batch size))",
    "pp_schedule": "1f1b, interleaved (with --vpp) or dualpipe (bidirectional, overlapped chunk pairs)",
    "zero": "0: replicated optimizer; 1: distributed optimizer (state sharded over DP); 2: + gradients; "
            "3: + parameters",
    "first_stage_layers": "layers of the first pipeline stage (default: an even split)",
    "last_stage_layers": "layers of the last pipeline stage (default: an even split)",
    "sequence_parallel": "sequence parallelism: reduce-scatter + all-gather instead of TP all-reduces",
    "dp_attention": "serving: data-parallel attention with EP experts (SGLang --enable-dp-attention, wide EP)",
    "overlap_grad_reduce": "DP gradient reduce during the last micro-batch's backward (Megatron's flag)",
    "overlap_moe_expert_parallel_comm": "EP all-to-all overlap: Megatron's combined 1F1B of the interleaved pipeline "
                                        "(needs --vpp >= 2; Megatron's flag)",
}


def add_layout_options(p, *, at: str = "") -> None:
    """The layout flags (each None when not given). ``at``: a suffix for their help."""
    g = p.add_argument_group("parallel layout (docs/steps.md; none given: pure EP over --ranks; under a layout the "
                             "job's GPUs are step's --gpus, compare's and sweep's --ranks)")
    for flag, dest, typ in LAYOUT_FLAGS:
        if typ is bool:
            g.add_argument(flag, dest=dest, action="store_true", default=None, help=_HELP[dest] + at)
        elif dest == "pp_schedule":
            g.add_argument(flag, dest=dest, choices=("1f1b", "interleaved", "dualpipe"), default=None,
                           help=_HELP[dest] + at)
        elif dest == "zero":
            g.add_argument(flag, dest=dest, type=int, choices=(0, 1, 2, 3), default=None, help=_HELP[dest] + at)
        else:
            g.add_argument(flag, dest=dest, type=int, default=None, metavar="N", help=_HELP[dest] + at)


def layout_given(args) -> list[str]:
    """The layout flags given on the command line."""
    return [f for f, dest, _ in LAYOUT_FLAGS if getattr(args, dest, None) is not None]


def layout_from_args(args, gpus: int | None = None) -> Any:
    """The :class:`~moonep_sim.step.parallel.Parallel` these flags give, or None when none is
    given. ``gpus``: the job's GPUs, from which --dp is derived when left out."""
    from moonep_sim.step.parallel import Parallel

    if not layout_given(args):
        return None
    kw = {dest: getattr(args, dest) for _, dest, _ in LAYOUT_FLAGS if getattr(args, dest, None) is not None}
    if "dp" not in kw and gpus:
        per = kw.get("tp", 1) * kw.get("cp", 1) * kw.get("pp", 1)
        if gpus % per:
            raise ConfigError(f"--gpus ({gpus}) must be a multiple of tp x cp x pp ({per}) to derive --dp")
        kw["dp"] = gpus // per
    if kw.get("vpp", 1) > 1 and "pp_schedule" not in kw:
        kw["pp_schedule"] = "interleaved"
    return Parallel(**kw)


__all__ = ["LAYOUT_FLAGS", "add_layout_options", "layout_from_args", "layout_given"]
