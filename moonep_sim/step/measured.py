"""Measured GEMM times from NVIDIA AIConfigurator's per-GPU tables, the step's default where they exist.

Notation: m rows, n output columns, k reduction of one GEMM ``[m, k] x [k, n]``. Times in
microseconds.

AIConfigurator (``aiconfigurator-core`` on PyPI, Apache-2.0; ``pip install 'moonep-sim[measured]'``)
ships per-GPU databases of measured kernel times under ``aiconfigurator_core/systems/data/<system>/``;
its GEMM table (``gemm/<backend>/<version>/gemm_perf.parquet``: framework, version, device,
kernel_source, gemm_dtype, m, n, k, latency in ms) is a near-complete grid over 74 m (1 to 32768) x
22 n x 22 k (32 to 65536) per dtype and kernel. This module reads it through the package's data
files (pandas / pyarrow, its own dependencies) and interpolates by shape:

- **grid**: per (dtype, kernel) the latencies on the (m, n, k) grid; a grid point the table lacks is
  filled along m (linear in log m, log t) from its (n, k) neighbours;
- **inside the grid**: trilinear in (log m, log n, log k) of log t -- a GEMM's time is close to a
  power law between grid points (flat in m while weight-bound, linear once compute-bound);
- **outside**: clamped to the grid's n and k and scaled by the FLOP ratio beyond the last point
  (``n > 65536``, an LM head's vocabulary), linear in m beyond the last m.

AIConfigurator's own ``sdk/perf_database.py`` interpolates its GEMM table by shape the same way in
spirit (neighbouring measured shapes); :func:`holdout_error` reports this interpolation's error on
grid points held out of the table.

**Which GPU**: the topology preset's name picks the system (:data:`SYSTEMS`): H100 and H200 presets
their own tables, B200 and GB200 theirs; H800 (the H100's die, same SMs and clocks) and H20 (the
same Hopper die with a fraction of the SMs' throughput) take the H100's table scaled by the ratio
of the two GPUs' rooflines for the op (``nearest-die`` beside the figure); any other GPU has no
table (the roofline, ``roofline-compute``). **Which kernel**: BF16 GEMMs are the table's
``torch`` linear (cuBLAS, what Megatron and PyTorch run); FP8 GEMMs its block-scaled DeepGEMM
kernel (DeepSeek-V3's recipe), per-tensor scaled FP8 where a system has no DeepGEMM rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from moonep_sim.sim.topology import load_topology

#: Topology preset (its name up to the first ``-`` after the GPU) -> (AIConfigurator system, how):
#: ``own`` = the GPU's own table; ``nearest-die`` = another GPU's table scaled by the roofline ratio.
SYSTEMS: dict[str, tuple[str, str]] = {
    "h100": ("h100_sxm", "own"), "h200": ("h200_sxm", "own"), "b200": ("b200_sxm", "own"),
    "gb200": ("gb200", "own"), "b300": ("b300_sxm", "own"), "gb300": ("gb300", "own"),
    "h800": ("h100_sxm", "nearest-die"), "h20": ("h100_sxm", "nearest-die"),
}
#: The nearest die's topology preset, whose roofline scales a nearest-die table.
DIE_PRESET = {"h100_sxm": "h100-cx7"}
#: Backends tried in order for the GEMM table (the latest version of the first that has one).
BACKENDS = ("sglang", "vllm", "trtllm")
#: Kernels per dtype, in order of preference: (gemm_dtype, kernel_source substring).
KERNELS = {"bf16": (("bfloat16", "torch"),), "fp8": (("fp8_block", "deepgemm"), ("fp8", ""))}


def available() -> bool:
    """Whether ``aiconfigurator-core`` (and pandas, which reads its tables) is installed."""
    try:
        import aiconfigurator_core  # noqa: F401
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True


def data_root() -> Path | None:
    """The package's ``systems/data`` folder (None without the package)."""
    if not available():
        return None
    import aiconfigurator_core

    p = Path(aiconfigurator_core.__file__).parent / "systems" / "data"
    return p if p.is_dir() else None


def system_for(topology_name: str) -> tuple[str, str] | None:
    """(AIConfigurator system, ``own`` / ``nearest-die``) for a topology preset name; None: no table."""
    gpu = topology_name.lower().split("-")[0]
    return SYSTEMS.get(gpu)


