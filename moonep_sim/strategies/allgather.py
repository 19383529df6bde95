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
from moonep_sim.plan.multihop import home_entry_slots
from moonep_sim.strategies import PlanContext, register

# Notation: T tokens, K top-k, R ranks, M = R*T messages.


@register("allgather", summary="all-gather every token to every rank, reduce-scatter back (Megatron-Core)")
def plan(routing: GlobalRouting, ctx: PlanContext) -> Plan:
    R, T, K = ctx.cluster.ranks, routing.num_tokens, routing.top_k
    sr, se, slot_of = home_slots(ctx.placement)
    # messages sorted by (src, dst, token): src r sends its tokens [off_r, off_r + s_r) to every dst
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
    hop = Hop(Scope.GLOBAL, src, src_row, dst, tok, np.full(R, T, dtype=np.int64))
    entry_slot = home_entry_slots(slot_of, routing.topk_ids_TK).ravel()
    entry_rank = sr.astype(INDEX)[entry_slot]  # the Plan's entry_rank, written as its index dtype
    # every rank's buffer holds token t at row t: the final rows' sources are the slot-sorted
    # entries' tokens, by arithmetic (no scatter of each entry's buffer row)
    lay = slot_layout(entry_slot, sr, ctx.token_padding, ranks=R)
    kept = lay.order_N[lay.n_drop:]
    layout = (lay,) + final_rows(lay, kept, None, entry_token(kept, K))
    return assemble_plan(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr),
                         Entries(entry_slot, None, dup_flags(entry_rank, K), rank_N=entry_rank), [hop],
                         padding=Padding(ctx.token_padding), layout=layout)
