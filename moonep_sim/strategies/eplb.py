"""``eplb``: static redundant experts planned from past load (DeepSeek's EPLB).

Anchor: DeepSeek's Expert Parallelism Load Balancer (EPLB, 2025). From a window of past per-expert
loads it replicates the hottest experts into ``num_redundant`` extra slots (greedy: each extra slot
goes to the expert with the highest load per replica), then packs them onto GPUs with a balanced
greedy packing -- hierarchically when expert groups divide among nodes (groups onto nodes, then
replicas within each node, then replicas onto that node's GPUs), globally otherwise. Each token
entry then picks one replica of its expert (round-robin in global order, or contiguous shares).

The placement is static within a window: replica weights are resident (no per-step prefetch, no
gradient reduce -- the inference setting EPLB was built for); when the placement changes between
windows, every (GPU, expert) that is new is charged one weight migration (``migrate_*`` fields of
the Plan) from a GPU that held the expert before, on the same node when possible. Planned on past
load, it lags drift: DeepSeek reported a balancedness (mean / max GPU load) of 0.31 on the next
window when planned on the previous one.

Pure functions: :func:`replicate_experts`, :func:`balanced_packing`, :func:`rebalance` and
:func:`migrations`; :class:`EPLBPlanner` is the caller-held state (a window of loads and the
placement in force) for replaying windows one after another.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import ClusterShape, GlobalRouting, Plan, Slots, plan_from_slots
from moonep_sim.plan.runs import cycle_runs, split_runs
from moonep_sim.strategies import Option, PlanContext, make_plan, register

# Notation: E experts, R ranks (GPUs), G GPUs per node, S slots (physical experts, E + redundant),
# X items being packed, W windows of history, T tokens, K top-k, N = T*K entries.


def replicate_experts(load_E: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy replication: each of the ``num_slots - E`` extra slots goes to the expert with the
    highest load per replica (ties: lowest id). Returns (slot_expert_S, replicas_E): experts
    0..E-1 first, then the extra slots in the order they were handed out."""
    load = np.asarray(load_E, dtype=np.float64)
    E = load.size
    require(num_slots >= E, f"slots ({num_slots}) must be >= num_experts ({E})")
    cnt = np.ones(E, dtype=np.int64)
    extra = np.empty(num_slots - E, dtype=np.int64)
    for i in range(num_slots - E):  # loop over redundant slots (a few dozen), not tokens
        e = int(np.argmax(load / cnt))
        extra[i] = e
        cnt[e] += 1
    return np.concatenate([np.arange(E, dtype=np.int64), extra]), cnt


