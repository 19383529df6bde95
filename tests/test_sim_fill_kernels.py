"""The block solver's compiled fill (moonep_sim.sim.fill_kernels) against its numpy reference:
bit-identical levels, bottleneck ports and step counts on random and adversarial counts over
several port maps, and identical flow records through the whole network."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from hypothesis import given, settings, strategies as st

from blocks_reference import BlockCountsReference, compiled_fill, numpy_tick, reference
from moonep_sim.sim.blocks import RUN_MAX, BlockCounts
from moonep_sim.sim.network import FlowNetwork, PortMap
from moonep_sim.sim.tick_kernels import set_rates
from moonep_sim.sim.topology import load_topology
from ideal_topology import ideal

IDEAL = {
    "spine": ideal("os", gpus_per_node=4, nvlink_bandwidth_GBps=100.0, nic_bandwidth_GBps=25.0,
                            nic_latency_us=5.0, fabric_latency_us=1.0, fabric_oversubscription=3.0),
    "node-links": ideal("nl", gpus_per_node=2, nvlink_bandwidth_GBps=50.0, nic_bandwidth_GBps=10.0,
                                 nic_attach="node", fabric_oversubscription=2.0),
    "nvlink-only": ideal("one", gpus_per_node=8, nvlink_bandwidth_GBps=100.0, nvlink_latency_us=2.0),
}


def port_map(name: str, R: int, sm: bool, degraded_rank: int | None = None) -> PortMap:
    topo = load_topology("h800-cx7") if name == "h800-cx7" else IDEAL[name]
    fac = None if degraded_rank is None else np.where(np.arange(R) == degraded_rank, 0.3, 1.0)
    return PortMap.build(topo, R, nic_factor_R=fac, sm_bytes_per_us=30e3 if sm else np.inf)


def transfers(rng, ports: PortMap, pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """(ns_F, nd_F): sender and receiver nodes of a batch of transfers of one pattern: uniform
    random, a hot receiver, one hot sender, all pairs once (every share ties), sparse, or
    everything over the NIC path (pure-RDMA phases)."""
    R = ports.ranks
    F = int(rng.integers(1, 3 * R * R))
    src, dst = rng.integers(R, size=F), rng.integers(R, size=F)
    nic = None
    if pattern == "hot-receiver":
        dst[: F // 2] = rng.integers(R)
    elif pattern == "hot-sender":
        src[: F // 2] = rng.integers(R)
    elif pattern == "all-pairs":
        src, dst = np.divmod(np.arange(R * R), R)
    elif pattern == "sparse":
        keep = rng.random(F) < 0.05
        src, dst = src[keep], dst[keep]
    elif pattern == "nic-only":
        nic = np.ones(src.size, dtype=bool)
    sm = (rng.random(src.size) < 0.5) if ports.sm_ports else None
    blk = ports.pair_class(src, dst, sm, nic)
    return blk * R + src, blk * R + dst


def assert_same_fill(bc: BlockCounts, cap_P: np.ndarray, hint: list | None = None) -> int:
    """The compiled fill and the numpy reference (of the same counts; its run hints ``hint``)
    agree bit for bit; returns the steps."""
    assert not isinstance(bc, BlockCountsReference)   # the compiled fill
    ref = reference(bc)
    ref._hint = list(hint or [])
    a, b = compiled_fill(bc, cap_P), ref.fill(cap_P)
    for name in ("level_src", "level_dst", "port_src", "port_dst"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.steps == b.steps
    return a.steps


PATTERNS = ["uniform", "hot-receiver", "hot-sender", "all-pairs", "sparse", "nic-only"]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["h800-cx7", "spine", "node-links", "nvlink-only"]), st.sampled_from([8, 12, 32]),
       st.booleans(), st.booleans(), st.sampled_from(PATTERNS), st.integers(0, 10_000))
def test_compiled_fill_equals_the_numpy_fill(name, R, sm, degraded, pattern, seed):
    """Counts added and removed over a few rounds (flows starting and finishing); every fill is
    bit-identical to the reference: h800-cx7, an oversubscribed spine, node links, one NVLink node;
    SM ports, a degraded NIC, ties, hot spots, pure-RDMA transfers."""
    if name == "nvlink-only":
        R = 8
    rng = np.random.default_rng(seed)
    ports = port_map(name, R, sm, int(rng.integers(R)) if degraded else None)
    bc = BlockCounts(ports)
    ns = nd = np.zeros(0, dtype=np.int64)
    for _ in range(3):
        s, d = transfers(rng, ports, pattern)
        bc.add(s, d, 1.0)
        ns, nd = np.r_[ns, s], np.r_[nd, d]
        assert_same_fill(bc, ports.cap_P)
        done = rng.random(ns.size) < 0.6
        bc.add(ns[done], nd[done], -1.0)
        ns, nd = ns[~done], nd[~done]
        assert_same_fill(bc, ports.cap_P)


@pytest.mark.parametrize("R", [8, 32, 64])
@pytest.mark.parametrize("sm", [False, True])
def test_compiled_fill_equals_the_numpy_fill_on_h800_ep_sizes(R, sm):
    """The EP8 / EP32 / EP64 h800-cx7 maps of the step benchmarks (the simple one-port-per-node
    case without SM ports, the general one with them), every pattern, a halved NIC among them."""
    rng = np.random.default_rng(R + sm)
    for pattern in PATTERNS:
        ports = port_map("h800-cx7", R, sm, int(rng.integers(R)) if pattern == "uniform" else None)
        bc = BlockCounts(ports)
        assert bc.simple == (not sm)
        s, d = transfers(rng, ports, pattern)
        bc.add(s, d, 1.0)
        assert assert_same_fill(bc, ports.cap_P) > 0
        bc.add(s[::2], d[::2], -1.0)
        assert_same_fill(bc, ports.cap_P)


@pytest.mark.parametrize("sm", [False, True])
def test_compiled_fill_of_nothing_freezes_nothing(sm):
    ports = port_map("h800-cx7", 16, sm)
    bc = BlockCounts(ports)
    lv = compiled_fill(bc, ports.cap_P)
    assert lv.steps == 0 and np.isinf(lv.level_src).all() and (lv.port_dst == -1).all()
    assert_same_fill(bc, ports.cap_P)


@pytest.mark.parametrize("R", [72, 136])
def test_wide_maps_take_the_compiled_fill(R):
    """Rows wider than 64 ranks (NIC rows of 72 and 136): the compiled fill runs, without the
    [2N, W] cell tables (only the numpy reference builds them), and equals the reference."""
    ports = port_map("h800-cx7", R, False)
    bc = BlockCounts(ports)
    assert not isinstance(bc, BlockCountsReference) and not hasattr(bc, "cell_NW")
    s, d = transfers(np.random.default_rng(1), ports, "uniform")
    bc.add(s, d, 1.0)
    a = compiled_fill(bc, ports.cap_P)
    ref = reference(bc)
    b = ref.fill(ports.cap_P)
    assert ref.cell_NW is not None
    for x, y in zip(a[:4], b[:4]):
        assert np.array_equal(x, y)
    assert a.steps == b.steps


def run_network(ports: PortMap, phases_RR, compiled: bool, stagger_us: float = 0.0):
    """Every rank sends phase i+1 once it received all of phase i (rank r starts r x stagger late);
    the flow records, with the block solver's compiled fill on or off."""
    env = simpy.Environment()
    net = FlowNetwork(env, ports, 0.002)
    if not compiled:
        numpy_tick(net)
    R = ports.ranks
    pids = [net.expect(f"p{i}", (b > 0).sum(0), sm=(i == 0)) for i, b in enumerate(phases_RR)]

    def rank(r):
        yield env.timeout(r * stagger_us)
        for pid, b in zip(pids, phases_RR):
            net.submit(pid, r, np.arange(R), b[r], b[r] * 1.01)
            yield net.received(pid, r)

    for r in range(R):
        env.process(rank(r))
    env.run()
    return net.records(), net.ticks, net.fill_iterations


