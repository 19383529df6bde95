"""Replay a routing trace layer by layer on real tensors over gloo (the rank program).

    python launch/replay.py --nproc 4 --trace T --strategy moonep --hidden 64 --backward --json out.json
    torchrun --nproc_per_node 4 launch/replay.py --trace T ...      (one rank per process)

Each selected layer's tokens are split over the ranks as ``GlobalRouting.split_evenly`` does (the
first T % R ranks get one more); routing comes from the trace (no router). Per layer and iteration
every rank times its phases (exchange + plan + row movement = dispatch, prefetch, expert compute,
combine, backward); the report gives, per phase, the max and the mean over ranks of the per-rank
mean over iterations, and every rank's own figure (``phases_R``: phase -> ms per rank, per layer
and summed over layers; ``slowest_rank``: phase -> the rank with the largest sum), so a straggler
rank can be named from a measured run. Per iteration, the layer's time is the slowest rank's
(``per_layer[*].iter_total_ms``); averaged over the layers they give one sample per iteration
(``layer_ms_samples``, median ``layer_ms_median``). Bytes are the Plan's (``Plan.bytes_summary``: bytes that
cross a link, rows of ``H * element size`` bytes). Unless ``--no-check``, rank 0 compares outputs (and with
``--backward`` the input and expert-weight gradients) with the dense single-process layer on the
gathered inputs, with the Plan's drops applied.

``--strategy a,b,c`` replays several strategies in one process group, interleaved step by step
(iteration i runs each in turn, the order rotated every iteration), so that two strategies' i-th
samples are taken moments apart: the matched pairs ``moonep_sim.analysis.ranking`` tests. The JSON
is then ``{"strategies": {name: report}, "order": [...], "interleaved": true, ...}``; ``--opt
STRATEGY.key=value`` sets one strategy's option, ``--opt key=value`` every strategy's.

The program sits above the gloo executor: it binds each strategy name to its planner
(``moonep_sim.strategies.planner``) and hands the planner callable to ``moonep_sim.gloo.Buffer``.
Every rank runs ``python -m moonep_sim.experiments.ranks.replay_rank``; :func:`run_replay` starts them on
local ranks (``moonep_sim.gloo.launcher.run_rank_program``).

Notation: T tokens of a layer, s tokens of this rank, H hidden, F expert width, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from moonep_sim.errors import CommError, MoonEPSimError, exit_status, require
from moonep_sim.experiments.ranks.replay_args import (check_args, check_before_ranks, parse_args, parse_layers,
                                                     strategy_names, strategy_opts)
from moonep_sim.io import check_outputs, write_text_atomic

MODULE = "moonep_sim.experiments.ranks.replay_rank"  # what every rank runs (python -m MODULE)
PHASES = ("exchange", "plan", "dispatch", "prefetch", "expert", "combine", "backward", "total")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _gather_rows(t: torch.Tensor, capacity: int, group, phase: str = "check.gather") -> list[torch.Tensor]:
    """Every rank's [s_r, C] tensor (padded to capacity for the all_gather)."""
    R = dist.get_world_size(group)
    pad = t.new_zeros((capacity,) + tuple(t.shape[1:]))
    pad[: t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in range(R)]
    _collective(phase, "all_gather", lambda: dist.all_gather(out, pad, group=group, async_op=True))
    return out


def _collective(phase: str, op: str, issue) -> None:
    """A collective of the replay itself (outside any Buffer), named by its phase: on failure a
    CommError names the phase and the silent peer (see moonep_sim.gloo.liveness)."""
    if not _TRACKER:  # run() called without main(): track with the default group's timeout
        from moonep_sim.gloo.liveness import PhaseTracker
        _TRACKER.append(PhaseTracker("moonep_sim/replay/", dist.get_rank(), range(dist.get_world_size()), 600.0))
    _TRACKER[0].collective(phase, op, issue)


# the replay's phase tracker (one replay per rank process; set in main)
_TRACKER: list = []


