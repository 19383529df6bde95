"""The flow network's per-tick bookkeeping as compiled kernels (with the block solver's compiled
fill): the transfers that finish (:func:`complete_due`), the rates after a fill (:func:`set_rates`),
the whole tick in one call (:func:`tick_blocks`: completions, the waiting flows that start, the
fill, the rates) and a rank's submission (:func:`submit_flows`).

A tick of ``moonep_sim.sim.network.FlowNetwork`` completes a transfer or two, starts a few and
re-rates the active ones; in numpy that is some thirty calls on arrays of tens to hundreds of
slots, whose cost is the calls (a DeepSeek-V3 EP32 decode step: ~12,300 ticks, ~3,700 submissions
of 32 entries). These kernels do the same element operations in the same order, so every rate,
remaining byte count, finish time and record is bit-identical to the numpy tick they replaced
(``tests/blocks_reference.py``, the reference they are tested against).

Notation (as ``moonep_sim.sim.blocks``): N = B x R nodes per side; node levels ``lev_U1`` [2N + 1]
(sender nodes, receiver nodes, a spare) and the ports that froze them ``bport_U1``, as
``fill_levels`` writes them; an active transfer's sender node ``ns`` and receiver node ``nd`` are
block x R + rank, both N (the sentinel, level 0) once it finished. Slots [0, n) of the
``ActiveFlows`` columns are in use. Units: bytes, microseconds, bytes per microsecond.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from moonep_sim.jit import kernel
from moonep_sim.sim.fill_kernels import fill_levels


class TickState(NamedTuple):
    """What one tick reads and the next one reads back (:func:`tick_blocks` returns it as the
    first fields of :class:`TickOut`): n active slots in use, dead ones among them, pn waiting
    flows, the earliest ready time among those (inf: none)."""

    n: int
    dead: int
    pn: int
    pend_min: float


class TickOut(NamedTuple):
    """:func:`tick_blocks`' result: the next :class:`TickState`'s fields, then the completed slots
    (``completed``) and receive groups (``groups``) whose ids the kernel wrote into the book's
    ``done``, the fill's steps (< 0: it froze nothing), the latest and the earliest finish time."""

    n: int
    dead: int
    pn: int
    pend_min: float
    completed: int
    groups: int
    steps: int
    fin_max: float
    next_finish: float


class FlowCols(NamedTuple):
    """The active flows' columns (``ActiveFlows.data``; slots [0, n) in use) as the buffers that
    hold them (``ActiveFlows.block``): ``f`` float64 [4, capacity] rate, bytes left at ``t0``,
    ``t0``, finish time; ``alive``; ``i`` int64 [7, capacity] flow id, receive-group key, source
    and destination rank, block, sender and receiver node."""

    f: np.ndarray
    alive: np.ndarray
    i: np.ndarray


class WaitCols(NamedTuple):
    """The waiting flows' columns (``Pending.data``; slots [0, pn), in submission order) as the
    buffers that hold them: ``f`` float64 [2, capacity] ready time, bytes (efficiency applied);
    ``i`` int64 [5, capacity] flow id, receive-group key, source and destination rank, block."""

    f: np.ndarray
    i: np.ndarray


class TickBook(NamedTuple):
    """What a tick records beside the flows: the sentinel node (N), the ranks R, the flow log's end,
    bottleneck port and ready columns, each receive group's flows left, ``done`` (int64 scratch
    of twice the active slots at least: the completed slots, then the completed groups' keys) and
    the last fill's node levels and ports (``lev_U1`` / ``bport_U1``, [2N + 1]: each fill writes
    them in place)."""

    sentinel: int
    R: int
    log_end: np.ndarray
    log_bneck: np.ndarray
    log_ready: np.ndarray
    left: np.ndarray
    done: np.ndarray
    lev_U1: np.ndarray
    bport_U1: np.ndarray


class Submission(NamedTuple):
    """One rank's submission to :func:`submit_flows`: the sending rank, the phase id, the time (us)
    and the sender's serial cost per message to another rank (us; 0: none)."""

    src: int
    pid: int
    now: float
    message_us: float


