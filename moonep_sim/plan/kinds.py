"""Typed vocabulary of a Plan: what a phase does (:class:`PhaseKind`), which ranks may talk in it
(:class:`Scope`), which pass of the step it belongs to (:class:`Direction`), and the one dtype of
its large index arrays (:data:`INDEX`).

Every communication phase of a Plan (``Plan.phases``), every flow the simulator sends and every
span it records carries these, so analyses select phases by kind instead of parsing names. The
members are ``str`` subclasses whose value is the lower-case name used in JSON and reports
(``PhaseKind.GRAD_REDUCE == "grad_reduce"``).
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from moonep_sim.errors import PlanError

INDEX = np.int32
"""The dtype of a Plan's index arrays that grow with tokens: per entry (``entry_rank_TK``,
``entry_row_TK``), per message of a hop (``src_rank_M``, ``src_row_M``, ``dst_rank_M``,
``dst_row_M``) and per final row (``row_entry_W``, ``expand_src_row_W``). Per-rank, per-slot and
per-migration arrays (``*_R``, ``*_S``, ``*_X``) stay int64: they are small, and are summed and
multiplied as counts. ``Plan`` and ``Hop`` convert integer arrays of another dtype when built
(:func:`as_index`); the fast builders write this dtype directly. An int32 index halves the Plan's
largest arrays (an all-gather's hop at K3 EP64: 33.5M messages, 1.07 GB as int64) and bounds a
layer to fewer than 2**31 entries, rows of a buffer (all ranks together) and final rows
(:func:`require_index`). Composite keys (``src * R + dst``, global rows ``offset + row``) are
formed in int64 or bounded where they are formed."""

INDEX_MAX = int(np.iinfo(INDEX).max)


def require_index(n: int, what: str) -> None:
    """Raise :class:`PlanError` unless ``n`` ids (0..n-1, plus the -1 sentinel) fit :data:`INDEX`."""
    if int(n) > INDEX_MAX:
        raise PlanError(f"{what} ({int(n)}) must be <= {INDEX_MAX}: the Plan's index arrays are "
                        f"{np.dtype(INDEX).name}")


def flat_ids(a) -> np.ndarray:
    """Ids (slots, ranks) as a flat integer array, in the caller's integer dtype (a planner whose
    entries are all kept may give them in a small unsigned one: less to write, gather and sort),
    else int64."""
    a = np.asarray(a)
    return (a if a.dtype.kind in "iu" else a.astype(np.int64)).ravel()


def as_index(a, what: str = "index array") -> np.ndarray:
    """``a`` as an :data:`INDEX` array: itself when it is one already (no copy), an integer array of
    another dtype converted after checking its values fit, anything else returned unchanged for
    the Plan's checks (``moonep_sim.plan.validate``) to name."""
    a = np.asarray(a)
    if a.dtype == INDEX or a.dtype.kind not in "iu":
        return a
    if a.dtype.itemsize < np.dtype(INDEX).itemsize and a.dtype.kind == "i":
        return a.astype(INDEX)
    out = np.empty(a.shape, dtype=INDEX)
    flat, dst = a.reshape(-1), out.reshape(-1)
    for lo in range(0, flat.size, _CONVERT_CHUNK):  # chunk by chunk (in cache): check, then convert
        c = flat[lo:lo + _CONVERT_CHUNK]
        if int(c.min()) < -INDEX_MAX - 1 or int(c.max()) > INDEX_MAX:
            raise PlanError(f"{what} values ({int(a.min())}..{int(a.max())}) must fit {np.dtype(INDEX).name}: "
                            "the Plan's index arrays are that dtype")
        dst[lo:lo + _CONVERT_CHUNK] = c
    return out


_CONVERT_CHUNK = 1 << 16  # elements per chunk of as_index's conversion


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

__all__ = ["COMM_KINDS", "Direction", "INDEX", "INDEX_MAX", "PhaseKind", "SCOPES", "Scope", "WEIGHT_KINDS", "as_index",
           "require_index"]
