"""Where things live: ranks in nodes (ClusterShape) and experts on ranks (Placement).

Notation: R ranks, G GPUs (ranks) per node, E experts, S expert slots (physical expert
instances; S == E without replicas).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moonep_sim.errors import ConfigError, require


@dataclass(frozen=True)
class ClusterShape:
    """R ranks grouped in nodes of ``gpus_per_node`` consecutive ranks."""

    ranks: int
    gpus_per_node: int = 0  # 0 = all ranks in one node

    def __post_init__(self) -> None:
        require(self.ranks >= 1, f"ranks ({self.ranks}) must be >= 1")
        if self.gpus_per_node == 0:
            object.__setattr__(self, "gpus_per_node", self.ranks)
        require(self.gpus_per_node >= 1, f"gpus_per_node ({self.gpus_per_node}) must be >= 1")
        require(self.ranks % self.gpus_per_node == 0,
                f"ranks ({self.ranks}) must be divisible by gpus_per_node ({self.gpus_per_node})")

    @property
    def num_nodes(self) -> int:
        return self.ranks // self.gpus_per_node

    # -- geometry: the one place that says which node and which rail a rank is on ---------------
    # Rank r sits on node ``r // G`` at local index ``r % G``; its NIC is on rail ``r % G`` (a
    # rail-optimised fabric: NIC i of every node on leaf i). Strategies, executors and the
    # simulator ask these methods instead of writing the rule again. Each takes a rank or an
    # integer array of ranks and returns the same shape.

    def node_of(self, rank):
        """Node of ``rank`` (int or integer array)."""
        return rank // self.gpus_per_node

    def local_index(self, rank):
        """Index of ``rank`` within its node, in [0, G) (int or integer array)."""
        return rank % self.gpus_per_node

    rail_of = local_index  # the rail (leaf switch) of a rank's NIC is its local index

    def rank_at(self, node, local):
        """The rank at ``local`` index on ``node`` (ints or broadcastable integer arrays)."""
        return node * self.gpus_per_node + local

    def same_node(self, a, b):
        """True where ranks ``a`` and ``b`` share a node (broadcast over arrays)."""
        return self.node_of(a) == self.node_of(b)

    def same_rail(self, a, b):
        """True where ranks ``a`` and ``b`` have the same local index (their NICs share a rail)."""
        return self.local_index(a) == self.local_index(b)

    def node_of_rank(self) -> np.ndarray:
        """int64 [R]: node of each rank."""
        return self.node_of(np.arange(self.ranks, dtype=np.int64))

    def intra_node_RR(self) -> np.ndarray:
        """bool [R, R]: True where source and destination share a node (diagonal included)."""
        r = np.arange(self.ranks, dtype=np.int64)
        return self.same_node(r[:, None], r[None, :])


@dataclass(frozen=True)
class Placement:
    """Expert slots on ranks. Slot s holds expert ``slot_expert_S[s]`` on rank ``slot_rank_S[s]``.

    Slots are sorted by rank (and by position within a rank). ``home_E[e]`` is the rank that owns
    expert e's master weights (and receives its reduced gradient); a slot on another rank is a
    replica (static, e.g. EPLB) whose weights are already resident.
    """

    num_experts: int
    ranks: int
    slot_rank_S: np.ndarray
    slot_expert_S: np.ndarray
    home_E: np.ndarray

    def __post_init__(self) -> None:
        E, R = self.num_experts, self.ranks
        sr, se, h = (np.asarray(a, dtype=np.int64) for a in (self.slot_rank_S, self.slot_expert_S, self.home_E))
        object.__setattr__(self, "slot_rank_S", sr)
        object.__setattr__(self, "slot_expert_S", se)
        object.__setattr__(self, "home_E", h)
        require(sr.shape == se.shape and sr.ndim == 1, "slot_rank_S and slot_expert_S must be 1-D of one length")
        require(h.shape == (E,), f"home_E length ({h.shape}) must equal num_experts ({E})")
        require(bool(((sr >= 0) & (sr < R)).all()), f"slot ranks must lie in [0, {R})")
        require(bool(((se >= 0) & (se < E)).all()), f"slot experts must lie in [0, {E})")
        require(bool((np.diff(sr) >= 0).all()), "slots must be sorted by rank")
        have = np.zeros(E, dtype=bool)
        have[se] = True
        missing = np.flatnonzero(~have)
        require(missing.size == 0, f"every expert must have a slot; experts {missing[:8].tolist()} have none")
        home_ok = np.zeros(E, dtype=bool)
        home_ok[se[sr == h[se]]] = True
        require(bool(home_ok.all()), "every expert must have a slot on its home rank")

    @classmethod
    def home_groups(cls, num_experts: int, ranks: int) -> "Placement":
        """Contiguous home groups: rank h owns experts [h*epn, (h+1)*epn), epn = E / R."""
        if num_experts % ranks:
            raise ConfigError(f"num_experts ({num_experts}) must be divisible by ranks ({ranks}) "
                              "for home-group placement")
        epn = num_experts // ranks
        e = np.arange(num_experts, dtype=np.int64)
        return cls(num_experts, ranks, e // epn, e, e // epn)

    @classmethod
    def from_map(cls, home_E: np.ndarray | list[int], ranks: int) -> "Placement":
        """A custom expert -> rank map (one slot per expert, sorted by rank then expert id)."""
        h = np.asarray(home_E, dtype=np.int64)
        if h.ndim != 1 or ((h < 0) | (h >= ranks)).any():
            raise ConfigError(f"expert map values must be ranks in [0, {ranks})")
        order = np.lexsort((np.arange(h.size), h))
        return cls(h.size, ranks, h[order], order, h)

    @classmethod
    def round_robin(cls, num_experts: int, ranks: int) -> "Placement":
        """Expert e homed on rank ``e % R`` (strided; any E >= R, spreads neighbouring experts)."""
        require(num_experts >= ranks, f"num_experts ({num_experts}) must be >= ranks ({ranks}) so every "
                                      "rank holds an expert")
        return cls.from_map(np.arange(num_experts, dtype=np.int64) % ranks, ranks)

    @classmethod
    def redundant(cls, num_experts: int, ranks: int, redundant: int) -> "Placement":
        """``E + N`` expert slots, ``(E + N) / R`` on every rank (a serving deployment's redundant
        expert slots, e.g. DeepSeek-V3's 256 + 32 over EP72 or EP144): the E homes in contiguous
        groups as even as they go (the first ``E mod R`` ranks one more), each rank's remaining
        slots holding replicas -- of experts 0, 1, 2, ... in turn, each on a rank that lacks it (a
        starting placement: EPLB re-places the replicas from load, ``strategies/eplb.py``)."""
        E, R, N = int(num_experts), int(ranks), int(redundant)
        require(N >= 0, f"redundant experts ({N}) must be >= 0")
        S = E + N
        require(R >= 1 and S % R == 0, f"ranks ({R}) must divide the expert slots ({S} = {E} experts + {N} "
                                       "redundant): every rank holds the same number of slots")
        per = S // R
        require(per >= -(-E // R), f"expert slots per rank ({per}) must hold each rank's home experts "
                                   f"({-(-E // R)} of {E} over {R} ranks)")
        require(per <= E, f"expert slots per rank ({per}) must be <= the experts ({E}): a rank holds an expert "
                          "at most once")
        homes = np.full(R, E // R, dtype=np.int64)
        homes[: E % R] += 1
        off = np.concatenate([[0], np.cumsum(homes)])
        home_E = np.repeat(np.arange(R, dtype=np.int64), homes)
        nxt = 0
        ranks_S, experts_S = [], []
        for r in range(R):  # loop over ranks and their few replica slots, not tokens
            own = list(range(int(off[r]), int(off[r + 1])))
            while len(own) < per:
                e = nxt % E
                nxt += 1
                if e not in own:
                    own.append(e)
            ranks_S += [r] * per
            experts_S += own
        return cls(E, R, np.asarray(ranks_S, dtype=np.int64), np.asarray(experts_S, dtype=np.int64), home_E)

    @property
    def num_slots(self) -> int:
        return int(self.slot_rank_S.size)
