"""``alltoall``: flat dropless variable-size all-to-all (Megatron-Core's ``alltoall`` dispatcher).

Ranks exchange per-expert counts, then one variable-size all-to-all sends every (token, k) entry to
the home rank of its expert, and one all-to-all brings the outputs back. Nothing is dropped or
padded; the hottest receiving rank sets the time. With ``dedup`` a token is sent once per
destination rank and expanded there (as DeepEP and MoonEP do).
"""

from __future__ import annotations

import numpy as np

from moonep_sim.plan import GlobalRouting, Plan, home_slots, plan_from_slots
from moonep_sim.strategies import Option, PlanContext, register


def home_slot_of_expert(ctx: PlanContext) -> np.ndarray:
    """int64 [E]: index of each expert's home slot in the placement's slot arrays."""
    p = ctx.placement
    home = p.slot_rank_S == p.home_E[p.slot_expert_S]
    slot_of = np.empty(p.num_experts, dtype=np.int64)
    slot_of[p.slot_expert_S[home]] = np.flatnonzero(home)
    return slot_of


@register("alltoall", summary="flat dropless variable-size all-to-all to each expert's home rank (Megatron-Core)",
          options={"dedup": Option(bool, False, "send a token once per destination rank, expand there")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, dedup: bool) -> Plan:
    # only home slots are used: replicas (if any) are ignored by this strategy
    sr, se, slot_of = home_slots(ctx.placement)
    return plan_from_slots(routing, ctx.cluster, ctx.costs, sr, se, sr, slot_of[routing.topk_ids_TK], dedup=dedup,
                           token_padding=ctx.token_padding)