def _stats(v_R: np.ndarray) -> dict[str, float]:
    return {"max_ms": float(v_R.max()) * 1e3, "mean_ms": float(v_R.mean()) * 1e3}


@dataclass(frozen=True)
class _LayerInput:
    """One (step, layer) item on this rank: the layer's routing ``lr``, this rank's token ids and
    weights (``ids`` [s, K], ``w`` [s, K]), inputs ``x`` [s, H] and output gradient ``grad_out``
    [s, H], every expert's weights for the dense check (None: not checked), tokens per rank ``tpr``
    [R] and the layer's position ``li`` in the trace."""

    lr: Any
    ids: torch.Tensor
    w: torch.Tensor
    x: torch.Tensor
    grad_out: torch.Tensor
    full_w: Any
    tpr: np.ndarray
    li: int


def _replay_items(args: argparse.Namespace, trace, layers: list[int], R: int) -> list:
    """The items ``(batch, step id, layer, routing of its first --max-tokens tokens, tokens per rank
    [R], zeros where a pass has fewer tokens than ranks)`` of every (batch, layer) holding a token,
    the selected steps each a batch (``routing.steps.step_batches``; merged: one batch of them all)."""
    from moonep_sim.routing.steps import read_layer, step_batches

    batches = step_batches(trace.steps(), int(trace.meta.num_tokens), getattr(args, "steps", None))
    items = []
    for bi, (step_id, ranges) in enumerate(batches):
        for li in layers:
            lr = read_layer(trace, li, ranges=ranges)
            T = lr.num_tokens if not args.max_tokens else min(lr.num_tokens, args.max_tokens)
            if T == 0:
                continue  # the step has no token at this layer (a per-layer token mask)
            # fewer tokens than ranks (a small decode pass): the last ranks hold none and still take
            # part in every collective, as real engines run them
            tpr = np.full(R, T // R, dtype=np.int64)
            tpr[: T % R] += 1
            items.append((bi, step_id, li, lr.take(0, T), tpr))
    require(len(items) >= 1, "the selected steps and layers must hold at least one token")
    return items


def _rank_inputs(args: argparse.Namespace, items: list, homes: dict[str, np.ndarray], rank: int,
                 shape: tuple[int, int, int], init_experts) -> tuple[list[_LayerInput], dict]:
    """Per item this rank's tokens and seeded inputs (:class:`_LayerInput`), and its home experts'
    weights per (layer, home set): one copy shared by the strategies whose placement gives this rank
    the same experts. ``shape``: (E, H, F). Every expert's weights are kept only for the dense check."""
    E, H, F = shape
    inputs, weights, full = [], {}, {}
    for bi, step_id, li, lr, tpr in items:
        off = np.concatenate([[0], np.cumsum(tpr)])
        lo, hi = int(off[rank]), int(off[rank + 1])
        check = args.check if args.check is not None else lr.num_tokens * H <= (1 << 22)
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + li * 1009 + bi * 7 + rank)
        x = torch.randn(hi - lo, H, generator=gen)
        if li not in full:
            full[li] = init_experts(E, H, F, seed=args.seed * 7919 + li)
        for home in homes.values():
            if (li, home.tobytes()) not in weights:
                hm = torch.from_numpy(home)
                weights[(li, home.tobytes())] = [p[hm].clone().requires_grad_(args.backward) for p in full[li]]
        inputs.append(_LayerInput(lr, torch.from_numpy(np.ascontiguousarray(lr.topk_ids_TK[lo:hi])),
                                  torch.from_numpy(np.ascontiguousarray(lr.topk_weights_TK[lo:hi])), x,
                                  torch.randn(hi - lo, H, generator=gen), full[li] if check else None, tpr, li))
    return inputs, weights


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Replay every ``--strategy`` (comma-separated) on the same tokens. With several, the steps are
    interleaved: iteration i runs each strategy in turn (the order rotated by one each iteration),
    so load drifts on the machine reach every strategy alike and iteration i of two strategies is a
    matched pair. Returns (on rank 0) one strategy's report, or ``{"strategies": {name: report}}``."""
    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.gloo.moe import dense_moe, init_experts
    from moonep_sim.plan import RowCosts
    from moonep_sim.routing.trace import Trace
    from moonep_sim.strategies import PlanContext, planner

    rank, R = dist.get_rank(), dist.get_world_size()
    names = strategy_names(args)   # (the numbers: check_args, which main runs first)
    trace = Trace(args.trace)
    meta = trace.meta
    require(meta.kind == "tokens", f"trace kind ({meta.kind!r}) must be 'tokens' for a replay (routing per token)")
    E, K, H, F = meta.num_experts, meta.top_k, args.hidden, args.ffn
    layers = parse_layers(args.layers, trace)
    items = _replay_items(args, trace, layers, R)
    capacity = int(max(int(it[4].max()) for it in items))
    dtype = _DTYPES[args.dispatch_dtype]
    opts = args.options if getattr(args, "options", None) is not None else strategy_opts(names, args.opt)
    # the planners: each strategy bound to the replay's context (this program is the Buffer's caller)
    costs = RowCosts.for_rows(H, torch.tensor([], dtype=dtype).element_size(), F)
    ctx = PlanContext.default(E, R, args.gpus_per_node, costs, args.token_padding)
    bufs = {n: Buffer(capacity=capacity, hidden=H, top_k=K, num_experts=E, planner=planner(n, ctx, **opts[n]),
                      gpus_per_node=args.gpus_per_node, timeout_s=args.timeout, dispatch_dtype=dtype)
            for n in names}
    # per (step, layer): this rank's tokens and inputs, and its home experts' weights (one copy per
    # layer and distinct home set: strategies whose placement gives this rank the same experts share
    # it); every expert's weights are kept only for the dense reference check
    homes = {n: np.flatnonzero(b.placement.home_E == rank) for n, b in bufs.items()}
    inputs, weights = _rank_inputs(args, items, homes, rank, (E, H, F), init_experts)
    S, L, n_it = len(names), len(items), args.warmup + args.iters
    times = np.zeros((S, L, args.iters, len(PHASES)))
    entries: dict[tuple[int, int], dict[str, Any]] = {}
    for it in range(n_it):
        for k in range(S):
            si = (k + it) % S
            buf = bufs[names[si]]
            for j in range(L):
                inp = inputs[j]
                params = weights[(inp.li, homes[names[si]].tobytes())]
                step = _step(buf, inp.ids, inp.w, inp.x, params, inp.grad_out, inp.li, args.backward)
                if it >= args.warmup:
                    times[si, j, it - args.warmup] = step["times"]
                if it == n_it - 1:
                    chk = (_check(rank, buf, step, inp, params, capacity, args.backward, dtype, dense_moe)
                           if inp.full_w is not None else None)
                    entries[(si, j)] = _layer_entry(buf, step, inp.lr, chk)
    return _gather_reports(args, names, bufs, items, layers, times, entries)


