"""A Plan's invariants, as named checks run in order.

Notation as in ``moonep_sim.plan.ir``: R ranks, T tokens, K top-k, E experts, S slots, M messages
of a hop, W final rows (ranks concatenated).

Every strategy's Plan must pass every check; the executors rely on them:

- ``shapes``: array shapes agree with R, T, K and S; slot ranks lie in [0, R).
- ``slots``: slots sorted by rank, experts in range, padded as stated, contiguous offsets; the
  final-row arrays have W rows.
- ``entries``: every kept entry is computed exactly once, at a slot of its expert's segment, at
  the row it names (conservation); slot segments are real rows then padding.
- ``duplicates``: a duplicate entry shares its destination rank with an earlier entry of its token.
- ``copies``: a copied expert is resident on its home rank; a stage-1 (relayed) copy's source is
  another rank of its node holding a stage-0 copy of the expert.
- ``capacity``: no rank holds more rows than its capacity.
- ``hop_provenance``: every hop is well-formed (sorted, in range, in scope, each destination row
  written once) and every final row traces back through the hops to its entry's token, so no row
  is misrouted.

A check that finds the Plan too malformed for the later ones stops the run. :func:`validate`
returns the violations as sentences, :func:`violations` with the check that found each, and
:func:`check` raises :class:`~moonep_sim.errors.PlanError` naming the failed checks;
:func:`validate_counting` also returns each hop's rows per (src, dst), counted while the hop check
walks the messages (``Plan.summary`` reports its bytes from them).

On a large Plan (``perf.thread_min`` entries and messages, :class:`~moonep_sim.perf.PerfConfig`) ``hop_provenance`` runs on a second thread
beside ``entries`` .. ``capacity`` (see :func:`_run`): the wall time falls on two cores, the CPU
time does not; the result is the sequential run's. The checks read the Plan's index arrays in
their own dtype (int32, :data:`~moonep_sim.plan.kinds.INDEX`): their tables are int32 too, so no
[N] operand is widened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from moonep_sim.errors import PlanError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import threads
from moonep_sim.plan.kinds import SCOPES, Scope
from moonep_sim.plan.order import entry_token

# The checks read a ``moonep_sim.plan.ir.Plan``. This module does not import the IR, not even for
# type checking: the IR imports it (``Plan.summary`` reports the violations), and the files of the
# package form no import circle.
Plan = Any


class Violation(NamedTuple):
    """One broken invariant: the check that found it and the sentence saying what must hold."""

    check: str
    message: str


@dataclass
class _State:
    """What earlier checks derived and later ones reuse (one validate run)."""

    out: list[Violation] = field(default_factory=list)
    rows_R: np.ndarray | None = None       # padded rows per rank
    row_off: np.ndarray | None = None      # [R+1] offsets of each rank's final rows
    hop_rows: list = field(default_factory=list)  # each walked hop's rows per (src, dst): Hop.rows_RR
    perf: PerfConfig = DEFAULT_PERF        # the chunk and block-walk settings (validate_chunk, ...)


# A check appends to st.out and returns False when the later checks cannot run.
CheckFn = Callable[["Plan", _State, Callable[[str], None]], bool]


def _check_shapes(plan: Plan, st: _State, bad: Callable[[str], None]) -> bool:
    R, K, T = plan.ranks, plan.top_k, plan.num_tokens
    if plan.tokens_per_rank_R.shape != (R,) or int(plan.tokens_per_rank_R.sum()) != T:
        bad(f"tokens_per_rank ({plan.tokens_per_rank_R.tolist()}) must have R={R} entries summing to T={T}")
        return False
    n = len(st.out)
    for name in ("entry_rank_TK", "entry_row_TK", "entry_dup_TK", "entry_weight_TK"):
        if getattr(plan, name).shape != (T, K):
            bad(f"{name} shape {list(getattr(plan, name).shape)} must be [{T}, {K}]")
    S = plan.slot_rank_S.size
    for name in ("slot_expert_S", "slot_home_S", "slot_offset_S", "slot_rows_S", "slot_padded_S"):
        if getattr(plan, name).shape != (S,):
            bad(f"{name} must have S={S} entries")
    if len(st.out) > n:
        return False
    if S and ((plan.slot_rank_S < 0) | (plan.slot_rank_S >= R)).any():
        bad("slot ranks must lie in [0, R)")
        return False
    return True


def _check_slots(plan: Plan, st: _State, bad: Callable[[str], None]) -> bool:
    R, E = plan.ranks, plan.num_experts
    n = len(st.out)
    if (np.diff(plan.slot_rank_S) < 0).any():
        bad("slots must be sorted by rank")
    if ((plan.slot_expert_S < 0) | (plan.slot_expert_S >= E)).any():
        bad("slot experts must lie in [0, E)")
    if (plan.slot_padded_S < plan.slot_rows_S).any():
        bad("slot_padded must be >= slot_rows")
    if plan.token_padding > 1 and (plan.slot_padded_S % plan.token_padding).any():
        bad(f"slot_padded must be a multiple of token_padding ({plan.token_padding})")
    rows_R = plan.rows_R()
    first = np.searchsorted(plan.slot_rank_S, np.arange(R))
    exp_off = np.cumsum(plan.slot_padded_S) - plan.slot_padded_S
    exp_off = exp_off - np.concatenate([[0], np.cumsum(plan.slot_padded_S)])[first][plan.slot_rank_S]
    if not np.array_equal(exp_off, plan.slot_offset_S):
        bad("slot_offset must be the running sum of slot_padded within each rank")
    if len(st.out) > n:
        return False
    W = int(rows_R.sum())
    if plan.row_entry_W.shape != (W,) or plan.expand_src_row_W.shape != (W,):
        bad(f"row_entry and expand_src_row must have W={W} rows (sum of padded slot rows)")
        return False
    st.rows_R, st.row_off = rows_R, plan.row_off_R()
    return True


def _check_entries(plan: Plan, st: _State, bad: Callable[[str], None]) -> bool:
    R, S = plan.ranks, plan.slot_rank_S.size
    rows_R, row_off = st.rows_R, st.row_off
    rank_e = plan.entry_rank_TK.ravel()
    row_e = plan.entry_row_TK.ravel()
    n = rank_e.size
    if n and (int(rank_e.min()) < -1 or int(rank_e.max()) >= R):
        bad("entry_rank must be -1 or a rank in [0, R)")
        return False
    # one walk, chunk by chunk of entries (perf.validate_chunk): no [N] temporaries and no masked copies. A
    # dropped entry (rank -1) reads the appended last element of each per-rank table: 0 rows (so
    # its row must be -1), and row offset 0 (so its row -1 reads the last final row, and the
    # comparison ignores it)
    # the per-rank tables in the entries' own dtype (int32 where both are: the final rows, all ranks,
    # fit it, as the Plan requires), read with ``take`` (faster than fancy indexing for a table this small)
    idt = np.int32 if rank_e.dtype == row_e.dtype == np.int32 and int(row_off[-1]) < 2**31 - 1 else np.int64
    rows_ext = np.append(rows_R, 0).astype(idt)
    off_ext = np.append(row_off[:-1], 0).astype(idt)
    row_ent = plan.row_entry_W
    C = st.perf.validate_chunk
    eid0 = np.arange(min(n, C), dtype=idt)
    n_kept, conserved = 0, True
    for lo in range(0, n, C):  # loop over chunks of entries, not entries
        rk, rw = rank_e[lo:lo + C], row_e[lo:lo + C]
        kept = rk >= 0
        nk = int(np.count_nonzero(kept))
        n_kept += nk
        if nk == rk.size:
            ok = int(rw.min()) >= 0 and bool((rw < rows_ext.take(rk)).all())
        else:  # kept: 0 <= row < rows of its rank; dropped: row -1 (>= -1 and < 0 rows)
            ok = int(rw.min()) >= -1 and bool(np.array_equal(rw >= 0, kept)) and \
                bool((rw < rows_ext.take(rk)).all())
        if not ok:
            bad("entry_row must be a row of the destination rank (or -1 when dropped)")
            return False
        if conserved and nk:
            g = off_ext.take(rk)
            g += rw
            got = row_ent.take(g)
            got -= lo
            same = got == eid0[:rk.size]
            conserved = bool(same.all()) if nk == rk.size else bool((same | ~kept).all())
    if not conserved:
        bad("row_entry must name, at each kept entry's row, that entry (conservation)")
    real_rows = plan.row_entry_W >= 0
    if int(np.count_nonzero(real_rows)) != n_kept:
        bad(f"final rows holding entries ({int(np.count_nonzero(real_rows))}) must equal kept entries "
            f"({n_kept}): every kept entry lands exactly once")
    # row -> slot: each slot's segment is slot_rows real rows then padding (padded >= rows here)
    real_S = np.maximum(plan.slot_rows_S, 0)  # a negative count means no real rows
    seg_len = np.stack([real_S, plan.slot_padded_S - real_S], axis=1).ravel()
    is_real_pos = np.repeat(np.tile(np.array([True, False]), S), seg_len)
    layout_ok = np.array_equal(is_real_pos, real_rows)
    if not layout_ok:
        bad("each slot's first slot_rows rows must hold entries and the rest be padding")
    del is_real_pos
    # the entry's expert is recovered from the routing only via the plan's slots. With the layout
    # as checked just above, slot s holds exactly max(slot_rows[s], 0) real rows.
    if layout_ok:
        count_S = real_S
    else:
        real_cum = np.concatenate([[0], np.cumsum(real_rows.view(np.uint8), dtype=np.int64)])
        slot_end = np.cumsum(plan.slot_padded_S)
        count_S = real_cum[slot_end] - real_cum[slot_end - plan.slot_padded_S]
    if (count_S != plan.slot_rows_S).any():
        bad("slot_rows must count the entries in each slot")
    return True


def _check_duplicates(plan: Plan, st: _State, bad: Callable[[str], None]) -> bool:
    R, K = plan.ranks, plan.top_k
    dup = plan.entry_dup_TK
    if not dup.any():
        return True
    # per token, a bit set of the ranks its earlier entries go to (W words of 64 ranks), chunk by
    # chunk of tokens (in cache, no [T, K] gathers; one word per token needs no gather at all)
    rank_TK, T, W = plan.entry_rank_TK, dup.shape[0], (R + 63) // 64
    step = max(st.perf.validate_chunk // max(K * W, 1), 1)
    for lo in range(0, T, step):  # loop over chunks of tokens, not tokens
        d_c = dup[lo:lo + step]
        if not d_c.any():
            continue
        r_c = rank_TK[lo:lo + step]
        drops = bool((r_c < 0).any())
        seen = np.zeros(r_c.shape[0] * W, dtype=np.uint64)
        word0 = np.arange(0, seen.size, W) if W > 1 else None  # each token's first word
        bit = np.empty(r_c.shape[0], dtype=np.uint64)
        for k in range(K):  # loop over top-k slots, not tokens
            col = r_c[:, k]
            sh = np.maximum(col, 0) if drops else col
            np.left_shift(np.uint64(1), (sh if W == 1 else sh & 63).astype(np.uint64), out=bit)
            if drops:
                bit[col < 0] = 0  # dropped entries mark nothing and are never duplicates
            at = None if W == 1 else word0 + (sh >> 6)
            cur = seen if at is None else seen[at]
            if (d_c[:, k] & ((cur & bit) == 0)).any():
                bad("a duplicate entry must share its destination rank with an earlier entry of its token")
                return True
            if at is None:
                seen |= bit
            else:
                seen[at] = cur | bit
    return True


def _check_copies(plan: Plan, st: _State, bad: Callable[[str], None]) -> bool:
    cp = plan.slot_home_S != plan.slot_rank_S
    if cp.any():
        resident = set(zip(plan.slot_rank_S[~cp].tolist(), plan.slot_expert_S[~cp].tolist()))
        miss = [(int(h), int(e)) for h, e in zip(plan.slot_home_S[cp], plan.slot_expert_S[cp])
                if (int(h), int(e)) not in resident]
        if miss:
            bad(f"copied experts must be resident on their home rank; (home, expert) {miss[:4]} are not")
    if plan.slot_src_S is not None:
        src = np.asarray(plan.slot_src_S)
        if src.shape != plan.slot_home_S.shape:
            bad(f"slot_src_S shape ({list(src.shape)}) must equal the slots' ({list(plan.slot_home_S.shape)})")
            return True
        s1 = cp & (src != plan.slot_home_S)
        if (~cp & (src != plan.slot_rank_S)).any():
            bad("a slot that is not a copy must name its own rank as its weights' source")
        if s1.any():
            node = plan.cluster.node_of_rank()
            off = s1 & (node[np.clip(src, 0, plan.ranks - 1)] != node[plan.slot_rank_S])
            off |= s1 & ((src < 0) | (src >= plan.ranks) | (src == plan.slot_rank_S))
            if off.any():
                i = int(np.argmax(off))
                bad(f"stage-1 copy of expert {int(plan.slot_expert_S[i])} on rank {int(plan.slot_rank_S[i])}: its "
                    f"relay ({int(src[i])}) must be another rank of the receiver's node")
            s0 = cp & ~s1
            held = set(zip(plan.slot_rank_S[s0].tolist(), plan.slot_expert_S[s0].tolist()))
            miss = [(int(r), int(e)) for r, e in zip(src[s1], plan.slot_expert_S[s1]) if (int(r), int(e)) not in held]
            if miss:
                bad(f"a stage-1 copy's relay must hold a stage-0 copy of its expert; (relay, expert) {miss[:4]} do not")
    return True


def _check_capacity(plan: Plan, st: _State, bad: Callable[[str], None]) -> bool:
    rows_R = st.rows_R
    if plan.capacity_R is not None and (rows_R > plan.capacity_R).any():
        r = int(np.argmax(rows_R > plan.capacity_R))
        bad(f"rank {r} rows ({int(rows_R[r])}) must be <= capacity ({int(plan.capacity_R[r])})")
    return True


class _HopWalk(NamedTuple):
    """What one walk over a hop's messages found (see :func:`_check_hop_provenance`)."""

    unsorted: bool
    wrong_src: bool
    wrong_dst: bool
    cross_node: bool
    cross_rail: bool
    rows_RR: np.ndarray  # int64 [R, R] messages per (src, dst), as ``Hop.rows_RR`` counts them


