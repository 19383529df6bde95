"""Load metrics of a routing: imbalance per expert, rank and node; what deduplication saves.

Notation: T tokens, K top-k, E experts, R ranks, N nodes.

Definitions (used everywhere in the project):

- ``maxvio = max_e(T_e / mean_T) - 1`` over the per-expert counts ``T_e`` (0 = balanced, 1 = the
  hottest expert takes twice the mean); ``max_over_mean = maxvio + 1``.
- ``gini``: the Gini coefficient of the counts (0 = equal, -> 1 = one expert takes everything),
  ``sum_i (2i - E - 1) x_(i) / (E * sum x)`` with ``x`` sorted ascending, i = 1..E.
- ``top_share(n)``: the fraction of all selections that go to the n hottest experts.
- Rank / node loads: selections whose expert's home rank (node) is that rank (node). The default
  layout is contiguous home groups, expert e on rank ``e * R // E`` (MoonEP's ``e // (E/R)`` when
  R divides E); ranks ``[n*G, (n+1)*G)`` form node n.
- Distinct ranks (nodes) per token: how many different ranks (nodes) a token's K experts live on:
  the rows it really sends when duplicates to one destination are sent once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from moonep_sim.errors import ConfigError, require


def maxvio(counts_E: np.ndarray) -> float:
    """``max_e(T_e / mean_T) - 1``; 0.0 for an all-zero count vector."""
    c = np.asarray(counts_E, dtype=np.float64)
    mean = c.mean() if c.size else 0.0
    return float(c.max() / mean - 1.0) if mean > 0 else 0.0


def max_over_mean(counts_E: np.ndarray) -> float:
    return maxvio(counts_E) + 1.0


def gini(counts_E: np.ndarray) -> float:
    """Gini coefficient of non-negative counts (0 for equal or all-zero counts)."""
    x = np.sort(np.asarray(counts_E, dtype=np.float64))
    n, s = x.size, x.sum()
    if n == 0 or s <= 0:
        return 0.0
    i = np.arange(1, n + 1, dtype=np.float64)
    return float(((2 * i - n - 1) * x).sum() / (n * s))


def top_share(counts_E: np.ndarray, n: int) -> float:
    """Fraction of all selections taken by the ``n`` hottest experts."""
    c = np.asarray(counts_E, dtype=np.float64)
    s = c.sum()
    if s <= 0:
        return 0.0
    n = min(max(int(n), 0), c.size)
    return float(np.sort(c)[::-1][:n].sum() / s)


@dataclass(frozen=True)
class EPLayout:
    """Where experts live: ``expert_rank_E[e]`` is expert e's home rank; ranks grouped in nodes.

    ranks (R) >= 1; gpus_per_node (G) divides R (0 = one node holds all ranks).
    """

    num_experts: int
    ranks: int
    gpus_per_node: int
    expert_rank_E: np.ndarray

    @classmethod
    def home_groups(cls, num_experts: int, ranks: int, gpus_per_node: int = 0) -> "EPLayout":
        """Contiguous home groups: expert e on rank ``e * R // E``."""
        require(ranks >= 1, f"ranks ({ranks}) must be >= 1")
        require(ranks <= num_experts,
                f"ranks ({ranks}) must be <= num_experts ({num_experts}): every rank needs a home expert")
        g = gpus_per_node or ranks
        require(g >= 1 and ranks % g == 0,
                f"gpus_per_node ({gpus_per_node}) must divide ranks ({ranks})")
        e = np.arange(num_experts, dtype=np.int64)
        return cls(num_experts, ranks, g, e * ranks // num_experts)

    @property
    def num_nodes(self) -> int:
        return self.ranks // self.gpus_per_node

    @property
    def expert_node_E(self) -> np.ndarray:
        return self.expert_rank_E // self.gpus_per_node


def rank_loads(counts_E: np.ndarray, layout: EPLayout) -> np.ndarray:
    """Selections per home rank, int64 [R]."""
    return np.bincount(layout.expert_rank_E, weights=np.asarray(counts_E, dtype=np.float64),
                       minlength=layout.ranks).astype(np.int64)


def node_loads(counts_E: np.ndarray, layout: EPLayout) -> np.ndarray:
    """Selections per node, int64 [N]."""
    return np.bincount(layout.expert_node_E, weights=np.asarray(counts_E, dtype=np.float64),
                       minlength=layout.num_nodes).astype(np.int64)


def distinct_per_token(ids_TK: np.ndarray, owner_E: np.ndarray) -> np.ndarray:
    """Number of distinct owners (ranks or nodes) among each token's K experts, int64 [T]."""
    o = np.sort(np.asarray(owner_E)[ids_TK], axis=1)
    return 1 + (o[:, 1:] != o[:, :-1]).sum(axis=1, dtype=np.int64) if o.shape[1] else np.zeros(len(o), np.int64)


def estimated_distinct(counts_E: np.ndarray, top_k: int, owner_E: np.ndarray, num_owners: int) -> float:
    """Estimated mean distinct owners per token from counts alone (no co-occurrence known).

    Models a token's K selections as K independent draws with the observed shares
    ``q_o = (selections of owner o) / (all selections)``: owner o is untouched with probability
    ``(1 - q_o)^K``. Exact for K = 1; ignores that one token's experts are distinct (so it
    slightly underestimates for K > 1).
    """
    c = np.asarray(counts_E, dtype=np.float64)
    if c.sum() <= 0:
        return 0.0
    q_O = np.bincount(owner_E, weights=c, minlength=num_owners) / c.sum()
    return float((1.0 - (1.0 - q_O) ** top_k).sum())


def layer_stats(counts_E: np.ndarray, *, layer: int, top: int = 0,
                layout: EPLayout | None = None, distinct_ranks_sum: int | None = None,
                distinct_nodes_sum: int | None = None, tokens: int | None = None,
                counts_only: bool = False, top_k: int = 1) -> dict[str, Any]:
    """The per-layer statistics object of ``trace inspect --json``.

    ``distinct_*_sum``: sums over tokens of distinct ranks/nodes (token-level traces), or None to
    estimate them from counts (counts-level traces; labelled as estimates).
    """
    c = np.asarray(counts_E, dtype=np.int64)
    E = c.size
    top = top or max(1, E // 16)
    out: dict[str, Any] = {
        "layer": int(layer),
        "selections": int(c.sum()),
        "maxvio": maxvio(c),
        "max_over_mean": max_over_mean(c),
        "gini": gini(c),
        "top_experts": np.argsort(-c, kind="stable")[:top].tolist(),
        "top_share": top_share(c, top),
        "top_n": int(top),
    }
    if layout is not None:
        for where, loads in (("rank", rank_loads(c, layout)), ("node", node_loads(c, layout))):
            out[f"{where}_loads"] = loads.tolist()
            out[f"{where}_max_over_mean"] = float(loads.max() / loads.mean()) if loads.mean() > 0 else 0.0
        if not counts_only:
            out["mean_distinct_ranks"] = distinct_ranks_sum / tokens if tokens else 0.0
            out["mean_distinct_nodes"] = distinct_nodes_sum / tokens if tokens else 0.0
            out["distinct_is_estimate"] = False
        else:
            out["mean_distinct_ranks"] = estimated_distinct(c, top_k, layout.expert_rank_E, layout.ranks)
            out["mean_distinct_nodes"] = estimated_distinct(c, top_k, layout.expert_node_E, layout.num_nodes)
            out["distinct_is_estimate"] = True
            out["distinct_note"] = ("estimate: a counts-level trace has no co-occurrence of experts within "
                                    "a token; modelled as K independent draws with the observed shares")
    return out


def step_expert_counts(step_T: np.ndarray, ids_TK: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Selections per (step, expert) pair that occurs, sparse: keys ``step * E + expert`` (int64,
    sorted) and counts. Memory grows with the pairs present, never with steps x experts."""
    K = ids_TK.shape[1]
    key = np.repeat(np.asarray(step_T, np.int64), K) * num_experts + np.asarray(ids_TK, np.int64).reshape(-1)
    return np.unique(key, return_counts=True)


def per_step_maxvio(keys: np.ndarray, counts: np.ndarray, tokens_S: np.ndarray, top_k: int,
                    num_experts: int) -> np.ndarray:
    """maxvio of each step (float64 [S]) from sparse (step, expert) counts and tokens per step;
    0 for an empty step."""
    S = len(tokens_S)
    max_S = np.zeros(S, np.float64)
    if keys.size:
        s_of = keys // num_experts
        starts = np.flatnonzero(np.concatenate([[True], s_of[1:] != s_of[:-1]]))
        max_S[s_of[starts]] = np.maximum.reduceat(counts.astype(np.float64), starts)
    mean_S = np.asarray(tokens_S, np.float64) * top_k / num_experts
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean_S > 0, max_S / mean_S - 1.0, 0.0)


def _spread(v: np.ndarray) -> dict[str, float] | None:
    v = np.asarray(v, dtype=np.float64)
    if v.size == 0:
        return None
    return {"min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}


def inspect_trace(path, *, ranks: int | None = None, gpus_per_node: int = 0,
                  layers: Iterable[int] | None = None, top: int = 0, steps=None,
                  chunk_tokens: int = 1 << 20) -> dict[str, Any]:
    """Statistics of a trace file, read one layer (and at most ``chunk_tokens`` tokens) at a time.

    ``layers``: model layer ids to inspect (default all). ``ranks``/``gpus_per_node``: EP layout for
    per-rank/per-node loads and distinct ranks/nodes per token. ``steps``: a step selection
    (``routing.steps`` grammar, e.g. ``"10-20"``; default all tokens).

    Per-step figures (token-level traces): ``steps`` holds the number of steps, tokens per step and
    the maxvio of each step (mean over the inspected layers) as min/median/max; each layer's entry
    holds its own ``maxvio_per_step`` spread. A step's maxvio is computed on that step's tokens alone,
    so small steps (decode passes of a few rows) have large maxvio by construction.
    """
    from moonep_sim.routing.steps import parse_steps, step_bounds, token_ranges
    from moonep_sim.routing.trace import Trace

    tr = Trace(path)
    m = tr.meta
    layout = None
    if ranks is not None:
        layout = EPLayout.home_groups(m.num_experts, ranks, gpus_per_node)
    elif gpus_per_node:
        raise ConfigError(f"--gpus-per-node ({gpus_per_node}) needs --ranks")
    want = list(m.layer_ids) if layers is None else list(layers)
    idx = [tr.layer_index(l) for l in want]
    per_layer = []
    T = m.num_tokens or 0
    sel = parse_steps(steps)
    if m.kind == "counts" and sel is not None:
        raise ConfigError(f"--steps ({sel.text}) needs a token-level trace: a counts-level trace has one step")
    step_T = tr.steps() if m.kind == "tokens" else None
    bounds = step_bounds(step_T, T)
    S = len(bounds) - 1
    ranges = token_ranges(step_T, T, sel) if m.kind == "tokens" else []
    chosen = sel.steps(S) if sel is not None else np.arange(S)
    n_S = np.diff(bounds)[chosen]
    mv_LS = []
    T_sel = int(sum(b - a for a, b in ranges))
    for i in idx:
        if m.kind == "counts":
            c = tr.counts(i)
            per_layer.append(layer_stats(c, layer=m.layer_ids[i], top=top, layout=layout,
                                         tokens=m.num_tokens, counts_only=True, top_k=m.top_k))
            continue
        c = np.zeros(m.num_experts, dtype=np.int64)
        parts_k, parts_c = [], []
        dr = dn = 0
        for lo, hi in ranges:
            for start in range(lo, hi, chunk_tokens):
                stop = min(hi, start + chunk_tokens)
                lr = tr.layer(i, start, stop)
                c += lr.counts_E()
                s_T = (step_T[start:stop] if step_T is not None else np.zeros(stop - start, np.int64))
                keep = tr.token_mask(i, start, stop)   # a per-layer token mask: the rows this layer has
                if keep is not None:
                    s_T = s_T[keep]
                kk, cc = step_expert_counts(s_T, lr.topk_ids_TK, m.num_experts)
                parts_k.append(kk)
                parts_c.append(cc)
                if layout is not None:
                    dr += int(distinct_per_token(lr.topk_ids_TK, layout.expert_rank_E).sum())
                    dn += int(distinct_per_token(lr.topk_ids_TK, layout.expert_node_E).sum())
                del lr
        keys, inv = np.unique(np.concatenate(parts_k) if parts_k else np.zeros(0, np.int64), return_inverse=True)
        counts = np.bincount(inv.reshape(-1), weights=np.concatenate(parts_c) if parts_c else None,
                             minlength=len(keys)).astype(np.int64)
        mv_S = per_step_maxvio(keys, counts, np.diff(bounds), m.top_k, m.num_experts)[chosen]
        st = layer_stats(c, layer=m.layer_ids[i], top=top, layout=layout,
                         distinct_ranks_sum=dr, distinct_nodes_sum=dn, tokens=T_sel)
        mv_LS.append(mv_S)
        st["maxvio_per_step"] = _spread(mv_S)
        per_layer.append(st)
    out: dict[str, Any] = {
        "file": str(path),
        "kind": m.kind,
        "model": m.model,
        "layers": len(per_layer),
        "layer_ids": [m.layer_ids[i] for i in idx],
        "tokens": T_sel if m.kind == "tokens" else m.num_tokens,
        "num_experts": m.num_experts,
        "num_experts_inferred": m.num_experts_inferred,
        "top_k": m.top_k,
        "num_steps": int(len(chosen)),
        "steps": {"count": int(len(chosen)), "selected": sel.text if sel is not None else "all",
                  "of": S, "rule": m.steps,
                  "tokens_per_step": _spread(n_S) if m.kind == "tokens" else None,
                  "maxvio_per_step": _spread(np.mean(mv_LS, axis=0)) if mv_LS else None},
        "source": m.source,
        "import_report": m.import_report,
    }
    if layout is not None:
        out["layout"] = {"ranks": layout.ranks, "gpus_per_node": layout.gpus_per_node,
                         "nodes": layout.num_nodes, "experts": "contiguous home groups, e -> e*R//E"}
    if per_layer:
        out["mean_maxvio"] = float(np.mean([p["maxvio"] for p in per_layer]))
    out["per_layer"] = per_layer
    return out
