"""Synthetic routing, deterministic by seed.

Notation: L layers, S steps, T tokens (per step), K top-k, E experts, G expert groups.

Method (MoonEP's benchmark method, generalised):

1. **Popularity.** A standard-normal score ``z_E`` is drawn once from the seed. Each popularity
   model maps it to log-popularity ``logp_E``:

   - ``maxvio`` / ``sigma``: lognormal, ``logp = sigma * z`` (``p_e ∝ exp(N(0, sigma))``); with a
     target maxvio, sigma is found by bisection in log scale (below);
   - ``zipf``: ``p ∝ 1 / rank^a`` where rank orders experts by z;
   - ``hot``: the N experts with the largest z are r times as popular as the others, r set so they
     take the chosen share of all selections;
   - ``uniform``: all equal.

   Per-layer variation v mixes a fresh normal per layer into z (``sqrt(1-v^2) z + v z'``);
   drift d does the same from step to step (an AR(1) walk), so popularity moves across steps.
2. **Sampling.** K distinct experts per token without replacement, with probability proportional to
   ``p_e`` at each draw (Plackett-Luce; :mod:`moonep_sim.routing.sampling`): by sequential
   inverse-CDF draws with repeats rejected, O(T K), or, with ``--logits``, by the equivalent
   Gumbel top-k *exponential race* over a ``[T, E]`` noise matrix, chunked over tokens. Weights
   are the race's softmax over the chosen K (their perturbed scores act as router logits;
   ``--logits`` stores every expert's).
3. **Group-limited routing** (DeepSeek-V3 style): experts form G contiguous groups; a group's
   score is the sum of its two best expert scores; each token keeps its top-M groups and picks
   its top-K experts inside them (each group's race drawn on its own, the same rule as a mask
   over the race's scores).

**Hitting a maxvio target.** ``maxvio = max_e(T_e / mean_T) - 1`` over one block's counts (a
block is one (layer, step)). sigma is first set by root finding on the *expected* maxvio: inclusion
probabilities of the race (``pi_e = 1 - exp(-p_e tau)``, tau such that ``sum pi = K``) plus the
binomial noise of the hottest expert (fixed-seed normal draws); the block is then sampled, and if
its realised maxvio is more than 2% off, sigma is refined by bisection on the realised statistic
with the same seed (same random draws, so it is a deterministic function of sigma; a redraw reuses
the first draw's noise -- the race's exponentials, the plain fast path's exponentials and uniforms
-- and the plain fast path's redraws only count, the chosen one's weights replayed after: the same
values as drawing afresh, at a fraction of the cost). A target
above ``E/K - 1`` is impossible (an expert takes at most one selection per token); a target below
the sampling-noise floor (the maxvio of uniform popularity at this token count) is unreachable;
both raise a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.routing.metrics import gini, maxvio as maxvio_of
from moonep_sim.routing.sampling import sample_topk  # re-exported: the sampler generate() draws with
from moonep_sim.routing.sampling import pl_ids_again, pl_weights, sampler_of
from moonep_sim.io import check_output_path
from moonep_sim.limits import MAX_ELEMENTS, MAX_LAYERS, MAX_NUM_EXPERTS
from moonep_sim.routing.trace import LayerRouting, TraceMeta, model_meta, write_trace

TOLERANCE = 0.05           # promised relative accuracy of a maxvio target
_REFINE_TOL = 0.02         # refine when the first realised value is further off than this
SIGMA_MIN, SIGMA_MAX = 1e-4, 64.0


# ---------------------------------------------------------------------------------- options
MAX_SEED = (1 << 63) - 1
#: A generator spec's numeric keys: (integer?, low, high, what). The bounds every way a value enters
#: (``--gen``, ``--trace gen:``, a sweep axis, ``GeneratorSpec(...)`` from Python) goes through.
SPEC_BOUNDS: dict[str, tuple[bool, float, float, str]] = {
    "maxvio": (False, 0.0, 1e6, "a target maxvio > 0 (0 is uniform: use uniform=1)"),
    "sigma": (False, 0.0, SIGMA_MAX, "a lognormal spread >= 0"),
    "zipf": (False, 0.0, 1e3, "a Zipf exponent > 0"),
    "hot": (True, 1, MAX_NUM_EXPERTS, "hot experts"),
    "hot_share": (False, 0.0, 1.0, "the hot experts' share of selections, in (0, 1]"),
    "tokens_per_rank": (True, 1, 1 << 20, "tokens on each rank"),
    "layers": (True, 1, MAX_LAYERS, "generated layers"),
    "seed": (True, 0, MAX_SEED, "a seed >= 0"),
    "groups": (True, 1, MAX_NUM_EXPERTS, "expert groups"),
    "topk_groups": (True, 1, MAX_NUM_EXPERTS, "groups kept per token"),
    "experts": (True, 1, MAX_NUM_EXPERTS, "routed experts (overrides the model's)"),
    "top_k": (True, 1, 1 << 10, "experts per token (overrides the model's)"),
}
_OPEN_LOW = {"maxvio", "zipf", "hot_share"}  # strictly above the low bound


def check_spec_value(key: str, value: Any, what: str = "generator spec") -> None:
    """Refuse (one line naming ``key``) a generator value of the wrong type, not finite, not an
    integer where one is meant, or outside :data:`SPEC_BOUNDS`."""
    if key not in SPEC_BOUNDS or value is None:
        return
    integer, lo, hi, meaning = SPEC_BOUNDS[key]
    name = f"{what} {key.replace('_', '-')}"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    require(ok_type and not isinstance(value, bool),
            f"{name} ({value!r}) must be {'an integer' if integer else 'a number'}: {meaning}")
    require(math.isfinite(value), f"{name} ({value}) must be finite: {meaning}")
    low_ok = value > lo if key in _OPEN_LOW else value >= lo
    def fmt(x):
        return str(int(x)) if integer else f"{x:g}"
    require(low_ok and value <= hi, f"{name} ({fmt(value)}) must be in {'(' if key in _OPEN_LOW else '['}{fmt(lo)}, "
                                    f"{fmt(hi)}]: {meaning}")


@dataclass(frozen=True)
class PopularitySpec:
    """Exactly one popularity model: ``maxvio`` (target), ``sigma`` (fixed lognormal spread),
    ``zipf`` (exponent a > 0), ``hot`` + ``hot_share`` (N hot experts taking share F of
    selections), or ``uniform``."""

    maxvio: float | None = None
    sigma: float | None = None
    zipf: float | None = None
    hot: int | None = None
    hot_share: float | None = None
    uniform: bool = False

    @property
    def kind(self) -> str:
        given = [k for k in ("maxvio", "sigma", "zipf", "hot") if getattr(self, k) is not None]
        if self.uniform:
            given.append("uniform")
        if len(given) != 1:
            raise ConfigError(f"popularity ({', '.join(given) or 'none'}) must be exactly one of "
                              "maxvio, sigma, zipf, hot (+hot_share), uniform")
        return given[0]

    def check(self, num_experts: int, top_k: int) -> None:
        kind = self.kind
        E, K = num_experts, top_k
        if kind == "maxvio":
            require(math.isfinite(self.maxvio) and self.maxvio > 0,
                    f"maxvio ({self.maxvio}) must be > 0 (use uniform for no skew)")
            require(self.maxvio <= E / K - 1 + 1e-12,
                    f"maxvio ({self.maxvio}) must be <= E/K - 1 ({E / K - 1:g}, E={E}, K={K}): an expert "
                    "takes at most one selection per token, so T_e <= T = (E/K) * mean_T")
        elif kind == "sigma":
            require(math.isfinite(self.sigma) and self.sigma >= 0, f"sigma ({self.sigma}) must be >= 0")
        elif kind == "zipf":
            require(math.isfinite(self.zipf) and self.zipf > 0, f"zipf ({self.zipf}) must be > 0")
        elif kind == "hot":
            require(self.hot_share is not None, "hot_share must be given with hot")
            require(1 <= self.hot < E, f"hot ({self.hot}) must be in [1, num_experts={E})")
            lo, hi = self.hot / E, min(1.0, self.hot / K)
            require(lo <= self.hot_share <= hi,
                    f"hot_share ({self.hot_share}) must be in [{lo:g}, {hi:g}] for {self.hot} hot experts "
                    f"of E={E}, K={K}: at least their uniform share, at most one selection per token each")
        if kind != "hot":
            require(self.hot_share is None, "hot_share needs hot")


@dataclass
class Generated:
    """A generated routing: ids/weights [L, S*T, K], step [S*T], optional logits [L, S*T, E]."""

    topk_ids_LTK: np.ndarray
    topk_weights_LTK: np.ndarray
    step_T: np.ndarray
    router_logits_LTE: np.ndarray | None
    num_experts: int
    report: dict[str, Any] = field(default_factory=dict)

    def layer(self, i: int) -> LayerRouting:
        return LayerRouting(self.topk_ids_LTK[i], self.topk_weights_LTK[i], self.num_experts, i)


# ---------------------------------------------------------------------------------- helpers
def _rng(seed: int, *path: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), *[int(p) for p in path]]))


def inclusion_probs(logp_E: np.ndarray, top_k: int) -> np.ndarray:
    """Probability that each expert is among a token's K (race approximation), float64 [E].

    ``pi_e = 1 - exp(-p_e * tau)`` with tau solving ``g(tau) = sum_e pi_e - K = 0``. g is increasing
    and concave in tau, so Newton's method started below the root (``tau = K / sum(p)``: there
    ``sum(1 - exp(-p tau)) <= tau * sum(p) = K``) climbs to it monotonically, never overshooting
    (each tangent lies above g): about 9 iterations on average, where the former safeguarded
    Newton in ``log tau`` fell back to bisection for about half its calls (43 iterations each) --
    4x faster per call, the maxvio calibration's ~56 calls per layer. tau is capped at ``e^60``
    (the old bracket's end: reached only as K -> E, where every pi is 1).
    """
    p = np.exp(np.asarray(logp_E, np.float64) - np.max(logp_E))
    K = float(top_k)
    tau = K / float(p.sum())
    cap = math.exp(60.0)
    for _ in range(200):
        x = p * tau
        g = float((-np.expm1(-x)).sum()) - K
        d = float((p * np.exp(-x)).sum())               # dg/dtau
        if g >= 0 or d <= 0:                            # at the root (to rounding), or flat
            break
        nxt = min(tau - g / d, cap)
        if nxt <= tau * (1 + 1e-15):                    # no more progress: converged (or capped)
            tau = max(nxt, tau)
            break
        tau = nxt
    return -np.expm1(-p * tau)


def _expected_maxvio(logp_E: np.ndarray, top_k: int, tokens: int, noise_M_E: np.ndarray) -> float:
    pi = inclusion_probs(logp_E, top_k)
    mean = tokens * top_k / pi.size
    c = tokens * pi + np.sqrt(tokens * pi * (1 - pi)) * noise_M_E
    return float(np.mean(c.max(axis=1)) / mean - 1.0)


def _expected_root(g) -> float:
    """log sigma where the expected maxvio meets the target, ``g(log sigma) = 0`` (g: expected minus
    target, increasing): Brent's method (``scipy.optimize.brentq``) on ``[log SIGMA_MIN, log
    SIGMA_MAX]`` to full precision (about 14 evaluations where the bisection it replaced took 56; the two roots agree to ~3e-14
    relative, so the calibrated draws are the same). A target outside the range's values gives the
    range's end (the realised calibration then says why it is unreachable)."""
    lo, hi = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
    g_lo = g(lo)
    if g_lo >= 0:
        return lo
    g_hi = g(hi)
    if g_hi < 0:
        return hi
    from scipy.optimize import brentq  # imported here: only a calibrated generation pays its import

    return float(brentq(g, lo, hi, xtol=1e-15, rtol=8.9e-16, maxiter=200))