def _version_key(v: str) -> tuple:
    parts = []
    for tok in v.replace("rc", ".").replace("post", ".").replace("dev", ".").split("."):
        parts.append(int(tok) if tok.isdigit() else 0)
    return tuple(parts)


@dataclass(frozen=True, eq=False)
class GemmTable:
    """One GPU's measured GEMM times for one dtype on the (m, n, k) grid: ``logt_MNK`` [M, N, K]
    log(us); ``source``: system / backend / version / kernel."""

    system: str
    dtype: str
    source: str
    m_M: np.ndarray
    n_N: np.ndarray
    k_K: np.ndarray
    logt_MNK: np.ndarray

    def us(self, m, n, k) -> np.ndarray:
        """float64 [...]: the time of GEMMs of shapes (m, n, k) (broadcast), in us."""
        m, n, k = np.broadcast_arrays(np.asarray(m, np.float64), np.asarray(n, np.float64), np.asarray(k, np.float64))
        mc = np.clip(m, self.m_M[0], self.m_M[-1])
        nc = np.clip(n, self.n_N[0], self.n_N[-1])
        kc = np.clip(k, self.k_K[0], self.k_K[-1])
        f = _interp(self)
        t = np.exp(f(np.stack([np.log(mc), np.log(nc), np.log(kc)], axis=-1).reshape(-1, 3))).reshape(m.shape)
        # beyond the grid: the FLOP ratio (n, k; compute-bound there) and linear in m
        t = t * np.maximum(n / nc, 1.0) * np.maximum(k / kc, 1.0) * np.maximum(m / mc, 1.0)
        return np.where(m > 0, t, 0.0)

    def held_out(self, every: int = 7) -> dict:
        """Interpolation error on interior grid points held out of the table: every ``every``-th
        interior (m, n, k) point removed, its time interpolated from the others' neighbours along m
        (the points either side in m). Returns {points, median_abs, p90_abs, max_abs} (fractions)."""
        M = self.m_M.size
        idx = np.arange(1, M - 1)[::every]
        lm = np.log(self.m_M)
        w = ((lm[idx] - lm[idx - 1]) / (lm[idx + 1] - lm[idx - 1]))[:, None, None]
        est = (1 - w) * self.logt_MNK[idx - 1] + w * self.logt_MNK[idx + 1]
        err = np.abs(np.exp(est - self.logt_MNK[idx]) - 1).ravel()
        return {"points": int(err.size), "median_abs": float(np.median(err)), "p90_abs": float(np.quantile(err, 0.9)),
                "max_abs": float(err.max())}


@lru_cache(maxsize=32)
def _interp(tab: GemmTable):
    from scipy.interpolate import RegularGridInterpolator

    return RegularGridInterpolator((np.log(tab.m_M), np.log(tab.n_N), np.log(tab.k_K)), tab.logt_MNK)


def _grid(df) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(m, n, k, log us [M, N, K]) of one kernel's rows; missing points filled along m."""
    d = df.groupby(["m", "n", "k"], as_index=False)["latency"].median()
    m_M, n_N, k_K = (np.sort(d[c].unique()).astype(np.float64) for c in ("m", "n", "k"))
    grid = np.full((m_M.size, n_N.size, k_K.size), np.nan)
    grid[np.searchsorted(m_M, d["m"]), np.searchsorted(n_N, d["n"]), np.searchsorted(k_K, d["k"])] = \
        np.log(np.maximum(d["latency"].to_numpy(np.float64) * 1e3, 1e-6))
    lm = np.log(m_M)
    bad = np.argwhere(np.isnan(grid[0]) | np.isnan(grid).any(axis=0))
    for j, l in bad:  # few (n, k) columns miss an m: fill along m from the column's measured points
        col = grid[:, j, l]
        ok = ~np.isnan(col)
        grid[:, j, l] = np.interp(lm, lm[ok], col[ok]) if ok.sum() >= 2 else np.nanmean(grid[:, j, :], axis=1)
    return m_M, n_N, k_K, grid


