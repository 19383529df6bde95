"""Compiled kernels of the samplers (:mod:`moonep_sim.routing.sampling`): one loop over the tokens
where the numpy code makes one array pass per step.

Every kernel does the per-token work of a numpy reference kept beside it (``sampling.py``,
``tests/sampling_reference.py``, whose samplers draw with it) with the same floating-point
operations in the same order, so its outputs are equal bit for bit; the random numbers stay
numpy's (drawn by the caller, in the same order and amounts), so the streams and the draws do not
move. tests/test_sampling_kernels.py holds the samplers' draws against the reference's.

- :func:`pl_pass1`, :func:`pl_pass2_out` -- the plain path (every token races all E experts:
  ``sample_topk_pl`` and its counted redraws ``pl_ids_again``) in token blocks, the rows a repeat
  or the "mostly chosen" test stops left to a second pass by position (:func:`pl_position` over
  their slots; the section "plain top-K" below); :func:`pl_replay_rows` the weights of a counted draw (``pl_weights``).
- :func:`draw` -- the inverse-CDF draws of every kernel (the guide table of
  :class:`~moonep_sim.routing.sampling.InverseCDF`, within each row's group): one pass over a
  block of uniforms before the kernels that read the experts drawn.
- :func:`pl_position` -- the grouped fast path's races (``_Races.advance``), one position of
  every row: its arrival time (``tau += X / left``), the repeat check of its draw against the
  row's earlier arrivals and the "mostly chosen" test, listing the rows a redraw or a remainder
  draw must settle; :func:`pl_retry` one rejection round of those rows;
  :func:`pl_remainder` their exact remainder draws; :func:`pl_settle` the popularity left and the
  counts of the rows settled after the pass.
- :func:`race_grouped` / :func:`race_plain` -- the race's K smallest keys per token
  (``smallest_k`` after ``mask_groups``; or of ``X / p``), for the rows whose K + 1 smallest keys
  (and, grouped, whose kept groups) are unique: the rows with ties are flagged, and the caller
  gives them the reference (whose tie-breaking is ``np.argpartition``'s).
"""

from __future__ import annotations

import numpy as np

from moonep_sim.jit import inline, kernel

# The steps the kernels share are the helpers below, inlined by numba itself (``inline="always"``:
# the helper's IR is pasted into the caller's before compiling): the arrival time and the clamp of
# an exponential (scalars only), a row's weights, the race's insertion of a key and its row's output.
# The repeat check and the settling of a row (in pl_position, pl_retry, pl_pass1) stay
# written out: a helper taking arrays, even inlined at the IR level, keeps the arrays' reference
# counts (atomic increments and decrements) on every call in the loop. Measured (numba 0.68, 65,536
# rows x K 8): as helpers, pl_pass1's plain path took 2.6x the time, the grouped path (pl_position,
# pl_retry) 2.0x; the inverse-CDF draw as an inlined helper, 1.6x on a Kimi-K3 layer. So the draw
# is its own kernel (:func:`draw`), run over a whole block of uniforms before the kernel that reads
# the experts drawn.


@kernel
def draw(u, rows, icdf, rowspan, e):
    """``e[i]``: the expert of uniform ``u[i]`` (``InverseCDF``'s guide: its bucket, then its
    walk or bisection), within row ``rows[i]``'s group (``rows`` empty: row i) when the rows race a
    group each. icdf: :class:`~moonep_sim.routing.sampling_records.Icdf`; span:
    :class:`~moonep_sim.routing.sampling_records.RowSpan`."""
    cum, guide, M, width, steps, linear = icdf
    first, base, mass, n, grouped = rowspan
    E = cum.size
    for i in range(u.size):
        v = u[i]
        if grouped:
            t = rows[i] if rows.size else i
            v = base[t] + v * mass[t]
        b = int(v * M)
        if b > M:
            b = M
        x = guide[b]
        if linear:
            for _ in range(width):           # (v = 1 only by a group's rounding: no read past cum)
                x += cum[x if x < E else E - 1] <= v
            if x > E:
                x = E
        else:
            hi = guide[b + 1] if b < M else guide[M]
            for _ in range(steps):
                mid = (x + hi) >> 1
                if cum[mid] <= v:
                    x = mid + 1
                else:
                    hi = mid
        if grouped:                          # u rounded onto the group's end: its last expert
            last = first[t] + (n - 1)
            if x > last:
                x = last
        e[i] = x


@inline
def _floored(xv):
    """An exponential clamped to 1e-30 (float32; NaN too)."""
    floor = np.float32(1e-30)
    return xv if xv >= floor else floor


