"""The flow network's one-kernel tick and submission (moonep_sim.sim.tick_kernels.tick_blocks and
submit_flows) against the numpy tick they stand beside, records pinned from before them, and the
per-port-map caches (PortMap.build, the block solver's tables, the pair tables): shared, read-only,
and leaking no state from one network into the next."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import simpy

import moonep_sim.sim.network as network
import moonep_sim.sim.ports as ports_mod
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from blocks_reference import BlockCountsReference, compiled_fill, numpy_tick, reference
from moonep_sim.sim.blocks import BlockCounts
from moonep_sim.sim.network import FlowNetwork, PortMap
from moonep_sim.sim.topology import load_topology
from ideal_topology import ideal

SPINE = ideal("os", gpus_per_node=4, nvlink_bandwidth_GBps=100.0, nic_bandwidth_GBps=25.0,
                       nic_latency_us=5.0, fabric_latency_us=1.0, fabric_oversubscription=3.0)

# sha256 (first 16 hex digits) of every record column, the ticks and filling steps of each case,
# taken with the network as it was before its one-kernel tick and submission (main d2495e0)
PINNED = {"h800-msg": ("e261d53d9dcf3c8f", 316, 462), "h800-exact": ("65bfe1315fdcb764", 1343, 1031),
          "spine": ("5cec4bb78a352c48", 199, 262)}


def case(name: str) -> tuple[PortMap, float]:
    """(port map, tol): a per-message host cost with SM ports, an exact h800 run, an
    oversubscribed spine; one degraded NIC in each."""
    if name == "h800-msg":
        topo, R, sm, tol = dataclasses.replace(load_topology("h800-cx7"), host_message_us=0.7), 16, True, 0.002
    elif name == "h800-exact":
        topo, R, sm, tol = load_topology("h800-cx7"), 24, False, 0.0
    else:
        topo, R, sm, tol = SPINE, 12, True, 0.005
    fac = np.where(np.arange(R) == 1, 0.4, 1.0)
    return PortMap.build(topo, R, nic_factor_R=fac, sm_bytes_per_us=30e3 if sm else np.inf), tol


#: submissions take the numpy path (no pair tables: every map is above ``pair_table_max`` pairs)
NO_PAIR_TABLES = PerfConfig(pair_table_max=0)


def run(name: str, compiled: bool = True, ports: PortMap | None = None, stop_at: float | None = None,
        tables: bool = True, late_phases: bool = False):
    """Three phases (sparse skewed, dense, sparse over the NIC path; jittered timing bytes), each
    sent in two submissions a quarter microsecond apart, ranks starting at random times and each
    phase waiting for the previous one's receipt: (records, ticks, fill steps, network).
    ``late_phases``: the phases after the first are registered while the first is under way."""
    rng = np.random.default_rng(len(name) * 7 + 3)
    p, tol = case(name)
    ports = p if ports is None else ports
    R = ports.ranks
    env = simpy.Environment()
    net = FlowNetwork(env, ports, tol, perf=DEFAULT_PERF if tables else NO_PAIR_TABLES)
    if not compiled:
        numpy_tick(net)
    pop = np.exp(rng.normal(0, 1.0, R))
    phases = [np.where(rng.random((R, R)) < 0.6, rng.poisson(30 * pop[None, :] / pop.mean(), (R, R)) * 1000.0, 0.0),
              rng.poisson(6, (R, R)) * 333.0, np.where(rng.random((R, R)) < 0.2, 4096.0, 0.0)]
    jit = [rng.lognormal(0, 0.1, (R, R)) for _ in phases]
    pids = [net.expect(f"p{i}", (b > 0).sum(0), sm=(i != 1), nic_only=(i == 2)) for i, b in enumerate(phases)
            if i == 0 or not late_phases]
    start = rng.random(R) * 4.0

    def register():
        yield env.timeout(6.0)
        pids.extend(net.expect(f"p{i}", (b > 0).sum(0), sm=(i != 1), nic_only=(i == 2))
                    for i, b in enumerate(phases) if i > 0)

    if late_phases:
        env.process(register())

    def rank(r):
        yield env.timeout(float(start[r]))
        for pid, b, j in zip(pids, phases, jit):
            half = R // 2
            net.submit(pid, r, np.arange(half), b[r, :half], b[r, :half] * j[r, :half])
            yield env.timeout(0.25)
            net.submit(pid, r, np.arange(half, R), b[r, half:], b[r, half:] * j[r, half:])
            yield net.received(pid, r)

    for r in range(R):
        env.process(rank(r))
    env.run(until=stop_at)
    return net.records(), net.ticks, net.fill_iterations, net


def digest(rec, ticks, steps) -> str:
    h = hashlib.sha256()
    for k in sorted(rec):
        h.update(k.encode())
        h.update(np.ascontiguousarray(rec[k]).tobytes())
    h.update(repr((ticks, steps)).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_records_are_the_pinned_ones_compiled_and_in_numpy(name):
    """Every flow's submit, ready and end time, bottleneck port, the ticks and the filling steps
    are the bits the network gave before its tick became one kernel, with the kernel and with the
    numpy tick (per-message host costs, SM ports, NIC-only phases, jittered timing bytes, flows
    that wait for their latency while others start)."""
    want, flows = PINNED[name][0], PINNED[name][2]
    for compiled, tables in ((True, True), (False, True), (True, False)):
        rec, ticks, steps, _ = run(name, compiled, tables=tables)
        assert (digest(rec, ticks, steps), ticks, rec["src"].size) == (want, PINNED[name][1], flows)
        assert not np.isnan(rec["end"]).any()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_phases_registered_during_the_run_give_the_same_records(name):
    """Phases registered after the first ticks (the receive counts grow under the compiled tick)
    give the records of the numpy tick."""
    a, b = run(name, True, late_phases=True), run(name, False, late_phases=True)
    assert a[3].num_phases == 3 and a[1:3] == b[1:3]
    for k in a[0]:
        assert np.array_equal(a[0][k], b[0][k], equal_nan=True), k


def idle(net: FlowNetwork) -> bool:
    """No flow transferring and none waiting."""
    return not net._a.alive.any() and net._pend.n == 0


def test_zero_byte_submissions_log_nothing_and_request_no_tick():
    """Entries of 0 bytes are skipped; a submission of only those adds no flow, no waiting flow
    and no tick (as the numpy path)."""
    ports, _ = case("spine")
    R = ports.ranks
    for tabs in (True, False):
        env = simpy.Environment()
        net = FlowNetwork(env, ports, 0.002, perf=DEFAULT_PERF if tabs else NO_PAIR_TABLES)
        pid = net.expect("p", np.zeros(R, dtype=np.int64))
        net.submit(pid, 3, np.arange(R), np.zeros(R), np.zeros(R))
        assert net._pend.n == 0 and net._log.n == 0 and net._next_tick == np.inf and idle(net)
        b = np.where(np.arange(R) % 3 == 0, 100.0, 0.0)
        pid = net.expect("q", np.r_[(b > 0).astype(np.int64)])
        net.submit(pid, 3, np.arange(R), b, b)
        assert net._pend.n == int((b > 0).sum()) == net._log.n
        assert np.array_equal(net._log.dst, np.flatnonzero(b > 0))
        env.run()
        assert idle(net) and not np.isnan(net.records()["end"]).any()


def test_submission_kernel_equals_the_numpy_submission():
    """The waiting flows and log rows one submission adds are the same through the pair tables'
    kernel as through the numpy path (per-message host cost, SM and NIC-only phases)."""
    ports, _ = case("h800-msg")
    R = ports.ranks
    rng = np.random.default_rng(5)
    nets = []
    for tabs in (True, False):
        net = FlowNetwork(simpy.Environment(), ports, 0.002, perf=DEFAULT_PERF if tabs else NO_PAIR_TABLES)
        nets.append(net)
    for i in range(6):
        b = np.where(rng.random(R) < 0.5, rng.integers(1, 9, R) * 512.0, 0.0)
        eff = b * rng.lognormal(0, 0.2, R)
        src = int(rng.integers(R))
        for net in nets:
            pid = net.expect(f"p{i}", np.ones(R, dtype=np.int64), sm=bool(i % 2), nic_only=i == 4)
            net.submit(pid, src, np.arange(R), b, eff)
    a, b = nets
    assert a._pend.n == b._pend.n > 0
    for k in a._pend.data:
        assert np.array_equal(a._pend.data[k][:a._pend.n], b._pend.data[k][:b._pend.n]), k
    for k, v in a.records().items():
        assert np.array_equal(v, b.records()[k], equal_nan=True), k
    assert a._pend_min == b._pend_min


def test_port_maps_are_built_once_per_topology_ranks_factors_and_sm_cap():
    """PortMap.build returns its kept map for the same topology object, ranks, factors (by value)
    and SM cap, and a new one when any differs; kept maps' capacities are read-only; the cache is
    bounded."""
    topo = load_topology("h800-cx7")
    a = PortMap.build(topo, 16, np.ones(16), np.ones(16), 30e3)
    assert PortMap.build(topo, 16, np.ones(16), np.ones(16), 30e3) is a
    assert PortMap.build(topo, 16, np.ones(16), np.r_[0.5, np.ones(15)], 30e3) is not a
    assert PortMap.build(topo, 16, np.ones(16), np.ones(16), np.inf) is not a
    assert PortMap.build(topo, 32, np.ones(32), np.ones(32), 30e3) is not a
    other = dataclasses.replace(topo, nic_latency_us=topo.nic_latency_us + 1.0)
    b = PortMap.build(other, 16, np.ones(16), np.ones(16), 30e3)
    assert b is not a and b.lat_nic_us == a.lat_nic_us + 1.0
    fresh = PortMap._build(topo, 16, np.ones(16), np.ones(16), 30e3)
    assert np.array_equal(a.cap_P, fresh.cap_P) and np.array_equal(a.nominal_cap_P, fresh.nominal_cap_P)
    with pytest.raises(ValueError):
        a.cap_P[0] = 1.0
    for R in range(2, 2 + 2 * ports_mod.BUILD_CACHE_SIZE):
        PortMap.build(topo, R)
    assert len(ports_mod._BUILT) == ports_mod.BUILD_CACHE_SIZE


def test_fresh_block_counts_share_the_tables_and_start_empty():
    """BlockCounts.fresh: the same tables (the very arrays), zero counts, and counts of its own."""
    ports, _ = case("spine")
    R = ports.ranks
    bc = BlockCounts(ports)
    s, d = np.arange(R), (np.arange(R) + 5) % R
    blk = ports.pair_class(s, d)
    bc.add(blk * R + s, blk * R + d, 1.0)
    compiled_fill(bc, ports.cap_P)
    new = bc.fresh()
    assert new._kernel_static is bc._kernel_static and new.pall is bc.pall
    assert not new.mm.any() and not new.cnt_src.any() and not new.cnt_dst.any()
    assert all(not m.any() for m in new.M + new.MT)
    new.add(blk * R + s, blk * R + d, 1.0)
    assert np.array_equal(new.mm, bc.mm) and new.mm is not bc.mm
    assert np.shares_memory(new.M[-1], new.mm) and not np.shares_memory(new.M[-1], bc.mm)
    a, b = compiled_fill(new, ports.cap_P), compiled_fill(bc, ports.cap_P)
    assert np.array_equal(a.level_src, b.level_src) and a.steps == b.steps
    ref = reference(bc)   # the numpy reference: hints of its own, fresh ones empty
    ref.fill(ports.cap_P)
    assert ref._hint and ref.fresh()._hint == [] and isinstance(ref.fresh(), BlockCountsReference)
    assert not isinstance(bc, BlockCountsReference)


def test_networks_of_one_port_map_do_not_leak_state():
    """A network built on a port map another network used (left mid-run, with flows active and
    waiting) gives the records of one built alone; the solver's tables and pair tables are
    shared, the counts not."""
    ports, _ = case("h800-exact")
    network._STATIC.clear()
    alone = run("h800-exact", ports=ports)
    _, _, _, half = run("h800-exact", ports=ports, stop_at=20.0)
    assert half._a.alive.any() and half._blocks.cnt_src.any()
    again = run("h800-exact", ports=ports)
    for k in alone[0]:
        assert np.array_equal(alone[0][k], again[0][k]), k
    assert alone[1:3] == again[1:3]
    net = again[3]
    assert net._blocks is not half._blocks and net._blocks.mm is not half._blocks.mm
    assert net._blocks._kernel_static is half._blocks._kernel_static
    assert net._pair_tables is half._pair_tables and len(network._STATIC) == 1
    tab = net._pair_table(False, False)   # per sender, its (block, latency) rows
    with pytest.raises(ValueError):
        tab[0][0][0] = 1
