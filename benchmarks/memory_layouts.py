"""Memory per pipeline stage of published and candidate layouts (the account of
``moonep_sim.step.memory.memory_for_layout``; no Plans: a balanced-routing stand-in for the routed
experts' rows). Prints DeepSeek-V3 in its published pretraining layout stage by stage, and Kimi K3
layouts on 64, 256 and 1024 H800s with the smallest change that fits where one does not.

Run: python benchmarks/memory_layouts.py
"""

from __future__ import annotations

from moonep_sim.models import get_model
from moonep_sim.sim.topology import load_topology
from moonep_sim.step.memory import MemoryOptions, memory_for_layout
from moonep_sim.step.memory_fit import smallest_fit
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
    cap = load_topology("h800-cx7").gpu_memory_GiB * GiB
    rows = [
        (64, "decode", Parallel(tp=8, dp=8, ep=64), MemoryOptions(weight_dtype="fp8", kv_dtype="fp8"), 64, 8192),
        (64, "decode", Parallel(dp=64, ep=64, dp_attention=True), MemoryOptions(weight_dtype="fp8", kv_dtype="fp8"),
         64, 8192),
        (256, "decode", Parallel(tp=8, dp=32, ep=128), MemoryOptions(weight_dtype="fp8", kv_dtype="fp8"), 64, 8192),
        (256, "train", Parallel(pp=16, dp=16, ep=16, global_batch_size=4096), MemoryOptions(recompute="full"), 4096,
         None),
        (1024, "train", Parallel(pp=16, dp=64, ep=64, global_batch_size=4096), MemoryOptions(), 4096, None),
        (1024, "train", Parallel(pp=16, dp=64, ep=64, global_batch_size=4096), MemoryOptions(recompute="full"), 4096,
         None),
    ]
    print(f"\nKimi K3 ({m.layers} layers, {m.num_experts} experts) on H800 ({cap / GiB:.0f} GiB)")
    print("| GPUs | mode | layout | options | peak GiB | fits | smallest change that fits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gpus, mode, par, opts, tokens, ctx in rows:
        par.check(gpus, m)
        shape = step_shape(m, mode, tokens, ctx)
        mem = memory_for_layout(m, shape, par, [], opts)
        fit = "-" if mem["peak_bytes"] <= cap else smallest_fit(m, shape, par, [], opts, cap)
        fit = fit if isinstance(fit, str) else (f"{fit['change']} ({fit['peak_bytes'] / GiB:.1f} GiB)" if fit
                                                else "none tried fits")
        print(f"| {gpus} | {mode} | {par.label()} ZeRO-{par.zero} {par.pp_schedule} | {opts.describe()} | "
              f"{mem['peak_bytes'] / GiB:.1f} | {'yes' if mem['peak_bytes'] <= cap else 'no'} | {fit} |")


if __name__ == "__main__":
    deepseek_v3()
    kimi_k3()
