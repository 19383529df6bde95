"""Why DeepEP's EP16 internode rows are missed: the sourced mechanisms, checked at the published rates.

Used by ``benchmarks/fidelity_gpu.py`` (section "DeepEP EP16 internode" of docs/results/fidelity_gpu.md).
Every figure is computed from the same plans as the fidelity rows: ``normal_plan(ep)`` gives the
``deepep`` plan of the row's setup, ``published`` the published GB/s of the EP8 / EP16 dispatch rows.
"""

from __future__ import annotations

import numpy as np

H = 7168

# -- why DeepEP's EP16 internode row is missed: the sourced mechanisms checked ----------------------
# DeepEP V1 ("legacy") normal kernels, deepseek-ai/DeepEP csrc/kernels/intranode.cu and internode.cu:
# both kernels run ``num_sms / 2`` channels, one SM pair each (intranode: even SMs send, odd SMs
# receive; internode: even SMs are the NVLink forwarders, odd SMs the RDMA senders and NVLink
# receivers). The intranode kernel has 768 threads = 24 warps per SM, split over the 8 ranks (3 warps
# per peer); an internode forwarder SM has one warp per NVLink peer (its own GPU included) plus a
# coordinator; an internode receiver SM one warp per source forwarder.
INTRANODE_WARPS_PER_SM = 24
INTRANODE_WARPS_PER_PEER = 3
FORWARDER_WARPS_PER_PEER = 1
# deep_ep/buffer.py Buffer.get_dispatch_config(16): Config(num_sms, 36, 288, 20, 128) =
# NVLink chunk / NVLink buffer / RDMA chunk / RDMA buffer, in tokens per channel and peer; the chunks
# (and get_combine_config's) are the simulator's deepep-v1 chunk table (moonep_sim.plan.kernel.V1_CHUNKS)
DEEPEP_EP16_NVL_BUFFER_TOKENS = 288
DEEPEP_EP16_RDMA_BUFFER_TOKENS = 128
# Bytes each row carries beyond the counted row (hidden + FP8 scales, or 2H), from the source, top-8:
# intranode.cu writes per received row src_idx (int32), topk_idx (int64 x K) and topk_weights (float x K)
# into their own channel buffers; internode.cu's get_num_bytes_per_token packs SourceMeta (8 B), topk_idx
# (int32 x K) and topk_weights (float x K) with the row, aligned to 16 B; its combine row carries
# SourceMeta + topk_weights (intranode's combine: src_idx + topk_weights).
TOPK = 8
INTRA_DISPATCH_META = 4 + 8 * TOPK + 4 * TOPK
INTER_DISPATCH_META = 8 + 4 * TOPK + 4 * TOPK
INTRA_COMBINE_META = 4 + 4 * TOPK
INTER_COMBINE_META = 8 + 4 * TOPK


