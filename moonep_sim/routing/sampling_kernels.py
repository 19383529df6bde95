"""Compiled kernels of the samplers (:mod:`moonep_sim.routing.sampling`): one loop over the tokens
where the numpy code makes one array pass per step.

Every kernel does the per-token work of a numpy reference kept in ``sampling.py`` with the same
floating-point operations in the same order, so its outputs are equal bit for bit; the random
numbers stay numpy's (drawn by the caller, in the same order and amounts), so the streams and the
draws do not move. tests/test_sampling_kernels.py holds each kernel against its reference.

- :func:`pl_position` -- one position of the sequential Plackett-Luce races (``_Races.advance``):
  each row's arrival time (``tau += X / left``), its inverse-CDF draw (the guide table of
  :class:`~moonep_sim.routing.sampling.InverseCDF`, within the row's group), the repeat check
  against the row's earlier arrivals and the "mostly chosen" test, listing the rows a redraw or
  a remainder draw must settle; :func:`pl_retry` one rejection round of those rows;
  :func:`pl_remainder` their exact remainder draws; :func:`pl_settle` the popularity left and the
  counts of the rows settled after the pass.
- :func:`weights_nk` -- the race's softmax of the arrival times (``_weights_KN``).
- :func:`race_k_smallest` -- the race's K smallest keys per token
  (``smallest_k`` after ``mask_groups``; or of ``X / p``), for the rows whose K + 1 smallest keys
  (and, grouped, whose kept groups) are unique: the rows with ties are flagged, and the caller
  gives them the reference (whose tie-breaking is ``np.argpartition``'s).
"""

from __future__ import annotations

import numpy as np

from moonep_sim.jit import kernel

# No helper taking arrays is called inside a loop: numba then keeps the arrays' reference counts
# (atomic increments and decrements) on every call, inlined or not, and a draw costs ten to twenty
# times more (measured: 14 ms instead of 1.4 ms a position at 262,144 rows). The inverse-CDF draw
# is therefore written out in both kernels that make one (pl_position, pl_retry), word for word.


@kernel
def pl_position(k, x, u, clocked, p, cum, guide, M, width, steps, linear, first, base, span, n, grouped,
                ids_NK, tau_NK, left, test_hard, hard_bound, update_left, counts, count, todo, hard):
    """Position ``k`` of every row: ``x`` (float32, clamped to 1e-30 in place) and ``u`` this
    position's exponentials and uniforms; ``clocked``: the arrival times ``tau_NK[:, k] = tau_NK[:, k - 1]
    + x / max(left, 1e-300)`` (0 before the first). State token-major: ``ids_NK``, ``tau_NK``. Rows whose draw repeats an earlier arrival go to ``todo``, rows past
    the "mostly chosen" bound (``test_hard``: ``left < hard_bound``) to ``hard`` (both in row
    order); the other rows are settled here (``left -= p[e]`` when ``update_left``, ``counts[e]
    += 1`` when ``count``). Returns the two lists' lengths."""
    N = u.size
    E = cum.size
    nt = 0
    nh = 0
    floor = np.float32(1e-30)
    for t in range(N):
        if clocked:
            xv = x[t]
            if not xv >= floor:
                xv = floor
                x[t] = xv
            d = left[t]
            if not d >= 1e-300:
                d = 1e-300
            tau_NK[t, k] = (tau_NK[t, k - 1] if k else 0.0) + np.float64(xv) / d
        v = u[t]
        if grouped:
            v = base[t] + v * span[t]
        b = int(v * M)                       # InverseCDF.draw: the guide's bucket, then its walk or bisection
        if b > M:
            b = M
        e = guide[b]
        if linear:
            for _ in range(width):           # (v = 1 only by a group's rounding: no read past cum)
                e += cum[e if e < E else E - 1] <= v
            if e > E:
                e = E
        else:
            hi = guide[b + 1] if b < M else guide[M]
            for _ in range(steps):
                mid = (e + hi) >> 1
                if cum[mid] <= v:
                    e = mid + 1
                else:
                    hi = mid
        if grouped:                          # u rounded onto the group's end: its last expert
            last = first[t] + (n - 1)
            if e > last:
                e = last
        rep = False                          # a repeat of the row's earlier arrivals
        for j in range(k):
            if ids_NK[t, j] == e:
                rep = True
                break
        ids_NK[t, k] = e
        if test_hard and left[t] < hard_bound[t]:
            hard[nh] = t
            nh += 1
        elif rep:
            todo[nt] = t
            nt += 1
        else:
            if update_left:
                left[t] -= p[e]
            if count:
                counts[e] += 1
    return nt, nh


