"""Calibrate the ``local-gloo`` topology: measure this machine, fit constants, write a TOML file.

What is measured: ``moonep_sim.experiments.ranks.calibrate_measure`` (gloo all-to-all per size and process
count, the expert SwiGLU, copies and row passes, planning and handle cost).

What is fitted (weighted least squares, each point weighted by 1/time, so small and large sizes
count alike):

- per P: ``t(m) = latency + (P-1) * m / bw_proc`` -> ``latency_us[P]`` and the per-process
  bandwidth ``bw_proc[P]`` (bytes each process sends per second);
- across P: latency as ``base + per_peer * (P-1)``; bandwidth as
  ``bw_proc(P) = min(port, aggregate / P)`` (every process has a port of ``port`` bytes/s, and
  all processes share a host-wide ``aggregate`` -- memory bandwidth, CPU cores);
- compute per P: ``t(flops) = launch + flops / flops_per_s``.

CPU rates (SwiGLU FLOP/s and its per-call intercept, copy and row-pass rates) are written per
core, from the largest P that does not exceed the cores, with ``[host] cores`` = the cores and
``nodes_per_host = 0`` (every process on this one machine, however the ranks are grouped in
nodes): the simulator shares the cores among the ranks busy at each moment itself (processor
sharing, ``moonep_sim.sim.cpu``). Nothing is fitted on
replayed traces.

The result is written atomically as the TOML file the simulator's ``local-gloo`` preset reads
(``moonep_sim.sim.topology.calibrated_topology_path()``, format in ``docs/topology.md``), with the
raw measurements and the full fit alongside (``local-gloo.measurements.json``). The simulator
shares a port max-min between transfers and has no host-wide limit, so the file carries the
per-process bandwidth fitted at the process count runs will use (``--target-nproc``, default the
largest measured); the fits at every P and the ``min(port, aggregate/P)`` model are in its
``[sources]``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.perf import host_cores
from moonep_sim.experiments.ranks.calibrate_measure import (DEFAULT_NPROCS, DEFAULT_SIZES_BYTES, DEFAULT_SWIGLU_SHAPES,
                                                      QUICK_SIZES_BYTES, QUICK_SWIGLU_SHAPES, measure,
                                                      measure_planning)
from moonep_sim.io import make_output_dir, write_text_atomic


# -- fitting -------------------------------------------------------------------------------------
def _wls_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Fit ``y = a + b*x`` minimising the squared *relative* error; returns (a, b), both >= 0."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    require(x.size >= 2 and np.unique(x).size >= 2, f"a line fit needs at least two distinct points ({x.size} given)")
    w = 1.0 / np.maximum(y, 1e-12)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if a < 0:  # latency cannot be negative: refit through the origin
        a, b = 0.0, float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
    if b <= 0:  # no measurable size dependence: constant time
        a, b = float(np.median(y)), 0.0
    return float(a), float(b)


@dataclass(frozen=True)
class CalibrationFit:
    """Fitted local-gloo constants (SI units inside the names).

    latency_us_P / proc_gbps_P / flops_per_s_P / launch_us_P: per process count P (keys are P).
    latency_base_us, latency_per_peer_us: latency(P) = base + per_peer * (P-1).
    port_gbps, aggregate_gbps: per-process bandwidth model ``min(port, aggregate / P)`` (GB/s = 1e9 B/s).
    compute_flops_per_s: per-process FLOP/s with the most processes measured (CPU shared);
    compute_flops_per_s_alone: with the fewest; launch_us: fixed cost of one expert GEMM chain.
    mem_gbps_P: per P, bytes of a large float32 copy per second per process (the copy's size over
    its time: each byte is read once and written once).  plan_us: CPU time to plan a small synthetic
    layer and build a handle (None if not measured).  cpu_cores: the cores this process may run on
    (``host_cores()``; a ``{"host": [{"cpu_cores": n}]}`` record overrides it).
    rowpass_gbps_P: per P, row bytes per second of one local pass over rows (4 MiB of float32 rows
    over the mean time of a random gather and a random scatter-add, each into a reused and into a
    fresh tensor), all P processes at once.
    handle_us: the handle's share of ``plan_us`` (plan + handle minus the planner alone).
    fresh_copy_gbps_P: per P, bytes per second of the 32 MiB copy into a freshly allocated tensor.
    """

    latency_us_P: dict[int, float]
    proc_gbps_P: dict[int, float]
    flops_per_s_P: dict[int, float]
    launch_us_P: dict[int, float]
    latency_base_us: float
    latency_per_peer_us: float
    port_gbps: float
    aggregate_gbps: float
    compute_flops_per_s: float
    compute_flops_per_s_alone: float
    launch_us: float
    mem_gbps_P: dict[int, float] = field(default_factory=dict)
    plan_us: float | None = None
    cpu_cores: int = field(default_factory=lambda: host_cores())
    rowpass_gbps_P: dict[int, float] = field(default_factory=dict)
    handle_us: float | None = None
    fresh_copy_gbps_P: dict[int, float] = field(default_factory=dict)

    def share(self, nproc: int) -> float:
        """How much P processes computing at once stretch each one's CPU work: max(1, P / cores)."""
        return max(1.0, nproc / max(self.cpu_cores, 1))

    def proc_gbps(self, nproc: int) -> float:
        return min(self.port_gbps, self.aggregate_gbps / nproc)

    def latency_us(self, nproc: int) -> float:
        return self.latency_base_us + self.latency_per_peer_us * (nproc - 1)

    def to_dict(self) -> dict[str, Any]:
        """The fit as JSON: the per-P fields (``*_P``) keyed by P as text."""
        return {k: {str(p): x for p, x in v.items()} if k.endswith("_P") else v for k, v in asdict(self).items()}


