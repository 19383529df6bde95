"""Planning speed and memory: every registered strategy on one Kimi K3-scale layer.

Default shape: R=64 ranks (8 per node), E=896 experts, K=16, 8192 tokens per rank -- 524,288
tokens, 8,388,608 (token, k) entries. Routing: expert popularity ``p_e ∝ exp(N(0, sigma))`` drawn
once, then K distinct experts per token by the Gumbel top-k trick (``argpartition`` of
``log p + Gumbel`` over experts, in chunks of tokens); the realised maxvio is printed.

For each strategy in ``moonep_sim.strategies.available()`` (default options), the plan is built
``--repeats`` times; the table shows the first (cold) run, the best and the median run (wall
clock), the best CPU time of this process (user + system seconds, and the two apart: system time
is mostly the kernel handing out fresh zeroed pages for large arrays), entries per second of the
best wall-clock run, and each strategy's peak memory: what planning allocates (numpy allocations
traced with ``tracemalloc`` during one extra run, excluding the routing input; ``--no-memory``
skips it) and the process's peak RSS over the timed runs (Linux; reset before each strategy).
For ``moonep`` it also reports the time of ``validate(plan)``, and the speed ratio of the
vectorised planner against the slow pure-Python reference planner of ``tests/test_moonep.py`` on a
small case (measured in this run).

    python benchmarks/bench_plan.py                       # K3 scale, all strategies
    python benchmarks/bench_plan.py --strategies moonep --repeats 5
    python benchmarks/bench_plan.py --tokens-per-rank 1024 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from moonep_sim.io import write_text_atomic  # noqa: E402
from moonep_sim.plan import GlobalRouting, validate  # noqa: E402
from moonep_sim.strategies import PlanContext, available, make_plan  # noqa: E402


def gumbel_topk_routing(ranks: int, experts: int, top_k: int, tokens_per_rank: int, sigma: float, seed: int,
                        chunk: int = 16384) -> GlobalRouting:
    """Lognormal popularity, K distinct experts per token (Gumbel top-k), tokens split evenly."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(0.0, sigma, experts).astype(np.float32)
    T = ranks * tokens_per_rank
    ids = np.empty((T, top_k), dtype=np.int64)
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        u = rng.random((b - a, experts), dtype=np.float32)
        score = logp - np.log(-np.log(np.maximum(u, np.float32(1e-30))))  # log p + Gumbel
        ids[a:b] = np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]
    w = rng.random((T, top_k), dtype=np.float32)
    w /= w.sum(axis=1, keepdims=True)
    return GlobalRouting.split_evenly(ids, w, experts, ranks)


def maxvio(counts_E: np.ndarray) -> float:
    return float(counts_E.max() / counts_E.mean() - 1.0)


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: ``/proc/self/clear_refs``); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """This process's peak RSS since start or the last :func:`reset_peak_rss` (Linux VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def time_strategy(name: str, routing: GlobalRouting, ctx: PlanContext, repeats: int) -> dict:
    """Plan ``repeats`` times: wall and CPU seconds (user and system apart) of each run, and the
    process's peak RSS while planning (routing and earlier plans' freed memory included)."""
    times, cpu, user, system = [], [], [], []
    gc.collect()
    can_reset = reset_peak_rss()
    for _ in range(repeats):
        gc.collect()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        plan = make_plan(name, routing, ctx)
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        user.append(r1.ru_utime - r0.ru_utime)
        system.append(r1.ru_stime - r0.ru_stime)
        cpu.append(user[-1] + system[-1])
        del plan
    n = routing.num_tokens * routing.top_k
    best = min(times)
    b = int(np.argmin(cpu))
    return {"strategy": name, "first_s": times[0], "best_s": best, "median_s": statistics.median(times),
            "first_cpu_s": cpu[0], "best_cpu_s": cpu[b], "best_cpu_user_s": user[b], "best_cpu_system_s": system[b],
            "entries_per_s": n / best, "runs": len(times),
            "peak_rss_bytes": peak_rss_bytes() if can_reset else None}


def traced_peak_bytes(name: str, routing: GlobalRouting, ctx: PlanContext) -> int:
    """Peak bytes allocated (numpy arrays included) while planning, over what existed before."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    plan = make_plan(name, routing, ctx)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del plan
    return int(peak)


