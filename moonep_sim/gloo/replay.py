"""Replay a routing trace layer by layer on real tensors over gloo (run under torchrun).

    torchrun --nproc_per_node 4 launch/replay.py --trace T --strategy moonep --hidden 64 --backward --json out.json

Each selected layer's tokens are split over the ranks as ``GlobalRouting.split_evenly`` does (the
first T % R ranks get one more); routing comes from the trace (no router). Per layer and iteration
every rank times its phases (exchange + plan + row movement = dispatch, prefetch, expert compute,
combine, backward); the report gives, per phase, the max and the mean over ranks of the per-rank
mean over iterations, and every rank's own figure (``phases_R``: phase -> ms per rank, per layer
and summed over layers; ``slowest_rank``: phase -> the rank with the largest sum), so a straggler
rank can be named from a measured run. Bytes are the Plan's (``Plan.bytes_summary``: bytes that
cross a link, rows of ``H * element size`` bytes). Unless ``--no-check``, rank 0 compares outputs (and with
``--backward`` the input and expert-weight gradients) with the dense single-process layer on the
gathered inputs, with the Plan's drops applied.

Notation: T tokens of a layer, s tokens of this rank, H hidden, F expert width, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from moonep_sim.errors import CommError, MoonEPSimError, require
from moonep_sim.io import write_text_atomic

PHASES = ("exchange", "plan", "dispatch", "prefetch", "expert", "combine", "backward", "total")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch/replay.py", description="Replay a trace over gloo (under torchrun).")
    ap.add_argument("--trace", required=True, help="trace file (moonep-sim safetensors format)")
    ap.add_argument("--strategy", default="moonep")
    ap.add_argument("--opt", action="append", default=[], metavar="K=V", help="strategy option (repeatable)")
    ap.add_argument("--layers", default=None, help="comma-separated layer positions in the trace (default: all)")
    ap.add_argument("--hidden", type=int, default=64, help="H (default 64)")
    ap.add_argument("--ffn", type=int, default=128, help="expert intermediate width F (default 128)")
    ap.add_argument("--max-tokens", type=int, default=0, help="use only the first N tokens of each layer")
    ap.add_argument("--backward", action="store_true", help="also run and time the backward pass")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="ranks per node for two-hop strategies (0 = one node)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the report here (atomically, by rank 0)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective is declared failed")
    ap.add_argument("--dispatch-dtype", default="float32", choices=sorted(_DTYPES))
    ap.add_argument("--token-padding", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", dest="check", action="store_true", default=None,
                    help="compare with the dense reference (default: on when T*H <= 2**22)")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def _parse_opts(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for it in items:
        require("=" in it, f"--opt ({it!r}) must look like key=value")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _gather_rows(t: torch.Tensor, capacity: int, group) -> list[torch.Tensor]:
    """Every rank's [s_r, C] tensor (padded to capacity for the all_gather)."""
    R = dist.get_world_size(group)
    pad = t.new_zeros((capacity,) + tuple(t.shape[1:]))
    pad[: t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in range(R)]
    dist.all_gather(out, pad, group=group)
    return out


