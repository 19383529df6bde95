"""What users read from a serving run: latency percentiles, throughput, SLO attainment, cost.

Definitions (seconds, tokens; percentiles by numpy's linear interpolation):

- TTFT: first token's time minus arrival. TPOT: ``(finish - first) / (output - 1)`` of requests
  with more than one output token. E2E: finish minus arrival.
- ITL: each decode iteration's duration once per sequence that decoded in it (with MTP the
  iteration's tokens share it: duration / (tokens per sequence)).
- output (input) tokens/s per GPU: output (prompt) tokens over the makespan (first arrival to last
  finish) and the deployment's GPUs; tokens/s per user: the mean of ``1 / TPOT``.
- SLO attainment: the share of requests whose TTFT and TPOT are within the SLO; goodput: those
  requests per second (and their output tokens per second per GPU).
- $ per million output tokens: ``gpus x price per GPU-hour / (output tokens per hour) x 1e6``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

from moonep_sim.errors import ConfigError, require

SLO_KEYS = ("ttft", "tpot", "e2e", "itl")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
PCTS = (50, 90, 99)


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=200ms,tpot=50ms`` -> ``{"ttft": 0.2, "tpot": 0.05}`` (seconds). A value needs a unit
    (s, ms, us)."""
    if not text:
        return {}
    out = {}
    for part in str(text).split(","):
        k, sep, v = part.strip().partition("=")
        k = k.strip().lower()
        require(sep == "=" and k in SLO_KEYS, f"--slo ({part.strip()!r}) must be KEY=VALUEUNIT with KEY one of "
                                              f"{', '.join(SLO_KEYS)}")
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|ms|us)\s*", v)
        if m is None:
            raise ConfigError(f"--slo {k} ({v.strip()!r}) must be a number with a unit (s, ms or us), e.g. {k}=200ms")
        out[k] = float(m.group(1)) * _UNITS[m.group(2)]
        require(out[k] > 0, f"--slo {k} ({v.strip()}) must be > 0")
    return out


def _pct(x: np.ndarray, w: np.ndarray | None = None) -> dict[str, float | None]:
    if x.size == 0:
        return {f"p{p}": None for p in PCTS} | {"mean": None}
    if w is None:
        return {f"p{p}": float(np.percentile(x, p)) for p in PCTS} | {"mean": float(x.mean())}
    o = np.argsort(x)
    xs, cw = x[o], np.cumsum(w[o])
    out = {f"p{p}": float(xs[min(int(np.searchsorted(cw, p / 100 * cw[-1])), len(xs) - 1)]) for p in PCTS}
    return out | {"mean": float(np.average(x, weights=w))}


def summarize(run: Any, input_N: np.ndarray, output_N: np.ndarray, gpus: int, slo: Mapping[str, float],
              price: float | None = None, warmup: float = 0.0) -> dict[str, Any]:
    """The figures of one run (see the module docstring). ``warmup``: the share of requests (by
    arrival order) left out of the latency figures (0: none)."""
    N = len(input_N)
    fin = ~np.isnan(run.finish_s)
    keep = np.zeros(N, bool)
    keep[int(N * warmup):] = True
    keep &= fin
    ttft = (run.first_s - run.arrival_s)[keep]
    e2e = (run.finish_s - run.arrival_s)[keep]
    multi = keep & (output_N > 1)
    tpot = ((run.finish_s - run.first_s) / np.maximum(output_N - 1, 1))[multi]
    d = run.it_decode_seqs > 0
    per_seq = np.where(d, run.it_tokens / np.maximum(run.it_decode_seqs, 1), 1.0)
    itl = (run.it_dur_s / np.maximum(per_seq, 1.0))[d]
    t0 = float(np.nanmin(run.arrival_s)) if N else 0.0
    span = float(np.nanmax(run.finish_s) - t0) if fin.any() else 0.0
    out_tok = float(output_N[fin].sum())
    in_tok = float(input_N[fin].sum())
    ok = np.ones(N, bool)
    lat = {"ttft": run.first_s - run.arrival_s, "tpot": (run.finish_s - run.first_s) / np.maximum(output_N - 1, 1),
           "e2e": run.finish_s - run.arrival_s}
    for k, lim in slo.items():
        if k in lat:
            v = lat[k]
            ok &= np.where(np.isnan(v), False, v <= lim + 1e-12) if k != "tpot" else np.where(output_N > 1, v <= lim + 1e-12, True)
        elif k == "itl":
            ok &= bool(itl.size == 0 or np.percentile(itl, 99) <= lim)
    ok &= fin
    ok_k = ok[keep] if keep.any() else ok
    res = {
        "requests": N, "finished": int(fin.sum()), "makespan_s": span,
        "ttft_s": _pct(ttft), "tpot_s": _pct(tpot), "itl_s": _pct(itl, run.it_decode_seqs[d].astype(float)),
        "e2e_s": _pct(e2e),
        "output_tokens_per_s_per_gpu": out_tok / span / gpus if span > 0 else 0.0,
        "input_tokens_per_s_per_gpu": in_tok / span / gpus if span > 0 else 0.0,
        "tokens_per_s_per_user": float(np.mean(1.0 / tpot[tpot > 0])) if (tpot > 0).any() else None,
        "slo": dict(slo), "slo_attainment": float(ok_k.mean()) if slo else None,
        "goodput_requests_per_s": float(ok.sum()) / span if slo and span > 0 else None,
        "goodput_tokens_per_s_per_gpu": float(output_N[ok].sum()) / span / gpus if slo and span > 0 else None,
        "kv_use_mean": float(np.average(run.it_kv_use, weights=run.it_dur_s)) if run.it_dur_s.sum() > 0 else 0.0,
        "kv_use_max": float(run.it_kv_use.max()) if run.it_kv_use.size else 0.0,
        "preemptions": int(run.preempted.sum()), "iterations": int(run.it_dur_s.size),
        "gpus": gpus,
    }
    if price is not None:
        res["usd_per_million_output_tokens"] = (gpus * price / (out_tok / span * 3600.0) * 1e6
                                                if span > 0 and out_tok else None)
        res["gpu_hour_price_usd"] = price
    return res