def _logp_for(spec: PopularitySpec, z_E: np.ndarray, top_k: int, sigma: float | None = None) -> np.ndarray:
    kind = spec.kind
    E = z_E.size
    if kind in ("maxvio", "sigma"):
        return (sigma if sigma is not None else spec.sigma) * z_E
    if kind == "uniform":
        return np.zeros(E)
    rank = np.empty(E, np.int64)
    rank[np.argsort(-z_E, kind="stable")] = np.arange(E)
    if kind == "zipf":
        return -spec.zipf * np.log1p(rank)
    # hot: N hottest-z experts get log-ratio lr, chosen so their expected share is hot_share
    hot = rank < spec.hot
    lo, hi = 0.0, 60.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        share = inclusion_probs(np.where(hot, mid, 0.0), top_k)[hot].sum() / top_k
        lo, hi = (mid, hi) if share < spec.hot_share else (lo, mid)
    return np.where(hot, 0.5 * (lo + hi), 0.0)


def _block(spec: PopularitySpec, z_E: np.ndarray, top_k: int, tokens: int, seed: int, path: tuple,
           groups: int, topk_groups: int, with_logits: bool) -> tuple:
    """Sample one (layer, step) block; returns ids, weights, logits, info, and the per-expert counts
    of ids when the calibration counted them (else None)."""
    kind = spec.kind
    # every draw of this block is seeded alike: what the sampler can reuse (the race's noise, the
    # plain fast path's uniforms) is drawn once; later draws of the plain fast path only count
    redraw: dict | None = {} if kind == "maxvio" else None   # one draw only: nothing kept
    logp = lambda sig: _logp_for(spec, z_E, top_k, sig)
    draw = lambda sig: sample_topk(logp(sig), top_k, tokens, _rng(seed, 1, *path), groups=groups,
                                   topk_groups=topk_groups, with_logits=with_logits, noise=redraw)
    counts_only = sampler_of(z_E.size, tokens, groups, topk_groups, with_logits) == "pl"
    if kind != "maxvio":
        ids, w, lg = draw(None)
        return ids, w, lg, {}, None
    target = spec.maxvio
    E = z_E.size
    noise = _rng(seed, 2, *path).standard_normal((16, E))
    ls = _expected_root(lambda ls: _expected_maxvio(math.exp(ls) * z_E, top_k, tokens, noise) - target)
    evals = []          # (relative error, log sigma, maxvio) of every draw
    best: list = []     # the first draw of the least error: log sigma, ids, weights, logits, counts

    def realised(log_sigma: float):
        if counts_only and "u" in redraw:  # the same experts as a whole draw, without its weights
            (ids, c), w, lg = pl_ids_again(logp(math.exp(log_sigma)), top_k, tokens, redraw), None, None
        else:
            ids, w, lg = draw(math.exp(log_sigma))
            c = redraw.pop("counts", None)  # counted by the sampler's kernels (plain fast path), else here
            if c is None:
                c = np.bincount(ids.ravel(), minlength=E)
        mv = maxvio_of(c)
        err = abs(mv / target - 1)
        if not evals or err < min(e[0] for e in evals):
            best[:] = [log_sigma, ids, w, lg, c]
        evals.append((err, log_sigma, mv))
        return mv

    mv = realised(ls)
    if abs(mv / target - 1) > _REFINE_TOL:
        # bracket the target on the realised statistic, then bisect (same seed: same draws)
        step = math.log(1.25)
        direction = 1.0 if mv < target else -1.0
        a = ls
        b = ls
        for _ in range(40):
            b = min(max(b + direction * step, math.log(SIGMA_MIN)), math.log(SIGMA_MAX))
            mvb = realised(b)
            if (mvb - target) * direction >= 0 or abs(mvb / target - 1) <= _REFINE_TOL:
                break
            if b in (math.log(SIGMA_MIN), math.log(SIGMA_MAX)):
                break
            a = b
            step *= 1.5
        lo_, hi_ = (a, b) if direction > 0 else (b, a)
        for _ in range(20):
            if min(e[0] for e in evals) <= _REFINE_TOL:
                break
            mid = 0.5 * (lo_ + hi_)
            mvm = realised(mid)
            lo_, hi_ = (mid, hi_) if mvm < target else (lo_, mid)
    err, ls_best, mv_best = min(evals, key=lambda e: e[0])
    _, ids, w, lg, counts = best
    if err > TOLERANCE:
        all_mv = [e[2] for e in evals]
        if min(all_mv) > target:
            raise ConfigError(
                f"maxvio ({target}) must be >= the sampling-noise floor (about {min(all_mv):.3g} for "
                f"T={tokens} tokens, E={E}, K={top_k}): counts of uniform popularity already vary that "
                "much; use more tokens or --uniform")
        raise ConfigError(f"maxvio ({target}) must be reachable (E={E}, K={top_k}, T={tokens}): the best "
                          f"realised value was {mv_best:.4g} at sigma={math.exp(ls_best):.4g}")
    if w is None:       # a counted draw: its ids as the sampler returns them, its weights replayed
        w = pl_weights(logp(math.exp(ls_best)), ids, redraw)
        ids = ids.T.astype(np.int64, order="C")
    return ids, w, lg, {"sigma": math.exp(ls_best), "calibration_samples": len(evals)}, counts


