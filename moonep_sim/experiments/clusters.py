"""The same comparison on several clusters: does the winner change, and why?

    from moonep_sim.experiments import Scenario
    from moonep_sim.experiments.clusters import compare_clusters

    sc = Scenario(routing="gen:model=kimi-k3,maxvio=10,tokens-per-rank=8192", cluster=64,
                  strategies=["alltoall", "deepep", "moonep", "costaware"])
    doc = compare_clusters(sc, ["h800-cx7", "h200-efa", "mi300x-cx7", "gb200-nvl72"])

Each cluster runs the scenario's own :meth:`~moonep_sim.experiments.Scenario.compare` with only
the topology changed (and, below, the kernel family): the same routing on every cluster (the same
trace layers or the same generated layer and seed), the same EP size, the same strategies. Its
row is that compare's layer times and verdict, word for word (winner or tie, margin, mechanism,
confidence, the verdict's sentence), so ``moonep-sim compare --topology a,b`` equals one
``compare --topology a`` and one ``--topology b``.

Kernel families: ``deepep`` / ``deepep-ll`` run the family native to each cluster's transport
(:func:`native_kernels`, ``moonep_sim/data/native-kernels.toml``: preset -> impl, with its reason;
DeepEP V1 needs GPU-initiated RDMA, so on EFA UCCL-EP stands in, on AMD mori), unless the
scenario's options give ``impl`` (then that one everywhere, and a cluster it does not run on is
flagged).

Flags beside the table: each cluster's compare flags (``outside-library``, ``oracle``, ...) and two
of this comparison's own: ``assumed-kernel-terms`` (a strategy priced by a kernel family whose
terms are assumed, :data:`moonep_sim.plan.kernel.FAMILIES` sources) and ``kernel-not-native`` (a
family whose vendor or transports are not the cluster's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Callable, Sequence

from moonep_sim.analysis.winner import dedup_flags
from moonep_sim.errors import ConfigError, require
from moonep_sim.io import data_toml

Progress = Callable[[str, int, int], None]

#: The strategies whose kernels a family prices, and the option naming it (default when not given).
#: costaware has no ``impl``: its planner prices DeepEP V1's relayed kernels (strategies/costaware.py).
KERNEL_OPTION = {"deepep": ("impl", "deepep-v1"), "deepep-ll": ("impl", "deepep-v1-ll")}
FIXED_FAMILY = {"costaware": "deepep-v1"}
_NATIVE_KEY = {"deepep": "impl", "deepep-ll": "ll_impl"}
MAX_CLUSTERS = 16


@dataclass(frozen=True)
class Native:
    """A preset's native kernel families: ``impl`` for ``deepep``, ``ll_impl`` for ``deepep-ll``,
    the GPU ``vendor`` and scale-out ``transport`` they are held against, and the ``reason``."""

    preset: str
    vendor: str
    transport: str
    impl: str
    ll_impl: str
    reason: str


@lru_cache(maxsize=1)
def native_kernels() -> dict[str, Native]:
    """preset -> :class:`Native`, from ``moonep_sim/data/native-kernels.toml``."""
    return {e["preset"]: Native(**e) for e in data_toml("native-kernels.toml")["native"]}


def native_impl(preset: str, strategy: str = "deepep") -> tuple[str | None, str]:
    """(the family ``strategy`` runs natively on ``preset``, why); (None, why) where the table has none."""
    n = native_kernels().get(preset)
    if n is None or strategy not in _NATIVE_KEY:
        return None, f"{preset} is not in moonep_sim/data/native-kernels.toml: the strategy's default family"
    return getattr(n, _NATIVE_KEY[strategy]), n.reason


def parse_topologies(text: str | Sequence[str]) -> list[str]:
    """``"a,b,c"`` (or a list) -> the names, checked: none empty, none twice, at most :data:`MAX_CLUSTERS`."""
    names = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    require(names and all(names), f"--topology ({text!r}) must be a comma list of presets or TOML files, none empty")
    dup = sorted({n for n in names if names.count(n) > 1})
    require(not dup, f"--topology ({text!r}) names {', '.join(dup)} twice: each cluster once")
    require(len(names) <= MAX_CLUSTERS, f"--topology ({text!r}) lists {len(names)} clusters: at most {MAX_CLUSTERS}")
    return names


def check_topologies(topologies: Sequence[str] | str) -> list[tuple[str, str]]:
    """(entry, its preset name) per entry of the list; a bad entry is one line naming it and its place."""
    from moonep_sim.experiments.compare import load_topology

    from moonep_sim.sim.topology import PRESET_ALIASES

    names = parse_topologies(topologies)
    out = []
    seen: dict[Any, str] = {}
    for i, t in enumerate(names):
        try:
            out.append((t, load_topology(t).name))
        except ConfigError as e:
            raise ConfigError(f"--topology entry {i + 1} of {len(names)} ({t!r}): {e}") from None
        try:  # one cluster named twice: a preset and its alias, or one file by two paths or links
            st = os.stat(t)
            key: Any = (st.st_dev, st.st_ino)
        except OSError:
            key = PRESET_ALIASES.get(t, t)
        require(key not in seen, f"--topology entry {i + 1} of {len(names)} ({t!r}) must differ from {seen.get(key)!r}: "
                                 "they name one cluster (each cluster once)")
        seen[key] = t
    return out


def cluster_scenarios(sc, topologies: Sequence[str]) -> list[tuple[str, Any, dict[str, dict[str, str]]]]:
    """(topology, the scenario on it, strategy -> {impl, source, reason}) per cluster, every one
    checked before any work; a bad entry is one line naming it and its place in the list."""
    from moonep_sim.experiments.spec import strategy_list

    entries = check_topologies(topologies)
    given = dict(strategy_list(sc.strategies, sc.options))
    out = []
    for i, (t, preset) in enumerate(entries):
        opts = {n: dict(o) for n, o in given.items() if o}
        impls = {}
        for s, (key, default) in KERNEL_OPTION.items():
            if s not in given:
                continue
            if key in given[s]:
                impls[s] = {"impl": str(given[s][key]), "source": "given", "reason": f"--opt {s}.{key} given"}
                continue
            nat, why = native_impl(preset, s)
            impls[s] = {"impl": nat or default, "source": "native" if nat else "default", "reason": why}
            opts.setdefault(s, {})[key] = nat or default
        for s, fam in FIXED_FAMILY.items():
            if s in given:
                impls[s] = {"impl": fam, "source": "fixed", "reason": f"{s}'s planner prices {fam}'s kernels"}
        sct = replace(sc, topology=t, options=opts)
        try:
            sct.resolved  # noqa: B018 -- check everything now
        except ConfigError as e:
            raise ConfigError(f"--topology entry {i + 1} of {len(entries)} ({t!r}): {e}") from None
        out.append((t, sct, impls))
    return out


def kernel_flags(topology: str, preset: str, impls: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """``assumed-kernel-terms`` and ``kernel-not-native`` flags of one cluster's kernel families."""
    from moonep_sim.plan.kernel import FAMILIES

    nat = native_kernels().get(preset)
    out = []
    for s, d in impls.items():
        fam = FAMILIES.get(d["impl"])
        if fam is None:
            continue
        assumed = sorted(k for k, v in fam.sources.items() if str(v).lower().startswith("assumed"))
        if assumed:
            out.append({"code": "assumed-kernel-terms", "strategy": s, "topology": topology,
                        "text": f"{s} on {topology} is priced by {fam.name} ({fam.library}), whose "
                                f"{', '.join(assumed)} term(s) are assumed (moonep_sim.plan.kernel.FAMILIES)"})
        if nat is not None and (fam.vendor != nat.vendor or nat.transport not in (*fam.transports, "none")):
            out.append({"code": "kernel-not-native", "strategy": s, "topology": topology,
                        "text": f"{s} on {topology} is priced by {fam.name}, which runs on {fam.vendor} GPUs over "
                                f"{' / '.join(fam.transports)}; {topology} is {nat.vendor} over {nat.transport}: a "
                                "setting its library does not run"})
    return out