@kernel
def pl_retry(k, todo, nt, uu, cum, guide, M, width, steps, linear, first, base, span, n, grouped, ids_NK):
    """One rejection round: ``todo[:nt]``'s rows redrawn with uniforms ``uu`` (one each, in row
    order); the rows that repeat again are kept, in order, at the front of ``todo``; returns how
    many."""
    E = cum.size
    m = 0
    for i in range(nt):
        t = todo[i]
        v = uu[i]
        if grouped:
            v = base[t] + v * span[t]
        b = int(v * M)                       # InverseCDF.draw: the guide's bucket, then its walk or bisection
        if b > M:
            b = M
        e = guide[b]
        if linear:
            for _ in range(width):           # (v = 1 only by a group's rounding: no read past cum)
                e += cum[e if e < E else E - 1] <= v
            if e > E:
                e = E
        else:
            hi = guide[b + 1] if b < M else guide[M]
            for _ in range(steps):
                mid = (e + hi) >> 1
                if cum[mid] <= v:
                    e = mid + 1
                else:
                    hi = mid
        if grouped:                          # u rounded onto the group's end: its last expert
            last = first[t] + (n - 1)
            if e > last:
                e = last
        rep = False                          # a repeat of the row's earlier arrivals
        for j in range(k):
            if ids_NK[t, j] == e:
                rep = True
                break
        if rep:
            todo[m] = t
            m += 1
        else:
            ids_NK[t, k] = e
    return m


@kernel
def pl_remainder(k, rows, uu, p, first, n, grouped, ids_NK):
    """Each row of ``rows`` draws position ``k`` from its experts not yet chosen, renormalised:
    the cumulative sum of its popularity with its arrivals zeroed, ``uu * total`` searched in it
    (``_Races._remainder``, the same sums in the same order)."""
    P = np.empty(n)
    c = np.empty(n)
    for i in range(rows.size):
        r = rows[i]
        f = first[r] if grouped else 0
        for a in range(n):
            P[a] = p[f + a]
        for j in range(k):
            P[ids_NK[r, j] - f] = 0.0
        s = P[0]
        c[0] = s
        for a in range(1, n):
            s = s + P[a]
            c[a] = s
        v = uu[i] * c[n - 1]
        e = 0
        for a in range(n):
            if c[a] <= v:
                e += 1
        last = n - 1
        for a in range(n - 1, -1, -1):
            if P[a] > 0:
                last = a
                break
        ids_NK[r, k] = f + (e if e < last else last)


@kernel
def pl_settle(k, rows, ids_NK, p, left, update_left, counts, count):
    """The rows settled after :func:`pl_position`'s pass: the popularity left and the counts."""
    for i in range(rows.size):
        t = rows[i]
        e = ids_NK[t, k]
        if update_left:
            left[t] -= p[e]
        if count:
            counts[e] += 1


@kernel
def weights_nk(tau_NK, out):
    """``out[t, j] = float32((tau[t, 0] / tau[t, j]) / sum_j (tau[t, 0] / tau[t, j]))``, the sum
    position by position (``_weights_KN`` of ``tau_NK.T``)."""
    N, K = tau_NK.shape
    inv = np.empty(K)
    for t in range(N):
        t0 = tau_NK[t, 0]
        for j in range(K):
            inv[j] = t0 / tau_NK[t, j]
        s = inv[0]
        for j in range(1, K):
            s = s + inv[j]
        for j in range(K):
            out[t, j] = np.float32(inv[j] / s)