def _align16(n: float) -> float:
    return float(-(-int(n) // 16) * 16)


def _last_hop_RR(plan) -> np.ndarray:
    """int64 [R, R]: rows the last hop moves from each (relay) rank to each rank (diagonal: own)."""
    R = plan.ranks
    h = plan.hops[-1]
    return np.bincount(h.src_rank_M * R + h.dst_rank_M, minlength=R * R).reshape(R, R)


def relay_diagnostic(topos: dict, normal_plan, published: dict) -> dict:
    """The EP16 miss: what the busiest ports and copy roles carry at the *published* EP8 and EP16
    rates, against each limit DeepEP's source suggests (computed from the same plans as the rows;
    time = counted bytes / published rate, less the kernel's fixed cost)."""
    h800, b200 = topos["h800-cx7"], topos["b200"]
    row = H * (1 + 4 / 128)
    fixed = h800.kernel_dispatch_fixed_us
    p8, p16 = normal_plan(8), normal_plan(16)
    c8, c16 = _last_hop_RR(p8), _last_hop_RR(p16)
    own8, own16 = np.diag(c8), np.diag(c16)
    recv8_R = c8.sum(axis=0)                            # rows each rank holds, its own included
    pub8, pub16 = float(published["normal-ep8-dispatch"]), float(published["normal-ep16-dispatch"])
    t8 = float(recv8_R.mean()) * row / (pub8 * 1e3) - fixed  # us of copying at the published rate
    pairs16 = p16.hops[0].src_rank_M.size / 16               # counted (token, node) pairs per rank
    t16 = pairs16 * row / (pub16 * 1e3) - fixed
    rate = lambda rows, t: float(rows) * row / t / 1e3  # GB/s  # noqa: E731
    nv8, all8 = rate((recv8_R - own8).max(), t8), rate(recv8_R.max(), t8)
    fwd16, fwdall16 = rate((c16.sum(axis=1) - own16).max(), t16), rate(c16.sum(axis=1).max(), t16)
    link = h800.nvlink_bytes_per_us / 1e3
    # (a) own rows: the forwarder writes its own GPU's rows too; counted on both rows the ratio stays
    own_share8 = float(own8.sum() / c8.sum())
    own_share16 = float(own16.sum() / c16.sum())
    # (b) SM roles, at the per-SM copy rate fitted on B200 (half of a kernel's SMs copy each way)
    per_sm = 2 * b200.sm_copy_GBps
    per_warp = per_sm / INTRANODE_WARPS_PER_SM
    ch = 24 // 2
    hop0 = p16.hops[0]
    h0 = np.bincount(hop0.src_rank_M * 16 + hop0.dst_rank_M, minlength=256).reshape(16, 16)
    recv_role = rate((h0.sum(axis=1) + c16.sum(axis=0)).max(), t16)  # RDMA-sender copies + NVLink receives
    pair16 = rate(c16.max(), t16)
    pair8 = rate((c8 - np.diag(own8)).max(), t8)
    # (c) windows: bytes a channel may have in flight to one peer, over the pair's load
    rdma_pair = rate((h0 - np.diag(np.diag(h0))).max(), t16)
    lat_rdma = ch * DEEPEP_EP16_RDMA_BUFFER_TOKENS * row / (rdma_pair * 1e3)
    lat_nvl = ch * DEEPEP_EP16_NVL_BUFFER_TOKENS * row / (pair16 * 1e3)
    out = dict(
        nvlink_GBps=link, ep8_nvlink_in_GBps=nv8, ep16_forward_out_GBps=fwd16,
        forward_vs_intranode=fwd16 / nv8,
        own_share_ep8=own_share8, own_share_ep16=own_share16, ep8_all_rows_GBps=all8, ep16_all_rows_GBps=fwdall16,
        own_rows_ratio=fwdall16 / all8,
        sm_role_cap_GBps=ch * per_sm, forwarder_role_GBps=fwdall16, receiver_role_GBps=recv_role,
        per_warp_GBps=per_warp, forwarder_pair_cap_GBps=ch * FORWARDER_WARPS_PER_PEER * per_warp,
        forwarder_pair_GBps=pair16, intranode_pair_cap_GBps=ch * INTRANODE_WARPS_PER_PEER * per_warp,
        intranode_pair_GBps=pair8,
        forwarder_warp_bound_GBps=pub16 * ch * FORWARDER_WARPS_PER_PEER * per_warp / pair16,
        warp_rate_to_bind_GBps=pair16 / (ch * FORWARDER_WARPS_PER_PEER),
        rdma_pair_GBps=rdma_pair, rdma_window_bind_us=lat_rdma, nvl_window_bind_us=lat_nvl,
        nic_latency_us=h800.nic_latency_us, nvlink_latency_us=h800.nvlink_latency_us, channels=ch,
        published_ep16_dispatch=pub16, published_ep16_combine=float(published["normal-ep16-combine"]))
    # (d) chunked forwarding (the term the simulator prices): every channel's first / last chunk
    from moonep_sim.plan.kernel import V1_CHUNKS, chunk_for
    c = chunk_for(V1_CHUNKS, 16)
    out.update(chunk_dispatch_nvl=c.dispatch_nvl, chunk_dispatch_rdma=c.dispatch_rdma, chunk_combine_nvl=c.combine_nvl,
               chunk_combine_rdma=c.combine_rdma,
               chunk_dispatch_tail_us=ch * c.dispatch_nvl * row / h800.nvlink_bytes_per_us,
               chunk_combine_tail_us=ch * c.combine_rdma * 2 * H / h800.nic_bytes_per_us,
               ep16_dispatch_time_us=t16 + fixed)
    # (e) the receivers' pass over the last chunk of every channel (the deepep-v1 family's recv_copy and
    # its fused combine reduce): dispatch's NVL receivers copy it into recv_x, combine's RDMA receivers sum it
    from moonep_sim.sim.kernels import receive_copy_us, reduce_bytes_per_us
    spec = p16.kernel
    rate = reduce_bytes_per_us(h800, spec)
    c8 = chunk_for(V1_CHUNKS, 8)
    big = 1e15  # more received than one message: the message's pass is what is exposed
    out.update(recv_rate_GBps=rate / 1e3,
               recv_copy_ep16_us=float(receive_copy_us(big, ch * c.dispatch_nvl * row, rate)),
               recv_copy_ep8_us=float(receive_copy_us(big, ch * c8.dispatch_nvl * row, rate)),
               reduce_ep16_us=float(receive_copy_us(big, ch * c.combine_rdma * 2 * H, rate)),
               reduce_unchunked_us=float(receive_copy_us(big, h800.kernel_relay_message_rows * 2 * H, rate)))
    # (f) the metadata each row carries on the wire, priced by bytes at an EP8-refitted NVLink rate: both
    # EP16 rows are NVLink-bound, so their times scale by (EP16 wire / counted) / (EP8 wire / counted)
    d8 = (row + INTRA_DISPATCH_META) / row
    d16 = _align16(row + INTER_DISPATCH_META) / row
    k16 = _align16(2 * H + INTER_COMBINE_META) / (2 * H)
    out.update(meta_dispatch_ep8_bytes=row + INTRA_DISPATCH_META, meta_dispatch_ep16_bytes=_align16(row + INTER_DISPATCH_META),
               meta_combine_ep8_bytes=2 * H + INTRA_COMBINE_META, meta_combine_ep16_bytes=_align16(2 * H + INTER_COMBINE_META),
               meta_dispatch_time_factor=d16 / d8, meta_combine_time_factor=k16 / d8)
    # (g) the forwarders start only once every source's channel counts arrived (an RDMA put: one NIC
    # latency), where the model lets a relay start on its own rows (every channel's first RDMA chunk copied
    # locally at the SM rate)
    from moonep_sim.sim.kernels import relay_hop_rows, sm_cap_bytes_per_us
    local = relay_hop_rows(h800, spec, 16, "dispatch", True) * row / min(h800.mem_bytes_per_us / 2,
                                                                         sm_cap_bytes_per_us(h800, spec))
    out.update(gate_local_us=local, gate_meta_us=h800.nic_latency_us, relay_message_rows=h800.kernel_relay_message_rows)
    out.update(_chunk_effect(h800, p16, pairs16))
    return out


def _chunk_effect(topo, plan, pairs: float) -> dict:
    """EP16's counted GB/s simulated as priced (the deepep-v1 chunk table and its receive copy), without
    the chunk table (relays forwarding, receivers reducing, in the topology's messages; no receive copy),
    and (dispatch) with the chunk table but no receive copy: what terms (d) and (e) move."""
    import dataclasses

    from moonep_sim.models import get_model
    from moonep_sim.sim import SimOptions, simulate_layer

    m = get_model("deepseek-v3")
    out = {}
    k = plan.kernel
    for tag, p in (("chunked", plan), ("unchunked", dataclasses.replace(plan, kernel=dataclasses.replace(k, chunks=(), recv_copy=False))),
                   ("nocopy", dataclasses.replace(plan, kernel=dataclasses.replace(k, recv_copy=False)))):
        for what, row in (("dispatch", H * (1 + 4 / 128)), ("combine", 2 * H)):
            if tag == "nocopy" and what == "combine":  # the receive copy is dispatch's only
                continue
            t = float(np.mean(simulate_layer(p, topo, m, SimOptions(isolate=what)).per_rank["end_us"]))
            out[f"{what}_{tag}_GBps"] = pairs * row / t / 1e3
    return out


def v2_sm90_nvlink_need(plan, published_GBps: float, nvlink_GBps_per_direction: float) -> dict:
    """DeepEP V2's "SM90, CX7, EP 8 x 2" dispatch row (its README names no GPU): the NVLink each relay
    must forward to other GPUs if the row's counted (token, node) bytes took ``counted / published``
    -- under the node-deduplicated movement V2's own SM model assumes (``ElasticBuffer.
    get_theoretical_num_sms``: scale-up traffic ``1 - 1 / num_scaleup_ranks`` per token and expected
    scale-up rank) -- against H800's NVLink per direction (400 GB/s bidirectional, vendor spec)."""
    row = H * (1 + 4 / 128)
    pairs = plan.hops[0].src_rank_M.size / plan.ranks
    t_us = pairs * row / (published_GBps * 1e3)
    c = _last_hop_RR(plan)
    need = float((c.sum(axis=1) - np.diag(c)).max()) * row / t_us / 1e3
    return dict(v2_ep16_published_GBps=published_GBps, v2_ep16_relay_nvlink_need_GBps=need,
                h800_nvlink_GBps_per_direction=nvlink_GBps_per_direction)


def render_diagnostic(d: dict) -> list[str]:
    """The EP16 section of the report (every figure computed by :func:`relay_diagnostic`)."""
    f = lambda v: f"{v:.1f}"  # noqa: E731
    err = lambda v, pub: f"{100 * (v / pub - 1):+.1f}%"  # noqa: E731
    return [
        "## DeepEP EP16 internode: the miss, and the sourced mechanisms checked", "",
        "The model binds EP16 on the relays' NVLink forwarding. At the *published* rates (time = counted bytes / "
        "published GB/s, less the fixed cost) the busiest EP8 NVLink-in carries "
        f"{f(d['ep8_nvlink_in_GBps'])} GB/s and the busiest EP16 relay forwards {f(d['ep16_forward_out_GBps'])} GB/s "
        f"to other GPUs: DeepEP's forwarders reach {100 * d['forward_vs_intranode']:.1f}% of the NVLink rate its "
        f"intranode kernel reaches (the model's port: {f(d['nvlink_GBps'])} GB/s, fitted on EP8). Leads from "
        "deepseek-ai/DeepEP `csrc/kernels/internode.cu` (V1), each at the published EP16 rate:", "",
        "| mechanism (source) | load at the published rate | limit | binds? |", "| --- | --- | --- | --- |",
        f"| (a) a forwarder also writes its own GPU's rows (one warp per NVLink peer, its own included) | own rows "
        f"{100 * d['own_share_ep16']:.1f}% of EP16's forwarded rows, {100 * d['own_share_ep8']:.1f}% of EP8's "
        f"received rows (counted by DeepEP's `recv_x`) | counting them on both sides: EP16 all rows "
        f"{f(d['ep16_all_rows_GBps'])} vs EP8 {f(d['ep8_all_rows_GBps'])} GB/s, ratio {d['own_rows_ratio']:.3f} | "
        "no: the same share on both, so the refit cancels it |",
        f"| (b) SM roles: `num_sms / 2` channels; even SMs forward, odd SMs send RDMA and receive NVLink | forwarder "
        f"SMs {f(d['forwarder_role_GBps'])}, RDMA-sender + receiver SMs {f(d['receiver_role_GBps'])} GB/s | "
        f"{d['channels']} SMs x 2 x `sm_copy_GBps` (B200-fitted) = {f(d['sm_role_cap_GBps'])} GB/s | no |",
        f"| (b) warps: 1 forwarder warp per (channel, peer), intranode 3 | busiest (relay, peer) pair "
        f"{f(d['forwarder_pair_GBps'])} GB/s (intranode pair {f(d['intranode_pair_GBps'])}) | {d['channels']} x 1 x "
        f"{d['per_warp_GBps']:.2f} GB/s per warp (B200 per-SM rate / 24 warps) = {f(d['forwarder_pair_cap_GBps'])} "
        f"(intranode {d['channels']} x 3: {f(d['intranode_pair_cap_GBps'])}) | no: would cap EP16 at "
        f"{f(d['forwarder_warp_bound_GBps'])} GB/s, above the NVLink bound; binds at the published rate only if an "
        f"H800 warp moves <= {d['warp_rate_to_bind_GBps']:.2f} GB/s (unpublished) |",
        f"| (c) windows: `get_dispatch_config(16)` buffers of {DEEPEP_EP16_RDMA_BUFFER_TOKENS} RDMA / "
        f"{DEEPEP_EP16_NVL_BUFFER_TOKENS} NVLink tokens per channel and peer (DeepEP's test also sweeps the chunk "
        f"sizes and reports the best) | busiest RDMA pair {f(d['rdma_pair_GBps'])}, NVLink pair "
        f"{f(d['forwarder_pair_GBps'])} GB/s | binds only at a round trip of {d['rdma_window_bind_us']:.0f} / "
        f"{d['nvl_window_bind_us']:.0f} us (latencies {d['nic_latency_us']:g} / {d['nvlink_latency_us']:g} us) | no |",
        f"| (d) chunked forwarding: each of the {d['channels']} channels sends in chunks "
        f"(`get_dispatch_config(16)`: {d['chunk_dispatch_nvl']} NVLink / {d['chunk_dispatch_rdma']} RDMA tokens; "
        f"`get_combine_config(16)`: {d['chunk_combine_nvl']} / {d['chunk_combine_rdma']}), so a relay holds every "
        f"channel's first chunk, and a receiver every channel's last, channels x chunk rows after the hop starts / "
        f"ends | dispatch tail {d['chunk_dispatch_tail_us']:.1f} us on NVLink (the kernel takes "
        f"{d['ep16_dispatch_time_us']:.0f} us at the published rate); combine tail "
        f"{d['chunk_combine_tail_us']:.1f} us on the NIC | the relay pipeline's fill / drain | yes, a little: priced "
        f"(the deepep-v1 family's chunk table): dispatch {f(d['dispatch_unchunked_GBps'])} -> "
        f"{f(d['dispatch_nocopy_GBps'])} GB/s (bound on the forwarding itself, not on the drain); combine with (e) "
        f"below |",
        f"| (e) the receivers' pass over every channel's last chunk: dispatch's NVL receivers (`internode.cu`; the "
        f"intranode kernel's receivers alike) poll the channel's tail, published once per send chunk, and TMA-copy "
        f"the arrived tokens into `recv_x`; combine's RDMA receivers sum each arrived chunk into `combined_x`; so the "
        f"last chunk of every channel is copied / summed after it arrived | dispatch: {d['channels']} x "
        f"{d['chunk_dispatch_nvl']} rows read and written, {d['recv_copy_ep16_us']:.1f} us at the kernel's SM rate "
        f"({f(d['recv_rate_GBps'])} GB/s; EP8: {d['channels']} x 6 rows, {d['recv_copy_ep8_us']:.1f} us, absorbed by "
        f"the EP8 fit); combine: the last RDMA chunks, {d['channels']} x {d['chunk_combine_rdma']} rows, "
        f"{d['reduce_ep16_us']:.1f} us (priced before at the topology's {d['relay_message_rows']}-row message: "
        f"{d['reduce_unchunked_us']:.1f} us) | the kernel's drain | yes: priced (the deepep-v1 family's "
        f"`recv_copy` and its chunked fused reduce): dispatch {f(d['dispatch_nocopy_GBps'])} -> "
        f"{f(d['dispatch_chunked_GBps'])} GB/s; combine, (d) and (e) together, {f(d['combine_unchunked_GBps'])} -> "
        f"{f(d['combine_chunked_GBps'])} |",
        f"| (f) metadata on the wire: `intranode.cu` writes each row's `src_idx`, `topk_idx` (int64) and "
        f"`topk_weights` into channel buffers of their own ({d['meta_dispatch_ep8_bytes']:.0f} B per FP8 row, "
        f"{d['meta_combine_ep8_bytes']:.0f} per BF16 combine row); `internode.cu`'s `get_num_bytes_per_token` packs "
        f"`SourceMeta`, `topk_idx` (int32) and `topk_weights` with the row ({d['meta_dispatch_ep16_bytes']:.0f} / "
        f"{d['meta_combine_ep16_bytes']:.0f} B) | EP16's wire bytes per counted byte over those of the fitted EP8 "
        f"dispatch row (whose fit absorbs its own): dispatch x {d['meta_dispatch_time_factor']:.4f}, combine x "
        f"{d['meta_combine_time_factor']:.4f} | priced by bytes alone (both rows NVLink-bound: time x that factor): EP16 dispatch "
        f"{f(d['dispatch_chunked_GBps'] / d['meta_dispatch_time_factor'])} GB/s "
        f"({err(d['dispatch_chunked_GBps'] / d['meta_dispatch_time_factor'], d['published_ep16_dispatch'])}), "
        f"combine {f(d['combine_chunked_GBps'] / d['meta_combine_time_factor'])} "
        f"({err(d['combine_chunked_GBps'] / d['meta_combine_time_factor'], d['published_ep16_combine'])}) | not "
        f"priced (below) |",
        f"| (g) start gate: a forwarder forwards nothing before the channel counts of every source RDMA rank "
        f"arrived (an RDMA put at the kernel's start) | the relay's own rows are ready after "
        f"{d['gate_local_us']:.1f} us (every channel's first RDMA chunk copied at the SM rate: the model's head "
        f"start) | the counts after one NIC latency, {d['gate_meta_us']:g} us (assumed) | no: "
        f"{max(d['gate_meta_us'] - d['gate_local_us'], 0.0):.1f} us of a {d['ep16_dispatch_time_us']:.0f} us kernel; "
        f"not priced (a relay's start on its first message is the engine's) |",
        "",
        f"(d) and (e) bind and are priced: EP16 is predicted at {f(d['dispatch_chunked_GBps'])} / "
        f"{f(d['combine_chunked_GBps'])} GB/s ({err(d['dispatch_chunked_GBps'], d['published_ep16_dispatch'])} / "
        f"{err(d['combine_chunked_GBps'], d['published_ep16_combine'])}), from the chunk sizes of DeepEP's "
        "configs, its channel count and the SM rate fitted on B200, nothing fitted on an EP16 row. (f) is checked "
        "and not priced: the model moves DeepEP's *counted* row in every strategy's row costs, and the NVLink rate "
        "fitted on the EP8 row absorbs that kernel's metadata; pricing it needs each kernel's wire row and the "
        "NVLink cost of the intranode kernel's small per-row stores (4-64 B each), which no vendor specification "
        "gives. Priced by bytes alone it would move the EP16 combine over the 10% target: the combine's pass "
        "rests on leaving (f) out. The rest of the miss (the forwarders reach "
        f"{100 * d['forward_vs_intranode']:.1f}% of the intranode NVLink rate) "
        "is a forwarding cost with no "
        "published H800 constant (the forwarder copies each row with one warp per (channel, peer), one row in flight "
        "per warp -- a TMA load, wait for it, a TMA store, wait for it to leave shared memory -- and scans every row "
        "of the channel for its peer bit: the missing constant is an H800 warp's time per forwarded row, which "
        f"binds at <= {d['warp_rate_to_bind_GBps']:.2f} GB/s per warp (row (b)) and which only an H800 measurement "
        "could size; fitting it on this row would make the row a fit, not a check). Provenance: EP16's 43 / 43 GB/s "
        "is the README table of "
        "2025-02; PR #130 (2025-04-22: IBGDA instead of IBRC, a QP per channel) re-listed EP32 (44 -> 58, 47 -> 57) "
        "and EP64 (46 -> 51, 45 -> 50) only. At EP16 the NIC carries "
        f"{f(d['rdma_pair_GBps'])} GB/s at the published rate (half the counted pairs are the local node's), so a "
        "transport change is not expected to move EP16: the miss is the model's, not the row's age. The EP16 combine "
        "(the same rows in reverse, bound on the relays' NVLink-in) misses for the same reason.", ""] + ([
        "DeepEP V2's SM90 rows ('SM90, CX7, EP 8 x 2 / 8 x 4'; no GPU named) are run on `h100-cx7` (assumed): at "
        f"the published {d['v2_ep16_published_GBps']:g} GB/s the busiest EP 8x2 relay would forward "
        f"{f(d['v2_ep16_relay_nvlink_need_GBps'])} GB/s over NVLink to other GPUs, more than H800's "
        f"{d['h800_nvlink_GBps_per_direction']:g} GB/s per direction, so the rows cannot be an H800's under the "
        "node-deduplicated movement V2's own SM model assumes; on an SM90 with full NVLink they are NIC-bound.", ""]
        if "v2_ep16_relay_nvlink_need_GBps" in d else [])
