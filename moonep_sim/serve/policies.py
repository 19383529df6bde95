"""Scheduler policies: whether an aggregated worker's iteration mixes prompt chunks with decodes.

- ``mixed`` (the default): decodes first in the token budget, prompt chunks fill the rest of the
  same iteration -- vLLM V1's scheduler, and SGLang with ``--enable-mixed-chunk``.
- ``prefill-first``: an iteration runs prompts or decodes, never both -- SGLang's default
  scheduler (``get_next_batch_to_run``: a new prefill batch when one can be formed, else the
  running batch decodes). Whenever a prompt chunk can run (a running prompt's next chunk, or a
  waiting request admitted under the limits), the iteration is prefill-only with the whole token
  budget, and the running decodes wait for it (their inter-token latency takes the prefill
  step); when none can, every running sequence decodes.

Prefill and decode pools of a disaggregated deployment run one kind of work each; the policy
changes nothing there. Add a policy: a :class:`SchedulerPolicy` registered here, and its branch in
:meth:`moonep_sim.serve.engine._Engine.start` (which reads ``mixes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moonep_sim.registry import Registry


@dataclass(frozen=True)
class SchedulerPolicy:
    """``name``; ``mixes``: prompt chunks and decodes share an iteration; ``engines``: which engines
    schedule this way (for the docs and the flags of a result)."""

    name: str
    mixes: bool
    engines: str


SCHEDULER_POLICIES: Registry[SchedulerPolicy] = Registry("scheduler policy")
SCHEDULER_POLICIES.register(SchedulerPolicy("mixed", True, "vLLM V1; SGLang with --enable-mixed-chunk"))
SCHEDULER_POLICIES.register(SchedulerPolicy("prefill-first", False, "SGLang's default (separate prefill and decode "
                                                                     "batches)"))
#: the policy a pool gets unless it names one
DEFAULT_POLICY = "mixed"


def get_policy(name: str) -> SchedulerPolicy:
    """The policy called ``name`` (a one-line error naming the choices otherwise)."""
    return SCHEDULER_POLICIES.get(name)


__all__ = ["DEFAULT_POLICY", "SCHEDULER_POLICIES", "SchedulerPolicy", "get_policy"]
