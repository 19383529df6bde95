"""When nothing fits: the smallest change to a layout or its options that does, found by re-running
the memory account (:func:`moonep_sim.step.memory.memory_for_layout`), never guessed.

The candidates, cheapest first (what each costs the step: recompute costs FLOPs, ZeRO stages
collectives, more pipeline stages a deeper bubble, lower precision accuracy), each tried alone
and then in pairs:

- train: selective recompute, then full; ZeRO one stage up (to 3); the whole optimizer state on
  the host (optimizer CPU offload, where the cluster gives its hosts: ``[cpu] memory_GiB``; the
  node's host memory must then hold it too); twice the pipeline stages (same GPUs: dp halved; EP
  kept when it still divides the stage's ranks, else halved);
- serving: fp8 KV cache; fp8 weights (where the GPU runs fp8); twice the pipeline stages.

A change of EP size re-accounts the experts with a balanced stand-in for the strategy's Plans
(:meth:`~moonep_sim.step.memory.PlanFootprint.balanced`): the changed layout has no Plans yet.
"""

from __future__ import annotations

import dataclasses
from itertools import combinations
from typing import Any, Callable, Sequence

from moonep_sim.errors import ConfigError
from moonep_sim.models import ModelSpec
from moonep_sim.step.memory import MemoryOptions, PlanFootprint, memory_for_layout
from moonep_sim.step.parallel import Parallel, pure_ep
from moonep_sim.step.stack import StepShape

Change = tuple[str, Callable[[Parallel, MemoryOptions], "tuple[Parallel, MemoryOptions] | None"]]


def _recompute(level: str):
    def f(par, o):
        order = ("none", "selective", "full")
        return (par, dataclasses.replace(o, recompute=level)) if order.index(o.recompute) < order.index(level) else None
    return f


def _zero(par, o):
    return (dataclasses.replace(par, zero=par.zero + 1), o) if par.zero < 3 and par.dp * par.cp > 1 else None


