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

Layouts whose weights, gradients and optimizer state alone exceed the GPU
(:func:`~moonep_sim.step.layout_step.static_memory_bytes`) are dropped before any simulation
(counted and flagged). **Priced as a model** (fast: a few layer simulations, not a step per layout): the MoE and dense
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


def no_fit_note(model, gpus: int, static: list, mem, cap: float, shape_of: Callable, fp8: bool) -> dict[str, Any]:
    """Why no layout fits on ``gpus`` GPUs of ``cap`` bytes, with the arithmetic: every parameter's
    stored bytes (weights in their dtype, and in train the gradients and optimizer state) sharded over
    every GPU is the floor no layout beats; and the smallest change that fits the layout with the
    least static memory (``static``: (layout, bytes) pairs; :func:`~moonep_sim.step.memory_fit.smallest_fit`
    on a balanced stand-in), or None."""
    import math

    from moonep_sim.step.dtypes import WEIGHT_DTYPES, get_dtype
    from moonep_sim.step.layout_step import chunk_params
    from moonep_sim.step.memory_fit import smallest_fit

    dense, expert = chunk_params(model, 0, model.layers, True, True)
    params = dense + expert
    per = get_dtype(mem.weight_dtype, "weight dtype", WEIGHT_DTYPES).weight_bytes
    train = shape_of(static[0][0]).mode == "train" if static else False
    if train:
        per += mem.grad_bytes_per_param + mem.optimizer_bytes_per_param
    floor = params * per
    least, least_b = min(static, key=lambda x: x[1]) if static else (None, 0.0)
    fit = smallest_fit(model, shape_of(least), least, [], mem, cap, fp8=fp8) if least is not None else None
    line = (f"no layout fits in memory on {gpus} GPUs: {params / 1e12:.3g}T parameters x {per:g} B (weights"
            + (", gradients and optimizer state" if train else "") + f") = {floor / 2**40:.1f} TiB, "
            f"{floor / gpus / 2**30:.0f} GiB per GPU even fully sharded, over the {cap / 2**30:g} GiB a GPU has: "
            f"at least {math.ceil(floor / cap)} GPUs")
    if least is not None:
        line += (f"; the least-loaded layout ({least.label()} ZeRO{least.zero}, {least_b / 2**30:.0f} GiB before "
                 "activations) fits with " + (f"{fit['change']} ({fit['detail']})" if fit else
                                              "no single change or pair tried (recompute, ZeRO, more pipeline stages, "
                                              "fp8 weights or KV)"))
    return {"parameters": params, "bytes_per_param": per, "floor_bytes": floor, "min_gpus": math.ceil(floor / cap),
            "least_layout": least.to_dict() if least is not None else None, "least_static_bytes": least_b,
            "fit": fit, "line": line}


@dataclass(frozen=True)
class LayoutSpace:
    """The layouts a search enumerates on ``gpus`` GPUs (:func:`enumerate_layouts`: micro-batch size,
    global batch size (0: ``gpus x micro_batch_size`` sequences), the pipeline schedules and ZeRO
    stages asked for) and how many rows per strategy it ranks (``top``)."""

    gpus: int
    micro_batch_size: int = 1
    global_batch_size: int = 0
    schedules: tuple[str, ...] = ("1f1b",)
    zeros: tuple[int, ...] = (1, 2, 3)
    top: int = 5

    def __post_init__(self) -> None:
        require(self.gpus >= 1, f"gpus ({self.gpus}) must be >= 1")
        require(self.top >= 1, f"top ({self.top}) must be >= 1")


#: the step options a layout search prices with; the others (the search chooses the layout and
#: prices one layer per kind) must keep their defaults
SEARCH_STEP_OPTIONS = ("mode", "overlap", "tokens_per_rank", "context", "gemm_dtype", "weight_dtype", "kv_dtype",
                       "recompute", "optimizer_bytes_per_param")


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
    run = _Search(scenario, probe, model, topo, min(G, gpus), o, seq, space.micro_batch_size, costs, mem, progress)
    # what cannot fit even without activations is dropped before any simulation
    from moonep_sim.step.layout_step import static_memory_bytes

    cap = topo.gpu_memory_GiB * 2**30
    static = [(p, static_memory_bytes(model, p, run.replica_shape(p), mem)) for p in layouts]
    unfit = [p for p, b in static if cap and b > cap]
    layouts = [p for p, b in static if not (cap and b > cap)]
    units, skipped, rows = run.price(layouts)
    names = [n for n, _ in probe.strategies]
    ranked = {n: sorted((r for r in rows if r["strategy"] == n),
                        key=lambda r: (not r["fits"], -r["tokens_per_s_per_gpu"]))[:space.top] for n in names}
    fit = len({r["layout"] for r in rows if r["fits"]})
    fp8 = float(getattr(topo, "gpu_tflops_fp8", 0) or 0) > 0
    why = None if fit else no_fit_note(model, gpus, static, mem, cap, run.replica_shape, fp8)
    return {"no_fit": why, "kind": "layout-search", "model": model.name, "mode": mode, "gpus": gpus, "gpus_per_node": G,
            "topology": topo.name, "seq": seq if mode == "train" else None,
            "micro_batch_size": space.micro_batch_size,
            "valid": len(layouts) + len(unfit), "unfit_unpriced": len(unfit),
            "priced": len({r["layout"] for r in rows}), "fit": fit,
            "units_simulated": len(units), "units_skipped": skipped, "ranked": ranked, "rows": rows,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "flags": ["PRICED AS A MODEL: one layer of each kind simulated per (ep, tokens per rank), every MoE "
                      "layer on the same generated routing; run `moonep-sim step` with a chosen layout for its full "
                      "step"] + ([] if fit else [why["line"]])
            + ([f"{len(unfit)} valid layout(s) not priced: their weights, gradients and optimizer state alone "
                f"exceed the GPU's {topo.gpu_memory_GiB:g} GiB"] if unfit else [])
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
        cfg = StepConfig(model, self.topo, None, self.probe.strategies, shape, o.overlap, self.costs, self.mem, {})
        names = [n for n, _ in self.probe.strategies]
        figs = {n: schedule_layout(cfg, p, priced_stages(model, p, units, n, shape, self.costs), self.G)
                for n in names}
        fitting = [n for n in names if not figs[n]["oom"]]
        best = max(fitting or names, key=lambda n: figs[n]["tokens_per_s_per_gpu"])
        return [{"layout": p.label() + (f" {p.pp_schedule}" if p.pp > 1 else "") + f" ZeRO{p.zero}",
                 "parallel": p.to_dict(), "strategy": n, "tokens_per_s_per_gpu": f["tokens_per_s_per_gpu"],
                 "step_time_us": f["step_time_us"], "mfu": f["mfu"],
                 "bubble_fraction": f["pipeline"]["bubble_fraction"], "peak_memory_bytes": f["peak_memory_bytes"],
                 "fits": not f["oom"], "best_at_layout": best,
                 "verdict": (f"{best} fastest at this layout" if fitting else "no strategy fits at this layout")}
                for n in names for f in [figs[n]]]


__all__ = ["LayoutSpace", "SEARCH_STEP_OPTIONS", "enumerate_layouts", "no_fit_note", "price_units", "priced_stages", "search_layouts"]