def _gather_reports(args: argparse.Namespace, names: list[str], bufs: dict, items: list, layers: list[int],
                    times: np.ndarray, entries: dict) -> dict[str, Any] | None:
    """Every rank's phase times ``times[strategy, item, iteration, phase]`` and weight fetches
    gathered on rank 0 and turned into the reports (None on the other ranks)."""
    rank, R = dist.get_rank(), dist.get_world_size()
    S, L = len(names), len(items)
    # every rank's per-iteration phase times -> rank 0
    mine = torch.from_numpy(times)
    allt = [torch.empty_like(mine) for _ in range(R)]
    _collective("report.gather_times", "all_gather", lambda: dist.all_gather(allt, mine, async_op=True))
    all_RSLIP = torch.stack(allt).numpy()
    fetched = torch.tensor([[entries[(si, j)]["fetched"] for j in range(L)] for si in range(S)], dtype=torch.int64)
    all_f = [torch.empty_like(fetched) for _ in range(R)]
    _collective("report.gather_fetched", "all_gather", lambda: dist.all_gather(all_f, fetched, async_op=True))
    fetched_SL = torch.stack(all_f).sum(dim=0).numpy()
    if rank != 0:
        return None
    reps = {}
    for si, name in enumerate(names):
        per_layer = []
        for j, (bi, step_id, li, lr, tpr) in enumerate(items):
            e = dict(entries[(si, j)])
            e.pop("fetched")
            e.update(layer=li, step=step_id, batch=bi, tokens=int(lr.num_tokens), tokens_per_rank=tpr.tolist())
            e["fetched_weights"] = int(fetched_SL[si, j])
            t_RIP = all_RSLIP[:, si, j]
            mean_RP = t_RIP.mean(axis=1)
            e["phases"] = {name_: _stats(mean_RP[:, p]) for p, name_ in enumerate(PHASES)}
            e["phases_R"] = {name_: [float(v) * 1e3 for v in mean_RP[:, p]] for p, name_ in enumerate(PHASES)}
            e["iter_total_ms"] = [float(v) * 1e3 for v in t_RIP[:, :, -1].max(axis=0)]
            # per phase: the slowest rank's time in each iteration, median over iterations (robust
            # to a stalled iteration on a shared machine, unlike the means above)
            e["phase_ms_median"] = {name_: float(np.median(t_RIP[:, :, p].max(axis=0))) * 1e3
                                    for p, name_ in enumerate(PHASES)}
            per_layer.append(e)
        reps[name] = _report(args, bufs[name], name, layers, per_layer)
    if S == 1:
        return reps[names[0]]
    from moonep_sim.analysis.measured_verdict import measured_verdict, replay_where

    out = {"strategies": reps, "order": names, "interleaved": True, "iters": args.iters, "warmup": args.warmup,
           "world_size": R, "trace": str(args.trace), "layers": layers}
    out["verdict"] = measured_verdict(reps, where=replay_where(out))
    return out


