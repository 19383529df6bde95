"""Step-time models: what one engine iteration of a given shape costs, per dispatch strategy.

Notation: D routing draws, T tokens per rank (decode: sequences per rank), C context (tokens).
Times in microseconds.

An iteration's shape is what the busiest attention rank runs (the attention-DP barrier waits for
it): ``n_pre`` prefill tokens at a mean context ``c_pre``, and ``n_dec`` decoding sequences at a
mean context ``c_dec`` (tokens per rank, after CUDA-graph padding where the engine pads).

- :class:`ConstantStepTime`: a fixed time per iteration (the closed-form checks).
- :class:`GridStepTime`: built from the step simulator over a grid of (mode, T, C) with D routing
  draws each (:func:`build_grid`); an iteration asks for draw ``d`` and gets the bilinear
  interpolation in (log2 T, C) of that draw's grid -- log in T (a step's time runs from flat,
  weight-bound, to linear in its tokens), linear in C (attention's KV reads and FLOPs grow
  linearly with the context) -- so the routing skew of the iteration is one real draw. A mixed iteration (chunked prefill beside decodes) costs the prefill step of all
  its tokens, ``P(n_pre + n_dec, c_pre)``, plus the decodes' attention beyond the smallest context
  of the grid, ``Dec(n_dec, c_dec) - Dec(n_dec, C_0)`` (ASSUMED: the decode tokens' MoE and GEMM
  work rides in the prefill step's token count; only their KV reads are added). Above the grid's
  largest T a time scales linearly with T; contexts are clamped to the grid.
- :func:`holdout_error`: the model against direct step simulations at shapes off the grid.
- :func:`cache_key` / :func:`save` / :func:`load`: a grid on disk (``.npz`` of plain arrays, read
  with ``allow_pickle=False``), keyed by everything that determines it.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moonep_sim.errors import ConfigError, require

#: simulate(mode, tokens per rank, context, draw) -> {strategy: step time us}
Simulate = Callable[[str, int, int, int], Mapping[str, float]]
#: bump when the grid's meaning changes (it is part of every cache key)
GRID_VERSION = 2


class ConstantStepTime:
    """Every iteration takes ``us`` microseconds, whatever its shape (closed-form checks)."""

    draws = 1

    def __init__(self, us: float) -> None:
        require(us > 0, f"constant step time ({us}) must be > 0 us")
        self.us = float(us)

    def time_us(self, n_pre: int, c_pre: float, n_dec: int, c_dec: float, draw: int = 0) -> float:
        return self.us

    def describe(self) -> dict[str, Any]:
        return {"kind": "constant", "us": self.us}


class AffineStepTime:
    """``base_us + per_token_us x (n_pre + n_dec)``: a hand-countable model for tests."""

    draws = 1

    def __init__(self, base_us: float, per_token_us: float) -> None:
        self.base, self.per = float(base_us), float(per_token_us)

    def time_us(self, n_pre: int, c_pre: float, n_dec: int, c_dec: float, draw: int = 0) -> float:
        return self.base + self.per * (n_pre + n_dec)

    def describe(self) -> dict[str, Any]:
        return {"kind": "affine", "base_us": self.base, "per_token_us": self.per}


def _axis(v: float, grid: np.ndarray, log: bool = True) -> tuple[int, int, float]:
    """(lo, hi, weight of hi) of ``v`` on ``grid``, in log2 or linear (``log=False``), clamped to its ends."""
    if len(grid) == 1 or v <= grid[0]:
        return 0, 0, 0.0
    if v >= grid[-1]:
        return len(grid) - 1, len(grid) - 1, 0.0
    hi = bisect.bisect_left(grid, v)
    lo = hi - 1
    f = math.log2 if log else float
    a, b = float(grid[lo]), float(grid[hi])
    return lo, hi, (f(v) - f(a)) / (f(b) - f(a))


@dataclass(frozen=True)
class Table:
    """One mode's grid of one strategy: ``T`` and ``C`` ascending, ``us_DTC`` [D, len(T), len(C)]."""

    T: np.ndarray
    C: np.ndarray
    us_DTC: np.ndarray

    def __post_init__(self) -> None:   # plain lists: a lookup per engine iteration bisects them
        object.__setattr__(self, "_T", [float(x) for x in self.T])
        object.__setattr__(self, "_C", [float(x) for x in self.C])

    def at(self, t: float, c: float, d: int) -> float:
        if t <= 0:
            return 0.0
        g = self.us_DTC[d % self.us_DTC.shape[0]]
        scale = 1.0
        T, C = self._T, self._C
        if t > T[-1]:                   # linear in T beyond the grid
            scale, t = t / T[-1], T[-1]
        i0, i1, wi = _axis(t, T)
        j0, j1, wj = _axis(c, C, log=False)
        v = ((1 - wi) * ((1 - wj) * g[i0, j0] + wj * g[i0, j1]) + wi * ((1 - wj) * g[i1, j0] + wj * g[i1, j1]))
        return float(v) * scale


