"""The block solver's progressive filling as one compiled kernel (:func:`fill_levels`).

The block solver's fill (``moonep_sim.sim.blocks``) takes about ten filling steps per rate change, each
a handful of numpy calls on arrays of a few to a few hundred ports: the cost is the calls, not the
arithmetic (a DeepSeek-V3 EP32 decode step: ~12,300 fills, ~5 s of numpy overhead). This kernel is
the same filling written as loops over the arrays :class:`BlockCounts` holds, doing the same steps
in the same order of floating-point operations, so its levels, bottleneck ports and step counts
are bit-identical to the numpy code it replaced (``tests/blocks_reference.py``, kept as the test
reference it is held equal to).

Notation (as ``moonep_sim.sim.blocks``): N = B x R nodes per side; U = 2N nodes (sender nodes
0..N-1, receiver nodes N..2N-1) plus one spare node U that stays empty (the padding of the cell
tables); P1 ports including the dummy; K ports per node at most; D nodes per port at most; W the
widest used block's row. Units: bytes/us.

What the numpy code does, step by step, and how the kernel reproduces it:

- per-port unfrozen counts and frozen loads are ``np.bincount`` over the node-major port table:
  a sum per port in increasing node order starting from 0.0 (the loop below adds in that order);
- the candidate ports (non-zero count, ascending) are ordered by share with a stable sort (ties
  to the lower port; merge sort here, also stable, so the same permutation);
- the run (the reference's ``_run`` / ``_prefix_run`` / ``_switch_cut`` / ``_cell_cut``) is the longest prefix,
  at most ``run_max`` ports, in which no node belongs to two ports and no node has an active cell
  with a node of an earlier port on the other side: the kernel scans the prefix once and stops at
  the first port that breaks either rule (every prefix width the numpy code tries gives that same
  cut, its docstring's argument);
- the freeze (``_freeze`` through the cell tables) scatters each frozen node's cells in node order
  into per-node sums (``np.bincount`` again: a fresh 0.0 sum per target, then one subtraction /
  addition per target), which the kernel accumulates in scratch arrays in the same order; the
  kernel derives each node's cells from four per-node values instead of reading the [2N, W]
  tables, so it runs at any width (the tables grow as R^2: 128 MiB at 1024 ranks).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moonep_sim.jit import inline, kernel


@kernel
def _active(s, r, key_U, row_U, col_U, mm):
    """Sender node s and receiver node r share a cell holding active transfers (same block, same
    node for NVLink blocks, same rank for local ones, and a count > 0)."""
    return key_U[s] == key_U[r] and mm[row_U[s] + col_U[r]] > 0.0


@kernel
def _touches(x, N, run_s, ns, run_r, nr, key_U, row_U, col_U, mm):
    """Node x has an active cell with one of the run's nodes of the other side so far (senders
    ``run_s[:ns]``, receivers ``run_r[:nr]``)."""
    if x < N:
        for i in range(nr):
            if _active(x, run_r[i], key_U, row_U, col_U, mm):
                return True
    else:
        for i in range(ns):
            if _active(run_s[i], x, key_U, row_U, col_U, mm):
                return True
    return False


@inline
def _join_run(x, N, run_s, ns, run_r, nr):
    """(ns, nr) once node x joins the step's run: a sender (x < N) at ``run_s[ns]``, else a receiver
    at ``run_r[nr]``. (Inlined where a run grows.)"""
    if x < N:
        run_s[ns] = x
        return ns + 1, nr
    run_r[nr] = x
    return ns, nr + 1


@kernel
def _before(share, i, j):
    """Candidate i comes before candidate j in the stable share order (numpy's: ascending, nan
    last, ties to the earlier candidate, i.e. the lower port)."""
    a, b = share[i], share[j]
    if a < b:
        return True
    if a > b:
        return False
    if a == b:
        return i < j
    if a != a:   # nan: after every number, in candidate order among nans
        return b != b and i < j
    return True


@kernel
def _sift(heap, size, k, share):
    """Restore the heap (``_before`` order) below position k."""
    x = heap[k]
    while True:
        c = 2 * k + 1
        if c >= size:
            break
        if c + 1 < size and _before(share, heap[c + 1], heap[c]):
            c += 1
        if not _before(share, heap[c], x):
            break
        heap[k] = heap[c]
        k = c
    heap[k] = x


@kernel
def _heapify(heap, m, share):
    """``heap[:m]``: candidates 0..m-1 as a binary heap in the stable share order; :func:`_pop`
    then yields them in the order numpy's stable ``argsort`` lists them (only as many as the run
    needs are popped: the first cut + 1 of m, not a full sort)."""
    for i in range(m):
        heap[i] = i
    for k in range(m // 2 - 1, -1, -1):
        _sift(heap, m, k, share)


@kernel
def _pop(heap, size, share):
    """The first candidate of ``heap[:size]`` in share order, removed (size - 1 remain). (A constant
    passed to a kernel is typed ``np.int64`` / ``np.bool_`` in these kernels: numba compiles a callee
    once more for each literal constant it is first seen with.)"""
    top = heap[0]
    heap[0] = heap[size - 1]
    if size > 2:
        _sift(heap, size - 1, np.int64(0), share)
    return top


@kernel
def _sort_run(g, lv, port, ng):
    """Sort the run's nodes ``g[:ng]`` ascending (all distinct), ``lv`` and ``port`` alongside."""
    if ng <= 32:
        for i in range(1, ng):
            x, y, z = g[i], lv[i], port[i]
            j = i - 1
            while j >= 0 and g[j] > x:
                g[j + 1], lv[j + 1], port[j + 1] = g[j], lv[j], port[j]
                j -= 1
            g[j + 1], lv[j + 1], port[j + 1] = x, y, z
        return
    o = np.argsort(g[:ng])
    gs, ls, ps = g[:ng].copy(), lv[:ng].copy(), port[:ng].copy()
    for i in range(ng):   # (a loop, not fancy indexing: less to compile)
        g[i], lv[i], port[i] = gs[o[i]], ls[o[i]], ps[o[i]]