def _walk_chunks(h, R: int, src_rows, buf_off, dst_off, origin, new_origin, node, local, chunk: int) -> _HopWalk:
    """Any hop, chunk by chunk of messages: checks order, rows and scope, writes ``new_origin``."""
    m = h.src_rank_M.size
    unsorted = wrong_src = wrong_dst = cross_node = cross_rail = False
    prev_key = -1
    rows = np.zeros(R * R, dtype=np.int64)
    kdt = np.int32 if R * R <= np.iinfo(np.int32).max and h.src_rank_M.dtype == np.int32 else np.int64
    for lo in range(0, m, chunk):  # loop over chunks of messages, not messages
        sl = slice(lo, min(m, lo + chunk))
        s_r, s_w, d_r, d_w = h.src_rank_M[sl], h.src_row_M[sl], h.dst_rank_M[sl], h.dst_row_M[sl]
        key = s_r.astype(kdt) * R
        key += d_r
        rows += np.bincount(key, minlength=R * R)
        unsorted |= bool(key[0] < prev_key) or bool((key[1:] < key[:-1]).any())
        prev_key = int(key[-1])
        if wrong_src or wrong_dst:  # the hop is malformed: only its order is still checked
            continue
        if int(s_w.min()) < -1 or (s_w >= src_rows[s_r]).any():
            wrong_src = True
            continue
        if int(d_w.min()) < 0 or (d_w >= h.dst_rows_R[d_r]).any():
            wrong_dst = True
            continue
        if h.scope == Scope.INTRA_NODE:
            cross_node |= bool((node[s_r] != node[d_r]).any())
        elif h.scope == Scope.INTER_NODE:
            cross_rail |= bool((local[s_r] != local[d_r]).any())
        src_g = buf_off[s_r] + s_w
        new_origin[dst_off[d_r] + d_w] = np.where(s_w >= 0, origin[np.maximum(src_g, 0)], -1)
    return _HopWalk(unsorted, wrong_src, wrong_dst, cross_node, cross_rail, rows.reshape(R, R))


