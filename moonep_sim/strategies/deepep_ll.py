"""``deepep-ll``: DeepEP's low-latency kernels (the decode regime).

Anchor: DeepEP (DeepSeek, 2025) low-latency dispatch and combine. Every (token, expert) selection
is one message straight to the expert's rank: no node deduplication, no relay, no count
exchange. Receive buffers are fixed: ``[local experts, max tokens x ranks]`` rows per rank (static
shapes, CUDA-graph friendly), of which the routing fills some. Dispatch rows are FP8 with one fp32
scale per 128 channels and a 16-byte header (``H + H/128*4 + 16`` bytes; option ``dispatch_dtype
= "bf16"``: ``2H + 16``); combine rows are BF16 (``2H``). Same-node peers go over NVLink, as the
kernels do since mid-2025 (option ``nvlink = false``: every peer over the NIC, the original
pure-RDMA kernels). The kernels use every SM and send one RDMA write per row, which the simulator
charges at the NIC (``moonep_sim.sim.kernels``). Option ``impl`` names the kernel family that
prices them (``moonep_sim.plan.kernel``: DeepEP V1 low-latency by default; NCCL EP LL, UCCL-EP LL,
NIXL EP, mori LL; ``pplx`` also changes the movement: one message per (token, destination rank);
``mori-ll`` relays through the same-index GPU of each node, as ``deepep`` does, its inter-node hop
a broadcast of every token to every other node -- ROCm/mori's InterNodeV1LL).

How DeepEP counts its bandwidth (ANCHORS): bytes per selection times the number of selections,
the local rank included, over the kernel's time (:func:`ll_counted_bytes`).
"""

from __future__ import annotations

import numpy as np

from moonep_sim.errors import require
from moonep_sim.plan import (GlobalRouting, Plan, RowCosts, Scope, Slots, home_slots, plan_from_hops, plan_from_slots,
                             to_final, to_node_of_final)
from moonep_sim.plan.kernel import FAMILIES, family, family_spec
from moonep_sim.plan.multihop import home_entry_slots
from moonep_sim.strategies import Option, PlanContext, register

HEADER_BYTES = 16  # per message: the source token index and routing metadata


def ll_row_costs(costs: RowCosts, dispatch_dtype: str = "fp8") -> RowCosts:
    """The low-latency kernels' row sizes from the context's (whose combine row is bf16 ``2H``)."""
    H = costs.combine_row_bytes // 2
    disp = (H + H // 128 * 4 if dispatch_dtype == "fp8" else 2 * H) + HEADER_BYTES
    return RowCosts(int(disp), int(costs.combine_row_bytes), costs.weight_bytes, costs.grad_bytes)


def ll_counted_bytes(plan: Plan, kind: str = "dispatch") -> int:
    """DeepEP's byte count for its low-latency bandwidth: every kept selection (local rank
    included) times the row size of ``kind``."""
    rows = int((plan.entry_rank_TK >= 0).sum())
    return rows * (plan.costs.dispatch_row_bytes if kind == "dispatch" else plan.costs.combine_row_bytes)


@register("deepep-ll",
          summary="DeepEP low-latency kernels: one message per (token, expert) straight to its rank, fixed buffers",
          options={"dispatch_dtype": Option(str, "fp8", "dispatch rows: fp8 (per-128 scales + 16-byte header) or bf16",
                                            choices=("fp8", "bf16")),
                   "max_tokens": Option(int, 0, "tokens per rank the fixed buffers hold (0 = the largest rank's count)",
                                        check=lambda v: v >= 0, constraint="must be >= 0 (0 = the largest rank's count)"),
                   "nvlink": Option(bool, True, "same-node peers over NVLink (false: every peer over the NIC)"),
                   "sms": Option(int, None, "SMs the kernels use (default: the kernel family's, -1 = all; "
                                 "0 = no SM cap)",
                                 check=lambda v: v >= -1, constraint="must be >= 1, 0 (no SM cap) or -1 (all)"),
                   "impl": Option(str, "deepep-v1-ll", "kernel family pricing the kernels "
                                  "(moonep_sim.plan.kernel.FAMILIES; pplx sends once per (token, rank))",
                                  choices=tuple(n for n, f in FAMILIES.items() if f.mode == "ll"))})
def plan(routing: GlobalRouting, ctx: PlanContext, *, dispatch_dtype: str, max_tokens: int, nvlink: bool,
         sms: int | None, impl: str) -> Plan:
    fam = family(impl, "ll")
    sms = fam.sms if sms is None else sms
    most = int(routing.tokens_per_rank_R.max()) if routing.tokens_per_rank_R.size else 0
    require(max_tokens == 0 or max_tokens >= most,
            f"max_tokens ({max_tokens}) must be >= the largest rank's token count ({most}): the buffers are fixed")
    T_max = max_tokens or most
    sr, se, slot_of = home_slots(ctx.placement)
    R = ctx.cluster.ranks
    local_E = np.bincount(sr, minlength=R)
    # fixed receive buffers: [local experts, max tokens x ranks] rows, padded segments included
    tp = max(int(ctx.token_padding), 1)
    capacity = local_E * (T_max * R + (tp - 1))
    if fam.node_relay:  # mori's InterNodeV1LL: through the same-index GPU of each node, then XGMI / NVLink
        hops = [to_node_of_final(ctx.cluster, dedup=True), to_final(Scope.INTRA_NODE, dedup=True)]
        return plan_from_hops(routing, ctx.cluster, ll_row_costs(ctx.costs, dispatch_dtype), Slots(sr, se, sr),
                              home_entry_slots(slot_of, routing.topk_ids_TK), hops, token_padding=tp,
                              capacity_R=capacity, options={"max_tokens": T_max}, perf=ctx.perf,
                              kernel=family_spec(fam, sms=sms, relay=True, nic_only=not nvlink, planned=False))
    return plan_from_slots(routing, ctx.cluster, ll_row_costs(ctx.costs, dispatch_dtype), Slots(sr, se, sr),
                           home_entry_slots(slot_of, routing.topk_ids_TK), dedup=fam.dedup_per_rank, token_padding=tp,
                           capacity_R=capacity, options={"max_tokens": T_max}, perf=ctx.perf,
                           kernel=family_spec(fam, sms=sms, row_messages=True, nic_only=not nvlink, planned=False))
