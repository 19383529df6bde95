"""The Plan IR: plain data that says how one MoE layer's tokens move and where experts compute.

The types here (:class:`RowCosts`, :class:`GlobalRouting`, :class:`Hop`, :class:`CommPhase`,
:class:`Plan`) are the intermediate representation between planners and executors; the named
invariant checks live in ``moonep_sim.plan.validate`` and the builders strategies use in
``moonep_sim.plan.build`` (single hop) and ``moonep_sim.plan.multihop`` (routes over several hops).

A strategy (``moonep_sim.strategies``) turns one layer's *global* routing into a Plan; both
executors (``moonep_sim.gloo`` for real tensors, ``moonep_sim.sim`` for the simulated cluster) carry
out any Plan unchanged and never look at the strategy's name.

Notation
--------
R ranks; T tokens of all ranks, concatenated in rank order (rank r owns tokens
``[tok_off_R[r], tok_off_R[r] + tokens_per_rank_R[r])``); K top-k; an *entry* is one (token, k)
pair with flat id ``e = t*K + k``; E experts; S expert slots (expert instances on ranks, see
``slot_*``); M messages (rows moved) of one hop; W final expert rows of all ranks (concatenated in
rank order, rank r's rows ``[row_off_R[r], row_off_R[r] + rows_R[r])``).

Data movement model
-------------------
Dispatch is a chain of *hops*. Buffer 0 on rank r is its input tokens ``x[tokens_per_rank_R[r], H]``.
Hop h moves M rows: message m copies row ``src_row_M[m]`` of buffer h on ``src_rank_M[m]`` into row
``dst_row_M[m]`` of buffer h+1 on ``dst_rank_M[m]`` (``src_row == -1``: a zero padding row is sent).
A hop's messages are sorted by (src_rank, dst_rank), and each (dst_rank, dst_row) is written once.
After the last hop, rank r builds its expert-grouped rows by a local gather:
final row w = last buffer row ``expand_src_row_W[w]`` (-1 = zero padding row). Several final rows
may read the same buffer row: that is deduplication (a row sent once, expanded at the destination).

Combine is the exact reverse (adjoint): each final row's expert output is multiplied by its entry's
routing weight, summed into the buffer rows it was expanded from, and sent back hop by hop, each
hop scatter-adding into the rows it came from. The backward of dispatch is a combine on the same
Plan and vice versa; so backward traffic follows from forward traffic.

Expert weights: slot s runs expert ``slot_expert_S[s]`` on ``slot_rank_S[s]`` with weights homed on
``slot_home_S[s]``. A slot whose home differs from its rank is a *copy*: its weights are prefetched
from the home before expert compute, and in backward its weight gradient (fp32) is reduced home.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.jit import kernel
from moonep_sim.plan.kernel import KernelSpec
from moonep_sim.plan.kinds import SCOPES, Direction, PhaseKind, Scope, as_index, require_index
from moonep_sim.plan.placement import ClusterShape
from moonep_sim.plan.validate import validate_counting
from moonep_sim.routing.trace import find_bad_token


@dataclass(frozen=True)
class RowCosts:
    """Byte sizes a Plan's traffic is counted in.

    dispatch_row_bytes: one dispatched row (bf16: 2*H; fp8: H + H/128*4).
    combine_row_bytes: one combined row, and one gradient row in backward (bf16: 2*H).
    weight_bytes: one expert's weights (gate, up, down) moved by a prefetch.
    grad_bytes: one expert's weight gradient (fp32) moved by a gradient reduce.
    """

    dispatch_row_bytes: int
    combine_row_bytes: int
    weight_bytes: int = 0
    grad_bytes: int = 0

    @classmethod
    def from_model(cls, model, dispatch_dtype: str = "bf16") -> "RowCosts":
        return cls(model.dispatch_row_bytes(dispatch_dtype), model.combine_row_bytes,
                   model.expert_weight_bytes, model.expert_grad_bytes)

    @classmethod
    def for_rows(cls, hidden: int, dispatch_elem_bytes: int = 4, expert_ffn: int = 0) -> "RowCosts":
        """Byte sizes as the gloo executor moves rows of ``hidden`` elements: dispatched rows of
        ``dispatch_elem_bytes`` per element, combined rows in float32, an expert's weights (gate,
        up, down: ``3 * hidden * expert_ffn`` elements) and their gradient in float32."""
        w = 3 * int(hidden) * int(expert_ffn) * 4
        return cls(int(hidden) * int(dispatch_elem_bytes), int(hidden) * 4, w, w)


def even_tokens_per_rank(tokens: int, ranks: int) -> np.ndarray:
    """int64 [R]: T tokens over R ranks as evenly as possible (the first T % R ranks get one more)."""
    tpr = np.full(int(ranks), int(tokens) // int(ranks), dtype=np.int64)
    tpr[: int(tokens) % int(ranks)] += 1
    return tpr


@dataclass(frozen=True)
class GlobalRouting:
    """One layer's routing of all ranks' tokens, concatenated in rank order.

    topk_ids_TK: int64 [T, K], experts in [0, E), distinct within a token.
    topk_weights_TK: float32 [T, K], routing weights.
    tokens_per_rank_R: int64 [R], sums to T.
    num_experts: E.
    """

    topk_ids_TK: np.ndarray
    topk_weights_TK: np.ndarray
    tokens_per_rank_R: np.ndarray
    num_experts: int

    def __post_init__(self) -> None:
        ids = np.asarray(self.topk_ids_TK)
        w = np.asarray(self.topk_weights_TK, dtype=np.float32)
        tpr = np.asarray(self.tokens_per_rank_R, dtype=np.int64)
        object.__setattr__(self, "topk_ids_TK", ids.astype(np.int64, copy=False))
        object.__setattr__(self, "topk_weights_TK", w)
        object.__setattr__(self, "tokens_per_rank_R", tpr)
        if ids.ndim != 2:
            raise PlanError(f"topk_ids shape ({list(ids.shape)}) must be [T, K]")
        if w.shape != ids.shape:
            raise PlanError(f"topk_weights shape ({list(w.shape)}) must equal topk_ids shape ({list(ids.shape)})")
        if tpr.ndim != 1 or tpr.size < 1 or (tpr < 0).any():
            raise PlanError(f"tokens_per_rank ({tpr.tolist()}) must be a non-empty list of counts >= 0")
        if int(tpr.sum()) != ids.shape[0]:
            raise PlanError(f"tokens_per_rank sum ({int(tpr.sum())}) must equal the number of tokens ({ids.shape[0]})")
        K, E = ids.shape[1], self.num_experts
        if K > E:
            raise PlanError(f"top_k ({K}) must be <= num_experts ({E})")
        bad = find_bad_token(ids, E)
        if bad is not None:
            kind, t = bad
            if kind == "range":
                v = ids[t][(ids[t] < 0) | (ids[t] >= E)][0]
                raise PlanError(f"expert id ({int(v)}) must lie in [0, {E}) (num_experts): token {t} routes to "
                                f"{ids[t].tolist()}")
            raise PlanError(f"topk_ids of token {t} ({ids[t].tolist()}) must be distinct experts: "
                            "a token cannot pick one expert twice")

    @classmethod
    def split_evenly(cls, topk_ids_TK: np.ndarray, topk_weights_TK: np.ndarray, num_experts: int,
                     ranks: int) -> "GlobalRouting":
        """Split T tokens over R ranks as evenly as possible (the first T % R ranks get one more)."""
        return cls(topk_ids_TK, topk_weights_TK, even_tokens_per_rank(np.asarray(topk_ids_TK).shape[0], ranks),
                   num_experts)

    @property
    def ranks(self) -> int:
        return int(self.tokens_per_rank_R.size)

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids_TK.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids_TK.shape[1])

    def tok_off_R(self) -> np.ndarray:
        """int64 [R+1]: token offsets of each rank."""
        return np.concatenate([[0], np.cumsum(self.tokens_per_rank_R)])

    def src_rank_T(self) -> np.ndarray:
        """int64 [T]: the rank each token lives on."""
        return np.repeat(np.arange(self.ranks, dtype=np.int64), self.tokens_per_rank_R)

    def counts_E(self) -> np.ndarray:
        return np.bincount(self.topk_ids_TK.ravel(), minlength=self.num_experts).astype(np.int64)


@dataclass(frozen=True)
class Hop:
    """One all-to-all of rows (see the module docstring). M messages, sorted by (src, dst).

    scope: which ranks may talk (:class:`~moonep_sim.plan.kinds.Scope`; a plain string naming a
        member is converted) -- ``global``, ``intra_node`` (same node) or ``inter_node`` (same
        local index on different nodes, or self). An unknown string is kept for ``validate`` to name.
    src_rank_M, src_row_M (-1 = zero row), dst_rank_M, dst_row_M: :data:`~moonep_sim.plan.kinds.INDEX`
        (int32) [M]; integer arrays of another dtype are converted when the Hop is built.
    dst_rows_R: int64 [R], rows of the buffer this hop fills on each rank (all ranks together
        fewer than 2**31).
    """

    scope: Scope
    src_rank_M: np.ndarray
    src_row_M: np.ndarray
    dst_rank_M: np.ndarray
    dst_row_M: np.ndarray
    dst_rows_R: np.ndarray

    def __post_init__(self) -> None:
        if not isinstance(self.scope, Scope) and self.scope in SCOPES:
            object.__setattr__(self, "scope", Scope(self.scope))
        for name in _HOP_INDEX_FIELDS:
            object.__setattr__(self, name, as_index(getattr(self, name), f"hop {name}"))
        rows = np.asarray(self.dst_rows_R)
        object.__setattr__(self, "dst_rows_R", rows.astype(np.int64, copy=False) if rows.dtype.kind in "iu" else rows)
        if rows.size and rows.dtype.kind in "iu":
            require_index(int(rows.sum()), "rows of a hop's buffer, all ranks together")

    def rows_RR(self, ranks: int, perf: PerfConfig = DEFAULT_PERF) -> np.ndarray:
        """int64 [R, R]: rows sent from each source to each destination (diagonal: local copies).

        One compiled pass over the messages (:func:`_pair_rows`; 1.2-2.6 ms for a K3 EP64 hop's
        2-4M messages, against 8-16 ms for the chunked bincount :func:`pair_rows_reference`, which
        stays the reference and counts hops of fewer than ``perf.pair_rows_compiled_min`` messages -- where
        it costs well under a millisecond and a process that plans only small layers never starts
        the compiled code, a quarter second once -- and hops whose message arrays are not
        integers). Raises :class:`PlanError` naming the first message whose rank is outside
        ``0..ranks-1``."""
        R = int(ranks)
        require_index(R * R, "ranks squared (the (src, dst) key)")
        src, dst = np.asarray(self.src_rank_M), np.asarray(self.dst_rank_M)
        if not (src.ndim == dst.ndim == 1 and src.size == dst.size and src.dtype.kind in "iu"
                and dst.dtype.kind in "iu" and src.size >= perf.pair_rows_compiled_min):
            return pair_rows_reference(src, dst, R)
        out = np.zeros((R, R), dtype=np.int64)
        bad = _pair_rows(src, dst, R, out)
        if bad >= 0:
            raise PlanError(f"hop message {bad}: src_rank ({int(src[bad])}) and dst_rank ({int(dst[bad])}) "
                            f"must lie in 0..{R - 1} (the Plan's ranks)")
        return out


def pair_rows_reference(src_M: np.ndarray, dst_M: np.ndarray, ranks: int) -> np.ndarray:
    """int64 [R, R]: messages per (src_M, dst_M) pair, the numpy reference of :meth:`Hop.rows_RR`.

    Counted chunk by chunk of messages: an all-gather's hop has R*T messages (33.5M at K3
    EP64), whose one-shot ``src*R + dst`` key alone would be 256 MiB of fresh pages."""
    R, m = int(ranks), np.asarray(src_M).size
    out = np.zeros(R * R, dtype=np.int64)
    for lo in range(0, m, _ROWS_CHUNK):  # loop over chunks of messages, not messages
        key = src_M[lo:lo + _ROWS_CHUNK] * R
        key += dst_M[lo:lo + _ROWS_CHUNK]
        out += np.bincount(key, minlength=R * R)
    return out.reshape(R, R)


@kernel
def _pair_rows(src_M, dst_M, R, out_RR):
    """Add one to ``out_RR[src_M[m], dst_M[m]]`` per message m; returns -1, or the first message
    whose source or destination lies outside ``0..R-1`` (counting stops there). A run of equal
    pairs is counted in a register and added once (a hop's messages come sorted by pair: one
    increment of memory per pair instead of one per message, 4x faster at K3 EP64)."""
    ps = -1
    pd = -1
    run = 0
    for m in range(src_M.size):
        s = src_M[m]
        d = dst_M[m]
        if s != ps or d != pd:
            if run > 0:
                out_RR[ps, pd] += run
            if s < 0 or s >= R or d < 0 or d >= R:
                return m
            ps = s
            pd = d
            run = 0
        run += 1
    if run > 0:
        out_RR[ps, pd] += run
    return -1


_ROWS_CHUNK = 1 << 18  # messages per chunk of pair_rows_reference (1 MiB of int32 keys)


#: the Hop's and the Plan's fields of dtype :data:`~moonep_sim.plan.kinds.INDEX`
_HOP_INDEX_FIELDS = ("src_rank_M", "src_row_M", "dst_rank_M", "dst_row_M")
_PLAN_INDEX_FIELDS = ("entry_rank_TK", "entry_row_TK", "row_entry_W", "expand_src_row_W")


@dataclass(frozen=True)
class CommPhase:
    """One communication phase of a layer, as the executors and reports see it.

    name: e.g. ``dispatch.0``, ``prefetch``, ``combine.0``, ``grad_reduce`` (for display).
    kind: its role (:class:`~moonep_sim.plan.kinds.PhaseKind`): DISPATCH | COMBINE | PREFETCH |
        MIGRATE | GRAD_REDUCE. Code selects phases by kind, never by name.
    direction: :class:`~moonep_sim.plan.kinds.Direction`.  scope: :class:`~moonep_sim.plan.kinds.Scope`.
    bytes_RR: int64 [R, R] bytes from source to destination (diagonal: local, crosses no link).
    msgs_RR: int64 [R, R] rows (or expert tensors) from source to destination.
    after: name of a phase of the same direction whose arrival at a rank gates that rank's sends of
        this one (a relay forwards what it received: ``prefetch.1`` after ``prefetch``, and
        ``grad_reduce`` after ``grad_reduce.1``); None = no such gate.
    """

    name: str
    kind: PhaseKind
    direction: Direction
    scope: Scope
    bytes_RR: np.ndarray
    msgs_RR: np.ndarray
    after: str | None = None

    def remote_bytes(self) -> int:
        return int(self.bytes_RR.sum() - np.trace(self.bytes_RR))

    def split_bytes(self, cluster: ClusterShape) -> tuple[int, int]:
        """(intra-node, inter-node) bytes that cross a link (diagonal excluded)."""
        intra = cluster.intra_node_RR()
        off = ~np.eye(cluster.ranks, dtype=bool)
        return int(self.bytes_RR[intra & off].sum()), int(self.bytes_RR[~intra].sum())


@dataclass(frozen=True)
class Plan:
    """How one layer's tokens move and where experts run. All arrays are numpy: the per-entry and
    per-final-row index arrays (``entry_rank_TK``, ``entry_row_TK``, ``row_entry_W``,
    ``expand_src_row_W``) and the hops' message arrays are :data:`~moonep_sim.plan.kinds.INDEX`
    (int32; converted when the Plan is built if given another integer dtype), the rest int64
    unless noted. A layer has fewer than 2**31 entries and final rows.

    strategy / options: who planned it and with what options (reports only; executors ignore them).
      Stamped by the registry (``moonep_sim.strategies.make_plan``): the strategy's name, and its
      options as parsed, overlaid with what the planner reported (resolved defaults, statistics).
    cluster: ranks and nodes.  num_experts (E), top_k (K).  tokens_per_rank_R: [R].
    costs: byte sizes of rows and expert weights.
    token_padding: each slot's row segment is padded to a multiple of this (1 = none).

    Per entry ([T, K], entry e = t*K + k):
      entry_rank_TK: destination rank, -1 = dropped.
      entry_row_TK: row in that rank's expert-grouped layout, -1 = dropped.
      entry_dup_TK: bool; True if an earlier entry of the same token is sent to the same rank, so
        this one shares that row (sent once, expanded there; it keeps its own weight).
      entry_weight_TK: float32 routing weight of each entry.

    Per slot ([S], sorted by rank; a rank's slots are laid out in this order):
      slot_rank_S, slot_expert_S, slot_home_S (rank owning the weights; != slot_rank for a copy),
      slot_offset_S (first row within the rank), slot_rows_S (real rows),
      slot_padded_S (rows allocated, real + padding; a multiple of token_padding).
      slot_src_S: the rank a copy slot's weights come from, or None (every copy from its home).
        A copy whose source is its home is *stage 0*; one whose source is another rank is *stage
        1*: that rank is on the receiver's node and holds a stage-0 copy of the same expert (a
        relay fanning one cross-node copy out over NVLink). Non-copy slots name their own rank.

    Per final row ([W], ranks concatenated):
      row_entry_W: entry id (t*K + k) computed at this row, -1 = padding.
      expand_src_row_W: row of the last hop's buffer on the same rank this row is gathered from,
        -1 = zero padding row.

    hops: the dispatch hops in order (combine runs them in reverse).
    migrate_expert_X / migrate_src_X / migrate_dst_X: [X] expert weights moved because a static
      placement changed (charged in forward; no gradient flows back). Empty for most strategies.
    capacity_R: [R] maximum rows a rank may hold (static buffer size), or None if unbounded.
    host_plan_us: planning work the layer waits for on the host besides the planner every
      strategy pays (a device-to-host copy of the counts, a Python planning loop, a barrier), in
      microseconds of the modelled cluster; the simulator adds it to the planning step. 0 for
      planners that run on the GPU.
    plan_seconds: wall time the planner took (stamped by ``make_plan``; 0 from a builder).
    kernel: how the GPU kernels this Plan stands for move its rows (SM budget, relayed hops,
      one message per row; :class:`~moonep_sim.plan.kernel.KernelSpec`), read by the simulator
      only; None = a generic collective per hop with no SM cap.
    """

    strategy: str
    options: dict[str, Any]
    cluster: ClusterShape
    num_experts: int
    top_k: int
    tokens_per_rank_R: np.ndarray
    costs: RowCosts
    token_padding: int
    entry_rank_TK: np.ndarray
    entry_row_TK: np.ndarray
    entry_dup_TK: np.ndarray
    entry_weight_TK: np.ndarray
    slot_rank_S: np.ndarray
    slot_expert_S: np.ndarray
    slot_home_S: np.ndarray
    slot_offset_S: np.ndarray
    slot_rows_S: np.ndarray
    slot_padded_S: np.ndarray
    row_entry_W: np.ndarray
    expand_src_row_W: np.ndarray
    hops: tuple[Hop, ...]
    migrate_expert_X: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    migrate_src_X: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    migrate_dst_X: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    capacity_R: np.ndarray | None = None
    host_plan_us: float = 0.0
    plan_seconds: float = 0.0
    kernel: KernelSpec | None = None
    slot_src_S: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in _PLAN_INDEX_FIELDS:
            object.__setattr__(self, name, as_index(getattr(self, name), name))
        require_index(int(np.asarray(self.entry_rank_TK).size), "entries (tokens x top-k)")
        require_index(int(np.asarray(self.row_entry_W).size), "final rows")

    # -- sizes ----------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return self.cluster.ranks

    @property
    def num_tokens(self) -> int:
        return int(self.entry_rank_TK.shape[0])

    def rows_R(self) -> np.ndarray:
        """[R] rows of each rank's expert-grouped layout, padding included."""
        return np.bincount(self.slot_rank_S, weights=self.slot_padded_S, minlength=self.ranks).astype(np.int64)

    def real_rows_R(self) -> np.ndarray:
        """[R] real (non-padding) rows each rank computes."""
        return np.bincount(self.slot_rank_S, weights=self.slot_rows_S, minlength=self.ranks).astype(np.int64)

    def row_off_R(self) -> np.ndarray:
        """[R+1] offsets of each rank's rows in the concatenated row arrays."""
        return np.concatenate([[0], np.cumsum(self.rows_R())])

    def tok_off_R(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.tokens_per_rank_R)])

    def rank_slots(self, rank: int) -> slice:
        """The slice of slot arrays belonging to ``rank``."""
        lo, hi = np.searchsorted(self.slot_rank_S, [rank, rank + 1])
        return slice(int(lo), int(hi))

    def is_copy_S(self) -> np.ndarray:
        """bool [S]: slots whose weights are prefetched from another rank."""
        return self.slot_home_S != self.slot_rank_S

    def copy_src_S(self) -> np.ndarray:
        """[S] the rank each slot's weights come from: its home (stage 0, or no copy), or a relay
        (stage 1; see ``slot_src_S``)."""
        return self.slot_home_S if self.slot_src_S is None else self.slot_src_S

    @property
    def dropped(self) -> int:
        return int(np.count_nonzero(self.entry_rank_TK < 0))

    @property
    def padded(self) -> int:
        return int((self.slot_padded_S - self.slot_rows_S).sum())

    @property
    def weight_copies(self) -> int:
        return int(self.is_copy_S().sum())

    # -- communication phases --------------------------------------------------------------
    def _weights_RR(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        R = self.ranks
        return np.bincount(src * R + dst, minlength=R * R).reshape(R, R).astype(np.int64)

    def phases(self, direction: str = "forward", hop_rows: list[np.ndarray] | None = None) -> list[CommPhase]:
        """The layer's communication phases in order.

        forward:  dispatch.0..H-1, prefetch (copies), migrate (if any), combine.H-1..0
        backward: combine_bwd.0..H-1 (gradient rows follow dispatch), dispatch_bwd.H-1..0 (follow
                  combine), grad_reduce (copies' fp32 weight gradients go home).
        Dispatch rows cost ``dispatch_row_bytes`` (forward only); combine and every backward row
        cost ``combine_row_bytes``. ``hop_rows``: each hop's ``rows_RR`` when the caller already
        counted them (the simulator counts them once for both directions).
        """
        if hop_rows is None:
            hop_rows = [h.rows_RR(self.ranks) for h in self.hops]
        c = self.costs
        copies = self.is_copy_S()
        stage1 = copies & (self.copy_src_S() != self.slot_home_S)
        copies = copies & ~stage1
        copy_RR = self._weights_RR(self.slot_home_S[copies], self.slot_rank_S[copies])
        relay_RR = self._weights_RR(self.copy_src_S()[stage1], self.slot_rank_S[stage1]) if stage1.any() else None
        out: list[CommPhase] = []
        K, G = PhaseKind, Scope.GLOBAL
        if direction == Direction.FORWARD:
            d = Direction.FORWARD
            for i, (h, rr) in enumerate(zip(self.hops, hop_rows)):
                out.append(CommPhase(f"dispatch.{i}", K.DISPATCH, d, h.scope, rr * c.dispatch_row_bytes, rr))
            out.append(CommPhase("prefetch", K.PREFETCH, d, G, copy_RR * c.weight_bytes, copy_RR))
            if relay_RR is not None:  # stage 1: each relay forwards its stage-0 copy inside its node
                out.append(CommPhase("prefetch.1", K.PREFETCH, d, Scope.INTRA_NODE, relay_RR * c.weight_bytes,
                                     relay_RR, after="prefetch"))
            if self.migrate_expert_X.size:
                mig = self._weights_RR(self.migrate_src_X, self.migrate_dst_X)
                out.append(CommPhase("migrate", K.MIGRATE, d, G, mig * c.weight_bytes, mig))
            for i in reversed(range(len(self.hops))):
                rr = hop_rows[i].T
                out.append(CommPhase(f"combine.{i}", K.COMBINE, d, self.hops[i].scope, rr * c.combine_row_bytes, rr))
        elif direction == Direction.BACKWARD:
            d = Direction.BACKWARD
            for i, (h, rr) in enumerate(zip(self.hops, hop_rows)):
                out.append(CommPhase(f"combine_bwd.{i}", K.DISPATCH, d, h.scope, rr * c.combine_row_bytes, rr))
            for i in reversed(range(len(self.hops))):
                rr = hop_rows[i].T
                out.append(CommPhase(f"dispatch_bwd.{i}", K.COMBINE, d, self.hops[i].scope,
                                     rr * c.combine_row_bytes, rr))
            if relay_RR is not None:  # the adjoint: stage 1 reduced into the relays first, then stage 0 home
                out.append(CommPhase("grad_reduce.1", K.GRAD_REDUCE, d, Scope.INTRA_NODE, relay_RR.T * c.grad_bytes,
                                     relay_RR.T))
            out.append(CommPhase("grad_reduce", K.GRAD_REDUCE, d, G, copy_RR.T * c.grad_bytes, copy_RR.T,
                                 after=None if relay_RR is None else "grad_reduce.1"))
        else:
            raise PlanError(f"direction ({direction!r}) must be 'forward' or 'backward'")
        return out

    def bytes_summary(self, hop_rows: list[np.ndarray] | None = None) -> dict[str, int]:
        """Bytes that cross a link (local copies excluded), by phase kind and by link class.

        Keys: dispatch, combine, prefetch, migrate, grad_reduce (backward), intra_node, inter_node
        (forward and backward together). hop_rows: each hop's ``rows_RR`` where the caller has
        counted them (else counted here).
        """
        out = dict(dispatch=0, combine=0, prefetch=0, migrate=0, grad_reduce=0, intra_node=0, inter_node=0)
        if hop_rows is None:
            hop_rows = [h.rows_RR(self.ranks) for h in self.hops]
        for direction in ("forward", "backward"):
            for p in self.phases(direction, hop_rows):
                intra, inter = p.split_bytes(self.cluster)
                if direction == "forward" or p.kind == PhaseKind.GRAD_REDUCE:
                    out[p.kind.value] += intra + inter
                out["intra_node"] += intra
                out["inter_node"] += inter
        return out

    def summary(self) -> dict[str, Any]:
        """The machine-readable summary ``moonep-sim plan --json`` prints."""
        real = self.real_rows_R()
        violations, hop_rows = validate_counting(self)  # (counts each hop's rows for the bytes on the way)
        return {
            "strategy": self.strategy,
            "options": {k: v for k, v in self.options.items() if _jsonable(v)},
            "ranks": self.ranks,
            "gpus_per_node": self.cluster.gpus_per_node,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "tokens": self.num_tokens,
            "recv_rows_per_rank": real.tolist(),
            "rows_per_rank_padded": self.rows_R().tolist(),
            "max_over_mean_rows": float(real.max() / max(real.mean(), 1e-12)) if real.size else 0.0,
            "dropped": self.dropped,
            "padded": self.padded,
            "duplicates_avoided": int(np.count_nonzero(self.entry_dup_TK)),
            "weight_copies": self.weight_copies,
            "migrations": int(self.migrate_expert_X.size),
            "hops": len(self.hops),
            "bytes": self.bytes_summary(hop_rows),
            "plan_seconds": self.plan_seconds,
            "invariant_violations": violations,
        }


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, type(None)))