class GridStepTime:
    """One strategy's step-time model from a grid (see the module docstring)."""

    def __init__(self, decode: Table, prefill: Table, info: Mapping[str, Any] | None = None) -> None:
        self.decode, self.prefill = decode, prefill
        self.draws = int(decode.us_DTC.shape[0])
        self.info = dict(info or {})

    def time_us(self, n_pre: int, c_pre: float, n_dec: int, c_dec: float, draw: int = 0) -> float:
        if n_pre <= 0:
            return self.decode.at(n_dec, c_dec, draw)
        t = self.prefill.at(n_pre + n_dec, c_pre, draw)
        if n_dec > 0:
            t += max(self.decode.at(n_dec, c_dec, draw) - self.decode.at(n_dec, float(self.decode.C[0]), draw), 0.0)
        return t

    def describe(self) -> dict[str, Any]:
        return {"kind": "grid", "draws": self.draws, "decode_tokens": self.decode.T.tolist(),
                "decode_contexts": self.decode.C.tolist(), "prefill_tokens": self.prefill.T.tolist(),
                "prefill_contexts": self.prefill.C.tolist(), **self.info}


def pow2_grid(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` up to the first >= ``hi`` (``lo`` itself first when not a power)."""
    lo, hi = max(int(lo), 1), max(int(hi), 1)
    out = [lo]
    p = 1 << int(np.ceil(np.log2(lo + 1e-9)))
    while out[-1] < hi:
        p = max(p, out[-1] + 1)
        out.append(p)
        p *= 2
    return out


def grid_piece(simulate: Simulate, strategies: Sequence[str], Ts: Sequence[int], Cs: Sequence[int], mode: str,
               draw: int, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """One mode's grid on one routing draw: {strategy: us [len(Ts), len(Cs)]} (``simulate(mode, T,
    C, draw)``, all strategies per call; ``progress()`` after each point). Consecutive calls share
    T and differ in C, so a simulator may keep one T's routing for them."""
    arr = {s: np.zeros((len(Ts), len(Cs))) for s in strategies}
    for i, t in enumerate(Ts):
        for j, c in enumerate(Cs):
            r = simulate(mode, int(t), int(c), draw)
            for s in strategies:
                arr[s][i, j] = float(r[s])
            if progress:
                progress(1)
    return arr


def assemble(strategies: Sequence[str], dec_T: Sequence[int], dec_C: Sequence[int], pre_T: Sequence[int],
             pre_C: Sequence[int], decode_D: Sequence[Mapping[str, np.ndarray]],
             prefill_D: Sequence[Mapping[str, np.ndarray]]) -> dict[str, GridStepTime]:
    """One :class:`GridStepTime` per strategy from its pieces (one per draw and mode, :func:`grid_piece`)."""
    return {s: GridStepTime(Table(np.asarray(dec_T, float), np.asarray(dec_C, float),
                                  np.stack([p[s] for p in decode_D])),
                            Table(np.asarray(pre_T, float), np.asarray(pre_C, float),
                                  np.stack([p[s] for p in prefill_D])))
            for s in strategies}


def build_grid(simulate: Simulate, strategies: Sequence[str], dec_T: Sequence[int], dec_C: Sequence[int],
               pre_T: Sequence[int], pre_C: Sequence[int], draws: int,
               progress: Callable[[int, int], None] | None = None) -> dict[str, GridStepTime]:
    """Every grid point simulated ``draws`` times (``simulate(mode, T, C, d)``, all strategies per
    call); one :class:`GridStepTime` per strategy. ``progress(done, total)`` after each point."""
    require(draws >= 1, f"routing draws ({draws}) must be >= 1")
    total = draws * (len(dec_T) * len(dec_C) + len(pre_T) * len(pre_C))
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total)
    dec = [grid_piece(simulate, strategies, dec_T, dec_C, "decode", d, tick) for d in range(draws)]
    pre = [grid_piece(simulate, strategies, pre_T, pre_C, "prefill", d, tick) for d in range(draws)]
    return assemble(strategies, dec_T, dec_C, pre_T, pre_C, dec, pre)


def holdout_points(model: GridStepTime, n: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """``n`` shapes between grid points (geometric midpoints of T, a random C in range), alternating
    decode and prefill: where interpolation is least sure."""
    rng = np.random.default_rng(seed)
    out: list[tuple[str, int, int]] = []
    tabs = [(t, m) for t, m in ((model.decode, "decode"), (model.prefill, "prefill")) if len(t.T) >= 2]
    for k in range(n if tabs else 0):
        tab, mode = tabs[k % len(tabs)]
        i = int(rng.integers(0, len(tab.T) - 1))
        t = int(round(np.sqrt(tab.T[i] * tab.T[i + 1])))
        if t in (int(tab.T[i]), int(tab.T[i + 1])):
            continue
        c = int(round(float(np.exp(rng.uniform(np.log(tab.C[0]), np.log(tab.C[-1]))))))
        out.append((mode, t, c))
    return out


def holdout_error(models: Mapping[str, GridStepTime], simulate: Simulate | None,
                  points: Sequence[tuple[str, int, int]],
                  direct: Sequence[Mapping[str, float]] | None = None) -> dict[str, dict[str, Any]]:
    """Per strategy: the relative error (model - direct) / direct at each held-out point (draw 0:
    ``simulate(mode, T, C, 0)``, or ``direct``, those results computed already), its median and
    largest absolute value."""
    rows: dict[str, list] = {s: [] for s in models}
    for k, (mode, t, c) in enumerate(points):
        r = direct[k] if direct is not None else simulate(mode, t, c, 0)
        for s, m in models.items():
            pred = m.decode.at(t, c, 0) if mode == "decode" else m.prefill.at(t, c, 0)
            rows[s].append({"mode": mode, "tokens_per_rank": t, "context": c, "direct_us": float(r[s]),
                            "model_us": pred, "rel_error": (pred - float(r[s])) / float(r[s])})
    out = {}
    for s, rs in rows.items():
        e = np.abs([x["rel_error"] for x in rs]) if rs else np.zeros(0)
        out[s] = {"points": rs, "median_abs_rel_error": float(np.median(e)) if e.size else None,
                  "max_abs_rel_error": float(e.max()) if e.size else None}
    return out


def cache_key(parts: Mapping[str, Any]) -> str:
    """A hex digest of everything that determines a grid (JSON of sorted keys, with the grid version)."""
    text = json.dumps({"grid_version": GRID_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def save(path: Path, models: Mapping[str, GridStepTime], holdout: Mapping[str, Any]) -> None:
    """The grids (plain arrays) and the held-out errors (JSON text) in one ``.npz``, written atomically."""
    from moonep_sim.io import write_bytes_atomic

    arrays: dict[str, np.ndarray] = {"strategies": np.asarray(list(models), dtype=np.str_),
                                     "holdout_json": np.asarray(json.dumps(holdout))}
    for i, m in enumerate(models.values()):
        for mode, tab in (("decode", m.decode), ("prefill", m.prefill)):
            arrays[f"{i}_{mode}_T"], arrays[f"{i}_{mode}_C"], arrays[f"{i}_{mode}_us"] = tab.T, tab.C, tab.us_DTC
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes_atomic(path, buf.getbuffer(), what="step-time cache")


def load(path: Path) -> tuple[dict[str, GridStepTime], dict[str, Any]] | None:
    """The grids and held-out errors saved at ``path``, or None when absent or unreadable."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            names = [str(s) for s in z["strategies"]]
            out = {}
            for i, s in enumerate(names):
                tabs = [Table(z[f"{i}_{m}_T"], z[f"{i}_{m}_C"], z[f"{i}_{m}_us"]) for m in ("decode", "prefill")]
                out[s] = GridStepTime(*tabs)
            return out, json.loads(str(z["holdout_json"]))
    except (OSError, KeyError, ValueError, ConfigError):
        return None


__all__ = ["AffineStepTime", "ConstantStepTime", "GRID_VERSION", "GridStepTime", "Simulate", "Table", "assemble",
           "build_grid", "grid_piece",
           "cache_key", "holdout_error", "holdout_points", "load", "pow2_grid", "save"]
