"""The flow-level network: analytic cases, the water-filling against a slow reference, tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from hypothesis import assume, example, given, settings, strategies as st

from blocks_reference import BlockCountsReference, compiled_fill
from moonep_sim.sim.blocks import BlockCounts
from moonep_sim.sim.network import FlowNetwork, PortMap, waterfill
from moonep_sim.sim.ports import Block, nic_group_of
from moonep_sim.sim.topology import Topology
from ideal_topology import ideal

TOPO = ideal("t", gpus_per_node=4, nvlink_bandwidth_GBps=100.0, nvlink_latency_us=2.0, nic_bandwidth_GBps=25.0,
                nic_latency_us=5.0, fabric_latency_us=0.0, gpu_mem_bandwidth_GBps=1000.0)
NV, NIC = 100e3, 25e3  # bytes per us


def run_phases(R, phases_RR, tol=0.0, topo=TOPO):
    """Every rank sends phase i+1 once it received all of phase i. Returns (end time, net)."""
    rec, net = run_solver(R, phases_RR, topo, tol, "auto")
    return float(np.nanmax(rec["end"])), net


def test_one_flow_is_latency_plus_bytes_over_bandwidth():
    b = np.zeros((2, 2)); b[0, 1] = 1e6
    t, _ = run_phases(2, [b])
    assert t == pytest.approx(2.0 + 1e6 / NV, rel=1e-12)
    b8 = np.zeros((8, 8)); b8[0, 5] = 1e6          # other node, other rail: NIC + spine latency
    t, _ = run_phases(8, [b8])
    assert t == pytest.approx(5.0 + 1e6 / NIC, rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_n_flows_through_one_port_share_it_equally(n):
    R = 4 if n < 4 else 8
    topo = ideal("one-node", gpus_per_node=8, nvlink_bandwidth_GBps=100.0, nvlink_latency_us=2.0)
    b = np.zeros((8, 8)); b[1:n + 1, 0] = 1e6        # n senders into rank 0's NVLink-in
    env = simpy.Environment()
    net = FlowNetwork(env, PortMap.build(topo, 8), 0.0)
    pid = net.expect("p", (b > 0).sum(0))
    for s in range(8):
        net.submit(pid, s, np.arange(8), b[s], b[s])
    env.run(until=2.0 + 1e-9)
    env.run(until=3.0)
    assert np.allclose(net._a.rate[net._a.alive], NV / n)
    env.run()
    assert np.allclose(net.records()["end"], 2.0 + n * 1e6 / NV)
    assert R >= 2


def test_uniform_all_to_all_matches_closed_form():
    R, G, b = 16, 4, 3e5
    B = np.full((R, R), b)
    t, net = run_phases(R, [B])
    nv_t = 2.0 + (G - 1) * b / NV
    nic_t = 5.0 + (R - G) * b / NIC  # rails differ for most pairs; the spine never binds (no oversubscription)
    assert t == pytest.approx(max(nv_t, nic_t), rel=1e-9)
    assert net.records()["bytes"].sum() == pytest.approx(B.sum())


def test_two_phases_that_do_not_overlap_take_the_sum():
    R = 8
    A = np.full((R, R), 2e5)
    Bm = np.full((R, R), 1e5) * (1 + (np.arange(R)[None, :] == 3))  # rank 3 receives twice as much
    ta, _ = run_phases(R, [A])
    tb, _ = run_phases(R, [Bm])
    tab, _ = run_phases(R, [A, Bm])
    assert ta > 0 and tb > 0, (ta, tb)
    assert tab == pytest.approx(ta + tb, rel=1e-9)


def test_oversubscribed_spine_binds_cross_rail_traffic():
    topo = ideal("os", gpus_per_node=2, nvlink_bandwidth_GBps=100.0, nic_bandwidth_GBps=25.0,
                    nic_latency_us=0.0, fabric_latency_us=0.0, nvlink_latency_us=0.0, fabric_oversubscription=4.0)
    R = 4  # 2 nodes x 2 rails; ranks 0 -> 3 and 2 -> 1 both climb rail 0's spine-up port
    b = np.zeros((R, R)); b[0, 3] = 1e6; b[2, 1] = 1e6
    t, _ = run_phases(R, [b], topo=topo)
    spine = 2 * NIC / 4.0
    assert t == pytest.approx(1e6 / (spine / 2), rel=1e-9)
    flat = ideal("flat", **{**{k: v for k, v in topo.__dict__.items() if k not in ("name", "fabric_oversubscription")}})
    t1, _ = run_phases(R, [b], topo=flat)
    assert t1 == pytest.approx(1e6 / NIC, rel=1e-9)


def slow_waterfill(paths, cap):
    """Obviously-correct progressive filling, one flow at a time."""
    F = len(paths)
    rate = [0.0] * F
    frozen = [False] * F
    capl = list(cap)
    while not all(frozen):
        best = float("inf")
        for p in range(len(capl)):
            n = sum(1 for f in range(F) if not frozen[f] and p in paths[f])
            if n:
                best = min(best, capl[p] / n)
        for f in range(F):
            if not frozen[f]:
                rate[f] += best
                for p in paths[f]:
                    capl[p] -= best
        for p in range(len(capl)):
            if capl[p] <= 1e-9 * cap[p]:
                for f in range(F):
                    if p in paths[f]:
                        frozen[f] = True
    return np.array(rate)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(2, 6), st.integers(0, 10_000))
def test_waterfill_matches_slow_reference(F, P, seed):
    rng = np.random.default_rng(seed)
    cap = rng.uniform(1, 10, P)
    paths = [sorted(set(rng.choice(P, size=rng.integers(1, min(P, 3) + 1), replace=False).tolist())) for _ in range(F)]
    arr = np.full((F, 4), P, dtype=np.int64)
    for f, p in enumerate(paths):
        arr[f, :len(p)] = p
    rate, bneck, _ = waterfill(arr, np.concatenate([cap, [np.inf]]), 0.0)
    ref = slow_waterfill(paths, cap)
    assert np.allclose(rate, ref, rtol=1e-9)
    use = np.zeros(P)
    for f, p in enumerate(paths):
        use[p] += rate[f]
    assert (use <= cap * (1 + 1e-9)).all()               # feasible
    assert all(bneck[f] in paths[f] for f in range(F))    # every flow names a port of its own path


def test_tolerance_is_only_slower_and_close_to_exact():
    rng = np.random.default_rng(3)
    R = 32
    pop = np.exp(rng.normal(0, 0.5, R))
    B = rng.poisson(200 * pop[None, :] / pop.mean(), (R, R)) * 7168.0
    C = rng.poisson(200, (R, R)) * 7168.0
    exact, n0 = run_phases(R, [B, C], tol=0.0)
    for tol in (0.001, 0.002, 0.005):
        approx, n1 = run_phases(R, [B, C], tol=tol)
        assert exact * (1 - 1e-9) <= approx <= exact * (1 + 6 * tol)
        assert n1.ticks < n0.ticks


# -- the per-side block solver against per-flow water-filling --------------------------------
def run_solver(R, phases_RR, topo, tol, solver, nic_factor=None, stagger_us=0.0, sm_cap=np.inf, nic_only=False):
    """Every rank sends phase i+1 once it received all of phase i, with a chosen solver; rank r starts ``r * stagger_us`` late (staggered
    starts and finishes exercise the incremental counts); with ``sm_cap`` finite the first phase is
    SM-driven (its flows also cross SM ports of that capacity); with ``nic_only`` the last phase's
    flows inside a node take the NIC path. Returns (records, network)."""
    env = simpy.Environment()
    net = FlowNetwork(env, PortMap.build(topo, R, nic_factor_R=nic_factor, sm_bytes_per_us=sm_cap), tol,
                      solver=solver)
    last = len(phases_RR) - 1
    pids = [net.expect(f"p{i}", (b > 0).sum(0), sm=(i == 0), nic_only=nic_only and i == last)
            for i, b in enumerate(phases_RR)]

    def rank(r):
        if stagger_us:
            yield env.timeout(r * stagger_us)
        for pid, b in zip(pids, phases_RR):
            net.submit(pid, r, np.arange(R), b[r], b[r].astype(float))
            yield net.received(pid, r)

    for r in range(R):
        env.process(rank(r))
    env.run()
    rec = net.records()
    assert not np.isnan(rec["end"]).any()
    return rec, net


TOPOS = {
    "flat": TOPO,
    "oversubscribed": ideal("os", gpus_per_node=4, nvlink_bandwidth_GBps=100.0, nic_bandwidth_GBps=25.0,
                               nic_latency_us=5.0, fabric_latency_us=1.0, fabric_oversubscription=3.0),
    "node-links": ideal("nl", gpus_per_node=2, nvlink_bandwidth_GBps=50.0, nic_bandwidth_GBps=10.0,
                           nic_attach="node", fabric_oversubscription=2.0),
    "one-node": ideal("one", gpus_per_node=8, nvlink_bandwidth_GBps=100.0, nvlink_latency_us=2.0),
}


def random_phases(rng, R, kind):
    """Adversarial and random [R, R] byte matrices: skewed receivers, one hot sender, sparse, ties."""
    if kind == "skew":
        pop = np.exp(rng.normal(0, 1.0, R))
        return [rng.poisson(50 * pop[None, :] / pop.mean(), (R, R)) * 1000.0]
    if kind == "hot-sender":
        b = rng.poisson(5, (R, R)) * 1000.0
        b[rng.integers(R)] *= 20
        return [b, rng.poisson(5, (R, R)).T * 1000.0]
    if kind == "sparse":
        return [np.where(rng.random((R, R)) < 0.2, rng.integers(1, 100, (R, R)) * 1000.0, 0.0)]
    return [np.full((R, R), 4096.0)]   # "ties": every flow equal


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(TOPOS)), st.sampled_from(["skew", "hot-sender", "sparse", "ties"]),
       st.integers(2, 12), st.integers(0, 10_000), st.booleans(), st.booleans(), st.booleans())
def test_block_solver_matches_per_flow_waterfill(topo_name, kind, R, seed, degraded, stagger, sm):
    """Exact mode: the per-side block solver and per-flow water-filling give the same flow end
    times (random and adversarial patterns, oversubscribed spines, node links, a degraded NIC,
    SM-limited copies)."""
    topo = TOPOS[topo_name]
    rng = np.random.default_rng(seed)
    phases = random_phases(rng, R, kind)
    fac = np.where(np.arange(R) == rng.integers(R), 0.3, 1.0) if degraded else None
    st_us = 3.7 if stagger else 0.0
    sm_cap = 30e3 if sm else np.inf
    nic = bool(seed % 3 == 0)   # pure-RDMA last phase in a third of the cases
    a, _ = run_solver(R, phases, topo, 0.0, "blocks", fac, st_us, sm_cap, nic)
    b, _ = run_solver(R, phases, topo, 0.0, "paths", fac, st_us, sm_cap, nic)
    assert np.allclose(a["end"], b["end"], rtol=1e-9, atol=1e-9)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(TOPOS)), st.integers(2, 12), st.integers(0, 10_000), st.booleans(), st.booleans())
def test_block_fill_compiled_equals_the_numpy_freeze(topo_name, R, seed, sm, degraded):
    """The block solver's compiled fill (each node's cells derived, not tabulated) gives every
    transfer the rate of the numpy reference's freeze through its per-node cell tables (one gather
    and one count for every block; it replaced a per-block freeze, kept once for wide maps), on
    random counts: SM ports, degraded NICs, oversubscribed spines, flows finished (counted out)
    and started again."""
    rng = np.random.default_rng(seed)
    fac = np.where(np.arange(R) == rng.integers(R), 0.3, 1.0) if degraded else None
    ports = PortMap.build(TOPOS[topo_name], R, nic_factor_R=fac, sm_bytes_per_us=30e3 if sm else np.inf)
    fast, ref = BlockCounts(ports), BlockCountsReference(ports)   # ref: the numpy reference
    ns, nd = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    for _ in range(3):
        F = int(rng.integers(1, 4 * R * R))
        src, dst = rng.integers(R, size=F), rng.integers(R, size=F)
        blk = ports.pair_class(src, dst, rng.random(F) < 0.5 if ports.sm_ports else None, None)
        for bc in (fast, ref):
            bc.add(blk * R + src, blk * R + dst, 1.0)
        ns, nd = np.r_[ns, blk * R + src], np.r_[nd, blk * R + dst]
        a, b = compiled_fill(fast, ports.cap_P), ref.fill(ports.cap_P)
        rate_a = np.minimum(a.level_src[ns], a.level_dst[nd])
        rate_b = np.minimum(b.level_src[ns], b.level_dst[nd])
        assert np.isfinite(rate_b).all() and np.allclose(rate_a, rate_b, rtol=1e-12, atol=0.0)
        done = rng.random(ns.size) < 0.5   # half of them finish
        for bc in (fast, ref):
            bc.add(ns[done], nd[done], -1.0)
        ns, nd = ns[~done], nd[~done]


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(sorted(TOPOS)), st.sampled_from(["skew", "hot-sender", "sparse", "ties"]),
       st.integers(4, 16), st.integers(0, 10_000), st.sampled_from([0.001, 0.002, 0.005, 0.02]))
@example("node-links", "hot-sender", 14, 78, 0.002)   # the latest end seen: 28.3 x tol
@example("flat", "hot-sender", 7, 370, 0.005)          # the earliest end seen: 1.86 x tol
def test_coalescing_stays_within_tolerance_of_exact(topo_name, kind, R, seed, tol):
    """tol > 0 only delays events (completions and starts move to the next tick), yet the end is
    not bounded below by the exact end: max-min sharing is not monotone (a transfer that ends late
    holds a shared port longer, so one that competes with it elsewhere runs faster, see
    test_coalescing_can_end_earlier_than_exact). On these random and adversarial families the
    last transfer ends at most 40 x tol later than exact (a chain of phases pays up to two tick
    gaps per hop; measured up to 28.3 x tol: node links, one hot sender, 14 ranks, tol 0.002, the
    first example above; 23 x tol at tol 0.005 on the same family) and at most 4 x tol earlier
    (1.86 x tol seen: flat, one hot sender, 7 ranks, tol 0.005, the second example; the
    constructed case of test_coalescing_can_end_earlier_than_exact reaches 2.2 x tol). A single
    receive group may move either way by at most 40 x tol of the end."""
    topo = TOPOS[topo_name]
    phases = random_phases(np.random.default_rng(seed), R, kind)
    ex, _ = run_solver(R, phases, topo, 0.0, "blocks", stagger_us=1.3)
    ap, _ = run_solver(R, phases, topo, tol, "blocks", stagger_us=1.3)
    assert ap["end"].size == ex["end"].size
    assume(ex["end"].size > 0)   # a sparse family can draw no transfer at all (4 ranks, seed 45)
    assert ap["end"].max() >= ex["end"].max() * (1 - 4 * tol)
    assert ap["end"].max() <= ex["end"].max() * (1 + 40 * tol)
    # per receive group (phase, receiver)
    key_e = ex["phase"] * R + ex["dst"]
    key_a = ap["phase"] * R + ap["dst"]
    last_e = np.full(len(phases) * R, -np.inf)
    last_a = np.full(len(phases) * R, -np.inf)
    np.maximum.at(last_e, key_e, ex["end"])
    np.maximum.at(last_a, key_a, ap["end"])
    ok = np.isfinite(last_e)
    assert (np.abs(last_a[ok] - last_e[ok]) <= 40 * tol * ex["end"].max() + 1e-9).all()


ONE_GPU = ideal("g1", gpus_per_node=1, nic_bandwidth_GBps=10.0, nic_latency_us=0.0, fabric_latency_us=0.0)


def rate_drop_case(tol, k=5, m=9, b_bytes=4e6, a_bytes=2e5, c_bytes=2e6, z_bytes=1.6e7):
    """An adversarial pattern for coalescing (one GPU per node: every transfer crosses its
    sender's nic_out and its receiver's nic_in). C (rank 1 -> 0) shares rank 0's nic_in with k
    transfers B_i (rank 2+i -> 0), each held down at its sender by m short transfers A (2+i ->
    other ranks). While the A transfers run, C gets most of rank 0's port; once they end, the B
    transfers speed up and C drops to 1 / (k+1) of it. A small transfer E ends just before the A
    transfers, so with tol > 0 a tick falls there and the A completions wait one gap: C keeps its
    high rate that much longer and ends early, and rank 0, once C arrived, sends Z (the end).
    Returns (end of the last transfer, end of C)."""
    R = 2 + k + m * k + 2
    env = simpy.Environment()
    net = FlowNetwork(env, PortMap.build(ONE_GPU, R), tol)
    one = lambda r: np.bincount([r], minlength=R)  # noqa: E731
    pB = net.expect("B", k * one(0))
    pA = net.expect("A", np.r_[np.zeros(2 + k), np.ones(m * k), np.zeros(2)])
    pC, pZ, pE = net.expect("C", one(0)), net.expect("Z", one(R - 1)), net.expect("E", one(R - 2))
    for i in range(k):
        a_b = np.full(m, a_bytes)
        net.submit(pB, 2 + i, np.array([0]), np.array([b_bytes]), np.array([b_bytes]))
        net.submit(pA, 2 + i, 2 + k + i * m + np.arange(m), a_b, a_b)
    net.submit(pC, 1, np.array([0]), np.array([c_bytes]), np.array([c_bytes]))

    def rank0():
        yield net.received(pC, 0)
        net.submit(pZ, 0, np.array([R - 1]), np.array([z_bytes]), np.array([z_bytes]))

    def early():
        yield env.timeout(a_bytes / (ONE_GPU.nic_bytes_per_us / (m + 1)) - 1.5)
        net.submit(pE, R - 3, np.array([R - 2]), np.array([1e4]), np.array([1e4]))

    env.process(rank0())
    env.process(early())
    env.run()
    rec = net.records()
    return float(rec["end"].max()), float(rec["end"][rec["phase"] == pC].max())


def test_coalescing_can_end_earlier_than_exact():
    """Why the tolerance cannot promise "never earlier than exact": delaying the A completions
    (as a tick gap does) hands C capacity that the exact model gives to the B transfers, so C ends
    about 10 x tol early and the end of the run more than tol early (docs/simulator.md). Pinned
    here so the documented behaviour cannot drift; the end stays within 20 x tol of exact."""
    tol = 0.02
    end_x, c_x = rate_drop_case(0.0)
    end_t, c_t = rate_drop_case(tol)
    # exact: while the A transfers run (their first 200 us) each B_i gets 1/10 of its sender's
    # port and C the other half of rank 0's; after them C gets 1/6 of it
    cap = ONE_GPU.nic_bytes_per_us
    t_a = 2e5 / (cap / 10)
    assert c_x == pytest.approx(t_a + (2e6 - cap / 2 * t_a) / (cap / 6), rel=1e-9)
    assert end_x == pytest.approx(c_x + 1.6e7 / cap, rel=1e-9)
    assert c_t < c_x * (1 - 5 * tol)          # one transfer: 9.8 x tol early
    assert end_t < end_x * (1 - tol)          # the end: 1.6 x tol early
    assert end_t >= end_x * (1 - 20 * tol)


@pytest.mark.parametrize("topo_name", sorted(TOPOS))
def test_side_ports_cover_exactly_the_paths(topo_name):
    """paths() is the sender's side ports then the receiver's: every port of the model is on one
    side, and the block of a pair selects the ports its old per-class routing named."""
    R = 8
    pm = PortMap.build(TOPOS[topo_name], R, sm_bytes_per_us=50e3)
    s, d = np.divmod(np.arange(R * R), R)
    sm = (s + d) % 2 == 0
    path, lat = pm.paths(s, d, sm), pm.latency(s, d)
    blk = pm.pair_class(s, d, sm)
    src_BRK, dst_BRK = pm.side_ports()
    for f in range(R * R):
        want = (set(src_BRK[blk[f], s[f]].tolist()) | set(dst_BRK[blk[f], d[f]].tolist())) - {pm.dummy}
        assert set(path[f].tolist()) - {pm.dummy} == want
        names = [pm.name(int(p)) for p in path[f] if p != pm.dummy]
        kinds = {n.split(".", 1)[1] if n.startswith("rank") else n for n in names}   # a rank's own ports by kind
        assert ({"sm_send", "sm_recv"} <= kinds) == bool(sm[f])
        kinds -= {"sm_send", "sm_recv"}
        if s[f] == d[f]:
            assert kinds == {"hbm"}
        elif s[f] // pm.gpus_per_node == d[f] // pm.gpus_per_node:
            assert kinds == {"nvlink_out", "nvlink_in"}
        else:
            assert {"nic_out", "nic_in"} <= kinds
    assert (lat >= 0).all()


def test_block_solver_is_refused_with_pair_ports():
    half = ideal("half", gpus_per_node=2, nic_duplex="half")
    env = simpy.Environment()
    with pytest.raises(Exception, match="solver"):
        FlowNetwork(env, PortMap.build(half, 4), 0.0, solver="blocks")


@pytest.mark.parametrize("topo_name", sorted(TOPOS) + ["half-duplex"])
def test_port_bytes_equal_the_per_flow_route_sums(topo_name):
    """port_bytes sums whole-byte flows per side before spreading them over ports; it must equal
    the per-flow sum over every flow's full route (spine, node-link, SM and pair ports included)."""
    topo = TOPOS.get(topo_name) or ideal("half", gpus_per_node=2, nic_duplex="half", fabric_oversubscription=2.0)
    R = 8
    phases = random_phases(np.random.default_rng(5), R, "hot-sender")
    _, net = run_solver(R, phases, topo, 0.0, "auto", sm_cap=30e3, nic_only=True)
    rec = net.records()
    path = net.ports.route(rec["src"], rec["dst"], net.flow_sm(rec), net.flow_nic(rec))
    want = np.zeros(net.ports.cap_P.size)
    for f in range(path.shape[0]):
        want[path[f]] += rec["bytes"][f]
    got = net.port_bytes()
    assert np.array_equal(got, want[:-1])
    assert got.sum() > 0


