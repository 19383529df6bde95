"""Do simulated and measured times rank the strategies alike?

Measured times on a shared machine carry noise: two strategies a few percent apart swap places
from run to run. So an order is only *measured* where the measurements resolve it. With the
replay's interleaved samples (``--strategy a,b,...``: iteration i runs every strategy moments
apart), each pair of strategies has matched samples ``a_i, b_i``; the pair is **resolved** when
an exact two-sided sign test on ``a_i - b_i`` rejects "either is as likely to be faster" at level
``alpha`` (default 0.05; e.g. at least 9 of 10 or 10 of 12 iterations favour one). The simulator
agrees with the measured order when, for every resolved pair, it puts the same strategy first.
Unresolved pairs (measured ties) constrain nothing; they are reported.

Also reported, for every case: the exact order of the medians (measured and simulated), whether
they are identical, and Kendall's tau-a between them -- strict figures that count measured ties
as orders.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping, Sequence

import numpy as np

from moonep_sim.errors import require

ALPHA = 0.05


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a between two equally long sequences (1 = same order, -1 = reversed)."""
    n = len(a)
    require(n == len(b), f"kendall_tau sequences must be equally long ({n} vs {len(b)})")
    if n < 2:
        return 1.0
    s = sum(int(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])) for i, j in itertools.combinations(range(n), 2))
    return s / (n * (n - 1) / 2)


def order(names: Sequence[str], values: Sequence[float]) -> list[str]:
    """``names`` sorted by ``values`` (smallest first; ties keep the given order)."""
    return [names[i] for i in sorted(range(len(names)), key=lambda i: values[i])]


def sign_test_p(diffs: Sequence[float]) -> float:
    """Exact two-sided sign test: the probability, if each nonzero difference were as likely
    positive as negative, of a split at least as lopsided as observed (zeros dropped; 1.0 if none)."""
    d = np.asarray(diffs, dtype=np.float64)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    n = pos + neg
    if n == 0:
        return 1.0
    k = min(pos, neg)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def resolved_pairs(samples: Mapping[str, Sequence[float]], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Every pair of strategies with matched samples: which is faster by the median of the paired
    differences, the sign test's p-value and whether the pair is resolved (p < alpha)."""
    names = list(samples)
    out = []
    for a, b in itertools.combinations(names, 2):
        sa, sb = np.asarray(samples[a], np.float64), np.asarray(samples[b], np.float64)
        require(sa.size == sb.size and sa.size > 0,
                f"samples of {a} ({sa.size}) and {b} ({sb.size}) must be matched, equally many and not empty")
        d = sa - sb
        med = float(np.median(d))
        fast, slow = (a, b) if med < 0 or (med == 0 and np.median(sa) <= np.median(sb)) else (b, a)
        p = sign_test_p(d)
        base = float(np.median(samples[slow]))
        out.append({"faster": fast, "slower": slow, "p": p, "resolved": p < alpha,
                    "median_gap": abs(med) / base if base > 0 else 0.0})
    return out


def agreement(samples: Mapping[str, Sequence[float]], simulated: Mapping[str, float],
              alpha: float = ALPHA) -> dict[str, Any]:
    """Measured (matched samples per strategy) against simulated times (one per strategy)."""
    names = list(samples)
    require(set(names) == set(simulated), f"simulated strategies ({sorted(simulated)}) must be the measured ones "
                                          f"({sorted(names)})")
    med = [float(np.median(samples[n])) for n in names]
    sim = [float(simulated[n]) for n in names]
    pairs = resolved_pairs(samples, alpha)
    for p in pairs:
        p["simulated_agrees"] = simulated[p["faster"]] < simulated[p["slower"]]
    res = [p for p in pairs if p["resolved"]]
    wrong = [p for p in res if not p["simulated_agrees"]]
    return {
        "measured_order": order(names, med), "simulated_order": order(names, sim),
        "measured_order_text": order_text(names, med, pairs),
        "same_order": order(names, med) == order(names, sim), "kendall_tau": kendall_tau(med, sim),
        "pairs": len(pairs), "resolved_pairs": len(res), "resolved_agree": len(res) - len(wrong),
        "disagreements": [f"{p['faster']} < {p['slower']} measured (p={p['p']:.3f}, "
                          f"{p['median_gap']:.1%} apart), simulated the other way" for p in wrong],
        "agrees": not wrong, "alpha": alpha,
    }


def order_text(names: Sequence[str], values: Sequence[float], pairs: Sequence[Mapping[str, Any]]) -> str:
    """The measured order, fastest first, with ``<`` where a neighbouring pair is resolved and
    ``~`` where it is a measured tie, e.g. ``capacity ~ alltoall < moonep``."""
    ranked = order(names, values)
    res = {frozenset((p["faster"], p["slower"])) for p in pairs if p["resolved"]}
    text = ranked[0] if ranked else ""
    for a, b in zip(ranked, ranked[1:]):
        text += (" < " if frozenset((a, b)) in res else " ~ ") + b
    return text


__all__ = ["ALPHA", "agreement", "kendall_tau", "order", "order_text", "resolved_pairs", "sign_test_p"]
