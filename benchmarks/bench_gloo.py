"""The gloo executor, measured: its overhead over raw all_to_all, and layer time under imbalance.

    python benchmarks/bench_gloo.py overhead   [--ranks 4 --hidden 1024 --tokens 4096 --experts 16 --top-k 2] [--pin] [--malloc-tuning]
    python benchmarks/bench_gloo.py imbalance  [--ranks 4 --hidden 256 --ffn 512 --tokens 2048 --maxvio 0.2,1,10]
    python benchmarks/bench_gloo.py starve     [--ranks 4 --kib 384 --mm 0,10,40]

overhead: in ONE run of R gloo ranks, balanced routing (every expert gets exactly T*K/E entries),
each iteration times (a) ``dispatch + combine`` of the flat ``alltoall`` strategy through the
Buffer including the routing exchange and planning, (b) the same with a reused handle (no
exchange, no planning), (b') the same with ``direct="off"`` (one ``all_to_all_single`` per hop
instead of point-to-point runs), (c) two raw ``all_to_all_single`` calls moving the same rows
with the same split sizes into preallocated buffers, (d) the floor: the least any executor
starting from token-major rows can do with ``all_to_all_single`` (one gather into send order,
(c), one weighted reduce back into token rows, all into preallocated buffers), (e) the floor's
two local passes alone, (f) one plain copy of the rows. The variants alternate within each
iteration (reversed every other one), each after a barrier; a variant's time is the max over
ranks, and the report gives medians over iterations (15 by default) and each variant's ratio to
(c), and the same for CPU time (each rank's user + system seconds over all its threads, mean over
ranks: less sensitive than wall time to other jobs on a shared machine). ``--pin`` pins each rank
(all its threads) to one core.

imbalance: routing by MoonEP's method (lognormal popularity, sigma bisected to the target maxvio,
K distinct experts per token; ``moonep_sim.routing.generators``), one forward layer
(dispatch with exchange and planning, prefetch, SwiGLU experts, combine) per strategy; the
strategies are interleaved within each iteration (so machine noise hits them alike); time =
median over iterations of the max over ranks. Reports what it measures.

starve: an all_to_all_single of ``--kib`` KiB per peer into a fresh output, after a barrier, then
``m`` float32 matmuls (256x512 @ 512x1024) on every rank as soon as its own call returns, for each
m of ``--mm``. Every rank records when it entered and left the call (``time.perf_counter``: the
same clock in every process of the machine); reported: median over iterations of (the last rank
to leave) minus (the last rank to enter) -- the collective's own time once everybody is in it --
per m. With more ranks than cores, ranks that leave early and compute take the cores from those
whose transfer is still in flight (gloo's loopback TCP copies need the CPU too).

Prints a table; ``--json OUT`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

HERE = str(Path(__file__).resolve().parent)


def _sync_time(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_s() -> float:
    """CPU seconds this process has used so far, all its threads (gloo's transport threads too),
    user + system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sync_time_cpu(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this rank) of one call of ``fn`` after a barrier."""
    import torch.distributed as dist

    dist.barrier()
    c0, t0 = _cpu_s(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, _cpu_s() - c0


def _over_ranks(v: list[float], how: str = "max") -> np.ndarray:
    import torch
    import torch.distributed as dist

    t = torch.tensor(v, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    st = torch.stack(out)
    return (st.max(dim=0).values if how == "max" else st.mean(dim=0)).numpy()


def _max_over_ranks(v: list[float]) -> np.ndarray:
    return _over_ranks(v, "max")


def _pin_threads(core: int) -> None:
    """Pin every thread of this process (the caller's, gloo's transport threads, the heartbeat) to
    one core; threads started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that ended meanwhile
            pass


def overhead_worker(rank, world, hidden, tokens, experts, top_k, iters, pin=False):
    import torch
    import torch.distributed as dist

    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.strategies import PlanContext, planner

    T = tokens * world
    a2a = planner("alltoall", PlanContext.default(experts, world))
    ids_all = (np.arange(T)[:, None] * top_k + np.arange(top_k)[None, :]) % experts  # perfectly balanced
    ids = torch.from_numpy(ids_all[rank * tokens:(rank + 1) * tokens].copy())
    w = torch.full((tokens, top_k), 1.0 / top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))
    buf = Buffer(capacity=tokens, hidden=hidden, top_k=top_k, num_experts=experts, planner=a2a,
                 timeout_s=120, validate_plans=False)
    buf_a2a = Buffer(capacity=tokens, hidden=hidden, top_k=top_k, num_experts=experts, planner=a2a,
                     timeout_s=120, validate_plans=False, direct="off")
    h = buf.dispatch(x, ids, w)[3]
    h_a2a = buf_a2a.dispatch(x, ids, w)[3]
    if pin:
        _pin_threads(rank % os.cpu_count())
    hop = h.hops[0]
    send = torch.randn(sum(hop.send_splits), hidden)
    recv = torch.empty(sum(hop.recv_splits), hidden)
    back = torch.empty_like(send)
    group = buf.comm.scopes["global"]
    half = torch.full((back.shape[0],), 0.5)
    red = torch.empty(tokens, hidden)  # the floor's token rows, reused across calls

    def full():
        rows, rw, _, hh = buf.dispatch(x, ids, w)
        buf.combine(rows, hh, rw)

    def reuse():
        rows, rw, _, _ = buf.dispatch(x, handle=h)
        buf.combine(rows, h, rw)

    def reuse_a2a():
        rows, rw, _, _ = buf_a2a.dispatch(x, handle=h_a2a)
        buf_a2a.combine(rows, h_a2a, rw)

    def raw():
        dist.all_to_all_single(recv, send, list(hop.recv_splits), list(hop.send_splits), group=group)
        dist.all_to_all_single(back, recv, list(hop.send_splits), list(hop.recv_splits), group=group)

    def floor():
        # the least any executor starting from token-major rows must do with all_to_all_single:
        # one gather of the token rows into send order, the two all-to-alls, one (weighted) reduce
        # back into token rows -- no layout change, no weighting pass (the reduce is the executor's
        # own weighted reduce, written into preallocated token rows)
        hop.send.gather(x, out=send)
        raw()
        hop.send.reduce(back, half, out=red)

    def passes():  # the floor's two local passes alone
        hop.send.gather(x, out=send)
        hop.send.reduce(back, half, out=red)

    def memcpy():  # one copy of this rank's rows (32 MiB at the defaults)
        back.copy_(send)

    fns = [full, reuse, reuse_a2a, raw, floor, passes, memcpy]
    names = [f.__name__ for f in fns]
    for fn in fns:  # warm-up
        _sync_time(fn)
    rows, cpus = [], []
    for it in range(iters):
        order = fns if it % 2 == 0 else fns[::-1]
        t = {fn.__name__: _sync_time_cpu(fn) for fn in order}
        rows.append([t[n][0] for n in names])
        cpus.append([t[n][1] for n in names])
    mx = _over_ranks(list(np.asarray(rows).ravel())).reshape(iters, len(fns))
    cpu = _over_ranks(list(np.asarray(cpus).ravel()), "mean").reshape(iters, len(fns))
    med = dict(zip(names, np.median(mx, axis=0)))
    med_cpu = dict(zip(names, np.median(cpu, axis=0)))
    row_bytes = hidden * 4
    remote = int(h.plan.hops[0].rows_RR(world).sum() - np.trace(h.plan.hops[0].rows_RR(world))) * row_bytes
    out = {f"{n}_ms": float(v) * 1e3 for n, v in med.items()}
    out.update({f"ratio_{n}": float(med[n] / med["raw"]) for n in names if n != "raw"})
    out["ratio_reuse_to_floor"] = float(med["reuse"] / med["floor"])
    # per iteration, then the median: the two variants of one iteration met the same machine load
    out["ratio_reuse_median_of_iters"] = float(np.median(mx[:, names.index("reuse")] / mx[:, names.index("raw")]))
    out["ratio_reuse_to_floor_median_of_iters"] = float(np.median(mx[:, names.index("reuse")]
                                                                  / mx[:, names.index("floor")]))
    out.update({f"{n}_cpu_ms": float(v) * 1e3 for n, v in med_cpu.items()})
    out.update({f"cpu_ratio_{n}": float(med_cpu[n] / med_cpu["raw"]) for n in names if n != "raw"})
    out.update({"rows_per_rank": int(h.rows), "remote_bytes_per_direction": remote,
                "direct_messages_per_rank": len(h.direct.send_runs) + len(h.direct.recv_runs) if h.direct else 0})
    return out


