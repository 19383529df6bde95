"""The parallel layout of a job: tensor, pipeline, context, data and expert parallelism.

One typed record, :class:`Parallel`, in Megatron-Core's terms (the names its flags take:
``--tp --pp --vpp --dp --cp --ep --etp --micro-batch-size --global-batch-size --pp-schedule
--zero``, plus ``--dp-attention`` for serving):

- the **dense part** (attention, norms, shared experts, dense FFNs, embedding, head) runs on a grid
  of ``world = tp x cp x dp x pp`` ranks: TP shards each weight ``tp`` ways (with sequence
  parallelism the activations between the TP regions too), CP splits a sequence over ``cp`` ranks
  (ring attention), PP cuts the layer stack into ``pp`` stages (``vpp`` virtual stages per rank
  when interleaved), DP replicates the rest ``dp`` ways;
- the **routed experts** of a stage run on the same ``tp x cp x dp`` ranks regrouped as
  ``ep x etp x edp`` (Megatron's expert-parallel folding): EP splits the expert slots over ``ep``
  ranks, expert-TP shards each expert ``etp`` ways, and ``edp = tp*cp*dp / (ep*etp)`` replicas of
  that grid each hold every expert of the stage;
- **serving** with ``dp_attention`` (SGLang's ``--enable-dp-attention``, vLLM's data-parallel
  attention with expert parallelism, "wide EP"): each of the ``dp`` attention ranks runs its own
  requests, the experts are EP over them, and every step waits for the slowest rank. SGLang's
  ``--tp 16 --dp 16 --enable-dp-attention --ep 16`` is ``Parallel(tp=1, dp=16, ep=16,
  dp_attention=True)`` here (its ``--tp`` counts the worker's GPUs; attention TP is tp / dp).

Training batches: ``global_batch_size`` sequences per step, ``micro_batch_size`` per micro-batch,
so each pipeline runs ``micro_batches = global_batch_size / (dp x micro_batch_size)`` of them.

:meth:`Parallel.check` validates the record as a whole against a GPU count and (optionally) a
model: the product equals the GPUs, each degree divides what it splits; one line naming the rule
otherwise. :meth:`Parallel.stage_layers` cuts a model's layers into pipeline stages, uneven first
and last stages included (Megatron's ``--decoder-first/last-pipeline-num-layers``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from moonep_sim.errors import ConfigError, is_int, require
from moonep_sim.models import ModelSpec

#: Pipeline schedules a layout may name (the step model's pipeline registry implements them).
PP_SCHEDULES = ("1f1b", "interleaved", "dualpipe")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Parallel:
    """A parallel layout (see the module docstring for the grid and the names).

    tp / pp / vpp / dp / cp / ep / etp: the degrees (each >= 1).
    micro_batch_size: sequences per micro-batch.  global_batch_size: sequences per training step
        (0 = one micro-batch per pipeline: ``dp x micro_batch_size``).
    pp_schedule: ``1f1b``, ``interleaved`` (needs vpp > 1) or ``dualpipe`` (DeepSeek's bidirectional
        schedule).  zero: 0 (replicated optimizer), 1 (optimizer state sharded over DP: Megatron's
        distributed optimizer), 2 (+ gradients), 3 (+ parameters).
    sequence_parallel: activations between TP regions split over tp (Megatron ``--sequence-parallel``).
    dp_attention: serving with data-parallel attention (see the module docstring).
    first_stage_layers / last_stage_layers: layers of the first / last pipeline stage (0 = an even
        split; the rest is spread evenly over the other stages).
    overlap_grad_reduce: the DP gradient reduce runs during the last micro-batch's backward
        (Megatron ``--overlap-grad-reduce``); off, it follows the backward.
    overlap_moe_expert_parallel_comm: Megatron-Core's EP all-to-all overlap (its
        ``--overlap-moe-expert-parallel-comm``): in training the interleaved pipeline runs as its
        combined 1F1B, each steady forward and backward of two micro-batches together, the
        dispatch/combine of each behind the other's compute. Needs the interleaved schedule (vpp >= 2,
        as Megatron requires a virtual pipeline when pp > 1) and ep >= 2.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 0
    pp_schedule: str = "1f1b"
    zero: int = 1
    sequence_parallel: bool = False
    dp_attention: bool = False
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    overlap_grad_reduce: bool = False
    overlap_moe_expert_parallel_comm: bool = False

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "vpp", "dp", "cp", "ep", "etp", "micro_batch_size"):
            v = getattr(self, f)
            require(is_int(v) and v >= 1, f"{f} ({v!r}) must be an integer >= 1")
        for f in ("global_batch_size", "first_stage_layers", "last_stage_layers"):
            v = getattr(self, f)
            require(is_int(v) and v >= 0, f"{f} ({v!r}) must be an integer >= 0 (0 = default)")
        require(self.pp_schedule in PP_SCHEDULES,
                f"pp schedule ({self.pp_schedule!r}) must be one of {', '.join(PP_SCHEDULES)}")
        require(self.zero in ZERO_STAGES, f"zero ({self.zero!r}) must be one of 0, 1, 2, 3")
        for f in ("sequence_parallel", "dp_attention", "overlap_grad_reduce", "overlap_moe_expert_parallel_comm"):
            require(isinstance(getattr(self, f), bool), f"{f} ({getattr(self, f)!r}) must be true or false")
        require(self.vpp == 1 or self.pp_schedule == "interleaved",
                f"vpp ({self.vpp}) must be 1 unless the pp schedule is interleaved ({self.pp_schedule})")
        require(self.pp_schedule != "interleaved" or self.vpp >= 2,
                f"pp schedule (interleaved) needs vpp >= 2 virtual stages per rank (vpp {self.vpp})")
        require(self.pp_schedule != "interleaved" or self.pp >= 2,
                f"pp schedule (interleaved) needs pp >= 2 stages (pp {self.pp})")
        require(not self.overlap_moe_expert_parallel_comm or (self.pp_schedule == "interleaved" and self.vpp >= 2),
                f"overlap_moe_expert_parallel_comm needs the interleaved pp schedule with vpp >= 2 (pp schedule "
                f"{self.pp_schedule}, vpp {self.vpp}): Megatron-Core runs its EP all-to-all overlap on a virtual "
                "pipeline (its pp = 1 path is not modelled)")
        require(not self.overlap_moe_expert_parallel_comm or self.ep >= 2,
                f"overlap_moe_expert_parallel_comm needs ep >= 2 (ep {self.ep}): it overlaps the EP all-to-all")
        require(not self.sequence_parallel or self.tp >= 2,
                f"sequence parallel needs tp >= 2 (tp {self.tp}): it splits activations over the TP group")
        require(self.pp >= 2 or not (self.first_stage_layers or self.last_stage_layers),
                f"first/last stage layers ({self.first_stage_layers}/{self.last_stage_layers}) need pp >= 2 "
                f"(pp {self.pp})")
        dense = self.tp * self.cp * self.dp
        require(dense % (self.ep * self.etp) == 0,
                f"ep x etp ({self.ep} x {self.etp}) must divide tp x cp x dp ({self.tp} x {self.cp} x {self.dp} = "
                f"{dense}): the expert grid is carved out of the dense grid of each pipeline stage")
        if self.global_batch_size:
            per = self.dp * self.micro_batch_size
            require(self.global_batch_size % per == 0,
                    f"global batch size ({self.global_batch_size}) must be a multiple of dp x micro-batch size "
                    f"({self.dp} x {self.micro_batch_size} = {per})")
        if self.pp_schedule == "interleaved" and self.global_batch_size:
            require(self.micro_batches % self.pp == 0,
                    f"micro-batches ({self.micro_batches}) must be a multiple of pp ({self.pp}) for the "
                    "interleaved schedule (Megatron's rule)")
        if self.pp_schedule == "dualpipe":
            require(self.pp % 2 == 0, f"pp ({self.pp}) must be even for dualpipe (its two directions pair "
                                      "the stages)")

    # ----------------------------------------------------------------------------- derived
    @property
    def world(self) -> int:
        """GPUs of the layout: ``tp x cp x dp x pp``."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel replicas per stage: ``tp x cp x dp / (ep x etp)``."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def micro_batches(self) -> int:
        """Micro-batches each pipeline runs per step: ``global_batch_size / (dp x micro_batch_size)``
        (1 when no global batch is given)."""
        if not self.global_batch_size:
            return 1
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def stages(self) -> int:
        """Model chunks of the pipeline: ``pp x vpp``."""
        return self.pp * self.vpp

    # ----------------------------------------------------------------------------- checks
    def check(self, gpus: int | None = None, model: ModelSpec | None = None, *, expert_slots: int | None = None,
              seq_len: int | None = None) -> "Parallel":
        """Validate against the job (one-line :class:`ConfigError` naming the rule); returns self.

        gpus: the job's GPUs (must equal :attr:`world`).  model: the heads, experts, layers and
        widths each degree must divide.  expert_slots: routed expert slots per MoE layer (default
        the model's experts; more with redundant experts).  seq_len: the sequence length CP splits.
        """
        if gpus is not None:
            require(is_int(gpus) and gpus >= 1, f"gpus ({gpus!r}) must be an integer >= 1")
            require(self.world == gpus, f"tp x cp x dp x pp ({self.tp} x {self.cp} x {self.dp} x {self.pp} = "
                                        f"{self.world}) must equal the GPUs ({gpus})")
        if model is not None:
            where = f"model {model.name}"
            if model.heads:
                require(model.heads % self.tp == 0, f"tp ({self.tp}) must divide the attention heads "
                                                    f"({model.heads}, {where})")
            slots = model.num_experts if expert_slots is None else expert_slots
            require(slots % self.ep == 0, f"ep ({self.ep}) must divide the expert slots ({slots}, {where}"
                                          + (f": {model.num_experts} experts + {slots - model.num_experts} "
                                             "redundant" if slots != model.num_experts else "") + ")")
            require(model.expert_ffn % self.etp == 0, f"etp ({self.etp}) must divide the expert FFN width "
                                                      f"({model.expert_ffn}, {where})")
            require(self.stages <= model.layers, f"pp x vpp ({self.pp} x {self.vpp} = {self.stages}) must be <= "
                                                 f"the layers ({model.layers}, {where})")
            self.stage_layers(model.layers)
        if seq_len is not None and self.cp > 1:
            require(seq_len % (2 * self.cp) == 0, f"sequence length ({seq_len}) must be a multiple of 2 x cp "
                                                  f"(2 x {self.cp}): ring attention splits it in 2 x cp chunks")
        return self

    def stage_layers(self, layers: int) -> tuple[int, ...]:
        """Layers of each of the :attr:`stages` model chunks, in pipeline order (chunk c of an
        interleaved pipeline runs on rank ``c mod pp``). The first and last chunks take
        ``first_stage_layers`` / ``last_stage_layers`` when given; the rest is spread evenly, the
        earlier chunks taking one more where it does not divide."""
        S = self.stages
        require(S <= layers, f"pp x vpp ({self.pp} x {self.vpp} = {S}) must be <= the layers ({layers})")
        if S == 1:
            return (layers,)
        first, last = self.first_stage_layers, self.last_stage_layers
        inner = S - (1 if first else 0) - (1 if last else 0)
        rest = layers - first - last
        require(rest >= inner and (inner > 0 or rest == 0),
                f"first/last stage layers ({first}/{last}) must leave at least one layer for each of the other "
                f"{inner} stage(s) of {layers} layers")
        base, extra = divmod(rest, inner) if inner else (0, 0)
        mid = [base + (1 if i < extra else 0) for i in range(inner)]
        out = ([first] if first else []) + mid + ([last] if last else [])
        return tuple(out)

    # ----------------------------------------------------------------------------- output
    def to_dict(self) -> dict[str, Any]:
        """The record and its derived sizes (what JSON reports state)."""
        d = asdict(self)
        d.update(world=self.world, edp=self.edp, micro_batches=self.micro_batches)
        return d

    def label(self) -> str:
        """A short label, e.g. ``TP1 PP16 DP64 EP64`` (degrees of 1 left out, except DP and EP; the EP
        all-to-all overlap named when on)."""
        parts = [f"TP{self.tp}"] if self.tp > 1 else []
        parts += [f"PP{self.pp}" + (f"x{self.vpp}" if self.vpp > 1 else "")] if self.pp > 1 else []
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        parts += [f"DP{self.dp}" + ("-attn" if self.dp_attention else ""), f"EP{self.ep}"]
        parts += [f"ETP{self.etp}"] if self.etp > 1 else []
        parts += ["EP-a2a-overlap"] if self.overlap_moe_expert_parallel_comm else []
        return " ".join(parts)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "layout") -> "Parallel":
        """A layout from a mapping of its field names (a deployment file's table); unknown keys
        are one error line naming them."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"world", "edp", "micro_batches"})
        require(not unknown, f"{where}: unknown layout key(s) {', '.join(unknown)}: expected "
                             f"{', '.join(sorted(names))}", ConfigError)
        return cls(**{k: v for k, v in d.items() if k in names})


def pure_ep(ranks: int) -> Parallel:
    """Today's step layout: every rank a data-parallel replica of the dense part (attention DP),
    the experts EP over all ``ranks``: ``Parallel(dp=ranks, ep=ranks)``."""
    return Parallel(dp=ranks, ep=ranks)


__all__ = ["PP_SCHEDULES", "Parallel", "ZERO_STAGES", "pure_ep"]
