"""The named records the samplers' kernels (:mod:`moonep_sim.routing.sampling_kernels`) take, built
from the samplers' state (``sampling._Races``, ``InverseCDF``): a kernel reads a few of these
instead of two dozen positional arrays and flags.

Notation as in :mod:`moonep_sim.routing.sampling`: N rows (tokens, or token-group races), K
positions, E experts, M guide buckets.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Icdf(NamedTuple):
    """An ``InverseCDF``'s tables as the kernels read them (its ``record``): the cumulative
    popularity ``cum`` [E], the guide table [M + 1] of M buckets, the widest bucket's width, the
    bisection steps it needs, and whether buckets are walked (``linear``) rather than bisected."""

    cum: np.ndarray
    guide: np.ndarray
    M: int
    width: int
    steps: int
    linear: bool


class RowSpan(NamedTuple):
    """The experts each row races: row r's ``[first[r], first[r] + n)``, its cumulative start
    ``base[r]`` and mass ``span[r]``; ``grouped``: rows race a group each (else every row all E,
    and first, base, span are not read)."""

    first: np.ndarray
    base: np.ndarray
    span: np.ndarray
    n: int
    grouped: bool


class RaceRows(NamedTuple):
    """Every row's race so far, token by token: its experts in arrival order ``ids_NK``, their
    arrival times ``tau_NK``, its popularity not yet chosen ``left``."""

    ids_NK: np.ndarray
    tau_NK: np.ndarray
    left: np.ndarray


class Tally(NamedTuple):
    """How a settled draw is booked: the popularity ``p`` [E] taken off the row's ``left`` when
    ``update_left``; ``counts[e] += 1`` when ``count``."""

    p: np.ndarray
    update_left: bool
    counts: np.ndarray
    count: bool


class Stopped(NamedTuple):
    """Pass 1's stopped rows, one slot each (ascending rows): ``rows2`` the row, ``stop2`` its first
    event, ``left2`` its popularity left, ``ids2`` / ``tau2`` its arrivals so far, ``x2`` / ``e2``
    its exponentials and experts drawn (position-major)."""

    rows2: np.ndarray
    stop2: np.ndarray
    left2: np.ndarray
    ids2: np.ndarray
    tau2: np.ndarray
    x2: np.ndarray
    e2: np.ndarray


__all__ = ["Icdf", "RaceRows", "RowSpan", "Stopped", "Tally"]