@kernel
def race_k_smallest(lp32, m_TE, inv_p, G, M, K, ids, kv, ok):
    """The race's K smallest keys per token, ascending, and their experts (``smallest_k``).

    ``G`` > 0, grouped: scores ``lp32 - m_TE`` (``m_TE`` the noise's log, float32), each group's
    score the sum of its two best (``_top2_sum``'s running pair, the groups side by side), the M
    best groups kept, keys ``-score`` there (``mask_groups``: +inf elsewhere). ``G`` = 0: keys
    ``m_TE * inv_p`` (the noise over the popularity). ``ok[t]`` False: a tie at the kept groups'
    edge or among the K + 1 smallest keys, the row left for the reference. Needs ``K < E``,
    grouped ``E // G >= 2`` and ``M < G``."""
    T, E = m_TE.shape
    n = E // G if G else E
    score = np.empty(E, np.float32)
    m1 = np.empty(max(G, 1), np.float32)
    m2 = np.empty(max(G, 1), np.float32)
    gs = np.empty(max(G, 1), np.float32)
    srt = np.empty(max(G, 1), np.float32)
    bv = np.empty(K + 1, np.float32)
    bi = np.empty(K + 1, np.int64)
    inf = np.float32(np.inf)
    for t in range(T):
        cnt = 0
        thr = inf
        if G:
            for e in range(E):
                score[e] = lp32[e] - m_TE[t, e]
            for g in range(G):
                c0 = score[g * n]
                c1 = score[g * n + 1]
                m1[g] = c0 if c0 >= c1 else c1
                m2[g] = c0 if c0 <= c1 else c1
            for a in range(2, n):                 # member by member across the groups: G chains at once
                for g in range(G):
                    r = score[g * n + a]
                    x1 = m1[g]
                    lo = x1 if x1 <= r else r
                    x2 = m2[g]
                    m2[g] = x2 if x2 >= lo else lo
                    m1[g] = x1 if x1 >= r else r
            for g in range(G):
                gs[g] = m1[g] + m2[g]
                srt[g] = gs[g]
            for i in range(M + 1):                          # the M + 1 largest group scores, descending
                best = i
                for j in range(i + 1, G):
                    if srt[j] > srt[best]:
                        best = j
                sw = srt[i]
                srt[i] = srt[best]
                srt[best] = sw
            if not srt[M - 1] > srt[M]:
                ok[t] = False
                continue
            for g in range(G):
                if gs[g] >= srt[M - 1]:                     # a kept group: its keys into the K + 1 smallest
                    for e in range(g * n, g * n + n):
                        v = -score[e]
                        if v < thr:
                            if cnt == K + 1:
                                pos = K
                            else:
                                pos = cnt
                                cnt += 1
                            while pos > 0 and bv[pos - 1] > v:
                                bv[pos] = bv[pos - 1]
                                bi[pos] = bi[pos - 1]
                                pos -= 1
                            bv[pos] = v
                            bi[pos] = e
                            if cnt == K + 1:
                                thr = bv[K]
        else:
            for e in range(E):
                v = m_TE[t, e] * inv_p[e]
                if v < thr:
                    if cnt == K + 1:
                        pos = K
                    else:
                        pos = cnt
                        cnt += 1
                    while pos > 0 and bv[pos - 1] > v:
                        bv[pos] = bv[pos - 1]
                        bi[pos] = bi[pos - 1]
                        pos -= 1
                    bv[pos] = v
                    bi[pos] = e
                    if cnt == K + 1:
                        thr = bv[K]
        while cnt < K + 1:                                  # fewer kept than K + 1: the masked, +inf
            bv[cnt] = inf
            cnt += 1
        good = True
        for j in range(K):
            if not bv[j + 1] > bv[j]:
                good = False
                break
        ok[t] = good
        if good:
            for j in range(K):
                ids[t, j] = bi[j]
                kv[t, j] = bv[j]


@kernel
def pl_replay(k, x, given_NK, p, ids_NK, tau_NK, left):
    """Position ``k``'s arrival times of given experts ``given_NK[:, k]`` with kept exponentials
    ``x`` (already clamped): ``tau_NK[:, k] = tau_NK[:, k - 1] + x / max(left, 1e-300)``, then
    ``left -= p[e]``."""
    for t in range(x.size):
        d = left[t]
        if not d >= 1e-300:
            d = 1e-300
        tau_NK[t, k] = (tau_NK[t, k - 1] if k else 0.0) + np.float64(x[t]) / d
        e = given_NK[t, k]
        ids_NK[t, k] = e
        left[t] -= p[e]

