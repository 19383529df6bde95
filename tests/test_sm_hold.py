"""Communication kernels hold their SMs as the libraries run them: a family that frees its SMs
while data is in flight (DeepEP's low-latency kernels in hook mode) slows overlapping compute only
in its SM phases, so two-batch overlap never makes a decode step slower than running its two
micro-batches one after the other; the timeline explains the gain op by op."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep_sim.plan.kernel import FAMILIES
from moonep_sim.sim.topology import load_topology
from moonep_sim.step import StepConfig, simulate_step, step_shape
from moonep_sim.step.layer_work import split_micro_batches
from moonep_sim.step.schedule import Timeline, overlap_by_op
from tests.test_step import SMALL, _ctx, _routing


def test_families_declare_whether_they_hold_their_sms():
    for f in FAMILIES.values():
        # mori's low-latency kernel sends, forwards and receives in one launch, with no receive hook
        assert f.holds == (f.mode == "normal" or f.name == "mori-ll"), f.name
        if not f.holds or f.mode == "ll":
            assert f.sources["holds_sms"].startswith(("sourced", "assumed")), f.name
    assert FAMILIES["deepep-v1-ll"].sources["holds_sms"].startswith("sourced")
    assert FAMILIES["mori-ll"].sources["holds_sms"].startswith("sourced") and FAMILIES["mori-ll"].sms == 64


def test_held_phases_slow_compute_only_at_the_ends_of_a_collective():
    tl = Timeline(1)
    tl.comm("dispatch", np.array([100.0]), 0, "forward", 1.0, held=(np.array([10.0]), np.array([5.0])))
    e = tl.compute("attn", 50.0, 0, "forward")
    # compute starts at 0 but the SMs are held for the first 10 us: it ends at 60
    assert e[0] == pytest.approx(60.0)
    e2 = tl.compute("expert", 40.0, 0, "forward")      # 60 -> 95, then held 95..100, then 5 more
    assert e2[0] == pytest.approx(105.0)
    assert tl.events[0].sm_held_R[0] == pytest.approx(15.0)
    assert tl.events[2].slowed_R[0] == pytest.approx(5.0)
    # a family that holds its SMs: nothing progresses under the whole collective
    tl = Timeline(1)
    tl.comm("dispatch", np.array([100.0]), 0, "forward", 1.0)
    assert tl.compute("attn", 50.0, 0, "forward")[0] == pytest.approx(150.0)
    ops = {o["op"]: o for o in overlap_by_op(tl, 0)}
    assert ops["dispatch"]["hidden_us"] == pytest.approx(0.0) and ops["attn"]["sm_us"] == pytest.approx(100.0)


def _decode(overlap, routing, tokens, topo, costs=None):
    cfg = StepConfig(SMALL, topo, _ctx(SMALL, topo), (("deepep-ll", {}),), step_shape(SMALL, "decode", tokens, 1024),
                     overlap, costs)
    return simulate_step(cfg, lambda i: (0, routing, "layer"))["strategies"]["deepep-ll"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.sampled_from([16, 32, 64, 128]), maxvio=st.floats(1.0, 3.0), seed=st.integers(0, 50),
       topo=st.sampled_from(["h800-cx7", "h20"]))
def test_two_batch_low_latency_decode_is_never_slower_than_its_micro_batches_in_series(tokens, maxvio, seed, topo):
    t = load_topology(topo)
    r = _routing(SMALL, tokens, maxvio=maxvio, seed=seed)
    two = _decode("two-batch", r, tokens, t)
    serial = sum(_decode("none", part, tokens // 2, t)["step_time_us"] for part in split_micro_batches(r, 2))
    assert two["step_time_us"] <= serial * (1 + 1e-9)
    ops = {(o["stream"], o["op"]): o for o in two["overlap_by_op"]}
    # the explanation adds up: every comm op's SM phases are what the compute ops lost to them
    held = sum(o["sm_us"] for o in two["overlap_by_op"] if o["stream"] == "comm")
    lost = sum(o["sm_us"] for o in two["overlap_by_op"] if o["stream"] == "compute")
    assert lost <= held + 1e-6
    assert ops[("comm", "dispatch")]["sm_us"] < ops[("comm", "dispatch")]["us"]  # free while in flight


def test_deepep_v1_on_efa_is_flagged_not_native_and_the_proxy_families_are_native_there():
    from moonep_sim.analysis.flags import native_flags
    from moonep_sim.plan.kernel import (NVSHMEM_EFA_OPS_PER_CHUNK, NVSHMEM_PROXY_THREADS, PROXY_OP_US,
                                        UCCL_EFA_OPS_PER_CHUNK, UCCL_PROXY_THREADS)

    got = native_flags({"deepep": {}, "deepep-ll": {}, "alltoall": {}}, "h100-efa")
    assert {(f["code"], f["strategy"]) for f in got} == {("kernel-not-native", "deepep"),
                                                          ("kernel-not-native", "deepep-ll")}
    codes = lambda fl: {(f["code"], f["strategy"]) for f in fl}
    assert codes(native_flags({"deepep": {"impl": "uccl-ep"}, "deepep-ll": {"impl": "uccl-ep-ll"}}, "h100-efa")) == \
        {("host-proxy", "deepep"), ("host-proxy", "deepep-ll")}     # native, and the proxy named
    got = native_flags({"deepep": {"impl": "deepep-nvshmem-efa"}}, "h100-efa")
    assert codes(got) == {("host-proxy", "deepep")} and "4.05 us of proxy time per relayed message" in got[0]["text"]
    # the order of development row 2 comes from the host-proxy terms fitted on it: both flags name them so
    for impl in ("deepep-nvshmem-efa", "uccl-ep"):
        text = native_flags({"deepep": {"impl": impl}}, "h100-efa")[0]["text"]
        fam = FAMILIES[impl]
        assert fam.proxy_GBps > 0
        assert "host-proxy per-call cost and throughput, FITTED on development row 2" in text
        assert f"{fam.proxy_call_us:g} us per dispatch or combine call" in text and "FITTED on that row" in text
        assert fam.sources["proxy_call_us"].startswith("FITTED on ANCHORS development row 2")
    got = native_flags({"deepep": {"impl": "uccl-ep"}}, "h100-efa")
    assert "each post on one NIC" in got[0]["text"]
    # pplx is priced GPU-initiated (IBGDA); on EFA it would run through NVSHMEM's host proxy
    assert codes(native_flags({"deepep-ll": {"impl": "pplx"}}, "h100-efa")) == {("kernel-not-native", "deepep-ll")}
    assert native_flags({"deepep-ll": {"impl": "pplx"}}, "h800-cx7") == []
    assert codes(native_flags({"deepep": {"impl": "deepep-nvshmem-efa"}}, "h800-cx7")) == \
        {("kernel-not-native", "deepep"), ("host-proxy", "deepep")}
    assert native_flags({"deepep": {}}, "h800-cx7") == [] and native_flags({"deepep": {}}, "my.toml") == []
    # a host proxy's cost per relayed message (chunk) is its proxied operations' time shared by its threads
    assert FAMILIES["uccl-ep"].message_us == pytest.approx(PROXY_OP_US * UCCL_EFA_OPS_PER_CHUNK / UCCL_PROXY_THREADS)
    assert FAMILIES["deepep-nvshmem-efa"].message_us == pytest.approx(
        PROXY_OP_US * NVSHMEM_EFA_OPS_PER_CHUNK / NVSHMEM_PROXY_THREADS)
    assert FAMILIES["uccl-ep-ll"].message_us == pytest.approx(PROXY_OP_US / UCCL_PROXY_THREADS)


def test_a_proxy_family_pays_its_proxied_operations_per_channel_chunk_of_each_node_pair():
    """Hand count: 24 SMs = 12 channels; 1000 rows from rank 0 to rank 8 (the other node) at EP16
    go 84 (83.3 rounded up) per channel, in ceil(84 / 20) = 5 dispatch chunks (RDMA send chunk 20
    at EP16) and ceil(84 / 12) = 7 combine chunks: 60 and 84 chunks, each message_us; the
    same-node pair pays nothing."""
    from moonep_sim.plan.kernel import family_spec
    from moonep_sim.sim.program import _row_messages_scale

    topo = load_topology("h100-efa")
    spec = family_spec(FAMILIES["deepep-nvshmem-efa"], relay=True, sms=FAMILIES["deepep-nvshmem-efa"].sms)
    ph, plan = _two_rows_of_1000(spec)
    byts = ph.bytes_RR
    per_msg = topo.nic_message_us + spec.message_us
    for direction, chunks in (("dispatch", 12 * 5), ("combine", 12 * 7)):
        sc = _row_messages_scale(ph, plan, topo, direction)
        extra_us = (sc[0, 8] - 1.0) * byts[0, 8] / topo.nic_bytes_per_us
        assert extra_us == pytest.approx(chunks * per_msg)
        assert sc[0, 1] == 1.0


def test_normal_kernels_pay_the_host_wait_of_their_count_exchange_once_per_forward_dispatch():
    from moonep_sim.plan.kernel import HOST_WAIT_US

    t = load_topology("h800-cx7")
    r = _routing(SMALL, 32, seed=3)
    cfg = StepConfig(SMALL, t, _ctx(SMALL, t), (("deepep", {}), ("deepep-ll", {})),
                     step_shape(SMALL, "decode", 32, 1024), "none")
    out = simulate_step(cfg, lambda i: (0, r, "layer"))
    ops = {o["op"]: o for o in out["strategies"]["deepep"]["overlap_by_op"]}
    assert ops["host_wait"]["count"] == SMALL.moe_layers
    assert ops["host_wait"]["us"] == pytest.approx(HOST_WAIT_US * SMALL.moe_layers)
    assert "host_wait" not in {o["op"] for o in out["strategies"]["deepep-ll"]["overlap_by_op"]}


def _deepseek_decode(overlap, routing, ranks, tokens, topo):
    """DeepSeek-V3's MoE layers (2 of them, no dense layer or head: the layers two-batch overlap
    changes), FP8 weights and GEMMs as DeepSeek's decode runs them, low-latency kernels, on
    ``ranks`` ranks of 8 per node."""
    import dataclasses

    from moonep_sim.models import get_model
    from moonep_sim.plan import ClusterShape, Placement, RowCosts
    from moonep_sim.step.costs import step_cost_model
    from moonep_sim.step.dtypes import get_dtype
    from moonep_sim.strategies import PlanContext

    m = dataclasses.replace(get_model("deepseek-v3"), layers=2, moe_layers=2, vocab=0)
    ctx = PlanContext(ClusterShape(ranks, 8), Placement.home_groups(m.num_experts, ranks), RowCosts.from_model(m, "fp8"),
                      1, topo)
    costs = step_cost_model(topo, "fp8", mode="decode", weight_bytes=get_dtype("fp8").weight_bytes)
    cfg = StepConfig(m, topo, ctx, (("deepep-ll", {}),), step_shape(m, "decode", tokens, 4096), overlap, costs)
    return simulate_step(cfg, lambda i: (0, routing, "layer"))["strategies"]["deepep-ll"]


def _deepseek_routing(ranks, tokens, seed, maxvio):
    from moonep_sim.plan import GlobalRouting
    from moonep_sim.routing import generate_layer

    lr = generate_layer(256, 8, tokens * ranks, seed, maxvio=maxvio)
    return GlobalRouting.split_evenly(lr.topk_ids_TK, lr.topk_weights_TK, 256, ranks)


def _by_op(res):
    return {(o["stream"], o["op"]): o for o in res["overlap_by_op"]}


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([(32, 256), (64, 128), (64, 256)]), seed=st.integers(0, 50), maxvio=st.floats(1.0, 2.0))
def test_two_batch_low_latency_decode_is_never_slower_than_no_overlap_where_it_holds(shape, seed, maxvio):
    """Two-batch overlap with DeepEP's low-latency kernels (hook mode: the SMs free while the RDMA
    is in flight) is never slower than the unsplit batch on the same routing, in the regime
    DeepSeek's decode runs in: wide EP, FP8 weights, micro-batches of 64-128 tokens (DeepSeek's
    decode splits 128 requests per GPU in two of 64) -- here EP64 at 128 or 256 tokens per rank (4
    experts per rank) and EP32 at 256 (8 per rank). With the measured GEMM tables EP32 at 128 holds
    too (17-20% faster); on the fitted roofline (no tables) it is 2-4% slower there, the roofline
    pricing a 64-row GEMM by its assumed efficiency curve. There the communication one micro-batch
    hides behind the other's compute is larger than what the split adds: every weight read once more per micro-batch (a weight-bound GEMM costs the
    same at half the rows) and each micro-batch's own kernel SM phases (send issue, receive copy).

    Where it cannot hold (tested below): few tokens per rank (16 at EP32-128, 32 below EP128:
    micro-batches of 8-16) or few ranks (EP16 at 64 tokens: 16 experts per rank, 704 MB of FP8
    expert weights per layer re-read per micro-batch). The split's added weight reads and SM phases
    grow with the weights and the calls, the communication to hide with the tokens; below the crossover no schedule of the two
    micro-batches hides enough (``docs/results/two-batch-decode.md``). SGLang splits every decode
    batch of two or more sequences regardless (``compute_split_seq_index``), so a user there pays it.

    The gain is explained per op: a step is its compute (the per-op rows of ``overlap_by_op``) plus
    its exposed communication, so the gain is the exposed time two-batch removes (its comm rows'
    ``hidden_us``) less the compute it adds (per op: the re-read weights, the SM phases lost)."""
    ranks, tokens = shape
    t = load_topology("h800-cx7")
    r = _deepseek_routing(ranks, tokens, seed, maxvio)
    none = _deepseek_decode("none", r, ranks, tokens, t)
    two = _deepseek_decode("two-batch", r, ranks, tokens, t)
    assert two["step_time_us"] <= none["step_time_us"]
    for res in (none, two):
        per_op = sum(o["us"] for o in res["overlap_by_op"] if o["stream"] == "compute")
        assert per_op == pytest.approx(res["compute_us"], rel=1e-9)
        assert res["step_time_us"] == pytest.approx(res["compute_us"] + res["exposed_comm_us"], rel=1e-9)
    added = two["compute_us"] - none["compute_us"]
    removed = none["exposed_comm_us"] - two["exposed_comm_us"]
    assert none["step_time_us"] - two["step_time_us"] == pytest.approx(removed - added, rel=1e-9, abs=1e-6)
    assert sum(o["hidden_us"] for o in two["overlap_by_op"] if o["stream"] == "comm") > 0
    assert all(o["hidden_us"] == 0.0 for o in none["overlap_by_op"])     # nothing hidden without overlap


def test_where_two_batch_decode_cannot_beat_no_overlap():
    """At 16 tokens per rank (micro-batches of 8) on EP32, two-batch is slower than the unsplit batch,
    and the per-op timeline says why: the compute the split adds (each micro-batch reads every
    expert's, projection's and shared expert's weights again -- the GEMMs are weight-bound at a few
    rows -- and the low-latency kernels' SM phases run once per micro-batch) exceeds the
    communication it hides (a few rows per rank in flight)."""
    t = load_topology("h800-cx7")
    r = _deepseek_routing(32, 16, 0, 1.5)
    none, two = _deepseek_decode("none", r, 32, 16, t), _deepseek_decode("two-batch", r, 32, 16, t)
    assert two["step_time_us"] > none["step_time_us"]
    n, w = _by_op(none), _by_op(two)
    added = sum(w[k]["us"] - n[k]["us"] for k in w if k[0] == "compute")
    removed = none["exposed_comm_us"] - two["exposed_comm_us"]
    assert added > removed > 0
    assert w[("compute", "expert")]["us"] > 1.5 * n[("compute", "expert")]["us"]    # the expert weights read twice


def test_uccl_proxies_bind_one_nic_each_so_ten_channels_load_four_nics_three_three_two_two():
    """UCCL-EP deals channel c to proxy thread c mod 4, which posts on NIC t mod N (N = the GPU's
    NICs): h100-efa (4 NICs per GPU) at its 20 SMs = 10 channels carries 3, 3, 2, 2 channels' bytes,
    so the GPU reaches 2.5 / 3 of its NIC rate; 24 SMs (12 channels) and 18 SMs (9 channels: 3, 2, 2,
    2 -> 2.25 / 3) by hand; h200-efa's 2 NICs per GPU take 5 and 5 channels (balanced); a family
    without bound proxies spreads over every NIC."""
    from dataclasses import replace

    from moonep_sim.plan.kernel import UCCL_SMS, family_spec
    from moonep_sim.sim.kernels import proxy_nic_share

    p5, p5en = load_topology("h100-efa"), load_topology("h200-efa")
    spec = family_spec(FAMILIES["uccl-ep"], relay=True, sms=FAMILIES["uccl-ep"].sms)
    assert UCCL_SMS == 20 and spec.proxy_nic_threads == 4
    assert proxy_nic_share(p5, spec) == pytest.approx(2.5 / 3)
    assert proxy_nic_share(p5, replace(spec, sms=24)) == 1.0
    assert proxy_nic_share(p5, replace(spec, sms=18)) == pytest.approx(2.25 / 3)
    assert proxy_nic_share(p5en, spec) == 1.0
    nv = family_spec(FAMILIES["deepep-nvshmem-efa"], relay=True, sms=24)
    assert proxy_nic_share(p5, nv) == 1.0 and proxy_nic_share(p5, None) == 1.0


def test_uccl_pays_its_chunks_and_its_busiest_nic_on_inter_node_pairs_only():
    """Hand count (h100-efa, EP16): 10 channels; 1000 rows of 4096 bytes from rank 0 to rank 8 (the
    other node) go ceil(1000 / 10) = 100 per channel, in ceil(100 / 20) = 5 dispatch chunks (UCCL's
    RDMA send chunk at EP16) and ceil(100 / 12) = 9 combine chunks: 50 and 90 chunks, each
    message_us + the NIC's message cost, on top of the bytes stretched by 3 / 2.5 (the busiest NIC);
    the same-node pair pays nothing."""
    from moonep_sim.plan.kernel import PROXY_OP_US, UCCL_EFA_OPS_PER_CHUNK, UCCL_PROXY_THREADS, family_spec
    from moonep_sim.sim.program import _row_messages_scale

    topo = load_topology("h100-efa")
    spec = family_spec(FAMILIES["uccl-ep"], relay=True, sms=FAMILIES["uccl-ep"].sms)
    assert spec.message_us == pytest.approx(0.45 * 6 / 4) and (PROXY_OP_US, UCCL_EFA_OPS_PER_CHUNK,
                                                                UCCL_PROXY_THREADS) == (0.45, 6, 4)
    ph, plan = _two_rows_of_1000(spec)
    byts = ph.bytes_RR
    per_msg = topo.nic_message_us + spec.message_us
    for direction, chunks in (("dispatch", 10 * 5), ("combine", 10 * 9)):
        sc = _row_messages_scale(ph, plan, topo, direction)
        extra_us = (sc[0, 8] - 3 / 2.5) * byts[0, 8] / topo.nic_bytes_per_us
        assert extra_us == pytest.approx(chunks * per_msg)
        assert sc[0, 1] == 1.0


def test_a_broadcast_hop_carries_the_token_owners_tokens_on_every_cross_node_pair():
    """mori's InterNodeV1LL puts every token to every other node's relay: hand count on 2 nodes of
    8, 100 tokens per rank; rank 0 needs 40 rows at rank 8 (its relay on the other node), so that
    pair carries 100 rows: 2.5x its bytes; rank 1's 100 rows there need no stretch; the same-node
    and empty pairs pay nothing. In combine the rows go back to their owner (the receiver)."""
    from types import SimpleNamespace

    from moonep_sim.plan import CommPhase
    from moonep_sim.plan.kernel import family_spec
    from moonep_sim.plan.kinds import Direction, PhaseKind, Scope
    from moonep_sim.sim.program import broadcast_scale

    topo = load_topology("mi300x-cx7")
    R = 16
    spec = family_spec(FAMILIES["mori-ll"], relay=True, sms=64)
    assert spec.broadcast and FAMILIES["mori-ll"].node_relay
    plan = SimpleNamespace(kernel=spec, ranks=R, tokens_per_rank_R=np.full(R, 100))
    msgs = np.zeros((R, R), np.int64)
    msgs[0, 8], msgs[1, 9], msgs[0, 1] = 40, 100, 7
    ph = CommPhase("dispatch.0", PhaseKind.DISPATCH, Direction.FORWARD, Scope.INTER_NODE, msgs * 1000, msgs)
    sc = broadcast_scale(ph, plan, topo, "dispatch")
    assert sc[0, 8] == pytest.approx(2.5) and sc[1, 9] == 1.0 and sc[0, 1] == 1.0 and sc[2, 10] == 1.0
    back = CommPhase("combine.0", PhaseKind.COMBINE, Direction.FORWARD, Scope.INTER_NODE, msgs.T * 1000, msgs.T)
    assert broadcast_scale(back, replace_tokens(plan, 0, 60), topo, "combine")[8, 0] == pytest.approx(60 / 40)
    assert broadcast_scale(ph, SimpleNamespace(kernel=family_spec(FAMILIES["deepep-v1"]), ranks=R), topo) is None


def replace_tokens(plan, rank: int, tokens: int):
    """``plan`` (a namespace) with ``rank``'s token count set to ``tokens``."""
    from types import SimpleNamespace

    t = np.array(plan.tokens_per_rank_R)
    t[rank] = tokens
    return SimpleNamespace(kernel=plan.kernel, ranks=plan.ranks, tokens_per_rank_R=t)


def test_mori_low_latency_relays_through_one_gpu_per_node_and_sends_at_most_its_tokens_per_other_node():
    """``deepep-ll impl=mori-ll`` builds the node-relayed two-hop plan (hop 0 to the same-index GPU of
    each node, hop 1 within it), one kernel that relays; a rank's hop-0 rows to other nodes are at
    most its tokens x (nodes - 1), the broadcast's count; DeepEP's low-latency plan stays one hop."""
    from moonep_sim.models import get_model
    from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
    from moonep_sim.strategies import PlanContext, make_plan

    R, T, E, K = 32, 64, 256, 8
    rng = np.random.default_rng(1)
    ids = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int64)
    routing = GlobalRouting.split_evenly(ids, np.full(ids.shape, 1 / K, np.float32), E, R)
    ctx = PlanContext(ClusterShape(R, 8), Placement.home_groups(E, R), RowCosts.from_model(get_model("deepseek-v3"), "bf16"), 1)
    mori = make_plan("deepep-ll", routing, ctx, impl="mori-ll")
    assert len(mori.hops) == 2 and mori.kernel.relay and mori.kernel.broadcast and mori.kernel.holds_sms
    h0 = mori.hops[0]
    cross = (h0.src_rank_M // 8) != (h0.dst_rank_M // 8)
    assert np.all(np.bincount(h0.src_rank_M[cross], minlength=R) <= T * (R // 8 - 1))
    assert len(make_plan("deepep-ll", routing, ctx).hops) == 1


def _two_rows_of_1000(spec):
    """An inter-node dispatch phase of 16 ranks in which rank 0 sends 1000 rows of 4 KiB to rank 8
    (the other node) and 1000 to rank 1 (its own node), and a plan stand-in carrying ``spec``."""
    from types import SimpleNamespace

    from moonep_sim.plan.ir import CommPhase
    from moonep_sim.plan.kinds import Direction, PhaseKind, Scope

    R = 16
    msgs, byts = np.zeros((R, R), np.int64), np.zeros((R, R), np.int64)
    msgs[0, 8], byts[0, 8] = 1000, 1000 * 4096
    msgs[0, 1], byts[0, 1] = 1000, 1000 * 4096
    ph = CommPhase("dispatch.0", PhaseKind.DISPATCH, Direction.FORWARD, Scope.INTER_NODE, byts, msgs)
    return ph, SimpleNamespace(kernel=spec, ranks=R)


def test_a_proxy_family_s_host_time_per_call_is_its_call_cost_plus_the_busiest_rank_s_inter_node_bytes():
    """Hand count (h100-efa, EP16 on 2 nodes): rank 0 sends 1000 rows of 4096 bytes to rank 8 (the
    other node) and 1000 to rank 1 (its own node): 4,096,000 inter-node bytes; at 1000 us per call
    and 2 GB/s (2000 bytes per us) the host pays 1000 + 2048 us per call; the same-node rows and the
    combine's phases are not counted; a family without the two terms costs the host nothing."""
    from dataclasses import replace
    from types import SimpleNamespace

    from moonep_sim.plan import ClusterShape
    from moonep_sim.plan.kernel import family_spec
    from moonep_sim.sim.kernels import proxy_host_us

    spec = family_spec(FAMILIES["uccl-ep"], relay=True, sms=FAMILIES["uccl-ep"].sms)
    ph, _ = _two_rows_of_1000(spec)
    comb = replace(ph, name="combine.0", kind=type(ph.kind).COMBINE)

    def plan(s):
        return SimpleNamespace(kernel=s, cluster=ClusterShape(16, 8), phases=lambda direction: [ph, comb])

    assert proxy_host_us(plan(replace(spec, proxy_call_us=1000.0, proxy_GBps=2.0))) == pytest.approx(1000.0 + 2048.0)
    assert proxy_host_us(plan(replace(spec, proxy_call_us=0.0, proxy_GBps=4.0))) == pytest.approx(1024.0)
    assert proxy_host_us(plan(replace(spec, proxy_call_us=250.0, proxy_GBps=0.0))) == pytest.approx(250.0)
    assert proxy_host_us(plan(replace(spec, proxy_call_us=0.0, proxy_GBps=0.0))) == 0.0
    assert proxy_host_us(plan(None)) == 0.0
    from moonep_sim.errors import ConfigError

    with pytest.raises(ConfigError, match="proxy_call_us"):
        replace(spec, proxy_call_us=-1.0)
