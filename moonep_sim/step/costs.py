"""Compute costs per op: a roofline with sourced peaks and an assumed GEMM efficiency curve, or a
measured profile that replaces them.

Notation: R ranks, S expert slots (a Plan's), m rows of one GEMM (tokens, or rows of one expert).
Times in microseconds.

Default model (every constant named; ``docs/steps.md`` lists the sources):

- ``gemm`` ops and the routed experts' grouped GEMM: ``max(FLOPs / (peak x compute_efficiency x
  eff(m)), bytes / (HBM x mem_efficiency))``. ``peak`` is the topology's dense BF16 peak
  (``gpu_tflops``) or its FP8 peak (``gpu_tflops_fp8``) with ``gemm_dtype = "fp8"``;
  ``eff(m) = m / (m + GEMM_HALF_ROWS)`` is an ASSUMED saturating curve (half the rate at 64 rows,
  the shape of a 128-row M tile's quantisation in DeepGEMM / CUTLASS grouped GEMMs, which pad each
  expert's rows to the tile): small groups run far below peak, large ones near the topology's
  ``gpu_compute_efficiency``. With ``GEMM_HALF_ROWS`` 0 the routed experts cost exactly what the
  layer simulator charges (``moonep_sim.sim.compute.rank_compute_us``).
- ``attention`` ops: roofline of FLOPs and bytes (K/V read, which makes decode memory-bound).
- ``bytes`` ops (norms, residuals, embedding gather, loss): bytes over HBM.

A **profile** (``--compute-profile FILE``) is a CSV of ``op,shape,time_us`` rows (``#`` comments),
the way Vidur and SimAI take profiled kernels: ``attn_core,"tokens=32,context=4096,kind=mla",41.5``.
``shape`` is the key :mod:`moonep_sim.step.stack` gives each op (or ``*``: any shape of that op).
The routed experts are ``expert`` / ``expert_bwd`` rows with ``shape`` ``rows=m`` (one expert's
GEMMs on m rows), interpolated linearly between the measured m (and beyond the last two). When a
profile is given, every op of the step must be in it: the missing ones are one error line.
"""

from __future__ import annotations

import csv
import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.models import ModelSpec
from moonep_sim.plan import Plan
from moonep_sim.sim.compute import slot_work
from moonep_sim.sim.topology import Topology
from moonep_sim.step.stack import Op

#: ASSUMED: rows at which a GEMM runs at half its large-GEMM rate (see the module docstring).
GEMM_HALF_ROWS = 64.0
GEMM_DTYPES = ("bf16", "fp8")
EXPERT_OPS = ("expert", "expert_bwd")
#: What a figure priced by the roofline says beside itself (no measured table covers it).
ROOFLINE = "roofline-compute"
#: Per-kernel launch costs, per op (one kernel per op, one per GEMM of a block of projections):
#: the GPU-side gap between back-to-back kernels fed from a stream and from a captured CUDA graph
#: (NVIDIA, "Getting Started with CUDA Graphs": 2.9 us kernels run at 3.8 us each from a stream,
#: 3.4 us each from a graph), and the host's time to submit one kernel in eager mode, which bounds
#: an op shorter than it (4-6 us per cudaLaunchKernel path, "pegainfer (3): From Launch Overhead to
#: CUDA Graph"; ASSUMED 5 us). ``CostModel.launch``: ``none`` (default), ``graph`` or ``eager``.
KERNEL_GAP_STREAM_US = 0.9
KERNEL_GAP_GRAPH_US = 0.5
HOST_LAUNCH_US = 5.0
LAUNCH_MODES = ("none", "graph", "eager")
#: Ops a profile may leave out (priced by the roofline, flagged): the casts and the router's top-k.
OPTIONAL_OPS = ("quantize", "quantize_bwd", "router_topk", "router_topk_bwd")
#: Bytes per weight element a weight-gradient GEMM moves besides its inputs: it accumulates into the
#: FP32 gradient (read and write 4 bytes: DeepGEMM's weight-gradient kernels take the FP32 gradient
#: as their C and write D = C + A B -- ``fp8_dptp128c_acc`` in DeepSeek's training profile; Megatron's
#: gradient-accumulation fusion into ``main_grad`` the same); charged on the measured path (the
#: roofline's backward already moves its FP32 gradients).
WGRAD_ACC_BYTES = 8.0
#: Per routed row, the token permutation into the expert-grouped layout and back (read + write of
#: one bf16 row each way: Megatron's permute / DeepSeek's expand_to_fused and reduce_fused), what
#: a zero-copy kernel (MoonEP: rows land in their expert-grouped slots) does not pay.
PERMUTE_PASSES = 4


