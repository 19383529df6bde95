"""Max-min fair rates of flows over ports by per-flow progressive filling (:func:`waterfill`).

The network's general solver, used when a path is not its sender's ports followed by its
receiver's (half-duplex pair ports: the CPU gloo presets); otherwise the block solver
(``moonep_sim.sim.blocks``) gives the same rates from per-pair counts. Notation and units:
``moonep_sim.sim.ports``.
"""

from __future__ import annotations

import numpy as np


def waterfill(path_FL: np.ndarray, cap_P: np.ndarray, tol: float = 0.0) -> tuple[np.ndarray, np.ndarray, int]:
    """Max-min fair rates of flows over ports (progressive filling, vectorised).

    path_FL: int64 [F, L] port indices; the last port of ``cap_P`` is a dummy of infinite capacity.
    cap_P: float64 [P+1] capacities (bytes/us).  tol: ports whose fair share lies within ``tol``
    (relative) of the current bottleneck freeze with it (0 = exact).
    Returns (rate_F, bottleneck_port_F, iterations). Every flow must cross a real port.
    """
    F = path_FL.shape[0]
    P1 = cap_P.size
    rate = np.zeros(F)
    bneck = np.full(F, -1, dtype=np.int64)
    if F == 0:
        return rate, bneck, 0
    cap = cap_P.astype(np.float64).copy()
    idx = np.arange(F)
    used = (path_FL != P1 - 1).any(axis=0)
    p = path_FL[:, : int(np.flatnonzero(used).max()) + 1] if used.any() else path_FL
    level = 0.0
    it = 0
    while idx.size:
        it += 1
        n = np.bincount(p.ravel(), minlength=P1).astype(np.float64)
        n[-1] = 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(n > 0, cap / n, np.inf)
        inc = float(share.min())
        if not np.isfinite(inc):  # pragma: no cover - every path has a real port
            raise RuntimeError("flows without a finite-capacity port")
        sat = share <= inc + tol * (level + inc) + 1e-12 * (level + inc)
        level += inc
        cap -= inc * n
        hit = sat[p]
        frozen = hit.any(axis=1)
        fi = idx[frozen]
        rate[fi] = level
        pf = p[frozen]
        # name the most contended saturated port of each flow (ties: first on the path)
        score = np.where(hit[frozen], n[pf], -1.0)
        bneck[fi] = pf[np.arange(fi.size), score.argmax(axis=1)]
        keep = ~frozen
        idx = idx[keep]
        p = p[keep]
    return rate, bneck, it


__all__ = ["waterfill"]
