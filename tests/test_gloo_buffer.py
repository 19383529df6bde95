"""The gloo Buffer moves rows exactly as the Plan says (every strategy, hand-built multi-hop Plans).

In-process: every rank's handle is built from one Plan and the hops are emulated (fast, hypothesis).
Spawned (4 gloo ranks, 2 nodes of 2, one spawn): traceable rows land where the Plan says,
``combine(dispatch(x)) == kept*x`` with weights 1, a reused handle moves the same rows,
prefetched copies equal their home weights, reduced gradients equal the sum over copies.
In-process world of one rank: bad input is rejected before any communication.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_sim.errors import ConfigError, PlanError
from moonep_sim.gloo.handle import Handle, build_handle, direct_index
from rank_spawner import free_port, spawn_ranks
from moonep_sim.plan import GlobalRouting, Hop, RowCosts, Slots, plan_from_slots, validate
from moonep_sim.strategies import PlanContext, available, make_plan, planner

HERE = str(Path(__file__).resolve().parent)
E, K, H, G = 8, 3, 4, 2


# -- every rank in one process (no torch.distributed): the Handle's gathers and scatters, hop by hop

def _emulate_hop(send_R: list[torch.Tensor], send_splits_R: list[tuple[int, ...]],
                 members_R: list[tuple[int, ...]], rank_count: int) -> list[torch.Tensor]:
    """What ``all_to_all_single`` delivers to each rank: chunks from each member in member order."""
    chunks = []
    for r in range(rank_count):
        chunks.append(dict(zip(members_R[r], torch.split(send_R[r], list(send_splits_R[r])))))
    return [torch.cat([chunks[src][r] for src in members_R[r]]) for r in range(rank_count)]


def emulate_dispatch(handles: list[Handle], x_R: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dispatch every rank's rows ``x_R[r] [s_r, C]`` in one process; returns each rank's [W_r, C]."""
    R = len(handles)
    buf = list(x_R)
    n = len(handles[0].hops)
    if n == 0:
        return [handles[r].expand.gather(buf[r]) for r in range(R)]
    for i in range(n):
        hs = [h.hops[i] for h in handles]
        send = [hs[r].send.gather(buf[r]) for r in range(R)]
        recv = _emulate_hop(send, [hs[r].send_splits for r in range(R)], [hs[r].members for r in range(R)], R)
        buf = [hs[r].recv.place(recv[r]) for r in range(R)] if i < n - 1 else recv
    return [handles[r].final.gather(buf[r]) for r in range(R)]


def emulate_combine(handles: list[Handle], y_R: list[torch.Tensor]) -> list[torch.Tensor]:
    """The adjoint of :func:`emulate_dispatch` (no routing weights): each rank's [s_r, C]."""
    R = len(handles)
    n = len(handles[0].hops)
    if n == 0:
        return [handles[r].expand.scatter_add(y_R[r]) for r in range(R)]
    buf = [handles[r].final.scatter_add(y_R[r]) for r in range(R)]
    for i in reversed(range(n)):
        hs = [h.hops[i] for h in handles]
        send = buf if i == n - 1 else [hs[r].recv.gather_back.gather(buf[r]) for r in range(R)]
        recv = _emulate_hop(send, [hs[r].recv_splits for r in range(R)], [hs[r].members for r in range(R)], R)
        buf = [hs[r].send.scatter_add(recv[r]) for r in range(R)]
    return buf


def routing_for(T, R, seed, skew=1.0):
    rng = np.random.default_rng(seed)
    logp = rng.normal(0, skew, E)
    ids = np.argsort(-(logp[None, :] + rng.gumbel(size=(T, E))), axis=1)[:, :K]
    w = rng.random((T, K)).astype(np.float32) + 0.1
    return GlobalRouting.split_evenly(ids, w, E, R)