@inline
def _arrival(prev, xv, left):
    """The next arrival time: ``prev + x / max(left, 1e-300)``."""
    d = left
    if not d >= 1e-300:
        d = 1e-300
    return prev + np.float64(xv) / d


@inline
def _row_weights(tau, i, by_row, K, inv, w_NK, t):
    """``_weights_KN`` of one row (the same divisions, the same sum): ``w_NK[t]`` from its arrival
    times ``tau[i, :K]`` (``by_row``) or ``tau[:K, i]``."""
    t0_ = tau[i, 0] if by_row else tau[0, i]
    for j in range(K):
        inv[j] = t0_ / (tau[i, j] if by_row else tau[j, i])
    sm = inv[0]
    for j in range(1, K):
        sm = sm + inv[j]
    for j in range(K):
        w_NK[t, j] = np.float32(inv[j] / sm)


@inline
def _keep(bv, bi, cnt, K, v, e):
    """Key ``v`` (expert ``e``) sorted into the ``cnt`` smallest ``bv[:cnt]`` kept so far, at most
    K + 1 (insertion); returns the new count."""
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
    return cnt


@inline
def _emit(bv, bi, cnt, K, t, ids, kv, ok):
    """Row ``t``'s K smallest keys (``bv[:cnt]``, padded with inf to K + 1) and their experts out,
    ``ok[t]`` False (nothing written) where the K + 1 smallest tie."""
    inf = np.float32(np.inf)
    while cnt < K + 1:
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
def pl_position(k, x, e_N, clocked, race, test_hard, hard_bound, tally, todo, hard, stop):
    """Position ``k`` of every row: ``x`` (float32, clamped to 1e-30 in place) this position's
    exponentials and ``e_N`` its experts drawn (:func:`draw`); ``clocked``: the arrival times
    ``tau_NK[:, k] = tau_NK[:, k - 1] + x / max(left, 1e-300)`` (0 before the first); ``ids_NK``,
    ``tau_NK`` the state by token (views of ``_Races``' position-major arrays, or pass 2's slots).
    Rows whose draw repeats an earlier arrival go to ``todo``, rows past the "mostly chosen" bound
    (``test_hard``: ``left < hard_bound``) to ``hard`` (both in row order); the other rows are
    settled here (``left -= p[e]`` when ``update_left``, ``counts[e] += 1`` when ``count``: the
    :class:`~moonep_sim.routing.sampling_records.Tally`). ``stop`` (pass 2; empty: none): rows with
    ``stop[t] > k`` are skipped (pass 1 settled them there). Returns the two lists' lengths. race:
    :class:`~moonep_sim.routing.sampling_records.RaceRows`."""
    ids_NK, tau_NK, left = race
    p, update_left, counts, count = tally
    nt = 0
    nh = 0
    for t in range(e_N.size):
        if stop.size and stop[t] > k:
            continue
        if clocked:
            xv = x[t]
            xf = _floored(xv)
            if xf != xv:
                x[t] = xf
            tau_NK[t, k] = _arrival(tau_NK[t, k - 1] if k else 0.0, xf, left[t])
        e = e_N[t]
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
def pl_retry(k, todo, nt, ee, ids_NK):
    """One rejection round: ``todo[:nt]``'s rows redrawn, ``ee`` their experts drawn
    (:func:`draw`, one each, in row order); the rows that repeat again are kept, in order, at the
    front of ``todo``; returns how many."""
    m = 0
    for i in range(nt):
        t = todo[i]
        e = ee[i]
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
def pl_remainder(k, rows, uu, p, rowspan, ids_NK):
    """Each row of ``rows`` draws position ``k`` from its experts not yet chosen, renormalised:
    the cumulative sum of its popularity with its arrivals zeroed, ``uu * total`` searched in it
    (``_Races._remainder``, the same sums in the same order). rowspan:
    :class:`~moonep_sim.routing.sampling_records.RowSpan`."""
    first, base, mass, n, grouped = rowspan
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
def pl_settle(k, rows, ids_NK, left, tally):
    """The rows settled after :func:`pl_position`'s pass: the popularity left and the counts
    (:class:`~moonep_sim.routing.sampling_records.Tally`)."""
    p, update_left, counts, count = tally
    for i in range(rows.size):
        t = rows[i]
        e = ids_NK[t, k]
        if update_left:
            left[t] -= p[e]
        if count:
            counts[e] += 1