def fit(measurements: dict[str, list[dict[str, Any]]]) -> CalibrationFit:
    """Fit the local-gloo constants from measurement records (see :func:`measure`).

    ``measurements["alltoall"]``: records with ``nproc``, ``bytes_per_peer``, ``seconds`` (list of
    repeats); ``measurements["swiglu"]``: records with ``nproc``, ``flops``, ``seconds``.
    """
    a2a, comp = measurements.get("alltoall", []), measurements.get("swiglu", [])
    require(len(a2a) > 0, "calibration needs all-to-all measurements (none given)")
    require(len(comp) > 0, "calibration needs SwiGLU measurements (none given)")
    lat_P: dict[int, float] = {}
    bw_P: dict[int, float] = {}
    for P in sorted({int(r["nproc"]) for r in a2a}):
        rec = [r for r in a2a if int(r["nproc"]) == P]
        m = np.array([r["bytes_per_peer"] for r in rec], float)
        t = np.array([statistics.median(r["seconds"]) for r in rec], float)
        a, b = _wls_line(m * (P - 1), t)  # t = latency + bytes_sent_per_process / bw
        lat_P[P] = a * 1e6
        bw_P[P] = (1.0 / b) / 1e9 if b > 0 else math.inf
    Ps = sorted(lat_P)
    if len(Ps) >= 2:
        x = np.array(Ps, float) - 1
        per_peer, base = np.polyfit(x, np.array([lat_P[p] for p in Ps]), 1)
        if per_peer < 0:
            per_peer, base = 0.0, float(np.median([lat_P[p] for p in Ps]))
        if base < 0:
            base, per_peer = 0.0, float(np.sum(x * [lat_P[p] for p in Ps]) / np.sum(x * x))
    else:
        base, per_peer = lat_P[Ps[0]] * 0.5, lat_P[Ps[0]] * 0.5 / max(Ps[0] - 1, 1)
    finite = {p: v for p, v in bw_P.items() if math.isfinite(v)}
    require(len(finite) > 0, "calibration measured no size dependence in the all-to-all: use larger --sizes")
    port = max(finite.values())  # fewest processes: each one gets its own port bandwidth
    aggregate = min(p * v for p, v in finite.items())  # most processes: the shared host limit binds
    aggregate = max(aggregate, port)  # one process alone never exceeds its port

    fl_P: dict[int, float] = {}
    launch_P: dict[int, float] = {}
    for P in sorted({int(r["nproc"]) for r in comp}):
        rec = [r for r in comp if int(r["nproc"]) == P]
        f = np.array([r["flops"] for r in rec], float)
        t = np.array([statistics.median(r["seconds"]) for r in rec], float)
        if np.unique(f).size >= 2:
            a, b = _wls_line(f, t)
        else:
            a, b = 0.0, float(t.mean() / f.mean())
        fl_P[P] = 1.0 / b if b > 0 else float(f.max() / t.max())
        launch_P[P] = a * 1e6
    cP = sorted(fl_P)
    mem_P = {int(r["nproc"]): float(r["bytes"]) / statistics.median(r["seconds"]) / 1e9
             for r in measurements.get("memcopy", []) if not r.get("fresh")}
    fresh_P = {int(r["nproc"]): float(r["bytes"]) / statistics.median(r["seconds"]) / 1e9
               for r in measurements.get("memcopy", []) if r.get("fresh")}
    plan_us = [statistics.median(r["seconds"]) * 1e6 for r in measurements.get("planning", [])]
    handle_us = [max(0.0, statistics.median(r["seconds"]) - statistics.median(r["plan_seconds"])) * 1e6
                 for r in measurements.get("planning", []) if r.get("plan_seconds")]
    rp: dict[int, list[tuple[float, float]]] = {}
    for r in measurements.get("rowpass", []):
        rp.setdefault(int(r["nproc"]), []).append((float(r["bytes"]), statistics.median(r["seconds"])))
    # bytes over the mean time of the variants: a pass of the executor's mix of ops
    rowpass_P = {p: float(np.mean([b for b, _ in v]) / np.mean([t for _, t in v]) / 1e9) for p, v in rp.items()}
    extra: dict[str, Any] = {}
    host = measurements.get("host") or []
    if host and host[0].get("cpu_cores"):
        extra["cpu_cores"] = int(host[0]["cpu_cores"])
    return CalibrationFit(lat_P, bw_P, fl_P, launch_P, float(base), float(per_peer), float(port), float(aggregate),
                          fl_P[cP[-1]], fl_P[cP[0]], float(np.median(list(launch_P.values()))), mem_P,
                          plan_us=float(plan_us[0]) if plan_us else None, rowpass_gbps_P=rowpass_P,
                          handle_us=float(handle_us[0]) if handle_us else None, fresh_copy_gbps_P=fresh_P, **extra)


