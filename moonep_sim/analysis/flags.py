"""Assumptions a result rests on, listed beside it: ``flags``.

Each flag is ``{code, strategy, text}`` (``strategy`` None when it concerns the whole result); the
tables print them under the table, the JSON report holds them under ``flags``, plots mark the
strategies they concern, and ``report.html`` lists them. Codes (:data:`FLAG_CODES`):

- ``oracle``: a planner planned on the layer's own counts (eplb without ``history``).
- ``free-migration``: a placement change charged nothing (eplb without ``previous``).
- ``dropped-rows`` / ``padded-rows``: the strategy dropped entries / computed padded rows.
- ``shape-not-given``: the trace names no model and none was given: rows and weights are costed
  with an invented shape (``custom``: hidden 1024, expert FFN 512).
- ``outside-library``: the cluster is outside what the strategy's real library supports
  (:data:`REAL_LIBRARY`; MoonEP runs inside one NVLink domain).
- ``quick-calibration`` / ``uncalibrated``: the local-gloo constants behind a real comparison's
  simulated column come from a quick calibration / the shipped defaults.
- ``stand-in-layer``: some layers were costed with another layer's routing (a step model's stand-in).
- ``one-seed``: generated routing at one seed: no spread over seeds behind a verdict.
- ``assumed-kernel-terms`` / ``kernel-not-native`` (the multi-cluster compare,
  :mod:`moonep_sim.experiments.clusters`): a strategy priced by a kernel family whose terms are
  assumed / whose GPU vendor or transports are not the cluster's. ``kernel-not-native`` is also
  raised on a single cluster's step and compare (:func:`native_flags`): e.g. DeepEP V1, which needs
  GPU-initiated RDMA, on an EFA preset.
- ``host-proxy``: a strategy priced by a CPU-proxy kernel family (UCCL-EP, DeepEP over NVSHMEM's
  libfabric proxy): the flag names its proxy time per RDMA message and per launch, the mechanism
  that makes it slower than GPU-initiated RDMA (:func:`native_flags`).
"""

from __future__ import annotations

from typing import Any, Mapping

FLAG_CODES = ("oracle", "free-migration", "dropped-rows", "padded-rows", "shape-not-given", "outside-library",
              "quick-calibration", "uncalibrated", "stand-in-layer", "one-seed", "assumed-kernel-terms",
              "kernel-not-native", "host-proxy")

#: where each strategy's real library runs: (library, where it runs, most nodes (NVLink domains) it
#: supports; None: no limit). ``moonep-sim strategies`` prints the first two.
REAL_LIBRARY: dict[str, tuple[str, str, int | None]] = {
    "alltoall": ("Megatron-Core alltoall dispatcher", "any cluster (NCCL all-to-all over NVLink and RDMA)", None),
    "allgather": ("Megatron-Core allgather dispatcher", "any cluster (NCCL all-gather / reduce-scatter)", None),
    "capacity": ("GShard / Switch / DeepSpeed / Megatron drop-and-pad", "any cluster", None),
    "hierarchical": ("Tutel 2DH all-to-all", "any cluster (intra-node, then inter-node)", None),
    "deepep": ("DeepEP normal kernels", "NVLink inside a node + RDMA across nodes", None),
    "deepep-ll": ("DeepEP low-latency kernels", "RDMA, NVLink for same-node peers", None),
    "fused-moe": ("DeepGEMM Mega MoE / Primus-Turbo MegaMoE", "one NVLink domain (symmetric memory; published at EP8)",
                  1),
    "eplb": ("DeepSeek EPLB (placement; dispatch by the serving system)", "any cluster", None),
    "llep": ("LeastLoadedEP (SalesforceAIResearch)", "any cluster (point-to-point weight copies)", None),
    "ultraep": ("UltraEP (paper; no public library)", "replicas inside one NVLink domain, dispatch across nodes",
                None),
    "moonep": ("MoonEP", "one NVLink domain only (CUDA VMM + NVSwitch multicast)", 1),
    "costaware": ("none (this project's planner)", "simulated only", None),
}


def library_of(name: str) -> tuple[str, str, int | None]:
    """(library, where it runs, max NVLink domains) of a strategy; unknown strategies: not stated."""
    return REAL_LIBRARY.get(name, REAL_LIBRARY.get(name.replace("_", "-"), ("not stated", "not stated", None)))


def _flag(code: str, strategy: str | None, text: str) -> dict[str, Any]:
    return {"code": code, "strategy": strategy, "text": text}


