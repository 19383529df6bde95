"""The gloo MoE layer equals the dense single-process layer, forward and backward, for every strategy.

One spawn of 4 gloo ranks (2 nodes of 2) runs every registered strategy (and its dedup variant);
the parent compares outputs and all gradients with ``dense_moe`` (drops of dropping strategies
applied to the reference).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rank_spawner import spawn_ranks
from moonep_sim.gloo.moe import dense_moe, init_experts
from moonep_sim.strategies import available

pytestmark = pytest.mark.slow  # every test here starts gloo ranks in processes (-m "not slow" skips them)

HERE = str(Path(__file__).resolve().parent)
CFG = dict(T=42, H=8, F=6, E=8, K=3, G=2, seed=3)


def variants() -> list[tuple[str, dict]]:
    out = []
    for name, spec in available().items():
        out.append((name, {}))
        if "dedup" in spec.options:
            out.append((name, {"dedup": True}))
    return out


def make_inputs(T, H, F, E, seed, **_):
    g = torch.Generator().manual_seed(seed)
    # a shared component skews the router, so some experts are hot (copies, drops happen)
    x = torch.randn(T, H, generator=g, dtype=torch.float64) + 1.5 * torch.randn(H, generator=g, dtype=torch.float64)
    router_w = torch.randn(E, H, generator=g, dtype=torch.float64) / H ** 0.5
    grad_out = torch.randn(T, H, generator=g, dtype=torch.float64)
    experts = init_experts(E, H, F, seed, dtype=torch.float64)
    return x, router_w, grad_out, experts


def tokens_of(rank, world, T):
    per = np.full(world, T // world)
    per[: T % world] += 1
    off = np.concatenate([[0], np.cumsum(per)])
    return int(off[rank]), int(off[rank + 1])


def layer_worker(rank, world, variants, T, H, F, E, K, G, seed, direct="auto"):
    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.gloo.moe import EPMoELayer
    from moonep_sim.plan import RowCosts
    from moonep_sim.strategies import PlanContext, planner

    x, router_w, grad_out, experts = make_inputs(T, H, F, E, seed)
    lo, hi = tokens_of(rank, world, T)
    res = {}
    for i, (name, opts) in enumerate(variants):
        ctx = PlanContext.default(E, world, G, RowCosts.for_rows(H, 8))
        buf = Buffer(capacity=(T + world - 1) // world, hidden=H, top_k=K, num_experts=E,
                     planner=planner(name, ctx, **opts), gpus_per_node=G, timeout_s=30, dispatch_dtype=torch.float64,
                     direct=direct)
        layer = EPMoELayer(buf, F, router_w=router_w, experts_w=experts).double()
        xr = x[lo:hi].clone().requires_grad_(True)
        out = layer(xr)
        (out * grad_out[lo:hi]).sum().backward()
        p = layer.last_handle.plan
        res.update({f"{i}/out": out.detach(), f"{i}/gx": xr.grad, f"{i}/grouter": layer.router_w.grad,
                    f"{i}/ggate": layer.gate.grad, f"{i}/gup": layer.up.grad, f"{i}/gdown": layer.down.grad,
                    f"{i}/home": layer.home_experts, f"{i}/keep": p.entry_rank_TK >= 0,
                    f"{i}/copies": np.array(layer.last_handle.num_copies), f"{i}/hops": np.array(len(p.hops)),
                    f"{i}/direct": np.array(layer.last_handle.direct is not None)})
    return res


@pytest.mark.parametrize("direct", ["auto", "on"])
def test_layer_matches_dense_reference_for_every_strategy(direct):
    """direct="on": the last hop by point-to-point runs wherever the Plan allows (at these tiny
    sizes "auto" keeps every Plan on all_to_all_single)."""
    vs = variants()
    world = 4
    results = spawn_ranks("test_gloo_layer:layer_worker", world, dict(variants=vs, direct=direct, **CFG),
                          timeout_s=240, pythonpath=[HERE])
    for r in results:
        assert r.ok, f"rank {r.rank} failed (exit {r.returncode}): {r.output[-3000:]}"
    x, router_w, grad_out, experts = make_inputs(**CFG)
    seen_copies = seen_multihop = seen_drops = False
    seen_direct = set()
    for i, (name, opts) in enumerate(vs):
        keep = results[0].result[f"{i}/keep"]
        xx = x.clone().requires_grad_(True)
        rw = router_w.clone().requires_grad_(True)
        ew = [w.clone().requires_grad_(True) for w in experts]
        ref = dense_moe(xx, rw, ew, CFG["K"], keep_TK=keep)
        (ref * grad_out).sum().backward()
        out = np.concatenate([r.result[f"{i}/out"] for r in results])
        gx = np.concatenate([r.result[f"{i}/gx"] for r in results])
        grouter = sum(r.result[f"{i}/grouter"] for r in results)
        tag = f"{name} {opts}"
        np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-9, atol=1e-10, err_msg=tag)
        np.testing.assert_allclose(gx, xx.grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=tag)
        np.testing.assert_allclose(grouter, rw.grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=tag)
        for j, key in enumerate(("ggate", "gup", "gdown")):
            got = np.zeros_like(ew[j].grad.numpy())
            for r in results:
                got[r.result[f"{i}/home"]] += r.result[f"{i}/{key}"]
            np.testing.assert_allclose(got, ew[j].grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=f"{tag} {key}")
        seen_copies |= sum(int(r.result[f"{i}/copies"]) for r in results) > 0
        seen_multihop |= int(results[0].result[f"{i}/hops"]) > 1
        seen_drops |= not keep.all()
        if all(bool(r.result[f"{i}/direct"]) for r in results):
            seen_direct.add((name, int(results[0].result[f"{i}/hops"])))
    # the case table must cover the regimes it claims (when the strategies producing them exist)
    names = {n for n, _ in vs}
    assert seen_multihop == bool(names & {"hierarchical", "deepep"})
    assert seen_drops == ("capacity" in names)
    assert seen_copies == bool(names & {"moonep", "eplb"})
    if direct == "auto":
        assert not seen_direct
    elif "alltoall" in names:
        assert ("alltoall", 1) in seen_direct, seen_direct
        if "hierarchical" in names:  # a two-hop Plan whose last hop goes by runs
            assert ("hierarchical", 2) in seen_direct, seen_direct


def replica_cache_worker(rank, world, T, H, F, E, K, G, seed):
    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.gloo.moe import EPMoELayer
    from moonep_sim.strategies import PlanContext, planner

    x, router_w, grad_out, experts = make_inputs(T, H, F, E, seed)
    lo, hi = tokens_of(rank, world, T)
    buf = Buffer(capacity=(T + world - 1) // world, hidden=H, top_k=K, num_experts=E,
                 planner=planner("eplb", PlanContext.default(E, world, G)), gpus_per_node=G, timeout_s=30,
                 dispatch_dtype=torch.float64)
    layer = EPMoELayer(buf, F, router_w=router_w, experts_w=experts).double()
    res = {}
    for step in range(3):
        if step == 2:
            buf.invalidate_replicas()
        layer.zero_grad(set_to_none=True)
        xr = x[lo:hi].clone().requires_grad_(True)
        out = layer(xr)
        (out * grad_out[lo:hi]).sum().backward()
        h = layer.last_handle
        res.update({f"{step}/out": out.detach(), f"{step}/gx": xr.grad, f"{step}/ggate": layer.gate.grad,
                    f"{step}/gup": layer.up.grad, f"{step}/gdown": layer.down.grad,
                    f"{step}/replica_fetches": np.array(buf.rows.replica_fetches),
                    f"{step}/fetch_calls": np.array(buf.rows.fetch_calls),
                    f"{step}/last_fetched": np.array(buf.rows.last_fetched),
                    f"{step}/residents": np.array(int(h.weights.residents.pos.numel())),
                    f"{step}/plan_copies": np.array(int(h.plan.is_copy_S()[h.plan.rank_slots(rank)].sum()))})
    return res


def test_resident_replicas_are_fetched_once_and_cached():
    """eplb's replicas are resident in its Plan: the executor fetches them on the first step only
    (same placement -> same cache key), gives identical outputs and gradients from the cache, and
    fetches again after ``invalidate_replicas``."""
    world = 4
    results = spawn_ranks("test_gloo_layer:replica_cache_worker", world, CFG, timeout_s=120, pythonpath=[HERE])
    for r in results:
        assert r.ok, f"rank {r.rank} failed (exit {r.returncode}): {r.output[-3000:]}"
    res = [r.result for r in results]
    assert sum(int(r["0/residents"]) for r in res) > 0  # the case exercises resident replicas
    assert all(int(r["0/plan_copies"]) == 0 for r in res)  # eplb's Plan has no per-step copies
    for r in res:
        assert int(r["0/replica_fetches"]) == 1 and int(r["0/fetch_calls"]) == 1
        assert int(r["0/last_fetched"]) == int(r["0/residents"])
        # second step, same placement: no collective, nothing fetched
        assert int(r["1/replica_fetches"]) == 1 and int(r["1/fetch_calls"]) == 1
        assert int(r["1/last_fetched"]) == 0
        # after invalidate_replicas the next step fetches again
        assert int(r["2/replica_fetches"]) == 2 and int(r["2/fetch_calls"]) == 2
        assert int(r["2/last_fetched"]) == int(r["0/residents"])
        for step in (1, 2):
            for key in ("out", "gx", "ggate", "gup", "gdown"):
                np.testing.assert_array_equal(r[f"{step}/{key}"], r[f"0/{key}"], err_msg=f"step {step} {key}")
    # and the gradients reach the master weights: equal to the dense reference
    x, router_w, grad_out, experts = make_inputs(**CFG)
    xx = x.clone().requires_grad_(True)
    ew = [w.clone().requires_grad_(True) for w in experts]
    ref = dense_moe(xx, router_w, ew, CFG["K"])
    (ref * grad_out).sum().backward()
    out = np.concatenate([res[r]["1/out"] for r in range(world)])
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(np.concatenate([res[r]["1/gx"] for r in range(world)]), xx.grad.numpy(),
                               rtol=1e-9, atol=1e-10)
    E = CFG["E"]
    for j, key in enumerate(("ggate", "gup", "gdown")):
        got = np.zeros_like(ew[j].grad.numpy())
        for r in range(world):
            got[np.arange(E) // (E // world) == r] += res[r][f"1/{key}"]
        np.testing.assert_allclose(got, ew[j].grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=key)