def balanced_packing(weight_X: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack X items into ``num_packs`` packs of X/num_packs items each, heaviest item first into
    the lightest pack that is not full (ties: lowest pack, then lowest item id).
    Returns (pack_X, rank_in_pack_X)."""
    w = np.asarray(weight_X, dtype=np.float64)
    X = w.size
    require(num_packs >= 1 and X % num_packs == 0,
            f"items ({X}) must be divisible by packs ({num_packs}) for balanced packing")
    per = X // num_packs
    pack = np.empty(X, dtype=np.int64)
    rank = np.empty(X, dtype=np.int64)
    load = np.zeros(num_packs)
    fill = np.zeros(num_packs, dtype=np.int64)
    for i in np.argsort(-w, kind="stable"):  # loop over experts/slots (<= E + redundant), not tokens
        p = int(np.argmin(np.where(fill < per, load, np.inf)))
        pack[i], rank[i] = p, fill[p]
        load[p] += w[i]
        fill[p] += 1
    return pack, rank


def rebalance(load_E: np.ndarray, num_slots: int, num_groups: int, cluster: ClusterShape) -> tuple[np.ndarray, str]:
    """EPLB's placement: ``slot_expert_S`` in rank-major order (rank r holds slots
    ``[r*S/R, (r+1)*S/R)``), and the policy used (``hierarchical`` or ``global``).

    Hierarchical (``E % num_groups == 0`` and ``num_groups % nodes == 0``): contiguous expert groups
    are packed onto nodes by group load; each node replicates its experts into S/nodes slots; each
    node's slots (load = expert load / replicas) are packed onto its GPUs. Global otherwise: one
    node, one group.
    """
    load = np.asarray(load_E, dtype=np.float64)
    E, R, G = load.size, cluster.ranks, cluster.gpus_per_node
    nodes = cluster.num_nodes
    require(num_slots % R == 0, f"slots ({num_slots}) must be divisible by ranks ({R}): every GPU holds "
                                "the same number of slots")
    hier = num_groups >= 1 and E % num_groups == 0 and num_groups % nodes == 0 and nodes > 1
    if not hier:
        nodes, G, num_groups = 1, R, 1
    gsize = E // num_groups
    # 1. groups onto nodes
    group_load = load.reshape(num_groups, gsize).sum(axis=1)
    gpack, grank = balanced_packing(group_load, nodes)
    per_node_groups = num_groups // nodes
    # node n's experts, in (rank-in-pack, position in group) order
    node_experts = np.empty((nodes, per_node_groups * gsize), dtype=np.int64)
    g = np.arange(num_groups)
    node_experts[gpack[:, None], grank[:, None] * gsize + np.arange(gsize)[None, :]] = \
        g[:, None] * gsize + np.arange(gsize)[None, :]
    slots_per_node = num_slots // nodes
    slots_per_gpu = num_slots // R
    out = np.empty(num_slots, dtype=np.int64)
    for n in range(nodes):  # loop over nodes
        exps = node_experts[n]
        phy, cnt = replicate_experts(load[exps], slots_per_node)
        phy_load = load[exps][phy] / cnt[phy]
        pack, rank = balanced_packing(phy_load, G)
        pos = n * slots_per_node + pack * slots_per_gpu + rank
        out[pos] = exps[phy]
    return out, "hierarchical" if hier else "global"


def migrations(old_slot_rank_S: np.ndarray, old_slot_expert_S: np.ndarray, new_slot_rank_S: np.ndarray,
               new_slot_expert_S: np.ndarray, num_experts: int, cluster: ClusterShape
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weight moves from an old placement to a new one: (expert_X, src_X, dst_X), one per (rank,
    expert) the new placement needs and the old did not have, sourced from a rank that held the
    expert before -- on the destination's node if possible, else the lowest such rank."""
    R, E = cluster.ranks, num_experts
    old_has = np.zeros(R * E, dtype=bool)
    old_has[np.asarray(old_slot_rank_S) * E + np.asarray(old_slot_expert_S)] = True
    pairs = np.unique(np.asarray(new_slot_rank_S) * E + np.asarray(new_slot_expert_S))
    pairs = pairs[~old_has[pairs]]
    dst, exp = pairs // E, pairs % E
    if pairs.size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    node = cluster.node_of_rank()
    cand = old_has.reshape(R, E)[:, exp].T  # [X, R]
    require(bool(cand.any(axis=1).all()), "every migrated expert must be held somewhere in the old placement")
    score = cand * (1 + (node[None, :] == node[dst][:, None]))
    src = np.argmax(score, axis=1).astype(np.int64)
    return exp.astype(np.int64), src, dst.astype(np.int64)


def balancedness(load_R: np.ndarray) -> float:
    """Mean over max of per-GPU load (1 = perfectly balanced; DeepSeek EPLB's metric)."""
    load = np.asarray(load_R, dtype=np.float64)
    return float(load.mean() / load.max()) if load.size and load.max() > 0 else 1.0