@pytest.mark.parametrize("name,R,sm", [("h800-cx7", 32, False), ("h800-cx7", 16, True), ("spine", 12, True),
                                       ("node-links", 8, False)])
def test_network_records_do_not_move_with_the_compiled_fill(name, R, sm):
    """Whole simulations (skewed two-phase traffic, staggered starts, coalescing on): every flow's
    ready and end time and bottleneck port are the same bits with the compiled fill as with the
    numpy one, and so are the ticks and filling steps."""
    rng = np.random.default_rng(R)
    ports = port_map(name, R, sm)
    pop = np.exp(rng.normal(0, 1.0, R))
    phases = [rng.poisson(40 * pop[None, :] / pop.mean(), (R, R)) * 1000.0, rng.poisson(20, (R, R)) * 512.0]
    (a, ta, ia), (b, tb, ib) = (run_network(ports, phases, c, 1.3) for c in (True, False))
    assert (ta, ia) == (tb, ib)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_set_rates_equals_the_numpy_update_with_zero_and_unchanged_rates():
    """The compiled re-rating against the numpy expressions it replaces, on slots whose rate is
    unchanged, changed, dropped to 0 (numpy's inf / nan quotients) or dead (the sentinel node)."""
    rng = np.random.default_rng(7)
    N, n = 12, 40
    lev = np.r_[rng.choice([0.0, 1.5, 3.0, np.inf], 2 * N), np.inf]
    ns, nd = rng.integers(N + 1, size=n), rng.integers(N + 1, size=n)
    rate = np.where(rng.random(n) < 0.3, np.minimum(np.append(lev[:N], 0.0)[ns], np.append(lev[N:2 * N], 0.0)[nd]),
                    rng.random(n))
    rem0, t0, t = rng.choice([0.0, 100.0, 2e5], n), rng.random(n), 3.0
    fin = rng.random(n) + 5.0
    cols = [rate.copy(), rem0.copy(), t0.copy(), fin.copy()]
    new = np.minimum(np.append(lev[:N], 0.0)[ns], np.append(lev[N:2 * N], 0.0)[nd])
    fin_max, fin_min = set_rates(new, n, *cols, t)
    ch = new != rate
    with np.errstate(divide="ignore", invalid="ignore"):
        rem = rem0[ch] - rate[ch] * (t - t0[ch])
        f = t + rem / new[ch]
    rem0[ch], t0[ch], rate[ch], fin[ch] = rem, t, new[ch], f
    for got, want in zip(cols, (rate, rem0, t0, fin)):
        assert np.array_equal(got, want, equal_nan=True)
    assert ch.any() and not np.isfinite(f).all()
    assert fin_max == f[np.isfinite(f)].max()
    assert np.isnan(fin_min) if np.isnan(fin).any() else fin_min == fin.min()