@pytest.mark.parametrize("R, G", [(8, 4), (7, 4), (12, 8), (3, 4)])
def test_port_map_asks_the_cluster_geometry_which_node_and_rail(R, G):
    """Blocks and latencies follow ``Topology.cluster``: same rank local, same node NVLink, same
    rail NIC, other rail NIC + spine (a partly used last node included)."""
    topo = ideal("g", gpus_per_node=G, nvlink_latency_us=2.0, nic_latency_us=5.0, fabric_latency_us=3.0,
                          fabric_oversubscription=2.0)
    geo = topo.cluster(R)
    assert (geo.gpus_per_node, geo.num_nodes) == (min(G, R), -(-R // G))
    ports = PortMap.build(topo, R)
    assert ports.cluster == geo
    src, dst = np.divmod(np.arange(R * R), R)
    blk = ports.pair_class(src, dst)
    node_s, node_d = src // min(G, R), dst // min(G, R)     # the rule, written out once here
    rail_s, rail_d = src % min(G, R), dst % min(G, R)
    want = np.where(src == dst, Block.LOCAL, np.where(node_s == node_d, Block.NVLINK,
                                                      np.where(rail_s == rail_d, Block.NIC, Block.NIC_SPINE)))
    assert np.array_equal(blk, want)
    lat = ports.latency(src, dst)
    assert np.array_equal(lat, np.select([src == dst, node_s == node_d, rail_s == rail_d], [0.0, 2.0, 5.0], 8.0))


def test_nic_groups_number_the_shared_links_node_by_node():
    geo = ideal("g", gpus_per_node=8).cluster(24)
    r = np.arange(24)
    for group in (1, 2, 4, 8):
        assert np.array_equal(nic_group_of(geo, group, r), r // group)