def _step(buf, ids, w, x, params, grad_out, li: int, backward: bool) -> dict[str, Any]:
    """One timed step of one layer: exchange, plan, dispatch, prefetch, experts, combine (and backward)."""
    from moonep_sim.gloo.moe import expert_forward

    for p in params:
        p.grad = None
    xi = x.clone().requires_grad_(backward)
    _collective(f"layer{li}.step_barrier", "barrier", lambda: dist.barrier(async_op=True))
    t = [time.perf_counter()]
    routing, w64 = buf.exchange_routing(ids, w)
    t.append(time.perf_counter())
    handle = buf.plan_handle(routing, w64)
    t.append(time.perf_counter())
    rows, row_w, _, _ = buf.dispatch(xi, handle=handle)
    t.append(time.perf_counter())
    copies, rows = buf.prefetch_weight(handle, tuple(params), tie=rows, cache_key=li)
    t.append(time.perf_counter())
    y = expert_forward(rows, handle, params, copies)
    t.append(time.perf_counter())
    out = buf.combine(y, handle, row_w)
    t.append(time.perf_counter())
    if backward:
        (out * grad_out).sum().backward()
    t.append(time.perf_counter())
    d = np.diff(t)  # exchange, plan, rows, prefetch, expert, combine, backward
    return {"times": [d[0], d[1], d[0] + d[1] + d[2], d[3], d[4], d[5], d[6], t[-1] - t[0]],
            "handle": handle, "xi": xi, "out": out}


