"""Fit the host-proxy transports' per-call cost and throughput on development row 2, with leave-one-out.

Usage::

    python benchmarks/fit_host_proxy.py             # fit, check, write docs/results/host-proxy-fit.md
    python benchmarks/fit_host_proxy.py --no-write  # print only

Row 2 of ``../shared/ANCHORS.md`` (Qwen3-30B-A3B, Megatron-Bridge, 64 H100 on p5.48xlarge, EFA)
times NCCL all-to-all, DeepEP over NVSHMEM's libfabric proxy and DeepEP over UCCL-EP's proxies in
the same layouts. Each host-proxy kernel family (``deepep-nvshmem-efa``, ``uccl-ep``) gets two
constants, FITTED here and nowhere else (``moonep_sim.plan.kernel``): what the training step's host
pays per dispatch or combine call, ``proxy_call_us``, and the rate ``proxy_GBps`` at which it pays
for the call's inter-node bytes (``moonep_sim.sim.kernels.proxy_host_us``, charged on the step's
host timeline). The target is each transport's step time relative to NCCL all-to-all in the same
layout (published / published against predicted / predicted), so the fit is of the transport
alone, not of the step's absolute error (``docs/results/fidelity_steps.md``); the objective is the
sum of squared log errors of those ratios.

How: per layout the step is priced at (0, none), (A, none) and (0, G) -- the step's host timeline
is close to linear in ``proxy_call_us`` and in ``1 / proxy_GBps`` -- the constants minimising the
objective of that linear model are found on a mesh, and the step is priced again at them (the
"at the fit" column is that run, not the linear model). Leave-one-out by EP size: fitted on the
EP16 layouts and priced on EP32's, and the other way round (each priced by a run at its own fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import fidelity_steps as fs  # noqa: E402

import moonep_sim.plan.kernel as kernel_mod  # noqa: E402

#: Row 2's published mean iteration seconds: (EP, micro-batch, overlap) -> NCCL, UCCL, NVSHMEM.
PUB = {(16, 4, False): (8.60, 14.81, 9.16), (16, 1, False): (27.89, 37.23, 28.69), (16, 4, True): (6.87, 11.21, 7.08),
       (32, 4, False): (9.24, 26.51, 17.21), (32, 1, False): (27.14, 48.22, 34.66), (32, 4, True): (6.29, None, 11.37)}
TRANSPORTS = {"uccl-ep": 1, "deepep-nvshmem-efa": 2}
#: The probe points: A us per call; G GB/s.
PROBE_A_US, PROBE_G = 2000.0, 3.0


def _parallel(ep: int, mb: int, on: bool):
    from moonep_sim.step.parallel import Parallel

    pp, dp = (4, 2) if ep == 16 else (2, 4)
    return Parallel(tp=8, pp=pp, dp=dp, ep=ep, micro_batch_size=mb, global_batch_size=256, zero=1,
                    overlap_grad_reduce=on, **(dict(vpp=2, pp_schedule="interleaved") if on else {}))


def step_s(strategy: str, cell: tuple, impl: str | None = None) -> float:
    """Predicted step seconds of one row-2 layout, as ``fidelity_steps.row2`` prices it."""
    opts = {"deepep": {"impl": impl, "sms": 20}} if impl else {}
    f = fs._step("qwen3-30b-a3b", "h100-efa", strategy, 64, _parallel(*cell), "qwen3-30b-a3b", opts)
    return f[strategy]["step_time_us"] / 1e6


def priced(impl: str, cells: list, a_us: float, g: float) -> list[float]:
    """``impl``'s step seconds on ``cells`` with ``proxy_call_us = a_us`` and ``proxy_GBps = g``."""
    base = kernel_mod.FAMILIES[impl]
    kernel_mod.FAMILIES[impl] = dataclasses.replace(base, proxy_call_us=a_us, proxy_GBps=g)
    try:
        return [step_s("deepep", c, impl) for c in cells]
    finally:
        kernel_mod.FAMILIES[impl] = base


def _inv(g: float) -> float:
    return 1.0 / g if g > 0 else 0.0


def fit(lin: dict, cells: list, target: dict) -> tuple[float, float]:
    """(``proxy_call_us``, ``proxy_GBps``) minimising the squared log errors of the linear model
    ``lin[c] = (t0, dt/da, dt/ds)`` (s = 1 / GBps) against ``target[c]`` (seconds) over ``cells``."""
    a = np.linspace(0.0, 6000.0, 601)[:, None, None]
    s = np.linspace(0.0, 2.0, 801)[None, :, None]
    t0, da, ds = (np.array([lin[c][i] for c in cells])[None, None, :] for i in range(3))
    tgt = np.array([target[c] for c in cells])[None, None, :]
    err = (np.log(np.maximum(t0 + da * a + ds * s, 1e-9) / tgt) ** 2).sum(axis=2)
    i, j = np.unravel_index(int(np.argmin(err)), err.shape)
    a_fit, s_fit = float(a[i, 0, 0]), float(s[0, j, 0])
    return a_fit, (1.0 / s_fit if s_fit > 0 else 0.0)


