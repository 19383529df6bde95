"""K distinct experts per token, drawn without replacement with probability proportional to popularity.

Notation: T tokens, K top-k, E experts, G expert groups.

The distribution is **Plackett-Luce**: a token's first expert is drawn with probability
``p_e / sum(p)``, each next one from the experts not yet chosen, renormalised. Three samplers draw
it, with the same distribution (not the same outputs for a seed); :func:`sample_topk` picks one
(the race for logits and for layers of at most ``CHUNK_ELEMS`` token-expert pairs):

- :func:`sample_topk_race` -- the **reference**, the Gumbel top-k trick run as the equivalent
  *exponential race*: the K smallest of ``X_te / p_e`` with ``X ~ Exp(1)`` over a ``[T, E]``
  noise matrix (chunked over tokens, ``np.argpartition``). ``logp_e - log X_te`` are
  Gumbel-perturbed scores, so this sampler also gives full router logits (``with_logits``), and
  group-limited routing (a group's score is the sum of its two best expert scores; each token
  keeps its top-M groups and picks its top-K experts inside them) as a mask over them.
- :func:`sample_topk_pl` -- the fast path for plain top-K: the K positions one after another,
  each an exact inverse-CDF draw from the whole popularity (:class:`InverseCDF`, a guide table
  instead of a binary search over E) with the repeats of an already chosen expert rejected and
  redrawn (a draw from ``p`` conditioned on "not chosen" IS the next Plackett-Luce draw); rows whose
  chosen mass exceeds one half, and rows still rejected after a few rounds, draw from their exact
  renormalised remainder (a per-row cumulative sum). Cost ``O(T K)`` draws plus ``O(T K^2)``
  integer compares instead of ``O(T E)`` noise and a partition: one draw of a Kimi-K3 layer
  (E=896, K=16, T=262144) takes about 0.08 CPU s instead of about 2.5 s (docs/results/steps.md).

The per-token work runs in compiled kernels (``sampling_kernels.py``), the one path the samplers
take; the numpy code they replaced is their test reference (``tests/sampling_reference.py``: the same
draws bit for bit from the same random numbers, taken from numpy's generator in the same order and
amounts; tests/test_sampling_kernels.py). The kernels measured 3-30x faster than it
(docs/results/steps.md); the race's tied rows, which the kernels leave, are sorted in numpy.
- :func:`sample_topk_grouped` -- the fast path for group-limited top-K: the race of each group
  run the same way (the experts' clocks are independent), its first two arrivals giving the group
  score, the kept groups' races continued and merged (exact; its docstring). About 2x faster than
  the race for DeepSeek-V3's 8 groups of 32, keep 4.

Weights: the race's arrival times. In the race, token t's k-th expert arrives at
``tau_k = sum_{j<=k} X_j / (P - P_{j-1})`` (X iid Exp(1), P the total popularity, ``P_{j-1}`` the
popularity already chosen: memorylessness of the exponential), independent of which experts won.
All three return ``w_k = (1/tau_k) / sum_j (1/tau_j)``: the softmax over the K chosen of the
scores ``-log tau_k`` (the Gumbel-perturbed logits up to a per-token constant), in the order drawn
(descending score).
"""

from __future__ import annotations

import math

import numpy as np

from moonep_sim.routing import sampling_kernels as _kn
from moonep_sim.routing import sampling_records as _rec

CHUNK_ELEMS = 1 << 22      # tokens per chunk = CHUNK_ELEMS // E (fixed: results never depend on the machine)
LOGP_FLOOR = -80.0         # log-popularity clipped here (exp stays a normal float32)
_REJECT_ROUNDS = 6         # rejection rounds per position before a row's exact remainder draw
_LINEAR_WIDTH = 4          # guide ranges up to this wide are walked, wider ones bisected (fewer array passes)
_REJECT_MASS = 0.5         # rows whose chosen popularity exceeds this share draw from the remainder at once


def _popularity(logp_E: np.ndarray) -> np.ndarray:
    return np.maximum(np.asarray(logp_E, np.float64) - np.max(logp_E), LOGP_FLOOR)