def _array_option(v):
    """Option converter: an array of loads, or a path to a ``.npy`` file (read without pickle)."""
    if v is None or isinstance(v, np.ndarray):
        return v
    if isinstance(v, (str, Path)):
        from moonep_sim.io import check_input_file

        check_input_file(v, "history")  # a named pipe or a directory is refused before it is opened
        try:
            obj = np.load(v, allow_pickle=False)
            if isinstance(obj, np.lib.npyio.NpzFile):
                with obj:
                    names = list(obj.files)
                    if len(names) != 1:
                        raise ConfigError(f"history ({str(v)!r}) must be a .npy file or an .npz holding one "
                                          f"array of loads [W, E], found {len(names)} arrays {names[:4]}")
                    obj = obj[names[0]]
        except (OSError, ValueError, EOFError) as e:
            raise ConfigError(f"history ({str(v)!r}) must be a readable .npy file of loads [W, E]: "
                              f"{str(e).splitlines()[0][:120]}") from None
        if obj.dtype.kind not in "iuf":
            raise ConfigError(f"history ({str(v)!r}) must hold numeric loads [W, E], found dtype {obj.dtype}")
        return obj
    return np.asarray(v)


_array_option.__name__ = "array or .npy path"


def default_redundant(num_experts: int, ranks: int) -> int:
    """R extra slots, plus what makes E + extra divisible by R."""
    return -(-(num_experts + ranks) // ranks) * ranks - num_experts


@register("eplb", summary="static redundant experts from past load (DeepSeek EPLB), weight migration charged",
          options={"num_redundant": Option(int, -1, "extra slots (-1: R, rounded so every GPU holds as many)",
                                           check=lambda v: v >= -1,
                                           constraint="must be >= 0, or -1 for the default (R extra slots, "
                                                      "rounded so every GPU holds as many)"),
                   "groups": Option(int, 0, "expert groups for hierarchical packing (0: one per node)",
                                    check=lambda v: v >= 0, constraint="must be >= 0 (0: one group per node)"),
                   "choice": Option(str, "round_robin", "replica per entry: round_robin or contiguous",
                                    choices=("round_robin", "contiguous")),
                   "dedup": Option(bool, False, "send a token once per destination rank"),
                   "history": Option(_array_option, None, "past loads [W, E] (array or .npy path); "
                                                          "default: this layer's own counts (oracle)"),
                   "previous": Option(_array_option, None, "slot experts of the placement in force (rank-major "
                                                           "[S]); migration from it is charged. Default: none "
                                                           "charged (the new placement is taken as in force)")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, num_redundant: int, groups: int, choice: str, dedup: bool,
         history: np.ndarray | None, previous: np.ndarray | None) -> Plan:
    E, R = routing.num_experts, ctx.cluster.ranks
    if num_redundant < 0:
        num_redundant = default_redundant(E, R)
    require(num_redundant <= E * R, f"option num_redundant ({num_redundant}) must be <= num_experts x ranks "
                                    f"({E * R}): beyond that every rank already holds every expert")
    S = E + num_redundant
    require(S % R == 0, f"num_redundant ({num_redundant}) must make num_experts + num_redundant ({S}) "
                        f"divisible by ranks ({R}): every GPU holds the same number of slots")
    if history is None:
        load = routing.counts_E().astype(np.float64)
        source = "current"
    else:
        h = np.asarray(history, dtype=np.float64)
        h = h[None] if h.ndim == 1 else h
        require(h.ndim == 2 and h.shape[1] == E, f"history shape ({list(h.shape)}) must be [W, {E}] (num_experts)")
        require(bool(np.isfinite(h).all() and (h >= 0).all()), "history loads must be finite and >= 0")
        load = h.sum(axis=0)
        source = f"history[{h.shape[0]}]"
    num_groups = groups or ctx.cluster.num_nodes
    slot_expert, policy = rebalance(load, S, num_groups, ctx.cluster)
    slot_rank = np.repeat(np.arange(R, dtype=np.int64), S // R)
    if previous is None:  # no placement in force given: the planned one is taken as already in place
        old_r, old_e = slot_rank, slot_expert
    else:
        prev = np.asarray(previous, dtype=np.int64).ravel()
        require(prev.size % R == 0 and bool(((prev >= 0) & (prev < E)).all()),
                f"previous placement ({prev.size} slots) must list experts in [0, {E}), a multiple of ranks ({R})")
        old_r, old_e = np.repeat(np.arange(R, dtype=np.int64), prev.size // R), prev
    mx, ms, md = migrations(old_r, old_e, slot_rank, slot_expert, E, ctx.cluster)
    ids_N = routing.topk_ids_TK.ravel()
    opts = {"num_redundant": num_redundant, "groups": num_groups, "policy": policy, "load_source": source,
            "planned_balancedness": balancedness(np.bincount(slot_rank, weights=load[slot_expert]
                                                             / np.bincount(slot_expert, minlength=E)[slot_expert],
                                                             minlength=R))}
    migrate = dict(migrate_expert_X=mx, migrate_src_X=ms, migrate_dst_X=md)
    return plan_from_slots(routing, ctx.cluster, ctx.costs, Slots(slot_rank, slot_expert, slot_rank),
                           replica_slots(ids_N, slot_expert, E, choice, perf=ctx.perf), dedup=dedup,
                           token_padding=ctx.token_padding, options=opts, perf=ctx.perf, **migrate)


def replica_slots(ids_N: np.ndarray, slot_expert_S: np.ndarray, num_experts: int, choice: str, *,
                  perf: PerfConfig = DEFAULT_PERF) -> np.ndarray:
    """INDEX [N] the replica slot of each entry, by one pass over the experts' runs
    (:mod:`moonep_sim.plan.runs`, compiled on a large layer): the j-th entry of expert e to its replica ``j % c_e``
    (round_robin) or to the replica whose contiguous share holds j (contiguous)."""
    E, S = num_experts, slot_expert_S.size
    if choice not in ("round_robin", "contiguous"):
        raise ConfigError(f"choice ({choice!r}) must be 'round_robin' or 'contiguous'")
    rep = np.argsort(slot_expert_S, kind="stable")  # slots grouped by expert, in slot order
    if choice == "round_robin":
        return cycle_runs(ids_N, E, slot_expert_S[rep], rep, perf=perf)
    c = np.bincount(slot_expert_S, minlength=E)
    n_e = np.bincount(ids_N, minlength=E)
    r_S = np.empty(S, dtype=np.int64)  # replica index of each slot: its rank among its expert's slots
    r_S[rep] = np.arange(S, dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
    n_S, c_S = n_e[slot_expert_S], c[slot_expert_S].astype(np.int64)
    rows_S = ((r_S + 1) * n_S + c_S - 1) // c_S - (r_S * n_S + c_S - 1) // c_S  # replica r's share
    return split_runs(ids_N, E, slot_expert_S[rep], rows_S[rep], rep, perf=perf)


class EPLBPlanner:
    """Caller-held EPLB state: a sliding window of per-expert loads and the placement in force.

    ``plan(routing, ctx)`` plans on the loads observed so far (or the routing's own counts when
    none were observed), charges migration from the placement in force, then makes the new
    placement the one in force. ``observe(counts_E)`` appends one window's loads.
    """

    def __init__(self, window: int = 1, **options):
        require(window >= 1, f"window ({window}) must be >= 1")
        self.window = window
        self.options = options
        self._history: list[np.ndarray] = []
        self.slot_expert_S: np.ndarray | None = None

    def observe(self, counts_E: np.ndarray) -> None:
        self._history = (self._history + [np.asarray(counts_E, dtype=np.float64)])[-self.window:]

    def plan(self, routing: GlobalRouting, ctx: PlanContext) -> Plan:
        hist = np.stack(self._history) if self._history else None
        # the first plan moves weights from the context's placement (home groups by default)
        prev = self.slot_expert_S if self.slot_expert_S is not None else ctx.placement.slot_expert_S
        p = make_plan("eplb", routing, ctx, history=hist, previous=prev, **self.options)
        self.slot_expert_S = p.slot_expert_S.copy()
        return p
