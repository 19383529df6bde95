"""NCCL's algorithm choice for the layout's collectives (moonep_sim.step.collectives.choose):
closed forms of the tree and NVLS on hand-built links, and the choice never above the ring."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_sim.errors import ConfigError
from moonep_sim.step import collectives as coll

NV = coll.Link("nvlink", 100_000.0, 2.0)     # 100 GB/s, 2 us a hop
NI = coll.Link("nic", 40_000.0, 5.0)         # 40 GB/s, 5 us a hop


def test_tree_all_reduce_across_nodes_is_nccls_closed_form():
    # 4 nodes x 8 ranks, 1 MiB: log2(S / 64) = 14, so the tree correction is .5 / .6 / .5 (LL / LL128 / Simple)
    S, span = 2.0 ** 20, coll.Span(4, 8, NV, NI, "")
    ll = 6.8 + 2 * (7 * 0.6 + 2 * 5.0) + S / (40_000 * 0.92 / 3.8 * 0.5 * 0.5)
    ll128 = 14.0 + 2 * (7 * 1.25 + 2 * 8.5) + S / (40_000 * 0.92 * 120 / 128 * 0.6 * 0.5)
    simple = 8.4 + 2 * (7 * 4.0 + 2 * 14.0) + S / (40_000 * 0.92 * 0.5 * 0.5)
    assert min(ll, ll128, simple) == ll128
    algo, proto, t = coll.choose("allreduce", S, 32, NI, span, algorithm="tree")
    assert (algo, proto, t) == ("tree", "ll128", pytest.approx(ll128))
    ring = 2 * 31 / 32 * S / NI.bytes_per_us + 62 * NI.latency_us
    assert coll.all_reduce_us(S, 32, NI, "ring", span) == pytest.approx(ring)
    assert coll.all_reduce_us(S, 32, NI, span=span) == pytest.approx(ll128)   # auto: the tree beats the ring


def test_nvls_inside_a_hopper_node_is_nccls_closed_form():
    S, span = 64.0 * 2 ** 20, coll.Span(1, 8, NV, None, "hopper")
    nvls_bw = 100_000 * 0.85 * 15 / 16
    assert coll.choose("allreduce", S, 8, NV, span) == ("nvls", "simple", pytest.approx(25 + S / (nvls_bw * 2 * 8 / 14)))
    # NVLS's reduce-scatter moves (ppn-1)/ppn of the bytes at 0.85 x 15/16 of the link: slower than the ring here
    assert coll.choose("reducescatter", S, 8, NV, span, "nvls") == \
        ("nvls", "simple", pytest.approx(25 + S / (nvls_bw * 7 / 8)))
    assert coll.choose("reducescatter", S, 8, NV, span)[:2] == ("ring", "simple")
    # without NVSwitch (no NVLS) the big all-reduce stays on the ring, in Simple
    assert coll.choose("allreduce", S, 8, NV, coll.Span(1, 8, NV))[:2] == ("ring", "simple")
    # a tiny one runs the ring in LL: 6.6 + 14 x 0.6 us beats 14 hops of 2 us
    S2 = 4096.0
    assert coll.choose("allreduce", S2, 8, NV, span) == \
        ("ring", "ll", pytest.approx(6.6 + 14 * 0.6 + S2 / (100_000 * 0.5 * 8 / 14)))


def test_nvls_tree_and_tree_only_where_nccl_runs_them():
    span = coll.Span(4, 8, NV, NI, "hopper")
    assert coll.choose("allgather", 1e6, 32, NI, span, algorithm="tree")[2] == math.inf   # tree: all-reduce only
    assert coll.choose("allgather", 1e6, 32, NI, span, algorithm="nvls")[2] == math.inf   # no NVLS gather across nodes
    a, p, t = coll.choose("allreduce", 1e9, 32, NI, span, algorithm="nvls")
    assert (a, p) == ("nvls_tree", "simple")
    assert t == pytest.approx(25 + 2 * 2 * 20.9 + 1e9 / (40_000 * 32 / 62))


def test_group_shape_and_nvls_from_the_topology():
    from moonep_sim.sim.topology import load_topology
    h200 = load_topology("h200-cx7")
    sp = coll.group_shape(h200, 64, 1)
    assert (sp.nodes, sp.per_node, sp.inter.name, sp.nvls) == (8, 8, "nic", "hopper")
    assert (coll.group_shape(h200, 16, 8).nodes, coll.group_shape(h200, 16, 8).per_node) == (16, 1)
    assert coll.group_shape(h200, 8, 1).inter is None
    assert coll.nvls_capable(load_topology("mi300x-cx7")) == ""
    nvl72 = load_topology("gb200-nvl72")      # 16 ranks 8 apart span 121 GPUs: 9 in the first domain, 7 in the next
    assert (coll.group_shape(nvl72, 16, 8).nodes, coll.group_shape(nvl72, 16, 8).per_node) == (2, 9)
    assert (coll.group_shape(nvl72, 64, 1).nodes, coll.group_shape(nvl72, 64, 1).nvls) == (1, "blackwell")


def test_unknown_algorithm_is_refused():
    with pytest.raises(ConfigError, match="algorithm"):
        coll.all_reduce_us(1e6, 8, NV, algorithm="butterfly")


@settings(max_examples=150, deadline=None)
@given(S=st.floats(1.0, 4e9), per_node=st.sampled_from([1, 2, 4, 8]), nodes=st.sampled_from([1, 2, 3, 4, 8, 16]),
       kind=st.sampled_from(["allreduce", "reducescatter", "allgather"]), nvls=st.sampled_from(["", "hopper", "blackwell"]))
def test_the_choice_is_never_above_the_ring(S, per_node, nodes, kind, nvls):
    n = per_node * nodes
    link = NV if nodes == 1 else NI
    span = coll.Span(nodes, per_node, NV, NI if nodes > 1 else None, nvls)
    ring = coll.choose(kind, S, n, link, span, "ring")[2]
    algo, proto, t = coll.choose(kind, S, n, link, span)
    assert 0.0 <= t <= ring
    assert algo in ("ring", "tree", "nvls", "nvls_tree") and proto in coll.PROTOCOLS


def test_tp_across_nodes_takes_nccls_choice_in_the_step():
    from moonep_sim.models import get_model
    from moonep_sim.sim.topology import load_topology
    from moonep_sim.step.layout_step import tp_comm_us
    from moonep_sim.step.parallel import Parallel
    from moonep_sim.step.stack import StepShape
    topo, m = load_topology("h200-cx7"), get_model("qwen3-30b-a3b")
    f, b = tp_comm_us(m, 0, 2, Parallel(tp=16, ep=16), StepShape("decode", 64, 2048), topo, 64, 8)
    S, link, span = 64 * m.hidden * 2, coll.group_link(topo, 16), coll.group_shape(topo, 16)
    assert (span.nodes, span.per_node) == (2, 8)
    one = coll.all_reduce_us(S, 16, link, span=span)
    assert (f, b) == pytest.approx((2 * 2 * one, 2 * 2 * one))     # 2 layers, 2 all-reduces each way
    assert one < coll.all_reduce_us(S, 16, link, "ring")           # a small message leaves the ring
