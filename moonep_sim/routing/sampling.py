"""K distinct experts per token, drawn without replacement with probability proportional to popularity.

Notation: T tokens, K top-k, E experts, G expert groups.

The distribution is **Plackett-Luce**: a token's first expert is drawn with probability
``p_e / sum(p)``, each next one from the experts not yet chosen, renormalised. Two samplers draw
it, with the same distribution (not the same outputs for a seed):

- :func:`sample_topk_race` -- the **reference**, the Gumbel top-k trick run as the equivalent
  *exponential race*: the K smallest of ``X_te / p_e`` with ``X ~ Exp(1)`` over a ``[T, E]``
  noise matrix (chunked over tokens, ``np.argpartition``). ``logp_e - log X_te`` are
  Gumbel-perturbed scores, so this sampler also gives full router logits (``with_logits``) and
  group-limited routing (a group's score is the sum of its two best expert scores; each token
  keeps its top-M groups and picks its top-K experts inside them), which need every expert's score.
- :func:`sample_topk_pl` -- the fast path for plain top-K: the K positions one after another,
  each an exact inverse-CDF draw from the whole popularity (:class:`InverseCDF`, a guide table
  instead of a binary search over E) with the repeats of an already chosen expert rejected and
  redrawn (a draw from ``p`` conditioned on "not chosen" IS the
  next Plackett-Luce draw); rows whose chosen mass exceeds one half, and rows still rejected after
  a few rounds, draw from their exact renormalised remainder (a per-row cumulative sum). Cost
  ``O(T K)`` draws plus ``O(T K^2)`` integer compares instead of ``O(T E)`` noise and a partition:
  a Kimi-K3 layer (E=896, K=16, T=262144) takes about 0.15 s instead of about 2.5 s (measured
  together on the 2-core reference machine; docs/results/traces.md).

Weights: the race's arrival times. In the race, token t's k-th expert arrives at
``tau_k = sum_{j<=k} X_j / (P - P_{j-1})`` (X iid Exp(1), P the total popularity, ``P_{j-1}`` the
popularity already chosen: memorylessness of the exponential), independent of which experts won.
Both samplers return ``w_k = (1/tau_k) / sum_j (1/tau_j)``: the softmax over the K chosen of the
scores ``-log tau_k`` (the Gumbel-perturbed logits up to a per-token constant), in the order drawn
(descending score).
"""

from __future__ import annotations

import math

import numpy as np

CHUNK_ELEMS = 1 << 22      # tokens per chunk = CHUNK_ELEMS // E (fixed: results never depend on the machine)
LOGP_FLOOR = -80.0         # log-popularity clipped here (exp stays a normal float32)
_REJECT_ROUNDS = 6         # rejection rounds per position before a row's exact remainder draw
_LINEAR_WIDTH = 4          # guide ranges up to this wide are walked, wider ones bisected (fewer array passes)
_REJECT_MASS = 0.5         # rows whose chosen popularity exceeds this share draw from the remainder at once


def _popularity(logp_E: np.ndarray) -> np.ndarray:
    lp = np.maximum(np.asarray(logp_E, np.float64) - np.max(logp_E), LOGP_FLOOR)
    return lp


