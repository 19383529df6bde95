"""The Plan: plain data that says how one MoE layer's tokens move and where experts compute.

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

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.plan.kernel import KernelSpec
from moonep_sim.plan.kinds import SCOPES, Direction, PhaseKind, Scope
from moonep_sim.plan.placement import ClusterShape
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
        T = np.asarray(topk_ids_TK).shape[0]
        tpr = np.full(ranks, T // ranks, dtype=np.int64)
        tpr[: T % ranks] += 1
        return cls(topk_ids_TK, topk_weights_TK, tpr, num_experts)

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

    def counts_RE(self) -> np.ndarray:
        """int64 [R, E]: tokens per (source rank, expert) -- MoonEP's ``tpe``."""
        src = np.repeat(self.src_rank_T(), self.top_k)
        flat = src * self.num_experts + self.topk_ids_TK.ravel()
        return np.bincount(flat, minlength=self.ranks * self.num_experts).reshape(self.ranks, self.num_experts)


@dataclass(frozen=True)
class Hop:
    """One all-to-all of rows (see the module docstring). M messages, sorted by (src, dst).

    scope: which ranks may talk (:class:`~moonep_sim.plan.kinds.Scope`; a plain string naming a
        member is converted) -- ``global``, ``intra_node`` (same node) or ``inter_node`` (same
        local index on different nodes, or self). An unknown string is kept for ``validate`` to name.
    src_rank_M, src_row_M (-1 = zero row), dst_rank_M, dst_row_M: int64 [M].
    dst_rows_R: int64 [R], rows of the buffer this hop fills on each rank.
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

    def rows_RR(self, ranks: int) -> np.ndarray:
        """int64 [R, R]: rows sent from each source to each destination (diagonal: local copies)."""
        return np.bincount(self.src_rank_M * ranks + self.dst_rank_M,
                           minlength=ranks * ranks).reshape(ranks, ranks)


@dataclass(frozen=True)
class CommPhase:
    """One communication phase of a layer, as the executors and reports see it.

    name: e.g. ``dispatch.0``, ``prefetch``, ``combine.0``, ``grad_reduce`` (for display).
    kind: its role (:class:`~moonep_sim.plan.kinds.PhaseKind`): DISPATCH | COMBINE | PREFETCH |
        MIGRATE | GRAD_REDUCE. Code selects phases by kind, never by name.
    direction: :class:`~moonep_sim.plan.kinds.Direction`.  scope: :class:`~moonep_sim.plan.kinds.Scope`.
    bytes_RR: int64 [R, R] bytes from source to destination (diagonal: local, crosses no link).
    msgs_RR: int64 [R, R] rows (or expert tensors) from source to destination.
    """

    name: str
    kind: PhaseKind
    direction: Direction
    scope: Scope
    bytes_RR: np.ndarray
    msgs_RR: np.ndarray

    def remote_bytes(self) -> int:
        return int(self.bytes_RR.sum() - np.trace(self.bytes_RR))

    def split_bytes(self, cluster: ClusterShape) -> tuple[int, int]:
        """(intra-node, inter-node) bytes that cross a link (diagonal excluded)."""
        intra = cluster.intra_node_RR()
        off = ~np.eye(cluster.ranks, dtype=bool)
        return int(self.bytes_RR[intra & off].sum()), int(self.bytes_RR[~intra].sum())


@dataclass(frozen=True)
class Plan:
    """How one layer's tokens move and where experts run. All arrays are numpy, int64 unless noted.

    strategy / options: who planned it and with what options (reports only; executors ignore them).
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
    plan_seconds: wall time the planner took.
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

    def tokens_per_expert_RE(self) -> np.ndarray:
        """[R, E] real rows each rank computes per expert (copies included)."""
        flat = self.slot_rank_S * self.num_experts + self.slot_expert_S
        return np.bincount(flat, weights=self.slot_rows_S,
                           minlength=self.ranks * self.num_experts).reshape(self.ranks, self.num_experts).astype(np.int64)

    @property
    def dropped(self) -> int:
        return int((self.entry_rank_TK < 0).sum())

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

    def phases(self, direction: str = "forward") -> list[CommPhase]:
        """The layer's communication phases in order.

        forward:  dispatch.0..H-1, prefetch (copies), migrate (if any), combine.H-1..0
        backward: combine_bwd.0..H-1 (gradient rows follow dispatch), dispatch_bwd.H-1..0 (follow
                  combine), grad_reduce (copies' fp32 weight gradients go home).
        Dispatch rows cost ``dispatch_row_bytes`` (forward only); combine and every backward row
        cost ``combine_row_bytes``.
        """
        R, c = self.ranks, self.costs
        copies = self.is_copy_S()
        copy_RR = self._weights_RR(self.slot_home_S[copies], self.slot_rank_S[copies])
        out: list[CommPhase] = []
        hop_rows = [h.rows_RR(R) for h in self.hops]
        K, G = PhaseKind, Scope.GLOBAL
        if direction == Direction.FORWARD:
            d = Direction.FORWARD
            for i, (h, rr) in enumerate(zip(self.hops, hop_rows)):
                out.append(CommPhase(f"dispatch.{i}", K.DISPATCH, d, h.scope, rr * c.dispatch_row_bytes, rr))
            out.append(CommPhase("prefetch", K.PREFETCH, d, G, copy_RR * c.weight_bytes, copy_RR))
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
            out.append(CommPhase("grad_reduce", K.GRAD_REDUCE, d, G, copy_RR.T * c.grad_bytes, copy_RR.T))
        else:
            raise PlanError(f"direction ({direction!r}) must be 'forward' or 'backward'")
        return out

    def bytes_summary(self) -> dict[str, int]:
        """Bytes that cross a link (local copies excluded), by phase kind and by link class.

        Keys: dispatch, combine, prefetch, migrate, grad_reduce (backward), intra_node, inter_node
        (forward and backward together).
        """
        out = dict(dispatch=0, combine=0, prefetch=0, migrate=0, grad_reduce=0, intra_node=0, inter_node=0)
        for direction in ("forward", "backward"):
            for p in self.phases(direction):
                intra, inter = p.split_bytes(self.cluster)
                if direction == "forward" or p.kind == PhaseKind.GRAD_REDUCE:
                    out[p.kind.value] += intra + inter
                out["intra_node"] += intra
                out["inter_node"] += inter
        return out

    def summary(self) -> dict[str, Any]:
        """The machine-readable summary ``moonep-sim plan --json`` prints."""
        real = self.real_rows_R()
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
            "duplicates_avoided": int(self.entry_dup_TK.sum()),
            "weight_copies": self.weight_copies,
            "migrations": int(self.migrate_expert_X.size),
            "hops": len(self.hops),
            "bytes": self.bytes_summary(),
            "plan_seconds": self.plan_seconds,
            "invariant_violations": validate(self),
        }


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, type(None)))