# ---------------------------------------------------------------------------------- reference: the race
def sample_topk_race(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                     groups: int = 1, topk_groups: int = 1, with_logits: bool = False,
                     noise: dict | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The exponential race over a ``[T, E]`` noise matrix (see the module docstring).

    Returns ids int64 [T, K] (by descending score), weights float32 [T, K] (softmax of the chosen
    scores), and the scores float32 [T, E] when ``with_logits``. Chunked: at most
    ``CHUNK_ELEMS`` floats of noise live at once.

    noise: a dict kept by a caller that draws the same block again at other popularities from
    an identically seeded ``rng`` (the maxvio calibration): the race's noise depends on ``rng``
    alone, so it is drawn (and its log taken) on the first call and reused after -- the same
    values, without the draws; ``rng`` is then left untouched. Only for one chunk (the race of
    at most ``CHUNK_ELEMS`` pairs, the layers :func:`sample_topk` gives it); None: always drawn.
    """
    return _race(logp_E, top_k, tokens, rng, groups, topk_groups, with_logits, noise, kernels=True)


def _race(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, groups: int, topk_groups: int,
          with_logits: bool, noise: dict | None, *, kernels: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`sample_topk_race`; ``kernels`` False: the numpy reference's race
    (``tests/sampling_reference.py``'s ``sample_topk_race``: the K smallest keys sorted in numpy for every row)."""
    E, K = int(np.size(logp_E)), int(top_k)
    lp = _popularity(logp_E)
    lp32 = lp.astype(np.float32)
    inv_p = np.exp(-lp).astype(np.float32)
    grouped = groups > 1 and topk_groups < groups
    ids = np.empty((tokens, K), np.int64)
    w = np.empty((tokens, K), np.float32)
    logits = np.empty((tokens, E), np.float32) if with_logits else None
    chunk = max(1, CHUNK_ELEMS // E)
    if noise is not None and tokens > chunk:
        noise = None                                   # several chunks: not kept
    for s in range(0, tokens, chunk):
        n = min(chunk, tokens - s)
        if noise is not None and "x" in noise:
            x = noise["x"]
        else:
            x = rng.standard_exponential((n, E), dtype=np.float32)
            if noise is not None:
                noise["x"] = x
        fast = kernels and not with_logits and K < E and (not grouped or E // groups >= 2)
        if grouped or with_logits:                     # the noise's log: kept with the noise
            logx = _kept(noise, "log", lambda: np.log(np.maximum(x, np.float32(1e-30))))
        rows = slice(None)                             # the rows whose keys numpy sorts: all, or
        if fast:                                       # the kernels': the same keys' K smallest, per token
            kv, ok = np.empty((n, K), np.float32), np.empty(n, np.bool_)
            if grouped:
                logT = _kept(noise, "logT", lambda: np.ascontiguousarray(logx.T))
                _kn.race_grouped(lp32, logT, logx, groups, topk_groups, K, ids[s:s + n], kv, ok)
            else:
                _kn.race_plain(x, inv_p, K, ids[s:s + n], kv, ok)
            rows = np.flatnonzero(~ok)                 # but for ties: which tied column wins is the partition's
        if not fast or rows.size:
            if grouped or with_logits:
                score = lp32 - logx[rows]                                   # logp + Gumbel
                if with_logits:
                    logits[s:s + n] = score
                if grouped:                            # in place: the logits hold their own copy
                    score = mask_groups(score, groups, topk_groups, copy=False)
                key = np.negative(score, out=score)
            else:                                      # (K = E, ties, or the numpy reference)
                key = x[rows] * inv_p                                       # X / p: smaller wins
            if fast:
                ids[s:s + n][rows], kv[rows] = smallest_k(key, K)
            else:
                ids[s:s + n], kv = smallest_k(key, K)
        kv = kv.astype(np.float64)
        # chosen scores: -log(key) (race) or -key (scores); softmax over the K chosen
        sc = kv if (grouped or with_logits) else np.log(np.maximum(kv, 1e-300))
        sc = -(sc - sc[:, :1])
        e = np.exp(sc)
        w[s:s + n] = e / e.sum(axis=1, keepdims=True)
    return ids, w, logits


def _kept(noise: dict | None, key: str, make) -> np.ndarray:
    """``make()``; with ``noise`` (:func:`sample_topk_race`), made once and kept under ``key``."""
    if noise is not None and key not in noise:
        noise[key] = make()
    return make() if noise is None else noise[key]


def _top2_sum(g_TGn: np.ndarray) -> np.ndarray:
    """The sum of each group's two largest scores, [T, G] (ties counted twice, as a partition
    does): a running (largest, second) over the group's members, member by member across all
    (token, group) rows at once -- the same values as ``np.partition(g, n - 2)[..., -2:].sum()``
    in about half its time at DeepSeek-V3's 8 groups of 32."""
    T, G, n = g_TGn.shape
    c = np.ascontiguousarray(g_TGn.reshape(T * G, n).T)       # [n, T*G]: one member of every row
    m1, m2 = np.maximum(c[0], c[1]), np.minimum(c[0], c[1])
    tmp = np.empty_like(m1)
    for r in c[2:]:
        np.minimum(m1, r, out=tmp)
        np.maximum(m2, tmp, out=m2)                             # the second: max(second, min(first, r))
        np.maximum(m1, r, out=m1)
    return (m1 + m2).reshape(T, G)


def _smallest_k_by_partition(key: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    E = key.shape[1]
    part = np.argpartition(key, K - 1, axis=1)[:, :K] if K < E else np.tile(np.arange(E), (key.shape[0], 1))
    kv = np.take_along_axis(key, part, axis=1)
    order = np.argsort(kv, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(kv, order, axis=1)


def smallest_k(key: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's K smallest keys in ascending order: their columns (int64 [n, K]) and values.

    The race's reference is ``np.argpartition`` then a stable ``np.argsort`` of the K found; with
    ties among a row's K + 1 smallest keys (float32 scores do tie: about one token in 150,000 at
    DeepSeek-V3's shape) which tied column it keeps, and in which order, is that partition's. So:
    the rows whose K + 1 smallest keys are all distinct -- where every exact method finds the same
    columns in the same order -- take a sort of the values (numpy's vectorised sort, about 4x faster
    than the partition at ``[1024, 256]``) and pick their columns by the K-th value; the other rows
    take the reference. The same output as the reference, row for row."""
    n, E = key.shape
    if K >= E or n == 0:
        return _smallest_k_by_partition(key, K)
    srt = np.sort(key, axis=1)[:, :K + 1]
    good = (srt[:, 1:] > srt[:, :-1]).all(axis=1)           # distinct, and the K-th below the next
    mask = key <= srt[:, K - 1:K]
    bad = np.flatnonzero(~good)
    mask[bad] = False
    mask[bad, :K] = True                                    # placeholder columns: the reference's below
    cols = (np.flatnonzero(mask) % E).reshape(n, K)         # each row's K columns, in column order
    order = np.argsort(np.take_along_axis(key, cols, axis=1), axis=1)   # distinct values: the only order
    ids, kv = np.take_along_axis(cols, order, axis=1), np.ascontiguousarray(srt[:, :K])
    if bad.size:
        ids[bad], kv[bad] = _smallest_k_by_partition(key[bad], K)
    return ids, kv


def mask_groups(score_TE: np.ndarray, groups: int, topk_groups: int, copy: bool = True) -> np.ndarray:
    """Scores with every expert outside each token's top-M groups set to -inf (a copy; with
    ``copy=False`` in place, ``score_TE`` returned)."""
    T, E = score_TE.shape
    g = score_TE.reshape(T, groups, E // groups)
    gscore = _top2_sum(g) if E // groups >= 2 else g[:, :, 0]
    keep = np.argpartition(-gscore, topk_groups - 1, axis=1)[:, :topk_groups]
    mask = np.ones((T, groups), bool)
    np.put_along_axis(mask, keep, False, axis=1)
    out = g.copy() if copy else g
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
    walk of at most 4 steps (a range that wide or less) or a binary search of
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
        self.record = _rec.Icdf(cum, self.guide, self.M, self.width, self.steps, self.width <= _LINEAR_WIDTH)


class _Races:
    """N independent exponential races run one arrival at a time by sequential Plackett-Luce draws
    (see the module docstring). Row r races the ``n`` experts ``[first_R[r], first_R[r] + n)``
    (its group; all E without groups). State: ``ids_KN`` the experts in arrival order, ``tau_KN``
    their arrival times (float64; same clock in every row), ``left_R`` each row's popularity not yet
    chosen. Draws: ``rng`` gives every row one exponential and one uniform per arrival; redraws
    after a repeat and exact remainder draws come from ``retry``.
    """

    def __init__(self, p_E: np.ndarray, icdf: InverseCDF, first_R: np.ndarray, n: int, K: int,
                 rng: np.random.Generator, retry: np.random.Generator) -> None:
        self.p_E, self.icdf, self.n, self.rng, self.retry = p_E, icdf, int(n), rng, retry
        self.first_R = np.asarray(first_R, np.intp)
        cum = icdf.cum_E
        self.base_R = np.where(self.first_R > 0, cum.take(self.first_R - 1), 0.0)  # the row's cumulative start
        self.span_R = cum.take(self.first_R + self.n - 1) - self.base_R              # and its mass
        self.left_R = self.span_R.copy()
        self.small = np.int16 if p_E.size <= np.iinfo(np.int16).max else np.int32
        N = self.first_R.size
        self.ids_KN = _position_major(K, N, self.small)   # position-major: each position one row
        self.tau_KN = _position_major(K, N, np.float64)
        self.tau_R = np.zeros(N)
        self.k = 0
        self._set_hard_bound()

    def _set_hard_bound(self) -> None:
        """``hard_R``: the chosen mass past which a row draws from its remainder at once; and
        ``easy_k``: positions before which no row can be past it (the k most popular experts of
        all together are short of it, with a margin far above the rounding of ``left_R``), so the
        test is skipped there."""
        self.hard_R = (1.0 - _REJECT_MASS) * self.span_R
        top = np.cumsum(np.sort(self.p_E)[::-1])      # the k most popular experts' mass, k = 1..E
        floor = float(self.span_R.min() - self.hard_R.max()) if self.span_R.size else 0.0
        self.easy_k = int(np.searchsorted(top, floor - 1e-9, side="left")) + 1

    @property
    def ids_NK(self) -> np.ndarray:
        """``ids_KN`` token by token, ``[N, K]`` (a view: what the kernels index)."""
        return self.ids_KN.T

    @property
    def tau_NK(self) -> np.ndarray:
        """``tau_KN`` token by token, ``[N, K]`` (a view)."""
        return self.tau_KN.T

    def subset(self, rows: np.ndarray, K: int) -> "_Races":
        """The races of ``rows`` (their arrivals so far kept), room for K arrivals in all."""
        out = type(self)(self.p_E, self.icdf, self.first_R[rows], self.n, K, self.rng, self.retry)
        out.left_R, out.tau_R, out.k = self.left_R[rows], self.tau_R[rows], self.k
        out.ids_KN[:self.k], out.tau_KN[:self.k] = self.ids_KN[:self.k, rows], self.tau_KN[:self.k, rows]
        return out

    def advance(self) -> None:
        """Every row's next arrival: its exponential and uniform from ``rng``, its arrival time and
        expert, redraws and remainder draws from ``retry``. The compiled kernels' pass
        (:mod:`~moonep_sim.routing.sampling_kernels`): the same random numbers drawn in the same
        order and amounts as the numpy reference's (``tests/sampling_reference.py``), the same draws."""
        k, N, icdf = self.k, self.first_R.size, self.icdf.record
        x = self.rng.standard_exponential(N, dtype=np.float32)   # clamped to 1e-30 by pl_position
        u = self.rng.random(N)
        rows = _rec.RowSpan(self.first_R, self.base_R, self.span_R, self.n, self.n != self.p_E.size)
        todo, hard, e = np.empty(N, np.intp), np.empty(N, np.intp), np.empty(N, np.int32)
        tally = _rec.Tally(self.p_E, True, _NO_COUNTS, False)
        _kn.draw(u, _NO_INTP, icdf, rows, e)
        nt, nh = _kn.pl_position(k, x, e, True, _rec.RaceRows(self.ids_NK, self.tau_NK, self.left_R),
                                 k >= self.easy_k, self.hard_R, tally, todo, hard, _NO_INTP)
        self.tau_R = self.tau_NK[:, k]
        _settle_left(k, todo, nt, hard[:nh], self.retry, icdf, rows, self.ids_NK, self.left_R, tally)
        self.k += 1


def _settle_left(k: int, todo: np.ndarray, nt: int, hard: np.ndarray, retry: np.random.Generator, icdf: _rec.Icdf,
                 rows: _rec.RowSpan, ids_NK: np.ndarray, left: np.ndarray, tally: _rec.Tally) -> None:
    """The rows a position's pass left at ``k``: ``todo[:nt]`` (a repeat) redrawn from ``retry`` up to
    ``_REJECT_ROUNDS`` times, then those still repeating and ``hard`` (past the "mostly chosen" bound)
    given their exact remainder draws, in ascending rows; all of them then settled (``left``, counts)."""
    rejected, e = todo[:nt].copy(), np.empty(nt, np.int32)
    for _ in range(_REJECT_ROUNDS):
        if nt == 0:
            break
        _kn.draw(retry.random(nt), todo[:nt], icdf, rows, e)
        nt = _kn.pl_retry(k, todo, nt, e, ids_NK)
    rest = np.sort(np.concatenate((hard, todo[:nt])), kind="stable") if nt else hard   # disjoint, each ascending
    _kn.pl_remainder(k, rest, retry.random(rest.size), tally.p, rows, ids_NK)
    for settled in (rejected, hard):
        _kn.pl_settle(k, settled, ids_NK, left, tally)


_NO_X, _NO_X2, _NO_W = np.empty(0, np.float32), np.empty((0, 0), np.float32), np.empty((0, 0), np.float32)  # unused
_NO_COUNTS, _NO_INTP, _NO_F64, _NO_TAU = np.empty(0, np.int64), np.empty(0, np.intp), np.empty(0), np.empty((0, 0))


_PAD = 64    # bytes between the rows of a position-major state: rows of a power of two in length
             # would put a token's K entries, which a repeat test reads together, in one cache set


def _position_major(K: int, N: int, dtype) -> np.ndarray:
    """An uninitialised ``[K, N]`` array whose rows lie ``_PAD`` bytes further apart than ``N``."""
    return np.empty((K, N + _PAD // np.dtype(dtype).itemsize), dtype)[:, :N]


def _normalised(logp_E: np.ndarray) -> tuple[np.ndarray, InverseCDF]:
    p = np.exp(_popularity(logp_E))
    p /= p.sum()
    return p, InverseCDF(p)


def _weights(tau_TK: np.ndarray) -> np.ndarray:
    """The race's softmax over the chosen: ``w ∝ 1 / tau`` (scores ``-log tau``), float32."""
    inv = tau_TK[:, :1] / tau_TK
    return (inv / inv.sum(axis=1, keepdims=True)).astype(np.float32)


def sample_topk_pl(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                   noise: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Plain top-K by sequential Plackett-Luce draws (the fast path; see the module docstring).

    Returns ids int64 [T, K] in the order drawn (descending score) and weights float32 [T, K]
    (the race's softmax over the chosen, from the arrival times). Same distribution as
    :func:`sample_topk_race` without groups or logits.

    Random streams: ``rng`` gives every token exactly one uniform and one exponential per
    position whatever the popularity (so draws at two popularities are coupled token by token);
    redraws after a rejection and remainder draws come from a child stream seeded once from it.

    noise: a dict that keeps this draw's exponentials, uniforms and child seed (K x T float32
    and float64), for :func:`pl_ids_again` to draw the same streams' experts at another
    popularity and :func:`pl_weights` their weights.
    """
    K, T = int(top_k), int(tokens)
    p, icdf = _normalised(logp_E)
    seed = int(rng.integers(0, 1 << 63))
    x, u = np.empty((K, T), np.float32), np.empty((K, T))
    for k in range(K):                                 # the reference's order: a position's exponentials, its uniforms
        rng.standard_exponential(dtype=np.float32, out=x[k])
        rng.random(out=u[k])
    np.maximum(x, np.float32(1e-30), out=x)            # an exact 0 would give a zero time (infinite score)
    if noise is not None:
        noise.update(x=x, u=u, retry_seed=seed)
    ids, w, counts = _pl_blocks(p, icdf, x, u, np.random.default_rng(seed), np.int64, noise is not None)
    if noise is not None:
        noise["counts"] = counts                       # this draw's count per expert, for the calibration
    return ids, w


def _pl_blocks(p: np.ndarray, icdf: InverseCDF, x_KN: np.ndarray | None, u_KN: np.ndarray,
               retry: np.random.Generator, dtype, count: bool) -> tuple[np.ndarray, np.ndarray | None,
                                                                        np.ndarray | None]:
    """The plain path's races by the kernels' two passes (``sampling_kernels``, "plain top-K"):
    the same draws as K calls of :meth:`_Races.advance`. ``x_KN``: the exponentials, for the
    arrival times and weights (float32 [N, K]); None: the experts only. Returns ids ``[N, K]`` of
    ``dtype``, the weights (None without ``x_KN``) and, with ``count``, the count of each expert
    (int64 [E]; else None)."""
    K, N = u_KN.shape
    E = p.size
    clocked = x_KN is not None
    one = _Races(p, icdf, np.zeros(1, np.intp), E, K, None, retry)   # every row alike: its bound and skip
    easy_k, hard = one.easy_k, float(one.hard_R[0])
    update_left = clocked or easy_k < K
    ids = np.empty((N, K), dtype)
    w = np.empty((N, K), np.float32) if clocked else _NO_W
    counts = np.zeros(E, np.int64) if count else _NO_COUNTS
    x = x_KN if clocked else _NO_X2
    ic = icdf.record
    tally = _rec.Tally(p, update_left, counts, count)
    every = _rec.RowSpan(_NO_INTP, _NO_F64, _NO_F64, E, False)   # every row races all E
    # the stopped rows' slots (room for every row; only those used are touched)
    rows2, stop2, left2 = np.empty(N, np.intp), np.empty(N, np.intp), np.empty(N)
    ids2, e2 = np.empty((N, K), dtype), np.empty((K, N), np.int32)
    tau2, x2 = (np.empty((N, K)), np.empty((K, N), np.float32)) if clocked else (_NO_TAU, _NO_X2)
    stopped = _rec.Stopped(rows2, stop2, left2, ids2, tau2, x2, e2)
    e_KN = np.empty((K, N), np.int32)
    _kn.draw(u_KN.reshape(-1), _NO_INTP, ic, every, e_KN.reshape(-1))
    n2 = _kn.pl_pass1(x, e_KN, clocked, easy_k, hard, tally, ids, w, stopped)
    todo, hard_slots, hard_S = np.empty(n2, np.intp), np.empty(n2, np.intp), np.full(n2, hard)
    for k in range(K if n2 else 0):                    # pass 2: the stopped rows, by slot, from their first event
        nt, nh = _kn.pl_position(k, x2[k, :n2] if clocked else _NO_X, e2[k, :n2], clocked,
                                 _rec.RaceRows(ids2, tau2, left2), k >= easy_k, hard_S, tally, todo, hard_slots,
                                 stop2[:n2])
        _settle_left(k, todo, nt, hard_slots[:nh], retry, ic, every, ids2, left2, tally)
    _kn.pl_pass2_out(n2, rows2, ids2, tau2, clocked, ids, w)
    w = w if clocked else None
    return ids, w, (counts if count else None)


def pl_ids_again(logp_E: np.ndarray, top_k: int, tokens: int, noise: dict) -> tuple[np.ndarray, np.ndarray]:
    """The experts :func:`sample_topk_pl` draws at ``logp_E`` from the streams whose draws
    ``noise`` kept (the same values, position-major ``[K, T]`` of a small int dtype) and their
    count per expert (int64 [E]), without their arrival times or weights: what a calibration that
    only counts needs, at about 40% of a whole draw. :func:`pl_weights` completes a draw."""
    E = int(np.size(logp_E))
    p, icdf = _normalised(logp_E)
    ids, _, counts = _pl_blocks(p, icdf, None, np.asarray(noise["u"]), np.random.default_rng(noise["retry_seed"]),
                                np.int16 if E <= np.iinfo(np.int16).max else np.int32, True)
    return ids.T, counts


def pl_weights(logp_E: np.ndarray, ids_KN: np.ndarray, noise: dict) -> np.ndarray:
    """The weights :func:`sample_topk_pl` returns with experts ``ids_KN`` (from
    :func:`pl_ids_again` at ``logp_E`` with the same ``noise``): its arrival times replayed from
    the kept exponentials (the same popularity left), float32 [T, K]."""
    K, T = ids_KN.shape
    p, _ = _normalised(logp_E)
    w = np.empty((T, K), np.float32)
    _kn.pl_replay_rows(np.asarray(noise["x"]), ids_KN.T, p, w)
    return w


def sample_topk_grouped(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                        groups: int, topk_groups: int) -> tuple[np.ndarray, np.ndarray]:
    return _grouped(logp_E, top_k, tokens, rng, groups, topk_groups, _Races)


def _grouped(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, groups: int, topk_groups: int,
             races_cls: type) -> tuple[np.ndarray, np.ndarray]:
    """Group-limited top-K (the race's rule, see the module docstring) without the ``[T, E]`` race.

    Exact by the race's structure: the experts' exponential clocks are independent, so each group
    is its own race. Every group's first two arrivals (sequential draws within the group) give its
    score, the sum of its two best perturbed scores ``-log tau``; each token keeps its top-M
    groups; each kept group's race continues (memoryless: from its second arrival, with the rest
    of its experts) to ``min(K, E/G)`` arrivals; the token's experts are the K earliest of them,
    in arrival order, weights ``∝ 1 / tau`` as in the race. Cost ``O(T (2G + M K))`` draws.
    (``races_cls``: :class:`_Races`, or the numpy reference's races in ``tests/sampling_reference.py``.)
    """
    E, K, T, G, M = int(np.size(logp_E)), int(top_k), int(tokens), int(groups), int(topk_groups)
    n = E // G
    p, icdf = _normalised(logp_E)
    retry = np.random.default_rng(int(rng.integers(0, 1 << 63)))
    # rows t * G + g: token t's race in group g
    races = races_cls(p, icdf, np.tile(np.arange(G, dtype=np.intp) * n, T), n, min(2, n), rng, retry)
    for _ in range(min(2, n)):
        races.advance()
    gscore_TG = -np.log(races.tau_KN).sum(axis=0).reshape(T, G)
    keep_TM = np.argpartition(-gscore_TG, M - 1, axis=1)[:, :M]
    Kg = min(K, n)
    kept = races.subset((np.arange(T, dtype=np.intp)[:, None] * G + keep_TM).reshape(-1), Kg)
    while kept.k < Kg:
        kept.advance()
    tau_TJ = kept.tau_KN.T.reshape(T, M * Kg)          # every kept group's arrivals, J = M * Kg
    ids_TJ = kept.ids_KN.T.reshape(T, M * Kg)
    cols, tau = smallest_k(tau_TJ, K)                 # the K earliest arrivals, in arrival order
    return np.take_along_axis(ids_TJ, cols, axis=1).astype(np.int64), _weights(tau)


def sample_topk(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                groups: int = 1, topk_groups: int = 1, with_logits: bool = False, noise: dict | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """K distinct experts per token, drawn without replacement with probability ∝ exp(logp).

    Returns ids int64 [T, K] (by descending score), weights float32 [T, K] (softmax of the chosen
    scores), and the scores float32 [T, E] when ``with_logits``. Plain and group-limited top-K
    take the fast Plackett-Luce paths; logits, and layers of at most ``CHUNK_ELEMS`` token-expert
    pairs, take the race (all three: module docstring). noise: what a redraw of the same streams
    reuses (the race's noise, :func:`sample_topk_race`; the plain fast path's uniforms,
    :func:`sample_topk_pl`; the grouped path keeps none).
    """
    if sampler_of(np.size(logp_E), tokens, groups, topk_groups, with_logits) == "race":
        # logits, and small layers (one chunk of the race: tens of ms): the race, whose draws are
        # coupled expert by expert across popularities. The fast paths' rejected draws are not, and
        # at a few tokens the maxvio calibration's bisection then meets a statistic too jagged to
        # hit its tolerance (e.g. T=64, E=8, K=2 at maxvio 1).
        return sample_topk_race(logp_E, top_k, tokens, rng, groups=groups, topk_groups=topk_groups,
                                with_logits=with_logits, noise=noise)
    if groups > 1 and topk_groups < groups:
        ids, w = sample_topk_grouped(logp_E, top_k, tokens, rng, groups=groups, topk_groups=topk_groups)
    else:
        ids, w = sample_topk_pl(logp_E, top_k, tokens, rng, noise=noise)
    return ids, w, None


def sampler_of(num_experts: int, tokens: int, groups: int = 1, topk_groups: int = 1,
               with_logits: bool = False) -> str:
    """Which sampler :func:`sample_topk` runs: ``race``, ``grouped`` or ``pl``."""
    if with_logits or int(tokens) * int(num_experts) <= CHUNK_ELEMS:
        return "race"
    return "grouped" if groups > 1 and topk_groups < groups else "pl"


__all__ = ["CHUNK_ELEMS", "InverseCDF", "LOGP_FLOOR", "mask_groups", "pl_ids_again", "pl_weights", "sample_topk",
           "sample_topk_grouped", "sample_topk_pl", "sample_topk_race", "sampler_of", "smallest_k"]