# ---------------------------------------------------------------------------------- public API
def generate(num_experts: int, top_k: int, tokens: int, seed: int, *, layers: int = 1, steps: int = 1,
             drift: float = 0.0, layer_variation: float = 0.0, groups: int = 1, topk_groups: int = 1,
             with_logits: bool = False, **popularity) -> Generated:
    """Generate ``layers`` x ``steps`` blocks of ``tokens`` tokens each (see the module docstring).

    tokens: T per step (the trace holds S*T tokens per layer, step-major). drift, layer_variation
    in [0, 1]. groups / topk_groups: group-limited routing (1 / 1 = none). popularity: the fields of
    one :class:`PopularitySpec` (``maxvio=``, ``sigma=``, ``zipf=``, ``hot=`` + ``hot_share=``,
    ``uniform=True``), which they build. Deterministic by seed.
    """
    spec = PopularitySpec(**popularity)
    E, K = int(num_experts), int(top_k)
    require(1 <= E <= MAX_NUM_EXPERTS, f"num_experts ({E}) must be in [1, {MAX_NUM_EXPERTS}]")
    require(1 <= K <= E, f"top_k ({K}) must be in [1, num_experts={E}]")
    require(tokens >= 1, f"tokens ({tokens}) must be >= 1")
    require(1 <= layers <= MAX_LAYERS, f"layers ({layers}) must be in [1, {MAX_LAYERS}]")
    require(steps >= 1, f"steps ({steps}) must be >= 1")
    check_size(tokens, K, layers, steps)
    require(0.0 <= drift <= 1.0, f"drift ({drift}) must be in [0, 1]")
    require(0.0 <= layer_variation <= 1.0, f"layer_variation ({layer_variation}) must be in [0, 1]")
    spec.check(E, K)
    grouped = groups > 1 or topk_groups > 1
    if grouped:
        require(groups >= 1 and E % groups == 0, f"groups ({groups}) must divide num_experts ({E})")
        require(1 <= topk_groups <= groups, f"topk_groups ({topk_groups}) must be in [1, groups={groups}]")
        require(K <= topk_groups * (E // groups),
                f"top_k ({K}) must be <= topk_groups * E/groups ({topk_groups * (E // groups)}): the "
                "kept groups must hold K experts")
    N = tokens * steps
    one = layers == 1 and steps == 1      # one block: its arrays are the output (no copy)
    ids = None if one else np.empty((layers, N, K), np.int64)
    w = None if one else np.empty((layers, N, K), np.float32)
    lg = np.empty((layers, N, E), np.float32) if with_logits and not one else None
    z_base = _rng(seed, 0).standard_normal(E)
    blocks = []
    for li in range(layers):
        z = z_base
        if layer_variation > 0:
            z = math.sqrt(1 - layer_variation ** 2) * z + layer_variation * _rng(seed, 3, li).standard_normal(E)
        for si in range(steps):
            if si > 0 and drift > 0:
                z = math.sqrt(1 - drift ** 2) * z + drift * _rng(seed, 4, li, si).standard_normal(E)
            b_ids, b_w, b_lg, info, c = _block(spec, z, K, tokens, seed, (li, si), groups, topk_groups,
                                            with_logits)
            sl = slice(si * tokens, (si + 1) * tokens)
            if one:
                ids, w, lg = b_ids[None], b_w[None], b_lg[None] if with_logits else None
            else:
                ids[li, sl], w[li, sl] = b_ids, b_w
                if with_logits:
                    lg[li, sl] = b_lg
            if c is None:
                c = np.bincount(b_ids.ravel(), minlength=E)
            blocks.append({"layer": li, "step": si, "maxvio": maxvio_of(c), "gini": gini(c), **info})
    report = {
        "popularity": spec.kind,
        "params": {k: v for k in ("maxvio", "sigma", "zipf", "hot", "hot_share")
                   if (v := getattr(spec, k)) is not None},
        "seed": int(seed), "drift": drift, "layer_variation": layer_variation,
        "groups": groups, "topk_groups": topk_groups,
        "realised_maxvio": [b["maxvio"] for b in blocks],
        "blocks": blocks,
    }
    if spec.kind == "hot":
        hot_ids = np.argsort(-z_base, kind="stable")[:spec.hot]
        report["hot_experts_layer0"] = np.sort(hot_ids).tolist()
    step = np.repeat(np.arange(steps, dtype=np.int32), tokens)
    return Generated(ids, w, step, lg, E, report)


def sigma_for_maxvio(num_experts: int, top_k: int, tokens: int, maxvio: float, seed: int) -> float:
    """The lognormal spread sigma whose *expected* maxvio over ``tokens`` tokens is ``maxvio``, for the
    popularity scores ``generate(..., seed)`` draws (the first step of the maxvio calibration, without
    sampling). Never refuses: a target under the sampling-noise floor of ``tokens`` tokens gives
    SIGMA_MIN (uniform popularity), one above the reachable range SIGMA_MAX. What a stand-in for an
    unrecorded layer is drawn at: the skew measured over a whole trace, fitted once at the trace's
    pooled token count, then drawn at any pass's own token count (``sigma=``), where a pass of a
    dozen tokens could not hit the target itself."""
    E = int(num_experts)
    z_E = _rng(seed, 0).standard_normal(E)
    noise = _rng(seed, 2, 0, 0).standard_normal((16, E))
    return math.exp(_expected_root(lambda ls: _expected_maxvio(math.exp(ls) * z_E, top_k, int(tokens), noise)
                                   - float(maxvio)))


def generate_layer(num_experts: int, top_k: int, tokens: int, seed: int, **popularity) -> LayerRouting:
    """One layer of ``tokens`` tokens (one step): ``generate(...).layer(0)``.

    Keyword arguments: one of ``maxvio=``, ``sigma=``, ``zipf=``, ``hot=`` + ``hot_share=``,
    ``uniform=True``; optionally ``groups=``, ``topk_groups=``.
    """
    return generate(num_experts, top_k, tokens, seed, **popularity).layer(0)


def check_size(tokens: int, top_k: int, layers: int = 1, steps: int = 1) -> None:
    """Refuse, before allocating, routing larger than :data:`moonep_sim.limits.MAX_ELEMENTS` ids."""
    n = int(tokens) * int(top_k) * int(layers) * int(steps)
    require(n <= MAX_ELEMENTS, f"tokens ({tokens}) x top_k ({top_k}) x layers ({layers}) x steps ({steps}) = {n} "
                               f"expert ids must be <= {MAX_ELEMENTS} (the largest routing moonep-sim generates)")


def generate_trace(path, num_experts: int, top_k: int, tokens: int, seed: int, *, model=None,
                   **kwargs) -> dict[str, Any]:
    """Generate (see :func:`generate`) and write a trace file atomically; returns the report.

    model: a preset name, a model file or a ModelSpec (``models.resolve_model``), stored with the
    trace (a preset by name, any other shape as ``model_spec``)."""
    check_output_path(path, "-o")  # before the work
    named = model_meta(model)
    g = generate(num_experts, top_k, tokens, seed, **kwargs)
    L = g.topk_ids_LTK.shape[0]
    steps = int(kwargs.get("steps", 1))
    desc = ", ".join(f"{k}={v}" for k, v in g.report["params"].items()) or g.report["popularity"]
    meta = TraceMeta(
        kind="tokens", num_experts=num_experts, top_k=top_k, layer_ids=list(range(L)),
        num_tokens=int(g.topk_ids_LTK.shape[1]), **named,
        steps=f"{steps} step(s) of {tokens} tokens each (step tensor)",
        source=f"synthetic: moonep-sim trace gen ({desc}, seed={seed})",
        attribution="synthetic (moonep-sim)",
        import_report={"generator": g.report},
    )
    tensors = {"topk_ids": g.topk_ids_LTK, "topk_weights": g.topk_weights_LTK, "step": g.step_T}
    if g.router_logits_LTE is not None:
        tensors["router_logits"] = g.router_logits_LTE
    write_trace(path, meta, tensors, what="-o")
    return g.report