class LogCols(NamedTuple):
    """The flow log's columns a submission writes (``FlowLog.data``) as the buffers that hold them:
    ``i`` int64 [3, capacity] source and destination rank, phase id; ``f`` float64 [2, capacity]
    bytes, submission time."""

    i: np.ndarray
    f: np.ndarray


class BlockCountsCols(NamedTuple):
    """The block solver's counts the tick updates (``BlockCounts``): port capacities ``cap_P``, the
    counts buffer ``mm`` (M cells, then MT cells from ``T``; per node its row and column in it are
    the solver tables' ``row_U`` / ``col_U``), the active transfers per sender and receiver node."""

    cap_P: np.ndarray
    mm: np.ndarray
    T: int
    cnt_src: np.ndarray
    cnt_dst: np.ndarray


def plain(record: tuple) -> tuple:
    """A record as the plain tuple of its fields, in order: what the Python side passes to a kernel
    called once a tick or a submission (numba types a plain tuple's items in C at each call, a
    NamedTuple's field by field in Python: measured ~20 us a tick, 15% of a K3 EP64 layer's
    simulation). The kernel reads the fields in the record's order, so the two are the same."""
    return tuple(record)


def wait_cols(waiting: Any) -> WaitCols:
    """:class:`WaitCols` over ``waiting``'s buffers (a ``Pending``; no copies)."""
    return WaitCols(waiting.block("ready"), waiting.block("id"))


def tick_records(active: Any, waiting: Any, log: Any, book: tuple, cap_P: np.ndarray,
                 blocks: Any) -> tuple[FlowCols, WaitCols, TickBook, BlockCountsCols]:
    """The records :func:`tick_blocks` reads, over the network's own columns (no copies): ``active``,
    ``waiting`` its ``ActiveFlows`` and ``Pending``, ``log`` its flow log's ``data``;
    ``book`` (sentinel, ranks, left, done, lev_U1, bport_U1) as :class:`TickBook` names them;
    ``blocks`` its ``BlockCounts``. Built again whenever a column is reallocated."""
    return (FlowCols(active.block("rate"), active.data["alive"], active.block("id")), wait_cols(waiting),
            TickBook(int(book[0]), int(book[1]), log["end"], log["bneck"], log["ready"], *book[2:]),
            BlockCountsCols(cap_P, blocks.mm, int(blocks.T), blocks.cnt_src, blocks.cnt_dst))


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
def set_rates(rate_F, n, rate, rem0, t0, fin, t):
    """Re-rate active slots [0, n) to ``rate_F`` after a fill at time t: a slot whose rate changed
    gets its remaining bytes at t, t0 = t, the new rate and its finish time; the others are left alone.
    Returns (fin_max, fin_min): the largest finite finish time among the changed slots (-inf if
    none) and the smallest finish time of all slots (nan if one is nan, inf if n = 0), as the numpy
    code's ``fin.max()`` / ``fin[isfinite].max()`` and ``a.fin.min()`` read them."""
    fin_max = -np.inf
    fin_min = np.inf
    nan = False
    for i in range(n):
        r = rate_F[i]
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
def complete_due(thr, t, n, flows, book, counts, tables):
    """Complete the active slots of [0, n) with ``fin <= thr`` (``done``: int64 scratch of 2n at
    least; the completed slots are written there in order): their log rows get end t and the
    bottleneck port of the last fill (``lev_U1`` / ``bport_U1``: the sender node's port where its
    level is the lower), their receive groups one flow fewer (``left``), the block counts lose them
    (``mm``: the counts buffer, M cells then MT cells from T; ``row_U`` / ``col_U``:
    ``BlockCounts.mt_row_N`` / ``cell_col_N``), and their slots go dead (rate 0 at the sentinel
    node, fin and rem0 inf).
    Returns (completed slots, receive groups completed): the count of each; the groups' keys
    (with repeats) follow the slots in ``done``. flows: :class:`FlowCols`; book: :class:`TickBook`;
    counts: :class:`BlockCountsCols`; tables: ``fill_kernels.SolverTables``."""
    ff, alive, fi = flows   # (rows by index: an array unpacked gives rows of any layout, slower loops)
    rate, rem0, t0, fin = ff[0], ff[1], ff[2], ff[3]
    ids, key, src, dst, blk, ns, nd = fi[0], fi[1], fi[2], fi[3], fi[4], fi[5], fi[6]
    sentinel, R, log_end, log_bneck, log_ready, left, done, lev_U1, bport_U1 = book
    cap_P, mm, T, cnt_src, cnt_dst = counts
    row_U, col_U = tables[8], tables[9]   # (SolverTables.row_U, col_U)
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