@kernel
def _freeze(g, lv, port, ng, own_load, nodes, scratch, cells):
    """Freeze nodes ``g[:ng]`` (increasing, no two sharing a cell) at levels ``lv`` saturated by
    ports ``port``: ``BlockCounts._freeze`` with the cell tables, the same operations in the same
    order. Its ``np.bincount`` sums each target's terms from 0.0 in (node, column) order and then
    subtracts / adds the sum to every node; here only the targets of non-zero terms (``touched`` /
    ``mark`` scratch) are updated: numpy's zero terms, and its subtraction / addition of a +0.0 sum,
    leave every count and frozen load as it is (a frozen load, a sum of terms starting from +0.0, is
    never -0.0; a level of inf times a zero cell is nan, so that term is kept).
    nodes: each node's (lev, bport, free, frz, cnt); scratch: (acc_c, acc_f, touched, mark), ``acc_c``
    / ``acc_f`` / ``mark`` zeroed, of size U + 1, left zeroed; cells: (cbase_U, wid_U, obase_U,
    qbase_U, cols_RG, mm) -- node x's w-th cell (w < ``wid_U[x]``) is ``mm[cbase_U[x] + w]``, shared
    with the other side's node ``obase_U[x] + q``, q = ``qbase_U[x] + w`` (or, for an NVLink node,
    ``qbase_U[x] = -1 - r``: ``cols_RG[r, w]``), what ``BlockCounts._node_cells`` tabulates (its
    columns past a block's width point at a zero cell: a term that leaves every sum as it is)."""
    lev, bport, free, frz, cnt = nodes
    acc_c, acc_f, touched, mark = scratch
    cbase_U, wid_U, obase_U, qbase_U, cols_RG, mm = cells
    for i in range(ng):
        x = g[i]
        lev[x] = lv[i]
        bport[x] = port[i]
        free[x] = False
    if own_load:
        for i in range(ng):
            x = g[i]
            frz[x] = frz[x] + lv[i] * cnt[x]
    for i in range(ng):
        cnt[g[i]] = 0.0
    nt = 0
    for i in range(ng):
        x = g[i]
        li = lv[i]
        finite = np.isfinite(li)
        cb, ob, qb = cbase_U[x], obase_U[x], qbase_U[x]
        for w in range(wid_U[x]):
            t = ob + (cols_RG[-1 - qb, w] if qb < 0 else qb + w)
            z = mm[cb + w] * (1.0 if free[t] else 0.0)
            if z == 0.0 and finite:   # a term of +0.0 (or -0.0): the sums stay as they are
                continue
            if not mark[t]:
                mark[t] = True
                touched[nt] = t
                nt += 1
            acc_c[t] += z
            acc_f[t] += li * z
    for j in range(nt):
        t = touched[j]
        cnt[t] = cnt[t] - acc_c[t]
        frz[t] = frz[t] + acc_f[t]
        acc_c[t] = 0.0
        acc_f[t] = 0.0
        mark[t] = False