@lru_cache(maxsize=16)
def gemm_table(system: str, dtype: str) -> GemmTable | None:
    """The measured GEMM table of ``system`` for ``dtype`` (``bf16`` / ``fp8``); None if absent."""
    import pandas as pd

    root = data_root()
    if root is None or not (root / system / "gemm").is_dir():
        return None
    for backend in BACKENDS:
        bdir = root / system / "gemm" / backend
        if not bdir.is_dir():
            continue
        for vdir in sorted((p for p in bdir.iterdir() if (p / "gemm_perf.parquet").is_file()),
                           key=lambda p: _version_key(p.name), reverse=True):
            df = pd.read_parquet(vdir / "gemm_perf.parquet", columns=["kernel_source", "gemm_dtype", "m", "n", "k",
                                                                       "latency"])
            for gd, kern in KERNELS[dtype]:
                rows = df[(df["gemm_dtype"] == gd) & df["kernel_source"].str.contains(kern, case=False, regex=False)]
                if len(rows) < 100:
                    continue
                ks = sorted(rows["kernel_source"].unique())
                rows = rows[rows["kernel_source"] == ks[0]]
                m, n, k, grid = _grid(rows)
                return GemmTable(system, dtype, f"aiconfigurator-core {system}/gemm/{backend}/{vdir.name} "
                                                f"{ks[0]} ({gd})", m, n, k, grid)
    return None


#: FlashAttention's backward FLOPs over its forward's (Dao, FlashAttention-2: 5 matmuls to 2).
ATTN_BWD_FLOPS = 2.5
#: FlashAttention-3's backward rate over its forward's on H100 SXM5 at head dim 128, 4k tokens, no
#: causal mask: 542 / 638 TFLOP/s (Shah et al., "FlashAttention-3", 2024, the forward and backward
#: speed figures): the backward's dQ accumulation (atomic adds in FP32) and its five matmuls keep it
#: below the forward's rate.
ATTN_BWD_EFFICIENCY = 542.0 / 638.0
#: A measured forward's backward (no measured backward table exists): its FLOPs at its rate.
ATTN_BWD_FACTOR = ATTN_BWD_FLOPS / ATTN_BWD_EFFICIENCY


@lru_cache(maxsize=8)
def attention_table(system: str, phase: str):
    """AIConfigurator's measured GQA attention of ``system`` (``context`` / ``generation``): the
    FlashAttention-3 rows with bf16 attention and cache, as a DataFrame (latency in us); None if absent."""
    import pandas as pd

    root = data_root()
    if root is None:
        return None
    for backend in BACKENDS:
        bdir = root / system / "attention" / backend
        if not bdir.is_dir():
            continue
        for vdir in sorted(bdir.iterdir(), key=lambda p: _version_key(p.name), reverse=True):
            f = vdir / f"{phase}_attention_perf.parquet"
            if not f.is_file():
                continue
            d = pd.read_parquet(f)
            d = d[(d["kernel_source"] == "fa3") & (d["attn_dtype"] == "bfloat16") & (d["kv_cache_dtype"] == "bfloat16")]
            if len(d):
                d = d.assign(us=d["latency"] * 1e3)
                d.attrs["source"] = f"aiconfigurator-core {system}/attention/{backend}/{vdir.name} fa3 {phase}"
                return d
    return None


def attention_us(system: str, attn: tuple) -> tuple[float, str] | None:
    """(us, source) of one layer's attention core on one rank from the measured tables: context
    attention for whole sequences (train / prefill, ``context <= tokens``), generation attention in
    decode; bilinear in (log sequences, log context) among the rows of the same query heads per KV
    head, head dim and window (the most heads up to ours, scaled linearly in heads: the tables hold
    one tensor-parallel GPU's share); None outside what the tables hold."""
    mode, seqs, ctx, heads, kv, hd, window = attn
    phase = "generation" if mode == "decode" else "context"
    d = attention_table(system, phase)
    if d is None:
        return None
    # the tables hold one GPU's share of the heads (tensor parallel): rows of the same query heads per
    # KV head, head dim and window, the most heads up to ours, scaled linearly to our heads
    d = d[(d["num_heads"] * kv == d["num_key_value_heads"] * heads) & (d["head_dim"] == hd)
          & (d["window_size"] == window) & (d["num_heads"] <= heads)]
    col = "step" if phase == "generation" else "isl"
    if d.empty:
        return None
    for top in sorted(d["num_heads"].unique(), reverse=True):  # the most heads whose grid covers the point
        v = _bilinear(d[d["num_heads"] == top], col, seqs, ctx)
        if v is not None:
            break
    else:
        return None
    v = v + np.log(heads / top)
    return float(np.exp(v)), d.attrs.get("source", f"aiconfigurator-core {system} {phase} attention")