def reference_ratio(repeats: int = 3) -> dict:
    """Vectorised moonep vs the pure-Python reference planner (tests/test_moonep.py), small case."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_moonep import ref_moonep  # the slow, obviously-correct planner
    R, E, K, s = 8, 64, 8, 1024
    routing = gumbel_topk_routing(R, E, K, s, sigma=1.0, seed=1)
    ctx = PlanContext.default(E, R, 4)
    ids = routing.topk_ids_TK.tolist()
    tpr = routing.tokens_per_rank_R.tolist()
    t_ref = min(_timed(lambda: ref_moonep(ids, tpr, E, R)) for _ in range(repeats))
    t_fast = min(_timed(lambda: make_plan("moonep", routing, ctx)) for _ in range(max(repeats, 5)))
    return {"ranks": R, "experts": E, "top_k": K, "entries": R * s * K, "reference_s": t_ref,
            "moonep_s": t_fast, "speedup": t_ref / t_fast}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--sigma", type=float, default=0.6, help="lognormal popularity skew")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default="", help="comma-separated (default: every registered strategy)")
    ap.add_argument("--no-validate", action="store_true", help="skip timing validate(moonep plan)")
    ap.add_argument("--no-memory", action="store_true", help="skip the extra traced run per strategy (peak memory)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    a = ap.parse_args(argv)

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    routing = gumbel_topk_routing(a.ranks, a.experts, a.top_k, a.tokens_per_rank, a.sigma, a.seed)
    gen_s = time.perf_counter() - t0
    n = routing.num_tokens * routing.top_k
    mv = maxvio(routing.counts_E())
    ctx = PlanContext.default(a.experts, a.ranks, a.gpus_per_node)
    print(f"layer: R={a.ranks} (G={a.gpus_per_node}/node) E={a.experts} K={a.top_k} s={a.tokens_per_rank} "
          f"-> {routing.num_tokens} tokens, {n} entries; sigma={a.sigma} maxvio={mv:.2f} (generated in {gen_s:.1f} s)")
    names = [s for s in a.strategies.split(",") if s] or list(available())
    rows = []
    print(f"{'strategy':14s} {'first s':>8s} {'best s':>8s} {'median s':>9s} {'best cpu s':>11s} {'(user':>6s} "
          f"{'+ sys)':>6s} {'Mentries/s':>11s} {'peak GiB':>9s} {'RSS GiB':>8s}")
    run_peak = 0  # the whole run's peak RSS (each strategy resets the kernel's count)
    for name in names:
        run_peak = max(run_peak, peak_rss_bytes() or 0)
        try:
            r = time_strategy(name, routing, ctx, a.repeats)
            r["traced_peak_bytes"] = None if a.no_memory else traced_peak_bytes(name, routing, ctx)
        except Exception as e:  # a strategy that fails is reported, the others still run
            rows.append({"strategy": name, "error": f"{type(e).__name__}: {e}"})
            print(f"{name:14s} error: {type(e).__name__}: {str(e)[:80]}")
            continue
        rows.append(r)
        peak = "-" if r["traced_peak_bytes"] is None else f"{r['traced_peak_bytes'] / 2**30:.2f}"
        rss = "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 2**30:.2f}"
        print(f"{name:14s} {r['first_s']:8.2f} {r['best_s']:8.2f} {r['median_s']:9.2f} {r['best_cpu_s']:11.2f} "
              f"{r['best_cpu_user_s']:6.2f} {r['best_cpu_system_s']:6.2f} {r['entries_per_s'] / 1e6:11.2f} "
              f"{peak:>9s} {rss:>8s}")
    print("best cpu s: user + system time of the run with the least; peak GiB: bytes numpy allocated while "
          "planning (tracemalloc, one extra run, routing excluded); RSS GiB: the process's peak RSS over the "
          "timed runs (routing and the process's other memory included)")
    result = {"loadavg_1min_start": load0, "ranks": a.ranks, "gpus_per_node": a.gpus_per_node, "experts": a.experts, "top_k": a.top_k,
              "tokens_per_rank": a.tokens_per_rank, "entries": n, "sigma": a.sigma, "maxvio": mv, "seed": a.seed,
              "strategies": rows}
    if "moonep" in names:
        peak = next((r.get("traced_peak_bytes") for r in rows if r["strategy"] == "moonep"), None)
        peak = traced_peak_bytes("moonep", routing, ctx) if peak is None else peak
        plan = make_plan("moonep", routing, ctx)
        extra = {"moonep_traced_peak_bytes": peak, "moonep_weight_copies": plan.weight_copies,
                 "moonep_max_rows": int(plan.real_rows_R().max()), "moonep_min_rows": int(plan.real_rows_R().min())}
        print(f"moonep: peak planning memory {peak / 2**30:.2f} GiB (tracemalloc, routing input excluded); "
              f"{plan.weight_copies} expert copies; real rows per rank {extra['moonep_min_rows']}.."
              f"{extra['moonep_max_rows']}")
        if not a.no_validate:
            t1 = time.perf_counter()
            errs = validate(plan)
            extra["validate_s"] = time.perf_counter() - t1
            extra["invariant_violations"] = errs
            print(f"validate(moonep plan): {extra['validate_s']:.2f} s, {len(errs)} violation(s)")
        del plan
        ref = reference_ratio()
        extra["reference"] = ref
        print(f"reference ratio (R={ref['ranks']} E={ref['experts']} K={ref['top_k']}, {ref['entries']} entries): "
              f"pure-Python reference {ref['reference_s'] * 1e3:.0f} ms, moonep {ref['moonep_s'] * 1e3:.1f} ms "
              f"-> {ref['speedup']:.0f}x")
        result.update(extra)
    result["loadavg_1min_end"] = os.getloadavg()[0]
    print(f"load average (1 min) at start {result['loadavg_1min_start']:.1f}, at end {result['loadavg_1min_end']:.1f} "
          f"on {os.cpu_count()} CPUs (other processes slow the wall times)")
    rss = max(run_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    result["process_peak_rss_bytes"] = rss
    print(f"process peak RSS (routing, all plans, validate): {rss / 2**30:.2f} GiB")
    if a.json:
        write_text_atomic(a.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