@kernel
def _fill_simple(cap_P, N, tables, nodes, scratch, cells, run):
    """:func:`fill_levels` where every node has one port and every port one node (``tables.simple``):
    the candidate ports are the nodes' own. nodes, scratch, cells: as :func:`_freeze` takes them;
    run: the run's buffers (sender nodes, receiver nodes, nodes, levels, ports)."""
    simple, dummy, run_max, pall_UK, port_nodes_PD, pps, nps, key_U, row_U, col_U = tables[:10]
    lev, bport, free, frz, cnt = nodes
    mm = cells[5]
    run_s, run_r, g, lv, port = run
    steps = 0
    nP = pps.size
    li = np.empty(nP, dtype=np.int64)   # the candidate ports' positions in pps, ascending
    share = np.empty(nP)
    heap = np.empty(nP, dtype=np.int64)
    m = np.int64(0)   # (not a literal 0: see _pop)
    for k in range(nP):
        if cnt[nps[k]] != 0.0:
            li[m] = k
            m += 1
    while m:
        steps += 1
        for i in range(m):
            k = li[i]
            x = nps[k]
            share[i] = (cap_P[pps[k]] - frz[x]) / cnt[x]
        _heapify(heap, m, share)
        w = min(m, run_max)
        cut = w
        ns = np.int64(0)
        nr = np.int64(0)
        for i in range(w):
            j = _pop(heap, m - i, share)
            k = li[j]
            x = nps[k]
            if _touches(x, N, run_s, ns, run_r, nr, key_U, row_U, col_U, mm):
                cut = i
                break
            ns, nr = _join_run(x, N, run_s, ns, run_r, nr)
            g[i] = x
            lv[i] = share[j]
            port[i] = pps[k]
        _sort_run(g, lv, port, cut)
        _freeze(g, lv, port, cut, np.bool_(False), nodes, scratch, cells)
        # the next step's candidates: those still carrying unfrozen transfers (counts only fall)
        mm_ = 0
        for i in range(m):
            if cnt[nps[li[i]]] != 0.0:
                li[mm_] = li[i]
                mm_ += 1
        m = mm_
    return steps


@kernel
def _fill_general(cap_P, N, tables, nodes, scratch, cells, run):
    """:func:`fill_levels` for any port map: each step sums every port's unfrozen transfers and
    frozen load from its nodes. Arguments as :func:`_fill_simple`'s."""
    simple, dummy, run_max, pall_UK, port_nodes_PD, pps, nps, key_U, row_U, col_U = tables[:10]
    lev, bport, free, frz, cnt = nodes
    mm = cells[5]
    run_s, run_r, g, lv, port = run
    U = 2 * N
    P1 = cap_P.size
    D = port_nodes_PD.shape[1]
    steps = 0
    K = pall_UK.shape[1]
    n = np.zeros(P1)
    fr = np.zeros(P1)
    cand = np.empty(P1, dtype=np.int64)
    share = np.empty(P1)
    heap = np.empty(P1, dtype=np.int64)
    seen = np.zeros(U + 1, dtype=np.int64)   # step stamp: the node is in this step's run so far
    while True:
        live = False
        for u in range(U):
            if cnt[u] != 0.0:
                live = True
                break
        if not live:
            break
        for p in range(P1):
            n[p] = 0.0
            fr[p] = 0.0
        for u in range(U):
            c = cnt[u]
            f = frz[u]
            if c == 0.0 and f == 0.0:   # adds +0.0 to sums that start at +0.0: leaves them as they are
                continue
            for k in range(K):
                p = pall_UK[u, k]
                n[p] += c
                fr[p] += f
        n[dummy] = 0.0
        m = np.int64(0)
        for p in range(P1):
            if n[p] != 0.0:
                cand[m] = p
                share[m] = (cap_P[p] - fr[p]) / n[p]
                m += 1
        _heapify(heap, m, share)
        steps += 1
        w = min(m, run_max)
        ns = np.int64(0)
        nr = np.int64(0)
        nrun = np.int64(0)
        for i in range(w):
            j = _pop(heap, m - i, share)
            p = cand[j]
            stop = False
            for d in range(D):
                x = port_nodes_PD[p, d]
                if x < 0:
                    break
                if seen[x] == steps or _touches(x, N, run_s, ns, run_r, nr, key_U, row_U, col_U, mm):
                    stop = True
                    break
            if stop:
                break
            for d in range(D):
                x = port_nodes_PD[p, d]
                if x < 0:
                    break
                seen[x] = steps
                ns, nr = _join_run(x, N, run_s, ns, run_r, nr)
                if cnt[x] > 0.0:   # the run's nodes that carry unfrozen transfers
                    g[nrun] = x
                    lv[nrun] = share[j]
                    port[nrun] = p
                    nrun += 1
        if nrun == 0:
            return -1
        _sort_run(g, lv, port, nrun)
        _freeze(g, lv, port, nrun, np.bool_(True), nodes, scratch, cells)
    return steps


