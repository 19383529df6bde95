"""Point-to-point runs of a Plan's last hop: which rows the gloo executor can send straight into
the expert-grouped layout, and whether it does.

Within a slot, rows are ordered by global entry, so the rows one source sends for one slot fill
ONE contiguous block of the destination's layout: a *run*, sent as one message. The runs and the
decision depend on the Plan alone, so every rank -- and the simulator, which charges such hops
the links' point-to-point efficiency -- reaches the same answer. Numpy only (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moonep_sim.plan.ir import Plan

#: the executor's defaults (``Buffer(direct="auto")``): point-to-point runs only while no rank has
#: more than MAX_RUNS remote runs and a remote run carries at least MIN_RUN_BYTES on average (else
#: one all_to_all_single is cheaper). Measured with 4 ranks on 2 cores: 12 runs of ~1 MiB per rank
#: beat all_to_all (1.65x vs 2.08x the raw all-to-alls, bench_gloo.py overhead); 48 runs of ~128 KiB
#: per rank (OLMoE-shaped layer, 512 tokens per rank) were ~6% slower -- each message needs its
#: process scheduled, which costs most when the ranks outnumber the cores.
MAX_RUNS = 16
MIN_RUN_BYTES = 64 << 10


@dataclass(frozen=True)
class LastHopRuns:
    """The last hop's messages in run order, and the runs. Per message (M): src, dst, srow (source
    buffer row) and pos (global layout row), sorted by (src, dst, pos). Per run: starts (first
    message), lens, r_src, r_dst, r_pos, tag (index of the run within its (src, dst) pair)."""

    src: np.ndarray
    dst: np.ndarray
    srow: np.ndarray
    pos: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    r_src: np.ndarray
    r_dst: np.ndarray
    r_pos: np.ndarray
    tag: np.ndarray

    @property
    def remote(self) -> np.ndarray:
        """bool per run: source and destination differ."""
        return self.r_src != self.r_dst


def last_hop_runs(plan: Plan) -> LastHopRuns | None:
    """The runs of ``plan``'s last hop, or None when it cannot be sent run by run: it has zero
    (padding) rows, or its rows do not map one-to-one onto the layout's real rows. Vectorised."""
    if not plan.hops:
        return None
    last = plan.hops[-1]
    src, dst = last.src_rank_M, last.dst_rank_M
    srow, drow = last.src_row_M, last.dst_row_M
    if srow.size and (srow < 0).any():
        return None
    R = plan.ranks
    buf_off = np.concatenate([[0], np.cumsum(last.dst_rows_R)]).astype(np.int64)
    row_off = plan.row_off_R()
    exp = plan.expand_src_row_W
    w_rank = np.repeat(np.arange(R, dtype=np.int64), np.diff(row_off))
    real = exp >= 0
    key = buf_off[w_rank[real]] + exp[real]
    mkey = buf_off[dst] + drow
    nbuf = int(buf_off[-1])
    if key.size != mkey.size or (key.size and (np.bincount(key, minlength=nbuf).max() > 1
                                              or np.bincount(mkey, minlength=nbuf).max() > 1)):
        return None
    inv = np.full(nbuf, -1, dtype=np.int64)
    inv[key] = np.flatnonzero(real)
    pos = inv[mkey] if mkey.size else mkey
    if pos.size and (pos < 0).any():
        return None
    # rows of one (src, dst) message may travel in any order both ends agree on: layout order,
    # so that each run is one contiguous block at both ends
    order = np.lexsort((pos, dst, src))
    src, dst, srow, pos = src[order], dst[order], srow[order], pos[order]
    M = src.size
    brk = np.ones(M, dtype=bool)
    brk[1:] = (src[1:] != src[:-1]) | (dst[1:] != dst[:-1]) | (pos[1:] != pos[:-1] + 1)
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, M))
    r_src, r_dst, r_pos = src[starts], dst[starts], pos[starts]
    pair = r_src * R + r_dst
    pfirst = np.ones(starts.size, dtype=bool)
    pfirst[1:] = pair[1:] != pair[:-1]
    tag = np.arange(starts.size) - np.maximum.accumulate(np.where(pfirst, np.arange(starts.size), 0))
    return LastHopRuns(src, dst, srow, pos, starts, lens, r_src, r_dst, r_pos, tag)


def runs_are_direct(runs: LastHopRuns, ranks: int, max_runs: int | None = MAX_RUNS,
                    min_run_bytes: int = MIN_RUN_BYTES, row_bytes: int = 1) -> bool:
    """Whether the executor sends these runs point-to-point: always when ``max_runs`` is None,
    else when no rank sends or receives more than ``max_runs`` remote runs and the mean remote run
    carries at least ``min_run_bytes`` (``row_bytes`` per row)."""
    remote = runs.remote
    if max_runs is None or not remote.any():
        return True
    most = max(np.bincount(runs.r_src[remote], minlength=ranks).max(),
               np.bincount(runs.r_dst[remote], minlength=ranks).max())
    return bool(most <= max_runs and runs.lens[remote].mean() * row_bytes >= min_run_bytes)


def last_hop_is_direct(plan: Plan, row_bytes: int, max_runs: int | None = MAX_RUNS,
                       min_run_bytes: int = MIN_RUN_BYTES) -> bool:
    """Whether the gloo executor (``direct="auto"`` by default) sends ``plan``'s last hop
    point-to-point, with rows of ``row_bytes`` bytes."""
    runs = last_hop_runs(plan)
    return runs is not None and runs_are_direct(runs, plan.ranks, max_runs, min_run_bytes, row_bytes)


__all__ = ["LastHopRuns", "MAX_RUNS", "MIN_RUN_BYTES", "last_hop_is_direct", "last_hop_runs", "runs_are_direct"]
