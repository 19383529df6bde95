"""Typed vocabulary of a layer's phases: what a phase does (:class:`PhaseKind`), which ranks may
talk in it (:class:`Scope`) and which pass of the step it belongs to (:class:`Direction`).

Every communication phase of a Plan (``Plan.phases``), every flow the simulator sends and every
span it records carries these, so analyses select phases by kind instead of parsing names. The
members are ``str`` subclasses whose value is the lower-case name used in JSON and reports
(``PhaseKind.GRAD_REDUCE == "grad_reduce"``).
"""

from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    """A ``str`` enum that prints and formats as its value (``enum.StrEnum`` needs Python 3.11)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class PhaseKind(_StrEnum):
    """The role of a phase in a layer's schedule (the same in both directions).

    DISPATCH: rows sent before expert compute (forward ``dispatch.h``; backward ``combine_bwd.h``,
        the output gradients following the dispatch hops).
    COMBINE: rows sent after expert compute (forward ``combine.h``; backward ``dispatch_bwd.h``).
    PREFETCH: a copy's expert weights sent from its home before compute (forward).
    MIGRATE: expert weights moved because a static placement changed (forward).
    GRAD_REDUCE: a copy's fp32 weight gradient sent home after the backward compute.
    PLANNING: the planner's work (forward, simulator spans).
    ROUTING_GATHER: the all-gather of every rank's routing (or counts) before planning.
    EXPERT_COMPUTE: the grouped expert GEMMs (simulator spans).
    COPY: a host's local pass over rows or weights before sending or after receiving.
    STALL: an injected wait (``moonep_sim.sim.faults.Stall``).
    KERNEL_FIXED: a GPU kernel's fixed cost (launch, notify, flag polling) before it moves bytes
        (simulator spans; ``moonep_sim.sim.kernels``).
    """

    DISPATCH = "dispatch"
    COMBINE = "combine"
    PREFETCH = "prefetch"
    MIGRATE = "migrate"
    GRAD_REDUCE = "grad_reduce"
    PLANNING = "planning"
    ROUTING_GATHER = "routing_gather"
    EXPERT_COMPUTE = "expert_compute"
    COPY = "copy"
    STALL = "stall"
    KERNEL_FIXED = "kernel_fixed"


COMM_KINDS = frozenset({PhaseKind.DISPATCH, PhaseKind.COMBINE, PhaseKind.PREFETCH, PhaseKind.MIGRATE,
                        PhaseKind.GRAD_REDUCE})
"""The kinds that move bytes between ranks (a Plan's ``CommPhase`` has one of these)."""

WEIGHT_KINDS = frozenset({PhaseKind.PREFETCH, PhaseKind.MIGRATE})
"""Kinds that move expert weights which must arrive before compute."""


class Scope(_StrEnum):
    """Which ranks may exchange rows in a hop.

    GLOBAL: any two ranks. INTRA_NODE: ranks of the same node. INTER_NODE: ranks with the same
    local index on different nodes (or a rank with itself).
    """

    GLOBAL = "global"
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


class Direction(_StrEnum):
    """FORWARD: the layer's forward pass. BACKWARD: its backward (a training step)."""

    FORWARD = "forward"
    BACKWARD = "backward"


SCOPES = tuple(s.value for s in Scope)

__all__ = ["COMM_KINDS", "Direction", "PhaseKind", "SCOPES", "Scope", "WEIGHT_KINDS"]