@kernel
def race_grouped(lp32, logT, logx, G, M, K, ids, kv, ok):
    """The grouped race's K smallest keys per token, ascending, and their experts (``smallest_k``
    of ``mask_groups``): scores ``lp32 - log X`` (float32; ``logx`` the noise's log ``[T, E]``,
    ``logT`` the same transposed), each group's score the sum of its two best (the values of
    ``_top2_sum``'s running pair, found for every token at once along ``logT``, with the third
    best), the M best groups kept, keys ``-score`` there sorted in from the kept experts at or
    above a floor (the least of the kept groups' third best: 3 M kept scores lie at or above it).
    ``ok[t]`` False: a tie at the kept groups' edge or among the K + 1 smallest keys, the row left
    for the reference. Needs ``K < E``, ``E // G >= 2`` and ``M < G``."""
    E, T = logT.shape
    n = E // G
    m1 = np.empty((G, T), np.float32)
    m2 = np.empty((G, T), np.float32)
    m3 = np.empty((G, T), np.float32)
    inf = np.float32(np.inf)
    for g in range(G):                       # every token's three best of each group, tokens side by side
        e0 = g * n
        a1 = m1[g]
        a2 = m2[g]
        a3 = m3[g]
        c = lp32[e0]
        row = logT[e0]
        for t in range(T):
            a1[t] = c - row[t]
            a2[t] = -inf
            a3[t] = -inf
        for e in range(e0 + 1, e0 + n):
            c = lp32[e]
            row = logT[e]
            for t in range(T):
                r = c - row[t]
                x1 = a1[t]
                lo1 = x1 if x1 <= r else r
                a1[t] = x1 if x1 >= r else r
                x2 = a2[t]
                lo2 = x2 if x2 <= lo1 else lo1
                a2[t] = x2 if x2 >= lo1 else lo1
                x3 = a3[t]
                a3[t] = x3 if x3 >= lo2 else lo2
    gs = np.empty(G, np.float32)
    srt = np.empty(G, np.float32)
    bv = np.empty(K + 1, np.float32)
    bi = np.empty(K + 1, np.int64)
    for t in range(T):
        for g in range(G):
            gs[g] = m1[g, t] + m2[g, t]
            srt[g] = gs[g]
        for i in range(M + 1):
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
        edge = srt[M - 1]
        low = inf                            # a floor under the (K + 1)-th best: 3 M kept scores are at or above it
        for g in range(G):
            if gs[g] >= edge and m3[g, t] < low:
                low = m3[g, t]
        if 3 * M < K + 1:
            low = -inf
        cnt = 0
        thr = inf
        for g in range(G):
            if gs[g] >= edge:
                for e in range(g * n, g * n + n):
                    sc = lp32[e] - logx[t, e]
                    if not sc >= low:
                        continue
                    v = -sc
                    if v < thr:
                        cnt = _keep(bv, bi, cnt, K, v, e)
                        if cnt == K + 1:
                            thr = bv[K]
        _emit(bv, bi, cnt, K, t, ids, kv, ok)


@kernel
def race_plain(x, inv_p, K, ids, kv, ok):
    """The plain race's K smallest keys ``x * inv_p`` (float32) per token, ascending, and their
    experts (``smallest_k``); ``ok[t]`` False where its K + 1 smallest tie. Needs ``K < E``."""
    T, E = x.shape
    bv = np.empty(K + 1, np.float32)
    bi = np.empty(K + 1, np.int64)
    inf = np.float32(np.inf)
    for t in range(T):
        cnt = 0
        thr = inf
        for e in range(E):
            v = x[t, e] * inv_p[e]
            if v < thr:                      # the K + 1 smallest, ascending, by insertion
                cnt = _keep(bv, bi, cnt, K, v, e)
                if cnt == K + 1:
                    thr = bv[K]
        _emit(bv, bi, cnt, K, t, ids, kv, ok)


# ---------------------------------------------------------------------------------- plain top-K, token blocks
# The plain path (every row races all E experts, from time 0) in two passes instead of K passes
# over all rows. Pass 1 runs each block of BLOCK rows through every position, its state in cache
# (position-major block buffers), up to each row's first event: a repeat (a redraw) or the "mostly
# chosen" test (a remainder draw). Those need the child stream's draws in the reference's order
# (position by position, row by row) and are left to pass 2, which runs the stopped rows alone --
# their state gathered into slots, in row order -- position by position through pl_position, as
# _Races.advance does; the rows settled at a position by pass 1 are the ones the reference settles
# at once there (no repeat, no test). The random numbers are the same, read from the [K, N] arrays
# the caller drew position by position.
BLOCK = 512


