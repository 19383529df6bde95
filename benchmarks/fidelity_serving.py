"""Serving fidelity: AIConfigurator's silicon sample (measured TTFT and TPOT of real deployments)
against `moonep-sim serve`, predicted as a user would (docs/results/fidelity_serving.md).

The sample is ``systems/silicon_sample.csv`` inside the ``aiconfigurator-core`` wheel (unzip it;
``--csv`` names the file). Rows kept: expert parallelism > 1 in some pool, a model this project has
a preset for (DeepSeek-V3/R1 -> deepseek-v3, Kimi-K2.5 -> kimi-k2 (ASSUMED: K2's text shape),
Qwen3-235B-A22B -> qwen3-235b, gpt-oss-120b), a recorded concurrency; every system has a preset
(b200_sxm -> b200, b300_sxm -> b300, gb200 -> gb200-nvl72, gb300 -> gb300-nvl72, h100_sxm ->
h100-cx7, h200_sxm -> h200-cx7). ``--per-group N`` keeps at most N rows per (model, system,
backend, mode) and ``--max-concurrency`` leaves out the rows above it (both off by default: every
row); ``--limit`` the first N rows, cheapest first.

Each row is predicted as a user would run it: the row's layout per pool (``read_layout``: world =
tp x attention DP; ``Parallel(tp, dp, ep=moe_ep, etp=moe_tp, dp_attention=dp > 1)``; a k x k-GPU
record of a k-GPU deployment read as its id names it), workers, ISL/OSL fixed, a closed loop at the
row's concurrency over ``--n-factor`` x concurrency requests, FP8 weights (0.5 B for NVFP4 rows,
gpt-oss's MXFP4 and Kimi-K2.5's INT4 experts, counted for the whole model) and FP8 GEMM peaks, BF16
KV, 0.95 of HBM for weights + KV, generated routing ``sigma=0.5`` with ``--draws`` draws, and the
strategy the backend's wide-EP path uses by default (sglang: DeepEP low-latency, ``deepep-ll``;
trtllm: its all-to-all, ``alltoall``; vllm: all-gather / reduce-scatter, ``allgather``). Nothing
is fitted to these rows.

Fast by grouping: one step-time model per (model, system, strategy, pool role and layout) over
the union of its rows' shapes (``merge_grids``) serves every concurrency, ISL and OSL of that
pool; models are built, then rows run, in ``--jobs`` processes; models are cached per commit;
rows are streamed to ``--json`` (a rerun skips those already there).

    python benchmarks/fidelity_serving.py --csv /tmp/aic_x/aiconfigurator_core/systems/silicon_sample.csv \
        --jobs 2 --draws 1 --n-factor 2 --json rows.jsonl --table docs/results/data/fidelity_serving_rows.csv \
        --out docs/results/fidelity_serving.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {"deepseek-ai/DeepSeek-R1": ("deepseek-v3", 1.0), "deepseek-ai/DeepSeek-V3": ("deepseek-v3", 1.0),
          "nvidia/DeepSeek-R1-NVFP4": ("deepseek-v3", 0.5), "nvidia/DeepSeek-V3.1-NVFP4": ("deepseek-v3", 0.5),
          "moonshotai/Kimi-K2.5": ("kimi-k2", 0.5), "Qwen/Qwen3-235B-A22B-FP8": ("qwen3-235b", 1.0),
          "openai/gpt-oss-120b": ("gpt-oss-120b", 0.5)}
SYSTEMS = {"b200_sxm": "b200", "gb200": "gb200-nvl72", "h100_sxm": "h100-cx7", "h200_sxm": "h200-cx7",
           "b300_sxm": "b300", "gb300": "gb300-nvl72"}
#: HBM share for weights + KV: the engines' KV fraction applies to the memory left after the
#: weights (TensorRT-LLM's kv_cache_free_gpu_memory_fraction 0.9; SGLang's static fraction is tuned
#: up to ~0.95 on these deployments), so a user states more than serve's 0.85 default
MEM_FRACTION = 0.95
STRATEGY = {"sglang": "deepep-ll", "trtllm": "alltoall", "vllm": "allgather"}


def _i(v, default=1) -> int:
    return default if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)


def read_layout(row, pre: str = "") -> tuple[int, int, int, int, bool]:
    """(tp, attention dp, moe ep, moe tp, read differently) of a row's pool. A pool recorded as
    k x k GPUs -- tp (or attention dp) k^2 with moe tp k x moe ep k, k > 1 -- is read as the k-GPU
    deployment (tp or dp k, EP k, moe tp 1): every such row whose id names its layout names
    ``tp{k}_ep{k}`` (194 of the 333 agg rows; the others are the same configurations without it),
    and rows recorded both ways carry the same measurements (e.g. ``dsr1_b200_sglang_fp4_agg_8192x1024
    _c128_cfg202`` and ``..._c128_tp4_ep4_1042``): the sample's k^2 is its conversion's product. A
    row whose id names another tp (``..._tp4_epnone_...`` recorded as tp 4 = moe tp 2 x ep 2) is
    kept as recorded."""
    tp, dp = _i(row[f"{pre}tp_size"]), _i(row[f"{pre}attention_dp_size"])
    ep, etp = _i(row[f"{pre}moe_ep_size"]), _i(row[f"{pre}moe_tp_size"])
    k = ep
    named = re.search(r"_tp(\d+)", str(row.get("id", "")))
    if k > 1 and etp == k and tp * dp == k * k and k * k in (tp, dp) and (named is None or int(named.group(1)) == k):
        return (k, 1, k, 1, True) if tp == k * k else (1, k, k, 1, True)
    return tp, dp, ep, etp, False


def _pool(row, pre: str, conc: int, role: str) -> dict:
    tp, dp, ep, etp, _ = read_layout(row, pre)
    workers = _i(row.get(f"{pre}num_workers"), 1) if pre else 1
    run = max(1, -(-conc // (workers * dp)))
    if role == "prefill":
        run = min(run, 64)
    lay = {"tp": tp, "dp": dp, "ep": ep, "etp": etp, "dp_attention": dp > 1}
    return {"workers": workers, "layout": lay, "max_running": run, "token_budget": max(8192, run)}


def row_setup(row, n_factor: int = 4) -> dict:
    """How a user runs the row: model, weight bytes, topology, strategy, concurrency, the deployment
    document and the closed-loop requests (``n_factor x concurrency`` of them, at least 16)."""
    model, wbytes = MODELS[row["model_path"]]
    if str(row.get("moe_quant_mode", "")).lower() == "nvfp4" or str(row.get("precision", "")).lower() == "fp4":
        wbytes = min(wbytes, 0.5)  # the row's experts in NVFP4 (counted as 0.5 B for the whole model)
    conc = int(re.search(r"silicon_concurrency=(\d+)", row["silicon_data_source"]).group(1))
    if row["mode"] == "agg":
        doc = {"worker": _pool(row, "", conc, "both")}
    else:
        doc = {"prefill": _pool(row, "prefill_", conc, "prefill"), "decode": _pool(row, "decode_", conc, "decode")}
    doc["weight_bytes"] = wbytes
    doc["mem_fraction"] = MEM_FRACTION
    read = any(read_layout(row, pre)[4] for pre in (("",) if row["mode"] == "agg" else ("prefill_", "decode_")))
    return {"model": model, "topology": SYSTEMS[row["system"]], "strategy": STRATEGY[row["backend"]], "conc": conc,
            "doc": doc, "layout_read": read, "isl": int(row["isl"]), "osl": int(row["osl"]), "n": max(n_factor * conc, 16)}


def _requests(su: dict):
    from moonep_sim.serve.requests import synthetic

    return synthetic(su["n"], su["isl"], su["osl"], 0, concurrency=su["conc"])


def pool_key(su: dict, pool) -> tuple:
    """What one step-time model serves: model, topology, strategy and the pool's role and layout
    (every concurrency, ISL and OSL of rows on that pool share it)."""
    lay = pool.layout
    return (su["model"], su["topology"], su["strategy"], pool.role,
            (lay.tp, lay.dp, lay.ep, lay.etp, bool(lay.dp_attention)))


def merge_grids(grids: list[dict]) -> dict:
    """One grid covering every row's (``grid_for``): decode T in powers of two up to the largest,
    prefill T 16, 64, 256, ... up to the largest, contexts the least and the most (a step's time is
    interpolated linearly in context; the held-out shapes report what that costs)."""
    from moonep_sim.serve import steptime as st

    dec_hi = max(max(g["dec_T"]) for g in grids)
    pre_hi = max(max(g["pre_T"]) for g in grids)
    pre_lo = min(min(g["pre_T"]) for g in grids)
    pre = [t for t in st.pow2_grid(pre_lo, pre_hi) if t == pre_lo or np.log2(t) % 2 == 0 or t >= pre_hi]
    dc = [c for g in grids for c in g["dec_C"]]
    pc = [c for g in grids for c in g["pre_C"]]
    return {"dec_T": st.pow2_grid(1, dec_hi) if dec_hi > 1 else [1], "dec_C": sorted({min(dc), max(dc)}),
            "pre_T": pre, "pre_C": sorted({min(pc), max(pc)})}


def build_pool(task: tuple) -> tuple:
    """One pool's step-time model (a worker process's job): ``(key, grid, draws, holdout, cache)``
    -> ``(key, models, info)``, or ``(key, None, error)`` when the step model refuses it."""
    from moonep_sim.experiments import Scenario
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.experiments.serve import ServeOptions, pool_steptime
    from moonep_sim.models import get_model
    from moonep_sim.serve.deployment import Pool
    from moonep_sim.step.parallel import Parallel

    key, grid, draws, holdout, cache = task
    model, topo, strat, role, (tp, dp, ep, etp, dpa) = key
    try:
        base = Scenario(f"gen:model={model},sigma=0.5", model=model, cluster=8, topology=topo, strategies=[strat])
        opts = ServeOptions(model=model, topology=topo, strategies=(strat,), routing=f"gen:model={model},sigma=0.5",
                            draws=draws, holdout=holdout, cache=cache, gemm_dtype="fp8", scenario=base)
        lay = Parallel(tp=tp, dp=dp, ep=ep, etp=etp, dp_attention=dpa)
        models, info = pool_steptime(Pool(role, 1, lay), None, get_model(model), load_topology(topo), opts,
                                     grid=grid)
        return key, models, info
    except Exception as e:  # a pool the step model refuses (layout, memory) is reported with its rows
        return key, None, f"{type(e).__name__}: {e}"


def predict_row(task: tuple) -> dict:
    """One row through the engine on its pools' prebuilt step-time models (a worker process's job)."""
    from moonep_sim.experiments.serve import ServeOptions, run_serve
    from moonep_sim.serve.deployment import deployment_from_dict

    rid, su, pools = task
    t0 = time.perf_counter()
    try:
        dep = deployment_from_dict(su["doc"], f"row {rid}")
        strat = su["strategy"]
        opts = ServeOptions(model=su["model"], topology=su["topology"], strategies=(strat,),
                            routing=f"gen:model={su['model']},sigma=0.5", gemm_dtype="fp8")
        out = run_serve(_requests(su), dep, opts, pools=pools)
    except Exception as e:  # a row the simulator refuses (memory, layout) is reported, not hidden
        return {"error": f"{type(e).__name__}: {e}"}
    f = out["strategies"][strat]
    return {"conc": su["conc"], "strategy": strat, "deployment": dep.label(), "layout_read": su["layout_read"],
            "ttft_ms": f["ttft_s"]["p50"] * 1e3,
            "tpot_ms": f["tpot_s"]["p50"] * 1e3, "steptime_error": out["steptime_model_error"],
            "preemptions": f["preemptions"], "kv_use_max": f["kv_use_max"], "wall_s": time.perf_counter() - t0,
            "iterations": f["iterations"], "mean_ttft_ms": f["ttft_s"]["mean"] * 1e3,
            "mean_tpot_ms": f["tpot_s"]["mean"] * 1e3}


def tpot_floor_ms(row) -> float:
    """The least time one decode step of the row's decode pool can take on its GPUs: every GPU reads
    its share of the dense weights and the experts its tokens select once (HBM bandwidth from the
    topology preset, weights at the row's bytes): ``(dense / tp + moe_layers x active experts x
    3 x hidden x ffn) x bytes / HBM``, with ``E/ep x (1 - (1 - 1/E)^(B x K))`` experts active on a
    GPU for a batch of B sequences in the pool's worker. A measured TPOT below it means more than
    one token per weight pass (speculative decoding such as MTP)."""
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.models import get_model
    from moonep_sim.step.stack import dense_params

    name, wbytes = MODELS[row["model_path"]]
    if str(row.get("moe_quant_mode", "")).lower() == "nvfp4" or str(row.get("precision", "")).lower() == "fp4":
        wbytes = min(wbytes, 0.5)
    m = get_model(name)
    topo = load_topology(SYSTEMS[row["system"]])
    pre = "" if row["mode"] == "agg" else "decode_"
    tp, dp, ep, etp, _ = read_layout(row, pre)
    workers = _i(row.get(f"{pre}num_workers"), 1) if pre else 1
    conc = int(re.search(r"silicon_concurrency=(\d+)", row["silicon_data_source"]).group(1))
    B = max(conc / workers, 1.0)
    E = m.num_experts
    active = E / ep * (1 - (1 - 1 / E) ** (B * m.top_k))
    dense = float(sum(dense_params(m).values())) / tp
    experts = m.moe_layers * active * 3.0 * m.dispatch_hidden * m.expert_ffn / etp
    return (dense + experts) * wbytes / (topo.gpu_mem_bandwidth_GBps * 1e9) * 1e3


def _err(p, m):
    return (p - m) / m


def eligible(d, max_conc: float | None):
    """The sample's EP > 1 rows: all of them, those of models with a preset here, those on systems
    without a topology preset, and the eligible ones (with ``conc``) under ``max_conc``."""
    ep = d[(d.moe_ep_size.fillna(1) > 1) | (d.prefill_moe_ep_size.fillna(1) > 1) | (d.decode_moe_ep_size.fillna(1) > 1)]
    known = ep[ep.model_path.isin(MODELS)]
    rows = known[known.system.isin(SYSTEMS)].copy()
    rows["conc"] = rows.silicon_data_source.str.extract(r"silicon_concurrency=(\d+)")[0].astype(float)
    rows = rows[rows.conc.notna()]  # a row whose source records no concurrency cannot be run as a closed loop
    if max_conc:
        rows = rows[rows.conc <= max_conc]
    return ep, known, known[~known.system.isin(SYSTEMS)], rows


def _pick(rows, per_group: int) -> list:
    if per_group <= 0:
        return [r for _, r in rows.iterrows()]
    picked = []
    for _, g in rows.groupby(["model_path", "system", "backend", "mode"]):
        g = g.sort_values(["isl", "osl", "conc"])
        idx = np.unique(np.linspace(0, len(g) - 1, min(per_group, len(g))).round().astype(int))
        picked += [g.iloc[i] for i in idx]
    return picked


def _pool_tasks(picked, args) -> tuple[dict, dict, dict]:
    """Per row its setup and pool keys; per pool key the merged grid (rows whose deployment is
    refused are kept with the reason)."""
    from moonep_sim.experiments.serve import grid_for
    from moonep_sim.serve.deployment import deployment_from_dict

    setups, keys, grids, bad = {}, {}, {}, {}
    for r in picked:
        su = row_setup(r, args.n_factor)
        try:
            dep = deployment_from_dict(su["doc"], f"row {r['id']}")
        except Exception as e:
            bad[r["id"]] = f"{type(e).__name__}: {e}"
            continue
        req = _requests(su)
        setups[r["id"]] = su
        keys[r["id"]] = {}
        for p in dep.pools:
            k = pool_key(su, p)
            keys[r["id"]][p.role] = k
            grids.setdefault(k, []).append(grid_for(p, req))
    return setups, keys, {k: merge_grids(g) for k, g in grids.items()}, bad


def _stream(fn, tasks: list, jobs: int, label: str):
    """``fn(task)`` for every task, yielded as each finishes (in ``jobs`` forked processes)."""
    t0 = time.perf_counter()
    if jobs <= 1:
        for i, t in enumerate(tasks):
            yield t, fn(t)
            print(f"  {label} {i + 1}/{len(tasks)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("fork")) as ex:
        futs = {ex.submit(fn, t): t for t in tasks}
        for i, f in enumerate(as_completed(futs)):
            yield futs[f], f.result()
            print(f"  {label} {i + 1}/{len(tasks)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


def _cost(grid: dict, key: tuple) -> float:
    tp, dp = key[4][0], key[4][1]
    return (len(grid["dec_T"]) * len(grid["dec_C"]) + len(grid["pre_T"]) * len(grid["pre_C"]) * 4) * (tp * dp)


def main() -> int:
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True)
    ap.add_argument("--per-group", type=int, default=0, help="at most N rows per model/system/backend/mode (0: all)")
    ap.add_argument("--max-concurrency", type=int, default=0, help="leave out rows above it (0: none)")
    ap.add_argument("--limit", type=int, default=0, help="the first N rows only, cheapest first (a smoke run)")
    ap.add_argument("--n-factor", type=int, default=4, help="closed-loop requests per client")
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--holdout", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    ap.add_argument("--cache", default=f"/tmp/moonep-fidelity-serving-{commit}",
                    help="step-time models (default: per commit, so a step-cost change never reads stale grids)")
    ap.add_argument("--json", default=None, help="per-row results (JSON lines, appended as they finish; rows "
                                                 "already there are not run again)")
    ap.add_argument("--table", default=None, help="the per-row table as CSV")
    ap.add_argument("--out", default=None, help="the results page (markdown)")
    ap.add_argument("--rows", default=None, help="render the page from these saved rows (JSON lines) instead")
    ap.add_argument("--note", default="", help="a line under the title (date, commit, machine load)")
    args = ap.parse_args()
    import pandas as pd

    d = pd.read_csv(args.csv)
    ep, known, no_preset, rows = eligible(d, args.max_concurrency)
    picked = _pick(rows, args.per_group)
    picked.sort(key=lambda r: (r["conc"] * (r["isl"] + r["osl"])))
    if args.limit:
        picked = picked[:args.limit]
    done = {}
    for f in (args.rows, args.json):
        if f and Path(f).is_file():
            done.update({x["id"]: x for x in (json.loads(ln) for ln in Path(f).read_text().splitlines() if ln.strip())})
    todo = [r for r in picked if r["id"] not in done]
    t0, c0 = time.perf_counter(), time.process_time()
    setups, keys, grids, bad = _pool_tasks(todo, args)
    if args.rows:     # render only: the refused deployments' reasons, nothing run
        done.update({r["id"]: _row_doc(r, {"error": bad[r["id"]]}) for r in todo if r["id"] in bad})
        todo, grids = [], {}
    need = sorted(grids, key=lambda k: -_cost(grids[k], k))
    print(f"{len(todo)} rows to predict over {len(need)} step-time models", file=sys.stderr, flush=True)
    built = {}
    for (k, *_), (_, models, info) in _stream(build_pool, [(k, grids[k], args.draws, args.holdout, args.cache)
                                                            for k in need], args.jobs, "step-time model"):
        built[k] = (models, info)
    tasks = []
    for r in todo:
        rid = r["id"]
        miss = [built[k][1] for k in keys.get(rid, {}).values() if built[k][0] is None]
        if rid in bad or miss:
            done[rid] = _row_doc(r, {"error": bad.get(rid) or miss[0]})
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(done[rid]) + "\n")
            continue
        tasks.append((rid, setups[rid], {role: built[k] for role, k in keys[rid].items()}))
    # cheapest first: a run stopped early (its --timeout) has predicted the most rows
    tasks.sort(key=lambda t: t[1]["n"] * (t[1]["isl"] + t[1]["osl"]))
    by_row = {r["id"]: r for r in todo}
    for (rid, *_), p in _stream(predict_row, tasks, args.jobs, "row"):
        done[rid] = row = _row_doc(by_row[rid], p)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"predicted in {time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} CPU s in this "
          f"process (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    res = [done[r["id"]] for r in picked if r["id"] in done]
    by_id = {r["id"]: r for _, r in d.iterrows()}
    for row in res:
        src = by_id[row["id"]]
        row["tpot_floor_ms"] = tpot_floor_ms(src)
        row["workers_given"] = not (isinstance(src["prefill_num_workers"], float)
                                    and math.isnan(src["prefill_num_workers"]))
    if args.table:
        write_table(res, args.table)
    if args.out:
        Path(args.out).write_text(page(res, len(ep), len(known), len(no_preset), len(rows), len(picked), args))
    return 0


def _row_doc(r, p: dict) -> dict:
    row = {"id": r["id"], "model": r["model_path"], "system": r["system"], "backend": r["backend"],
           "mode": r["mode"], "precision": r["precision"], "isl": int(r["isl"]), "osl": int(r["osl"]),
           "measured_ttft_ms": float(r["silicon_ttft_ms"]), "measured_tpot_ms": float(r["silicon_tpot_ms"]), **p}
    if "error" not in p:
        row["ttft_err"] = _err(p["ttft_ms"], row["measured_ttft_ms"])
        row["tpot_err"] = _err(p["tpot_ms"], row["measured_tpot_ms"])
    return row


TABLE_COLUMNS = ("id", "model", "system", "backend", "mode", "precision", "isl", "osl", "conc", "deployment",
                 "strategy", "measured_ttft_ms", "ttft_ms", "ttft_err", "measured_tpot_ms", "tpot_ms", "tpot_err",
                 "tpot_floor_ms", "preemptions", "kv_use_max", "steptime_error", "layout_read", "error")


def write_table(res: list[dict], path: str) -> None:
    """The per-row table as CSV (one row per sample row; ``error`` where the simulator refused it)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TABLE_COLUMNS)
        for r in res:
            w.writerow([r.get(c, "") if not isinstance(r.get(c), float) else f"{r[c]:.6g}" for c in TABLE_COLUMNS])