def _stats(v_R: np.ndarray) -> dict[str, float]:
    return {"max_ms": float(v_R.max()) * 1e3, "mean_ms": float(v_R.mean()) * 1e3}


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    from moonep_sim.gloo.buffer import Buffer
    from moonep_sim.gloo.moe import dense_moe, expert_forward, init_experts
    from moonep_sim.routing.trace import Trace

    rank, R = dist.get_rank(), dist.get_world_size()
    trace = Trace(args.trace)
    meta = trace.meta
    require(meta.kind == "tokens", f"trace kind ({meta.kind!r}) must be 'tokens' for a replay (routing per token)")
    E, K, H, F = meta.num_experts, meta.top_k, args.hidden, args.ffn
    require(H >= 1 and F >= 1, f"hidden ({H}) and ffn ({F}) must be >= 1")
    require(args.iters >= 1 and args.warmup >= 0, f"iters ({args.iters}) must be >= 1 and warmup ({args.warmup}) >= 0")
    layers = list(range(trace.num_layers)) if args.layers is None else \
        [int(v) for v in args.layers.split(",") if v.strip()]
    for li in layers:
        require(0 <= li < trace.num_layers, f"layer ({li}) must lie in [0, {trace.num_layers}) (layers of the trace)")
    T = int(meta.num_tokens) if not args.max_tokens else min(int(meta.num_tokens), args.max_tokens)
    require(T >= R, f"tokens ({T}) must be >= world size ({R}) to give every rank a token")
    tpr = np.full(R, T // R, dtype=np.int64)
    tpr[: T % R] += 1
    off = np.concatenate([[0], np.cumsum(tpr)])
    lo, hi = int(off[rank]), int(off[rank + 1])
    capacity = int(tpr.max())
    check = args.check if args.check is not None else T * H <= (1 << 22)
    dtype = _DTYPES[args.dispatch_dtype]
    buf = Buffer(capacity=capacity, hidden=H, top_k=K, num_experts=E, strategy=args.strategy,
                 options=_parse_opts(args.opt), gpus_per_node=args.gpus_per_node, timeout_s=args.timeout,
                 dispatch_dtype=dtype, token_padding=args.token_padding, expert_ffn=F)
    home = torch.from_numpy(np.flatnonzero(buf.ctx.placement.home_E == rank))
    per_layer = []
    for li in layers:
        lr = trace.layer(li, 0, T)
        ids = torch.from_numpy(np.ascontiguousarray(lr.topk_ids_TK[lo:hi]))
        w = torch.from_numpy(np.ascontiguousarray(lr.topk_weights_TK[lo:hi]))
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + li * 1009 + rank)
        x = torch.randn(hi - lo, H, generator=gen)
        grad_out = torch.randn(hi - lo, H, generator=gen)
        full_w = init_experts(E, H, F, seed=args.seed * 7919 + li)
        params = [p[home].clone().requires_grad_(args.backward) for p in full_w]
        times = np.zeros((args.iters, len(PHASES)))
        for it in range(args.warmup + args.iters):
            for p in params:
                p.grad = None
            xi = x.clone().requires_grad_(args.backward)
            dist.barrier()
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
            if args.backward:
                (out * grad_out).sum().backward()
            t.append(time.perf_counter())
            if it >= args.warmup:
                d = np.diff(t)  # exchange, plan, rows, prefetch, expert, combine, backward
                times[it - args.warmup] = [d[0], d[1], d[0] + d[1] + d[2], d[3], d[4], d[5], d[6], t[-1] - t[0]]
        mean_phase = torch.from_numpy(times.mean(axis=0))
        allt = [torch.empty_like(mean_phase) for _ in range(R)]
        dist.all_gather(allt, mean_phase)
        allt_RP = torch.stack(allt).numpy()
        plan = handle.plan
        fwd = plan.bytes_summary()
        sent = sum(p.remote_bytes() for p in plan.phases("forward"))
        if args.backward:
            sent += sum(p.remote_bytes() for p in plan.phases("backward"))
        n_fetched = torch.tensor([buf.last_fetched])  # actually fetched in the last iteration (cached replicas not)
        all_f = [torch.empty_like(n_fetched) for _ in range(R)]
        dist.all_gather(all_f, n_fetched)
        entry = {
            "layer": li, "layer_id": int(lr.layer),
            "phases": {name: _stats(allt_RP[:, j]) for j, name in enumerate(PHASES)},
            "phases_R": {name: [float(v) * 1e3 for v in allt_RP[:, j]] for j, name in enumerate(PHASES)},
            "bytes": {**fwd, "sent": int(sent)},
            "recv_rows_per_rank": plan.real_rows_R().tolist(),
            "rows_per_rank_padded": plan.rows_R().tolist(),
            "dropped": plan.dropped, "padded": plan.padded, "weight_copies": plan.weight_copies,
            "fetched_weights": int(sum(int(f) for f in all_f)), "hops": len(plan.hops),
            "plan_seconds": plan.plan_seconds, "correct": None, "max_abs_err": None,
        }
        if check:
            entry.update(_check(rank, buf, handle, lr, x, xi, out, grad_out, params, full_w, capacity, tpr,
                                args.backward, dtype, dense_moe))
        per_layer.append(entry)
    if rank != 0:
        return None
    totals = {name: sum(e["phases"][name]["max_ms"] for e in per_layer) for name in PHASES}
    # per rank, summed over layers: which rank is slow in which phase (a straggler)
    phases_R = {name: [float(v) for v in np.sum([e["phases_R"][name] for e in per_layer], axis=0)] for name in PHASES}
    checked = [e["correct"] for e in per_layer if e["correct"] is not None]
    return {
        "strategy": args.strategy, "options": buf.options, "world_size": R, "gpus_per_node": buf.gpus_per_node,
        "trace": str(args.trace), "layers": layers, "hidden": H, "ffn": F, "num_experts": E, "top_k": K,
        "tokens": T, "tokens_per_rank": tpr.tolist(), "iters": args.iters, "warmup": args.warmup,
        "backward": bool(args.backward), "dispatch_dtype": args.dispatch_dtype,
        "dispatch_ms": totals["dispatch"], "prefetch_ms": totals["prefetch"], "expert_ms": totals["expert"],
        "combine_ms": totals["combine"], "backward_ms": totals["backward"], "total_ms": totals["total"],
        "phases": {name: {"max_ms": totals[name],
                          "mean_ms": sum(e["phases"][name]["mean_ms"] for e in per_layer)} for name in PHASES},
        "phases_R": phases_R,
        "slowest_rank": {name: int(np.argmax(v)) for name, v in phases_R.items()},
        "bytes_sent": int(sum(e["bytes"]["sent"] for e in per_layer)),
        "correct": (all(checked) if checked else None),
        "max_abs_err": max((e["max_abs_err"] for e in per_layer if e["max_abs_err"] is not None), default=None),
        "per_layer": per_layer,
    }


