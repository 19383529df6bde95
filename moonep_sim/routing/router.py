"""Router replay: route tokens again from their router logits, with or without a balancing rule.

Notation: T tokens, K top-k, E experts, G expert groups, M groups kept per token.

Modes (all return a :class:`LayerRouting`; ids ordered by descending selection score):

- ``topk``: top-K of the scores, ``softmax(logits)`` or ``sigmoid(logits)``; weights are the chosen
  scores normalised to sum 1 per token.
- ``bias`` (auxiliary-loss-free, DeepSeek-V3 style): select top-K of ``score + bias_E``; the
  weights come from the *unbiased* scores. :func:`aux_free_bias` fits such a bias on a
  calibration batch with the sign update ``b_e += u * sign(mean - load_e)``.
- ``quantile``: per-expert offsets ``beta_E`` computed on a calibration batch so that each expert
  would take exactly ``C = T*K/E`` tokens there; route on top-K of ``logits - beta``; weights
  from the unbiased scores. :func:`quantile_offsets` finds beta by coordinate ascent on the dual
  of the balanced assignment: each token's threshold ``tau_t`` is its (K+1)-th best adjusted
  logit; each expert's offset is set between the C-th and (C+1)-th largest ``logits_te - tau_t``
  over tokens (so exactly C tokens would clear it); repeated, damped, keeping the best.
- ``group``: group-limited top-K: experts form G contiguous groups, a group scores the sum of its
  two best expert scores, each token keeps its top-M groups and takes its top-K experts there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.routing.sampling import mask_groups, smallest_k
from moonep_sim.routing.trace import LayerRouting

SCORES = ("softmax", "sigmoid")
MODES = ("topk", "bias", "quantile", "group")


def scores(logits_TE: np.ndarray, score: str = "softmax") -> np.ndarray:
    """Router scores from logits, float32 [T, E]."""
    require(score in SCORES, f"score ({score!r}) must be one of {', '.join(SCORES)}")
    x = np.asarray(logits_TE, dtype=np.float32)
    if score == "sigmoid":
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _topk(sel_TE: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, ordered by descending value, int64 [T, k] (ties as
    ``np.argpartition`` breaks them: :func:`~moonep_sim.routing.sampling.smallest_k`)."""
    return smallest_k(-sel_TE, k)[0]


def _finish(ids_TK: np.ndarray, score_TE: np.ndarray, num_experts: int, layer: int) -> LayerRouting:
    w = np.take_along_axis(score_TE, ids_TK, axis=1).astype(np.float64)
    s = w.sum(axis=1, keepdims=True)
    w = np.divide(w, s, out=np.full_like(w, 1.0 / max(1, w.shape[1])), where=s > 0)
    return LayerRouting(ids_TK, w.astype(np.float32), num_experts, layer)


def _check(logits_TE: np.ndarray, top_k: int) -> np.ndarray:
    x = np.asarray(logits_TE, dtype=np.float32)
    require(x.ndim == 2, f"router logits shape ({list(x.shape)}) must be [T, E]")
    require(1 <= top_k <= x.shape[1], f"top_k ({top_k}) must be in [1, num_experts={x.shape[1]}]")
    if not np.isfinite(x).all():
        t = int(np.argmax(~np.isfinite(x).all(axis=1)))
        raise ConfigError(f"router logits (token {t}) must be finite")
    return x


def route_topk(logits_TE: np.ndarray, top_k: int, *, score: str = "softmax", bias_E: np.ndarray | None = None,
               layer: int = -1) -> LayerRouting:
    """Top-K routing; with ``bias_E`` the bias shifts selection only (weights stay unbiased)."""
    x = _check(logits_TE, top_k)
    s = scores(x, score)
    sel = s
    if bias_E is not None:
        b = np.asarray(bias_E, dtype=np.float32)
        require(b.shape == (x.shape[1],), f"bias length ({b.shape}) must equal num_experts ({x.shape[1]})")
        sel = s + b
    return _finish(_topk(sel, top_k), s, x.shape[1], layer)