@pytest.mark.parametrize("name,R,sm", [("h800-cx7", 32, True), ("spine", 12, False)])
def test_compiled_counting_equals_the_numpy_scatter(name, R, sm):
    """Transfers counted in and out by the compiled pass leave the same cells and node totals as
    the numpy scatter (``np.add.at``) it replaces."""
    rng = np.random.default_rng(3)
    ports = port_map(name, R, sm)
    fast, ref = BlockCounts(ports), BlockCountsReference(ports)
    for pattern in PATTERNS:
        s, d = transfers(rng, ports, pattern)
        out = rng.random(s.size) < 0.4
        for bc in (fast, ref):
            bc.add(s, d, 1.0)
            bc.add(s[out], d[out], -1.0)
    assert fast.mm.any()
    for attr in ("mm", "cnt_src", "cnt_dst"):
        assert np.array_equal(getattr(fast, attr), getattr(ref, attr)), attr


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["h800-cx7", "spine", "node-links", "nvlink-only"]), st.integers(2, 16), st.booleans(),
       st.sampled_from([0.0, 0.002, 0.02]), st.integers(0, 10_000))
def test_network_runs_do_not_move_with_the_compiled_kernels(name, R, sm, tol, seed):
    """Random sizes, tolerances (exact and coalesced), SM ports and sparse or skewed phases: the
    network's records, ticks and filling steps are the same with the compiled kernels as with the
    numpy code."""
    if name == "nvlink-only":
        R = min(R, 8)
    rng = np.random.default_rng(seed)
    ports = port_map(name, R, sm, int(rng.integers(R)) if seed % 2 else None)
    sparse = np.where(rng.random((R, R)) < 0.3, rng.integers(1, 50, (R, R)) * 1000.0, 0.0)
    phases = [sparse, rng.poisson(8, (R, R)) * 777.0]

    def run(compiled):
        env = simpy.Environment()
        net = FlowNetwork(env, ports, tol)
        if not compiled:
            numpy_tick(net)
        pids = [net.expect(f"p{i}", (b > 0).sum(0), sm=(i == 0)) for i, b in enumerate(phases)]

        def rank(r):
            yield env.timeout(float(rng_r[r]))
            for pid, b in zip(pids, phases):
                net.submit(pid, r, np.arange(R), b[r], b[r] * 1.03)
                yield net.received(pid, r)

        for r in range(R):
            env.process(rank(r))
        env.run()
        return net.records(), net.ticks, net.fill_iterations

    rng_r = rng.random(R) * 5.0
    (a, ta, ia), (b, tb, ib) = run(True), run(False)
    assert (ta, ia) == (tb, ib)
    for k in a:
        assert np.array_equal(a[k], b[k], equal_nan=True), k


def test_a_step_whose_last_run_was_the_longest_is_filled_again():
    """A step whose run in the last fill was ``RUN_MAX`` ports long, with more candidates than that
    now: the numpy fill tries the longest prefix again (it skipped every width and failed on an
    unset cut: an SM-driven all-to-all at EP256 filled twice), and equals the compiled one."""
    R = 256
    ports = port_map("h800-cx7", R, True)
    bc = BlockCountsReference(ports)
    s, d = np.divmod(np.arange(R * R), R)
    blk = ports.pair_class(s, d, np.ones(R * R, dtype=bool))
    bc.add(blk * R + s, blk * R + d, 1.0)
    first = bc.fill(ports.cap_P)
    assert bc._hint[0] == RUN_MAX
    again = bc.fill(ports.cap_P)
    assert again.steps == first.steps and np.array_equal(again.level_src, first.level_src)
    kernel = compiled_fill(bc, ports.cap_P)   # (the compiled fill of the same counts, at this width too)
    assert kernel.steps == first.steps and np.array_equal(kernel.level_src, first.level_src)
    # where the kernel runs: a hint of RUN_MAX at every step and more candidates than that
    ports = port_map("h800-cx7", 64, True)
    bc = BlockCounts(ports)
    s, d = np.divmod(np.arange(64 * 64), 64)
    bc.add(*(ports.pair_class(s, d, np.arange(s.size) % 2 == 0) * 64 + x for x in (s, d)), 1.0)
    assert_same_fill(bc, ports.cap_P, hint=[RUN_MAX] * 64)
