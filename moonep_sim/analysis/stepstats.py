"""Steps as the unit of a result: aggregates over a trace's steps, and identical work found once.

Notation: B batches (the selected steps of a trace, each costed as its own batch; one batch for
generated or in-memory routing, or with ``--steps merged``), L layers.

Every command that costs routing simulates each batch on its own and aggregates a strategy's
per-batch figure (the mean over its layers) over the batches:

- ``token_weighted_mean``: ``sum_b tokens_b * x_b / sum_b tokens_b`` (a step of 90 tokens counts
  nine times a step of 10; with one batch, the figure itself);
- ``median`` and ``p90``: over steps, each step counting once (numpy's linear interpolation);
- ``worst`` and ``worst_step``: the largest value and the step id it came from (``best`` likewise).

:func:`aggregate` returns that dict (:data:`AGGREGATE_FIELDS`); :func:`routing_key` names a
layer's routing by its content, so identical (routing, strategy) points across steps are planned
and simulated once.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

#: the keys of :func:`aggregate`'s result
AGGREGATE_FIELDS = ("token_weighted_mean", "median", "p90", "worst", "worst_step", "best", "best_step", "steps")


def batch_weights(tokens_B: Sequence[int | None]) -> np.ndarray:
    """Weights of each batch, float64 [B] summing to 1: by tokens, equal when tokens are unknown."""
    t = np.asarray([np.nan if v is None else float(v) for v in tokens_B], float)
    if t.size == 0 or not np.isfinite(t).all() or t.sum() <= 0:
        return np.full(max(t.size, 1), 1.0 / max(t.size, 1))
    return t / t.sum()


def weighted_mean(values_B: Sequence[float], tokens_B: Sequence[int | None]) -> float:
    """The token-weighted mean over batches (the figure itself for one batch)."""
    v = np.asarray(values_B, float)
    return float(np.dot(batch_weights(tokens_B)[: v.size], v)) if v.size else float("nan")


def aggregate(values_B: Sequence[float], tokens_B: Sequence[int | None],
              step_ids_B: Sequence[int | None]) -> dict[str, Any]:
    """Token-weighted mean, median, p90, worst and best of a per-batch series (see the module doc)."""
    v = np.asarray(values_B, float)
    if v.size == 0:
        return {k: None for k in AGGREGATE_FIELDS} | {"steps": 0}
    hi, lo = int(np.argmax(v)), int(np.argmin(v))
    return {"token_weighted_mean": weighted_mean(v, tokens_B), "median": float(np.median(v)),
            "p90": float(np.percentile(v, 90)), "worst": float(v[hi]), "worst_step": step_ids_B[hi],
            "best": float(v[lo]), "best_step": step_ids_B[lo], "steps": int(v.size)}


def routing_key(routing) -> str:
    """A digest of a GlobalRouting's content (ids, weights, tokens per rank, E): equal routings,
    equal keys (plans are pure functions of the routing and the context)."""
    h = hashlib.blake2b(digest_size=16)
    for a in (routing.topk_ids_TK, routing.topk_weights_TK, routing.tokens_per_rank_R):
        a = np.ascontiguousarray(a)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    h.update(str(routing.num_experts).encode())
    return h.hexdigest()


def step_wins(series: dict[str, Sequence[float]], excluded: Sequence[str] = ()) -> dict[str, int]:
    """For each strategy, the number of batches in which it was the fastest (``excluded``: strategies
    that may not win, e.g. ones that dropped rows; ties go to the first in order)."""
    names = [n for n in series if n not in set(excluded)] or list(series)
    m = np.asarray([series[n] for n in names], float)
    best = np.argmin(m, axis=0) if m.size else np.zeros(0, np.int64)
    return {n: int((best == i).sum()) for i, n in enumerate(names)}


#: the step figures :func:`step_aggregates` aggregates over a trace's recorded steps
STEP_SERIES = ("step_time_us", "exposed_comm_us", "tokens_per_s_per_gpu", "peak_memory_bytes")


def step_aggregates(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-step aggregate of whole steps (``moonep-sim step`` on a trace, any ``--steps``):
    ``docs`` are :class:`~moonep_sim.experiments.step.StepResult` documents, one per recorded step.
    Per strategy and figure of :data:`STEP_SERIES`, :func:`aggregate` (token-weighted mean, median,
    p90, worst and best step); ``wins``: in how many steps each strategy had the shortest step time
    among those that fit in memory and dropped nothing (all of them when none does); ``steps``,
    ``step_ids``, ``tokens``: the steps aggregated."""
    tokens_B = [d["setup"].get("step_tokens") for d in docs]
    ids_B = [d["setup"].get("step_id") for d in docs]
    names = list(docs[0]["strategies"]) if docs else []
    per = {n: {k: aggregate([float(d["strategies"][n][k]) for d in docs], tokens_B, ids_B) for k in STEP_SERIES}
           for n in names}
    bad = [n for n in names if any(d["strategies"][n].get("oom") or d["strategies"][n].get("dropped")
                                   for d in docs)]
    wins = step_wins({n: [float(d["strategies"][n]["step_time_us"]) for d in docs] for n in names}, bad)
    return {"steps": len(docs), "step_ids": ids_B, "tokens": tokens_B, "strategies": per, "wins": wins,
            "excluded_from_wins": bad}


__all__ = ["AGGREGATE_FIELDS", "STEP_SERIES", "aggregate", "batch_weights", "routing_key",
           "step_aggregates", "step_wins", "weighted_mean"]
