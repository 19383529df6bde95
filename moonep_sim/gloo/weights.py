"""One rank's weight exchanges for a Plan: which expert weights it sends and receives to fill its
fetched slots (prefetch), and the same exchanges reversed for their gradients (gradient reduce).

Notation: R ranks; E experts; X this rank's fetched slots (its *copy list*, in slot order); Q
elements of one expert's flattened weights (one row per expert). Pure numpy in, torch index
tensors out; ``moonep_sim.gloo.handle.build_handle`` calls :func:`weight_fetch`, the row engine
(``moonep_sim.gloo.rows``) runs the exchanges.

The fetched slots are the Plan's copies (``plan.is_copy_S()``: fetched every step) and the
*resident replicas* (slots of an expert whose master weights live on another rank that the Plan
does not call copies, e.g. EPLB's static replicas): their weights are fetched once and kept by the
:class:`~moonep_sim.gloo.buffer.Buffer` until the resident set changes. Relayed copies (stage 1,
``plan.slot_src_S``): the first two exchanges carry stage 0 only; a second round then forwards
each relay's received copy to its node's receivers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moonep_sim.gloo.rowmap import as_index as _t
from moonep_sim.plan import Plan


def _splits(counts: np.ndarray) -> tuple[int, ...]:
    return tuple(int(c) for c in counts)


@dataclass(frozen=True)
class WeightExchange:
    """One all-to-all of expert weight rows among the R ranks, seen from one rank.

    send_pos: int64 [x_send] the rows this rank sends, in send order (grouped by destination):
      indices into its home experts (``fetch`` and ``plan_copies``) or positions in its copy list
      (``relay``: the copies it forwards).
    send_splits / recv_splits: rows per rank.
    recv_pos: int64 [x_recv] position in this rank's copy list of each received row, in receive
      order (grouped by source).
    total: rows exchanged over all ranks (0: no rank takes part, no collective is issued).
    The gradient reduce runs it backwards: sends ``recv_pos`` rows, receives into ``send_pos``.
    """

    send_pos: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_pos: torch.Tensor
    total: int = 0


@dataclass(frozen=True)
class Residents:
    """This rank's resident replicas (fetched once, cached by the Buffer).

    pos / expert: int64 [X_res] position in this rank's copy list and expert of each.
    key: bytes naming the global set of resident (rank, expert) pairs (every rank builds the same
    key from the Plan, so every rank agrees on whether a fetch runs).
    """

    pos: torch.Tensor
    expert: torch.Tensor
    key: bytes = b""


@dataclass(frozen=True)
class WeightFetch:
    """The weight exchanges of one rank for one Plan.

    fetch: every fetched slot's weights from its home (stage 0 of relayed copies); the gradient
      reduce runs it backwards.  plan_copies: the same for the Plan copies only (when the resident
      replicas are cached).  relay: stage 1, each relay forwarding its received copy to its node.
    residents: the resident replicas (:class:`Residents`).
    """

    fetch: WeightExchange
    plan_copies: WeightExchange
    relay: WeightExchange
    residents: Residents


def weight_fetch(plan: Plan, rank: int, home_E: np.ndarray, fetch_S: np.ndarray,
                 local_of_E: np.ndarray) -> WeightFetch:
    """Rank ``rank``'s :class:`WeightFetch` for ``plan`` (vectorised over slots).

    home_E: int64 [E] the rank holding each expert's master weights.  fetch_S: bool [S] the
    fetched slots (Plan copies and resident replicas).  local_of_E: int64 [E] each expert's index
    among this rank's home experts (-1 elsewhere).
    """
    R, E = plan.ranks, plan.num_experts
    plan_copy_S = plan.is_copy_S()
    resident_S = fetch_S & ~plan_copy_S
    pairs = np.unique(plan.slot_rank_S[resident_S].astype(np.int64) * E + plan.slot_expert_S[resident_S])
    resident_key = np.array([R, E], dtype=np.int64).tobytes() + pairs.tobytes()
    copies = np.flatnonzero(fetch_S)  # global list of fetched slots, slot order
    c_dst, c_exp = plan.slot_rank_S[copies], plan.slot_expert_S[copies]
    c_src = home_E[c_exp]

    def exchange(sel: np.ndarray, total: int) -> WeightExchange:
        """Sends (my experts to others, by (dst, slot)) and receives (by (src, slot)) of the
        fetched slots ``sel`` (bool over the global fetched list); receive positions index this
        rank's full copy list."""
        mine = np.flatnonzero((c_src == rank) & sel)
        mine = mine[np.argsort(c_dst[mine], kind="stable")]
        to_me = np.flatnonzero(c_dst == rank)  # in slot order = my copy list order
        pos = np.flatnonzero(sel[to_me])
        order = np.argsort(c_src[to_me[pos]], kind="stable")
        return WeightExchange(_t(local_of_E[c_exp[mine]]), _splits(np.bincount(c_dst[mine], minlength=R)),
                              _splits(np.bincount(c_src[to_me[pos]], minlength=R)), _t(pos[order]), total)

    c_copy = plan_copy_S[copies]
    c_src1 = plan.copy_src_S()[copies]
    s1 = c_copy & (c_src1 != plan.slot_home_S[copies])  # relayed copies (stage 1)
    fetch = exchange(~s1, int(copies.size))
    plan_copies = exchange(c_copy & ~s1, int(c_copy.sum()))
    # stage 1: a relay forwards the copy it received (a row of its copy list) to its node's receivers
    start = np.searchsorted(c_dst, np.arange(R + 1))  # fetched slots are in slot order: by rank
    key = c_dst * E + c_exp
    ko = np.argsort(key, kind="stable")
    mine1 = np.flatnonzero(s1 & (c_src1 == rank))
    mine1 = mine1[np.argsort(c_dst[mine1], kind="stable")]
    at = ko[np.searchsorted(key[ko], rank * E + c_exp[mine1])]  # the relay's own copy of the expert
    to_me = np.flatnonzero(c_dst == rank)
    pos1 = np.flatnonzero(s1[to_me])
    pos1 = pos1[np.argsort(c_src1[to_me[pos1]], kind="stable")]
    relay = WeightExchange(_t(at - start[rank]), _splits(np.bincount(c_dst[mine1], minlength=R)),
                           _splits(np.bincount(c_src1[to_me[pos1]], minlength=R)), _t(pos1), int(s1.sum()))
    mine_c = c_dst == rank
    res_pos = np.flatnonzero(~c_copy[mine_c])
    return WeightFetch(fetch, plan_copies, relay, Residents(_t(res_pos), _t(c_exp[mine_c][res_pos]), resident_key))


__all__ = ["Residents", "WeightExchange", "WeightFetch", "weight_fetch"]
