"""A layout search: every valid parallel layout of a model on N GPUs, priced, those that fit in
memory ranked per strategy by tokens/s per GPU.

Notation: N GPUs, G per node, t tp, p pp, d dp, e ep; T tokens per expert-grid rank of one
micro-batch (``micro_batch_size x seq / t``).

**Enumerated** (:func:`enumerate_layouts`): t over the divisors of G that divide the heads; p over
the divisors of N / t up to the layers; d = N / (t p); e over the divisors of t d that divide the
expert slots; cp = etp = 1; each ZeRO stage asked for (default 1, 2 and 3) and each pp schedule
where it applies (interleaved with vpp 2, DualPipe with an even pp). Training keeps one global batch for all
layouts (default ``N x micro_batch_size`` sequences, so every d divides it); each layout is
validated as a whole (:meth:`~moonep_sim.step.parallel.Parallel.check`), the invalid ones dropped.

Layouts whose weights, gradients and optimizer state alone exceed the GPU (the memory account on
a balanced stand-in, :func:`~moonep_sim.step.memory.memory_for_layout`) are dropped before any
simulation (counted and flagged). **Optimizer CPU offload** is enumerated where the cluster gives
its hosts (``[cpu] memory_GiB``) and no fraction is asked for: each layout takes the least of
``LayoutSpace.offloads`` (0, 0.5, 1) under which its account fits the GPU and the node's host
memory (:func:`~moonep_sim.step.offload.offload_fits`), and the next one up when every strategy
still runs out of memory on the priced Plans. **Priced as a model** (fast: a few layer simulations, not a step per layout): the MoE and dense
layers of a stage program depend on the layout only through (e, T, the EP group's GPUs per node),
so for each distinct such key one layer of each kind (dense or MoE, and its attention kind) is
simulated alone as today's step (one micro-batch of a one-layer model over the EP group, every MoE
layer on the same generated routing -- the search is flagged so); a stage's program is the sum of
its layers' (:func:`priced_stages`, the embedding and the head counted once), then
:func:`~moonep_sim.step.layout_step.schedule_layout` schedules it exactly as a layout step does.
``moonep-sim step`` with the chosen layout runs the full step (every layer its own routing).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

from moonep_sim.errors import ConfigError, require


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model, gpus: int, gpus_per_node: int, mode: str = "train", *, micro_batch_size: int = 1,
                      global_batch_size: int = 0, schedules: tuple[str, ...] = ("1f1b",), seq: int = 4096,
                      expert_slots: int | None = None, zeros: tuple[int, ...] = (1,)) -> list:
    """Every valid :class:`~moonep_sim.step.parallel.Parallel` (see the module docstring)."""
    from moonep_sim.step.parallel import Parallel

    require(gpus >= 1, f"gpus ({gpus}) must be >= 1")
    gbs = global_batch_size or gpus * micro_batch_size
    slots = expert_slots or model.num_experts
    out = []
    for tp in _divisors(min(gpus_per_node, gpus)):
        if gpus % tp or (model.heads and model.heads % tp) or (micro_batch_size * seq) % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > model.layers or (mode != "train" and pp > 1):
                continue
            dp = gpus // (tp * pp)
            for ep in _divisors(tp * dp):
                if slots % ep:
                    continue
                for sch, zero in ((a, z) for a in (schedules if pp > 1 else ("1f1b",))
                                  for z in (zeros if mode == "train" else (1,))):
                    kw = dict(tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_size=micro_batch_size, zero=zero,
                              pp_schedule=sch, global_batch_size=gbs if mode == "train" else 0)
                    if sch == "interleaved":
                        kw["vpp"] = 2
                    try:
                        p = Parallel(**kw).check(gpus, model, expert_slots=slots)
                        if sch == "dualpipe" and p.micro_batches % 2:
                            continue
                    except ConfigError:
                        continue
                    out.append(p)
    return out


def _unit_key(p, G: int, T: int) -> tuple[int, int, int, int, int]:
    """(ep, EP GPUs per node, tokens per rank, TP x CP shards, tp): what a layer's program depends on."""
    from moonep_sim.step.layout_step import expert_group_gpus_per_node

    return p.ep, expert_group_gpus_per_node(p, G), T, p.tp * p.cp, p.tp