def route_group(logits_TE: np.ndarray, top_k: int, groups: int, topk_groups: int, *, score: str = "softmax",
                bias_E: np.ndarray | None = None, layer: int = -1) -> LayerRouting:
    """Group-limited top-K (each token confined to its top-``topk_groups`` of ``groups`` groups)."""
    x = _check(logits_TE, top_k)
    E = x.shape[1]
    require(groups >= 1 and E % groups == 0, f"groups ({groups}) must divide num_experts ({E})")
    require(1 <= topk_groups <= groups, f"topk_groups ({topk_groups}) must be in [1, groups={groups}]")
    require(top_k <= topk_groups * (E // groups),
            f"top_k ({top_k}) must be <= topk_groups * E/groups ({topk_groups * (E // groups)})")
    s = scores(x, score)
    sel = s + (np.asarray(bias_E, np.float32) if bias_E is not None else 0)
    return _finish(_topk(mask_groups(sel, groups, topk_groups, copy=False), top_k), s, E, layer)


def route_quantile(logits_TE: np.ndarray, top_k: int, beta_E: np.ndarray, *, score: str = "softmax",
                   layer: int = -1) -> LayerRouting:
    """Top-K of ``logits - beta``; weights from the unbiased scores."""
    x = _check(logits_TE, top_k)
    b = np.asarray(beta_E, dtype=np.float32)
    require(b.shape == (x.shape[1],), f"beta length ({b.shape}) must equal num_experts ({x.shape[1]})")
    return _finish(_topk(x - b, top_k), scores(x, score), x.shape[1], layer)


def _load_ratio(ids_TK: np.ndarray, E: int) -> float:
    c = np.bincount(ids_TK.ravel(), minlength=E)
    return float(c.max() / c.mean())


def quantile_offsets(logits_TE: np.ndarray, top_k: int, *, rounds: int = 60, damping: float = 0.5,
                     target: float = 1.01) -> tuple[np.ndarray, dict[str, Any]]:
    """Per-expert offsets beta_E (float32 [E]) balancing top-K of ``logits - beta`` on this batch.

    Stops early once max/mean load <= ``target`` (1.0 = exact balance, reachable only up to ties
    and T*K/E not being an integer; default 1.01). Returns beta and ``{"max_over_mean", "rounds"}``: the best
    round's load ratio on this (calibration) batch.
    """
    x = _check(logits_TE, top_k).astype(np.float64)
    T, E = x.shape
    K = top_k
    C = T * K / E
    require(K < E, f"top_k ({K}) must be < num_experts ({E}) for quantile balancing")
    cap = max(1, min(T, int(round(C))))
    beta = np.zeros(E)
    best = (np.inf, beta.copy(), 0)
    for r in range(rounds + 1):  # the last pass only scores the last round's offsets
        adj = x - beta
        ratio = _load_ratio(_topk(adj, K), E)
        if ratio < best[0]:
            best = (ratio, beta.copy(), r)
        if ratio <= target + 1e-9 or r == rounds:
            break
        # token thresholds: the (K+1)-th best adjusted logit (the best expert not taken)
        tau = -np.partition(-adj, K, axis=1)[:, K]
        # expert offsets: midpoint between the cap-th and (cap+1)-th largest of x - tau over tokens
        v = x - tau[:, None]
        if cap < T:
            part = -np.partition(-v, [cap - 1, cap], axis=0)
            new = 0.5 * (part[cap - 1] + part[cap])
        else:
            new = v.min(axis=0) - 1e-6
        new -= new.mean()
        beta = (1 - damping) * beta + damping * new
    return best[1].astype(np.float32), {"max_over_mean": best[0], "rounds": best[2] + 1}


def aux_free_bias(logits_TE: np.ndarray, top_k: int, *, score: str = "sigmoid", rounds: int = 100,
                  update: float = 1e-3) -> np.ndarray:
    """Fit a fixed expert bias (float32 [E]) by the auxiliary-loss-free sign update on one batch."""
    x = _check(logits_TE, top_k)
    s = scores(x, score)
    E = x.shape[1]
    b = np.zeros(E, np.float32)
    mean = x.shape[0] * top_k / E
    for _ in range(rounds):
        c = np.bincount(_topk(s + b, top_k).ravel(), minlength=E)
        b += np.float32(update) * np.sign(mean - c).astype(np.float32)
    return b


def synthetic_logits(tokens: int, num_experts: int, seed: int, *, skew: float = 1.0,
                     noise: float = 1.0) -> np.ndarray:
    """Router logits float32 [T, E]: a per-expert popularity ``skew * N(0,1)`` plus per-token
    ``noise * N(0,1)``; deterministic by seed."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 7]))
    pop = skew * rng.standard_normal(num_experts)
    return (pop[None, :] + noise * rng.standard_normal((tokens, num_experts))).astype(np.float32)


def replay_layer(logits_TE: np.ndarray, top_k: int, mode: str = "topk", *, score: str = "softmax",
                 calib_tokens: int | None = None, bias_E: np.ndarray | None = None, groups: int = 1,
                 topk_groups: int = 1, bias_rounds: int = 100, bias_update: float = 1e-3,
                 layer: int = -1) -> tuple[LayerRouting, dict[str, Any]]:
    """Route one layer's logits in ``mode`` (one of ``MODES``).

    calib_tokens: the first tokens form the calibration batch of ``quantile`` (offsets) and of
    ``bias`` when no ``bias_E`` is given (default: all tokens). Returns the routing and a report
    with max/mean load on the calibration batch and on all tokens.
    """
    require(mode in MODES, f"mode ({mode!r}) must be one of {', '.join(MODES)}")
    x = _check(logits_TE, top_k)
    T, E = x.shape
    n = T if calib_tokens is None else int(calib_tokens)
    require(1 <= n <= T, f"calib_tokens ({n}) must be in [1, tokens={T}]")
    info: dict[str, Any] = {"mode": mode, "score": score, "calib_tokens": n}
    if mode == "topk":
        r = route_topk(x, top_k, score=score, layer=layer)
    elif mode == "bias":
        if bias_E is None:
            bias_E = aux_free_bias(x[:n], top_k, score=score, rounds=bias_rounds, update=bias_update)
        info["bias"] = np.asarray(bias_E, np.float32).tolist()
        r = route_topk(x, top_k, score=score, bias_E=bias_E, layer=layer)
    elif mode == "quantile":
        beta, q = quantile_offsets(x[:n], top_k)
        info["beta"] = beta.tolist()
        info["calibration_rounds"] = q["rounds"]
        r = route_quantile(x, top_k, beta, score=score, layer=layer)
    else:
        r = route_group(x, top_k, groups, topk_groups, score=score, bias_E=bias_E, layer=layer)
        info.update(groups=groups, topk_groups=topk_groups)
    info["calib_max_over_mean"] = _load_ratio(r.topk_ids_TK[:n], E)
    info["max_over_mean"] = _load_ratio(r.topk_ids_TK, E)
    return r, info


def replay_trace(src, out, mode: str = "topk", *, top_k: int | None = None, **kwargs) -> dict[str, Any]:
    """Re-route every layer of the trace ``src`` (which must hold ``router_logits``) and write the
    result to ``out`` atomically (logits and steps kept). Returns the replay report."""
    from moonep_sim.io import check_output_path
    from moonep_sim.routing.trace import Trace, write_trace
    from dataclasses import replace

    check_output_path(out, "-o", inputs=(src,))
    tr = Trace(src)
    m = tr.meta
    K = top_k or m.top_k
    if not tr.has("router_logits"):
        raise ConfigError(f"{src}: tensor router_logits: expected for router replay, missing (generate a "
                          "trace with `moonep-sim trace gen --logits`)")
    L, T = m.num_layers, m.num_tokens
    ids = np.empty((L, T, K), np.int64)
    w = np.empty((L, T, K), np.float32)
    logits = np.empty((L, T, m.num_experts), np.float32)
    per_layer = []
    for i in range(L):
        logits[i] = tr.router_logits(i)
        r, info = replay_layer(logits[i], K, mode, layer=m.layer_ids[i], **kwargs)
        ids[i], w[i] = r.topk_ids_TK, r.topk_weights_TK
        info.pop("beta", None), info.pop("bias", None)
        per_layer.append({"layer": m.layer_ids[i], **info})
    report = {"replayed_from": str(src), "mode": mode, "top_k": K, "per_layer": per_layer}
    meta = replace(m, top_k=K, source=f"router replay ({mode}) of {m.source}",
                   import_report={**m.import_report, "router_replay": report})
    tensors = {"topk_ids": ids, "topk_weights": w, "router_logits": logits}
    steps = tr.steps()
    if steps is not None:
        tensors["step"] = steps.astype(np.int32)
    write_trace(out, meta, tensors, what="-o", inputs=(src,))
    return report