def relay_plan(plan):
    """A two-hop Plan from a single-hop one: every rank first hands all its tokens (plus one zero
    padding row) to rank r+1, which then sends the original messages on."""
    R = plan.ranks
    (hop,) = plan.hops
    s_R = plan.tokens_per_rank_R
    src = np.repeat(np.arange(R), s_R + 1)
    row = np.concatenate([np.append(np.arange(s), -1) for s in s_R])
    relay = (src + 1) % R
    dst_row = np.concatenate([np.arange(s + 1) for s in s_R])
    rows_at_relay = np.zeros(R, np.int64)
    rows_at_relay[(np.arange(R) + 1) % R] = s_R + 1
    hop_a = Hop("global", src, row, relay, dst_row, rows_at_relay)
    new_src = (hop.src_rank_M + 1) % R
    order = np.lexsort((hop.dst_rank_M, new_src))
    hop_b = Hop("global", new_src[order], hop.src_row_M[order], hop.dst_rank_M[order], hop.dst_row_M[order],
                hop.dst_rows_R)
    return dataclasses.replace(plan, strategy="relay", hops=(hop_a, hop_b))


def copy_plan(routing, ctx):
    """A single-hop Plan with two copies per rank (rank r computes rank r+1's first expert and rank
    r+2's second expert for the even tokens that pick them), dedup and token_padding 2 (padding)."""
    R = ctx.cluster.ranks
    epn = E // R
    home_rank = np.arange(E) // epn
    copy_rank = np.repeat(np.arange(R), 2)
    copy_expert = ((copy_rank + 1 + np.tile([0, 1], R)) % R) * epn + np.tile([0, 1], R)
    rank = np.concatenate([home_rank, copy_rank])
    expert = np.concatenate([np.arange(E), copy_expert])
    home = np.concatenate([home_rank, home_rank[copy_expert]])
    order = np.argsort(rank, kind="stable")
    rank, expert, home = rank[order], expert[order], home[order]
    slot_home_of = np.flatnonzero(rank == home)
    home_slot = np.empty(E, np.int64)
    home_slot[expert[slot_home_of]] = slot_home_of
    copy_slot = np.full(E, -1)
    cs = np.flatnonzero(rank != home)
    copy_slot[expert[cs]] = cs
    ids = routing.topk_ids_TK
    even = (np.arange(ids.shape[0]) % 2 == 0)[:, None]
    entry_slot = np.where(even & (copy_slot[ids] >= 0), copy_slot[ids], home_slot[ids])
    plan = plan_from_slots(routing, ctx.cluster, ctx.costs, Slots(rank, expert, home), entry_slot, dedup=True,
                           token_padding=2)
    return dataclasses.replace(plan, strategy="copies")


def all_plans(routing, ctx):
    out = []
    for name, spec in available().items():
        out.append(make_plan(name, routing, ctx))
        if "dedup" in spec.options:
            out.append(make_plan(name, routing, ctx, dedup=True))
    base = make_plan("alltoall", routing, ctx, dedup=True)
    out += [relay_plan(base), relay_plan(make_plan("alltoall", routing, ctx)), copy_plan(routing, ctx)]
    return out


def expected_rows(plan, x_TC, rank):
    lo, hi = plan.row_off_R()[rank], plan.row_off_R()[rank + 1]
    re = plan.row_entry_W[lo:hi]
    want = x_TC[np.maximum(re, 0) // plan.top_k].copy()
    want[re < 0] = 0
    return want


# -- in-process emulation -------------------------------------------------------------------------

def traceable(T, R, seed, skew):
    """Routing, context, and token rows that name themselves: (token, source rank, 1000 + token);
    plus each rank's token offsets."""
    routing = routing_for(T, R, seed, skew)
    x = np.stack([np.arange(T), routing.src_rank_T(), 1000 + np.arange(T)], axis=1).astype(np.float64)
    return routing, PlanContext.default(E, R, G), x, routing.tok_off_R()


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 30), seed=st.integers(0, 10_000), skew=st.sampled_from([0.0, 1.0, 3.0]))
def test_emulated_hops_move_rows_where_the_plan_says(T, seed, skew):
    R = 4
    routing, ctx, x, off = traceable(T, R, seed, skew)
    for plan in all_plans(routing, ctx):
        assert validate(plan) == [], plan.strategy
        hs = [build_handle(plan, r, ctx.placement.home_E) for r in range(R)]
        got = emulate_dispatch(hs, [torch.from_numpy(x[off[r]:off[r + 1]]) for r in range(R)])
        for r in range(R):
            np.testing.assert_array_equal(got[r].numpy(), expected_rows(plan, x, r), err_msg=plan.strategy)
        back = torch.cat(emulate_combine(hs, got)).numpy()
        kept = (plan.entry_rank_TK >= 0).sum(1)
        np.testing.assert_array_equal(back, x * kept[:, None], err_msg=plan.strategy)