# ---------------------------------------------------------------------------------- plain top-K, token blocks
# The plain path (every row races all E experts, from time 0) in two passes instead of K passes
# over all rows. Pass 1 runs each block of BLOCK rows through every position, its state in cache,
# up to each row's first event: a repeat (a redraw) or the "mostly chosen" test (a remainder
# draw); those need the child stream's draws in the reference's order (position by position, row
# by row) and are left to pass 2, which runs only the stopped rows, position by position, exactly
# as _Races.advance does (the rows settled at a position by pass 1 are the ones the reference
# settles at once there: no repeat, no test). The random numbers are the same, read from the
# [K, N] arrays the caller drew position by position.
BLOCK = 1024


@kernel
def pl_pass1(x_KN, u_KN, clocked, p, cum, guide, M, width, steps, linear, easy_k, hard_bound, update_left,
             ids_NK, left, w_NK, counts, count, stop, tau2, rows2):
    """Pass 1 over every row (see above): ``ids_NK`` written where settled, ``left`` and
    ``counts`` kept, the weights ``w_NK`` of the rows settled at every position (``clocked``);
    ``stop[t]`` the row's first event (K: none). The stopped rows are listed, ascending, in
    ``rows2`` and their arrival times so far kept in ``tau2`` (slot by slot); returns how many."""
    K, N = u_KN.shape
    E = cum.size
    floor = np.float32(1e-30)
    tau = np.empty((BLOCK, K))
    inv = np.empty(K)
    n2 = 0
    for t0 in range(0, N, BLOCK):
        t1 = min(N, t0 + BLOCK)
        for t in range(t0, t1):
            stop[t] = K
        for k in range(K):
            test = k >= easy_k
            for t in range(t0, t1):
                if stop[t] < K:
                    continue
                if clocked:
                    xv = x_KN[k, t]
                    if not xv >= floor:
                        xv = floor
                        x_KN[k, t] = xv
                    d = left[t]
                    if not d >= 1e-300:
                        d = 1e-300
                    tau[t - t0, k] = (tau[t - t0, k - 1] if k else 0.0) + np.float64(xv) / d
                v = u_KN[k, t]
                b = int(v * M)                       # InverseCDF.draw: the guide's bucket, then its walk or bisection
                if b > M:
                    b = M
                e = guide[b]
                if linear:
                    for _ in range(width):           # (v = 1 only by a group's rounding: no read past cum)
                        e += cum[e if e < E else E - 1] <= v
                    if e > E:
                        e = E
                else:
                    hi = guide[b + 1] if b < M else guide[M]
                    for _ in range(steps):
                        mid = (e + hi) >> 1
                        if cum[mid] <= v:
                            e = mid + 1
                        else:
                            hi = mid
                rep = False                          # a repeat of the row's earlier arrivals
                for j in range(k):
                    if ids_NK[t, j] == e:
                        rep = True
                        break
                if rep or (test and left[t] < hard_bound):
                    stop[t] = k
                    continue
                ids_NK[t, k] = e
                if update_left:
                    left[t] -= p[e]
                if count:
                    counts[e] += 1
        for t in range(t0, t1):
            if stop[t] < K:
                if clocked:
                    for j in range(stop[t]):
                        tau2[n2, j] = tau[t - t0, j]
                rows2[n2] = t
                n2 += 1
            elif clocked:                    # _weights_KN of the row
                t0_ = tau[t - t0, 0]
                for j in range(K):
                    inv[j] = t0_ / tau[t - t0, j]
                sm = inv[0]
                for j in range(1, K):
                    sm = sm + inv[j]
                for j in range(K):
                    w_NK[t, j] = np.float32(inv[j] / sm)
    return n2


