"""The named records :func:`~moonep_sim.plan.assemble_plan` builds a Plan from.

Notation as in :mod:`moonep_sim.plan.ir`: R ranks, T tokens, K top-k, N = T*K entries, S slots,
P padding rows that arrive over the wire.

A Plan assembled from hops a planner built itself needs four things besides the routing, the
cluster and the row costs: the expert slots (:class:`Slots`), where each entry ends up after the
last hop (:class:`Entries`), the hops, and how slots are padded (:class:`Padding`). Example::

    assemble_plan(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), Entries(entry_slot, buf_row, dup), [hop],
                  padding=Padding(ctx.token_padding))

:class:`SlotLayout` is what the layout builders (``build.slot_layout``: ``reference``, ``fused``) return;
:func:`slot_geometry` the per-slot arithmetic they share.

The records only name the arrays; :func:`~moonep_sim.plan.assemble_plan` checks what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moonep_sim.errors import PlanError


@dataclass(frozen=True)
class Slots:
    """The expert slots of a Plan, sorted by rank (a rank's slots are laid out in this order).

    rank_S: int64 [S] the rank each slot computes on.  expert_S: int64 [S] its expert.
    home_S: int64 [S] the rank owning the expert's weights (!= rank_S for a copy).
    """

    rank_S: np.ndarray
    expert_S: np.ndarray
    home_S: np.ndarray


@dataclass(frozen=True)
class Route:
    """The ranks a multi-hop Plan's tokens pass (:func:`~moonep_sim.plan.plan_from_routes`): entry
    e's token goes src -> via_N[0][e] -> ... -> its slot's rank.

    via_N: H-1 int64 [N] arrays, the intermediate rank of each entry after hops 0..H-2 (values at
      dropped entries are ignored); with ``via_table`` H-1 int64 [R, R] tables instead, ``via[s, d]``
      the intermediate rank of every token going from source rank s to final rank d (a route that
      depends on its ends only, as Tutel's 2DH and DeepEP's are).
    scopes / dedup: one per hop (H = len(scopes)); dedup[h] sends a token once per receiving rank.
    """

    via_N: Sequence[np.ndarray]
    scopes: Sequence[str]
    dedup: Sequence[bool]
    via_table: bool = False

    def check(self, ranks: int) -> None:
        """Refuse (:class:`~moonep_sim.errors.PlanError`) a route whose parts disagree on the hops, or
        a via table not [R, R] of ranks."""
        H, R = len(self.scopes), int(ranks)
        if len(self.via_N) != H - 1 or len(self.dedup) != H:
            raise PlanError(f"route ({len(self.via_N)} intermediate ranks, {len(self.dedup)} dedup flags) must match "
                            f"hops ({H}): H-1 intermediate ranks and H flags")
        for v in self.via_N if self.via_table else ():
            t = np.asarray(v)
            if t.shape != (R, R):
                raise PlanError(f"via table shape ({list(t.shape)}) must be [R, R] = [{R}, {R}]")
            if t.size and (int(t.min()) < 0 or int(t.max()) >= R):
                raise PlanError(f"via table values ({int(t.min())}..{int(t.max())}) must be ranks in [0, {R})")


@dataclass(frozen=True)
class Entries:
    """Where each of the N entries (flat id ``e = t*K + k``) is after the last hop.

    slot_N: int64 [N] the slot computing it, -1 = dropped; may be None when the caller gives
      ``assemble_plan`` its layout and ``rank_N`` (nothing else needs it).
    buf_row_N: int64 [N] the row of the last hop's buffer (on the entry's rank) holding its token;
      may be None when the caller gives ``assemble_plan`` its layout.
    dup_N: bool [N] duplicate flags (see :class:`~moonep_sim.plan.Plan`'s ``entry_dup_TK``).
    rank_N: optional int64 [N] each entry's rank (``slot_rank_S[slot_N]``, -1 dropped) when the
      planner has it already: the Plan's ``entry_rank_TK`` (not copied).
    """

    slot_N: np.ndarray | None
    buf_row_N: np.ndarray | None
    dup_N: np.ndarray
    rank_N: np.ndarray | None = None


@dataclass(frozen=True)
class Padding:
    """How slots are padded beyond their entries' rows.

    token_padding: each slot's rows are padded to a multiple of this (1 = none).
    min_rows_S: optional int64 [S] rows to allocate at least (capacity padding).
    slot_P / buf_row_P: optional padding rows that *arrived* over the wire (zero rows sent with
      ``src_row == -1``): row p is computed by slot ``slot_P[p]`` and read from row
      ``buf_row_P[p]`` of the last buffer; they fill that slot's padding rows in order, and
      padding rows beyond them read the local zero row (-1).
    """

    token_padding: int = 1
    min_rows_S: np.ndarray | None = None
    slot_P: np.ndarray | None = None
    buf_row_P: np.ndarray | None = None


@dataclass(frozen=True)
class SlotLayout:
    """An expert-grouped layout of final rows, and the slot-sorted entry order it came from (what
    :func:`~moonep_sim.plan.build.slot_layout` returns).

    slot_rows_S / slot_padded_S / slot_offset_S: as in :class:`~moonep_sim.plan.Plan`.
    entry_row_N: INDEX [N] each entry's row within its rank's layout, -1 = dropped.

    order_N: INDEX [N] entries sorted by (slot, entry); the first ``n_drop`` are the dropped ones.
    grow_K: INDEX [N - n_drop] global final row (ranks concatenated) of ``order_N[n_drop:]``,
      increasing: slots are sorted by rank and laid out in order within a rank. None when the
      layout has no padding rows (the global rows are then simply 0, 1, 2, ...).
    rows_R: int64 [R] padded rows of each rank.
    entry_rank_N: INDEX [N] each entry's rank, -1 = dropped, where :func:`~moonep_sim.plan.build.slot_layout` was asked
      for it (``with_ranks``), else None.
    """

    slot_rows_S: np.ndarray
    slot_padded_S: np.ndarray
    slot_offset_S: np.ndarray
    entry_row_N: np.ndarray
    order_N: np.ndarray
    n_drop: int
    rows_R: np.ndarray
    grow_K: np.ndarray | None
    entry_rank_N: np.ndarray | None = None


def slot_geometry(slot_rows_S: np.ndarray, slot_rank_S: np.ndarray, token_padding: int,
                  min_rows_S: np.ndarray | None, ranks: int | None):
    """(padded, cum, offset, rows_R) of a :class:`SlotLayout` (``reference.slot_layout`` and the compiled
    builders of ``fused`` and ``fused_routes`` take them from here): each slot's padded rows, its
    first global row (ranks concatenated), its first row within its rank (int64 [S]); each rank's
    padded rows (int64 [R])."""
    S = slot_rank_S.size
    padded = slot_rows_S if min_rows_S is None else np.maximum(slot_rows_S, min_rows_S)
    tp = max(int(token_padding), 1)
    padded = (padded + tp - 1) // tp * tp
    cum = np.cumsum(padded) - padded
    R = int(slot_rank_S.max()) + 1 if S else 0
    first = np.searchsorted(slot_rank_S, np.arange(R))
    rank_base = np.concatenate([[0], np.cumsum(padded)])[first]
    offset = cum - rank_base[slot_rank_S] if S else cum
    nR = R if ranks is None else int(ranks)
    rows_R = np.bincount(slot_rank_S, weights=padded, minlength=nR).astype(np.int64)
    return padded, cum, offset, rows_R


__all__ = ["Entries", "Padding", "Route", "SlotLayout", "Slots", "slot_geometry"]