def _bilinear(d, col: str, seqs: float, ctx: float) -> float | None:
    """log us at (seqs, ctx), bilinear in (log batch, log ``col``) over d's grid; None outside or
    where a corner is missing."""
    g = d.groupby(["batch_size", col])["us"].median()
    bs = np.sort(g.index.get_level_values(0).unique().to_numpy(np.float64))
    ls = np.sort(g.index.get_level_values(1).unique().to_numpy(np.float64))
    if bs.size < 2 or ls.size < 2 or not (bs[0] <= seqs <= bs[-1] and ls[0] <= ctx <= ls[-1]):
        return None
    grid = np.full((bs.size, ls.size), np.nan)
    for (b, l), v in g.items():
        grid[np.searchsorted(bs, b), np.searchsorted(ls, l)] = np.log(v)
    i = int(np.clip(np.searchsorted(bs, seqs) - 1, 0, bs.size - 2))
    j = int(np.clip(np.searchsorted(ls, ctx) - 1, 0, ls.size - 2))
    c = grid[i:i + 2, j:j + 2]
    if np.isnan(c).any():
        return None
    wb = (np.log(seqs) - np.log(bs[i])) / (np.log(bs[i + 1]) - np.log(bs[i]))
    wl = (np.log(ctx) - np.log(ls[j])) / (np.log(ls[j + 1]) - np.log(ls[j]))
    return float((1 - wb) * ((1 - wl) * c[0, 0] + wl * c[0, 1]) + wb * ((1 - wl) * c[1, 0] + wl * c[1, 1]))


@dataclass(frozen=True, eq=False)
class Measured:
    """The measured tables a topology's ops are priced from: ``system`` (AIConfigurator's), ``how``
    (``own`` / ``nearest-die``: then scaled by the roofline ratio to ``die``, the die's preset)."""

    system: str
    how: str
    die: object | None = None

    def gemm(self, dtype: str) -> GemmTable | None:
        return gemm_table(self.system, dtype)

    def gemm_us(self, dtype: str, m, n, k) -> np.ndarray | None:
        """float64 [...]: measured (m, n, k) GEMM times in us on the table's GPU; None: no table."""
        tab = self.gemm(dtype)
        return None if tab is None else tab.us(m, n, k)

    def attention_us(self, attn: tuple) -> tuple[float, str] | None:
        """(us, source) of an attention core from the measured tables (:func:`attention_us`)."""
        return attention_us(self.system, attn) if attn else None

    def label(self, dtype: str) -> str:
        """What a figure priced from it says beside itself."""
        tab = self.gemm(dtype)
        src = tab.source if tab is not None else self.system
        return f"measured ({src})" + (f", nearest-die ({self.system} scaled by the roofline ratio)"
                                      if self.how == "nearest-die" else "")


def load_measured(topology) -> Measured | None:
    """The :class:`Measured` tables for a :class:`~moonep_sim.sim.topology.Topology` (by its preset
    name), or None: the package is not installed, or its GPU has no table (the roofline then)."""
    got = system_for(getattr(topology, "name", ""))
    root = data_root()
    if got is None or root is None or not (root / got[0]).is_dir():
        return None
    return Measured(got[0], got[1], _die(DIE_PRESET[got[0]]) if got[1] == "nearest-die" else None)


#: The nearest die's topology by preset name, read once (every step loads the tables).
_die = lru_cache(maxsize=4)(load_topology)


__all__ = ["ATTN_BWD_EFFICIENCY", "ATTN_BWD_FACTOR", "ATTN_BWD_FLOPS", "BACKENDS", "attention_table", "attention_us", "DIE_PRESET", "GemmTable", "KERNELS", "Measured", "SYSTEMS", "available", "data_root",
           "gemm_table", "load_measured", "system_for"]