@kernel
def pl_pass2(k, rows2, n2, stop, x_KN, u_KN, clocked, p, cum, guide, M, width, steps, linear, easy_k, hard_bound,
             update_left, ids_NK, tau2, left, counts, count, todo, hard):
    """Position ``k`` of pass 2: the stopped rows ``rows2[:n2]`` at or past their first event, as
    :func:`pl_position` runs them (``tau2`` by slot); returns the lengths of ``todo`` and ``hard``."""
    E = cum.size
    floor = np.float32(1e-30)
    nt = 0
    nh = 0
    for i in range(n2):
        t = rows2[i]
        if stop[t] > k:
            continue
        if clocked:
            xv = x_KN[k, t]
            if not xv >= floor:
                xv = floor
                x_KN[k, t] = xv
            d = left[t]
            if not d >= 1e-300:
                d = 1e-300
            tau2[i, k] = (tau2[i, k - 1] if k else 0.0) + np.float64(xv) / d
        v = u_KN[k, t]
        b = int(v * M)                       # InverseCDF.draw: the guide's bucket, then its walk or bisection
        if b > M:
            b = M
        e = guide[b]
        if linear:
            for _ in range(width):           # (v = 1 only by a group's rounding: no read past cum)
                e += cum[e if e < E else E - 1] <= v
            if e > E:
                e = E
        else:
            hi = guide[b + 1] if b < M else guide[M]
            for _ in range(steps):
                mid = (e + hi) >> 1
                if cum[mid] <= v:
                    e = mid + 1
                else:
                    hi = mid
        rep = False                          # a repeat of the row's earlier arrivals
        for j in range(k):
            if ids_NK[t, j] == e:
                rep = True
                break
        if k >= easy_k and left[t] < hard_bound:
            hard[nh] = t
            nh += 1
        elif rep:
            todo[nt] = t
            nt += 1
        else:
            ids_NK[t, k] = e
            if update_left:
                left[t] -= p[e]
            if count:
                counts[e] += 1
    return nt, nh


@kernel
def pl_weights_rows(rows2, n2, tau2, w_NK):
    """The weights of rows ``rows2[:n2]`` from their arrival times ``tau2`` (by slot)."""
    K = tau2.shape[1]
    inv = np.empty(K)
    for i in range(n2):
        t0 = tau2[i, 0]
        for j in range(K):
            inv[j] = t0 / tau2[i, j]
        sm = inv[0]
        for j in range(1, K):
            sm = sm + inv[j]
        for j in range(K):
            w_NK[rows2[i], j] = np.float32(inv[j] / sm)


@kernel
def pl_replay_rows(x_KN, given_NK, p, ids_NK, w_NK):
    """Every row's arrival times of its given experts ``given_NK`` with kept exponentials ``x_KN``
    (clamped), from time 0 and popularity 1 left (the plain path), then its weights; the
    experts copied to ``ids_NK`` (``_Races.replay`` and ``_weights_KN``, token blocks)."""
    K, N = x_KN.shape
    tau = np.empty((BLOCK, K))
    left = np.empty(BLOCK)
    inv = np.empty(K)
    for t0 in range(0, N, BLOCK):
        t1 = min(N, t0 + BLOCK)
        for t in range(t0, t1):
            left[t - t0] = 1.0
        for k in range(K):
            for t in range(t0, t1):
                d = left[t - t0]
                if not d >= 1e-300:
                    d = 1e-300
                tau[t - t0, k] = (tau[t - t0, k - 1] if k else 0.0) + np.float64(x_KN[k, t]) / d
                e = given_NK[t, k]
                ids_NK[t, k] = e
                left[t - t0] -= p[e]
        for t in range(t0, t1):
            t0_ = tau[t - t0, 0]
            for j in range(K):
                inv[j] = t0_ / tau[t - t0, j]
            sm = inv[0]
            for j in range(1, K):
                sm = sm + inv[j]
            for j in range(K):
                w_NK[t, j] = np.float32(inv[j] / sm)


__all__ = ["BLOCK", "pl_pass1", "pl_pass2", "pl_position", "pl_remainder", "pl_replay", "pl_replay_rows", "pl_retry",
           "pl_settle", "pl_weights_rows", "race_k_smallest", "weights_nk"]