def _more_pp(model: ModelSpec):
    def f(par, o):
        if par.dp % 2 or par.stages * 2 > model.layers:
            return None
        dense = par.tp * par.cp * (par.dp // 2)
        ep = par.ep if dense % (par.ep * par.etp) == 0 else par.ep // 2
        if ep < 1 or dense % (ep * par.etp):
            return None
        mbs = par.micro_batch_size
        gbs = par.global_batch_size
        try:
            q = dataclasses.replace(par, pp=par.pp * 2, dp=par.dp // 2, ep=ep, first_stage_layers=0, last_stage_layers=0,
                                    global_batch_size=gbs if not gbs or gbs % (par.dp // 2 * mbs) == 0 else 0)
            q.stage_layers(model.layers)
        except ConfigError:
            return None
        return q, o
    return f


def _offload(par, o):
    return (par, dataclasses.replace(o, optimizer_offload=1.0)) if o.optimizer_offload < 1.0 else None


def _dtype(field: str, name: str):
    def f(par, o):
        return (par, dataclasses.replace(o, **{field: name})) if getattr(o, field) not in (name, "mxfp4", "nvfp4",
                                                                                           "fp4") else None
    return f


def candidate_changes(model: ModelSpec, mode: str, fp8: bool = True, offload: bool = False) -> list[Change]:
    """The changes tried, cheapest first (see the module docstring); ``offload``: whether the
    cluster's hosts can take the optimizer state."""
    if mode == "train":
        return [("selective recompute", _recompute("selective")), ("ZeRO one stage up", _zero),
                ("full recompute", _recompute("full"))] \
            + ([("optimizer CPU offload", _offload)] if offload else []) \
            + [("twice the pipeline stages", _more_pp(model))]
    out: list[Change] = []
    if fp8:
        out += [("fp8 KV cache", _dtype("kv_dtype", "fp8")), ("fp8 weights", _dtype("weight_dtype", "fp8"))]
    return out + [("twice the pipeline stages", _more_pp(model))]


def _describe(par: Parallel, o: MemoryOptions, base: Parallel, bo: MemoryOptions) -> str:
    diff = [f"{k} {getattr(base, k)} -> {getattr(par, k)}" for k in ("pp", "dp", "ep", "zero")
            if getattr(par, k) != getattr(base, k)]
    diff += [f"{k.replace('_', ' ')} {getattr(bo, k)} -> {getattr(o, k)}" for k in ("recompute", "weight_dtype", "kv_dtype",
                                                                                      "optimizer_offload")
             if getattr(o, k) != getattr(bo, k)]
    return ", ".join(diff)


def smallest_fit(model: ModelSpec, shape: StepShape, par: Parallel, plans: Sequence[Any], opts: MemoryOptions,
                 capacity_bytes: float, *, fp8: bool = True, expert_slots: int = 0, host_bytes_per_node: float = 0.0,
                 gpus_per_node: int = 1) -> dict[str, Any] | None:
    """The first change (alone, then two together; cheapest first) under which the account's peak
    is at most ``capacity_bytes`` (and what it offloads fits the node's ``host_bytes_per_node`` over
    its ``gpus_per_node`` GPUs): ``{"change", "detail", "peak_bytes", "layout", "options"}``, or
    None when none of them fits. ``fp8``: whether the GPU runs fp8 (else no fp8 change is tried);
    ``host_bytes_per_node`` 0: the cluster's hosts are not given (no offload is tried)."""
    cands = candidate_changes(model, shape.mode, fp8, host_bytes_per_node > 0)
    per_node = max(min(int(gpus_per_node), par.world), 1)
    tries = [(c,) for c in cands] + list(combinations(cands, 2))
    for combo in tries:
        p, o = par, opts
        ok = True
        for _, fn in combo:
            r = fn(p, o)
            if r is None:
                ok = False
                break
            p, o = r
        if not ok:
            continue
        fps = plans if p.ep == par.ep else [PlanFootprint.balanced(model, p.ep, max(1, shape.tokens // (p.cp * p.tp)),
                                                                   expert_slots)]
        mem = memory_for_layout(model, shape, p, fps, o, expert_slots)
        host_ok = mem["host_bytes_per_gpu"] * per_node <= host_bytes_per_node or not mem["host_bytes_per_gpu"]
        if mem["peak_bytes"] <= capacity_bytes and host_ok:
            return {"change": " + ".join(n for n, _ in combo), "detail": _describe(p, o, par, opts),
                    "peak_bytes": mem["peak_bytes"], "layout": p.to_dict(), "options": o.describe()}
    return None


def attach_fits(cfg, out: dict, footprints: dict) -> None:
    """A step's hook (``moonep_sim.step.run``): when every strategy of ``out`` (name -> figures)
    runs out of memory, each one's smallest change that fits (``fit``:
    :func:`moonep_sim.step.memory_fit.smallest_fit` on its Plans' ``footprints``, under the step's
    layout -- ``cfg.parallel``, default ``pure_ep`` -- and the slots it holds)."""
    if not out or not all(d.get("oom") for d in out.values()):
        return
    par = getattr(cfg, "parallel", None) or pure_ep(cfg.ctx.cluster.ranks)
    fp8 = float(getattr(cfg.topology, "gpu_tflops_fp8", 0) or 0) > 0
    # the plain step (no layout) does not time the optimizer, so it takes no offload: none is suggested
    host = host_capacity(cfg.topology) if getattr(cfg, "parallel", None) is not None else 0.0
    for name, d in out.items():
        d["fit"] = smallest_fit(cfg.model, cfg.shape, par, footprints[name], cfg.memory, d["gpu_memory_bytes"],
                                fp8=fp8, expert_slots=cfg.ctx.placement.num_slots, host_bytes_per_node=host,
                                gpus_per_node=cfg.topology.gpus_per_node)


def host_capacity(topo) -> float:
    """Bytes of host memory per node the cluster gives (``[cpu] memory_GiB``; 0 = not given)."""
    return float(getattr(topo, "cpu_memory_GiB", 0) or 0) * 2**30


__all__ = ["attach_fits", "candidate_changes", "host_capacity", "smallest_fit"]