def strategy_flags(name: str, options: Mapping[str, Any], nodes: int, dropped: int = 0, padded: int = 0,
                   unit: str = "the run") -> list[dict[str, Any]]:
    """Flags of one strategy: its options (eplb's oracle and free migration), its drops and
    padding, and the cluster against its real library."""
    out = []
    if name == "eplb":
        if options.get("history") in (None, "", "None"):
            out.append(_flag("oracle", name, "eplb planned on the layer's own counts (an oracle: a real EPLB plans "
                                              "on past load; pass --opt eplb.history=PAST.npy)"))
        if options.get("previous") in (None, "", "None"):
            out.append(_flag("free-migration", name, "eplb's placement change was charged no weight migration "
                                                      "(pass --opt eplb.previous=SLOTS.npy to charge it)"))
    if dropped:
        out.append(_flag("dropped-rows", name, f"{name} dropped {dropped:,} entries over {unit} (less work: it never "
                                               "wins a comparison)"))
    if padded:
        out.append(_flag("padded-rows", name, f"{name} computed {padded:,} padded rows over {unit}"))
    lib, where, most = library_of(name)
    if most is not None and nodes > most:
        out.append(_flag("outside-library", name, f"{name} on {nodes} nodes: its real library ({lib}) runs in {where}; "
                                                  "this figure is a simulation of what it does not support"))
    return out