def _layer_class(model, l: int) -> tuple[bool, str]:
    return l >= model.dense_layers, model.attention_kind(l)


def price_units(scenario, model, key: tuple[int, int, int, int, int], mode: str, seq: int, costs, mem,
                overlap: str) -> dict:
    """``{layer class: {strategy: StageProgram}}`` of one unit key (ep, EP GPUs per node, T, shards, tp): one
    layer of each class simulated alone as a one-layer model's step over the EP group."""
    from moonep_sim.experiments.step import layer_source
    from moonep_sim.step import StepConfig, step_shape
    from moonep_sim.step.layout_step import (StageProgram, _head_us, dense_probe_model, program_difference,
                                             stage_model)
    from moonep_sim.step.run import simulate_step

    ep, g_ep, T, shards, tp = key
    group = dataclasses.replace(scenario, cluster=(ep, g_ep)).resolved
    shape = dataclasses.replace(step_shape(model, mode, T, seq if mode == "train" else None), shards=shards, tp=tp)
    src = layer_source(group.source, ep, T, model.moe_layers, 1)
    out = {}

    def run(sub) -> dict:
        cfg = StepConfig(sub, group.topology, group.ctx, group.strategies, shape, overlap, costs, mem, {})
        res = simulate_step(cfg, lambda i: src(0), None, None, False)
        return {n: StageProgram.of(res, n) for n, _ in group.strategies}

    first_moe = model.dense_layers
    moe = run(stage_model(model, first_moe, first_moe + 1))
    out[_layer_class(model, first_moe)] = moe
    head = _head_us(model, shape, costs)
    for l in range(model.layers):
        cls = _layer_class(model, l)
        if cls in out:
            continue
        if l >= first_moe:
            out[cls] = run(stage_model(model, l, l + 1))
        else:   # a dense layer runs only beside an MoE layer: that pair less the MoE layer alone
            both = run(dense_probe_model(model, l, l + 1))
            out[cls] = {n: program_difference(both[n], moe[n], head) for n in both}
    return out


def priced_stages(model, p, units: dict, name: str, shape, costs) -> list:
    """Each model stage's :class:`~moonep_sim.step.layout_step.StageProgram` for strategy ``name``:
    the sum of its layers' one-layer programs (each less the embedding and head it ran), the
    embedding and head added once; its MoE layers' Plans (footprints) those of the unit's one layer,
    which :func:`~moonep_sim.step.layout_step.layout_memory` accounts under the layout."""
    from moonep_sim.step.host import stacked_host_blocks
    from moonep_sim.step.layout_step import StageProgram, _head_us, stage_bounds

    ef, hf, eb, hb = _head_us(model, shape, costs)
    out = []
    for a, b in stage_bounds(model, p):
        F, B, Fc, Bc = ef + hf, eb + hb, ef + hf, eb + hb
        progs = [units[_layer_class(model, l)][name] for l in range(a, b)]
        for sp in progs:
            F += sp.forward_us - ef - hf
            B += sp.backward_us - eb - hb
            Fc += sp.forward_compute_us - ef - hf
            Bc += sp.backward_compute_us - eb - hb
        hf_, hb_ = stacked_host_blocks(progs)
        out.append(StageProgram(F, B, Fc, Bc, {}, sum(sp.dropped for sp in progs), sum(sp.entries for sp in progs),
                                tuple(f for sp in progs for f in sp.footprints), host_forward=hf_, host_backward=hb_))
    return out


