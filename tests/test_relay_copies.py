"""Relayed expert-weight copies (stage 0: home -> one rank of a remote node over the NIC; stage 1:
that relay -> the node's other receivers over NVLink): the Plan's data and its checks, the
simulator's closed form, ``costaware``'s choice of relays, and the gloo executor's two rounds.

Notation: R ranks, G GPUs per node, E experts, W one expert's weight bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from moonep_sim.models import custom_model
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, RowCosts
from moonep_sim.plan.kinds import PhaseKind
from moonep_sim.plan.validate import validate
from moonep_sim.sim import SimOptions, load_topology, simulate_layer
from moonep_sim.sim.kernels import weight_copy_bytes_per_us
from moonep_sim.strategies import PlanContext, make_plan
from moonep_sim.strategies.costaware import relay_sources
from moonep_sim.strategies.moonep import plan_from_alloc
from conftest import tokens_per_expert_RE

HERE = str(Path(__file__).resolve().parent)
R, G, E = 8, 4, 8
BIG = custom_model(E, 1, hidden=4096, expert_ffn=4096, name="big")  # W = 96 MiB: weights dominate


def one_expert_to_a_remote_node(relay: bool):
    """Expert 0 (home rank 0, node 0) computed on rank 0 and on every rank of node 1 (4..7); with
    ``relay`` rank 4 receives it from the home and forwards it to 5, 6, 7."""
    ids = np.zeros((R, 1), np.int64)
    g = GlobalRouting.split_evenly(ids, np.ones((R, 1), np.float32), E, R)
    ctx = PlanContext(ClusterShape(R, G), Placement.home_groups(E, R), RowCosts.from_model(BIG), 1)
    alloc = np.zeros((E, R), np.int64)
    alloc[0] = [4, 0, 0, 0, 1, 1, 1, 1]
    p = plan_from_alloc(g, ctx, alloc, 1, False)
    if not relay:
        return p
    src = np.where(p.is_copy_S(), np.where(p.slot_rank_S > 4, 4, p.slot_home_S), p.slot_rank_S)
    return dataclasses.replace(p, slot_src_S=src)


def test_stage_one_copies_are_phases_gated_on_their_relay():
    p = one_expert_to_a_remote_node(True)
    assert validate(p) == []
    assert (p.copy_src_S() != p.slot_home_S)[p.is_copy_S()].tolist() == [False, True, True, True]  # stage 0, 1, 1, 1
    fwd = {ph.name: ph for ph in p.phases("forward")}
    assert fwd["prefetch"].msgs_RR.sum() == 1 and fwd["prefetch"].msgs_RR[0, 4] == 1  # once over the NIC
    assert fwd["prefetch.1"].after == "prefetch" and fwd["prefetch.1"].msgs_RR[4, [5, 6, 7]].tolist() == [1, 1, 1]
    bwd = [ph for ph in p.phases("backward") if ph.kind == PhaseKind.GRAD_REDUCE]
    assert [ph.name for ph in bwd] == ["grad_reduce.1", "grad_reduce"]  # into the relay first, then home
    assert bwd[1].after == "grad_reduce.1" and bwd[1].msgs_RR[4, 0] == 1 and bwd[1].msgs_RR.sum() == 1
    # without relays the phases are what they always were
    q = one_expert_to_a_remote_node(False)
    assert [ph.name for ph in q.phases("forward")] == ["dispatch.0", "prefetch", "combine.0"]
    assert q.phases("forward")[1].msgs_RR[0, 4:].tolist() == [1, 1, 1, 1]


def test_validate_names_a_bad_relay():
    p = one_expert_to_a_remote_node(True)
    src = p.slot_src_S.copy()
    src[(p.slot_rank_S == 5) & p.is_copy_S()] = 1  # rank 1 is on node 0 and holds no copy
    v = validate(dataclasses.replace(p, slot_src_S=src))
    assert any("relay (1) must be another rank of the receiver's node" in m for m in v), v
    assert any("(relay, expert) [(1, 0)] do not" in m for m in v), v
    src = p.slot_src_S.copy()
    src[(p.slot_rank_S == 6) & p.is_copy_S()] = 7  # rank 7 is itself a stage-1 receiver
    v = validate(dataclasses.replace(p, slot_src_S=src))
    assert any("(relay, expert) [(7, 0)] do not" in m for m in v), v


def test_relayed_fan_out_costs_one_nic_copy_plus_nvlink_not_g_nic_copies():
    """Closed form: rank 4 holds the weights after W/nic; ranks 5..7 after W/nic + (G-1) W/nvlink
    (the relay's NVLink out-port carries G-1 copies). Sent directly, the home's NIC carries G copies."""
    topo = load_topology("h800-cx7", gpus_per_node=G)
    W = RowCosts.from_model(BIG).weight_bytes
    nic, nv = weight_copy_bytes_per_us(topo, True), weight_copy_bytes_per_us(topo, False)
    lat = topo.nic_latency_us + topo.nvlink_latency_us
    opts = SimOptions(planning=False)
    relayed = simulate_layer(one_expert_to_a_remote_node(True), topo, BIG, opts).per_rank["compute_start_us"]
    direct = simulate_layer(one_expert_to_a_remote_node(False), topo, BIG, opts).per_rank["compute_start_us"]
    assert relayed[4] == pytest.approx(W / nic, abs=lat)
    for r in (5, 6, 7):
        assert relayed[r] == pytest.approx(W / nic + (G - 1) * W / nv, abs=2 * lat + 5)
    assert max(direct[4:]) == pytest.approx(G * W / nic, abs=2 * lat + 5)
    # backward: the adjoint runs (stage 1 into the relay, then home) and is cheaper than G NIC gradients
    b_rel = simulate_layer(one_expert_to_a_remote_node(True), topo, BIG, SimOptions(planning=False, backward=True))
    b_dir = simulate_layer(one_expert_to_a_remote_node(False), topo, BIG, SimOptions(planning=False, backward=True))
    assert b_rel.phases_us["bwd.grad_reduce.1"] > 0 and b_rel.phases_us["bwd.grad_reduce"] > 0
    assert b_rel.layer_time_us < b_dir.layer_time_us


def test_relay_sources_pick_one_relay_per_expert_and_node():
    # copies: (expert, rank, home); G = 4; expert 0 home 0 -> ranks 6, 5, 4 (node 1) and 1 (node 0)
    e = np.array([0, 0, 0, 0, 3, 3])
    r = np.array([6, 5, 4, 1, 9, 2])
    h = np.array([0, 0, 0, 0, 0, 0])
    assert relay_sources(e, r, h, ClusterShape(12, 4)).tolist() == [4, 4, 0, 0, 0, 0]


def hot_on_one_node(T_per=8192, seed=0):
    """2 nodes of 4, 32 experts, top-4: the experts of node 0 (0..15) are chosen 5x as often as the
    others and expert 0 (home rank 0) 200x (distinct experts per token: top-K of log-weights plus
    Gumbel noise). Node 0 is overloaded as a whole, so balance needs copies to node 1."""
    rng = np.random.default_rng(seed)
    E2, K, T = 32, 4, T_per * 8
    logw = np.where(np.arange(E2) < 16, np.log(5.0), 0.0)
    logw[0] = np.log(200.0)
    ids = np.argsort(-(logw + rng.gumbel(size=(T, E2))), axis=1)[:, :K].astype(np.int64)
    return GlobalRouting.split_evenly(ids, np.full((T, K), 0.25, np.float32), E2, 8)


def test_costaware_relays_cross_node_copies_on_a_two_node_hot_spot():
    g = hot_on_one_node()
    model = custom_model(32, 4, hidden=7168, expert_ffn=512, name="small-experts")
    topo = load_topology("h800-cx7", gpus_per_node=4)
    ctx = PlanContext(ClusterShape(8, 4), Placement.home_groups(32, 8), RowCosts.from_model(model), 1, topology=topo)
    p = make_plan("costaware", g, ctx)
    assert validate(p) == []
    o = p.options
    assert o["copies_cross_node"] > 0 and o["copies_relayed"] > 0, o
    assert int((p.copy_src_S() != p.slot_home_S).sum()) == o["copies_relayed"]  # stage-1 copies
    res = simulate_layer(p, topo, model)
    no_copy = simulate_layer(make_plan("deepep", g, ctx), topo, model)
    assert res.layer_time_us < no_copy.layer_time_us
    assert simulate_layer(p, topo, model, SimOptions(backward=True)).layer_time_us > 0


# ---------------------------------------------------------------------------------------------
# gloo: 4 ranks in 2 nodes of 2
# ---------------------------------------------------------------------------------------------

CFG = dict(T=48, H=8, F=6, E=8, K=3, G=2, seed=5)


def relay_planner(ctx):
    """The hottest expert e also computed on both ranks of the node its home is not on: the lower
    of them is the relay (stage 0 from the home), the other is fed by it (stage 1)."""

    def plan(routing):
        counts = routing.counts_E()
        Ex, Rx, Gx = counts.size, ctx.cluster.ranks, ctx.cluster.gpus_per_node
        epn = Ex // Rx
        alloc = np.zeros((Ex, Rx), np.int64)
        alloc[np.arange(Ex), np.arange(Ex) // epn] = counts
        e = int(np.argmax(counts))
        h = e // epn
        other = [r for r in range(Rx) if r // Gx != h // Gx]
        c = int(counts[e])
        if c < 3:
            raise ValueError(f"hottest expert rows ({c}) must be >= 3 for this test")
        alloc[e, [h] + other] = [c - 2 * (c // 3), c // 3, c // 3]
        p = plan_from_alloc(routing, ctx, alloc, epn, False)
        src = np.where(p.is_copy_S(), np.where(p.slot_rank_S == other[1], other[0], p.slot_home_S), p.slot_rank_S)
        return dataclasses.replace(p, slot_src_S=src)

    return plan


def relay_worker(rank, world, T, H, F, E, K, G, seed):
    from test_gloo_layer import make_inputs, tokens_of
    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.gloo.moe import EPMoELayer

    x, router_w, grad_out, experts = make_inputs(T, H, F, E, seed)
    lo, hi = tokens_of(rank, world, T)
    ctx = PlanContext.default(E, world, G, RowCosts.for_rows(H, 8))
    buf = Buffer(capacity=(T + world - 1) // world, hidden=H, top_k=K, num_experts=E, planner=relay_planner(ctx),
                 gpus_per_node=G, timeout_s=30, dispatch_dtype=torch.float64)
    layer = EPMoELayer(buf, F, router_w=router_w, experts_w=experts).double()
    xr = x[lo:hi].clone().requires_grad_(True)
    out = layer(xr)
    (out * grad_out[lo:hi]).sum().backward()
    h = layer.last_handle
    # the copies this rank holds, fetched again outside autograd, next to the home weights of expert 0
    copies = buf.prefetch_weight(h, (layer.gate.detach(), layer.up.detach(), layer.down.detach()))
    sl = h.plan.rank_slots(rank)
    cp = h.plan.is_copy_S()[sl]
    exp = h.plan.slot_expert_S[sl][cp]
    return {"out": out.detach(), "gx": xr.grad, "ggate": layer.gate.grad, "gup": layer.up.grad,
            "gdown": layer.down.grad, "home": layer.home_experts, "copy_experts": exp,
            "copy_gate": copies[0][h.slots.weight_index[torch.from_numpy(np.flatnonzero(cp))]] if cp.any()
            else torch.zeros(0), "relayed": np.array(h.weights.relay.total), "valid": np.array(len(validate(h.plan))),
            "hot": np.array(int(np.argmax(tokens_per_expert_RE(h.plan).sum(axis=0))))}


@pytest.mark.slow
def test_gloo_relayed_copies_equal_home_weights_and_gradients_the_dense_reference():
    from rank_spawner import spawn_ranks
    from moonep_sim.gloo.moe import dense_moe
    from test_gloo_layer import make_inputs

    world = 4
    results = spawn_ranks("test_relay_copies:relay_worker", world, CFG, timeout_s=120, pythonpath=[HERE])
    for r in results:
        assert r.ok, f"rank {r.rank} failed (exit {r.returncode}): {r.output[-3000:]}"
    res = [r.result for r in results]
    assert int(res[0]["relayed"]) == 1 and int(res[0]["valid"]) == 0  # one stage-1 copy
    x, router_w, grad_out, experts = make_inputs(**CFG)
    e = int(res[0]["hot"])
    other = [r for r in range(world) if r // CFG["G"] != (e // (CFG["E"] // world)) // CFG["G"]]
    for r in other:  # the relay's copy and the relayed one equal the home weights of the hot expert
        assert res[r]["copy_experts"].tolist() == [e]
        np.testing.assert_array_equal(res[r]["copy_gate"][0], experts[0][e].numpy())
    xx = x.clone().requires_grad_(True)
    ew = [w.clone().requires_grad_(True) for w in experts]
    ref = dense_moe(xx, router_w, ew, CFG["K"])
    (ref * grad_out).sum().backward()
    np.testing.assert_allclose(np.concatenate([r["out"] for r in res]), ref.detach().numpy(), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(np.concatenate([r["gx"] for r in res]), xx.grad.numpy(), rtol=1e-9, atol=1e-10)
    for j, key in enumerate(("ggate", "gup", "gdown")):
        got = np.zeros_like(ew[j].grad.numpy())
        for r in res:
            got[r["home"]] += r[key]
        np.testing.assert_allclose(got, ew[j].grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=key)
