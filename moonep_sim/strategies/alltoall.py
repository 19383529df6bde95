"""``alltoall``: flat dropless variable-size all-to-all (Megatron-Core's ``alltoall`` dispatcher).

Ranks exchange per-expert counts, then one variable-size all-to-all sends every (token, k) entry to
the home rank of its expert, and one all-to-all brings the outputs back. Nothing is dropped or
padded; the hottest receiving rank sets the time. With ``dedup`` a token is sent once per
destination rank and expanded there (as DeepEP and MoonEP do).
"""

from __future__ import annotations

from moonep_sim.plan import GlobalRouting, Plan, Slots, home_slots, plan_from_slots
from moonep_sim.plan.multihop import home_entry_slots
from moonep_sim.strategies import Option, PlanContext, register


@register("alltoall", summary="flat dropless variable-size all-to-all to each expert's home rank (Megatron-Core)",
          options={"dedup": Option(bool, False, "send a token once per destination rank, expand there")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, dedup: bool) -> Plan:
    # only home slots are used: replicas (if any) are ignored by this strategy
    sr, se, slot_of = home_slots(ctx.placement)
    return plan_from_slots(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr),
                           home_entry_slots(slot_of, routing.topk_ids_TK), dedup=dedup, token_padding=ctx.token_padding, perf=ctx.perf)