# ---------------------------------------------------------------------------------- reference: the race
def sample_topk_race(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                     groups: int = 1, topk_groups: int = 1, with_logits: bool = False
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The exponential race over a ``[T, E]`` noise matrix (the reference; see the module docstring).

    Returns ids int64 [T, K] (by descending score), weights float32 [T, K] (softmax of the chosen
    scores), and the scores float32 [T, E] when ``with_logits``. Chunked: at most
    ``CHUNK_ELEMS`` floats of noise live at once.
    """
    E, K = int(np.size(logp_E)), int(top_k)
    lp = _popularity(logp_E)
    lp32 = lp.astype(np.float32)
    inv_p = np.exp(-lp).astype(np.float32)
    grouped = groups > 1 and topk_groups < groups
    ids = np.empty((tokens, K), np.int64)
    w = np.empty((tokens, K), np.float32)
    logits = np.empty((tokens, E), np.float32) if with_logits else None
    chunk = max(1, CHUNK_ELEMS // E)
    for s in range(0, tokens, chunk):
        n = min(chunk, tokens - s)
        x = rng.standard_exponential((n, E), dtype=np.float32)
        if grouped or with_logits:
            score = lp32 - np.log(np.maximum(x, np.float32(1e-30)))      # logp + Gumbel
            if with_logits:
                logits[s:s + n] = score
            if grouped:
                score = mask_groups(score, groups, topk_groups)
            key = -score
        else:
            key = x
            key *= inv_p                                                 # X / p: smaller wins
        part = np.argpartition(key, K - 1, axis=1)[:, :K] if K < E else np.tile(np.arange(E), (n, 1))
        kv = np.take_along_axis(key, part, axis=1)
        order = np.argsort(kv, axis=1, kind="stable")
        ids[s:s + n] = np.take_along_axis(part, order, axis=1)
        kv = np.take_along_axis(kv, order, axis=1).astype(np.float64)
        # chosen scores: -log(key) (race) or -key (scores); softmax over the K chosen
        sc = kv if (grouped or with_logits) else np.log(np.maximum(kv, 1e-300))
        sc = -(sc - sc[:, :1])
        e = np.exp(sc)
        w[s:s + n] = e / e.sum(axis=1, keepdims=True)
    return ids, w, logits


def mask_groups(score_TE: np.ndarray, groups: int, topk_groups: int) -> np.ndarray:
    """Scores with every expert outside each token's top-M groups set to -inf (a copy)."""
    T, E = score_TE.shape
    g = score_TE.reshape(T, groups, E // groups)
    if E // groups >= 2:
        top2 = np.partition(g, E // groups - 2, axis=2)[:, :, -2:]
        gscore = top2.sum(axis=2)
    else:
        gscore = g[:, :, 0]
    keep = np.argpartition(-gscore, topk_groups - 1, axis=1)[:, :topk_groups]
    mask = np.ones((T, groups), bool)
    np.put_along_axis(mask, keep, False, axis=1)
    out = g.copy()
    out[mask] = -np.inf
    return out.reshape(T, E)


# ---------------------------------------------------------------------------------- fast path: Plackett-Luce
class InverseCDF:
    """Exact inverse-CDF draws from a fixed distribution ``p_E`` (float64 [E], > 0) in expert order.

    ``draw(u)`` for uniforms ``u`` in [0, 1) is ``searchsorted(cum, u, side="right")``: the first
    expert whose cumulative mass exceeds u. A draw is a monotone function of u, so two
    popularities drawn with the same u differ only where a boundary moved past it (the coupling
    the maxvio calibration relies on: the realised statistic is a smooth function of sigma).
    Faster than ``np.searchsorted`` by a guide table (Chen and Asau's indexed search): M >= 8E
    equal buckets of u, each storing the answer range ``[lo, hi]`` of its bucket, then a
    walk of at most 4 steps (a range that wide or less) or a vectorised binary search of
    ``ceil(log2(widest range + 1))`` steps (ranges 1 to 6 wide for lognormal popularity at E=896;
    measured 2-4x faster than ``np.searchsorted`` there).
    """

    def __init__(self, p_E: np.ndarray) -> None:
        E = p_E.size
        cum = np.cumsum(p_E)
        cum /= cum[-1]
        cum[-1] = 1.0                                  # u < 1 always lands on an expert
        self.cum_E = cum
        self.M = 1 << max(10, int(math.ceil(math.log2(8 * E))))   # a power of two: u * M and b / M exact
        g = np.searchsorted(cum, np.arange(self.M + 1) / self.M, side="right")
        self.guide = np.minimum(g, E - 1)
        self.width = int((self.guide[1:] - self.guide[:-1]).max())
        self.steps = int(math.ceil(math.log2(self.width + 1))) if self.width else 0

    def draw(self, u: np.ndarray) -> np.ndarray:
        """Expert ids, intp [N], of uniforms ``u`` float64 [N] in [0, 1)."""
        b = (u * self.M).astype(np.intp)
        lo = self.guide.take(b)
        if self.width <= _LINEAR_WIDTH:                # step forward while the boundary is passed
            for _ in range(self.width):
                lo += self.cum_E.take(lo) <= u
        else:
            hi = self.guide.take(b + 1)
            for _ in range(self.steps):                # invariant: the answer lies in [lo, hi]
                mid = (lo + hi) >> 1
                right = self.cum_E.take(mid) <= u
                lo = np.where(right, mid + 1, lo)
                hi = np.where(right, hi, mid)
        return lo


def _remainder_draw(p_E: np.ndarray, chosen_NK: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row from ``p_E`` with the row's ``chosen_NK`` experts removed, renormalised
    (exact inverse CDF over each row's own cumulative sum; chunked over rows)."""
    N, E = chosen_NK.shape[0], p_E.size
    out = np.empty(N, np.int64)
    chunk = max(1, CHUNK_ELEMS // E)
    for s in range(0, N, chunk):
        c = chosen_NK[s:s + chunk]
        P = np.tile(p_E, (c.shape[0], 1))
        if c.shape[1]:
            np.put_along_axis(P, c, 0.0, axis=1)
        cum = np.cumsum(P, axis=1)
        u = rng.random(c.shape[0]) * cum[:, -1]
        e = (cum <= u[:, None]).sum(axis=1)            # first index whose cumulative mass exceeds u
        last = E - 1 - np.argmax(P[:, ::-1] > 0, axis=1)  # u rounded up to the total: the last live expert
        out[s:s + chunk] = np.minimum(e, last)
    return out


def sample_topk_pl(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Plain top-K by sequential Plackett-Luce draws (the fast path; see the module docstring).

    Returns ids int64 [T, K] in the order drawn (descending score) and weights float32 [T, K]
    (the race's softmax over the chosen, from the arrival times). Same distribution as
    :func:`sample_topk_race` without groups or logits.

    Random streams: ``rng`` gives every token exactly one uniform and one exponential per
    position whatever the popularity (so draws at two popularities are coupled token by token);
    redraws after a rejection and remainder draws come from a child stream seeded once from it.
    """
    E, K, T = int(np.size(logp_E)), int(top_k), int(tokens)
    p = np.exp(_popularity(logp_E))
    p /= p.sum()
    icdf = InverseCDF(p)
    retry = np.random.default_rng(int(rng.integers(0, 1 << 63)))
    small = np.int16 if E <= np.iinfo(np.int16).max else np.int32
    ids_KT = np.empty((K, T), small)                   # position-major: each position one contiguous row
    inv_tau_KT = np.empty((K, T), np.float32)          # 1 / arrival time of each chosen expert
    mass_T = np.zeros(T)                               # popularity already chosen per token
    tau_T = np.zeros(T)

    def repeats(e: np.ndarray, k: int, rows: np.ndarray | None) -> np.ndarray:
        rep = np.zeros(e.size, bool)
        for j in range(k):
            rep |= (ids_KT[j] if rows is None else ids_KT[j, rows]) == e
        return rep

    for k in range(K):
        # arrival time of the k-th expert: tau += X / (popularity not yet chosen)
        tau_T += rng.standard_exponential(T, dtype=np.float32) / np.maximum(1.0 - mass_T, 1e-300)
        np.divide(1.0, tau_T, out=inv_tau_KT[k])
        e = icdf.draw(rng.random(T)).astype(small)
        ids_KT[k] = e
        todo = np.flatnonzero(repeats(e, k, None) | (mass_T > _REJECT_MASS)) if k else np.empty(0, np.intp)
        hard = todo[mass_T[todo] > _REJECT_MASS]       # mostly chosen already: the remainder at once
        todo = todo[mass_T[todo] <= _REJECT_MASS]
        for _ in range(_REJECT_ROUNDS):
            if todo.size == 0:
                break
            e = icdf.draw(retry.random(todo.size)).astype(small)
            rep = repeats(e, k, todo)
            ids_KT[k, todo[~rep]] = e[~rep]
            todo = todo[rep]
        rest = np.union1d(hard, todo) if todo.size else hard
        if rest.size:
            ids_KT[k, rest] = _remainder_draw(p, ids_KT[:k, rest].T.astype(np.int64), retry)
        mass_T += p.take(ids_KT[k])
    # weights ∝ 1 / tau (the softmax of the scores -log tau over the chosen K)
    inv_tau_KT /= inv_tau_KT.sum(axis=0)
    return ids_KT.T.astype(np.int64, order="C"), inv_tau_KT.T.copy(order="C")


def sample_topk(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                groups: int = 1, topk_groups: int = 1, with_logits: bool = False
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """K distinct experts per token, drawn without replacement with probability ∝ exp(logp).

    Returns ids int64 [T, K] (by descending score), weights float32 [T, K] (softmax of the chosen
    scores), and the scores float32 [T, E] when ``with_logits``. Plain top-K takes the fast
    Plackett-Luce path; group-limited routing and logits take the race (both: module docstring).
    """
    if (groups > 1 and topk_groups < groups) or with_logits:
        return sample_topk_race(logp_E, top_k, tokens, rng, groups=groups, topk_groups=topk_groups,
                                with_logits=with_logits)
    ids, w = sample_topk_pl(logp_E, top_k, tokens, rng)
    return ids, w, None


__all__ = ["CHUNK_ELEMS", "InverseCDF", "LOGP_FLOOR", "mask_groups", "sample_topk", "sample_topk_pl",
           "sample_topk_race"]
