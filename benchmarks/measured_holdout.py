"""Interpolation error of the measured GEMM tables on points held out of them.

Usage::

    python benchmarks/measured_holdout.py            # writes docs/results/measured-tables.md

For every GPU AIConfigurator has a GEMM table for (``moonep_sim.step.measured``) and both dtypes,
every 7th interior m of the (m, n, k) grid is held out and interpolated from its neighbours in m
(linear in log m, log t: the interpolation the step uses, here across a gap twice the table's own
spacing, so an upper bound of its error inside the grid). Needs ``aiconfigurator-core``.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from moonep_sim.step.measured import SYSTEMS, available, gemm_table  # noqa: E402


def main() -> int:
    if not available():
        print("moonep-sim: error: aiconfigurator-core must be installed: pip install 'moonep-sim[measured]'",
              file=sys.stderr)
        return 2
    rows = []
    for system in sorted({s for s, how in SYSTEMS.values() if how == "own"}):
        for dtype in ("bf16", "fp8"):
            tab = gemm_table(system, dtype)
            if tab is None:
                continue
            h = tab.held_out()
            rows.append((system, dtype, tab.source, h))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    load = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    L = ["# Measured GEMM tables: interpolation error on held-out points", "",
         f"Date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit `{commit}`, command "
         f"`python benchmarks/measured_holdout.py`, load average {' '.join(load)}.", "",
         "Every 7th interior m of each table's (m, n, k) grid held out and interpolated from the m either side "
         "(linear in log m, log t, across twice the table's spacing: an upper bound of the step's in-grid "
         "error). Sources: `aiconfigurator-core` 0.12.0 (Apache-2.0).", "",
         "| GPU table | dtype | kernel (backend/version) | held-out points | median abs error | p90 | max |",
         "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for system, dtype, src, h in rows:
        L.append(f"| {system} | {dtype} | {src.split(' ', 1)[1]} | {h['points']:,} | {h['median_abs']:.1%} | "
                 f"{h['p90_abs']:.1%} | {h['max_abs']:.1%} |")
        print(f"{system:10s} {dtype:5s} median {h['median_abs']:.1%} p90 {h['p90_abs']:.1%} ({h['points']} points)")
    out = HERE.parent / "docs" / "results" / "measured-tables.md"
    out.write_text("\n".join(L) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