@dataclass(frozen=True)
class Profile:
    """A measured profile: ``times[(op, shape)]`` in us; ``curves[op]`` = (rows [n], us [n]) sorted."""

    path: str
    times: dict[tuple[str, str], float]
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def lookup(self, op: str, shape: str) -> float | None:
        t = self.times.get((op, shape))
        return self.times.get((op, "*")) if t is None else t

    def expert_us(self, op: str, rows_S: np.ndarray) -> np.ndarray | None:
        """[S] one expert's time per slot at its rows (0 for empty slots); None if not profiled."""
        if op not in self.curves:
            return None
        m, t = self.curves[op]
        if m.size == 1:
            out = t[0] * rows_S / m[0]
        else:
            out = np.interp(rows_S, m, t)
            hi = rows_S > m[-1]
            slope = (t[-1] - t[-2]) / (m[-1] - m[-2])
            out = np.where(hi, t[-1] + slope * (rows_S - m[-1]), out)
        return np.where(rows_S > 0, np.maximum(out, 0.0), 0.0)


def read_profile(path: str | os.PathLike) -> Profile:
    """Read a profile CSV (see the module docstring); one-line errors naming the file and row."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--compute-profile ({p}) must be a readable text file: {e}") from None
    times: dict[tuple[str, str], float] = {}
    pts: dict[str, list[tuple[float, float]]] = {}
    rows = csv.reader(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    for i, row in enumerate(rows, 1):
        if i == 1 and [c.strip() for c in row][:3] == ["op", "shape", "time_us"]:
            continue
        require(len(row) == 3, f"{p}: row {i} ({','.join(row)!r}) must have 3 fields: op,shape,time_us")
        op, shape, t = (c.strip() for c in row)
        try:
            us = float(t)
        except ValueError:
            raise ConfigError(f"{p}: row {i} time_us ({t!r}) must be a number") from None
        require(np.isfinite(us) and us >= 0, f"{p}: row {i} time_us ({t}) must be >= 0")
        if op in EXPERT_OPS:
            require(shape.startswith("rows="), f"{p}: row {i} shape ({shape!r}) of {op} must be rows=M")
            try:
                m = float(shape[5:])
            except ValueError:
                raise ConfigError(f"{p}: row {i} shape ({shape!r}) must be rows=M with M a number") from None
            require(m > 0, f"{p}: row {i} rows ({m:g}) must be > 0")
            pts.setdefault(op, []).append((m, us))
        else:
            times[(op, shape)] = us
    curves = {}
    for op, xs in pts.items():
        xs.sort()
        m = np.array([a for a, _ in xs])
        require(np.unique(m).size == m.size, f"{p}: {op} rows must not repeat")
        curves[op] = (m, np.array([b for _, b in xs]))
    require(times or curves, f"--compute-profile ({p}) must hold at least one op,shape,time_us row")
    return Profile(str(p), times, curves)


@dataclass(frozen=True)
class CostModel:
    """Prices ops and a Plan's routed experts on one topology (or from a profile).

    gemm_dtype: ``bf16`` or ``fp8`` GEMM peak.  half_rows: the efficiency curve's half-rate rows
    (0 = flat at the topology's efficiency).  profile: measured times replacing the defaults.
    measured: AIConfigurator's measured tables (``moonep_sim.step.measured.load_measured``): the
    GEMM ops and the routed experts' GEMMs are read from them (a profile still wins); every other
    op stays on the roofline (:meth:`op_source` says which).
    permute: the routed experts also pay the token permutation into the expert-grouped layout and
    back (:data:`PERMUTE_PASSES`) and, with FP8 GEMMs, the cast of their intermediate rows, over
    HBM -- not for a zero-copy kernel (``KernelSpec.zero_copy``); off by default so that the
    experts cost what the layer simulator charges (``moonep-sim step`` turns it on).
    fitted: the GEMM roofline's constants FITTED on the measured tables for this GPU and dtype
    (:func:`fitted_constants`: ``compute_efficiency``, ``half_rows``, ``mem_efficiency``), replacing
    the topology's efficiencies and :data:`GEMM_HALF_ROWS` for GEMMs (None: the assumed ones).
    launch: what launching each op's kernels costs (:data:`LAUNCH_MODES`): ``none``; ``graph`` (a
    captured CUDA graph: :data:`KERNEL_GAP_GRAPH_US` per kernel); ``eager`` (a stream fed by the
    host: :data:`KERNEL_GAP_STREAM_US` per kernel, and no op shorter than the host's
    :data:`HOST_LAUNCH_US` per kernel). Not applied to a profile's times (they include it).
    weight_bytes: bytes per stored weight element, scales included (``moonep_sim.step.dtypes``;
    2 = bf16): the roofline prices a GEMM's weight traffic (the ops' bf16 weight bytes, the routed
    experts' weights) at it, what bounds the memory-bound decode GEMMs.
    recompute: what a training backward recomputes of its forward first (an
    ``ActivationOptions``; None: nothing), priced by :mod:`moonep_sim.step.recompute`.
    legacy: the step's earlier cost model, kept to show what the terms since added change
    (:func:`legacy_cost_model`): GEMMs and attention on the roofline at the topology's efficiency x
    ``m / (m + GEMM_HALF_ROWS)``, FP8 at exactly twice the BF16 peak, the casts and the router's
    top-k free (with no measured tables, permutation or launches: the fields above at their
    defaults); the layer's communication then ignores the host wait of a count exchange and has
    every kernel hold its SMs for the whole collective (``moonep_sim.step.layer_sim``).
    """

    topo: Topology
    gemm_dtype: str = "bf16"
    half_rows: float = GEMM_HALF_ROWS
    profile: Profile | None = None
    measured: object | None = None
    permute: bool = False
    fitted: dict | None = None
    launch: str = "none"
    weight_bytes: float = 2.0
    legacy: bool = False
    recompute: object | None = None

    def __post_init__(self) -> None:
        require(self.weight_bytes > 0, f"weight bytes ({self.weight_bytes}) must be > 0")
        require(self.gemm_dtype in GEMM_DTYPES, f"gemm dtype ({self.gemm_dtype!r}) must be one of "
                                                f"{', '.join(GEMM_DTYPES)}")
        require(self.half_rows >= 0, f"half_rows ({self.half_rows}) must be >= 0")
        require(self.launch in LAUNCH_MODES, f"launch ({self.launch!r}) must be one of {', '.join(LAUNCH_MODES)}")

    @property
    def gemm_flops_per_us(self) -> float:
        t = self.topo
        if self.legacy:
            return t.gpu_tflops * (2.0 if self.gemm_dtype == "fp8" else 1.0) * t.gpu_compute_efficiency * 1e6
        peak = t.gpu_tflops_fp8 if (self.gemm_dtype == "fp8" and t.gpu_tflops_fp8 > 0) else t.gpu_tflops
        eff = self.fitted["compute_efficiency"] if self.fitted else t.gpu_compute_efficiency
        return peak * eff * 1e6

    @property
    def gemm_mem_bytes_per_us(self) -> float:
        """HBM rate of a weight-bound GEMM (the fitted efficiency where given)."""
        if self.fitted:
            return self.topo.gpu_mem_bandwidth_GBps * self.fitted["mem_efficiency"] * 1e3
        return self.topo.mem_bytes_per_us

    def curve(self, rows: np.ndarray | float) -> np.ndarray | float:
        """eff(m) in (0, 1]: the fraction of the large-GEMM rate a GEMM of m rows reaches."""
        h = self.fitted["half_rows"] if self.fitted else self.half_rows
        if h <= 0:
            return np.ones_like(rows, dtype=np.float64) if isinstance(rows, np.ndarray) else 1.0
        m = np.maximum(rows, 1e-9)
        return m / (m + h)

    def op_us(self, op: Op) -> float:
        """One op's time (a profile's when given; ``missing_ops`` checks first)."""
        if self.profile is not None and (op.name not in OPTIONAL_OPS or self.profile.lookup(op.name, op.shape)):
            t = self.profile.lookup(op.name, op.shape)
            require(t is not None, f"--compute-profile ({self.profile.path}) must time op {op.name} at shape "
                                   f"{op.shape}", ConfigError)
            return float(t)
        if self.legacy and op.name in OPTIONAL_OPS:
            return 0.0
        t = self._measured_op_us(op)
        return self._launched(op, t if t is not None else self.roofline_op_us(op))

    def _launched(self, op: Op, t: float) -> float:
        """``t`` with the op's kernel launches (``launch``); a zero-time op (a cast without FP8) none."""
        if self.launch == "none" or t <= 0:
            return t
        kernels = max(len(op.parts), 1) * (2 if op.name.endswith("_bwd") and op.kind == "gemm" else 1)
        if self.launch == "graph":
            return t + kernels * KERNEL_GAP_GRAPH_US
        return max(t + kernels * KERNEL_GAP_STREAM_US, kernels * HOST_LAUNCH_US)

    def roofline_op_us(self, op: Op) -> float:
        """One op's roofline time (see the module docstring)."""
        mem = self.topo.mem_bytes_per_us
        if op.kind == "cast":  # FP8 GEMMs only
            return op.bytes / mem if self.gemm_dtype == "fp8" else 0.0
        if op.kind == "bytes":
            return op.bytes / mem
        if op.kind == "attention":  # a backward at FlashAttention-3's backward rate (legacy: the forward's)
            from moonep_sim.step.measured import ATTN_BWD_EFFICIENCY

            eff = ATTN_BWD_EFFICIENCY if op.name.endswith("_bwd") and not self.legacy else 1.0
            return max(op.flops / (self.topo.flops_per_us * eff), op.bytes / mem)
        wbytes = op.bytes * self.weight_bytes / 2.0  # a GEMM op's bytes are its bf16 weights
        return max(op.flops / (self.gemm_flops_per_us * float(self.curve(float(op.rows)))),
                   wbytes / self.gemm_mem_bytes_per_us)

    def _gemm_shape(self, op: Op) -> tuple[float, float, float] | None:
        """(m, n, k) of a GEMM op with its width given (None otherwise)."""
        if op.kind != "gemm" or op.k <= 0 or op.rows <= 0:
            return None
        return float(op.rows), op.flops / (2.0 * op.rows * op.k), float(op.k)

    def _measured_op_us(self, op: Op) -> float | None:
        """A GEMM op's measured time (the backward: its input- and weight-gradient GEMMs), scaled to
        this GPU's roofline when the table is another die's; None: not covered."""
        if self.measured is not None and op.kind == "attention" and op.attn:
            return self._measured_attention_us(op)
        mnk = self._gemm_shape(op) if self.measured is not None else None
        if mnk is None:
            return None
        m, n, k = mnk
        nk = [(float(a), float(b)) for a, b in op.parts] or [(n / 2.0 if op.name.endswith("_bwd") else n, k)]
        if op.name.endswith("_bwd"):  # per GEMM: dX = dY W^T (m, k, n), dW = X^T dY (k, n, m)
            ms, ns, ks = [m] * len(nk) + [b for _, b in nk], [b for _, b in nk] + [a for a, _ in nk], \
                [a for a, _ in nk] + [m] * len(nk)
        else:
            ms, ns, ks = [m] * len(nk), [a for a, _ in nk], [b for _, b in nk]
        t = self.measured.gemm_us(self.gemm_dtype, ms, ns, ks)
        t = None if t is None else float(t.sum())
        if t is None:
            return None
        if self.measured.die is not None:
            die = CostModel(self.measured.die, self.gemm_dtype, self.half_rows)
            t *= self.roofline_op_us(op) / die.roofline_op_us(op)
        if op.name.endswith("_bwd"):  # the weight gradients accumulate into FP32
            t += WGRAD_ACC_BYTES * sum(a * b for a, b in nk) / self.gemm_mem_bytes_per_us
        return t

    def _measured_attention_us(self, op: Op) -> float | None:
        """An attention core's measured forward (x ``ATTN_BWD_FACTOR`` for its backward), scaled to
        this GPU's roofline when the table is another die's; None: not covered."""
        from moonep_sim.step.measured import ATTN_BWD_FACTOR

        got = self.measured.attention_us(op.attn)
        if got is None:
            return None
        t = got[0] * (ATTN_BWD_FACTOR if op.name.endswith("_bwd") else 1.0)
        if self.measured.die is not None:
            die = CostModel(self.measured.die, self.gemm_dtype, self.half_rows)
            t *= self.roofline_op_us(op) / die.roofline_op_us(op)
        return t

    def op_source(self, op: Op) -> str:
        """Where ``op``'s time comes from: ``profile``, ``measured (...)`` or :data:`ROOFLINE`."""
        if self.profile is not None and (op.name not in OPTIONAL_OPS or self.profile.lookup(op.name, op.shape)):
            return f"profile ({self.profile.path})"
        if self.measured is not None and op.kind == "attention" and op.attn:
            got = self.measured.attention_us(op.attn)
            if got is not None:
                return f"measured ({got[1]})" + (", backward x 2.5 FLOPs (FlashAttention-2) at 542/638 of the "
                                                 "forward's rate (FlashAttention-3)" if op.name.endswith("_bwd") else "")
        if self.measured is not None and self._gemm_shape(op) is not None \
                and self.measured.gemm(self.gemm_dtype) is not None:
            return self.measured.label(self.gemm_dtype)
        return self._roofline_label()

    def _roofline_label(self) -> str:
        return ROOFLINE + (f" (GEMM constants {self.fitted['source']})" if self.fitted else "")

    def expert_source(self) -> str:
        """Where the routed experts' GEMM times come from."""
        if self.profile is not None:
            return f"profile ({self.profile.path})"
        if self.measured is not None and self.measured.gemm(self.gemm_dtype) is not None:
            return self.measured.label(self.gemm_dtype) + ", grouped: a rank's experts read as one GEMM"
        return self._roofline_label()

    def sources(self, ops: list[Op], train: bool) -> dict[str, str]:
        """Op name -> where its time comes from (:meth:`op_source`), the routed experts included."""
        out = {op.name: self.op_source(op) for op in ops}
        out["expert"] = self.expert_source()
        if train:
            out["expert_bwd"] = out["expert"]
        if self.legacy:
            out["cost_model"] = "legacy: roofline at the topology's efficiency x m/(m+64), FP8 = 2 x BF16, no casts, " \
                                "router top-k, permutation, launches or host wait; every kernel holds its SMs"
        out["launch"] = {"none": "not charged", "graph": f"CUDA graph: {KERNEL_GAP_GRAPH_US} us per kernel",
                         "eager": f"eager: {KERNEL_GAP_STREAM_US} us per kernel, at least {HOST_LAUNCH_US} us "
                                  "(host submit)"}[self.launch]
        return out

    def missing_ops(self, ops: list[Op]) -> list[str]:
        """``op@shape`` of every op (and expert GEMM) the profile lacks; [] without a profile."""
        if self.profile is None:
            return []
        out = []
        for op in ops:
            if op.name in EXPERT_OPS:
                if op.name not in self.profile.curves:
                    out.append(f"{op.name}@rows=M")
            elif op.name not in OPTIONAL_OPS and self.profile.lookup(op.name, op.shape) is None:
                out.append(f"{op.name}@{op.shape}")
        return sorted(set(out))

    def expert_us_R(self, plan: Plan, model: ModelSpec, backward: bool = False) -> np.ndarray:
        """float64 [R]: each rank's routed-expert time for ``plan`` (its grouped GEMM over its slots,
        padding rows included as ``gpu_padding_compute`` says, plus one launch). Mirrors
        ``moonep_sim.sim.compute.rank_compute_us`` with the efficiency curve on the FLOP side."""
        t = self.topo
        R = plan.ranks
        rows_S = plan.slot_padded_S.astype(np.float64)
        if t.gpu_padding_compute < 1:
            real = plan.slot_rows_S.astype(np.float64)
            rows_S = real + t.gpu_padding_compute * (rows_S - real)
        name = "expert_bwd" if backward else "expert"
        prof = self.profile.expert_us(name, rows_S) if self.profile is not None else None
        if prof is not None:
            return np.bincount(plan.slot_rank_S, weights=prof, minlength=R)
        require(self.profile is None, f"--compute-profile ({self.profile.path if self.profile else ''}) must time "
                                      f"op {name} (rows=M rows)", ConfigError)
        if self.measured is not None and self.measured.gemm(self.gemm_dtype) is not None:
            out = self._measured_expert_us_R(plan, model, rows_S, backward)
        else:
            out = self._roofline_expert_us_R(plan, model, rows_S, backward)
        if self.permute and not (plan.kernel is not None and plan.kernel.zero_copy):
            per_row = PERMUTE_PASSES * model.dispatch_hidden * 2.0
            if self.gemm_dtype == "fp8":  # the SwiGLU output's cast (twice in backward: transposed too)
                per_row += (2.0 if backward else 1.0) * model.expert_ffn * (2 + 1 + 4 / 128)
            out = out + np.bincount(plan.slot_rank_S, weights=rows_S * per_row, minlength=plan.ranks) / \
                self.topo.mem_bytes_per_us
        return out

    def _measured_expert_us_R(self, plan: Plan, model: ModelSpec, rows_S: np.ndarray, backward: bool) -> np.ndarray:
        """[R] the routed experts' grouped GEMM read from the measured table, plus one launch; scaled
        by the roofline ratio for a nearest-die table.

        A grouped GEMM (DeepGEMM's ``m_grouped`` contiguous and masked kernels) schedules the tiles of
        every local expert in one persistent kernel, so its c experts of mean m rows run as one GEMM
        whose N is the experts' N side by side: gate/up ``(m, c 2F, D)`` and down ``(m, c D, F)``; in
        backward the input gradients ``(m, c D, 2F)``, ``(m, c F, D)`` and the K-grouped weight
        gradients ``(D, c 2F, m)``, ``(F, c D, m)`` (these accumulating into FP32:
        :data:`WGRAD_ACC_BYTES`). Read one expert at a time instead, a weight-bound expert (a few
        rows) fills few SMs and the table's lone small GEMM streams its weights well below the HBM
        rate; side by side the rank's experts stream at it. At DeepSeek-V3's EP32 decode shape (8
        experts of 64 rows, FP8) this reads 140 us on H100, against 150 us in AIConfigurator's own
        measured DeepEP MoE table (sglang 0.5.10 ``wideep_generation_moe_perf``, EP32, uniform) and
        209 us one expert at a time (``tests/test_measured.py``)."""
        D, F = float(model.dispatch_hidden), float(model.expert_ffn)
        R = plan.ranks
        live = rows_S > 0
        c_R = np.bincount(plan.slot_rank_S[live], minlength=R).astype(np.float64)
        rows_R = np.bincount(plan.slot_rank_S, weights=rows_S, minlength=R)
        has = c_R > 0
        c, m = c_R[has], rows_R[has] / np.maximum(c_R[has], 1.0)
        if backward:
            shapes = [(m, c * D, 2 * F), (D, c * 2 * F, m), (m, c * F, D), (F, c * D, m)]
        else:
            shapes = [(m, c * 2 * F, D), (m, c * D, F)]
        t_R = np.zeros(R)
        mnk = np.array([np.broadcast_arrays(*g) for g in shapes])  # [G, 3, ranks with experts]
        for t in self.measured.gemm_us(self.gemm_dtype, *mnk.transpose(1, 0, 2)):  # every GEMM in one lookup
            t_R[has] += t  # (summed GEMM by GEMM)
        out = t_R + self.topo.gpu_launch_us
        if self.measured.die is not None:
            die = CostModel(self.measured.die, self.gemm_dtype, self.half_rows)
            mine = self._roofline_expert_us_R(plan, model, rows_S, backward)
            ref = die._roofline_expert_us_R(plan, model, rows_S, backward)
            out = out * np.divide(mine, ref, out=np.ones_like(mine), where=ref > 0)
        if backward:
            out = out + WGRAD_ACC_BYTES * c_R * 3 * D * F / self.gemm_mem_bytes_per_us
        return out

    def _roofline_expert_us_R(self, plan: Plan, model: ModelSpec, rows_S: np.ndarray, backward: bool) -> np.ndarray:
        t = self.topo
        R = plan.ranks
        flops_S, fixed_S, per_row = slot_work(plan, model, backward)
        scale = np.divide(rows_S, plan.slot_padded_S, out=np.zeros_like(rows_S), where=plan.slot_padded_S > 0)
        flops_S = flops_S * scale
        fixed_S = np.where(rows_S > 0, fixed_S, 0.0)
        if self.weight_bytes != 2.0:  # bf16 weights (and fp32 gradients in the backward) -> the stored format
            fixed_S = fixed_S * ((self.weight_bytes + 4.0) / 6.0 if backward else self.weight_bytes / 2.0)
        t_flop = flops_S / (self.gemm_flops_per_us * self.curve(rows_S))
        t_mem = (fixed_S + rows_S * per_row) / self.gemm_mem_bytes_per_us
        t_S = np.maximum(t_flop, t_mem)
        if t.gpu_slot_us > 0:
            t_S = t_S + np.where(rows_S > 0, t.gpu_slot_us, 0.0)
        return np.bincount(plan.slot_rank_S, weights=t_S, minlength=R) + t.gpu_launch_us


