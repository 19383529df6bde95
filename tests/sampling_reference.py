"""The numpy reference of the samplers (:mod:`moonep_sim.routing.sampling`): their sequential races
(:class:`moonep_sim.routing.sampling._Races`) a pass per step over every row, and the samplers
drawn with them. The compiled kernels (``sampling_kernels.py``) are the one path the samplers
take; the functions below, of the same names and signatures, draw what they draw from numpy
passes, and the tests hold the two equal, draw for draw (tests/test_sampling_kernels.py)."""

from __future__ import annotations

import numpy as np

from moonep_sim.routing import sampling


class RacesNumpy:
    """The numpy steps of ``sampling._Races`` (mixed into it by :class:`RacesReference`: its state;
    its rejection rounds the sampling module's)."""

    def _draw(self, u: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """Inverse-CDF draws (intp) of uniforms ``u`` within each row's experts (rows None: every
        row): ``np.searchsorted``, which tests/test_sampling.py holds equal to the kernels' draw."""
        E = self.p_E.size
        if self.n == E:                                # every row races all E: u itself
            return np.minimum(np.searchsorted(self.icdf.cum_E, u, side="right"), E - 1)
        base, span, first = ((self.base_R, self.span_R, self.first_R) if rows is None else
                             (self.base_R[rows], self.span_R[rows], self.first_R[rows]))
        e = np.minimum(np.searchsorted(self.icdf.cum_E, base + u * span, side="right"), E - 1)
        np.minimum(e, first + (self.n - 1), out=e)     # u rounded onto the group's end: its last expert
        return e

    def _repeats(self, e: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """Whether each draw ``e`` (of ``self.small`` dtype) repeats one of its row's arrivals."""
        if not self.k:
            return np.zeros(e.size, bool)
        rep = (self.ids_KN[0] if rows is None else self.ids_KN[0, rows]) == e
        eq = np.empty_like(rep)
        for j in range(1, self.k):
            np.equal(self.ids_KN[j] if rows is None else self.ids_KN[j, rows], e, out=eq)
            rep |= eq
        return rep

    def _remainder(self, rows: np.ndarray) -> np.ndarray:
        """One draw per row of ``rows`` from its experts not yet chosen, renormalised (exact inverse
        CDF over the row's own cumulative sum; chunked over rows)."""
        n, k = self.n, self.k
        out = np.empty(rows.size, np.int64)
        chunk = max(1, sampling.CHUNK_ELEMS // n)
        for s in range(0, rows.size, chunk):
            r = rows[s:s + chunk]
            first = self.first_R[r][:, None]
            P = self.p_E[first + np.arange(n)]
            if k:
                np.put_along_axis(P, self.ids_KN[:k, r].T.astype(np.intp) - first, 0.0, axis=1)
            cum = np.cumsum(P, axis=1)
            u = self.retry.random(r.size) * cum[:, -1]
            e = (cum <= u[:, None]).sum(axis=1)        # first index whose cumulative mass exceeds u
            last = n - 1 - np.argmax(P[:, ::-1] > 0, axis=1)  # u rounded up to the total: the last live expert
            out[s:s + chunk] = first[:, 0] + np.minimum(e, last)
        return out

    def _tick(self, x: np.ndarray | None = None) -> np.ndarray:
        """This position's arrival times: ``tau += X / (popularity not yet chosen)``, X from ``rng``
        (or ``x``, kept from an earlier draw of the same streams). Returns X."""
        if x is None:
            x = self.rng.standard_exponential(self.first_R.size, dtype=np.float32)
            np.maximum(x, np.float32(1e-30), out=x)    # an exact 0 would give a zero time (infinite score)
        dt = np.maximum(self.left_R, 1e-300)
        np.divide(x, dt, out=dt)
        self.tau_R = np.add(self.tau_R, dt, out=self.tau_KN[self.k])   # this position's row is the clock now
        return x

    def advance_numpy(self, u: np.ndarray | None = None, keep: dict | None = None,
                      counts_E: np.ndarray | None = None) -> None:
        """``sampling._Races.advance`` in numpy, a pass per step over every row (the kernels'
        reference; the plain path's too, for which ``sampling._pl_blocks`` runs the kernels). ``u``:
        this position's uniforms, kept from an earlier run of the same streams (``keep`` keeps the
        exponentials and uniforms, lists ``x`` and ``u``): the experts drawn without the arrival
        times (``tau_KN`` left unset, and ``left_R`` too when no position tests it). ``counts_E``:
        the drawn experts added to it."""
        k, N = self.k, self.first_R.size
        clocked = u is None
        if clocked:
            x = self._tick()
            u = self.rng.random(N)
            if keep is not None:
                keep["x"].append(x)
                keep["u"].append(u)
        e = self._draw(u, None)                        # intp; its narrow copy is this position's row
        ids = self.ids_KN[k]
        ids[...] = e
        if k:
            rep = self._repeats(ids, None)
            if k >= self.easy_k:                       # some row may be mostly chosen: the remainder at once
                hard_R = self.left_R < self.hard_R
                todo = np.flatnonzero(rep | hard_R)
                hard, todo = todo[hard_R[todo]], todo[~hard_R[todo]]
            else:
                todo, hard = np.flatnonzero(rep), np.empty(0, np.intp)
            for _ in range(sampling._REJECT_ROUNDS):
                if todo.size == 0:
                    break
                ee = self._draw(self.retry.random(todo.size), todo)
                rep = self._repeats(ee.astype(self.small), todo)
                ok = todo[~rep]
                ids[ok] = e[ok] = ee[~rep]
                todo = todo[rep]
            rest = np.union1d(hard, todo) if todo.size else hard
            if rest.size:
                ids[rest] = e[rest] = self._remainder(rest)
        if clocked or self.easy_k < self.ids_KN.shape[0]:   # the popularity left: the clock's, the test's
            self.left_R -= self.p_E.take(e)
        if counts_E is not None:
            counts_E += np.bincount(e, minlength=counts_E.size)
        self.k += 1

    def replay(self, ids_KN: np.ndarray, xs: list) -> None:
        """The arrival times of experts ``ids_KN`` with the exponentials ``xs`` of their streams
        (one array per position, as :meth:`advance` kept them)."""
        for k in range(ids_KN.shape[0]):
            self._tick(xs[k])
            self.ids_KN[k] = ids_KN[k]
            self.left_R -= self.p_E.take(ids_KN[k])
            self.k += 1


_WEIGHT_BLOCK = 1 << 15    # tokens per block of _weights_KN (16 x 32768 float64: 4 MiB, cache-sized)


def _weights_KN(tau_KN: np.ndarray, block: int = _WEIGHT_BLOCK) -> np.ndarray:
    """``sampling._weights`` of ``tau_KN.T`` (float32 [N, K], C order) computed on the position-major
    arrays, ``block`` tokens at a time (contiguous rows; the same divisions and the same
    position-by-position sum, so the same values whatever the block)."""
    K, N = tau_KN.shape
    out = np.empty((N, K), np.float32)
    for s in range(0, N, block):
        tau = tau_KN[:, s:s + block]
        inv = tau[0] / tau
        inv /= inv.sum(axis=0)
        out[s:s + block] = inv.T
    return out


class RacesReference(sampling._Races, RacesNumpy):
    """The samplers' races stepped by :meth:`RacesNumpy.advance_numpy`."""

    advance = RacesNumpy.advance_numpy


def sample_topk_race(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                     groups: int = 1, topk_groups: int = 1, with_logits: bool = False,
                     noise: dict | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``sampling.sample_topk_race`` with every row's K smallest keys found in numpy."""
    return sampling._race(logp_E, top_k, tokens, rng, groups, topk_groups, with_logits, noise, kernels=False)


def sample_topk_grouped(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                        groups: int, topk_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """``sampling.sample_topk_grouped`` with its races stepped in numpy."""
    return sampling._grouped(logp_E, top_k, tokens, rng, groups, topk_groups, RacesReference)


def sample_topk_pl(logp_E: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator, *,
                   noise: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``sampling.sample_topk_pl``: K positions, each a numpy pass over every row."""
    E, K, T = int(np.size(logp_E)), int(top_k), int(tokens)
    p, icdf = sampling._normalised(logp_E)
    seed = int(rng.integers(0, 1 << 63))
    races = RacesReference(p, icdf, np.zeros(T, np.intp), E, K, rng, np.random.default_rng(seed))
    if noise is not None:
        noise.update(x=[], u=[], retry_seed=seed)
    for _ in range(K):
        races.advance(keep=noise)
    return races.ids_KN.T.astype(np.int64, order="C"), _weights_KN(races.tau_KN)


def pl_ids_again(logp_E: np.ndarray, top_k: int, tokens: int, noise: dict) -> tuple[np.ndarray, np.ndarray]:
    """``sampling.pl_ids_again``: the kept streams' experts at ``logp_E``, a numpy pass per position."""
    E, K, T = int(np.size(logp_E)), int(top_k), int(tokens)
    p, icdf = sampling._normalised(logp_E)
    races = RacesReference(p, icdf, np.zeros(T, np.intp), E, K, None, np.random.default_rng(noise["retry_seed"]))
    counts = np.zeros(E, np.int64)
    for k in range(K):
        races.advance(u=noise["u"][k], counts_E=counts)
    return races.ids_KN, counts


def pl_weights(logp_E: np.ndarray, ids_KN: np.ndarray, noise: dict) -> np.ndarray:
    """``sampling.pl_weights``: the arrival times replayed in numpy, then the weights."""
    K, T = ids_KN.shape
    p, icdf = sampling._normalised(logp_E)
    races = RacesReference(p, icdf, np.zeros(T, np.intp), p.size, K, None, None)
    races.replay(ids_KN, noise["x"])
    return _weights_KN(races.tau_KN)


__all__ = ["RacesNumpy", "RacesReference", "pl_ids_again", "pl_weights", "sample_topk_grouped", "sample_topk_pl", "sample_topk_race"]