def _stats(rows, key):
    e = np.abs([r[key] for r in rows if key in r])
    return (float(np.median(e)), float(np.percentile(e, 90)), len(e)) if len(e) else (None, None, 0)


def tags(r: dict) -> list[str]:
    """The mechanisms a predicted row carries (see the page's "What drives the worst rows")."""
    t = []
    if r["measured_tpot_ms"] < r.get("tpot_floor_ms", 0.0):
        t.append("below-floor")
    if r.get("preemptions", 0) > 0:
        t.append("preempts")
    if r["mode"] == "disagg" and not r.get("workers_given", True):
        t.append("no-workers")
    if r.get("layout_read"):
        t.append("k2-read")
    if r.get("precision") == "fp4":
        t.append("fp4-at-fp8")
    if r.get("conc", 0) < 8:
        t.append("conc<8")
    first = r.get("deployment", "").split(" | ")[0]
    m = re.search(r"\[(?:TP(\d+) )?DP(\d+)(-attn)? EP(\d+)( ETP\d+)?\]", first)
    if m and not (m.group(1) is None and m.group(3) and m.group(5) is None and m.group(2) == m.group(4)):
        t.append("prefill-layout")
    return t


def _group_table(ok: list, by, title: str) -> list[str]:
    out = [f"## By {title}", "", f"| {title} | rows | TTFT median | TTFT p90 | TTFT signed median | TPOT median | "
           "TPOT p90 | TPOT signed median |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    keys = sorted({k for r in ok for k in by(r)})
    for k in keys:
        g = [r for r in ok if k in by(r)]
        a, b_, c = _stats(g, "ttft_err")
        x, y, _ = _stats(g, "tpot_err")
        st_, sp = np.median([r["ttft_err"] for r in g]), np.median([r["tpot_err"] for r in g])
        out.append(f"| {k} | {c} | {a:.0%} | {b_:.0%} | {st_:+.0%} | {x:.0%} | {y:.0%} | {sp:+.0%} |")
    return out + [""]


READING = "<!-- reading: kept when the page is regenerated -->"


def page(res, total, known, no_preset, eligible, picked, args) -> str:
    ok = [r for r in res if "ttft_err" in r]
    bad = [r for r in res if "error" in r]
    for r in ok:
        r["tags"] = tags(r)
    out = ["# Serving fidelity: AIConfigurator's silicon sample", "", args.note, "",
           f"Generated by `python benchmarks/fidelity_serving.py --csv .../silicon_sample.csv --jobs {args.jobs} "
           f"--draws {args.draws} --n-factor {args.n_factor}` (aiconfigurator-core 0.12.0's sample). Per-row table: "
           "`docs/results/data/fidelity_serving_rows.csv`.", "",
           f"EP > 1 rows in the sample: {total}; of models with a preset here: {known}; of those on systems without a "
           f"topology preset: {no_preset}; with a recorded concurrency: {eligible}; predicted: {len(ok)}; refused by "
           f"the simulator: {len(bad)} (each with its reason in the table); not run in the time the run had: "
           f"{eligible - len(res)} (the costliest: rows run cheapest first). Every row is predicted as a user would "
           "run it (the module docstring of the benchmark); nothing here was fitted to these rows.", "",
           "Errors are (predicted - measured) / measured of the p50 TTFT and p50 TPOT.", ""]
    m_t, p_t, n = _stats(ok, "ttft_err")
    m_p, p_p, _ = _stats(ok, "tpot_err")
    if n:
        out += [f"**Overall ({n} rows): median |TTFT error| {m_t:.0%}, p90 {p_t:.0%}; median |TPOT error| {m_p:.0%}, "
                f"p90 {p_p:.0%}.** Signed medians: TTFT {np.median([r['ttft_err'] for r in ok]):+.0%}, TPOT "
                f"{np.median([r['tpot_err'] for r in ok]):+.0%}.", ""]
    out += _group_table(ok, lambda r: [r["system"]], "system")
    out += _group_table(ok, lambda r: [r["backend"]], "backend")
    out += _group_table(ok, lambda r: [r["mode"]], "mode")
    out += _group_table(ok, lambda r: [f"{r['system']} / {r['backend']}"], "system and backend")
    out += _group_table(ok, lambda r: r["tags"] or ["none of these"], "mechanism tag")
    out += ["Tags: `below-floor` the measured TPOT is under one decode step's HBM floor on the row's GPUs (several "
            "tokens a weight pass: speculative decoding the columns do not record); `preempts` the prediction "
            "preempts (its KV cache overflows at BF16 KV); `no-workers` a disaggregated row without worker counts "
            "(one per pool assumed); `k2-read` a k x k-GPU record read as k GPUs; `fp4-at-fp8` an NVFP4 row priced "
            "at FP8 GEMM rates (the step has no FP4 GEMM peak); `conc<8` fewer than 8 clients; `prefill-layout` the "
            "prompts run on a pool the layout step prices (attention TP, expert TP or EP over fewer GPUs than the "
            "worker).", ""]
    worst_p = sorted(ok, key=lambda r: -abs(r["tpot_err"]))[:15]
    worst_t = sorted(ok, key=lambda r: -abs(r["ttft_err"]))[:15]
    for title, rows_, k in (("TPOT", worst_p, "tpot"), ("TTFT", worst_t, "ttft")):
        out += [f"## The 15 worst rows by {title}", "", "| id | deployment | ISL/OSL | conc | TTFT meas / pred ms | "
                "TPOT meas / pred ms | tags |", "| --- | --- | --- | ---: | --- | --- | --- |"]
        for r in rows_:
            out.append(f"| {r['id']} | {r['deployment'].replace(' | ', ' ; ')} | {r['isl']}/{r['osl']} | {r['conc']} | "
                       f"{r['measured_ttft_ms']:.0f} / {r['ttft_ms']:.0f} | {r['measured_tpot_ms']:.1f} / "
                       f"{r['tpot_ms']:.1f} | {', '.join(r['tags'])} |")
        out.append("")
    if bad:
        out += ["## Refused", "", "| id | reason |", "| --- | --- |"]
        out += [f"| {r['id']} | {r['error'][:200]} |" for r in bad] + [""]
    keep = ""
    if args.out and Path(args.out).is_file():
        old = Path(args.out).read_text()
        keep = old[old.index(READING):] if READING in old else ""
    return "\n".join(out) + "\n" + (keep or READING + "\n")


if __name__ == "__main__":
    sys.exit(main())