# -- the topology file ---------------------------------------------------------------------------
class _CpuRates(NamedTuple):
    """The CPU rates a calibration sets, each with the process count it was taken from: SwiGLU
    FLOP/s ``flops`` (at ``cnear``, de-shared by ``share``), copy traffic ``mem`` GB/s (at
    ``mnear``), the row passes ``copy_gbps`` (at ``rnear``; None: the preset's) and a copy into a
    fresh tensor ``wcopy`` (at ``fnear``; None: the preset's)."""

    cnear: int
    share: float
    flops: float
    mnear: int
    mem: float
    rnear: int | None
    copy_gbps: float
    fnear: int | None
    wcopy: float


def _cpu_rates(f: CalibrationFit, base) -> _CpuRates:
    """The calibration's CPU rates (see :class:`_CpuRates`); ``base``: the shipped preset, for what was not measured."""
    # CPU work is modelled per core: the simulator shares the cores among the busy ranks itself
    # (``[host] cores``). Rates are taken from the largest process count that does not
    # oversubscribe the cores (more processes than cores add time-slicing stalls to short timed
    # operations that the sharing factor already accounts for), de-shared if every count did.
    def cpu_p(measured) -> int:
        ok = [p for p in measured if p <= f.cpu_cores]
        return max(ok) if ok else min(measured)

    cnear = cpu_p(f.flops_per_s_P)
    s_c = f.share(cnear)
    flops = f.flops_per_s_P[cnear] * s_c
    # memory bandwidth counts traffic (each byte of a copy is read and written: 2 x the copy's size
    # per second); the simulator counts expert activations and weights in bf16 bytes while the CPU
    # replay moves float32, twice as many: the bf16-equivalent traffic rate is the copy-size rate
    def rate(measured: dict[int, float], preset: float) -> tuple[int | None, float]:
        """(the process count a measured rate is taken at, the rate de-shared); (None, ``preset``) unmeasured."""
        p = cpu_p(measured) if measured else None
        return p, (measured[p] * f.share(p) if measured else preset)

    mnear, mem = rate(f.mem_gbps_P, base.gpu_mem_bandwidth_GBps)
    rnear, copy_gbps = rate(f.rowpass_gbps_P, base.host_copy_bandwidth_GBps)
    fnear, wcopy = rate(f.fresh_copy_gbps_P, base.host_weight_copy_bandwidth_GBps)
    return _CpuRates(cnear, s_c, flops, mnear if mnear is not None else cnear, mem, rnear, copy_gbps, fnear, wcopy)


