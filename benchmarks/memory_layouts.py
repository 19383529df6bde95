"""Memory per pipeline stage of published and candidate layouts (the account of
``moonep_sim.step.memory.memory_for_layout``; no Plans: a balanced-routing stand-in for the routed
experts' rows). Prints DeepSeek-V3 in its published pretraining layout stage by stage, Kimi K3
layouts on 64, 256 and 1024 H800s (with optimizer CPU offload where it needs it, the node's host
memory beside) with the smallest change that fits where one does not, and K3's training floor.

Run: python benchmarks/memory_layouts.py
"""

from __future__ import annotations

from moonep_sim.models import get_model
from moonep_sim.sim.topology import load_topology
from moonep_sim.step.memory import MemoryOptions, memory_for_layout
from moonep_sim.step.layout_step import chunk_params
from moonep_sim.step.memory_fit import host_capacity, smallest_fit
from moonep_sim.step.parallel import Parallel
from moonep_sim.step.stack import step_shape

GiB = 2**30


def _parts(d: dict) -> str:
    return ", ".join(f"{k} {v / GiB:.1f}" for k, v in d.items())


def deepseek_v3() -> None:
    m = get_model("deepseek-v3")
    par = Parallel(pp=16, dp=128, ep=64, zero=1, pp_schedule="dualpipe", global_batch_size=15360).check(2048, m)
    opts = MemoryOptions(gemm_dtype="fp8", optimizer_bytes_per_param=8, recompute="selective",
                         recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
    mem = memory_for_layout(m, step_shape(m, "train", 4096, None), par, [], opts)
    print(f"DeepSeek-V3, {par.label()} dualpipe ZeRO-1, 2048 GPUs, one 4096-token sequence per micro-batch; "
          f"{opts.describe()}")
    print("| stage | layers (MoE) | micro-batches alive | peak GiB | parts (GiB) |")
    print("| --- | --- | --- | --- | --- |")
    for s in mem["stages"]:
        print(f"| {s['stage']} | {s['layers']} ({s['moe_layers']}) | {s['chunks_alive']} | "
              f"{s['peak_bytes'] / GiB:.1f} | {_parts(s['parts'])} |")
    base = memory_for_layout(m, step_shape(m, "train", 4096, None), par, [], MemoryOptions())
    print(f"peak {mem['peak_bytes'] / GiB:.1f} GiB (stage {mem['peak_stage']}); the same layout with bf16 GEMMs, "
          f"12-byte Adam and no recompute: {base['peak_bytes'] / GiB:.1f} GiB")


def kimi_k3() -> None:
    m = get_model("kimi-k3")
    topo = load_topology("h800-cx7")
    cap, host = topo.gpu_memory_GiB * GiB, host_capacity(topo)
    G = topo.gpus_per_node
    off = dict(recompute="full", gemm_dtype="fp8", optimizer_offload=1.0)
    rows = [
        (64, "decode", Parallel(tp=8, dp=8, ep=64), MemoryOptions(weight_dtype="fp8", kv_dtype="fp8"), 64, 8192),
        (64, "decode", Parallel(dp=64, ep=64, dp_attention=True), MemoryOptions(weight_dtype="fp8", kv_dtype="fp8"),
         64, 8192),
        (256, "decode", Parallel(tp=8, dp=32, ep=128), MemoryOptions(weight_dtype="fp8", kv_dtype="fp8"), 64, 8192),
        (64, "train", Parallel(pp=8, dp=8, ep=8, zero=3, global_batch_size=64), MemoryOptions(**off), 4096, None),
        (256, "train", Parallel(pp=16, dp=16, ep=16, global_batch_size=4096), MemoryOptions(recompute="full"), 4096,
         None),
        (256, "train", Parallel(pp=16, dp=16, ep=16, global_batch_size=256), MemoryOptions(**off), 4096, None),
        (256, "train", Parallel(pp=16, dp=16, ep=16, zero=2, global_batch_size=256), MemoryOptions(**off), 4096, None),
        (1024, "train", Parallel(pp=16, dp=64, ep=64, global_batch_size=4096), MemoryOptions(), 4096, None),
        (1024, "train", Parallel(pp=16, dp=64, ep=64, global_batch_size=4096), MemoryOptions(recompute="full"), 4096,
         None),
    ]
    print(f"\nKimi K3 ({m.layers} layers, {m.num_experts} experts) on H800 ({cap / GiB:.0f} GiB; hosts "
          f"{topo.cpu_memory_GiB:g} GiB per node of {G} GPUs)")
    print("| GPUs | mode | layout | options | peak GiB | host GiB per node | fits | smallest change that fits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gpus, mode, par, opts, tokens, ctx in rows:
        par.check(gpus, m)
        shape = step_shape(m, mode, tokens, ctx)
        mem = memory_for_layout(m, shape, par, [], opts)
        node = mem["host_bytes_per_gpu"] * min(G, gpus)
        ok = mem["peak_bytes"] <= cap and node <= host
        fit = "-" if ok else smallest_fit(m, shape, par, [], opts, cap, host_bytes_per_node=host, gpus_per_node=G)
        fit = fit if isinstance(fit, str) else (f"{fit['change']} ({fit['peak_bytes'] / GiB:.1f} GiB)" if fit
                                                else "none tried fits")
        print(f"| {gpus} | {mode} | {par.label()} ZeRO-{par.zero} {par.pp_schedule} | {opts.describe()} | "
              f"{mem['peak_bytes'] / GiB:.1f} | {node / GiB:.0f} | {'yes' if ok else 'no'} | {fit} |")
    floors(m, cap, host, G)


def floors(m, cap: float, host: float, G: int) -> None:
    """The physical floor of training: what must stay on the GPU (bf16 weights, fp32 gradients; the
    optimizer state offloaded) over every GPU, and the offloaded state over every node's host."""
    import math

    params = sum(chunk_params(m, 0, m.layers, True, True))
    dev, hst = 2 + 4, 12 + 4
    print(f"\nTraining floor of {m.name}: {params / 1e12:.3f}T parameters")
    print("| GPUs | on the GPU: params x 6 B / GPUs (GiB) | on the host: params x 16 B / nodes (GiB per node) | "
          "fits the floor |")
    print("| --- | --- | --- | --- |")
    for gpus in (64, 256, 1024):
        d, h = params * dev / gpus, params * hst / (gpus // G)
        print(f"| {gpus} | {d / GiB:.0f} of {cap / GiB:.0f} | {h / GiB:.0f} of {host / GiB:.0f} | "
              f"{'yes' if d <= cap and h <= host else 'no'} |")
    need = max(math.ceil(params * dev / cap), math.ceil(params * hst / host) * G)
    print(f"at least {need} GPUs ({math.ceil(need / G)} nodes) before any activation; "
          f"without offload (18 B on the GPU): {math.ceil(params * 18 / cap)}")


if __name__ == "__main__":
    deepseek_v3()
    kimi_k3()
