"""Optimizer CPU offload: the optimizer state in host memory, its step on the CPU.

What real frameworks do (Megatron-Core's ``--optimizer-cpu-offload --optimizer-offload-fraction f``,
its ``HybridDeviceOptimizer``; DeepSpeed's ZeRO-Offload): of the parameters a rank's optimizer
updates (its ZeRO shard), a fraction ``f`` gets a pinned fp32 master copy and its Adam moments in
host memory and is stepped by a CPU Adam; the rest stays on the GPU. Each step the rank copies
those parameters' gradients device -> host, the CPU steps them, and the updated parameters go back
host -> device. The gradients themselves stay on the GPU (the data-parallel gradient buffer), as do
the weights.

Notation: S the parameters of a rank's optimizer shard, f the offloaded fraction, G the GPUs of a
node (they share its host). Bytes; microseconds.

Memory (:func:`host_bytes_per_param`, used by :func:`moonep_sim.step.memory.memory_for_layout`):
the GPU keeps ``(1 - f) S`` parameters' optimizer state; the host keeps ``f S`` parameters' state
(``optimizer_bytes_per_param``: master and moments) plus the pinned fp32 gradient copy Megatron
allocates beside it (:data:`HOST_GRAD_BYTES`). A node's host memory holds its G GPUs' shares
(:func:`host_check`): more than ``[cpu] memory_GiB`` is out of memory, as HBM is.

Time (:func:`optimizer_step_us`):

- GPU part: ``(1 - f) S`` parameters, memory-bound at :data:`GPU_ADAM_BYTES_PER_PARAM` per
  parameter over the HBM (``gpu_mem_bandwidth_GBps x gpu_mem_efficiency``), as before offload.
- device -> host: ``f S x`` :data:`D2H_BYTES` (fp32 gradients) over the GPU's PCIe link
  (``[cpu] pcie_GBps x`` :data:`PCIE_EFFICIENCY`); host -> device: ``f S x`` :data:`H2D_BYTES`
  (the fp32 master, cast to the weight's dtype on the GPU) the same way, the other direction.
- CPU Adam: memory-bound, streaming :data:`CPU_ADAM_BYTES_PER_PARAM` per parameter over the
  node's DRAM (``[cpu] mem_bandwidth_GBps x`` :data:`CPU_ADAM_MEM_EFFICIENCY`), for the ``G f S``
  parameters of the node's GPUs at once (they share the host).
- What overlaps: with Megatron's ``--overlap-cpu-optimizer-d2h-h2d`` (one CPU optimizer per
  parameter, copies on their own streams) the copies and the CPU step pipeline over parameters:
  ``max(d2h, cpu, h2d)``; without it ``d2h + cpu + h2d`` in sequence. Either way the GPU part
  runs beside the CPU part (the GPU optimizer is launched before the CPU steps): the step is the
  larger of the two.
"""

from __future__ import annotations

from typing import Any

from moonep_sim.errors import require

#: ASSUMED: mixed-precision Adam on the GPU reads the fp32 master weight, gradient and two moments
#: and writes the master, the moments and the bf16 weight: 4 x 4 + 3 x 4 + 2 bytes per parameter.
GPU_ADAM_BYTES_PER_PARAM = 30
#: Megatron's HybridDeviceOptimizer copies the fp32 main gradients to pinned host buffers ...
D2H_BYTES = 4
#: ... and the updated fp32 master back (``param.data.copy_``: cast to the weight's dtype on the GPU).
H2D_BYTES = 4
#: The pinned fp32 gradient copy it keeps in host memory beside the offloaded state.
HOST_GRAD_BYTES = 4
#: CPU Adam (fp32) streams master, gradient and both moments in (16 B) and master and moments out (12 B).
CPU_ADAM_BYTES_PER_PARAM = 28
#: ASSUMED: a pinned-memory copy reaches 80% of the PCIe link's per-direction rate.
PCIE_EFFICIENCY = 0.8
#: ASSUMED: a vectorised CPU Adam (DeepSpeed's CPUAdam, torch's fused AdamW) sustains half the
#: node's DRAM bandwidth (its fp32 arithmetic and the concurrent DMA copies share the sockets).
CPU_ADAM_MEM_EFFICIENCY = 0.5


def check_offload(fraction: float, where: str = "--optimizer-offload-fraction") -> float:
    """``fraction`` as a float in [0, 1], or one error line naming it."""
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0.0 <= float(fraction) <= 1.0
    require(ok, f"{where} ({fraction!r}) must lie in [0, 1]: the share of the optimizer state held and stepped "
                "on the host (0 = none, 1 = all)")
    return float(fraction)


def check_host(topo, fraction: float, mode: str, where: str = "--optimizer-offload-fraction") -> None:
    """Refuse an offload the job cannot do: outside training, or on a topology whose host side is
    not given (``[cpu] memory_GiB`` 0)."""
    if not fraction:
        return
    require(mode == "train", f"{where} ({fraction:g}) needs --mode train (mode {mode}): only training has an "
                             "optimizer step")
    require(float(getattr(topo, "cpu_memory_GiB", 0) or 0) > 0 and float(getattr(topo, "cpu_pcie_GBps", 0) or 0) > 0
            and float(getattr(topo, "cpu_mem_bandwidth_GBps", 0) or 0) > 0,
            f"{where} ({fraction:g}) needs the host side of topology {getattr(topo, 'name', '?')} ([cpu] memory_GiB, "
            "pcie_GBps, mem_bandwidth_GBps): not given for this cluster")