def _calibration_sources(f: CalibrationFit, nproc: int, near: int, r: _CpuRates) -> dict[str, str]:
    """Where every constant of the calibrated topology comes from (its ``[sources]``)."""
    cnear, s_c, mnear, rnear, fnear = r.cnear, r.share, r.mnear, r.rnear, r.fnear
    measured_plan = f.handle_us is not None
    how = "fit t = latency + (P-1) * m / bandwidth over message sizes m (median of repeats, slowest rank)"
    desh = (f"per core: P={cnear} <= {f.cpu_cores} cores" if s_c == 1 else
            f"de-shared: x max(1, P / {f.cpu_cores} cores) = {s_c:g}") + " (the simulator applies the sharing)"
    sources = {
        "nvlink_bandwidth_GBps": f"moonep-sim calibrate: gloo all_to_all_single, per process at P={near}; {how}",
        "nvlink_latency_us": (f"moonep-sim calibrate: the same fit's latency at P={nproc}"
                              + ("" if near == nproc else " (from latency(P) = base + per_peer x (P-1))")
                              + ": every hop of a job of that many processes pays it, whatever its peers "
                                "(the processes time-slice the cores)"),
        "host_message_us": "0: the per-collective cost is all in the link latency (latency(P) at the job's P)",
        "nic": "unused: every process is in one node (copied from the NVLink figures)",
        "duplex": "half: a gloo TCP pair has one thread that alternately writes and reads, so both directions "
                  "of one pair share its rate (testbed probe: a 2-rank exchange gets ~0.5 of the link each way)",
        "gpu_tflops": f"moonep-sim calibrate: float32 SwiGLU, {cnear} processes computing at once, fit t = launch + "
                      f"flops / rate; {desh}",
        "gpu_slot_us": f"moonep-sim calibrate: the same fit's intercept (one SwiGLU call: the replay runs one "
                       f"matmul chain per expert slot), divided by {s_c:g}",
        "gpu_launch_us": "0: the fixed cost is per slot (gpu_slot_us)",
        "gpu_padding_compute": "0: the gloo replay skips padding rows (they stay zero)",
        "gpu_mem_bandwidth_GBps": (f"moonep-sim calibrate: 32 MiB float32 copy, {mnear} processes at once, "
                                   f"read + write traffic (2 x size / time), halved (the simulator counts bf16 "
                                   f"bytes, the CPU replay moves float32); {desh}"
                                   if f.mem_gbps_P else "shipped preset value (not measured)"),
        "host_sharing": "static: every rank's CPU work stretched by max(1, ranks / cores); exact processor sharing "
                        "of the compute alone ('processor') leaves out the CPU the loopback transfers need and "
                        "under-predicts (docs/topology.md)",
        "host_cores": f"moonep-sim calibrate: CPU cores this process may run on ({f.cpu_cores}); nodes_per_host = 0: "
                      "every rank runs on this machine, whatever gpus_per_node groups them into",
        "host_copy_bandwidth_GBps": (f"moonep-sim calibrate: torch index_select (random gather) and index_add_ "
                                     f"(random scatter-add), into a reused and a fresh tensor, of 2048 float32 rows "
                                     f"of 512, {rnear} processes at once: bytes over the mean time, "
                                     f"x max(1, P / cores)" if rnear is not None
                                     else "shipped preset value (not measured)"),
        "host_weight_copy_bandwidth_GBps": (f"moonep-sim calibrate: 32 MiB float32 copy into a fresh tensor "
                                            f"(clone), {fnear} processes at once, x max(1, P / cores)"
                                            if fnear is not None else "not measured: the row-pass rate is used"),
        "plan_fixed_us": ("moonep-sim calibrate: CPU time to build one rank's handle for a synthetic 512-token "
                          "E=64 K=8 layer (alltoall), one process: per core" if measured_plan else
                          "moonep-sim calibrate: CPU time to plan a synthetic 512-token E=64 K=8 layer (alltoall) "
                          "and build a handle" if f.plan_us is not None else "shipped preset value (not measured)"),
        "plan_measured_factor": ("1: each Plan's own measured planner time (Plan.plan_seconds) is charged, "
                                 "run on the shared cores" if measured_plan else "off (not measured)"),
        "plan_routing_bytes_per_entry": "16: the gloo executor all-gathers every token's routing as int64 "
                                        "(expert id + weight bits) per (token, k) entry",
        "per_nproc": "; ".join(f"P={p}: latency {f.latency_us_P[p]:.1f} us, {f.proc_gbps_P[p]:.4f} GB/s"
                               for p in sorted(f.proc_gbps_P)) + "; " + "; ".join(
            f"P={p}: {f.flops_per_s_P[p] / 1e9:.2f} GFLOP/s" for p in sorted(f.flops_per_s_P)) + "".join(
            f"; P={p}: row pass {v:.3f} GB/s" for p, v in sorted(f.rowpass_gbps_P.items())),
        "bandwidth_model": f"per process min(port {f.port_gbps:.4f}, aggregate {f.aggregate_gbps:.4f} / P) GB/s",
    }
    return sources