def fitted_constants(topology_name: str, dtype: str) -> dict | None:
    """The GEMM roofline's constants FITTED on AIConfigurator's measured tables for the preset's GPU
    and ``dtype`` (``moonep_sim/data/roofline-fits.toml``, ``benchmarks/fit_roofline.py``), with
    their ``source``; None for a GPU the file does not list."""
    from moonep_sim.io import data_toml

    g = data_toml("roofline-fits.toml").get(topology_name.lower().split("-")[0])
    if not g or dtype not in g:
        return None
    return dict(g[dtype], source=g["source"])


#: The cost models a step can price with (:func:`cost_model_preset`): ``current`` (the default,
#: :func:`step_cost_model`'s rule) and ``legacy`` (:func:`legacy_cost_model`).
COST_MODEL_PRESETS = ("current", "legacy")
_PRESET: ContextVar[str] = ContextVar("moonep_sim_cost_model_preset", default="current")


@contextmanager
def cost_model_preset(name: str):
    """Within the block, every step priced through :func:`step_cost_model` in this thread uses the
    cost model ``name`` (:data:`COST_MODEL_PRESETS`): ``benchmarks/fidelity_steps.py --before``
    prices the development rows with ``legacy`` this way, without a flag on every step path."""
    require(name in COST_MODEL_PRESETS, f"cost model ({name!r}) must be one of {', '.join(COST_MODEL_PRESETS)}")
    token = _PRESET.set(name)
    try:
        yield
    finally:
        _PRESET.reset(token)