def emulate_direct(plan, x_R):
    """Every rank's DirectIndex of a single-hop ``plan``, its runs delivered in one process:
    (dispatched layouts, combined tokens, runs used)."""
    R = plan.ranks
    ds = [direct_index(plan, r, max_runs=None) for r in range(R)]
    if ds[0] is None:
        return None
    msgs = {}
    for r, d in enumerate(ds):
        send = d.remote_send.gather(x_R[r])
        for p, tag, a, _, m in d.send_runs:
            msgs[(r, p, tag)] = send[a:a + m]
    lay = []
    for r, d in enumerate(ds):
        out = torch.full((d.rows, x_R[r].shape[1]), float("nan"), dtype=x_R[r].dtype)
        for p, tag, a, _, m in d.recv_runs:
            out[a:a + m] = msgs.pop((p, r, tag))
        for _, _, a, b, m in d.self_runs:
            out[a:a + m] = x_R[r][d.list_src[b:b + m]]
        out[d.pad_pos] = 0
        lay.append(out)
    assert not msgs  # every message sent was received exactly once
    back = {}
    for r, d in enumerate(ds):
        for p, tag, a, _, m in d.recv_runs:
            back[(r, p, tag)] = lay[r][a:a + m]
    toks, split = [], []
    for r, d in enumerate(ds):
        lst = torch.full((d.list_rows, x_R[r].shape[1]), float("nan"), dtype=x_R[r].dtype)
        for p, tag, _, b, m in d.send_runs:
            lst[b:b + m] = back.pop((p, r, tag))
        # the split reduce reads kept rows from the layout and never the kept rows' list positions (NaN)
        out = torch.full((x_R[r].shape[0], x_R[r].shape[1]), float("nan"), dtype=x_R[r].dtype)
        split.append(d.split.add_remote(d.split.local(lay[r], None, out), lst, None))
        for _, _, a, b, m in d.self_runs:
            lst[b:b + m] = lay[r][a:a + m]
        toks.append(d.list_map.scatter_add(lst))
    assert not back
    return lay, toks, sum(len(d.send_runs) + len(d.self_runs) for d in ds), split


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 30), seed=st.integers(0, 10_000), skew=st.sampled_from([0.0, 1.0, 3.0]))
def test_direct_runs_move_rows_where_the_plan_says(T, seed, skew):
    """The point-to-point runs (direct="on") deliver the same layout and combine as the Plan says."""
    R = 4
    routing, ctx, x, off = traceable(T, R, seed, skew)
    x_R = [torch.from_numpy(x[off[r]:off[r + 1]]) for r in range(R)]
    used = 0
    for plan in all_plans(routing, ctx):
        got = emulate_direct(plan, x_R) if len(plan.hops) == 1 else None
        if got is None:
            continue
        lay, toks, runs, split = got
        used += 1
        for r in range(R):
            np.testing.assert_array_equal(lay[r].numpy(), expected_rows(plan, x, r), err_msg=plan.strategy)
        kept = (plan.entry_rank_TK >= 0).sum(1)
        np.testing.assert_array_equal(torch.cat(toks).numpy(), x * kept[:, None], err_msg=plan.strategy)
        np.testing.assert_array_equal(torch.cat(split).numpy(), x * kept[:, None], err_msg=plan.strategy)
        # a run is one (source, destination) block: never more runs than rows, at least one per pair used
        assert runs <= int(plan.hops[0].src_rank_M.size)
        assert runs >= len(set(zip(plan.hops[0].src_rank_M.tolist(), plan.hops[0].dst_rank_M.tolist())))
    assert used >= 2  # the flat all-to-all (and others) qualify


