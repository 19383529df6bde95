"""Measure a step's compute ops with torch and write a ``--compute-profile`` CSV (docs/steps.md).

Times every op the step model prices for one model and step shape -- norms, the attention
projections and core, the router, shared experts, dense FFN, embedding, LM head, loss, and one
routed expert's SwiGLU at several row counts -- on the GPU torch finds (CUDA), else on the CPU,
and writes ``op,shape,time_us`` rows keyed exactly as ``moonep_sim.step.stack`` keys them::

    python benchmarks/profile_ops.py --model kimi-k2 --mode train --tokens 4096 -o prof.csv
    moonep-sim step --gen model=kimi-k2,tokens-per-rank=4096 --mode train --compute-profile prof.csv ...

The ops are stand-ins of the same shapes (one bf16 matmul of the op's weights for a GEMM, a
scaled-dot-product attention of the op's heads and context for the attention core, elementwise
passes over the op's bytes for memory-bound ops); backward ops are timed as torch autograd's
backward of the same stand-in. A real engine's kernels will differ: measure your own where you can
(Vidur and SimAI profile the serving engine's kernels the same way). On a CPU, use small shapes
(``--tokens 64``, a small model file): the point there is the format, not the numbers.
"""

from __future__ import annotations

import argparse
import csv
import time

import torch

from moonep_sim.models import resolve_model
from moonep_sim.step.compose import all_ops, stack_ops
from moonep_sim.step.stack import step_shape

EXPERT_ROWS = (1, 8, 32, 128, 512, 2048, 8192)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: torch.device, reps: int) -> float:
    """Median microseconds of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    _sync(dev)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append((time.perf_counter() - t0) * 1e6)
    out.sort()
    return out[len(out) // 2]


def op_fn(op, dev, dtype, model):
    """A callable running a stand-in of ``op`` (see the module docstring)."""
    bwd = op.name.endswith("_bwd")
    base = op.name[:-4] if bwd else op.name
    if op.kind == "bytes":
        n = max(int(op.bytes / 2 / 4), 1)  # four passes of bf16 elements
        x = torch.randn(n, device=dev, dtype=dtype)
        return lambda: (x * 1.0001 + x).sum()
    if op.kind == "attention":
        T, n = op.rows, max(model.heads, 1)
        d = max(model.head_dim, 16)
        ctx = int(op.flops / max(2.0 * T * n * 2 * d, 1.0)) or 1
        q = torch.randn(1, n, T, d, device=dev, dtype=dtype, requires_grad=bwd)
        k = torch.randn(1, n, max(ctx, 1), d, device=dev, dtype=dtype, requires_grad=bwd)
        v = torch.randn(1, n, max(ctx, 1), d, device=dev, dtype=dtype, requires_grad=bwd)
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if bwd:
            return lambda: f().sum().backward()
        return f
    # a GEMM of op.rows rows through its weights: rows x H @ H x (weights / H)
    H = model.hidden
    cols = max(int(op.flops / max(2.0 * op.rows * H, 1.0)) // (2 if bwd else 1), 1)
    a = torch.randn(op.rows, H, device=dev, dtype=dtype, requires_grad=bwd)
    w = torch.randn(H, cols, device=dev, dtype=dtype, requires_grad=bwd)
    if bwd:
        return lambda: (a @ w).sum().backward()
    return lambda: a @ w


def expert_fn(rows: int, model, dev, dtype, bwd: bool):
    D, F = model.dispatch_hidden, model.expert_ffn
    x = torch.randn(rows, D, device=dev, dtype=dtype, requires_grad=bwd)
    wg = torch.randn(D, F, device=dev, dtype=dtype, requires_grad=bwd)
    wu = torch.randn(D, F, device=dev, dtype=dtype, requires_grad=bwd)
    wd = torch.randn(F, D, device=dev, dtype=dtype, requires_grad=bwd)
    f = lambda: (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd
    return (lambda: f().sum().backward()) if bwd else f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model preset or file (with its layer-stack fields)")
    ap.add_argument("--mode", choices=("train", "prefill", "decode"), default="train")
    ap.add_argument("--tokens", type=int, required=True, help="tokens per rank (per micro-batch for two-batch)")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = resolve_model(a.model)
    shape = step_shape(model, a.mode, a.tokens, a.context)
    train = a.mode == "train"
    seen, rows = set(), []
    for op in all_ops(stack_ops(model, shape), train):
        if (op.name, op.shape) in seen:
            continue
        seen.add((op.name, op.shape))
        rows.append((op.name, op.shape, timed(op_fn(op, dev, dtype, model), dev, a.reps)))
    for m in EXPERT_ROWS:
        rows.append(("expert", f"rows={m}", timed(expert_fn(m, model, dev, dtype, False), dev, a.reps)))
        if train:
            rows.append(("expert_bwd", f"rows={m}", timed(expert_fn(m, model, dev, dtype, True), dev, a.reps)))
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        f.write(f"# measured by benchmarks/profile_ops.py on {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), "
                f"model {model.name}, mode {a.mode}, tokens {a.tokens}, context {shape.context}\n")
        w.writerow(["op", "shape", "time_us"])
        for r in rows:
            w.writerow([r[0], r[1], f"{r[2]:.3f}"])
    print(f"wrote {len(rows)} rows to {a.out}")


if __name__ == "__main__":
    main()