def _check(rank, buf, handle, lr, x, xi, out, grad_out, params, full_w, capacity, tpr, backward, dtype, dense_moe):
    """Rank 0 compares the gathered outputs (and gradients) with the dense reference."""
    outs = _gather_rows(out.detach(), capacity, None)
    xs = _gather_rows(x, capacity, None)
    gos = _gather_rows(grad_out, capacity, None)
    gxs = _gather_rows(xi.grad, capacity, None) if backward else None
    if backward:  # every rank's home-expert gradients, [epn_r, P] padded to E rows
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
        home_E = buf.ctx.placement.home_E
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


def _summary(rep: dict[str, Any]) -> str:
    lines = [f"replay {rep['strategy']} {rep['options']} on {rep['world_size']} ranks, {rep['tokens']} tokens, "
             f"H={rep['hidden']} F={rep['ffn']}, layers {rep['layers']}"]
    ph = rep["phases"]
    lines.append("  phase ms (max / mean over ranks): " + ", ".join(
        f"{k} {ph[k]['max_ms']:.2f}/{ph[k]['mean_ms']:.2f}" for k in PHASES if k != "backward" or rep["backward"]))
    lines.append(f"  bytes sent {rep['bytes_sent']:,}; correct: {rep['correct']} (max abs err {rep['max_abs_err']})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``launch/replay.py`` and ``python -m moonep_sim.gloo.replay``). Exits non-zero on error."""
    args = None
    try:
        args = _parse(argv)
        if not dist.is_initialized():
            require("RANK" in os.environ and "WORLD_SIZE" in os.environ,
                    "RANK / WORLD_SIZE (unset) must be set: launch with torchrun --nproc_per_node N launch/replay.py ...")
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(args.timeout, 1.0)))
        rep = run(args)
        if rep is not None:
            if args.json:
                write_text_atomic(args.json, json.dumps(rep, indent=1, sort_keys=True))
            if not args.quiet:
                print(_summary(rep), flush=True)
        dist.barrier()
        code = 0 if rep is None or rep["correct"] is not False else 3
    except MoonEPSimError as e:
        rank = os.environ.get("RANK", "?")
        print(f"moonep-sim: error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1 if isinstance(e, CommError) else 2
    except RuntimeError as e:  # a collective outside the Buffer (report gathering) failed
        rank = os.environ.get("RANK", "?")
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"moonep-sim: error: rank {rank}: CommError: replay report collective failed: {line[:240]}",
              file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without process-group destructors: after a failed collective they can block
    os._exit(code)


if __name__ == "__main__":
    main()
