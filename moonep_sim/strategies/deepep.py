"""``deepep``: node-deduplicated two-hop dispatch (DeepEP's normal, internode kernels).

Anchor: DeepEP (DeepSeek, 2025) normal kernels with DeepSeek-V3's node-limited routing. Hop 0
crosses the network once per (token, destination *node*), to the GPU with the token's own local
index on that node (RDMA, scope ``inter_node``); hop 1 forwards over NVLink once per (token,
destination GPU) and the GPU expands the row into each of its experts (scope ``intra_node``).

The local node: DeepEP counts it in its RDMA bytes, but no byte of it crosses the network. Here the
token's hop 0 to its own node is a self copy (the diagonal of hop 0's matrix, which no link carries)
and it then travels over NVLink like the others; :func:`deepep_rdma_bytes` gives DeepEP's count
(unique (token, node) pairs, local node included) for comparison with its published bandwidths.

Option ``impl`` names the kernel family that prices the kernels (``moonep_sim.plan.kernel``:
DeepEP V1 by default; DeepEP V2, NCCL EP, UCCL-EP, mori move rows the same way here, at their own
SM budget, copy rate and per-message costs). Option ``max_nodes`` (M, 0 = no limit): a routing is given, so the planner cannot re-route it; it
checks that no token spans more than M nodes and raises otherwise. Node-limited selection itself
applies to router logits: :func:`node_limited_topk` (DeepSeek-V3's group-limited top-k with one
expert group per node) makes such a routing; ``moonep-sim plan`` uses it when the trace holds
``router_logits``. Every plan reports ``max_nodes_per_token`` and ``mean_nodes_per_token`` in its
options.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.errors import PlanError, require
from moonep_sim.plan import GlobalRouting, Plan, Slots, Scope, home_slots, plan_from_hops, to_final, to_node_of_final
from moonep_sim.plan.kernel import FAMILIES, family, family_spec
from moonep_sim.plan.multihop import home_entry_slots
from moonep_sim.plan.runs import distinct_per_token
from moonep_sim.strategies import Option, PlanContext, register

# Notation: T tokens, K top-k, E experts, R ranks, G GPUs per node, N = T*K entries.


def node_limited_topk(logits_TE: np.ndarray, top_k: int, num_nodes: int, max_nodes: int,
                      score: str = "sigmoid") -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's group-limited routing with one expert group per node.

    logits_TE: float [T, E] router logits; experts form ``num_nodes`` contiguous groups (the experts
    a node holds under home-group placement). Scores are ``sigmoid`` (DeepSeek-V3) or ``softmax``;
    a group scores the sum of its two best scores; each token keeps its ``max_nodes`` best groups
    and takes its ``top_k`` best experts there (:func:`moonep_sim.routing.router.route_group`).
    Weights are the chosen scores normalised to sum 1. Returns (topk_ids_TK int64, topk_weights_TK
    float32).
    """
    from moonep_sim.routing.router import route_group

    E = np.asarray(logits_TE).shape[-1]
    require(num_nodes >= 1 and E % num_nodes == 0,
            f"num_experts ({E}) must be divisible by nodes ({num_nodes}) for node-limited routing")
    require(1 <= max_nodes <= num_nodes, f"max_nodes ({max_nodes}) must lie in [1, {num_nodes}] (nodes)")
    r = route_group(logits_TE, top_k, num_nodes, max_nodes, score=score)
    return r.topk_ids_TK.astype(np.int64), r.topk_weights_TK


def deepep_rdma_bytes(plan: Plan) -> int:
    """DeepEP's RDMA byte count of a ``deepep`` plan: unique (token, node) pairs, local node
    included, times the dispatch row size (ANCHORS: how DeepEP counts)."""
    return int(plan.hops[0].src_rank_M.size) * plan.costs.dispatch_row_bytes


@register("deepep", summary="DeepEP normal kernels: once per destination node over RDMA, then NVLink forward",
          options={"max_nodes": Option(int, 0, "check that no token spans more than this many nodes (0 = no limit)",
                                       check=lambda v: v >= 0, constraint="must be >= 0 (0 = no limit)"),
                   "sms": Option(int, None, "SMs its kernels use (default: the kernel family's, DeepEP V1: 24; "
                                 "0 = no SM cap, -1 = all)",
                                 check=lambda v: v >= -1, constraint="must be >= 1, 0 (no SM cap) or -1 (all)"),
                   "impl": Option(str, "deepep-v1", "kernel family pricing the kernels (moonep_sim.plan.kernel.FAMILIES; "
                                  "`moonep-sim topologies` lists them)",
                                  choices=tuple(n for n, f in FAMILIES.items() if f.mode == "normal"))})
def plan(routing: GlobalRouting, ctx: PlanContext, *, max_nodes: int, sms: int | None, impl: str) -> Plan:
    fam = family(impl, "normal")
    sms = fam.sms if sms is None else sms
    cl = ctx.cluster
    sr, se, slot_of = home_slots(ctx.placement)
    ids = routing.topk_ids_TK
    # home groups number the slots as the experts: the routing's ids are the slots (no [N] gather)
    entry_slot = home_entry_slots(slot_of, ids)
    node_S = cl.node_of(sr)
    npt = distinct_per_token(entry_slot, node_S, perf=ctx.perf)
    if max_nodes and npt.size and int(npt.max()) > max_nodes:
        t = int(np.argmax(npt > max_nodes))
        raise PlanError(f"nodes of token {t} ({int(npt[t])}) must be <= max_nodes ({max_nodes}): the given "
                        "routing is not node-limited; route from logits with node_limited_topk")
    opts = {"max_nodes_per_token": int(npt.max()) if npt.size else 0,
            "mean_nodes_per_token": float(npt.mean()) if npt.size else 0.0}
    # RDMA once per (token, destination node) on the token's rail, then NVLink once per (token, GPU);
    # one kernel: the relay (same local index on the destination node) forwards rows as they arrive
    hops = [to_node_of_final(cl, dedup=True), to_final(Scope.INTRA_NODE, dedup=True)]
    return plan_from_hops(routing, cl, ctx.costs, Slots(sr, se, sr), entry_slot, hops, token_padding=ctx.token_padding,
                          options=opts, perf=ctx.perf, kernel=family_spec(fam, sms=sms, relay=True))