def _layer_entry(buf, step: dict[str, Any], lr, checked: dict[str, Any] | None) -> dict[str, Any]:
    """What the report says of one layer (its Plan's bytes and rows; the check's outcome)."""
    from moonep_sim.analysis.verdict import _plan_figures

    plan = step["handle"].plan
    sent = sum(p.remote_bytes() for p in plan.phases("forward"))
    if step["xi"].requires_grad:
        sent += sum(p.remote_bytes() for p in plan.phases("backward"))
    e = {"layer": None, "layer_id": int(lr.layer), "bytes": {**plan.bytes_summary(), "sent": int(sent)},
         "recv_rows_per_rank": plan.real_rows_R().tolist(), "rows_per_rank_padded": plan.rows_R().tolist(),
         "dropped": plan.dropped, "padded": plan.padded, "weight_copies": plan.weight_copies,
         "fetched": int(buf.rows.last_fetched),  # actually fetched in the last iteration (cached replicas not)
         "hops": len(plan.hops), "plan_seconds": plan.plan_seconds, "correct": None, "max_abs_err": None,
         "plan_figures": _plan_figures(plan, None, "forward")}  # what the measured verdict reads
    if checked:
        e.update(checked)
    return e


def _report(args, buf, name: str, layers: list[int], per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    """One strategy's report; ``per_layer`` holds one entry per (step, layer) (``layer``: the stored
    position, ``layer_id``: the model layer id, ``step``: the trace's step, None when merged)."""
    from moonep_sim.analysis.stepstats import aggregate, batch_weights

    # per iteration: each step's layer times (max over ranks) averaged over its layers, then the
    # token-weighted mean over steps -> one sample per iteration (one step: the mean over layers)
    bis = sorted({e["batch"] for e in per_layer})
    first = {b: next(e for e in per_layer if e["batch"] == b) for b in bis}
    tok_B = [first[b]["tokens"] for b in bis]
    step_B = [first[b]["step"] for b in bis]
    it_B = np.asarray([np.mean([e["iter_total_ms"] for e in per_layer if e["batch"] == b], axis=0) for b in bis])
    samples = batch_weights(tok_B) @ it_B
    med_B = np.median(it_B, axis=1)
    tpr = np.sum([first[b]["tokens_per_rank"] for b in bis], axis=0)
    T = int(sum(tok_B))
    totals = {p: sum(e["phases"][p]["max_ms"] for e in per_layer) for p in PHASES}
    # per rank, summed over layers: which rank is slow in which phase (a straggler)
    phases_R = {p: [float(v) for v in np.sum([e["phases_R"][p] for e in per_layer], axis=0)] for p in PHASES}
    checked = [e["correct"] for e in per_layer if e["correct"] is not None]
    # per iteration: the layers' times (max over ranks) averaged over layers -> one sample per iteration
    return {
        "strategy": name, "options": buf.planner.options, "world_size": buf.world_size, "gpus_per_node": buf.gpus_per_node,
        "trace": str(args.trace), "layers": layers, "hidden": args.hidden, "ffn": args.ffn,
        "num_experts": buf.num_experts, "top_k": buf.top_k, "tokens": T, "tokens_per_rank": tpr.tolist(),
        "iters": args.iters, "warmup": args.warmup,
        "backward": bool(args.backward), "dispatch_dtype": args.dispatch_dtype,
        "dispatch_ms": totals["dispatch"], "prefetch_ms": totals["prefetch"], "expert_ms": totals["expert"],
        "combine_ms": totals["combine"], "backward_ms": totals["backward"], "total_ms": totals["total"],
        "layer_ms_samples": [float(v) for v in samples],
        "layer_ms_median": float(np.median(samples)),
        "phases": {p: {"max_ms": totals[p], "mean_ms": sum(e["phases"][p]["mean_ms"] for e in per_layer)}
                   for p in PHASES},
        "phases_R": phases_R,
        "slowest_rank": {p: int(np.argmax(v)) for p, v in phases_R.items()},
        "bytes_sent": int(sum(e["bytes"]["sent"] for e in per_layer)),
        "correct": (all(checked) if checked else None),
        "max_abs_err": max((e["max_abs_err"] for e in per_layer if e["max_abs_err"] is not None), default=None),
        "per_step": {"step": step_B, "tokens": tok_B, "layer_ms_median": [float(v) for v in med_B]},
        "steps_aggregate": {"layer_ms_median": aggregate(med_B, tok_B, step_B)},
        "per_layer": per_layer,
    }


def _check(rank, buf, step: dict[str, Any], inp: "_LayerInput", params, capacity, backward, dtype, dense_moe):
    """Rank 0 compares the gathered outputs (and gradients) with the dense reference. ``step``:
    :func:`_step`'s result on ``inp``."""
    handle, xi, out = step["handle"], step["xi"], step["out"]
    lr, x, grad_out, full_w, tpr = inp.lr, inp.x, inp.grad_out, inp.full_w, inp.tpr
    outs = _gather_rows(out.detach(), capacity, None)
    xs = _gather_rows(x, capacity, None)
    gos = _gather_rows(grad_out, capacity, None)
    gxs = _gather_rows(xi.grad, capacity, None) if backward else None
    if backward:  # every rank's home-expert gradients, [epn_r, Q] padded to E rows
        n_home = int(params[0].shape[0])
        flat = torch.cat([p.grad.reshape(n_home, -1) for p in params], dim=1)
        allg = _gather_rows(flat, buf.num_experts, None)
    if rank != 0:
        return {}
    plan = handle.plan
    cut = lambda parts: torch.cat([p[: int(n)] for p, n in zip(parts, tpr)])  # noqa: E731
    X = cut(xs).double().requires_grad_(backward)
    ew = [p.double().requires_grad_(backward) for p in full_w]
    keep = plan.entry_rank_TK >= 0
    ref = dense_moe(X, None, ew, plan.top_k, routing=(torch.from_numpy(lr.topk_ids_TK),
                                                      torch.from_numpy(lr.topk_weights_TK).double()), keep_TK=keep)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    got = cut(outs).double()
    errs = [float((got - ref.detach()).abs().max()) if got.numel() else 0.0]
    scale = [float(ref.detach().abs().max()) if got.numel() else 1.0]
    if backward:
        (ref * cut(gos).double()).sum().backward()
        errs.append(float((cut(gxs).double() - X.grad).abs().max()))
        scale.append(float(X.grad.abs().max()))
        home_E = buf.placement.home_E
        P = [int(np.prod(p.shape[1:])) for p in full_w]
        for r in range(buf.world_size):
            experts = np.flatnonzero(home_E == r)
            parts = torch.split(allg[r][: experts.size], P, dim=1)
            for j, part in enumerate(parts):
                want = ew[j].grad[torch.from_numpy(experts)]
                errs.append(float((part.double().reshape(want.shape) - want).abs().max()) if want.numel() else 0.0)
                scale.append(float(want.abs().max()) if want.numel() else 1.0)
    rel = max(e / max(s, 1e-12) for e, s in zip(errs, scale))
    return {"correct": bool(rel <= tol), "max_abs_err": float(max(errs)), "max_rel_err": float(rel)}


def _each(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-strategy reports of a replay result (one, or several when interleaved)."""
    from moonep_sim.gloo.launcher import reports_by_strategy

    return list(reports_by_strategy(rep).values())


def _summary(rep: dict[str, Any]) -> str:
    lines = [f"replay {rep['strategy']} {rep['options']} on {rep['world_size']} ranks, {rep['tokens']} tokens, "
             f"H={rep['hidden']} F={rep['ffn']}, layers {rep['layers']}"]
    ph = rep["phases"]
    lines.append("  phase ms (max / mean over ranks): " + ", ".join(
        f"{k} {ph[k]['max_ms']:.2f}/{ph[k]['mean_ms']:.2f}" for k in PHASES if k != "backward" or rep["backward"]))
    lines.append(f"  bytes sent {rep['bytes_sent']:,}; correct: {rep['correct']} (max abs err {rep['max_abs_err']})")
    return "\n".join(lines)


def _summaries(rep: dict[str, Any]) -> str:
    """Each strategy's summary, then the measured verdict when several were interleaved."""
    from moonep_sim.analysis.verdict import verdict_line

    lines = [_summary(r) for r in _each(rep)]
    if rep.get("verdict"):
        lines.append("measured " + verdict_line(rep["verdict"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``launch/replay.py`` and ``python -m moonep_sim.experiments.ranks.replay_rank``).

    With ``--nproc N`` (and not already a rank): start N local ranks (:func:`launch`). Otherwise run
    as one rank: exit 0, 3 when a result check failed, 2 on bad input and 1 when a collective failed
    (one line ``moonep-sim: error: rank R: Class: message`` on stderr), 130 on Ctrl-C."""
    if argv is None:
        argv = sys.argv[1:]
    if "RANK" not in os.environ and any(a == "--nproc" or a.startswith("--nproc=") for a in argv):
        sys.exit(launch(argv))
    args = None
    rank = os.environ.get("RANK", "?")
    from moonep_sim.gloo.liveness import PhaseTracker, announce, join_group
    watch = None
    try:
        args = parse_args(argv)
        check_args(args)
        if args.json:  # every rank refuses alike, before the run (not rank 0 alone, after it)
            check_outputs({"--json": args.json}, {"--trace": args.trace, "--spec": args.spec})
        watch = join_group(args.timeout, "launch/replay.py")
        _TRACKER[:] = [PhaseTracker("moonep_sim/replay/", dist.get_rank(), range(dist.get_world_size()),
                                    args.timeout)]
        rep = run(args)
        if rep is not None:
            if args.json:
                write_text_atomic(args.json, json.dumps(rep, indent=1, sort_keys=True), what="--json")
            if not args.quiet:
                print(_summaries(rep), flush=True)
        _collective("exit.barrier", "barrier", lambda: dist.barrier(async_op=True))
        code = 0 if rep is None or all(r["correct"] is not False for r in _each(rep)) else 3
    except MoonEPSimError as e:
        print(f"moonep-sim: error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1 if isinstance(e, CommError) else 2
    except RuntimeError as e:  # a collective no tracker watched (process-group set-up)
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if watch is not None and not watch.up.is_set():
            msg = watch.report(f"failed: {line[:160]}")  # one line: this thread's or the watchdog's
        else:
            phase = _TRACKER[0].phase if _TRACKER else "start"
            msg = f"replay collective failed after {phase}: {line[:240]}"
        print(f"moonep-sim: error: rank {rank}: CommError: {msg}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        if rank in ("0", "?"):
            print("moonep-sim: interrupted", file=sys.stderr, flush=True)
        code = 130
    announce(f"exited {code}")
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without process-group destructors: after a failed collective they can block
    os._exit(code)


def launch(argv: Sequence[str]) -> int:
    """``--nproc N``: run the replay on N local ranks (:func:`run_replay`) and print its summary;
    on failure print the failing rank's one line and return its status (2 bad input, 1 a failed
    collective), 130 on Ctrl-C."""
    return exit_status(_launch, argv)


def _launch(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    check_args(args)
    if args.json:
        check_outputs({"--json": args.json}, {"--trace": args.trace, "--spec": args.spec})
    check_before_ranks(args, args.nproc)
    from moonep_sim.gloo.launcher import strip_launch_args

    rest = strip_launch_args(argv)
    rep = run_replay(args.nproc, rest, timeout_s=max(600.0, 10 * args.timeout))
    if args.json:
        write_text_atomic(args.json, json.dumps(rep, indent=1, sort_keys=True), what="--json")
    if not args.quiet:
        print(_summaries(rep), flush=True)
    return 0 if all(r["correct"] is not False for r in _each(rep)) else 3


def run_replay(nproc: int, argv: Sequence[str], timeout_s: float = 600.0, **kw: Any) -> dict[str, Any]:
    """Run the replay on ``nproc`` local gloo ranks; return its JSON report.

    argv: replay arguments (``--trace T --strategy S ...``; ``--json`` is added); ``kw``: ``env``,
    ``quiet``, ``grace_s`` of :func:`moonep_sim.gloo.launcher.run_rank_program` (which raises a
    failing rank's own error class with its one line)."""
    from moonep_sim.gloo.launcher import run_rank_program

    return run_rank_program(MODULE, nproc, argv, timeout_s, **kw)


if __name__ == "__main__":
    main()
