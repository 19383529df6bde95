"""The flow network's per-tick bookkeeping as compiled kernels (with the block solver's compiled
fill): the transfers that finish (:func:`complete_due`) and the rates after a fill
(:func:`set_rates`).

A tick of ``moonep_sim.sim.network.FlowNetwork`` completes a transfer or two, starts a few and
re-rates the active ones; in numpy that is some thirty calls on arrays of tens to hundreds of
slots, whose cost is the calls (a DeepSeek-V3 EP32 decode step: ~12,300 ticks). These kernels do
the same element operations in the same order, so every rate, remaining byte count, finish time
and record is bit-identical to the numpy code of ``FlowNetwork`` they stand beside (its reference,
run when the block solver's fill is not compiled, and tested against them).

Notation (as ``moonep_sim.sim.blocks``): N = B x R nodes per side; node levels ``lev_U1`` [2N + 1]
(sender nodes, receiver nodes, a spare) and the ports that froze them ``bport_U1``, as
``fill_levels`` returns them; an active transfer's sender node ``ns`` and receiver node ``nd`` are
block x R + rank, both N (the sentinel, level 0) once it finished. Slots [0, n) of the
``ActiveFlows`` columns are in use. Units: bytes, microseconds, bytes per microsecond.
"""

from __future__ import annotations

import math

import numpy as np

from moonep_sim.jit import kernel


@kernel
def _divide(a, b):
    """a / b with numpy's float semantics where b is 0 (inf with the quotient's sign, nan for 0/0);
    compiled Python raises there."""
    if b != 0.0:
        return a / b
    if a != a or a == 0.0:
        return np.nan
    return math.copysign(np.inf, a) * math.copysign(1.0, b)


@kernel
def _level(lev_U1, N, s, d):
    """``np.minimum`` of a transfer's sender-node and receiver-node levels (the sentinel N: 0)."""
    ls = 0.0 if s >= N else lev_U1[s]
    ld = 0.0 if d >= N else lev_U1[N + d]
    if ls != ls:
        return ls
    if ld != ld:
        return ld
    return ls if ls <= ld else ld


@kernel
def set_rates(lev_U1, N, n, ns, nd, rate, rem0, t0, fin, t):
    """Re-rate active slots [0, n) after a fill at time t: a slot whose rate changed gets its
    remaining bytes at t, t0 = t, the new rate and its finish time; the others are left alone.
    Returns (fin_max, fin_min): the largest finite finish time among the changed slots (-inf if
    none) and the smallest finish time of all slots (nan if one is nan, inf if n = 0), as the numpy
    code's ``fin.max()`` / ``fin[isfinite].max()`` and ``a.fin.min()`` read them."""
    fin_max = -np.inf
    fin_min = np.inf
    nan = False
    for i in range(n):
        r = _level(lev_U1, N, ns[i], nd[i])
        if r != rate[i]:   # dead slots keep rate 0
            rem = rem0[i] - rate[i] * (t - t0[i])
            rem0[i] = rem
            t0[i] = t
            rate[i] = r
            f = t + _divide(rem, r)
            fin[i] = f
            if np.isfinite(f) and f > fin_max:
                fin_max = f
        f = fin[i]
        if f != f:
            nan = True
        elif f < fin_min:
            fin_min = f
    return fin_max, (np.nan if nan else fin_min)


@kernel
def complete_due(thr, t, n, fin, rate, rem0, alive, ns, nd, ids, key, lev_U1, bport_U1, sentinel,
                 log_end, log_bneck, left, mm, T, row_U, col_U, cnt_src, cnt_dst, done):
    """Complete the active slots of [0, n) with ``fin <= thr`` (``done``: int64 scratch of 2n at
    least; the completed slots are written there in order): their log rows get end t and the
    bottleneck port of the last fill (the sender node's port where its level is the lower), their
    receive groups one flow fewer (``left``), the block counts lose them (``mm``: the counts
    buffer, M cells then MT cells from T; ``row_U`` / ``col_U``: ``BlockCounts.mt_row_N`` /
    ``cell_col_N``), and their slots go dead (rate 0 at the sentinel node, fin and rem0 inf).
    Returns (completed slots, receive groups completed): the count of each; the groups' keys
    (with repeats) follow the slots in ``done``."""
    N = sentinel
    m = 0
    for i in range(n):
        if fin[i] <= thr:
            done[m] = i
            m += 1
    for j in range(m):
        i = done[j]
        s, d = ns[i], nd[i]
        k = ids[i]
        log_end[k] = t
        log_bneck[k] = bport_U1[s] if lev_U1[s] <= lev_U1[N + d] else bport_U1[N + d]
        left[key[i]] -= 1
        mm[row_U[s] + col_U[d]] -= 1.0
        mm[T + row_U[d] + col_U[s]] -= 1.0
        cnt_src[s] -= 1.0
        cnt_dst[d] -= 1.0
    g = m
    for j in range(m):
        i = done[j]
        if left[key[i]] == 0:
            done[g] = key[i]
            g += 1
    for j in range(m):
        i = done[j]
        alive[i] = False
        fin[i] = np.inf
        rem0[i] = np.inf
        rate[i] = 0.0
        ns[i] = sentinel
        nd[i] = sentinel
    return m, g - m


__all__ = ["complete_due", "set_rates"]