def _walk_blocks(h, R: int, src_rows, buf_off, dst_off, origin, new_origin, node, local,
                 chunk: int) -> _HopWalk | None:
    """:func:`_walk_chunks` for a hop sorted by (src, dst), block by (src, dst) block: each block's
    ranks and buffer offsets are scalars, so its rows index the source and destination buffers of
    its two ranks directly -- numpy's bounds checks of that gather and scatter are its range
    checks: the rows are read as unsigned, so a negative row is out of range too, and only a block
    with a zero row (-1) or a bad row takes a second, checked pass (an all-gather's hop checks ~3x
    faster than by chunks). None when the hop is not sorted or a row is out of range (the caller
    then walks it by chunks, which names what is wrong)."""
    m = h.src_rank_M.size
    src, dst, s_rows, d_rows = h.src_rank_M, h.dst_rank_M, h.src_row_M, h.dst_row_M
    if s_rows.dtype != np.int32 or d_rows.dtype != np.int32:  # (INDEX rows read as unsigned, below)
        return None
    for lo in range(0, m, chunk):  # source ranks non-decreasing, chunk by chunk
        c = src[max(lo - 1, 0):lo + chunk]
        if (c[1:] < c[:-1]).any():
            return None
    sb = np.searchsorted(src, np.arange(R + 1, dtype=src.dtype))
    rows = np.zeros((R, R), dtype=np.int64)
    buf_off, dst_off = np.asarray(buf_off).tolist(), np.asarray(dst_off).tolist()  # (scalars per rank)
    ramp = np.zeros(0, dtype=np.int32)  # 0, 1, 2, ...: the rows of a run
    cross_node = cross_rail = False
    for r in range(R):  # loop over source ranks and their (src, dst) blocks, not messages
        a, b = int(sb[r]), int(sb[r + 1])
        if b == a:
            continue
        d = dst[a:b]
        if (d[1:] < d[:-1]).any():
            return None
        db = (np.searchsorted(d, np.arange(R + 1, dtype=d.dtype)) + a).tolist()
        rows[r] = np.diff(db)
        qs = [q for q in range(R) if db[q + 1] > db[q]]
        if h.scope == Scope.INTRA_NODE:
            cross_node |= any(node[r] != node[q] for q in qs)
        elif h.scope == Scope.INTER_NODE:
            cross_rail |= any(local[r] != local[q] for q in qs)
        src_buf = origin[buf_off[r]:buf_off[r + 1]]  # rank r's rows of the source buffer
        for q in qs:  # loop over (src, dst) blocks, not messages
            lo, hi = db[q], db[q + 1]
            sw, dw = s_rows[lo:hi], d_rows[lo:hi]
            dst_buf = new_origin[dst_off[q]:dst_off[q + 1]]  # rank q's rows of the destination buffer
            if hi - lo > ramp.size:
                ramp = np.arange(hi - lo, dtype=np.int32)
            # a block's rows are often one run (every builder numbers a block's receive rows so; an
            # all-gather's source rows too): then its gather or scatter is a slice. Rows read as
            # unsigned: a zero row (-1), a negative row or one beyond its rank's buffer is an IndexError
            # (numpy scatters through an intp index ~2x faster than through an int32 one)
            src_run, dst_run = _as_run(sw, ramp, len(src_buf)), _as_run(dw, ramp, len(dst_buf))
            try:
                vals = src_buf[src_run] if src_run else src_buf.take(sw.view(np.uint32))
                dst_buf[dst_run if dst_run else dw.view(np.uint32).astype(np.intp)] = vals
                continue
            except IndexError:
                pass
            if int(sw.min()) < -1 or int(dw.min()) < 0:
                return None
            try:  # (an IndexError: a row beyond its rank's buffer)
                vals = np.where(sw >= 0, src_buf.take(np.maximum(sw, 0)), -1)  # (-1: a zero row)
                dst_buf[dst_run if dst_run else dw.astype(np.intp)] = vals
            except IndexError:
                return None
    return _HopWalk(False, False, False, cross_node, cross_rail, rows)