#: how each SLO-side figure is read: (key into the summary, percentile, lower is better)
SLO_METRIC = {"ttft": ("ttft_s", "p99"), "tpot": ("tpot_s", "p99"), "e2e": ("e2e_s", "p99"), "itl": ("itl_s", "p99")}


#: margins below this are called a tie (one seeded run; the step-time model's own error is larger)
TIE_MARGIN = 0.02


def serve_verdict(figs: Mapping[str, Mapping[str, Any]], slo: Mapping[str, float],
                  mech: Mapping[str, str] | None = None, model_error: float | None = None) -> dict[str, Any]:
    """The strategy that serves best: with an SLO, the highest goodput (output tokens/s/GPU of the
    requests within it; then attainment); without, the lowest p99 TPOT. Margin against the
    runner-up (a tie below :data:`TIE_MARGIN`), the mechanism (``mech[winner]``), and the
    confidence: the step-time model's held-out error (``model_error``) against the margin."""
    names = list(figs)
    if not names:
        return {}
    if slo:
        metric, higher = "goodput (output tokens/s/GPU within the SLO)", True
        val = lambda n: float(figs[n].get("goodput_tokens_per_s_per_gpu") or 0.0)
        key = lambda n: (-val(n), -(figs[n].get("slo_attainment") or 0.0))
    else:
        metric, higher = "p99 TPOT", False
        val = lambda n: float(figs[n]["tpot_s"]["p99"]) if figs[n]["tpot_s"]["p99"] is not None else float("inf")
        key = val
    order = sorted(names, key=key)
    w = order[0]
    m = (mech or {}).get(w, "")
    if len(order) == 1:
        return {"winner": w, "metric": metric, "order": order, "runner_up": None, "why": f"{w} is the only strategy",
                "text": f"{w} is the only strategy"}

    def margin(o: str) -> float:
        a, b = val(w), val(o)
        if higher:
            return (a - b) / b if b > 0 else (1.0 if a > 0 else 0.0)
        return (b - a) / b if np.isfinite(b) and b > 0 else 0.0
    mg = margin(order[1])
    tie = mg < TIE_MARGIN
    level = "low" if model_error is None or mg <= model_error else "medium"
    why = (f"{w} {'ties' if tie else 'wins'} {metric} by {mg:.1%} over {order[1]}" + (f": {m}" if m else ""))
    others = [{"strategy": o, "margin": margin(o), "tie": margin(o) < TIE_MARGIN, "mechanism": (mech or {}).get(o),
               "why": f"{o}: {metric} {val(o):.4g} against {val(w):.4g}"} for o in order[1:]]
    return {"winner": w, "metric": metric, "order": order, "runner_up": order[1], "margin": mg, "tie": tie,
            "mechanism": m, "why": why, "text": why, "others": others,
            "confidence": {"level": level, "basis": "one seeded run; the step-time model's median held-out error "
                                                     f"{model_error:.1%}" if model_error is not None else
                                                     "one seeded run"}}


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher x and y are better), by x."""
    idx = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    out, best_y = [], -np.inf
    for i in idx:
        if points[i][1] > best_y:
            out.append(i)
            best_y = points[i][1]
    return sorted(out, key=lambda i: points[i][0])


__all__ = ["PCTS", "SLO_KEYS", "SLO_METRIC", "TIE_MARGIN", "parse_slo", "pareto", "serve_verdict", "summarize"]