def no_fit_note(model, gpus: int, static: list, mem, cap: float, shape_of: Callable, fp8: bool, *,
                offload: float = 0.0, host_cap: float = 0.0, gpus_per_node: int = 8) -> dict[str, Any]:
    """Why no layout fits on ``gpus`` GPUs of ``cap`` bytes, with the arithmetic: every parameter's
    bytes that must stay on the GPU (weights in their dtype, and in train the gradients and the
    optimizer state not offloaded: ``offload``, the largest fraction the search tried) sharded over
    every GPU is the floor no layout beats; with offload, the host's floor too (the offloaded state
    and its gradient copy over the nodes' ``host_cap`` bytes each, ``gpus_per_node`` GPUs a node);
    the fewest GPUs both allow; and the smallest change that fits the layout with the least static
    memory (``static``: (layout, bytes) pairs; :func:`~moonep_sim.step.memory_fit.smallest_fit` on a
    balanced stand-in), or None."""
    import math

    from moonep_sim.step.dtypes import WEIGHT_DTYPES, get_dtype
    from moonep_sim.step.layout_step import chunk_params
    from moonep_sim.step.memory_fit import smallest_fit
    from moonep_sim.step.offload import host_bytes_per_param

    dense, expert = chunk_params(model, 0, model.layers, True, True)
    params = dense + expert
    per = get_dtype(mem.weight_dtype, "weight dtype", WEIGHT_DTYPES).weight_bytes
    train = shape_of(static[0][0]).mode == "train" if static else False
    off = offload if train else 0.0
    if train:
        per += mem.grad_bytes_per_param + mem.optimizer_bytes_per_param * (1 - off)
    floor = params * per
    host_per = host_bytes_per_param(mem.optimizer_bytes_per_param) * off
    host_nodes = math.ceil(params * host_per / host_cap) if off and host_cap else 0
    min_gpus = max(math.ceil(floor / cap), host_nodes * gpus_per_node)
    least, least_b = min(static, key=lambda x: x[1]) if static else (None, 0.0)
    fit = smallest_fit(model, shape_of(least), least, [], mem, cap, fp8=fp8, host_bytes_per_node=host_cap,
                       gpus_per_node=gpus_per_node) if least is not None else None
    what = "weights" + (", gradients and optimizer state" if train and off < 1 else ", gradients" if train else "")
    line = (f"no layout fits in memory on {gpus} GPUs: {params / 1e12:.3g}T parameters x {per:g} B that stay on the "
            f"GPU ({what}" + (f"; {off:g} of the optimizer state on the host" if off else "")
            + f") = {floor / 2**40:.1f} TiB, {floor / gpus / 2**30:.0f} GiB per GPU even fully sharded, over the "
            f"{cap / 2**30:g} GiB a GPU has: at least {math.ceil(floor / cap)} GPUs")
    if host_nodes:
        line += (f"; on the host {params / 1e12:.3g}T x {host_per:g} B (the offloaded optimizer state and its fp32 "
                 f"gradient copy) = {params * host_per / 2**40:.1f} TiB over {host_cap / 2**30:g} GiB per node: at least "
                 f"{host_nodes} nodes ({host_nodes * gpus_per_node} GPUs)")
    if min_gpus > gpus:
        line += f"; the smallest change that can fit: at least {min_gpus} GPUs"
    if least is not None:
        line += (f"; the least-loaded layout ({least.label()} ZeRO{least.zero}, {least_b / 2**30:.0f} GiB before "
                 "activations) fits with " + (f"{fit['change']} ({fit['detail']})" if fit else
                                              "no single change or pair tried (recompute, ZeRO, optimizer CPU offload, "
                                              "more pipeline stages, fp8 weights or KV)"))
    return {"parameters": params, "bytes_per_param": per, "floor_bytes": floor, "min_gpus": min_gpus,
            "host_bytes_per_param": host_per, "min_host_nodes": host_nodes, "offload": off,
            "least_layout": least.to_dict() if least is not None else None, "least_static_bytes": least_b,
            "fit": fit, "line": line}


@dataclass(frozen=True)
class LayoutSpace:
    """The layouts a search enumerates on ``gpus`` GPUs (:func:`enumerate_layouts`: micro-batch size,
    global batch size (0: ``gpus x micro_batch_size`` sequences), the pipeline schedules and ZeRO
    stages asked for), how many rows per strategy it ranks (``top``) and the optimizer CPU offload
    fractions a layout may take where the cluster gives its hosts (``offloads``; the least that fits)."""

    gpus: int
    micro_batch_size: int = 1
    global_batch_size: int = 0
    schedules: tuple[str, ...] = ("1f1b",)
    zeros: tuple[int, ...] = (1, 2, 3)
    top: int = 5
    offloads: tuple[float, ...] = (0.0, 0.5, 1.0)

    def __post_init__(self) -> None:
        from moonep_sim.step.offload import check_offload

        require(self.gpus >= 1, f"gpus ({self.gpus}) must be >= 1")
        object.__setattr__(self, "offloads", tuple(sorted({0.0} | {check_offload(f, "offload fraction")
                                                                   for f in self.offloads})))
        require(self.top >= 1, f"top ({self.top}) must be >= 1")


