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

import numpy as np

from moonep_sim.plan import GlobalRouting, Plan, Scope, home_slots, plan_from_routes
from moonep_sim.strategies import Option, PlanContext, register


@register("hierarchical", summary="Tutel 2DH: intra-node all-to-all, then inter-node between equal local ranks",
          options={"dedup": Option(bool, False, "send a token once per receiving GPU on each hop")})
def plan(routing: GlobalRouting, ctx: PlanContext, *, dedup: bool) -> Plan:
    G = ctx.cluster.gpus_per_node
    sr, se, slot_of = home_slots(ctx.placement)
    R = ctx.cluster.ranks
    rank = np.arange(R, dtype=np.int64)
    # via[s, d]: on the source's node, at the destination's local index
    via_RR = (rank[:, None] // G) * G + rank[None, :] % G
    return plan_from_routes(routing, ctx.cluster, ctx.costs, sr, se, sr, slot_of[routing.topk_ids_TK], [via_RR],
                            (Scope.INTRA_NODE, Scope.INTER_NODE), (dedup, dedup), token_padding=ctx.token_padding,
                            via_table=True)