def host_bytes_per_param(optimizer_bytes_per_param: float) -> float:
    """Host bytes per offloaded parameter: its optimizer state and the pinned fp32 gradient copy."""
    return float(optimizer_bytes_per_param) + HOST_GRAD_BYTES


def optimizer_step_us(shard_params: float, fraction: float, topo, gpus_per_node: int,
                      overlap: bool = False) -> dict[str, float]:
    """The optimizer step of one rank whose optimizer shard has ``shard_params`` parameters, a
    fraction ``fraction`` offloaded, the node's ``gpus_per_node`` GPUs offloading alike (see the
    module docstring): ``{"gpu_us", "d2h_us", "cpu_us", "h2d_us", "total_us"}``. With ``fraction`` 0
    only ``gpu_us`` (the whole shard on the GPU)."""
    S, f = float(shard_params), float(fraction)
    hbm = topo.gpu_mem_bandwidth_GBps * topo.gpu_mem_efficiency * 1e3   # bytes per us
    gpu = (1.0 - f) * S * GPU_ADAM_BYTES_PER_PARAM / hbm
    d2h = h2d = cpu = 0.0
    if f > 0:
        pcie = topo.cpu_pcie_GBps * PCIE_EFFICIENCY * 1e3
        dram = topo.cpu_mem_bandwidth_GBps * CPU_ADAM_MEM_EFFICIENCY * 1e3
        d2h = f * S * D2H_BYTES / pcie
        h2d = f * S * H2D_BYTES / pcie
        cpu = max(int(gpus_per_node), 1) * f * S * CPU_ADAM_BYTES_PER_PARAM / dram
    host = max(d2h, cpu, h2d) if overlap else d2h + cpu + h2d
    return {"gpu_us": gpu, "d2h_us": d2h, "cpu_us": cpu, "h2d_us": h2d, "total_us": max(gpu, host)}


def host_check(mem: dict, topo, gpus_per_node: int, world: int) -> dict[str, Any]:
    """A node's host memory under the account ``mem`` (:func:`~moonep_sim.step.memory.memory_for_layout`:
    ``host_bytes_per_gpu``, the largest rank's): the node's ``min(G, world)`` GPUs each hold that much
    (ASSUMED: a node's GPUs lie in one pipeline stage, as the tp x cp x dp grid runs fastest).
    ``{"bytes_per_node", "capacity_bytes_per_node", "oom"}``; ``oom`` None when nothing is offloaded."""
    per_gpu = float(mem.get("host_bytes_per_gpu", 0.0))
    cap = float(getattr(topo, "cpu_memory_GiB", 0) or 0) * 2**30
    node = per_gpu * max(min(int(gpus_per_node), int(world)), 1)
    return {"bytes_per_node": node, "capacity_bytes_per_node": cap,
            "oom": (node > cap) if per_gpu > 0 else None}


def offload_fits(mem0: dict, fraction: float, cap: float, host_cap_node: float, gpus_on_node: int,
                 optimizer_bytes_per_param: float) -> tuple[bool, bool]:
    """Whether an account taken with nothing offloaded (``mem0``:
    :func:`~moonep_sim.step.memory.memory_for_layout`) fits with ``fraction`` of the optimizer state
    on the host, without recomputing it (the offload takes ``fraction`` of each stage's optimizer
    part off the GPU and puts it, with the pinned gradient copy, on the host): ``(its weights,
    gradients and remaining optimizer state fit in cap and the host memory of the node's
    gpus_on_node GPUs in host_cap_node, the whole peak fits too)``. ``cap`` 0: no limit."""
    f, obp = float(fraction), float(optimizer_bytes_per_param)
    static = whole = 0.0
    host = 0.0
    for st in mem0["stages"]:
        p = st["parts"]
        opt = p.get("optimizer", 0.0)
        static = max(static, p.get("weights", 0.0) + p.get("gradients", 0.0) + opt * (1 - f))
        whole = max(whole, st["peak_bytes"] - opt * f)
        if obp > 0:
            host = max(host, opt * f / obp * host_bytes_per_param(obp))
    host_ok = f == 0 or host * max(int(gpus_on_node), 1) <= host_cap_node
    return (not cap or static <= cap) and host_ok, (not cap or whole <= cap) and host_ok


__all__ = ["CPU_ADAM_BYTES_PER_PARAM", "CPU_ADAM_MEM_EFFICIENCY", "D2H_BYTES", "GPU_ADAM_BYTES_PER_PARAM", "H2D_BYTES",
           "HOST_GRAD_BYTES", "PCIE_EFFICIENCY", "check_host", "check_offload", "host_bytes_per_param", "host_check", "offload_fits",
           "optimizer_step_us"]
