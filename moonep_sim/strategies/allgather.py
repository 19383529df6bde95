"""``allgather``: all-gather the tokens, reduce-scatter the outputs (Megatron-Core's ``allgather``).

Anchor: Megatron-Core's ``MoEAllGatherTokenDispatcher``. Every rank's token rows go to every rank
(one all-gather: each rank then holds all T tokens, in global order), and each rank computes the
entries of the experts it holds; combine is the reverse, a reduce-scatter in which every rank sends
a (partial, often zero) output row of every token back to the token's owner. It ignores the
routing when moving data, so its traffic is ``(R-1)*T`` rows each way whatever the skew: a
routing-oblivious reference. Experts are taken at their home rank.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.plan import (INDEX, Entries, GlobalRouting, Hop, Padding, Plan, Scope, Slots, assemble_plan,
                             dup_flags, entry_token, final_rows, home_slots, slot_layout)
from moonep_sim.plan import threads
from moonep_sim.plan.multihop import home_entry_slots
from moonep_sim.strategies import PlanContext, register

# Notation: T tokens, K top-k, R ranks, M = R*T messages.


def _layout(entry_slot_N: np.ndarray, slot_rank_S: np.ndarray, token_padding: int, R: int, K: int, perf) -> tuple:
    """The entries' layout and final rows (what ``assemble_plan`` takes as ``layout``): every rank's
    buffer holds token t at row t, so the final rows' sources are the slot-sorted entries' tokens,
    by arithmetic (no scatter of each entry's buffer row)."""
    lay = slot_layout(entry_slot_N, slot_rank_S, token_padding, ranks=R, perf=perf)
    kept = lay.order_N[lay.n_drop:]
    return (lay,) + final_rows(lay, kept, None, entry_token(kept, K))


@register("allgather", summary="all-gather every token to every rank, reduce-scatter back (Megatron-Core)")
def plan(routing: GlobalRouting, ctx: PlanContext) -> Plan:
    R, K = ctx.cluster.ranks, routing.top_k
    sr, se, slot_of = home_slots(ctx.placement)
    entry_slot = home_entry_slots(slot_of, routing.topk_ids_TK).ravel()
    # the slot sort and layout on a second thread beside the hop (numpy's loops release the GIL)
    layout = threads.Beside(_layout, entry_slot, sr, ctx.token_padding, R, K, ctx.perf,
                            run=entry_slot.size >= ctx.perf.thread_min)
    with layout:
        hop = _hop(routing, R)
        entry_rank = sr.astype(INDEX)[entry_slot]  # the Plan's entry_rank, written as its index dtype
        dup = dup_flags(entry_rank, K, perf=ctx.perf)
    return assemble_plan(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr),
                         Entries(entry_slot, None, dup, rank_N=entry_rank), [hop],
                         padding=Padding(ctx.token_padding), layout=layout.result(), perf=ctx.perf)


def _hop(routing: GlobalRouting, R: int) -> Hop:
    """The all-gather: messages sorted by (src, dst, token), src r sending its tokens
    [off_r, off_r + s_r) to every dst, each token at its global row in every receive buffer."""
    T = routing.num_tokens
    tok_off = routing.tok_off_R()
    tpr = routing.tokens_per_rank_R
    M = R * T
    tok = np.empty(M, dtype=INDEX)  # the token, = its row in every receive buffer
    src_row = np.empty(M, dtype=INDEX)
    dst = np.empty(M, dtype=INDEX)
    for r in range(R):  # loop over ranks only; each block [R, s_r] is filled by numpy
        s_r, lo = int(tpr[r]), int(tok_off[r]) * R
        if s_r == 0:
            continue
        blk = slice(lo, lo + R * s_r)
        rows = np.arange(s_r, dtype=np.int64)
        src_row[blk].reshape(R, s_r)[:] = rows[None, :]
        tok[blk].reshape(R, s_r)[:] = (rows + int(tok_off[r]))[None, :]
        dst[blk].reshape(R, s_r)[:] = np.arange(R, dtype=np.int64)[:, None]
    src = np.repeat(np.arange(R, dtype=INDEX), tpr * R)
    return Hop(Scope.GLOBAL, src, src_row, dst, tok, np.full(R, T, dtype=np.int64))