def test_direct_runs_apply_only_to_one_to_one_hops():
    routing = routing_for(40, 4, 3)
    ctx = PlanContext.default(E, 4, G)
    flat = make_plan("alltoall", routing, ctx)
    assert direct_index(flat, 0, max_runs=None) is not None
    # dedup: one received row feeds several layout rows -> not direct
    assert direct_index(make_plan("alltoall", routing, ctx, dedup=True), 0, max_runs=None) is None
    # the size rule: tiny runs are not worth a message each
    assert direct_index(flat, 0, max_runs=64, min_run_bytes=64 << 10, row_bytes=4) is None
    assert direct_index(flat, 0, max_runs=0, min_run_bytes=0) is None


@pytest.mark.parametrize("csr", [True, False])
def test_split_reduce_equals_the_weighted_reduce_of_the_whole_list(csr, monkeypatch):
    """Combine's two-part reduce (kept rows from the layout, received rows from the list) equals the
    weighted reduce of the whole receive list; ``csr=False``: the path for builds without the sparse
    accumulate."""
    import moonep_sim.gloo.handle as handle_mod

    if not csr:
        monkeypatch.setattr(handle_mod, "csr_addmm_ok", lambda dtype: False)
    plan = make_plan("alltoall", routing_for(40, 4, 3), PlanContext.default(E, 4, G))
    g = torch.Generator().manual_seed(0)
    for r in range(4):
        d = direct_index(plan, r, max_runs=None)
        y = torch.randn(d.rows, 5, generator=g, dtype=torch.float64)
        w = torch.rand(d.rows, generator=g, dtype=torch.float64)
        lst = torch.randn(d.list_rows, 5, generator=g, dtype=torch.float64)
        lw = torch.rand(d.list_rows, generator=g, dtype=torch.float64)
        for _, _, a, b, m in d.self_runs:  # the whole list holds the kept rows too
            lst[b:b + m], lw[b:b + m] = y[a:a + m], w[a:a + m]
        want = d.list_map.scatter_add(lst * lw[:, None])  # index_add_, an independent kernel
        np.testing.assert_allclose(d.list_map.reduce(lst, lw).numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
        holes, hw = lst.clone(), lw.clone()
        for _, _, a, b, m in d.self_runs:
            holes[b:b + m], hw[b:b + m] = float("nan"), float("nan")
        out = torch.full((d.split.tokens, 5), float("nan"), dtype=torch.float64)  # memory reused across calls
        got = d.split.add_remote(d.split.local(y, w, out), holes, hw)
        assert got.data_ptr() == out.data_ptr()
        assert d.self_runs and d.send_runs, "both parts are exercised"
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


def test_hand_built_plans_are_valid_and_multi_hop():
    routing = routing_for(21, 4, 0)
    ctx = PlanContext.default(E, 4, G)
    base = make_plan("alltoall", routing, ctx, dedup=True)
    relay = relay_plan(base)
    assert validate(relay) == [] and len(relay.hops) == 2
    assert (relay.hops[0].src_row_M == -1).sum() == 4  # one padding row per rank
    cp = copy_plan(routing, ctx)
    assert validate(cp) == [] and cp.weight_copies == 8 and cp.padded > 0


def test_out_of_scope_hop_is_rejected():
    routing = routing_for(9, 4, 1)
    ctx = PlanContext.default(E, 4, G)
    plan = make_plan("alltoall", routing, ctx)
    (hop,) = plan.hops
    bad = dataclasses.replace(plan, hops=(dataclasses.replace(hop, scope="intra_node"),))
    with pytest.raises(PlanError, match="outside its scope group"):
        for r in range(4):
            build_handle(bad, r, ctx.placement.home_E)


# -- spawned gloo ranks ---------------------------------------------------------------------------

def movement_worker(rank, world, T, seed, direct="off"):
    from moonep_sim.gloo.buffer import Buffer

    routing = routing_for(T, world, seed)
    off = routing.tok_off_R()
    lo, hi = int(off[rank]), int(off[rank + 1])
    x = np.stack([np.arange(T), routing.src_rank_T(), 1000 + np.arange(T), -np.arange(T)], 1).astype(np.float64)
    ctx = PlanContext.default(E, world, G, RowCosts.for_rows(H, 8, 3))
    buf = Buffer(capacity=int(routing.tokens_per_rank_R.max()), hidden=H, top_k=K, num_experts=E,
                 planner=planner("alltoall", ctx), gpus_per_node=G, timeout_s=30, dispatch_dtype=torch.float64,
                 direct=direct)
    ids = torch.from_numpy(routing.topk_ids_TK[lo:hi])
    w = torch.from_numpy(routing.topk_weights_TK[lo:hi])
    xr = torch.from_numpy(x[lo:hi])
    # the Buffer's own exchange reproduces the global routing on every rank
    g, _ = buf.exchange_routing(ids, w)
    res = {"exchange_ok": bool(np.array_equal(g.topk_ids_TK, routing.topk_ids_TK)
                               and np.array_equal(g.topk_weights_TK, routing.topk_weights_TK))}
    gen = torch.Generator().manual_seed(seed)
    home_w = (torch.randn(E, 2, 3, generator=gen, dtype=torch.float64), torch.randn(E, 5, generator=gen,
                                                                                     dtype=torch.float64))
    for i, plan in enumerate(all_plans(routing, ctx)):
        h = buf.handle_for(plan)
        res[f"{i}/direct"] = h.direct is not None
        rows = buf.rows.dispatch_rows(h, xr)
        res[f"{i}/rows_bad"] = int((rows.numpy() != expected_rows(plan, x, rank)).any(axis=1).sum())
        res[f"{i}/rows"] = int(rows.shape[0])
        ones = torch.ones(h.rows, dtype=torch.float64)
        back = buf.combine(rows, h, ones)
        kept = (plan.entry_rank_TK[lo:hi] >= 0).sum(1)
        res[f"{i}/kx_bad"] = float(np.abs(back.numpy() - x[lo:hi] * kept[:, None]).max(initial=0))
        # a reused handle moves other rows the same way (no exchange, no planning)
        rows2, _, cu, _ = buf.dispatch(2 * xr, handle=h)
        res[f"{i}/reuse_bad"] = int((rows2 != 2 * rows).sum())
        res[f"{i}/cu_ok"] = bool(cu[-1] == h.rows)
        # prefetch: copies equal their home weights; reduce: sums over copies land at home
        local = tuple(t[h.slots.home_experts] for t in home_w)
        copies = buf.prefetch_weight(h, local)
        copy_experts = h.slots.expert[h.slots.is_copy]
        res[f"{i}/prefetch_bad"] = int(sum((c != t[copy_experts]).sum() for c, t in zip(copies, home_w)))
        res[f"{i}/copies"] = int(copy_experts.numel())
        cg = tuple(torch.full_like(c, float(rank + 1)) * (1 + torch.arange(c.shape[0], dtype=c.dtype)).view(
            -1, *[1] * (c.dim() - 1)) for c in copies)
        lg = tuple(torch.zeros_like(t) for t in local)
        red = buf.reduce_grad(h, cg, lg)
        # expected: copy j on rank r contributes (r+1)*(j+1) to its expert's home
        fetch = plan.is_copy_S() | (buf.placement.home_E[plan.slot_expert_S] != plan.slot_rank_S)
        cr, ce = plan.slot_rank_S[fetch], plan.slot_expert_S[fetch]
        j = np.concatenate([np.arange((cr == r).sum()) for r in range(world)])
        want_E = np.bincount(ce, weights=(cr + 1) * (j + 1), minlength=E)
        want = want_E[h.slots.home_experts.numpy()]
        res[f"{i}/reduce_bad"] = int(sum((r_.reshape(r_.shape[0], -1) != torch.from_numpy(want)[:, None]).sum()
                                         for r_ in red))
        res[f"{i}/hops"] = len(plan.hops)
        res[f"{i}/name"] = plan.strategy
    # results are recycled only once nothing references them (a fresh Buffer: an empty pool)
    buf = Buffer(capacity=int(routing.tokens_per_rank_R.max()), hidden=H, top_k=K, num_experts=E,
                 planner=planner("alltoall", ctx), gpus_per_node=G, timeout_s=30, dispatch_dtype=torch.float64,
                 direct=direct)
    h = buf.handle_for(make_plan("alltoall", routing, ctx))
    a = buf.rows.dispatch_rows(h, xr)
    a_ptr, a_copy = a.data_ptr(), a.clone()
    b = buf.rows.dispatch_rows(h, 2 * xr)
    res["held_not_reused"] = bool(b.data_ptr() != a_ptr and torch.equal(a, a_copy))
    del a
    c = buf.rows.dispatch_rows(h, 3 * xr)
    res["freed_reused"] = bool(c.data_ptr() == a_ptr and torch.equal(c, 3 * a_copy))
    return res


@pytest.mark.slow  # spawns 4 gloo ranks
@pytest.mark.parametrize("direct", ["off", "on"])
def test_rows_land_where_the_plan_says_on_gloo(direct):
    world = 4
    results = spawn_ranks("test_gloo_buffer:movement_worker", world, dict(T=23, seed=5, direct=direct), timeout_s=180,
                          pythonpath=[HERE])
    for r in results:
        assert r.ok, f"rank {r.rank} failed (exit {r.returncode}): {r.output[-3000:]}"
    res = [r.result for r in results]
    assert all(r["exchange_ok"] for r in res)
    n = len([k for k in res[0] if k.endswith("/name")])
    names = set()
    for i in range(n):
        name = res[0][f"{i}/name"]
        names.add((name, res[0][f"{i}/hops"]))
        for r in res:
            assert r[f"{i}/rows_bad"] == 0, (name, r)
            assert r[f"{i}/kx_bad"] == 0.0, name
            assert r[f"{i}/reuse_bad"] == 0 and r[f"{i}/cu_ok"], name
            assert r[f"{i}/prefetch_bad"] == 0 and r[f"{i}/reduce_bad"] == 0, name
    # the table covers multi-hop plans and plans with copies, non-vacuously
    assert ("relay", 2) in names
    assert all(r["held_not_reused"] for r in res) and all(r["freed_reused"] for r in res)
    used_direct = {res[0][f"{i}/name"] for i in range(n) if res[0][f"{i}/direct"]}
    if direct == "off":
        assert not used_direct
    else:  # single- and multi-hop plans took the point-to-point path
        assert {"alltoall", "relay"} <= used_direct, used_direct
    i_copies = [i for i in range(n) if res[0][f"{i}/name"] == "copies"][0]
    assert all(r[f"{i_copies}/copies"] == 2 for r in res)
    assert sum(r[f"{i}/rows"] for r in res for i in range(n)) > 0


# -- input validation in a world of one rank --------------------------------------------------

@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from moonep_sim.gloo.teardown import shutdown

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    shutdown()  # the Buffers' heartbeat joined before the store goes (no broken-pipe warning at exit)


def test_bad_input_is_rejected_before_communication(world_of_one):
    from moonep_sim.gloo.buffer import Buffer

    ctx = PlanContext.default(4, 1)
    buf = Buffer(capacity=4, hidden=H, top_k=2, num_experts=4, planner=planner("alltoall", ctx), timeout_s=5)
    x = torch.zeros(4, H)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    w = torch.ones(4, 2)
    seq0 = buf.comm.tracker.seq   # collectives this rank has entered
    with pytest.raises(ConfigError, match=r"tokens \(5\) must be <= capacity \(4\)"):
        buf.dispatch(torch.zeros(5, H), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2))
    with pytest.raises(ConfigError, match=r"x shape \(\[4, 3\]\) must be \[s, 4\]"):
        buf.dispatch(torch.zeros(4, 3), ids, w)
    with pytest.raises(ConfigError, match="x dtype"):
        buf.dispatch(x.long(), ids, w)
    with pytest.raises(ConfigError, match="topk_ids dtype"):
        buf.dispatch(x, ids.float(), w)
    with pytest.raises(ConfigError, match=r"topk_ids shape \(\[4, 3\]\) must be \[4, 2\]"):
        buf.dispatch(x, torch.zeros(4, 3, dtype=torch.long), w)
    with pytest.raises(ConfigError, match=r"topk_ids value \(4\) must lie in \[0, 4\)"):
        buf.dispatch(x, ids + 1, w)
    with pytest.raises(ConfigError, match="must be distinct experts"):
        buf.dispatch(x, torch.zeros(4, 2, dtype=torch.long), w)
    with pytest.raises(ConfigError, match="topk_weights shape"):
        buf.dispatch(x, ids, torch.ones(4))
    assert buf.comm.tracker.seq == seq0  # nothing was communicated
    with pytest.raises(ConfigError, match=r"strategy \('nope'\) must be one of"):
        planner("nope", ctx)
    with pytest.raises(ConfigError, match="option"):
        planner("alltoall", ctx, bogus=1)
    with pytest.raises(ConfigError, match=r"planner \('alltoall'\) must be callable"):
        Buffer(capacity=4, hidden=H, top_k=2, num_experts=4, planner="alltoall")
    # a good batch works in a world of one, and uneven sizes (s < capacity, s = 0) are fine
    out = buf.combine(*buf.dispatch(x[:3], ids[:3], w[:3])[0:1], buf.dispatch(x[:3], ids[:3], w[:3])[3])
    assert out.shape == (3, H)
    rows, rw, cu, h = buf.dispatch(x[:0], ids[:0], w[:0])
    assert rows.shape == (0, H) and buf.combine(rows, h).shape == (0, H)