def _verdict(v: dict[str, Any] | None) -> dict[str, Any]:
    v = v or {}
    return {"winner": v.get("winner"), "runner_up": v.get("runner_up"), "margin": float(v.get("margin") or 0.0),
            "tie": bool(v.get("tie")), "tied_with": list(v.get("tied_with") or []),
            "mechanism": v.get("mechanism"), "confidence": (v.get("confidence") or {}).get("level"),
            "why": v.get("why", "")}


def cluster_row(topology: str, preset: str, sc, impls: dict[str, dict[str, str]], rep: dict[str, Any]) -> dict:
    """One cluster's row from its compare report ``rep``."""
    topo = sc.resolved.topology
    strat = {}
    for n, s in rep["strategies"].items():
        worst = max(s["layers"], key=lambda e: float(e["sim"]["layer_time_us"]))["sim"]
        st = worst.get("straggler") or {}
        strat[n] = {"layer_time_us": float(s["sim"]["layer_time_us_mean"]),
                    "straggler": st.get("detail", "") if isinstance(st, dict) else str(st),
                    "busiest_port": (worst.get("busiest_port") or {}).get("name", ""),
                    "ratio_to_lower_bound": float(s["sim"]["ratio_to_lower_bound"]),
                    "phases_us": s["sim"]["phases_us_mean"]}
    flags = [dict(f, topology=topology) for f in rep.get("flags") or [] if f.get("code") != "kernel-not-native"]
    flags += kernel_flags(topology, preset, impls)  # the cluster's own families (the report's are the defaults)
    return {"topology": topology, "preset": preset, "ranks": rep["cluster"]["ranks"],
            "gpus_per_node": rep["cluster"]["gpus_per_node"], "nodes": rep["cluster"]["nodes"],
            "nvlink_GBps": topo.nvlink_bytes_per_us / 1e3, "nic_GBps": topo.nic_bytes_per_us / 1e3,
            "tflops": float(topo.gpu_tflops), "kernels": impls,
            "layer_time_us": {n: d["layer_time_us"] for n, d in strat.items()},
            "verdict": _verdict(rep.get("verdict")), "strategies": strat, "flags": flags,
            "constants": rep["topology"]}


