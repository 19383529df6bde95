"""``hierarchical``: Tutel's 2DH two-phase all-to-all (intra-node first, then across nodes).

Anchor: Tutel (Hwang et al., 2023), "2D hierarchical all-to-all". Hop 0 stays inside a node: GPU
(node n, local i) sends to local GPU (n, j) every row bound for local index j on *any* node. Hop 1
crosses nodes only between GPUs of equal local index: (n, j) sends to (m, j) the rows bound for
node m. Messages across the network become fewer and larger (G times fewer peers per NIC), at the
price of a second pass over NVLink.

Option ``dedup``: a token crosses each hop once per receiving GPU (and is expanded at its final
GPU); without it every (token, k) entry is its own row on both hops. Experts are taken at their
home rank (replicas of a custom placement are not used).
"""

from __future__ import annotations


from moonep_sim.plan import GlobalRouting, Plan, Slots, Scope, home_slots, plan_from_hops, to_final, to_rail_of_final
from moonep_sim.plan.multihop import home_entry_slots
from moonep_sim.strategies import Option, PlanContext, register


@register("hierarchical", summary="Tutel 2DH: intra-node all-to-all, then inter-node between equal local ranks",
          options={"dedup": Option(bool, False, "send a token once per receiving GPU on each hop")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, dedup: bool) -> Plan:
    sr, se, slot_of = home_slots(ctx.placement)
    ids = routing.topk_ids_TK
    # home groups number the slots as the experts: the routing's ids are the slots (no [N] gather)
    entry_slot = home_entry_slots(slot_of, ids)
    # NVLink to the GPU of the source's node on the destination's rail, then across nodes on that rail
    hops = [to_rail_of_final(ctx.cluster, dedup=dedup), to_final(Scope.INTER_NODE, dedup=dedup)]
    return plan_from_hops(routing, ctx.cluster, ctx.costs, Slots(sr, se, sr), entry_slot, hops,
                          token_padding=ctx.token_padding, perf=ctx.perf)