def imbalance_worker(rank, world, hidden, ffn, tokens, experts, top_k, maxvios, iters, seed):
    import torch

    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.gloo.moe import expert_forward, init_experts
    from moonep_sim.routing.generators import generate_layer
    from moonep_sim.routing.metrics import maxvio as maxvio_of
    from moonep_sim.plan import RowCosts
    from moonep_sim.strategies import PlanContext, available, planner

    T = tokens * world
    full_w = init_experts(experts, hidden, ffn, seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))
    out = {}
    names = list(available())
    ctx = PlanContext.default(experts, world, 0, RowCosts.for_rows(hidden, 4, ffn))
    bufs = {n: Buffer(capacity=tokens, hidden=hidden, top_k=top_k, num_experts=experts, planner=planner(n, ctx),
                      timeout_s=120, validate_plans=False) for n in names}
    for mv in maxvios:
        lr = generate_layer(experts, top_k, T, seed, maxvio=mv)
        real_mv = float(maxvio_of(lr.counts_E()))
        ids = torch.from_numpy(lr.topk_ids_TK[rank * tokens:(rank + 1) * tokens].copy())
        w = torch.from_numpy(lr.topk_weights_TK[rank * tokens:(rank + 1) * tokens].copy())
        layers, info = {}, {}
        for n in names:
            buf = bufs[n]
            home = torch.from_numpy(np.flatnonzero(buf.placement.home_E == rank))
            params = [p[home] for p in full_w]

            def layer(buf=buf, params=params, n=n):
                rows, rw, _, h = buf.dispatch(x, ids, w)
                copies = buf.prefetch_weight(h, params)
                y = expert_forward(rows, h, params, copies)
                buf.combine(y, h, rw)
                info[n] = h

            layers[n] = layer
            _sync_time(layer)  # warm-up
        # strategies interleaved within each iteration, so machine noise hits them alike
        ts = np.array([[_sync_time(layers[n]) for n in names] for _ in range(iters)])
        med = np.median(_max_over_ranks(list(ts.ravel())).reshape(iters, len(names)), axis=0)
        for j, n in enumerate(names):
            p = info[n].plan
            real = p.real_rows_R()
            out[f"{mv}/{n}"] = {"maxvio_target": mv, "maxvio": real_mv, "strategy": n, "layer_ms": float(med[j]) * 1e3,
                                "max_rows": int(p.rows_R().max()), "max_over_mean_rows": float(real.max() / real.mean()),
                                "dropped": p.dropped, "weight_copies": p.weight_copies}
    return {"rows": json.dumps(list(out.values()))}