def local_gloo_topology(fit_: CalibrationFit, nproc: int, nprocs_measured: Sequence[int]):
    """The calibrated ``local-gloo`` :class:`~moonep_sim.sim.topology.Topology` for runs of ``nproc``
    processes.

    All processes form one "node" whose "NVLink" port per process is the gloo loopback path:
    bandwidth = the fitted per-process bandwidth at ``nproc`` (so CPU and memory sharing between
    that many processes is inside the figure; the simulator shares each port max-min between the
    transfers using it), latency = the fitted all-to-all latency at ``nproc``. "GPU" compute is
    the measured per-process SwiGLU FLOP/s with ``nproc`` processes computing at once; memory
    bandwidth the measured per-process copy rate. Constants not measured keep the shipped
    preset's values (listed in ``sources``).
    """
    from moonep_sim.io import data_toml
    from moonep_sim.sim.topology import topology_from_dict

    base = topology_from_dict(data_toml("topology-local-gloo.toml"), "preset local-gloo")
    f = fit_
    near = min(f.proc_gbps_P, key=lambda p: abs(p - nproc))
    bw = f.proc_gbps_P[near] if near == nproc else f.proc_gbps(nproc)
    lat = f.latency_us_P[near] if near == nproc else f.latency_us(nproc)
    r = _cpu_rates(f, base)
    measured_plan = f.handle_us is not None
    # A collective's fixed cost is set by how many processes share this machine's cores (every rank
    # of the job is active at once), not by how many peers one hop has: latency(P) grows with P
    # because P > cores processes time-slice. So every hop of a P-process job gets latency(P) on its
    # links, and no per-message term (the fit across P stays in [sources]).
    lat0 = float(lat)
    host = f"{f.cpu_cores} CPU cores, measured with {list(nprocs_measured)} processes"
    sources = _calibration_sources(f, nproc, near, r)
    # the handle's cost measured by one process alone: per core (the simulator shares the cores)
    plan_fixed = float(f.handle_us if measured_plan else f.plan_us if f.plan_us is not None else base.plan_fixed_us)
    return replace(
        base,
        description=(f"this machine's CPU processes over loopback gloo, calibrated by moonep-sim calibrate "
                     f"for {nproc} processes ({host}) at {time.strftime('%Y-%m-%d %H:%M')}"),
        nvlink_bandwidth_GBps=round(bw, 6), nvlink_latency_us=round(lat0, 3), nvlink_efficiency=1.0,
        nic_bandwidth_GBps=round(bw, 6), nic_latency_us=round(lat0, 3), nic_efficiency=1.0,
        host_message_us=0.0, host_weight_copy_bandwidth_GBps=round(r.wcopy, 4),
        nvlink_duplex="half", nic_duplex="half",
        gpu_tflops=round(r.flops / 1e12, 6), gpu_compute_efficiency=1.0,
        gpu_mem_bandwidth_GBps=round(r.mem, 4), gpu_mem_efficiency=1.0,
        gpu_launch_us=0.0, gpu_slot_us=round(f.launch_us_P[r.cnear] / r.share, 3), gpu_padding_compute=0.0,
        host_cores=float(f.cpu_cores), host_nodes_per_host=0, host_copy_bandwidth_GBps=round(r.copy_gbps, 4),
        plan_fixed_us=round(plan_fixed, 3), plan_measured_factor=1.0 if measured_plan else 0.0,
        plan_routing_bytes_per_entry=16.0,
        sources=sources, path="")


