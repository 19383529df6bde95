"""Fit the roofline's GEMM constants on AIConfigurator's measured GEMM tables, per GPU and dtype.

Usage::

    python benchmarks/fit_roofline.py     # writes moonep_sim/data/roofline-fits.toml, docs/results/roofline-fits.md

The step's roofline prices a GEMM of (m, n, k) as ``max(2mnk / (peak x e x m / (m + h)), bytes /
(HBM x b))`` (``moonep_sim.step.costs``). Here ``e`` (the large-GEMM efficiency), ``h`` (the rows
at half that rate) and ``b`` (the HBM efficiency of a weight-bound GEMM) are fitted by least squares
on log time over every table point with n, k >= 1024, per GPU table and dtype (bf16: the torch
linear; fp8: the block-scaled DeepGEMM kernel), and the measured FP8 / BF16 rate at large shapes is
reported. The constants are FITTED on those tables (named so in the data file), and used by the
step where the package is not installed (``moonep_sim.step.costs.fitted_constants``). Needs
``aiconfigurator-core``.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from moonep_sim.step.measured import available, gemm_table  # noqa: E402

#: AIConfigurator system -> (the topology preset whose peaks the fit divides by, the GPUs it serves).
FIT_SYSTEMS = {"h100_sxm": ("h100-cx7", ("h100", "h800")), "h200_sxm": ("h200-cx7", ("h200",)),
               "b200_sxm": ("b200", ("b200",)), "gb200": ("gb200-nvl72", ("gb200",)),
               "b300_sxm": ("b300", ("b300",)), "gb300": ("gb300-nvl72", ("gb300",))}


def fit(tab, peak_tflops: float, hbm_GBps: float) -> dict:
    from scipy.optimize import least_squares

    M, N, K = np.meshgrid(tab.m_M, tab.n_N, tab.k_K, indexing="ij")
    keep = (N >= 1024) & (K >= 1024)
    m, n, k, t = M[keep], N[keep], K[keep], np.exp(tab.logt_MNK[keep])
    elem = 1.0 if tab.dtype == "fp8" else 2.0
    flops, wbytes = 2 * m * n * k, (n * k + m * k + m * n) * elem

    def model(p):
        e, h, b = np.exp(p)
        return np.maximum(flops / (peak_tflops * 1e6 * e * m / (m + h)), wbytes / (hbm_GBps * 1e3 * b))

    r = least_squares(lambda p: np.log(model(p)) - np.log(t), x0=np.log([0.7, 64.0, 0.8]))
    e, h, b = np.exp(r.x)
    err = np.abs(model(r.x) / t - 1)
    big = (m >= 4096) & (n >= 4096) & (k >= 4096)
    tflops = float(np.median(flops[big] / t[big] / 1e6))
    return {"compute_efficiency": float(e), "half_rows": float(h), "mem_efficiency": float(b),
            "median_abs_error": float(np.median(err)), "p90_abs_error": float(np.quantile(err, 0.9)),
            "points": int(err.size), "large_tflops": tflops}


def main() -> int:
    if not available():
        print("moonep-sim: error: aiconfigurator-core must be installed: pip install 'moonep-sim[measured]'",
              file=sys.stderr)
        return 2
    from moonep_sim.sim.topology import load_topology

    out, rows = [], []
    for system, (preset, gpus) in FIT_SYSTEMS.items():
        topo = load_topology(preset)
        fits = {}
        for dtype in ("bf16", "fp8"):
            tab = gemm_table(system, dtype)
            if tab is None:
                continue
            peak = topo.gpu_tflops_fp8 if dtype == "fp8" else topo.gpu_tflops
            fits[dtype] = f = fit(tab, peak, topo.gpu_mem_bandwidth_GBps)
            f["source"] = tab.source
            rows.append((system, dtype, f))
        ratio = fits["fp8"]["large_tflops"] / fits["bf16"]["large_tflops"] if len(fits) == 2 else 0.0
        for g in gpus:
            out.append(f"[{g}]")
            for dtype, f in fits.items():
                out.append(f"{dtype} = {{ compute_efficiency = {f['compute_efficiency']:.4f}, half_rows = "
                           f"{f['half_rows']:.2f}, mem_efficiency = {f['mem_efficiency']:.4f} }}")
            out.append(f"fp8_over_bf16 = {ratio:.4f}")
            out.append(f'source = "FITTED on {system} tables ({", ".join(f["source"] for f in fits.values())})'
                       f'{"; H800: the H100 die" if g == "h800" else ""}"')
            out.append("")
    head = ["# The step roofline's GEMM constants FITTED on AIConfigurator's measured GEMM tables",
            "# (benchmarks/fit_roofline.py; aiconfigurator-core 0.12.0, Apache-2.0): per GPU and dtype, the",
            "# large-GEMM efficiency over the preset's peak, the rows at half that rate, the HBM efficiency of a",
            "# weight-bound GEMM, and the measured FP8 / BF16 rate at large shapes.", ""]
    (HERE.parent / "moonep_sim" / "data" / "roofline-fits.toml").write_text("\n".join(head + out))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    L = ["# The roofline's GEMM constants, fitted on the measured tables", "",
         f"Date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit `{commit}`, command "
         "`python benchmarks/fit_roofline.py`.", "",
         "`t = max(2mnk / (peak x e x m/(m+h)), bytes / (HBM x b))` fitted by least squares on log t over every "
         "point with n, k >= 1024 of each table. These are FITTED on AIConfigurator's tables (the step uses the "
         "tables themselves where the package is installed, and these constants where it is not).", "",
         "| GPU table | dtype | e | h (rows) | b | fit median abs error | p90 | points | measured TFLOP/s at "
         "m, n, k >= 4096 |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, dtype, f in rows:
        L.append(f"| {system} | {dtype} | {f['compute_efficiency']:.3f} | {f['half_rows']:.0f} | "
                 f"{f['mem_efficiency']:.3f} | {f['median_abs_error']:.1%} | {f['p90_abs_error']:.1%} | "
                 f"{f['points']:,} | {f['large_tflops']:.0f} |")
        print(system, dtype, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in f.items() if k != "source"})
    (HERE.parent / "docs" / "results" / "roofline-fits.md").write_text("\n".join(L) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