def legacy_cost_model(topo: Topology, gemm_dtype: str = "bf16", profile: Profile | None = None) -> CostModel:
    """The step's earlier cost model (``CostModel.legacy``): the roofline at the topology's
    efficiency x ``m / (m + 64)``, FP8 at twice BF16, no measured tables, no launch, cast,
    permutation, router top-k or host-wait cost, every kernel holding its SMs. A user's profile
    still wins where given."""
    return CostModel(topo, gemm_dtype, profile=profile, legacy=True)


def step_cost_model(topo: Topology, gemm_dtype: str = "bf16", compute_profile: "str | os.PathLike | None" = None,
                    measured: bool = True, mode: str | None = None, weight_bytes: float = 2.0) -> CostModel:
    """The cost model every step path prices with (one rule): a user's ``compute_profile`` wins;
    else AIConfigurator's measured tables where installed and the GPU has one
    (``moonep_sim.step.measured``; ``measured=False`` skips them); else the roofline, its GEMM
    constants fitted on those tables where the GPU has a fit (:func:`fitted_constants`). The routed
    experts pay their permutation; launches are a captured CUDA graph in ``decode`` (serving) and
    eager otherwise (``mode`` None: not charged). weight_bytes: the stored weights' bytes per
    element (:class:`CostModel`)."""
    from moonep_sim.step.measured import load_measured

    profile = read_profile(compute_profile) if compute_profile else None
    if _PRESET.get() == "legacy":
        return legacy_cost_model(topo, gemm_dtype, profile)
    tables = load_measured(topo) if measured and profile is None else None
    return CostModel(topo, gemm_dtype, profile=profile, measured=tables, permute=True,
                     fitted=fitted_constants(topo.name, gemm_dtype) if tables is None and profile is None else None,
                     launch="none" if mode is None else ("graph" if mode == "decode" else "eager"),
                     weight_bytes=weight_bytes)


def flat_cost_model(topo: Topology) -> CostModel:
    """The cost model whose routed experts cost exactly what the layer simulator charges."""
    return CostModel(topo, "bf16", 0.0)


__all__ = ["COST_MODEL_PRESETS", "CostModel", "EXPERT_OPS", "GEMM_DTYPES", "GEMM_HALF_ROWS", "HOST_LAUNCH_US", "KERNEL_GAP_GRAPH_US",
           "KERNEL_GAP_STREAM_US", "LAUNCH_MODES", "OPTIONAL_OPS", "PERMUTE_PASSES", "Profile", "ROOFLINE", "WGRAD_ACC_BYTES",
           "cost_model_preset", "fitted_constants", "flat_cost_model", "legacy_cost_model", "step_cost_model",
           "read_profile"]
