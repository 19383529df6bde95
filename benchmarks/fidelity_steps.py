"""Fidelity of the step model under parallel layouts against the published step-level development rows.

Usage::

    python benchmarks/fidelity_steps.py              # every row, printed and written to docs/results/fidelity_steps.md
    python benchmarks/fidelity_steps.py --rows 1     # only ANCHORS row 1 (SimuMax B200); --no-write to print only
    python benchmarks/fidelity_steps.py --after-only # skip the "before" column (half the time)
    python benchmarks/fidelity_steps.py --fit-host 65,72.5,80,87.5,95,110   # refit Megatron's host cost per launch

Every row is priced twice: **before** -- with the step's earlier cost model
(``moonep_sim.step.costs.legacy_cost_model``: the roofline at the topology's 60% x m/(m+64), FP8 =
2 x BF16, no measured tables, no launch, cast, permutation or router top-k cost, no host wait, every
communication kernel holding its SMs; both DeepEP transports of row 2 as DeepEP V1, ``deepep``, the
host proxies not modelled) -- and **after**, with the cost model a step uses today
(``step_cost_model``: measured tables where installed, launches, casts, permutation, host waits,
kernel families' SM use and host proxies).

Every development row of ``../shared/ANCHORS.md`` ("Step-level rows for development") this
benchmark covers is predicted as a user would run it: the published layout and batch through
``Scenario.step(parallel=...)`` with the shipped presets and topologies, the strategy that names
the row's dispatcher, balanced routing where the row says so, every layer its own routing, and
no knob chosen to match. Fitted on row 2 and shipped: Megatron-Core's host time per launched
kernel (``moonep_sim.step.host.MEGATRON_HOST_LAUNCH_US``, ``--fit-host`` refits it and gives its
leave-one-out error and the check on row 1, docs/results/host-launch-fit.md), and the host-proxy
per-call cost and throughput of the two DeepEP transports of row 2 (``benchmarks/fit_host_proxy.py``,
docs/results/host-proxy-fit.md), so row 2's DeepEP columns are in-sample; the error of each row
is ``predicted / published - 1``.

- **Row 1** (SimuMax B200 release table, 8 x B200, bf16, seq 4096): DeepSeek-V2 and DeepSeek-V3
  truncated to 4 layers (1 dense + 3 MoE, as the table's DeepSeek rows run them), TP1 EP8 PP1 DP8
  and TP1 EP4 PP2 DP4, 1 sequence per micro-batch, 4 / 8 / 32 micro-batches, ZeRO 1 (its configs'
  ``zero_state``), Megatron's all-to-all dispatcher (``alltoall``); step time (training) and
  allocated memory per GPU (memory). The dense Llama rows of the same table are not run (the
  step model needs an MoE layer).
- **Row 2** (Qwen3-30B-A3B, 64 H100 on p5.48xlarge, EFA): TP8 ETP1, EP16 = TP8 PP4 DP2 and
  EP32 = TP8 PP2 DP4, global batch 256 x 4096, micro-batch 4 or 1, balanced routing, recompute
  off; NCCL all-to-all -> ``alltoall``; DeepEP + UCCL -> ``deepep impl=uccl-ep`` and DeepEP +
  NVSHMEM over libfabric -> ``deepep impl=deepep-nvshmem-efa`` (the kernel families whose CPU proxies
  price each RDMA chunk's proxied operations, ``moonep_sim.plan.kernel``), both at 20 SMs (Megatron-Core's
  ``moe_deepep_num_sms`` default); "overlap on" -> what the row's harness turns on
  (``bench_qwen3_pretrain.py`` beside it: ``overlap_moe_expert_parallel_comm`` with a virtual
  pipeline of 2 and recompute off): the interleaved schedule at vpp 2 run as Megatron-Core's
  combined 1F1B (``overlap_moe_expert_parallel_comm``: each steady forward and backward of two
  micro-batches as one op, the dispatch/combine of each behind the other's compute; the host
  launching both halves, its syncs ASSUMED hidden) and the DP gradient reduce overlapped
  (``overlap_grad_reduce``, ASSUMED from the recipe). Mean iteration seconds.
- **Row 5** (torchtitan with DeepEP, Qwen3-30B-A3B EP8 on B200, the GPU its source's README
  names): the ratios only -- DeepEP over the default all-to-all in tokens/s per GPU at one node,
  16 nodes over one node with DeepEP, memory per GPU 16 nodes over one. As torchtitan runs it
  (``torchtitan/distributed/expert_parallel.py`` and ``deepep/deepep.py`` at the DeepEP
  integration, pytorch/torchtitan 36a4b69): FSDP2 over all GPUs (``zero=3``, the routed experts
  sharded over the ``dp / ep`` ranks of their ``edp`` mesh), gradients reduce-scattered per block
  during the backward (``overlap_grad_reduce``), fp32 parameter shards (16 B per parameter:
  ``FSDP2_OPTIMIZER_BYTES_PER_PARAM``); 8 sequences per GPU per step (the source's local batch
  size); sequence length 2048, derived from the row's 341 TFLOPS at 14,796 tokens/s by torchtitan's
  own FLOP count (:func:`torchtitan_flops_per_token`); DeepEP's normal kernels at 24 SMs (the
  source's B200 EP8 config). The default all-to-all -> ``alltoall`` (it sends every (token, k)
  copy and syncs the host for its splits: ``.to("cpu", non_blocking=False)`` before
  ``all_to_all_single``, as Megatron's dispatcher); DeepEP -> ``deepep`` (normal kernels, the host
  waiting for the received counts). ASSUMED: eager (torchtitan's ``compile.enable`` defaults to
  false), at Megatron's fitted host cost per launch (torchtitan's is not measured; DeepSeek's
  measured eager 28.5 us is the other sourced value, its effect stated in the results page);
  recompute off (torchtitan's default, a full checkpoint of every second block, would put the
  step's activations at about half; not modelled per block).

Groups: training (rows 1, 2 step times), memory (row 1), ratios (row 5); serving has no
development row here (the serving model's own benchmark covers it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ = 4096
#: where each run's op times came from (``setup.compute_sources`` values), gathered for the header
SOURCES: set[str] = set()


def _truncated(name: str, layers: int, dense: int):
    from moonep_sim.models import get_model

    m = get_model(name)
    return dataclasses.replace(m, name=f"{name}-l{layers}", layers=layers, moe_layers=layers - dense)


#: which cost model the rows are being priced with (``main`` sets it): "legacy" or "current"
BEFORE = {"on": False}


def _step(model, topology: str, strategies: str, gpus: int, parallel, gen: str, options=None, context: int = SEQ,
          **step_options):
    from moonep_sim.experiments.scenario import Scenario

    sc = Scenario(routing=f"gen:model={gen},uniform=1", model=model, cluster=(gpus, 0), topology=topology,
                  strategies=strategies, options=options or {})
    res = sc.step("train", parallel=parallel, context=context, **step_options)
    SOURCES.update(str(v).replace(", grouped: a rank's experts read as one GEMM", "") for v in (res.setup.get("compute_sources") or {}).values())
    return res.figures


def row1() -> list[dict]:
    from moonep_sim.step.parallel import Parallel

    pub = {("deepseek-v2", 8, 4): (366.6, 45.63), ("deepseek-v2", 4, 4): (282.1, 44.70),
           ("deepseek-v3", 8, 4): (603.2, 104.30), ("deepseek-v3", 4, 4): (452.2, 114.00),
           ("deepseek-v2", 8, 8): (676.2, None), ("deepseek-v2", 4, 8): (492.6, None),
           ("deepseek-v3", 8, 8): (1101.7, None), ("deepseek-v3", 4, 8): (771.6, None),
           ("deepseek-v2", 8, 32): (2721.3, None), ("deepseek-v2", 4, 32): (1727.7, None),
           ("deepseek-v3", 8, 32): (4141.2, None), ("deepseek-v3", 4, 32): (2718.6, None)}
    out = []
    for (name, ep, mbc), (ms, gib) in pub.items():
        pp, dp = (1, 8) if ep == 8 else (2, 4)
        p = Parallel(pp=pp, dp=dp, ep=ep, micro_batch_size=1, global_batch_size=dp * mbc, zero=1)
        f = _step(_truncated(name, 4, 1), "b200", "alltoall", 8, p, name)["alltoall"]
        case = f"{name} l4 tp1 ep{ep} pp{pp} dp{dp} mbc{mbc}"
        out.append(dict(row=1, group="training", case=case, unit="ms", published=ms, predicted=f["step_time_us"] / 1e3))
        if gib is not None:
            out.append(dict(row=1, group="memory", case=case + " alloc", unit="GiB", published=gib,
                            predicted=f["peak_memory_bytes"] / 2**30))
    return out


def row2() -> list[dict]:
    from moonep_sim.step.parallel import Parallel

    pub = {(16, 4, False): (8.60, 14.81, 9.16), (16, 1, False): (27.89, 37.23, 28.69),
           (16, 4, True): (6.87, 11.21, 7.08), (32, 4, False): (9.24, 26.51, 17.21),
           (32, 1, False): (27.14, 48.22, 34.66), (32, 4, True): (6.29, None, 11.37)}
    out = []
    for (ep, mb, on), (nccl, uccl, nvshmem) in pub.items():
        pp, dp = (4, 2) if ep == 16 else (2, 4)
        p = Parallel(tp=8, pp=pp, dp=dp, ep=ep, micro_batch_size=mb, global_batch_size=256, zero=1,
                     overlap_grad_reduce=on,
                     **(dict(vpp=2, pp_schedule="interleaved", overlap_moe_expert_parallel_comm=True) if on else {}))
        if BEFORE["on"]:   # the proxies were not modelled: both transports are DeepEP V1
            f = _step("qwen3-30b-a3b", "h100-efa", "alltoall,deepep", 64, p, "qwen3-30b-a3b")
            f = {"alltoall": f["alltoall"], "uccl": f["deepep"], "nvshmem": f["deepep"]}
        else:
            # sms=20: Megatron-Core's moe_deepep_num_sms default, which the row's flex dispatcher sets
            f = _step("qwen3-30b-a3b", "h100-efa", "alltoall,deepep", 64, p, "qwen3-30b-a3b",
                      {"deepep": {"impl": "uccl-ep", "sms": 20}})
            g = _step("qwen3-30b-a3b", "h100-efa", "deepep", 64, p, "qwen3-30b-a3b",
                      {"deepep": {"impl": "deepep-nvshmem-efa", "sms": 20}})
            f = {"alltoall": f["alltoall"], "uccl": f["deepep"], "nvshmem": g["deepep"]}
        case = f"EP{ep} TP8 PP{pp} DP{dp} mb{mb} overlap {'on' if on else 'off'}"
        for label, pubv, strat in (("NCCL all-to-all", nccl, "alltoall"), ("DeepEP+UCCL", uccl, "uccl"),
                                   ("DeepEP+NVSHMEM", nvshmem, "nvshmem")):
            if pubv is None:
                out.append(dict(row=2, group="training", case=f"{case} {label}", unit="s", published=None,
                                predicted=f[strat]["step_time_us"] / 1e6, note="preempted: no published figure"))
                continue
            out.append(dict(row=2, group="training", case=f"{case} {label}", unit="s", published=pubv,
                            predicted=f[strat]["step_time_us"] / 1e6))
    return out


#: Row 5's sequences per GPU per step: the local batch size (``LBS``) its source gives for the
#: 16-node run (NousResearch/torchtitan ``torchtitan/distributed/deepep/README.md``; torchtitan's
#: ``training.local_batch_size`` default is 8 too), one micro-batch (no gradient accumulation).
ROW5_LOCAL_BATCH = 8
#: FSDP2 under torchtitan's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` keeps the
#: sharded parameters in fp32 (4 B, the master copy itself), fp32 gradients (4 B) and Adam's two
#: moments (8 B): 16 B per parameter. The step's memory counts a weight's bf16 2 B and 4 B of
#: gradient, so the optimizer's share is 16 - 2 - 4 = 10 B (Megatron's 12 B adds a separate fp32
#: master beside the bf16 weight).
FSDP2_OPTIMIZER_BYTES_PER_PARAM = 4 + 8 - 2
#: SMs of DeepEP's normal kernels in the row's code: its default tuned B200 EP8 config (24 SMs, the
#: same README's "Tuned Configurations").
ROW5_DEEPEP_SMS = 24


def torchtitan_flops_per_token(m, seq: int) -> float:
    """torchtitan's model FLOPs per token (``get_moe_model_nparams_and_flops``, which its logged
    TFLOPS divide by): 6 x the parameters a token uses other than the token embedding (attention,
    norms, router, ``top_k / E`` of the routed experts, the output head) + 12 x layers x heads x
    head_dim x ``seq``. GQA models only (Qwen3's stack: q/k norms of head_dim each)."""
    H, hd = m.hidden, m.head_dim
    attn = H * m.heads * hd + 2 * H * m.kv_heads * hd + m.heads * hd * H + 2 * hd   # q, k, v, o, q/k norms
    layer = attn + 2 * H + H * m.num_experts + m.top_k * 3 * H * m.expert_ffn       # + 2 norms, router, experts
    active = m.layers * layer + H + m.vocab * H                                      # + final norm, output head
    return 6.0 * active + 12.0 * m.layers * m.heads * hd * seq


def torchtitan_seq_len(m, flops_per_token: float) -> float:
    """The sequence length at which :func:`torchtitan_flops_per_token` equals ``flops_per_token``
    (the published TFLOPS over the published tokens/s)."""
    base = torchtitan_flops_per_token(m, 0)
    return (flops_per_token - base) / (12.0 * m.layers * m.heads * m.head_dim)


def row5() -> list[dict]:
    from moonep_sim.models import get_model
    from moonep_sim.step.parallel import Parallel

    # the sequence length the row ran: its published 341 TFLOPS at 14,796 tokens/s per GPU, by
    # torchtitan's FLOP count, gives 2033 (+-14 from the TFLOPS' rounding): 2048, torchtitan's default
    seq = 2 ** round(np.log2(torchtitan_seq_len(get_model("qwen3-30b-a3b"), 341e12 / 14796)))

    def par(gpus: int):
        # FSDP2 reduce-scatters each block's gradients in its post-backward hook, overlapped with the
        # backward of the blocks before it (overlap_grad_reduce); parameters all-gathered per block (ZeRO 3)
        return Parallel(dp=gpus, ep=8, zero=3, micro_batch_size=ROW5_LOCAL_BATCH,
                        global_batch_size=ROW5_LOCAL_BATCH * gpus, overlap_grad_reduce=True)

    kw = dict(options={"deepep": {"sms": ROW5_DEEPEP_SMS}}, context=seq,
              optimizer_bytes_per_param=FSDP2_OPTIMIZER_BYTES_PER_PARAM)
    one = _step("qwen3-30b-a3b", "b200", "alltoall,deepep", 8, par(8), "qwen3-30b-a3b", **kw)
    many = _step("qwen3-30b-a3b", "b200", "deepep", 128, par(128), "qwen3-30b-a3b", **kw)
    tps = lambda f: f["tokens_per_s_per_gpu"]
    return [dict(row=5, group="ratios", case="EP8 1 node: DeepEP / default all-to-all tokens/s/GPU", unit="x",
                 published=14796 / 9930, predicted=tps(one["deepep"]) / tps(one["alltoall"])),
            dict(row=5, group="ratios", case="DeepEP tokens/s/GPU: 16 nodes / 1 node", unit="x",
                 published=13856 / 14796, predicted=tps(many["deepep"]) / tps(one["deepep"])),
            dict(row=5, group="ratios", case="memory per GPU: 16 nodes / 1 node", unit="x",
                 published=114.8 / 167.9,
                 predicted=many["deepep"]["peak_memory_bytes"] / one["deepep"]["peak_memory_bytes"])]


def _err(r: dict, key: str = "predicted") -> float | None:
    return None if r["published"] is None or r.get(key) is None else r[key] / r["published"] - 1


def _fmt(v, unit: str) -> str:
    return "-" if v is None else f"{v:,.4g} {unit}"


def summary(rows: list[dict]) -> list[str]:
    """The per-row table (before / after and their errors) and the per-group errors."""
    lines = ["| row | group | case | published | before | error before | after | error after |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        eb, ea = _err(r, "before"), _err(r)
        note = "n/a (" + r.get("note", "") + ")"
        lines.append(f"| {r['row']} | {r['group']} | {r['case']} | {_fmt(r['published'], r['unit'])} | "
                     f"{_fmt(r.get('before'), r['unit'])} | " + (note if eb is None and r["published"] is None else
                                                                 "-" if eb is None else f"{eb:+.1%}")
                     + f" | {_fmt(r['predicted'], r['unit'])} | " + (note if ea is None else f"{ea:+.1%}") + " |")
    lines += ["", "| group | rows | median abs error before | after | mean signed error before | after | worst before | "
              "after |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    groups = ["training", "memory", "ratios"]
    for g in groups + ["all"]:
        cols = []
        for key in ("before", "predicted"):
            es = [_err(r, key) for r in rows if (g == "all" or r["group"] == g) and _err(r, key) is not None]
            cols.append(es)
        n = max(len(c) for c in cols)
        if not n:
            lines.append(f"| {g} | 0 | - | - | - | - | - | - |")
            continue
        med = [f"{median(abs(e) for e in c):.1%}" if c else "-" for c in cols]
        mean = [f"{sum(c) / len(c):+.1%}" if c else "-" for c in cols]
        worst = [f"{max(c, key=abs):+.1%}" if c else "-" for c in cols]
        lines.append(f"| {g} | {n} | {med[0]} | {med[1]} | {mean[0]} | {mean[1]} | {worst[0]} | {worst[1]} |")
    lines.append("| serving | 0 | - | - | - | - | - | - |  (no serving development row in this benchmark)")
    return lines


def run_rows(want: set[int], before: bool) -> list[dict]:
    """Every wanted row priced with the legacy (``before``) or the current cost model."""
    from moonep_sim.step.costs import cost_model_preset

    BEFORE["on"] = before
    rows: list[dict] = []
    with cost_model_preset("legacy") if before else nullcontext():
        for n, fn in ((1, row1), (2, row2), (5, row5)):
            if n in want:
                a = time.perf_counter()
                rows += fn()
                print(f"row {n} ({'before' if before else 'after'}): {time.perf_counter() - a:.0f} s", file=sys.stderr,
                      flush=True)
    BEFORE["on"] = False
    return rows


def _interp(grid: list[float], ys: list[float], h: float) -> float:
    """Linear interpolation of a case's predictions ``ys`` over the launch-cost ``grid`` at ``h``."""
    import numpy as np

    return float(np.interp(h, grid, ys))


def _best_h(grid: list[float], cases: list[tuple[float, list[float]]]) -> float:
    """The launch cost (on a 0.5 us mesh over the grid) minimising the median absolute log error of
    ``cases`` ((published, predictions over the grid) each)."""
    import numpy as np

    mesh = np.arange(grid[0], grid[-1] + 1e-9, 0.5)
    cost = [median(abs(np.log(_interp(grid, ys, h) / pub)) for pub, ys in cases) for h in mesh]
    return float(mesh[int(np.argmin(cost))])


def fit_host(grid: list[float]) -> list[str]:
    """Megatron-Core's host time per launch FITTED on row 2 (the median absolute log error of its
    published iteration times, predictions interpolated over ``grid``), each case's leave-one-out
    error, and row 1 at the fitted value (a row the fit did not see)."""
    from moonep_sim.step.host import host_launch_cost

    runs = {}
    for h in grid:
        with host_launch_cost(h):
            a = time.perf_counter()
            runs[h] = (row2(), [r for r in row1() if r["group"] == "training"])
            print(f"launch {h:g} us: {time.perf_counter() - a:.0f} s", file=sys.stderr, flush=True)
    r2 = [(r["case"], r["published"], [runs[h][0][i]["predicted"] for h in grid])
          for i, r in enumerate(runs[grid[0]][0]) if r["published"] is not None]
    h_fit = _best_h(grid, [(pub, ys) for _, pub, ys in r2])
    lines = [f"Fitted on row 2's {len(r2)} published iteration times: **{h_fit:g} us per launch** "
             f"(grid {', '.join(f'{h:g}' for h in grid)} us, linear between).", "",
             "| row | case | published | at the fit | error | leave-one-out fit (us) | leave-one-out error |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    loo, ins = [], []
    for i, (case, pub, ys) in enumerate(r2):
        h_i = _best_h(grid, [(p, y) for j, (_, p, y) in enumerate(r2) if j != i])
        e, e_i = _interp(grid, ys, h_fit) / pub - 1, _interp(grid, ys, h_i) / pub - 1
        ins.append(e)
        loo.append(e_i)
        lines.append(f"| 2 | {case} | {pub:,.4g} s | {_interp(grid, ys, h_fit):,.4g} s | {e:+.1%} | {h_i:g} | {e_i:+.1%} |")
    r1 = [(r["case"], r["published"], [runs[h][1][i]["predicted"] for h in grid]) for i, r in enumerate(runs[grid[0]][1])]
    out1 = []
    for case, pub, ys in r1:
        base, e = ys[0] / pub - 1, _interp(grid, ys, h_fit) / pub - 1
        out1.append((base, e))
        lines.append(f"| 1 | {case} (not fitted) | {pub:,.4g} ms | {_interp(grid, ys, h_fit):,.4g} ms | {e:+.1%} | - | "
                     f"at {grid[0]:g} us: {base:+.1%} |")
    lines += ["", f"Row 2 median absolute error at the fit {median(abs(e) for e in ins):.1%}, leave-one-out "
                  f"{median(abs(e) for e in loo):.1%} (worst {max(loo, key=abs):+.1%}); row 1 (unseen by the fit) "
                  f"{median(abs(e) for _, e in out1):.1%} against {median(abs(b) for b, _ in out1):.1%} at "
                  f"{grid[0]:g} us per launch."]
    return lines



def page_head(title: str, command: str, t0: float, load0: tuple, commit: str) -> list[str]:
    """A results page's first lines: its title, the date, commit, command (with its wall seconds since
    ``t0``) and the 1-minute load average at the start (``load0``) and now."""
    return [f"# {title}", "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}",
            f"- command: `{command}` ({time.perf_counter() - t0:.0f} s)",
            f"- machine load (1-min load average at start / end): {load0[0]:.1f} / {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores"]

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5", help="ANCHORS development rows to run (default 1,2,5)")
    ap.add_argument("--no-write", action="store_true", help="print only (no docs/results/fidelity_steps.md)")
    ap.add_argument("--after-only", action="store_true", help="skip the 'before' column (the legacy cost model)")
    ap.add_argument("--fit-host", default="", metavar="US,US,...",
                    help="fit Megatron-Core's host time per launch on row 2 over this grid of us (leave-one-out, row 1 "
                         "checked) and write docs/results/host-launch-fit.md")
    args = ap.parse_args(argv)
    # the code the run prices is the head when it starts
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if args.fit_host:
        t0, load0 = time.perf_counter(), os.getloadavg()
        lines = fit_host(sorted(float(x) for x in args.fit_host.split(",")))
        print("\n".join(lines))
        if not args.no_write:
            head = page_head("Megatron-Core's host time per launch, fitted on development row 2",
                             f"python benchmarks/fidelity_steps.py --fit-host {args.fit_host}", t0, load0, commit) + [
                    "- what is fitted: the host's time per launched kernel of the layout step's host timeline "
                    "(`moonep_sim.step.host`), kernel counts per block from DeepSeek's H800 trace; every other "
                    "figure as `fidelity_steps.py` predicts it", ""]
            (ROOT / "docs" / "results" / "host-launch-fit.md").write_text("\n".join(head + lines) + "\n")
        return 0
    want = {int(x) for x in args.rows.split(",") if x.strip()}
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    rows = run_rows(want, before=False)
    if not args.after_only:
        sources_after = set(SOURCES)
        for r, b in zip(rows, run_rows(want, before=True)):
            r["before"] = b["predicted"]
        SOURCES.clear()
        SOURCES.update(sources_after)
    lines = summary(rows)
    print("\n".join(lines))
    if args.no_write:
        return 0
    head = page_head("Step fidelity under parallel layouts (development rows)",
                     f"python benchmarks/fidelity_steps.py --rows {args.rows}{' --after-only' if args.after_only else ''}",
                     t0, load0, commit) + [
            "- FITTED on row 2: Megatron-Core's host time per launched kernel "
            "(`moonep_sim.step.host.MEGATRON_HOST_LAUNCH_US`; leave-one-out and the check on row 1 in "
            "docs/results/host-launch-fit.md) and the host-proxy per-call cost and throughput of DeepEP + UCCL and "
            "DeepEP + NVSHMEM (`moonep_sim.plan.kernel.UCCL_EFA_CALL_US` and its kin; leave-one-out in "
            "docs/results/host-proxy-fit.md), so row 2's DeepEP columns are in-sample; everything else a prediction "
            "with the shipped presets: "
            "the layout, batch and dispatcher are the published ones, the rest as `moonep-sim step` defaults "
            "them (every MoE layer its own generated balanced routing; 'after' op times as a step prices them, from: "
            + (", ".join(sorted(SOURCES)) or "?") + ").",
            "- before: the step's earlier cost model (`moonep_sim.step.costs.legacy_cost_model`: roofline at 60% x "
            "m/(m+64), FP8 = 2 x BF16, no measured tables, no launch / cast / permute / router / host-wait cost, every "
            "kernel holding its SMs; row 2's DeepEP transports both as DeepEP V1)" + ("" if not args.after_only else
                                                                                      " -- not run (--after-only)")
            + ".",
            "- mappings and assumptions: see the docstring of `benchmarks/fidelity_steps.py` (row 2's 'overlap on' is "
            "interleaved at vpp 2 as Megatron's combined 1F1B (EP all-to-all overlap) with the DP gradient reduce overlapped; row 5's "
            "batch and FSDP are ASSUMED).", ""]
    (ROOT / "docs" / "results" / "fidelity_steps.md").write_text("\n".join(head + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