def call(v: dict[str, Any]) -> str:
    """A verdict's call: the winner, or ``tie of a and b`` (ties named, never a win)."""
    if v.get("tie"):
        return "tie of " + " and ".join([v["winner"], *(v.get("tied_with") or [v["runner_up"]])])
    return str(v["winner"])


def winner_change(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Across one point's clusters: call -> the clusters with it, and whether it changes."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(call(r["verdict"]), []).append(r["topology"])
    return {"winners": [{"call": c, "topologies": ts} for c, ts in by.items()], "changes": len(by) > 1}


def compare_clusters(scenarios, topologies: Sequence[str] | str, *, labels: Sequence[str] | None = None,
                     progress: Progress | None = None, jobs: int | None = 1, cluster: str | None = None) -> dict:
    """The comparison of each scenario (one, or several: one point each, e.g. one per maxvio) on
    every topology; every (point, cluster) checked before any work. The JSON-ready document:
    ``points`` (each: ``label``, ``routing``, ``clusters`` -- one row per cluster -- and
    ``winner_change``) and ``flags`` (every row's, with its ``topology``)."""
    one = not isinstance(scenarios, (list, tuple))
    scs = [scenarios] if one else list(scenarios)
    require(scs, "compare_clusters needs at least one scenario")
    require(labels is None or len(labels) == len(scs), f"labels ({len(labels or [])}) must be one per scenario ({len(scs)})")
    plan = [cluster_scenarios(s, topologies) for s in scs]
    total = sum(len(p) for p in plan)
    points, k = [], 0
    for i, (sc, cl) in enumerate(zip(scs, plan)):
        rows, routing = [], None
        for t, sct, impls in cl:
            def cb(msg, done, n, _t=t, _k=k):
                if progress:
                    progress(f"{_t}: {msg}", _k * 1000 + (1000 * done) // max(n, 1), total * 1000)
            rep = sct.compare(progress=cb if progress else None, jobs=jobs, cluster=cluster).to_dict()
            routing = routing or rep["routing"]
            rows.append(cluster_row(t, sct.resolved.topology.name, sct, impls, rep))
            k += 1
        points.append({"label": labels[i] if labels else routing["label"], "routing": routing,
                       "model": sc.resolved.source.model.name, "clusters": rows,
                       "winner_change": winner_change(rows)})
    if progress:
        progress("done", total * 1000, total * 1000)
    strategies = [n for n, _ in scs[0].resolved.strategies]
    return {"kind": "clusters", "topologies": [t for t, _, _ in plan[0]], "strategies": strategies,
            "ranks": scs[0].resolved.cluster.ranks, "points": points,
            "flags": dedup_flags([f for p in points for r in p["clusters"] for f in r["flags"]],
                                 key=("code", "strategy", "topology", "text")),
            "native_kernels": "moonep_sim/data/native-kernels.toml"}


__all__ = ["KERNEL_OPTION", "FIXED_FAMILY", "Native", "call", "check_topologies", "cluster_row", "cluster_scenarios", "compare_clusters",
           "kernel_flags", "native_impl", "native_kernels", "parse_topologies", "winner_change"]