def model_flags(model: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``shape-not-given`` when the model is the invented ``custom`` shape."""
    if model.get("name") == "custom":
        return [_flag("shape-not-given", None, f"no model shape given: rows and weights costed with an invented shape "
                                               f"(hidden {model.get('hidden', 1024)}, expert FFN "
                                               f"{model.get('expert_ffn', 512)}); pass --model")]
    return []


def calibration_flags(kind: str | None) -> list[dict[str, Any]]:
    """Flags of the local-gloo constants: ``quick`` or None / ``none`` (shipped defaults)."""
    if kind == "quick":
        return [_flag("quick-calibration", None, "the local-gloo column uses a quick calibration of this machine "
                                                 "(`moonep-sim calibrate` measures it fully)")]
    if kind in (None, "none"):
        return [_flag("uncalibrated", None, "the local-gloo column uses the shipped defaults, not a calibration of "
                                            "this machine (`moonep-sim calibrate`)")]
    return []


def compare_flags(rep: Mapping[str, Any], calibration: str | None = None) -> list[dict[str, Any]]:
    """Every flag of a compare report. ``calibration``: the local-gloo calibration kind behind a real
    replay's simulated column (``experiments.calibrate.calibration_kind``; None: uncalibrated)."""
    out = model_flags(rep.get("model") or {})
    nodes = int((rep.get("cluster") or {}).get("nodes") or 1)
    L = len((rep.get("routing") or {}).get("layers") or []) or 1
    for n, s in (rep.get("strategies") or {}).items():
        S = len((s.get("per_step") or {}).get("layer_time_us") or [])
        unit = f"{L} layer(s)" + (f" x {S} steps" if S > 1 else "")
        out += strategy_flags(n, s.get("options") or {}, nodes, int(s.get("dropped", 0)), int(s.get("padded", 0)),
                              unit=unit)
    out += native_flags({n: s.get("options") or {} for n, s in (rep.get("strategies") or {}).items()},
                        (rep.get("topology") or {}).get("name"))
    if rep.get("real"):
        out += calibration_flags(calibration)
    stand = rep.get("stand_in_layers") or []
    if stand:
        out.append(_flag("stand-in-layer", None, f"layers {', '.join(map(str, stand))} were costed with a stand-in "
                                                 "layer's routing"))
    return out


def step_flags(setup: Mapping[str, Any], options: Mapping[str, Mapping[str, Any]],
               model: Mapping[str, Any] | None = None,
               figures: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every flag of one step: stand-in and reused layers, each strategy's options against its
    real library and the entries it dropped over the step's MoE layers (``figures[name]["dropped"]``),
    the model shape."""
    out = model_flags(model or {})
    nodes = max(int(setup.get("ranks", 1)) // max(int(setup.get("gpus_per_node", 1)), 1), 1)
    for n, o in options.items():
        dropped = int((figures or {}).get(n, {}).get("dropped", 0) or 0)
        out += strategy_flags(n, o, nodes, dropped, unit="the step")
    out += native_flags(options, setup.get("topology"))
    stand = [i for i, p in enumerate(setup.get("layers_routing") or []) if str(p).startswith("STAND-IN")]
    if stand:
        out.append(_flag("stand-in-layer", None, f"{len(stand)} MoE layer(s) the trace does not have were costed "
                                                 f"with generated stand-in routing (MoE layers {_ranges(stand)})"))
    if setup.get("reused_layers"):
        out.append(_flag("stand-in-layer", None, f"{setup['reused_layers']} MoE layer(s) reuse another layer's "
                                                 f"routing (distinct layers {setup.get('distinct_layers')})"))
    return out


def native_flags(options: Mapping[str, Mapping[str, Any]], topology: str | None) -> list[dict[str, Any]]:
    """``kernel-not-native`` flags of the strategies that take a kernel family (``impl``) on the
    preset ``topology``: the family's GPU vendor or transports are not the preset's
    (``moonep_sim/data/native-kernels.toml``, the table ``moonep_sim.experiments.clusters`` reads);
    and ``host-proxy`` flags naming a CPU-proxy family's cost per RDMA message (the mechanism that
    slows it); [] for a preset the table does not list."""
    from moonep_sim.errors import ConfigError
    from moonep_sim.io import data_toml
    from moonep_sim.plan.kernel import FAMILIES
    from moonep_sim.strategies import get_strategy

    nat = {e["preset"]: e for e in data_toml("native-kernels.toml")["native"]}.get(topology or "")
    if nat is None:
        return []
    out = []
    for n, o in options.items():
        try:
            opt = get_strategy(n).options.get("impl")
        except ConfigError:  # a strategy this build does not know has no kernel family
            opt = None
        fam = FAMILIES.get(str((o or {}).get("impl") or opt.default)) if opt is not None else None
        if fam is not None and (fam.vendor != nat["vendor"] or nat["transport"] not in (*fam.transports, "none")):
            out.append(_flag("kernel-not-native", n, f"{n} on {topology} is priced by {fam.name}, which runs on "
                                                     f"{fam.vendor} GPUs over {' / '.join(fam.transports)}; "
                                                     f"{topology} is {nat['vendor']} over {nat['transport']}: a "
                                                     "setting its library does not run"))
        if fam is not None and fam.message_us > 0 and fam.extra_fixed_us > 0:
            out.append(_flag("host-proxy", n, f"{n} is priced by {fam.name}, whose RDMA writes a CPU proxy posts: "
                                              f"{fam.message_us:.2f} us of proxy time per relayed message (one "
                                              f"channel's chunk to one node) and +{fam.extra_fixed_us:g} us per launch, "
                                              "serial at each GPU's proxy -- the proxied operations per chunk "
                                              "(put, tail / head atomics; on EFA each atomic applied by the target's "
                                              "proxy) over its proxy threads, x 0.45 us per operation (ASSUMED): it "
                                              "grows with the chunks per token (more nodes per token, smaller RDMA "
                                              "chunks at larger EP)"
                                              + (f"; its {fam.proxy_nic_threads} proxy threads each post on one NIC, "
                                                 "so its channels' bytes land unevenly on the GPU's NICs and the "
                                                 "busiest binds" if fam.proxy_nic_threads else "")
                                              + (f"; in a training step its host pays {fam.proxy_call_us:g} us per "
                                                 f"dispatch or combine call plus the call's inter-node bytes at "
                                                 f"{fam.proxy_GBps:g} GB/s (host-proxy per-call cost and throughput, "
                                                 "FITTED on development row 2)" if fam.proxy_call_us or fam.proxy_GBps
                                                 else "")
                                              + (f". {fam.caveat}" if fam.caveat else "")))
    return out


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ", ".join(out)


def sweep_flags(rep: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every flag of a sweep report (drops and padding summed over its points)."""
    out = model_flags(rep.get("model") or {})
    pts = rep.get("points") or []
    g = int((rep.get("cluster") or {}).get("gpus_per_node") or 1)
    nodes = max([int(p.get("ranks", 1)) // max(int(p.get("gpus_per_node", g)), 1) for p in pts] or [1])
    for n, s in (rep.get("strategies") or {}).items():
        padded = sum(int(f.get("padded", 0)) for f in s.get("figures") or [] if f)
        out += strategy_flags(n, s.get("options") or {}, nodes, int(sum(s.get("dropped") or [])), padded,
                              unit=f"{len(pts)} point(s)")
    if rep.get("seed") is not None and not rep.get("seeds"):
        out.append(_flag("one-seed", None, f"generated routing at one seed ({rep['seed']}): no spread over seeds "
                                           "behind the verdicts"))
    return out


__all__ = ["FLAG_CODES", "REAL_LIBRARY", "step_flags", "calibration_flags", "compare_flags", "library_of",
           "model_flags", "native_flags", "strategy_flags", "sweep_flags"]