def calibrated_path() -> Path:
    """Where the ``local-gloo`` preset reads its calibration from."""
    from moonep_sim.sim.topology import calibrated_topology_path

    return Path(calibrated_topology_path())


def calibration_kind(path: Path | None = None) -> str | None:
    """``full`` or ``quick`` for the calibration file at ``path`` (default: :func:`calibrated_path`),
    from the measurements written beside it (files from before the ``kind`` field: ``quick`` when
    they hold only the quick message sizes); None when there is no calibration file."""
    path = Path(path) if path else calibrated_path()
    if not path.is_file():
        return None
    try:
        d = json.loads(path.with_suffix(".measurements.json").read_text())
    except (OSError, ValueError):
        return "full"
    if "kind" in d:
        return str(d["kind"])
    sizes = {r.get("bytes_per_peer") for r in d.get("measurements", {}).get("alltoall", [])}
    return "quick" if sizes and sizes <= set(QUICK_SIZES_BYTES) else "full"


@dataclass
class CalibrationResult:
    fit: CalibrationFit
    measurements: dict[str, list[dict[str, Any]]]
    path: Path | None
    seconds: float
    topology: Any = None


def calibrate(nprocs: Sequence[int] = DEFAULT_NPROCS, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
              swiglu_shapes: Sequence[tuple[int, int, int]] = DEFAULT_SWIGLU_SHAPES, repeats: int = 9,
              out: str | os.PathLike | None = None, write: bool = True,
              progress: Callable[[str], None] | None = None, target_nproc: int | None = None,
              inner_flops: float = 2e9, kind: str = "full") -> CalibrationResult:
    """Measure, fit and (if ``write``) write the local-gloo topology file to ``out`` (default:
    :func:`calibrated_path`), with constants for runs of ``target_nproc`` processes (default: the
    largest measured); the raw measurements go beside it (``.measurements.json``), with ``kind``
    (``full``, or ``quick`` for the demo's short run: :func:`calibration_kind` reads it back)."""
    nprocs = sorted(set(int(p) for p in nprocs))
    for p in nprocs:
        require(2 <= p <= 64, f"nproc ({p}) must lie in [2, 64]")
    require(len(sizes_bytes) >= 2, f"sizes ({list(sizes_bytes)}) must hold at least two message sizes")
    for s in sizes_bytes:
        require(4 <= s <= 1 << 30, f"message size ({s} bytes) must lie in [4 B, 1 GiB]")
    require(repeats >= 1, f"repeats ({repeats}) must be >= 1")
    t0 = time.perf_counter()
    merged: dict[str, list[dict[str, Any]]] = {"alltoall": [], "swiglu": [], "memcopy": [], "rowpass": [],
                                                "host": [{"cpu_cores": host_cores()}]}
    for p in nprocs:
        if progress:
            progress(f"measuring with {p} processes ...")
        m = measure(p, sizes_bytes, swiglu_shapes, repeats=repeats, inner_flops=inner_flops)
        merged["alltoall"] += m["alltoall"]
        merged["swiglu"] += m["swiglu"]
        merged["memcopy"] += m.get("memcopy", [])
        merged["rowpass"] += m.get("rowpass", [])
    merged["planning"] = [measure_planning()]
    f = fit(merged)
    target = int(target_nproc or max(nprocs))
    topo = local_gloo_topology(f, target, nprocs)
    path = None
    if write:
        path = Path(out) if out else calibrated_path()
        make_output_dir(path.parent, "calibration folder")  # ~/.cache/moonep-sim on a fresh machine
        write_text_atomic(path, topo.to_toml())
        write_text_atomic(path.with_suffix(".measurements.json"),
                          json.dumps({"fit": f.to_dict(), "measurements": merged, "target_nproc": target, "kind": kind},
                                     indent=1))
    return CalibrationResult(f, merged, path, time.perf_counter() - t0, topo)