@kernel
def submit_flows(sub, dst_F, bytes_F, eff_F, blk_R, lat_R, R, pn, ln, wait, log):
    """``FlowNetwork.submit``: rank ``src``'s transfers of phase ``pid`` to ``dst_F`` with bytes > 0
    (the others skipped) appended, in order, to the waiting columns (``p_*``, slots from ``pn``)
    and the log's (``l_*``, rows from ``ln``; both with room for every entry). ``blk_R`` /
    ``lat_R``: the block and latency of the sender's transfer to each rank (its rows of the
    network's pair tables); ``message_us`` > 0 adds the sender's serial per-message cost (x its
    transfers to other ranks) to each transfer's latency to another rank. Returns (transfers kept, the earliest
    ready time: inf when none). sub: :class:`Submission` (src, pid, now, message_us); wait:
    :class:`WaitCols`; log: :class:`LogCols`."""
    src, pid, now, message_us = sub
    (wf, wi), (li, lf) = wait, log
    p_ready, p_eff, p_id, p_key, p_src, p_dst, p_blk = wf[0], wf[1], wi[0], wi[1], wi[2], wi[3], wi[4]
    l_src, l_dst, l_phase, l_bytes, l_start = li[0], li[1], li[2], lf[0], lf[1]
    m = 0
    remote = 0
    for f in range(dst_F.size):
        if bytes_F[f] > 0:
            m += 1
            if dst_F[f] != src:
                remote += 1
    first = np.inf
    if m == 0:
        return 0, first
    extra = message_us * float(remote)
    j = 0
    for f in range(dst_F.size):
        if bytes_F[f] > 0:
            d = dst_F[f]
            lat = lat_R[d]
            if message_us > 0:
                lat = lat + (extra if d != src else 0.0)
            r = now + lat
            if r < first:
                first = r
            k = pn + j
            p_ready[k] = r
            p_eff[k] = eff_F[f]
            p_id[k] = ln + j
            p_key[k] = pid * R + d
            p_src[k] = src
            p_dst[k] = d
            p_blk[k] = blk_R[d]
            q = ln + j
            l_src[q] = src
            l_dst[q] = d
            l_phase[q] = pid
            l_bytes[q] = bytes_F[f]
            l_start[q] = now
            j += 1
    return m, first


@kernel
def _compact(flows, n):
    """The live slots of [0, n) moved to the front, in order (every column of :class:`FlowCols`);
    returns how many."""
    f, alive, ints = flows
    k = 0
    for j in range(n):
        if alive[j]:
            if k != j:
                alive[k] = True
                for c in range(f.shape[0]):
                    f[c, k] = f[c, j]
                for c in range(ints.shape[0]):
                    ints[c, k] = ints[c, j]
            k += 1
    return k