class SolverTables(NamedTuple):
    """The block solver's tables, as :func:`fill_levels` and the network's one-kernel tick read them:
    built once per port map by ``BlockCounts`` (contiguous int64 arrays), never written after.

    simple: every node has one port and every port one node (then ``pps`` / ``nps``: the ports that
    have a node, ascending, and their nodes).  dummy: the dummy port.  run_max: ports of one run at
    most.  pall_UK: int64 [U, K] ports of each node (dummy-padded).  port_nodes_PD: int64 [P1, D]
    nodes of each port (-1-padded).  key_U, row_U, col_U: int64 [U] per node its cell key, its
    row's first index in the counts buffer and its column in the other side's rows.  cbase_U,
    wid_U, obase_U, qbase_U: int64 [U + 1] per node (and the spare node) its row's first cell in
    ``mm`` (its side's M or MT part), its row's width (0: an unused block), the other side's first
    node of its block and its cells' first rank there (-1 - r for an NVLink node of rank r: its
    node's ranks ``cols_RG[r]``, int64 [R, G]); see :func:`_freeze`.
    """

    simple: bool
    dummy: int
    run_max: int
    pall_UK: np.ndarray
    port_nodes_PD: np.ndarray
    pps: np.ndarray
    nps: np.ndarray
    key_U: np.ndarray
    row_U: np.ndarray
    col_U: np.ndarray
    cbase_U: np.ndarray
    wid_U: np.ndarray
    obase_U: np.ndarray
    qbase_U: np.ndarray
    cols_RG: np.ndarray


@kernel
def fill_levels(cap_P, cnt_src_N, cnt_dst_N, mm, tables, lev, bport):
    """The filling steps taken (-1 when a step froze nothing: the numpy code raises there), with
    ``lev`` / ``bport`` (float64 / int64 [U + 1], written whole) per node (and the spare node U)
    the level at which it froze (inf: never) and the port that froze it (-1: none).

    cap_P: float64 [P1] capacities.  cnt_src_N / cnt_dst_N: float64 [N] active transfers per
    sender / receiver node.  mm: float64 [2T + 1] the counts buffer (``BlockCounts.mm``: M cells,
    MT cells, a zero).  tables: the solver's :class:`SolverTables` (built once per port map)."""
    simple, dummy, run_max, pall_UK, port_nodes_PD, pps, nps, key_U, row_U, col_U = tables[:10]
    N = cnt_src_N.size
    U = 2 * N
    cnt = np.empty(U + 1)
    for i in range(N):   # (a loop, not slice assignments: no shape check's message to compile)
        cnt[i] = cnt_src_N[i]
        cnt[N + i] = cnt_dst_N[i]
    cnt[U] = 0.0
    for u in range(U + 1):
        lev[u] = np.inf
        bport[u] = -1
    frz = np.zeros(U + 1)
    free = np.ones(U + 1, dtype=np.bool_)
    free[U] = False
    acc_c = np.zeros(U + 1)
    acc_f = np.zeros(U + 1)
    mark = np.zeros(U + 1, dtype=np.bool_)
    touched = np.empty(U + 1, dtype=np.int64)
    nodes, scratch, cells = (lev, bport, free, frz, cnt), (acc_c, acc_f, touched, mark), tables[10:] + (mm,)
    D = port_nodes_PD.shape[1]
    cap_run = run_max * max(D, 1)
    run_s = np.empty(cap_run, dtype=np.int64)   # the run's sender nodes so far
    run_r = np.empty(cap_run, dtype=np.int64)   # its receiver nodes
    g = np.empty(cap_run, dtype=np.int64)       # the run's nodes, then sorted, with their levels and ports
    lv = np.empty(cap_run)
    port = np.empty(cap_run, dtype=np.int64)
    run = (run_s, run_r, g, lv, port)
    if simple:
        return _fill_simple(cap_P, N, tables, nodes, scratch, cells, run)
    return _fill_general(cap_P, N, tables, nodes, scratch, cells, run)


@kernel
def count_transfers(mm, T, row_U, col_U, cnt_src_N, cnt_dst_N, ns_F, nd_F, sign):
    """``BlockCounts.add`` in one pass: transfers from sender nodes ``ns_F`` to receiver nodes
    ``nd_F`` counted in (sign 1) or out (sign -1) of their M cell, MT cell (from T in ``mm``) and
    both nodes' totals. Counts are whole numbers, so the order of the additions does not matter."""
    for f in range(ns_F.size):
        s, d = ns_F[f], nd_F[f]
        mm[row_U[s] + col_U[d]] += sign
        mm[T + row_U[d] + col_U[s]] += sign
        cnt_src_N[s] += sign
        cnt_dst_N[d] += sign


__all__ = ["SolverTables", "count_transfers", "fill_levels"]
