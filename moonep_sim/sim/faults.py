"""Stragglers and faults: inputs of a simulation, all deterministic given the seed.

Factors are *speed* factors: 1 = nominal, 0.5 = half speed / half bandwidth.

- :class:`SlowGPU` ``(rank, factor)``: the rank's expert compute runs at ``factor`` speed.
- :class:`DegradedLink` ``(rank, factor, link)``: the rank's NIC (``link="nic"``) or NVLink port
  (``"nvlink"``), both directions, carries ``factor`` of its bandwidth.
- :class:`Stall` ``(rank, us, phase)``: the rank waits ``us`` microseconds before it starts
  ``phase`` (``dispatch``, ``compute`` or ``combine``).
- jitter (``SimOptions.jitter``): every compute and every transfer is stretched by an independent
  lognormal factor of mean 1 and coefficient of variation ``cv``, drawn from ``seed``.

CLI spellings: ``--slow-gpu RANK:FACTOR``, ``--degrade-nic RANK:FACTOR``,
``--degrade-nvlink RANK:FACTOR``, ``--stall RANK:US[:PHASE]``, ``--jitter CV --seed N``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from moonep_sim.errors import ConfigError, require
from moonep_sim.limits import MAX_STALL_US

STALL_PHASES = ("dispatch", "compute", "combine")
LINKS = ("nic", "nvlink")


@dataclass(frozen=True)
class SlowGPU:
    rank: int
    factor: float

    def __post_init__(self) -> None:
        require(self.rank >= 0, f"slow GPU rank ({self.rank}) must be >= 0")
        require(0 < self.factor < float("inf"),
                f"slow GPU factor ({self.factor}) must be finite and > 0: a speed factor, 0.5 = half speed")


@dataclass(frozen=True)
class DegradedLink:
    rank: int
    factor: float
    link: str = "nic"

    def __post_init__(self) -> None:
        require(self.rank >= 0, f"degraded link rank ({self.rank}) must be >= 0")
        require(self.link in LINKS, f"link ({self.link!r}) must be one of {LINKS}")
        require(0 < self.factor <= 1, f"degraded {self.link} factor ({self.factor}) must lie in (0, 1]: "
                                      "the fraction of bandwidth left")


@dataclass(frozen=True)
class Stall:
    rank: int
    us: float
    phase: str = "compute"

    def __post_init__(self) -> None:
        require(self.rank >= 0, f"stall rank ({self.rank}) must be >= 0")
        require(0 <= self.us <= MAX_STALL_US, f"stall duration ({self.us}) must be in [0, {MAX_STALL_US:g}] microseconds")
        require(self.phase in STALL_PHASES, f"stall phase ({self.phase!r}) must be one of {STALL_PHASES}")


Fault = SlowGPU | DegradedLink | Stall


def _split(text: str, flag: str, n_min: int, n_max: int) -> list[str]:
    parts = text.split(":")
    require(n_min <= len(parts) <= n_max,
            f"{flag} ({text!r}) must look like RANK:VALUE" + (":PHASE" if n_max > 2 else ""))
    return parts


def _num(s: str, flag: str, text: str, typ=float):
    try:
        return typ(s)
    except ValueError:
        raise ConfigError(f"{flag} ({text!r}) must hold numbers: {s!r} is not a {typ.__name__}") from None


def parse_faults(slow_gpu=(), degrade_nic=(), degrade_nvlink=(), stall=()) -> list[Fault]:
    """Faults from CLI strings (``RANK:FACTOR`` and ``RANK:US[:PHASE]``)."""
    out: list[Fault] = []
    for t in slow_gpu or ():
        r, f = _split(t, "--slow-gpu", 2, 2)
        out.append(SlowGPU(_num(r, "--slow-gpu", t, int), _num(f, "--slow-gpu", t)))
    for flag, link, items in (("--degrade-nic", "nic", degrade_nic), ("--degrade-nvlink", "nvlink", degrade_nvlink)):
        for t in items or ():
            r, f = _split(t, flag, 2, 2)
            out.append(DegradedLink(_num(r, flag, t, int), _num(f, flag, t), link))
    for t in stall or ():
        p = _split(t, "--stall", 2, 3)
        out.append(Stall(_num(p[0], "--stall", t, int), _num(p[1], "--stall", t), p[2] if len(p) > 2 else "compute"))
    return out


class StallKey(NamedTuple):
    """Which stall: rank ``rank`` before ``phase`` (one of ``STALL_PHASES``)."""

    rank: int
    phase: str


@dataclass(frozen=True)
class FaultState:
    """Faults resolved for R ranks: per-rank factors and the stalls' total us per :class:`StallKey`."""

    gpu_speed_R: np.ndarray
    nic_factor_R: np.ndarray
    nvlink_factor_R: np.ndarray
    stall_us: dict[StallKey, float]

    @classmethod
    def build(cls, faults, ranks: int) -> "FaultState":
        gpu, nic, nvl = np.ones(ranks), np.ones(ranks), np.ones(ranks)
        stalls: dict[StallKey, float] = {}
        for f in faults or ():
            require(f.rank < ranks, f"fault rank ({f.rank}) must be < ranks ({ranks}): {f}")
            if isinstance(f, SlowGPU):
                gpu[f.rank] *= f.factor
            elif isinstance(f, DegradedLink):
                (nic if f.link == "nic" else nvl)[f.rank] *= f.factor
            elif isinstance(f, Stall):
                key = StallKey(f.rank, f.phase)
                stalls[key] = stalls.get(key, 0.0) + f.us
            else:
                raise ConfigError(f"fault ({f!r}) must be a SlowGPU, DegradedLink or Stall")
        return cls(gpu, nic, nvl, stalls)


def lognormal_factors(rng: np.random.Generator, cv: float, shape) -> np.ndarray:
    """Lognormal draws of mean 1 and coefficient of variation ``cv`` (all ones when cv == 0)."""
    if cv <= 0:
        return np.ones(shape)
    s2 = np.log1p(cv * cv)
    return rng.lognormal(-s2 / 2, np.sqrt(s2), shape)


__all__ = ["DegradedLink", "Fault", "FaultState", "SlowGPU", "Stall", "StallKey", "lognormal_factors", "parse_faults"]