def test_dispatch_keeps_the_handles_weights_out_of_the_graph(world_of_one):
    """The routing weights dispatch returns carry the gradient to the router; the handle's own row
    weights (reused by later dispatches and by combine's default) never join an autograd graph."""
    from moonep_sim.gloo.buffer import Buffer

    buf = Buffer(capacity=4, hidden=H, top_k=2, num_experts=4, planner=planner("alltoall", PlanContext.default(4, 1)),
                 timeout_s=5)
    # float64 rows: the handle's weights are float64 too, so no dtype conversion copies them
    x = torch.randn(4, H, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    rows, rw, _, h = buf.dispatch(x, torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]), w)
    assert h.layout.weights.dtype == x.dtype
    assert rw.requires_grad and not h.layout.weights.requires_grad and h.layout.weights.grad_fn is None
    buf.combine(rows, h, rw).sum().backward()
    assert w.grad is not None and x.grad is not None
    rows2, rw2, _, _ = buf.dispatch(x, handle=h)  # reusing the handle, then combining with its weights
    assert not h.layout.weights.requires_grad
    buf.combine(rows2, h).sum().backward()  # a fresh graph: nothing from the first step is reused


@pytest.mark.parametrize("strategy, opts", [("alltoall", {}), ("alltoall", {"dedup": True}), ("hierarchical", {}),
                                            ("deepep", {}), ("moonep", {}), ("capacity", {}), ("eplb", {})])
@pytest.mark.parametrize("max_runs, min_bytes, row_bytes", [(None, 0, 1), (16, 64 << 10, 4), (64, 0, 1), (2, 0, 1)])
def test_the_simulator_sees_the_executors_direct_decision(strategy, opts, max_runs, min_bytes, row_bytes):
    """``moonep_sim.plan.direct.last_hop_is_direct`` (numpy, what the simulator calls) decides as
    the executor's ``direct_index`` does, for every rank."""
    from moonep_sim.plan.direct import last_hop_is_direct

    routing = routing_for(64, 4, 5)
    plan = make_plan(strategy, routing, PlanContext.default(E, 4, G), **opts)
    want = last_hop_is_direct(plan, row_bytes, max_runs, min_bytes)
    for r in range(4):
        assert (direct_index(plan, r, max_runs, min_bytes, row_bytes) is not None) == want