# ---------------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------------

def validate(plan: Plan) -> list[str]:
    """Check a Plan's invariants; returns the violated ones as sentences (empty list: valid).

    Holds for every strategy: shapes agree; slots sorted by rank, contiguous and padded as stated;
    every kept entry computed exactly once, at a slot of its expert, at the row it names; every
    hop well-formed (sorted, in range, in scope, each destination row written once); every final
    row traces back through the hops to its entry's token (so no row is misrouted); duplicates
    share a destination with an earlier entry of their token; copies come from a resident home;
    capacity respected.
    """
    v: list[str] = []
    R, E, K = plan.ranks, plan.num_experts, plan.top_k
    T = plan.num_tokens
    if plan.tokens_per_rank_R.shape != (R,) or int(plan.tokens_per_rank_R.sum()) != T:
        return [f"tokens_per_rank ({plan.tokens_per_rank_R.tolist()}) must have R={R} entries summing to T={T}"]
    for name in ("entry_rank_TK", "entry_row_TK", "entry_dup_TK", "entry_weight_TK"):
        if getattr(plan, name).shape != (T, K):
            v.append(f"{name} shape {list(getattr(plan, name).shape)} must be [{T}, {K}]")
    S = plan.slot_rank_S.size
    for name in ("slot_expert_S", "slot_home_S", "slot_offset_S", "slot_rows_S", "slot_padded_S"):
        if getattr(plan, name).shape != (S,):
            v.append(f"{name} must have S={S} entries")
    if v:
        return v
    if S and ((plan.slot_rank_S < 0) | (plan.slot_rank_S >= R)).any():
        return ["slot ranks must lie in [0, R)"]
    if (np.diff(plan.slot_rank_S) < 0).any():
        v.append("slots must be sorted by rank")
    if ((plan.slot_expert_S < 0) | (plan.slot_expert_S >= E)).any():
        v.append("slot experts must lie in [0, E)")
    if (plan.slot_padded_S < plan.slot_rows_S).any():
        v.append("slot_padded must be >= slot_rows")
    if plan.token_padding > 1 and (plan.slot_padded_S % plan.token_padding).any():
        v.append(f"slot_padded must be a multiple of token_padding ({plan.token_padding})")
    rows_R = plan.rows_R()
    first = np.searchsorted(plan.slot_rank_S, np.arange(R))
    exp_off = np.cumsum(plan.slot_padded_S) - plan.slot_padded_S
    exp_off = exp_off - np.concatenate([[0], np.cumsum(plan.slot_padded_S)])[first][plan.slot_rank_S]
    if not np.array_equal(exp_off, plan.slot_offset_S):
        v.append("slot_offset must be the running sum of slot_padded within each rank")
    if v:
        return v
    W = int(rows_R.sum())
    if plan.row_entry_W.shape != (W,) or plan.expand_src_row_W.shape != (W,):
        return [f"row_entry and expand_src_row must have W={W} rows (sum of padded slot rows)"]
    row_off = plan.row_off_R()

    # entries <-> rows
    rank_e = plan.entry_rank_TK.ravel()
    row_e = plan.entry_row_TK.ravel()
    if rank_e.size and (int(rank_e.min()) < -1 or int(rank_e.max()) >= R):
        v.append("entry_rank must be -1 or a rank in [0, R)")
        return v
    kept = rank_e >= 0
    all_kept = bool(kept.all())
    if all_kept:  # dropless strategies: skip the masked copies
        rank_k, row_k, eid = rank_e, row_e, np.arange(rank_e.size, dtype=np.int64)
    else:
        rank_k, row_k, eid = rank_e[kept], row_e[kept], np.flatnonzero(kept)
    if ((row_k.size and int(row_k.min()) < 0) or (row_k >= rows_R[rank_k]).any()
            or (not all_kept and (row_e[~kept] != -1).any())):
        v.append("entry_row must be a row of the destination rank (or -1 when dropped)")
        return v
    grow = row_off[rank_k] + row_k
    del rank_k, row_k
    if not np.array_equal(plan.row_entry_W[grow], eid):
        v.append("row_entry must name, at each kept entry's row, that entry (conservation)")
    del grow
    real_rows = plan.row_entry_W >= 0
    if int(np.count_nonzero(real_rows)) != eid.size:
        v.append(f"final rows holding entries ({int(np.count_nonzero(real_rows))}) must equal kept entries "
                 f"({eid.size}): every kept entry lands exactly once")
    # row -> slot: each slot's segment is slot_rows real rows then padding (padded >= rows here)
    row_rank = np.repeat(np.arange(R), rows_R)
    real_S = np.maximum(plan.slot_rows_S, 0)  # a negative count means no real rows
    seg_len = np.stack([real_S, plan.slot_padded_S - real_S], axis=1).ravel()
    is_real_pos = np.repeat(np.tile(np.array([True, False]), S), seg_len)
    if not np.array_equal(is_real_pos, real_rows):
        v.append("each slot's first slot_rows rows must hold entries and the rest be padding")
    del is_real_pos
    # the entry's expert is recovered from the routing only via the plan's slots
    real_cum = np.concatenate([[0], np.cumsum(real_rows.view(np.uint8), dtype=np.int64)])
    slot_end = np.cumsum(plan.slot_padded_S)
    if ((real_cum[slot_end] - real_cum[slot_end - plan.slot_padded_S]) != plan.slot_rows_S).any():
        v.append("slot_rows must count the entries in each slot")
    del real_cum
    # duplicates share the rank of an earlier entry of the same token
    dup = plan.entry_dup_TK
    if dup.any():
        # per token, a bit set of the ranks its earlier entries go to (64 ranks per word)
        has = np.flatnonzero(dup.any(axis=1))  # only tokens with a duplicate need the check
        ranks_TK, dup_TK = plan.entry_rank_TK[has], dup[has]
        seen = np.zeros((has.size, (R + 63) // 64), dtype=np.uint64)
        tok = np.arange(has.size)
        bad_dup = False
        for k in range(K):
            col = ranks_TK[:, k]
            valid = col >= 0
            word = np.where(valid, col >> 6, 0)
            bit = np.left_shift(np.uint64(1), (col & 63).astype(np.uint64))
            cur = seen[tok, word]
            had = ((cur & bit) != 0) & valid
            if (dup_TK[:, k] & ~had).any():
                bad_dup = True
                break
            seen[tok, word] = cur | np.where(valid, bit, np.uint64(0))
        if bad_dup:
            v.append("a duplicate entry must share its destination rank with an earlier entry of its token")
    # copies: home must hold the expert
    cp = plan.slot_home_S != plan.slot_rank_S
    if cp.any():
        resident = set(zip(plan.slot_rank_S[~cp].tolist(), plan.slot_expert_S[~cp].tolist()))
        bad = [(int(h), int(e)) for h, e in zip(plan.slot_home_S[cp], plan.slot_expert_S[cp]) if (int(h), int(e)) not in resident]
        if bad:
            v.append(f"copied experts must be resident on their home rank; (home, expert) {bad[:4]} are not")
    if plan.capacity_R is not None and (rows_R > plan.capacity_R).any():
        r = int(np.argmax(rows_R > plan.capacity_R))
        v.append(f"rank {r} rows ({int(rows_R[r])}) must be <= capacity ({int(plan.capacity_R[r])})")

    # hops: well-formed and provenance
    node = plan.cluster.node_of_rank()
    local = np.arange(R) % plan.cluster.gpus_per_node
    origin = np.arange(T, dtype=np.int64)  # buffer 0: token ids, ranks concatenated
    buf_off = plan.tok_off_R()
    for i, h in enumerate(plan.hops):
        m = h.src_rank_M.size
        if not all(a.shape == (m,) for a in (h.src_row_M, h.dst_rank_M, h.dst_row_M)) or h.dst_rows_R.shape != (R,):
            v.append(f"hop {i}: message arrays must share one length and dst_rows_R have R entries")
            return v
        if h.scope not in SCOPES:
            v.append(f"hop {i}: scope ({h.scope!r}) must be one of {SCOPES}")
        if m and (min(int(h.src_rank_M.min()), int(h.dst_rank_M.min())) < 0
                  or max(int(h.src_rank_M.max()), int(h.dst_rank_M.max())) >= R):
            v.append(f"hop {i}: ranks must lie in [0, R)")
            return v
        key = h.src_rank_M * R + h.dst_rank_M
        if (np.diff(key) < 0).any():
            v.append(f"hop {i}: messages must be sorted by (src_rank, dst_rank)")
        src_rows = np.diff(buf_off)
        if m and (int(h.src_row_M.min()) < -1 or (h.src_row_M >= src_rows[h.src_rank_M]).any()):
            v.append(f"hop {i}: src_row must be -1 or a row of the source buffer")
            return v
        if m and (int(h.dst_row_M.min()) < 0 or (h.dst_row_M >= h.dst_rows_R[h.dst_rank_M]).any()):
            v.append(f"hop {i}: dst_row must be a row of the destination buffer")
            return v
        dst_off = np.concatenate([[0], np.cumsum(h.dst_rows_R)])
        gdst = dst_off[h.dst_rank_M] + h.dst_row_M
        if m and np.bincount(gdst, minlength=int(dst_off[-1])).max() > 1:
            v.append(f"hop {i}: each destination row must be written once")
        if h.scope == "intra_node" and (node[h.src_rank_M] != node[h.dst_rank_M]).any():
            v.append(f"hop {i}: intra_node scope must not cross nodes")
        if h.scope == "inter_node" and (local[h.src_rank_M] != local[h.dst_rank_M]).any():
            v.append(f"hop {i}: inter_node scope must connect equal local indices only")
        new_origin = np.full(int(dst_off[-1]), -2, dtype=np.int64)  # -2 never written, -1 zero row
        src_g = buf_off[h.src_rank_M] + h.src_row_M
        new_origin[gdst] = np.where(h.src_row_M >= 0, origin[np.maximum(src_g, 0)], -1)
        origin, buf_off = new_origin, dst_off
    # final gather
    last_rows = np.diff(buf_off)
    exp = plan.expand_src_row_W
    if exp.size and (int(exp.min()) < -1 or (exp >= last_rows[row_rank]).any()):
        v.append("expand_src_row must be -1 or a row of the last buffer on the same rank")
        return v
    final_origin = np.where(exp >= 0, origin[np.maximum(buf_off[row_rank] + exp, 0)], -1)
    want = np.where(real_rows, _div_k(plan.row_entry_W, max(K, 1)), -1)
    if (real_rows & (exp < 0)).any():
        v.append("every real row must be gathered from a buffer row")
    bad = real_rows & (final_origin != want)
    if bad.any():
        w = int(np.argmax(bad))
        v.append(f"row {w} of rank {int(row_rank[w])} must hold token {int(want[w])} but receives "
                 f"{'nothing' if final_origin[w] == -2 else 'token ' + str(int(final_origin[w]))} (misrouted)")
    return v


def check(plan: Plan) -> Plan:
    """Raise :class:`PlanError` listing the violated invariants; return the plan if valid."""
    errs = validate(plan)
    if errs:
        raise PlanError(f"plan of strategy {plan.strategy!r} violates {len(errs)} invariant(s): " + "; ".join(errs))
    return plan


# ---------------------------------------------------------------------------------------------
# Builders shared by strategies
# ---------------------------------------------------------------------------------------------

def _small_key_dtype(n_keys: int) -> type:
    """Smallest unsigned dtype holding ``n_keys`` distinct keys (int64 beyond 16 bits)."""
    return np.uint8 if n_keys <= 1 << 8 else np.uint16 if n_keys <= 1 << 16 else np.int64


def _stable_order(key_N: np.ndarray, n_keys: int) -> np.ndarray:
    """int64 [N] permutation that sorts ``key_N`` (integers in [0, n_keys)) stably.

    numpy's stable sort is a radix sort for integer dtypes of 16 bits or less (one or two passes
    over the data) and a merge/tim sort otherwise, so the key is narrowed to the smallest unsigned
    dtype that holds ``n_keys`` values first.
    """
    return np.argsort(key_N.astype(_small_key_dtype(n_keys), copy=False), kind="stable")


def _div_k(entry_N: np.ndarray, top_k: int) -> np.ndarray:
    """Token of each flat entry id (``e // K``; a shift when K is a power of two)."""
    if top_k & (top_k - 1) == 0:
        return entry_N >> (top_k.bit_length() - 1)
    return entry_N // top_k


@dataclass(frozen=True)
class _Layout:
    """What :func:`layout_slots` computes, plus the slot-sorted entry order it came from.

    order_N: int64 [N] entries sorted by (slot, entry); the first ``n_drop`` are the dropped ones.
    grow_K: int64 [N - n_drop] global final row (ranks concatenated) of ``order_N[n_drop:]``,
      increasing: slots are sorted by rank and laid out in order within a rank. None when the
      layout has no padding rows (the global rows are then simply 0, 1, 2, ...).
    rows_R: int64 [R] padded rows of each rank.
    """

    slot_rows_S: np.ndarray
    slot_padded_S: np.ndarray
    slot_offset_S: np.ndarray
    entry_row_N: np.ndarray
    order_N: np.ndarray
    n_drop: int
    rows_R: np.ndarray
    grow_K: np.ndarray | None


def _sorted_layout(order_N: np.ndarray, n_drop: int, slot_rows_S: np.ndarray, slot_rank_S: np.ndarray,
                   token_padding: int, min_rows_S: np.ndarray | None, ranks: int | None) -> _Layout:
    """The expert-grouped layout from entries already sorted by (slot, entry) (dropped first)."""
    S = slot_rank_S.size
    N = order_N.size
    padded = slot_rows_S if min_rows_S is None else np.maximum(slot_rows_S, min_rows_S)
    tp = max(int(token_padding), 1)
    padded = (padded + tp - 1) // tp * tp
    cum = np.cumsum(padded) - padded
    R = int(slot_rank_S.max()) + 1 if S else 0
    first = np.searchsorted(slot_rank_S, np.arange(R))
    rank_base = np.concatenate([[0], np.cumsum(padded)])[first]
    offset = cum - rank_base[slot_rank_S] if S else cum
    # sorted position p of a kept entry of slot s: row within its rank = offset[s] + (p - n_drop -
    # start[s]); global row (ranks concatenated) = cum[s] + (p - n_drop - start[s])
    starts = np.cumsum(slot_rows_S) - slot_rows_S
    n_kept = N - n_drop
    row_sorted = np.repeat(offset - starts, slot_rows_S)
    row_sorted += np.arange(n_kept, dtype=np.int64)
    entry_row = np.empty(N, dtype=np.int64)
    entry_row[order_N[:n_drop]] = -1
    entry_row[order_N[n_drop:]] = row_sorted
    if int(padded.sum()) == n_kept:  # no padding rows: global rows are 0..n_kept-1 in this order
        grow = None
    else:
        grow = row_sorted
        grow += np.repeat(cum - offset, slot_rows_S)
    del row_sorted
    nR = R if ranks is None else int(ranks)
    rows_R = np.bincount(slot_rank_S, weights=padded, minlength=nR).astype(np.int64)
    return _Layout(slot_rows_S, padded, offset, entry_row, order_N, n_drop, rows_R, grow)


def _slot_sort(entry_slot_N: np.ndarray, num_slots: int) -> tuple[np.ndarray, int, np.ndarray]:
    """Entries sorted by (slot, entry), dropped (-1) first: (order_N, n_drop, slot_rows_S).

    One counting pass and one stable radix sort on a small-int key (0 = dropped, s+1 = slot s).
    """
    key = entry_slot_N.astype(_small_key_dtype(num_slots + 1), copy=True)
    key += 1
    counts = np.bincount(key, minlength=num_slots + 1).astype(np.int64)
    order = _stable_order(key, num_slots + 1)
    return order, int(counts[0]), counts[1:]


def _layout(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int,
            min_rows_S: np.ndarray | None, ranks: int | None = None) -> _Layout:
    order, n_drop, slot_rows = _slot_sort(entry_slot_N, slot_rank_S.size)
    return _sorted_layout(order, n_drop, slot_rows, slot_rank_S, token_padding, min_rows_S, ranks)


def layout_slots(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int = 1,
                 min_rows_S: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Expert-grouped layout from each entry's slot (vectorised).

    entry_slot_N: int64 [N] slot of each entry in flat entry order (e = t*K + k), -1 = dropped.
    slot_rank_S: int64 [S] sorted.  min_rows_S: optional [S] rows to allocate at least (capacity pad).
    Returns (slot_rows_S, slot_padded_S, slot_offset_S, entry_row_N): entries keep their global
    order within a slot (tokens of source ranks concatenated in rank order, then k).
    """
    lay = _layout(np.asarray(entry_slot_N, dtype=np.int64), np.asarray(slot_rank_S, dtype=np.int64),
                  token_padding, min_rows_S)
    return lay.slot_rows_S, lay.slot_padded_S, lay.slot_offset_S, lay.entry_row_N


def _src_dst_order(entry_rank_N: np.ndarray, src_rank_T: np.ndarray, top_k: int, ranks: int):
    """Kept entries sorted stably by (source rank, destination rank), and entries per (src, dst).

    Requires tokens in rank order (``src_rank_T`` non-decreasing, as in every GlobalRouting).
    Returns (order_kept, ecnt): int64 [N_kept] entry ids; int64 [R*R] entries of each
    (src, dst) block, src-major. Each source rank's entries are a contiguous run, sorted by
    destination alone with a one-byte radix sort per run (R < 255); otherwise one sort of the
    key ``src*R + dst``.
    """
    R, K, N = ranks, top_k, entry_rank_N.size
    if R < 255:
        tok_bound = np.searchsorted(src_rank_T, np.arange(R + 1))
        d8 = entry_rank_N.astype(np.uint8)  # dropped (-1) becomes 255 and sorts last in its run
        ecnt = np.zeros((R, R), dtype=np.int64)
        for r in range(R):
            lo, hi = int(tok_bound[r]) * K, int(tok_bound[r + 1]) * K
            if hi > lo:
                ecnt[r] = np.bincount(d8[lo:hi], minlength=256)[:R]
        order = np.empty(int(ecnt.sum()), dtype=np.int64)
        pos = 0
        for r in range(R):
            lo, hi = int(tok_bound[r]) * K, int(tok_bound[r + 1]) * K
            nk = int(ecnt[r].sum())
            if nk:
                np.add(np.argsort(d8[lo:hi], kind="stable")[:nk], lo, out=order[pos:pos + nk])
                pos += nk
        return order, ecnt.ravel()
    n_keys = R * R + 1
    dt = _small_key_dtype(n_keys)
    key = np.repeat((src_rank_T * R).astype(dt), K)
    key += entry_rank_N.astype(dt)
    drop = entry_rank_N < 0
    key[drop] = R * R
    order = _stable_order(key, n_keys)
    ecnt = np.bincount(key, minlength=n_keys)[: R * R].astype(np.int64)
    return order[: N - int(np.count_nonzero(drop))], ecnt


def _single_hop_any_order(entry_rank_N: np.ndarray, src_rank_T: np.ndarray, tok_off_R: np.ndarray,
                          top_k: int, ranks: int, dedup: bool):
    """:func:`single_hop_messages` for tokens not in rank order (receive rows in token order)."""
    N = entry_rank_N.size
    kept = np.flatnonzero(entry_rank_N >= 0)
    dst = entry_rank_N[kept]
    tok = kept // top_k
    order = np.argsort(dst, kind="stable")  # (dst, entry) order
    d_s, t_s = dst[order], tok[order]
    first = np.ones(order.size, dtype=bool)
    if dedup:
        first[1:] = (d_s[1:] != d_s[:-1]) | (t_s[1:] != t_s[:-1])
    msg_of_sorted = np.cumsum(first) - 1
    msg_dst = d_s[first]
    msg_tok = t_s[first]
    n_msg = msg_dst.size
    per_dst = np.bincount(msg_dst, minlength=ranks)
    dst_start = np.cumsum(per_dst) - per_dst
    msg_row = np.arange(n_msg, dtype=np.int64) - dst_start[msg_dst]
    entry_buf_row = np.full(N, -1, dtype=np.int64)
    entry_buf_row[kept[order]] = msg_row[msg_of_sorted]
    entry_dup = np.zeros(N, dtype=bool)
    entry_dup[kept[order]] = ~first
    msg_src = src_rank_T[msg_tok]
    o2 = np.argsort(msg_src, kind="stable")  # (src, dst, token): messages were in (dst, token) order
    hop = Hop("global", msg_src[o2], (msg_tok - tok_off_R[msg_src])[o2], msg_dst[o2], msg_row[o2],
              per_dst.astype(np.int64))
    return hop, entry_buf_row, entry_dup


def single_hop_messages(entry_rank_N: np.ndarray, src_rank_T: np.ndarray, tok_off_R: np.ndarray,
                        top_k: int, ranks: int, dedup: bool):
    """One global hop sending each kept entry's token to its destination rank.

    With ``dedup`` a token is sent once per destination rank; otherwise once per entry.
    The receive buffer on each rank holds rows ordered by (source rank, token, k).
    Returns (hop, entry_buf_row_N, entry_dup_N): the Hop, each entry's row in the receive buffer
    (-1 dropped), and the duplicate flags.
    """
    entry_rank_N = np.asarray(entry_rank_N, dtype=np.int64)
    src_rank_T = np.asarray(src_rank_T, dtype=np.int64)
    N, R, K = entry_rank_N.size, int(ranks), max(int(top_k), 1)
    if src_rank_T.size and not bool((np.diff(src_rank_T) >= 0).all()):
        return _single_hop_any_order(entry_rank_N, src_rank_T, np.asarray(tok_off_R, dtype=np.int64), K, R, dedup)
    # kept entries in (src, dst, entry) order = the hop's message order; entries of one token are
    # adjacent within a (src, dst) block, so per-destination dedup compares neighbours
    order, ecnt = _src_dst_order(entry_rank_N, src_rank_T, K, R)
    n_kept = order.size
    ebound = np.concatenate([[0], np.cumsum(ecnt)])  # entry-domain bounds of the R*R blocks
    if dedup and n_kept:
        tok_s = _div_k(order, K)
        first = np.empty(n_kept, dtype=bool)
        first[0] = True
        np.not_equal(tok_s[1:], tok_s[:-1], out=first[1:])
        first[ebound[:-1][ecnt > 0]] = True  # a new (src, dst) block starts a new message
        msg_idx = np.flatnonzero(first)
        msg_tok = tok_s[msg_idx]
        del tok_s
        mcum = np.cumsum(first.view(np.uint8), dtype=np.int64)  # messages up to and including p
        m_at = np.zeros(ebound.size, dtype=np.int64)  # messages before each block bound
        nz = ebound > 0
        m_at[nz] = mcum[ebound[nz] - 1]
        cnt = m_at[1:] - m_at[:-1]
    else:
        msg_tok = _div_k(order, K)
        cnt = ecnt
        first = mcum = None
    msg_src, msg_dst, msg_row, per_dst = _block_messages(cnt, R)
    src_row = msg_tok if msg_tok is not order else msg_tok.copy()
    src_row -= np.asarray(tok_off_R, dtype=np.int64)[msg_src]  # token -> row on its rank
    del msg_tok
    entry_buf_row = np.full(N, -1, dtype=np.int64)
    entry_dup = np.zeros(N, dtype=bool)
    if first is not None:
        mcum -= 1
        entry_buf_row[order] = msg_row[mcum]
        del mcum
        np.logical_not(first, out=first)
        entry_dup[order] = first
    else:
        entry_buf_row[order] = msg_row
    hop = Hop("global", msg_src, src_row, msg_dst, msg_row, per_dst)
    return hop, entry_buf_row, entry_dup


def _block_messages(cnt: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Messages laid out in (src, dst) blocks, ``cnt[src*R + dst]`` in each, in message order.

    Returns (src_rank_M, dst_rank_M, dst_row_M, per_dst_R): each destination's receive buffer holds
    its messages in (source rank, message order) order, so dst_row numbers them that way.
    """
    cnt_RR = cnt.reshape(R, R)  # [src, dst]
    per_dst = cnt_RR.sum(axis=0).astype(np.int64)
    block_start = np.cumsum(cnt) - cnt  # first message of each (src, dst) block
    dst_row0 = (np.cumsum(cnt_RR, axis=0) - cnt_RR).ravel()  # its first receive row
    blocks = np.arange(R * R, dtype=np.int64)
    row = np.repeat(dst_row0 - block_start, cnt)
    row += np.arange(row.size, dtype=np.int64)
    return np.repeat(blocks // R, cnt), np.repeat(blocks % R, cnt), row, per_dst


def _final_rows(lay, kept_sorted: np.ndarray, entry_buf_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row_entry_W, expand_src_row_W) from the layout ``lay`` (see :func:`_layout`), the kept entries
    in slot order and each entry's row in the last hop's buffer; padding rows get -1."""
    if lay.grow_K is None:  # no padding rows: the final rows are the slot-sorted kept entries
        return kept_sorted.copy(), entry_buf_row[kept_sorted]
    W = int(lay.rows_R.sum())
    row_entry = np.full(W, -1, dtype=np.int64)
    expand = np.full(W, -1, dtype=np.int64)
    row_entry[lay.grow_K] = kept_sorted
    expand[lay.grow_K] = entry_buf_row[kept_sorted]
    return row_entry, expand


def _plan_from_order(strategy: str, options: dict[str, Any], routing: GlobalRouting, cluster: ClusterShape,
                     costs: RowCosts, slot_rank_S: np.ndarray, slot_expert_S: np.ndarray, slot_home_S: np.ndarray,
                     order_N: np.ndarray, n_drop: int, slot_rows_S: np.ndarray, *, dedup: bool,
                     token_padding: int = 1, min_rows_S: np.ndarray | None = None,
                     capacity_R: np.ndarray | None = None, started: float | None = None, **extra) -> Plan:
    """:func:`plan_from_slots` from entries already sorted by (slot, entry), dropped ones first.

    For planners that know this order without sorting (``moonep`` derives it from its per-expert
    order). ``slot_rows_S[s]`` entries of slot s follow the ``n_drop`` dropped ones, slot by slot.
    """
    T, K = routing.topk_ids_TK.shape
    R = cluster.ranks
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    lay = _sorted_layout(order_N, n_drop, slot_rows_S, slot_rank_S, token_padding, min_rows_S, R)
    kept_sorted = order_N[n_drop:]
    entry_rank = np.empty(T * K, dtype=np.int64)
    entry_rank[order_N[:n_drop]] = -1
    entry_rank[kept_sorted] = np.repeat(slot_rank_S, slot_rows_S)
    hop, entry_buf_row, entry_dup = single_hop_messages(entry_rank, routing.src_rank_T(), routing.tok_off_R(),
                                                        K, R, dedup)
    row_entry, expand = _final_rows(lay, kept_sorted, entry_buf_row)
    del entry_buf_row
    return Plan(
        strategy=strategy, options=dict(options), cluster=cluster, num_experts=routing.num_experts, top_k=K,
        tokens_per_rank_R=routing.tokens_per_rank_R, costs=costs, token_padding=max(int(token_padding), 1),
        entry_rank_TK=entry_rank.reshape(T, K), entry_row_TK=lay.entry_row_N.reshape(T, K),
        entry_dup_TK=entry_dup.reshape(T, K), entry_weight_TK=routing.topk_weights_TK,
        slot_rank_S=slot_rank_S, slot_expert_S=np.asarray(slot_expert_S, dtype=np.int64),
        slot_home_S=np.asarray(slot_home_S, dtype=np.int64), slot_offset_S=lay.slot_offset_S,
        slot_rows_S=lay.slot_rows_S, slot_padded_S=lay.slot_padded_S, row_entry_W=row_entry,
        expand_src_row_W=expand, hops=(hop,), capacity_R=capacity_R,
        plan_seconds=(time.perf_counter() - started) if started is not None else 0.0, **extra)


def plan_from_slots(strategy: str, options: dict[str, Any], routing: GlobalRouting, cluster: ClusterShape,
                    costs: RowCosts, slot_rank_S: np.ndarray, slot_expert_S: np.ndarray, slot_home_S: np.ndarray,
                    entry_slot_TK: np.ndarray, *, dedup: bool, token_padding: int = 1,
                    min_rows_S: np.ndarray | None = None, capacity_R: np.ndarray | None = None,
                    started: float | None = None, **extra) -> Plan:
    """A single-hop Plan from each entry's slot: the builder behind most strategies.

    entry_slot_TK: int64 [T, K] index into the slot arrays (which must be sorted by rank), -1 =
    dropped. The hop sends tokens straight to the slot's rank (deduplicated per rank if ``dedup``);
    the destination expands them into the expert-grouped layout.
    """
    slot_rank_S = np.asarray(slot_rank_S, dtype=np.int64)
    entry_slot = np.asarray(entry_slot_TK, dtype=np.int64).ravel()
    order, n_drop, slot_rows = _slot_sort(entry_slot, slot_rank_S.size)
    return _plan_from_order(strategy, options, routing, cluster, costs, slot_rank_S, slot_expert_S, slot_home_S,
                            order, n_drop, slot_rows, dedup=dedup, token_padding=token_padding,
                            min_rows_S=min_rows_S, capacity_R=capacity_R, started=started, **extra)


def concat_ranks(parts: Iterable[np.ndarray]) -> np.ndarray:
    """Concatenate per-rank int64 arrays (helper for multi-hop builders)."""
    parts = list(parts)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