def starve_worker(rank, world, kib, mms, iters):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = torch.ones((kib << 10) // 4 * world)
    a, b = torch.randn(256, 512), torch.randn(512, 1024)
    out = {}
    for m in mms:
        t_I2 = []
        for i in range(iters + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(torch.empty_like(x), x)
            t1 = time.perf_counter()
            for _ in range(m):
                torch.mm(a, b)
            if i >= 2:
                t_I2.append((t0, t1))
        t = torch.tensor(t_I2, dtype=torch.float64)
        allt = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(allt, t)
        T = torch.stack(allt).numpy()  # [R, iters, (enter, leave)]
        own = T[:, :, 1].max(axis=0) - T[:, :, 0].max(axis=0)
        out[str(m)] = {"collective_ms_median": float(np.median(own)) * 1e3,
                       "entry_spread_ms_median": float(np.median(T[:, :, 0].max(axis=0) - T[:, :, 0].min(axis=0))) * 1e3}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["overhead", "imbalance", "starve"])
    ap.add_argument("--kib", type=int, default=384, help="starve: KiB per peer")
    ap.add_argument("--mm", default="0,10,40", help="starve: matmuls each rank runs right after the call")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--maxvio", default="0.2,1,10")
    ap.add_argument("--iters", type=int, default=None, help="iterations (default 5; overhead: 15; starve: 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--pin", action="store_true", help="overhead: pin rank r (all its threads) to core r mod cores")
    ap.add_argument("--malloc-tuning", action="store_true",
                    help="run the ranks with glibc's mmap disabled and trimming off (MALLOC_MMAP_MAX_=0, "
                         "MALLOC_TRIM_THRESHOLD_=16 GiB): freed blocks stay mapped, so fresh tensors do not "
                         "page-fault (a CPU stand-in for a caching allocator)")
    a = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    sys.path.insert(0, str(Path(HERE).parent / "tests"))  # the tests' rank spawner
    from rank_spawner import spawn_ranks

    env = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(16 << 30)} if a.malloc_tuning else {}

    if a.what == "overhead":
        kw = dict(hidden=a.hidden or 1024, tokens=a.tokens or 4096, experts=a.experts or 16, top_k=a.top_k,
                  iters=a.iters or 15, pin=a.pin)
        res = spawn_ranks("bench_gloo:overhead_worker", a.ranks, kw, timeout_s=900, pythonpath=[HERE], env=env)
    elif a.what == "starve":
        kw = dict(kib=a.kib, mms=[int(v) for v in a.mm.split(",")], iters=a.iters or 12)
        res = spawn_ranks("bench_gloo:starve_worker", a.ranks, kw, timeout_s=900, pythonpath=[HERE], env=env)
    else:
        kw = dict(hidden=a.hidden or 256, ffn=a.ffn, tokens=a.tokens or 2048, experts=a.experts or 32,
                  top_k=a.top_k, maxvios=[float(v) for v in a.maxvio.split(",")], iters=a.iters or 5, seed=a.seed)
        res = spawn_ranks("bench_gloo:imbalance_worker", a.ranks, kw, timeout_s=1800, pythonpath=[HERE], env=env)
    for r in res:
        if not r.ok:
            raise SystemExit(f"rank {r.rank} failed: {r.output[-2000:]}")
    r0 = res[0].result
    report = {"what": a.what, "ranks": a.ranks, **kw, "cpu_count": os.cpu_count(), "malloc_tuning": a.malloc_tuning,
              "loadavg_after": os.getloadavg()}
    if a.what == "overhead":
        report.update(r0)
        print(f"overhead on {a.ranks} ranks, H={kw['hidden']}, {kw['tokens']} tokens/rank, E={kw['experts']} "
              f"K={kw['top_k']}, balanced, fp32 rows ({r0['rows_per_rank']} rows/rank, "
              f"{r0['remote_bytes_per_direction'] / 2**20:.1f} MiB cross-rank per direction), median of {kw['iters']}:")
        print(f"  (malloc tuning {'on' if a.malloc_tuning else 'off'}; load average after "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
        print(f"  ranks pinned one core each: {'yes' if kw['pin'] else 'no'}; wall = max over ranks, CPU = mean "
              f"over ranks of the rank's CPU time (all its threads, user + system)")
        print(f"  {'variant':<34}{'wall':>9}   {'ratio':>6}   {'CPU':>8}   {'ratio':>6}")
        lines = [("raw 2x all_to_all_single", "raw"), ("dispatch+combine (plan each)", "full"),
                 ("dispatch+combine (reuse handle)", "reuse"), ("same, direct='off' (all_to_all)", "reuse_a2a"),
                 ("floor: gather + raw + reduce", "floor"), ("the floor's two local passes", "passes"),
                 ("one memcpy of the rows", "memcpy")]
        for label, n in lines:
            ratio = 1.0 if n == "raw" else r0[f"ratio_{n}"]
            cratio = 1.0 if n == "raw" else r0[f"cpu_ratio_{n}"]
            print(f"  {label:<34}{r0[f'{n}_ms']:7.1f} ms  {ratio:5.2f}x  {r0[f'{n}_cpu_ms']:6.1f} ms  {cratio:5.2f}x")
        print(f"  reused handle / raw: {r0['ratio_reuse']:.2f}x (median of per-iteration ratios "
              f"{r0['ratio_reuse_median_of_iters']:.2f}x; target at 2 ranks: 1.25x); reused handle / floor: "
              f"{r0['ratio_reuse_to_floor']:.2f}x (per iteration {r0['ratio_reuse_to_floor_median_of_iters']:.2f}x; "
              f"target at 4 ranks: 1.1x); {r0['direct_messages_per_rank']} point-to-point messages per rank")
    elif a.what == "starve":
        report["results"] = r0
        print(f"starve on {a.ranks} ranks ({os.cpu_count()} cores): all_to_all_single of {kw['kib']} KiB per peer, "
              f"then m matmuls per rank; median of {kw['iters']}")
        base = r0[str(kw["mms"][0])]["collective_ms_median"]
        for m in kw["mms"]:
            v = r0[str(m)]
            print(f"  m = {m:3d}: collective (last leave - last enter) {v['collective_ms_median']:7.2f} ms "
                  f"({v['collective_ms_median'] / base:.1f}x)   entry spread {v['entry_spread_ms_median']:.2f} ms")
    else:
        rows = json.loads(r0["rows"])
        report["results"] = rows
        print(f"imbalance on {a.ranks} ranks, H={kw['hidden']} F={kw['ffn']}, {kw['tokens']} tokens/rank, "
              f"E={kw['experts']} K={kw['top_k']}; forward layer ms (median of {a.iters}, max over ranks)")
        print(f"  {'strategy':<13}" + "".join(f"  maxvio {m:<6}" for m in kw["maxvios"]))
        for n in sorted({r["strategy"] for r in rows}):
            cells = [r for r in rows if r["strategy"] == n]
            print(f"  {n:<13}" + "".join(f"  {c['layer_ms']:7.1f} ms  " for c in cells)
                  + "   max/mean rows " + ", ".join(f"{c['max_over_mean_rows']:.2f}" for c in cells))
        print("  realised maxvio: " + ", ".join(f"{r['maxvio']:.2f}" for r in rows[:: len({x['strategy'] for x in rows})]))
    if a.json:
        from moonep_sim.io import write_text_atomic
        write_text_atomic(a.json, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