def _as_run(rows, ramp, n: int) -> slice | None:
    """The slice ``rows`` is when it is the run ``a, a+1, ..., b`` inside ``[0, n)``, else None
    (checked exactly, in cache: a block is at most a few thousand rows here)."""
    k = rows.size
    if not k:
        return None
    a, b = int(rows[0]), int(rows[-1])
    if b - a != k - 1 or a < 0 or b >= n:
        return None
    return slice(a, b + 1) if np.array_equal(rows - a, ramp[:k]) else None


def _check_hop_provenance(plan: Plan, st: _State, bad: Callable[[str], None]) -> bool:
    R, K, T, C = plan.ranks, plan.top_k, plan.num_tokens, st.perf.validate_chunk
    cl = plan.cluster
    rank = np.arange(R, dtype=np.int64)
    node, local = cl.node_of(rank), cl.local_index(rank)
    # origin of each row of the current buffer: a token id (buffer 0 holds the tokens, ranks
    # concatenated), -1 a zero row, -2 never written; int32 where token ids fit (half the pages)
    odt = np.int32 if T < 2**31 - 1 else np.int64
    origin = np.arange(T, dtype=odt)
    buf_off = plan.tok_off_R()
    for i, h in enumerate(plan.hops):
        m = h.src_rank_M.size
        if not all(a.shape == (m,) for a in (h.src_row_M, h.dst_rank_M, h.dst_row_M)) or h.dst_rows_R.shape != (R,):
            bad(f"hop {i}: message arrays must share one length and dst_rows_R have R entries")
            return False
        if h.scope not in SCOPES:
            bad(f"hop {i}: scope ({h.scope!r}) must be one of {SCOPES}")
        if m and (min(int(h.src_rank_M.min()), int(h.dst_rank_M.min())) < 0
                  or max(int(h.src_rank_M.max()), int(h.dst_rank_M.max())) >= R):
            bad(f"hop {i}: ranks must lie in [0, R)")
            return False
        src_rows = np.diff(buf_off)
        dst_off = np.concatenate([[0], np.cumsum(h.dst_rows_R)])
        new_origin = np.full(int(dst_off[-1]), -2, dtype=odt)
        args = (h, R, src_rows, buf_off, dst_off, origin, new_origin, node, local, C)
        w = _walk_blocks(*args) if m >= st.perf.block_walk_min_mean * R * R else None
        if w is None:  # (the chunk walk names what is wrong)
            new_origin.fill(-2)
            w = _walk_chunks(*args)
        st.hop_rows.append(w.rows_RR)
        if w.unsorted:
            bad(f"hop {i}: messages must be sorted by (src_rank, dst_rank)")
        if w.wrong_src:
            bad(f"hop {i}: src_row must be -1 or a row of the source buffer")
            return False
        if w.wrong_dst:
            bad(f"hop {i}: dst_row must be a row of the destination buffer")
            return False
        # every message wrote one row (a token id or -1): fewer rows written means one twice
        unwritten = sum(int(np.count_nonzero(new_origin[lo:lo + C] == -2))  # (chunks: in cache)
                        for lo in range(0, new_origin.size, C))
        if new_origin.size - unwritten != m:
            bad(f"hop {i}: each destination row must be written once")
        if w.cross_node:
            bad(f"hop {i}: intra_node scope must not cross nodes")
        if w.cross_rail:
            bad(f"hop {i}: inter_node scope must connect equal local indices only")
        origin, buf_off = new_origin, dst_off
    # final gather, rank by rank and chunk by chunk of its final rows: row w of rank r reads row
    # expand[w] of r's last buffer (the rank's buffer offset and size are scalars)
    row_off = st.row_off
    exp, row_ent = plan.expand_src_row_W, plan.row_entry_W
    if exp.size and int(exp.min()) < -1:
        bad("expand_src_row must be -1 or a row of the last buffer on the same rank")
        return False
    ungathered, misrouted = False, None
    for r in range(R):  # loop over ranks and chunks of their final rows, not rows
        for lo in range(int(row_off[r]), int(row_off[r + 1]), C):
            hi = min(int(row_off[r + 1]), lo + C)
            e = exp[lo:hi]
            if int(e.max()) >= int(buf_off[r + 1] - buf_off[r]):
                bad("expand_src_row must be -1 or a row of the last buffer on the same rank")
                return False
            org = origin[int(buf_off[r]):int(buf_off[r + 1])]  # rank r's rows of the last buffer
            zero_rows = int(e.min()) < 0
            got = np.where(e >= 0, org.take(np.maximum(e, 0)), -1) if zero_rows else org.take(e)
            ent = row_ent[lo:hi]
            want = entry_token(ent, max(K, 1))  # a token, or < 0 at padding rows
            np.maximum(want, -1, out=want)
            wrong = got != want
            real = ent >= 0  # the rows holding an entry
            if not real.all():
                wrong &= real
            if zero_rows:
                ungathered |= bool((real & (e < 0)).any())
            if misrouted is None and wrong.any():
                w = int(np.argmax(wrong))
                misrouted = (lo + w, int(want[w]), int(got[w]))
    if ungathered:
        bad("every real row must be gathered from a buffer row")
    if misrouted is not None:
        w, tw, tg = misrouted
        r = int(np.searchsorted(row_off, w, side="right")) - 1
        bad(f"row {w} of rank {r} must hold token {tw} but receives "
            f"{'nothing' if tg == -2 else 'token ' + str(tg)} (misrouted)")
    return True


CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("shapes", _check_shapes),
    ("slots", _check_slots),
    ("entries", _check_entries),
    ("duplicates", _check_duplicates),
    ("copies", _check_copies),
    ("capacity", _check_capacity),
    ("hop_provenance", _check_hop_provenance),
)
"""The named checks, in the order they run (see the module docstring)."""


#: the last checks of CHECKS, which read only the Plan and what ``shapes`` and ``slots`` derived
#: (``rows_R``, ``row_off``): on a large Plan they run on a second thread, beside the checks between
CONCURRENT = ("hop_provenance",)

if tuple(n for n, _ in CHECKS[-len(CONCURRENT):]) != CONCURRENT:  # (their violations are placed last)
    raise RuntimeError(f"CONCURRENT checks {CONCURRENT} must be the last of CHECKS")


def _run(plan: Plan, perf: PerfConfig = DEFAULT_PERF) -> _State:
    """Run the checks in order, until one finds the Plan too malformed for the later ones.

    On a Plan of at least ``perf.thread_min`` entries and messages, the CONCURRENT checks start on a second
    thread (:class:`~moonep_sim.plan.threads.Beside`) as soon as ``slots`` has passed, and the
    checks between run on this one. The result is the sequential run's: the second thread's
    violations follow the others', and are dropped (with any exception it raised, and the hop rows
    it counted) when an earlier check stopped the run."""
    st = _State(perf=perf)
    size = int(np.asarray(plan.entry_rank_TK).size) + sum(int(np.asarray(h.src_rank_M).size) for h in plan.hops)
    later = [(n, fn) for n, fn in CHECKS if n in CONCURRENT] if size >= perf.thread_min else []
    worker = None
    for name, fn in CHECKS:
        if later and name in CONCURRENT:
            continue
        if not fn(plan, st, lambda msg, name=name: st.out.append(Violation(name, msg))):
            if worker is not None:
                worker.discard()
                st.hop_rows.clear()
            return st
        if later and name == "slots":  # what the CONCURRENT checks read is there: start them
            worker = threads.Beside(_run_in_order, later, plan, st)
    if worker is not None:
        st.out.extend(worker.result())
    return st