#: the step options a layout search prices with; the others (the search chooses the layout and
#: prices one layer per kind) must keep their defaults
SEARCH_STEP_OPTIONS = ("mode", "overlap", "tokens_per_rank", "context", "gemm_dtype", "weight_dtype", "kv_dtype",
                       "recompute", "optimizer_bytes_per_param", "optimizer_offload", "offload_overlap")


def search_layouts(scenario, space: LayoutSpace, step=None, *,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Every valid layout of ``scenario``'s model on ``space.gpus`` GPUs, priced (see the module
    docstring) with the step options ``step`` (a :class:`~moonep_sim.experiments.step.StepOptions`,
    default train; of its fields :data:`SEARCH_STEP_OPTIONS`, the context the training sequence,
    default 4096). Returns ``{"ranked": {strategy: [the best ``space.top`` rows, fitting ones
    first]}, "rows": every (layout, strategy) row, "valid", "fit", "seconds", ...}``;
    ``progress(done, total)`` after each unit priced and each layout scheduled."""
    from moonep_sim.experiments.compare import load_topology
    from moonep_sim.experiments.spec import parse_cluster
    from moonep_sim.experiments.step import StepOptions

    t0, c0 = time.perf_counter(), time.process_time()
    o = step if step is not None else StepOptions()
    require(isinstance(space, LayoutSpace) and isinstance(o, StepOptions),
            f"space ({type(space).__name__}) and step ({type(o).__name__}) must be a LayoutSpace and a StepOptions "
            "(moonep_sim.experiments.layout_search, moonep_sim.experiments.step)")
    default = StepOptions()
    for f in dataclasses.fields(o):
        require(f.name in SEARCH_STEP_OPTIONS or getattr(o, f.name) == getattr(default, f.name),
                f"step option {f.name} ({getattr(o, f.name)!r}) does not apply to a layout search (it takes "
                f"{', '.join(SEARCH_STEP_OPTIONS)})")
    mode, seq, gpus = o.mode, int(o.context or 4096), space.gpus
    _, G = parse_cluster(scenario.cluster)
    topo = load_topology(scenario.topology)
    G = G or topo.gpus_per_node
    probe = dataclasses.replace(scenario, cluster=(1, 1)).resolved
    model = probe.source.model
    require(probe.source.gen is not None, "a layout search runs on generated routing (gen:...)")
    layouts = enumerate_layouts(model, gpus, min(G, gpus), mode, micro_batch_size=space.micro_batch_size,
                                global_batch_size=space.global_batch_size, schedules=space.schedules, seq=seq,
                                zeros=space.zeros)
    require(bool(layouts), f"no valid layout of {model.name} on {gpus} GPUs ({G} per node): every tp, pp, dp, ep "
                           "split breaks a rule (heads, experts, layers or the GPU count)")
    costs, mem = o.priced(topo)   # as a step prices its ops (no profile, the optimizer over every rank)
    from moonep_sim.step.memory_fit import host_capacity

    host_cap = host_capacity(topo)
    offloads = ((o.optimizer_offload,) if o.optimizer_offload else
                space.offloads if mode == "train" and host_cap > 0 else (0.0,))
    mem = dataclasses.replace(mem, optimizer_offload=0.0)   # each layout takes its own (place_offloads)
    run = _Search(scenario, probe, model, topo, min(G, gpus), o, seq, space.micro_batch_size, costs, mem, progress,
                  offloads)
    # what cannot fit even without activations is dropped before any simulation
    cap = topo.gpu_memory_GiB * 2**30
    static, unfit = run.place_offloads(layouts, cap, host_cap)
    layouts = [p for p in layouts if p in run.start]
    units, skipped, rows = run.price(layouts)
    names = [n for n, _ in probe.strategies]
    ranked = {n: sorted((r for r in rows if r["strategy"] == n),
                        key=lambda r: (not r["fits"], -r["tokens_per_s_per_gpu"]))[:space.top] for n in names}
    fit = len({r["layout"] for r in rows if r["fits"]})
    fp8 = float(getattr(topo, "gpu_tflops_fp8", 0) or 0) > 0
    why = None if fit else no_fit_note(model, gpus, static, mem, cap, run.replica_shape, fp8, offload=max(offloads),
                                       host_cap=host_cap, gpus_per_node=min(G, gpus))
    return {"no_fit": why, "kind": "layout-search", "model": model.name, "mode": mode, "gpus": gpus, "gpus_per_node": G,
            "topology": topo.name, "seq": seq if mode == "train" else None,
            "micro_batch_size": space.micro_batch_size,
            "valid": len(layouts) + len(unfit), "unfit_unpriced": len(unfit), "offloads": offloads,
            "priced": len({r["layout"] for r in rows}), "fit": fit,
            "units_simulated": len(units), "units_skipped": skipped, "ranked": ranked, "rows": rows,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "flags": ["PRICED AS A MODEL: one layer of each kind simulated per (ep, tokens per rank), every MoE "
                      "layer on the same generated routing; run `moonep-sim step` with a chosen layout for its full "
                      "step"] + ([] if fit else [why["line"]])
            + ([f"{len(unfit)} valid layout(s) not priced: their weights, gradients and optimizer state alone "
                f"exceed the GPU's {topo.gpu_memory_GiB:g} GiB"
                + (f" (or the host's {topo.cpu_memory_GiB:g} GiB per node) with as much of the optimizer state on "
                   f"the host as tried ({max(offloads):g})" if max(offloads) else "")] if unfit else [])
            + ([f"OPTIMIZER CPU OFFLOAD: {sum(1 for r in rows if r['optimizer_offload'])} row(s) keep part of the "
                "optimizer state on the host, their optimizer step priced over PCIe and a CPU Adam (ASSUMED rates: "
                "docs/steps.md)"] if any(r["optimizer_offload"] for r in rows) else [])
            + ([f"{len(skipped)} (ep, tokens per rank) pair(s) could not be priced, their layouts dropped: "
                f"{skipped[0]['reason']}"] if skipped else [])}


@dataclass(frozen=True)
class _Search:
    """What pricing a search's layouts shares: the scenario and its one-GPU probe, the model, the
    topology, the GPUs per node (G), the step options, the training sequence and micro-batch size,
    the cost model, the memory options and the progress callback."""

    scenario: Any
    probe: Any
    model: Any
    topo: Any
    G: int
    options: Any
    seq: int
    micro_batch_size: int
    costs: Any
    mem: Any
    progress: Any
    offloads: tuple = (0.0,)
    start: dict = dataclasses.field(default_factory=dict)

    def T_of(self, p) -> int:
        """Tokens per expert-grid rank of one micro-batch under layout ``p``."""
        if self.options.mode == "train":
            return self.micro_batch_size * self.seq // (p.tp * p.cp)
        return max(int(self.options.tokens_per_rank or self.probe.source.gen.tokens_per_rank) // p.tp, 1)

    def replica_shape(self, p):
        """One micro-batch of one data-parallel replica."""
        from moonep_sim.step import step_shape

        mode = self.options.mode
        return step_shape(self.model, mode, self.T_of(p) * p.tp * p.cp, self.seq if mode == "train" else None)

    def place_offloads(self, layouts: list, cap: float, host_cap: float) -> tuple[list, list]:
        """Each layout's least offload fraction under which its balanced account fits (``start``:
        the least whose whole peak fits, else the largest whose weights, gradients and optimizer
        state fit); ``(static, unfit)``: every layout's static bytes at the largest fraction, and
        those that do not fit even so."""
        from moonep_sim.step.memory import memory_for_layout
        from moonep_sim.step.offload import offload_fits

        static, unfit = [], []
        obp = self.mem.optimizer_bytes_per_param
        for p in layouts:
            m0 = memory_for_layout(self.model, self.replica_shape(p), p, [], self.mem)
            fits = [(f, *offload_fits(m0, f, cap, host_cap, min(self.G, p.world), obp)) for f in self.offloads]
            top = self.offloads[-1]
            static.append((p, max(st["parts"].get("weights", 0.0) + st["parts"].get("gradients", 0.0)
                                  + st["parts"].get("optimizer", 0.0) * (1 - top) for st in m0["stages"])))
            whole = [f for f, _, w in fits if w]
            part = [f for f, s, _ in fits if s]
            if whole or part:
                self.start[p] = whole[0] if whole else part[-1]
            else:
                unfit.append(p)
        return static, unfit

    def price(self, layouts: list) -> tuple[dict, list, list]:
        """(the units priced, the unit keys skipped with why, one row per (layout, strategy))."""
        keys = sorted({_unit_key(p, self.G, self.T_of(p)) for p in layouts})
        total = len(keys) + len(layouts)
        units, skipped = {}, []
        o = self.options
        for i, k in enumerate(keys):
            try:
                units[k] = price_units(self.scenario, self.model, k, o.mode, self.seq, self.costs, self.mem, o.overlap)
            except ConfigError as e:   # e.g. the asked skew below what so few tokens can show: those layouts dropped
                skipped.append({"ep": k[0], "tokens_per_rank": k[2], "reason": str(e)})
            if self.progress:
                self.progress(i + 1, total)
        rows = []
        for j, p in enumerate(layouts):
            key = _unit_key(p, self.G, self.T_of(p))
            if key in units:
                rows += self.layout_rows(p, units[key])
            if self.progress:
                self.progress(len(keys) + j + 1, total)
        return units, skipped, rows

    def layout_rows(self, p, units: dict) -> list[dict]:
        """One row per strategy of layout ``p``, scheduled from the priced ``units``."""
        from moonep_sim.step import StepConfig, step_shape
        from moonep_sim.step.layout_step import schedule_layout

        o, model = self.options, self.model
        shape = dataclasses.replace(step_shape(model, o.mode, self.T_of(p), self.seq if o.mode == "train" else None),
                                    shards=p.tp * p.cp, tp=p.tp)
        names = [n for n, _ in self.probe.strategies]
        progs = {n: priced_stages(model, p, units, n, shape, self.costs) for n in names}
        for frac in [f for f in self.offloads if f >= self.start.get(p, 0.0)]:   # the least offload that fits
            mem = dataclasses.replace(self.mem, optimizer_offload=frac)
            cfg = StepConfig(model, self.topo, None, self.probe.strategies, shape, o.overlap, self.costs, mem, {})
            figs = {n: schedule_layout(cfg, p, progs[n], self.G) for n in names}
            if any(not f["oom"] for f in figs.values()):
                break
        fitting = [n for n in names if not figs[n]["oom"]]
        best = max(fitting or names, key=lambda n: figs[n]["tokens_per_s_per_gpu"])
        return [{"layout": p.label() + (f" {p.pp_schedule}" if p.pp > 1 else "") + f" ZeRO{p.zero}"
                 + (f" offload {frac:g}" if frac else ""),
                 "parallel": p.to_dict(), "optimizer_offload": frac,
                 "host_memory_bytes_per_node": f["host_memory"]["bytes_per_node"], "strategy": n, "tokens_per_s_per_gpu": f["tokens_per_s_per_gpu"],
                 "step_time_us": f["step_time_us"], "mfu": f["mfu"],
                 "bubble_fraction": f["pipeline"]["bubble_fraction"], "peak_memory_bytes": f["peak_memory_bytes"],
                 "fits": not f["oom"], "best_at_layout": best,
                 "verdict": (f"{best} fastest at this layout" if fitting else "no strategy fits at this layout")}
                for n in names for f in [figs[n]]]


__all__ = ["LayoutSpace", "SEARCH_STEP_OPTIONS", "enumerate_layouts", "no_fit_note", "price_units", "priced_stages", "search_layouts"]