@kernel
def pl_pass1(x_KN, e_KN, clocked, easy_k, hard_bound, tally, ids_NK, w_NK, stopped):
    """Pass 1 over every row (see above), ``e_KN`` the experts drawn (:func:`draw`): ``ids_NK``
    and (``clocked``) the weights ``w_NK`` of every row settled at every position, ``counts`` kept
    (``count``). The stopped rows, ascending, get slots: ``rows2`` the row, ``stop2`` its first
    event, ``left2`` its popularity left, ``ids2`` / ``tau2`` its arrivals so far, ``x2`` / ``e2``
    its exponentials and draws (position-major): the
    :class:`~moonep_sim.routing.sampling_records.Stopped` record. Returns the number of slots.
    tally: :class:`~moonep_sim.routing.sampling_records.Tally`."""
    p, update_left, counts, count = tally
    rows2, stop2, left2, ids2, tau2, x2, e2 = stopped
    K, N = e_KN.shape
    E = p.size
    bids = np.empty((K, BLOCK), np.int32)
    btau = np.empty((K, BLOCK))
    bleft = np.empty(BLOCK)
    bstop = np.empty(BLOCK, np.int64)
    W = (E + 63) >> 6
    bits = np.empty((BLOCK, W), np.int64)            # each row's chosen experts, a bit each: the repeat test
    inv = np.empty(K)
    n2 = 0
    for t0 in range(0, N, BLOCK):
        B = min(N, t0 + BLOCK) - t0
        for i in range(B):
            bstop[i] = K
            bleft[i] = 1.0                   # a whole row's span: cum[E - 1] - 0 = 1 exactly
            for a in range(W):
                bits[i, a] = 0
        for k in range(K):
            test = k >= easy_k
            for i in range(B):
                if bstop[i] < K:
                    continue
                t = t0 + i
                if clocked:                          # (x clamped to 1e-30 by the caller)
                    btau[k, i] = _arrival(btau[k - 1, i] if k else 0.0, x_KN[k, t], bleft[i])
                e = e_KN[k, t]
                rep = (bits[i, e >> 6] >> (e & 63)) & 1   # a repeat of the row's earlier arrivals
                if rep or (test and bleft[i] < hard_bound):
                    bstop[i] = k
                    continue
                bids[k, i] = e
                bits[i, e >> 6] |= 1 << (e & 63)
                if update_left:
                    bleft[i] -= p[e]
                if count:
                    counts[e] += 1
        for i in range(B):
            t = t0 + i
            st = bstop[i]
            if st < K:
                rows2[n2] = t
                stop2[n2] = st
                left2[n2] = bleft[i]
                for j in range(st):
                    ids2[n2, j] = bids[j, i]
                    if clocked:
                        tau2[n2, j] = btau[j, i]
                for j in range(st, K):
                    e2[j, n2] = e_KN[j, t]
                    if clocked:
                        x2[j, n2] = x_KN[j, t]
                n2 += 1
            else:
                for j in range(K):
                    ids_NK[t, j] = bids[j, i]
                if clocked:
                    _row_weights(btau, i, False, K, inv, w_NK, t)
    return n2


@kernel
def pl_pass2_out(n2, rows2, ids2, tau2, clocked, ids_NK, w_NK):
    """The slots' experts (and, ``clocked``, weights from their arrival times) to their rows."""
    K = ids2.shape[1]
    inv = np.empty(K)
    for i in range(n2):
        t = rows2[i]
        for j in range(K):
            ids_NK[t, j] = ids2[i, j]
        if clocked:
            _row_weights(tau2, i, True, K, inv, w_NK, t)


@kernel
def pl_replay_rows(x_KN, given_NK, p, w_NK):
    """Every row's weights from its given experts ``given_NK`` and kept exponentials ``x_KN``
    (clamped): its arrival times from time 0 and popularity 1 left (the plain path), as
    ``_Races.replay`` and ``_weights_KN`` compute them, in token blocks."""
    K, N = x_KN.shape
    btau = np.empty((K, BLOCK))
    bleft = np.empty(BLOCK)
    inv = np.empty(K)
    for t0 in range(0, N, BLOCK):
        B = min(N, t0 + BLOCK) - t0
        for i in range(B):
            bleft[i] = 1.0
        for k in range(K):
            for i in range(B):
                btau[k, i] = _arrival(btau[k - 1, i] if k else 0.0, x_KN[k, t0 + i], bleft[i])
                bleft[i] -= p[given_NK[t0 + i, k]]
        for i in range(B):
            _row_weights(btau, i, False, K, inv, w_NK, t0 + i)


__all__ = ["BLOCK", "draw", "pl_pass1", "pl_pass2_out", "pl_position", "pl_remainder", "pl_replay_rows", "pl_retry", "pl_settle", "race_grouped",
           "race_plain"]