def _run_in_order(checks, plan: Plan, st: _State) -> list[Violation]:
    """``checks`` in order (until one stops), their violations apart from ``st.out``."""
    out: list[Violation] = []
    for name, fn in checks:
        if not fn(plan, st, lambda msg, name=name: out.append(Violation(name, msg))):
            break
    return out


def violations(plan: Plan, perf: PerfConfig = DEFAULT_PERF) -> list[Violation]:
    """Run the checks in order; every broken invariant with the check that found it (empty: valid).
    perf: from ``perf.thread_min`` entries and messages the hop check runs on a second thread (the
    same violations)."""
    return _run(plan, perf).out


def validate(plan: Plan, perf: PerfConfig = DEFAULT_PERF) -> list[str]:
    """Check a Plan's invariants; returns the violated ones as sentences (empty list: valid)."""
    return [v.message for v in violations(plan, perf)]


def validate_counting(plan: Plan, perf: PerfConfig = DEFAULT_PERF) -> tuple[list[str], list[np.ndarray] | None]:
    """:func:`validate`, and the rows each hop sends from each source to each destination
    (``Hop.rows_RR`` of every hop, counted while the hop check walks the messages), or None
    where the checks stopped before walking every hop. ``Plan.summary`` reports both: its bytes
    then need no second pass over the messages."""
    st = _run(plan, perf)
    rows = st.hop_rows if len(st.hop_rows) == len(plan.hops) else None
    return [v.message for v in st.out], rows


def check(plan: Plan) -> Plan:
    """Raise :class:`PlanError` naming each failed check and its violations; return the plan if valid."""
    errs = violations(plan)
    if errs:
        failed = list(dict.fromkeys(v.check for v in errs))
        raise PlanError(f"plan of strategy {plan.strategy!r} fails check(s) {', '.join(failed)}: "
                        + "; ".join(f"[{v.check}] {v.message}" for v in errs))
    return plan


__all__ = ["CHECKS", "Violation", "check", "validate", "validate_counting", "violations"]