def run(log=print) -> list[str]:
    cells = list(PUB)
    nccl = {}
    for c in cells:
        nccl[c] = step_s("alltoall", c)
    log(f"NCCL all-to-all priced: {[round(nccl[c], 3) for c in cells]}")
    lines = []
    results = {}
    for impl, col in TRANSPORTS.items():
        have = [c for c in cells if PUB[c][col] is not None]
        # the published ratio to NCCL, applied to the predicted NCCL step: the seconds to reach
        target = {c: nccl[c] * PUB[c][col] / PUB[c][0] for c in have}
        t0 = priced(impl, have, 0.0, 0.0)
        ta = priced(impl, have, PROBE_A_US, 0.0)
        tg = priced(impl, have, 0.0, PROBE_G)
        lin = {c: (t0[i], (ta[i] - t0[i]) / PROBE_A_US, (tg[i] - t0[i]) / _inv(PROBE_G)) for i, c in enumerate(have)}
        log(f"{impl}: probes done")
        a_fit, g_fit = fit(lin, have, target)
        at_fit = dict(zip(have, priced(impl, have, a_fit, g_fit)))
        loo = {}
        for train_ep, test_ep in ((16, 32), (32, 16)):
            tr, te = [c for c in have if c[0] == train_ep], [c for c in have if c[0] == test_ep]
            a_i, g_i = fit(lin, tr, target)
            for c, v in zip(te, priced(impl, te, a_i, g_i)):
                loo[c] = (a_i, g_i, v)
        log(f"{impl}: fitted {a_fit:g} us per call, {g_fit:.3g} GB/s")
        results[impl] = (a_fit, g_fit, at_fit, loo, t0)
    lines += [f"Fitted on row 2 (every published layout of each transport): "
              + "; ".join(f"**{impl}**: `proxy_call_us` = {r[0]:g} us, `proxy_GBps` = {r[1]:.3g} GB/s"
                          for impl, r in results.items()) + ".", "",
              "Step time relative to NCCL all-to-all in the same layout (published / published; predicted / "
              "predicted). 'none': the families' code-derived pricing alone (both constants 0); 'at the fit': "
              "priced again at the fitted constants (in-sample); 'leave-one-out': fitted on the other EP size's "
              "layouts only, priced here (out of sample).", "",
              "| transport | layout | published | none | error | at the fit (in-sample) | error | leave-one-out fit | "
              "leave-one-out | error |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    summary = {}
    for impl, (a_fit, g_fit, at_fit, loo, t0) in results.items():
        col = TRANSPORTS[impl]
        errs_in, errs_loo = [], []
        for i, c in enumerate(at_fit):
            pub_r = PUB[c][col] / PUB[c][0]
            r0, rf = t0[i] / nccl[c], at_fit[c] / nccl[c]
            a_i, g_i, v = loo[c]
            rl = v / nccl[c]
            errs_in.append(rf / pub_r - 1)
            errs_loo.append(rl / pub_r - 1)
            lines.append(f"| {impl} | EP{c[0]} mb{c[1]} overlap {'on' if c[2] else 'off'} | {pub_r - 1:+.1%} | "
                         f"{r0 - 1:+.1%} | {r0 / pub_r - 1:+.1%} | {rf - 1:+.1%} | {rf / pub_r - 1:+.1%} | "
                         f"{a_i:g} us, {g_i:.3g} GB/s | {rl - 1:+.1%} | {rl / pub_r - 1:+.1%} |")
        summary[impl] = (errs_in, errs_loo)
    lines.append("")
    for impl, (ei, el) in summary.items():
        lines.append(f"- {impl}: median absolute error of the ratio in-sample {np.median(np.abs(ei)):.1%} (worst "
                     f"{max(ei, key=abs):+.1%}), leave-one-out {np.median(np.abs(el)):.1%} (worst {max(el, key=abs):+.1%}).")
    order = []
    for c in cells:
        u = results["uccl-ep"][2].get(c)
        n = results["deepep-nvshmem-efa"][2][c]
        ok = nccl[c] < n and (u is None or n < u)
        order.append(ok)
        lines.append(f"- EP{c[0]} mb{c[1]} overlap {'on' if c[2] else 'off'}: NCCL {nccl[c]:.3f} s, NVSHMEM {n:.3f} s"
                     + (f", UCCL {u:.3f} s" if u is not None else " (UCCL preempted)") + f": published order "
                     f"{'holds' if ok else 'DOES NOT hold'} (in-sample)")
    return lines


def per_layer() -> list[str]:
    """The kernels alone against the same images' per-layer rows on p5.48xlarge, simulated as DeepEP's
    internode test measures them, at each family's own chunk table and swept over the test's chunk
    grid as the published figure is (``benchmarks/fidelity_efa.py``, docs/results/fidelity-efa.md).
    The fitted host terms do not enter (an isolated kernel has no host timeline)."""
    import fidelity_efa

    return fidelity_efa.table()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only (no docs/results/host-proxy-fit.md)")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    t0, load0 = time.perf_counter(), os.getloadavg()
    lines = run(lambda m: print(m, file=sys.stderr, flush=True))
    lines += ["", "## The kernels alone against the same images' per-layer figures (p5.48xlarge)", "",
              per_layer.__doc__.split("\n\n")[0].replace("\n    ", " "), ""] + per_layer()
    print("\n".join(lines))
    if not args.no_write:
        head = fs.page_head("Host-proxy transports' per-call cost and throughput, fitted on development row 2",
                            "python benchmarks/fit_host_proxy.py", t0, load0, commit) + [
                "- what is fitted and why: `docs/results/host-proxies.md`; the method: this script's docstring", ""]
        (ROOT / "docs" / "results" / "host-proxy-fit.md").write_text("\n".join(head + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
