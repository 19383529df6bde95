"""Measure this machine for the ``local-gloo`` calibration (``moonep_sim.experiments.calibrate``
fits and writes the constants).

What is measured (each in P spawned processes, for every P asked, all ranks at once):

- gloo ``all_to_all_single`` with a message of m bytes from every rank to every other rank, for a
  few sizes m; each repeat is bracketed by a barrier and its time is the slowest rank's; the
  figure kept is the median over repeats (robust to the odd descheduled process).
- the expert SwiGLU ``(silu(x W1) * (x W3)) W2`` in float32 with torch, all P ranks computing at
  the same time, timed until every rank is done (a barrier, whose bare cost is subtracted), so
  CPU sharing between processes is part of the figure; a few row counts.
- a 32 MiB float32 copy, and the executor's local passes over rows (``index_select`` /
  ``index_add_`` of 4 MiB of float32 rows into reused and fresh tensors), all P ranks at once.
- in this process: the CPU time to plan a synthetic layer (``Plan.plan_seconds``) and to plan it
  and build one rank's handle; the difference is the handle's cost.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import CommError, require
from moonep_sim.io import write_text_atomic

DEFAULT_NPROCS = (2, 4)
DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
QUICK_SIZES_BYTES = (4 << 10, 256 << 10, 2 << 20)
# SwiGLU shapes (rows, hidden, ffn) timed for the compute fit
DEFAULT_SWIGLU_SHAPES = ((64, 512, 1024), (256, 512, 1024), (1024, 512, 1024))
QUICK_SWIGLU_SHAPES = ((64, 512, 1024), (512, 512, 1024))


# -- measurement -------------------------------------------------------------------------------
def _worker(rank: int, world: int, store: str, sizes: Sequence[int], shapes: Sequence[tuple[int, int, int]],
            repeats: int, warmup: int, out: str, inner_flops: float = 2e9) -> None:
    """One process of a measurement run (module level: picklable for the spawn start method)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        a2a = _measure_alltoall(world, sizes, repeats, warmup)
        mem = _measure_memcopy(world, repeats)
        passes = _measure_rowpasses(rank, world, repeats)
        comp = _measure_swiglu(rank, world, shapes, repeats, warmup, inner_flops)
        if rank == 0:
            write_text_atomic(out, json.dumps({"alltoall": a2a, "swiglu": comp, "memcopy": mem, "rowpass": passes}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure_alltoall(world: int, sizes: Sequence[int], repeats: int, warmup: int) -> list[dict[str, Any]]:
    """gloo ``all_to_all_single`` per message size, the slowest rank's seconds per repeat."""
    import torch
    import torch.distributed as dist

    # all-to-all as the executor runs it (into a freshly allocated output), the sizes
    # interleaved (each round times every size, the order rotated), so a load change on the
    # machine reaches every size alike
    xs = [torch.ones(max(1, int(size) // 4) * world) for size in sizes]
    t_NS = torch.zeros(len(xs), repeats, dtype=torch.float64)
    for i in range(-warmup, repeats):
        for k in range(len(xs)):
            j = (k + i) % len(xs)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(torch.empty_like(xs[j]), xs[j])
            if i >= 0:
                t_NS[j, i] = time.perf_counter() - t0
    dist.all_reduce(t_NS, op=dist.ReduceOp.MAX)
    a2a: list[dict[str, Any]] = [{"nproc": world, "bytes_per_peer": int(x.numel() // world) * 4,
                                  "seconds": t_NS[j].tolist()} for j, x in enumerate(xs)]
    return a2a


def _timed(fn, repeats: int, skip: int = 0):
    """Seconds of ``fn()`` per repeat (after ``skip`` untimed ones), each started after a barrier,
    the slowest rank's: float64 [repeats]. What ``fn`` returns is freed after the clock stops."""
    import torch
    import torch.distributed as dist

    t_S = torch.zeros(repeats, dtype=torch.float64)
    for i in range(-skip, repeats):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        if i >= 0:
            t_S[i] = time.perf_counter() - t0
        del out
    dist.all_reduce(t_S, op=dist.ReduceOp.MAX)
    return t_S


def _measure_memcopy(world: int, repeats: int) -> list[dict[str, Any]]:
    """A 32 MiB float32 copy into a reused and into a fresh tensor, all ranks at once."""
    import torch

    # memory bandwidth: a 32 MiB float32 copy, all ranks at once
    src = torch.ones(8 << 20)
    dst = torch.empty_like(src)
    m_S = _timed(lambda: dst.copy_(src), repeats)
    # the same copy into a freshly allocated tensor (what a pass over copied expert weights does)
    f_S = _timed(src.clone, repeats)
    return [{"nproc": world, "bytes": src.numel() * 4, "seconds": m_S.tolist()},
            {"nproc": world, "bytes": src.numel() * 4, "seconds": f_S.tolist(), "fresh": True}]


def _measure_rowpasses(rank: int, world: int, repeats: int) -> list[dict[str, Any]]:
    """The executor's local passes over rows (``index_select`` / ``index_add_``), all ranks at once."""
    import torch

    # the executor's local passes over rows: a gather of rows in a random order (index_select)
    # and a scatter-add of rows into random places (index_add_), each into a reused workspace and
    # into a fresh tensor (the executor does both; a fresh one pays its page faults), 4 MiB of
    # float32 rows (2048 of 512: the row count of a small replayed layer per rank)
    nrows, width = 2048, 512
    rows_x = torch.ones(nrows, width)
    rows_y = torch.empty_like(rows_x)
    perm = torch.randperm(nrows, generator=torch.Generator().manual_seed(rank))
    ops = {"gather": lambda: torch.index_select(rows_x, 0, perm, out=rows_y),
           "gather_fresh": lambda: torch.index_select(rows_x, 0, perm),
           "scatter_add": lambda: rows_y.index_add_(0, perm, rows_x),
           "scatter_add_fresh": lambda: torch.zeros_like(rows_x).index_add_(0, perm, rows_x)}
    passes = []
    for op, fn in ops.items():
        def four(fn=fn) -> None:
            for _ in range(4):
                fn()
        c_S = _timed(four, repeats, skip=1) / 4
        passes.append({"nproc": world, "op": op, "bytes": nrows * width * 4, "seconds": c_S.tolist()})
    return passes


def _measure_swiglu(rank: int, world: int, shapes: Sequence[tuple[int, int, int]], repeats: int, warmup: int,
                    inner_flops: float) -> list[dict[str, Any]]:
    """The expert SwiGLU per (rows, hidden, ffn) shape, timed until every rank is done (a bare
    barrier's cost subtracted)."""
    import torch
    import torch.distributed as dist

    # the cost of a bare barrier, subtracted from "compute then barrier" below
    barrier_s = float(_timed(dist.barrier, repeats).median())
    comp: list[dict[str, Any]] = []
    for rows, hidden, ffn in shapes:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(rows, hidden, generator=g)
        w1 = torch.randn(hidden, ffn, generator=g) * 0.02
        w3 = torch.randn(hidden, ffn, generator=g) * 0.02
        w2 = torch.randn(ffn, hidden, generator=g) * 0.02

        def swiglu() -> torch.Tensor:
            return (torch.nn.functional.silu(x @ w1) * (x @ w3)) @ w2

        def calls(inner: int) -> None:
            for _ in range(inner):
                swiglu()
            dist.barrier()  # the time until *every* rank is done: CPU sharing counts

        flops = 6 * rows * hidden * ffn
        inner = max(1, round(inner_flops / flops))  # enough calls per repeat to dwarf the barrier
        for _ in range(warmup):
            swiglu()
        t_S = ((_timed(lambda: calls(inner), repeats) - barrier_s) / inner).clamp_min(1e-7)
        comp.append({"nproc": world, "rows": rows, "hidden": hidden, "ffn": ffn,
                     "flops": flops, "seconds": t_S.tolist(), "calls_per_repeat": inner,
                     "barrier_s": barrier_s})
    return comp


def measure(nproc: int, sizes_bytes: Sequence[int], swiglu_shapes: Sequence[tuple[int, int, int]],
            repeats: int = 9, warmup: int = 2, timeout_s: float = 300.0,
            inner_flops: float = 2e9) -> dict[str, list[dict[str, Any]]]:
    """Run one measurement with ``nproc`` spawned processes; returns ``{"alltoall": [...], "swiglu": [...]}``.

    Each record keeps every repeat's time (``seconds``, the slowest rank's). Processes are
    terminated if anything fails, times out, or the caller is interrupted (Ctrl-C).
    """
    import torch.multiprocessing as mp

    require(nproc >= 2, f"nproc ({nproc}) must be >= 2: an all-to-all needs two processes")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moonep-cal-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        env_backup = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned children
        procs = []
        try:
            for r in range(nproc):
                p = ctx.Process(target=_worker, args=(r, nproc, store, list(sizes_bytes), list(swiglu_shapes),
                                                      repeats, warmup, out, inner_flops), daemon=True)
                p.start()
                procs.append(p)
            deadline = time.monotonic() + timeout_s
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
            bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
            if bad:
                what = "timed out" if any(c is None for _, c in bad) else "failed"
                raise CommError(f"calibration with nproc ({nproc}) {what}: ranks {[r for r, _ in bad]} "
                                f"(exit codes {[c for _, c in bad]})")
            return json.loads(Path(out).read_text())
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(1)
            if env_backup is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_backup


def measure_planning(repeats: int = 7) -> dict[str, Any]:
    """CPU time to plan one small synthetic layer (512 tokens, E=64, K=8, 4 ranks) with the flat
    all-to-all planner and build one rank's handle -- what every replay rank does per layer before
    moving rows. A fixed synthetic routing, not a replayed trace. Median of ``repeats``.
    ``plan_seconds``: the planner alone (as ``Plan.plan_seconds`` records it); ``seconds``: planner
    plus handle; their difference is the handle's cost (the ``[planning] fixed_us`` constant when
    the planner's own measured time is charged per Plan)."""
    from moonep_sim.gloo.handle import build_handle
    from moonep_sim.plan import GlobalRouting
    from moonep_sim.strategies import PlanContext, make_plan

    rng = np.random.default_rng(0)
    T, E, K, R = 512, 64, 8, 4
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K]
    w = np.full((T, K), 1.0 / K, np.float32)
    routing = GlobalRouting.split_evenly(ids, w, E, R)
    ctx = PlanContext.default(E, R)
    t_S, p_S = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        plan = make_plan("alltoall", routing, ctx)
        build_handle(plan, 0, ctx.placement.home_E, w)
        t_S.append(time.perf_counter() - t0)
        p_S.append(float(plan.plan_seconds))
    return {"tokens": T, "experts": E, "top_k": K, "ranks": R, "seconds": t_S[1:], "plan_seconds": p_S[1:]}


__all__ = ["DEFAULT_NPROCS", "DEFAULT_SIZES_BYTES", "DEFAULT_SWIGLU_SHAPES", "QUICK_SIZES_BYTES",
           "QUICK_SWIGLU_SHAPES", "measure", "measure_planning"]