@kernel
def tick_blocks(t, state, flows, wait, book, counts, tables):
    """One tick of ``FlowNetwork`` at time t with the block solver's compiled fill, as the numpy
    reference does it, in its order: (1) the active slots [0, n) due by ``t + 2e-9 x max(t, 1)`` complete
    (:func:`complete_due` under the last fill's ``book.lev_U1`` / ``bport_U1``; the dead slots are
    dropped, in order, once they are more than half of them: ``dead`` counts them); (2) where
    ``pend_min <= t + 1e-9`` the waiting flows ready by then (``p_*``, slots [0, pn) in submission
    order) start, in order, at the end of the active columns (room for all of them is there),
    counted into the blocks, and the others stay, in order; (3) the fill (``fill_levels`` over the
    counts and the solver's tables, into the book's levels); (4) :func:`set_rates`.

    state: :class:`TickState`; flows, wait, book, counts: :func:`tick_records`; tables: the solver's
    ``fill_kernels.SolverTables``. Returns a :class:`TickOut`: the completed slots, then the
    completed groups' keys (ascending, each once: as ``np.unique`` of :func:`complete_due`'s), are
    in ``book.done``; steps < 0: the fill froze nothing (and (4) did not run)."""
    n, dead, pn, pend_min = state
    ff, alive, fi = flows   # (rows by index: an array unpacked gives rows of any layout, slower loops)
    rate, rem0, t0, fin = ff[0], ff[1], ff[2], ff[3]
    ids, key, src, dst, blk, ns, nd = fi[0], fi[1], fi[2], fi[3], fi[4], fi[5], fi[6]
    wf, wi = wait
    p_ready, p_eff, p_id, p_key, p_src, p_dst, p_blk = wf[0], wf[1], wi[0], wi[1], wi[2], wi[3], wi[4]
    sentinel, R, log_end, log_bneck, log_ready, left, done, lev, bport = book
    cap_P, mm, T, cnt_src, cnt_dst = counts
    row_U, col_U = tables[8], tables[9]   # (SolverTables.row_U, col_U)
    m = 0
    g = 0
    if n > 0:
        thr = t + 2e-9 * max(t, 1.0)
        m, g = complete_due(thr, t, n, flows, book, counts, tables)
        if g > 1:   # the keys sorted (by argsort: the sort fill_kernels._sort_run compiles), repeats dropped
            keys = done[m:m + g].copy()
            for i, j in enumerate(np.argsort(keys)):
                done[m + i] = keys[j]
            u = m + 1
            for i in range(m + 1, m + g):
                if done[i] != done[u - 1]:
                    done[u] = done[i]
                    u += 1
            g = u - m
        if m:
            dead += m
            if 2 * dead > n:
                n = _compact(flows, n)
                dead = 0
    lim = t + 1e-9
    if pend_min <= lim:
        k = 0
        rest = np.inf
        for i in range(pn):
            if p_ready[i] <= lim:
                f = p_id[i]
                log_ready[f] = t
                b = p_blk[i]
                s = b * R + p_src[i]
                d = b * R + p_dst[i]
                rate[n] = 0.0
                rem0[n] = p_eff[i]
                t0[n] = t
                fin[n] = np.inf
                ids[n] = f
                key[n] = p_key[i]
                src[n] = p_src[i]
                dst[n] = p_dst[i]
                blk[n] = b
                alive[n] = True
                ns[n] = s
                nd[n] = d
                mm[row_U[s] + col_U[d]] += 1.0
                mm[T + row_U[d] + col_U[s]] += 1.0
                cnt_src[s] += 1.0
                cnt_dst[d] += 1.0
                n += 1
            else:
                if k != i:
                    p_ready[k] = p_ready[i]
                    p_eff[k] = p_eff[i]
                    p_id[k] = p_id[i]
                    p_key[k] = p_key[i]
                    p_src[k] = p_src[i]
                    p_dst[k] = p_dst[i]
                    p_blk[k] = p_blk[i]
                if p_ready[k] < rest:
                    rest = p_ready[k]
                k += 1
        pn = k
        pend_min = rest
    steps = fill_levels(cap_P, cnt_src, cnt_dst, mm, tables, lev, bport)
    fin_max, nxt = -np.inf, np.inf
    if steps >= 0:
        rate_F = np.empty(n)   # each slot's rate: the lower level of its two nodes
        for i in range(n):
            rate_F[i] = _level(lev, sentinel, ns[i], nd[i])
        fin_max, nxt = set_rates(rate_F, n, rate, rem0, t0, fin, t)
    return TickOut(n, dead, pn, pend_min, m, g, steps, fin_max, nxt)


__all__ = ["BlockCountsCols", "FlowCols", "LogCols", "Submission", "TickBook", "TickOut", "TickState", "WaitCols",
           "complete_due", "plain", "set_rates", "submit_flows", "tick_blocks", "tick_records", "wait_cols"]
