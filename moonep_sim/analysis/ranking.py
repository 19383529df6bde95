"""Do simulated and measured times rank the strategies alike?

Measured times on a shared machine carry noise: two strategies a few percent apart swap places
from run to run. So an order is only *measured* where the measurements resolve it. With the
replay's interleaved samples (``--strategy a,b,...``: iteration i runs every strategy moments
apart), each pair of strategies has matched samples ``a_i, b_i``, and an exact two-sided sign
test on ``a_i - b_i`` (``scipy.stats.binomtest``) asks whether either strategy is as likely to be
faster. A case compares many pairs at once (21 for 7 strategies), so at level 0.05 about one tied
pair in twenty would look resolved by chance; Holm's step-down procedure keeps the chance of even
one such false resolution in a case below ``alpha`` (default 0.05): the pairs' p-values sorted
ascending, the i-th (from 0) must be below ``alpha / (m - i)``, stopping at the first that is not.
Those pairs are **resolved** (with 16 matched iterations: one strategy faster in at least 15 of
16 for the first). The simulator agrees with the measured order when, for every resolved pair, it
puts the same strategy first. Unresolved pairs (measured ties) constrain nothing; they are
reported, with the pairs that would be resolved without the correction.

Also reported, for every case: the exact order of the medians (measured and simulated), whether
they are identical, and Kendall's tau-a between them -- strict figures that count measured ties
as orders.
"""

from __future__ import annotations

import itertools
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
    from scipy.stats import binomtest

    d = np.asarray(diffs, dtype=np.float64)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    if pos + neg == 0:
        return 1.0
    return float(binomtest(pos, pos + neg, 0.5).pvalue)


def holm(pvalues: Sequence[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected with family-wise error <= alpha."""
    m = len(pvalues)
    out = [False] * m
    for i, j in enumerate(sorted(range(m), key=lambda j: pvalues[j])):
        if pvalues[j] >= alpha / (m - i):
            break
        out[j] = True
    return out


def resolved_pairs(samples: Mapping[str, Sequence[float]], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Every pair of strategies with matched samples: which is faster by the median of the paired
    differences, the sign test's p-value, whether the pair is resolved (Holm over all the pairs at
    ``alpha``) and whether it would be without the correction (p < alpha)."""
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
        out.append({"faster": fast, "slower": slow, "p": p, "resolved_uncorrected": p < alpha,
                    "median_gap": abs(med) / base if base > 0 else 0.0})
    for pair, ok in zip(out, holm([q["p"] for q in out], alpha)):
        pair["resolved"] = ok
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
    loose = [p for p in pairs if p["resolved_uncorrected"]]
    loose_wrong = [p for p in loose if not p["simulated_agrees"]]
    return {
        "measured_order": order(names, med), "simulated_order": order(names, sim),
        "measured_order_text": order_text(names, med, pairs),
        "same_order": order(names, med) == order(names, sim), "kendall_tau": kendall_tau(med, sim),
        "pairs": len(pairs), "resolved_pairs": len(res), "resolved_agree": len(res) - len(wrong),
        "disagreements": [f"{p['faster']} < {p['slower']} measured (p={p['p']:.3f}, "
                          f"{p['median_gap']:.1%} apart), simulated the other way" for p in wrong],
        "agrees": not wrong, "alpha": alpha,
        "resolved": [f"{p['faster']} < {p['slower']}" for p in res],
        "uncorrected_pairs": len(loose), "uncorrected_agree": len(loose) - len(loose_wrong),
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


__all__ = ["ALPHA", "agreement", "holm", "kendall_tau", "order", "order_text", "resolved_pairs", "sign_test_p"]
