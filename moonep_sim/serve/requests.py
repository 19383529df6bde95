"""Requests a serving simulation runs: arrival times and lengths, as numpy arrays.

Notation: N requests. Times in seconds from the start of the run; lengths in tokens.

- :func:`poisson_arrivals` / :func:`gamma_arrivals`: open-loop arrivals at a rate (requests/s);
  gamma with a coefficient of variation ``cv`` (1 = Poisson; > 1 burstier).
- a closed loop at a concurrency (benchmark clients: each sends its next request when the last
  finishes) is the engine's (``Requests.closed``: arrival times are set as clients issue them).
- :func:`read_request_trace`: a JSONL request trace, one request per line, either this project's
  form ``{"arrival_s": .., "input_len": .., "output_len": .., "prefix_hit": ..}`` or the Mooncake
  trace form ``{"timestamp": ms, "input_length": .., "output_length": .., "hash_ids": [..]}``
  (its prefix hit: the tokens of hash blocks a previous request already sent, 512 tokens a block
  as Mooncake's trace defines them).
- :func:`lengths`: fixed or distributed input/output lengths (``1024``, ``uniform:512:2048``,
  ``lognormal:MEAN:SIGMA``, ``exp:MEAN``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moonep_sim.errors import ConfigError, require

#: tokens of one Mooncake trace hash block (the trace's published block size)
MOONCAKE_BLOCK_TOKENS = 512
#: the most requests one run takes (the arrays stay small next to the token-steps they drive)
MAX_REQUESTS = 5_000_000


@dataclass(frozen=True)
class Requests:
    """N requests: ``arrival_s_N`` (sorted; ignored when ``closed`` > 0), ``input_N``, ``output_N``
    (>= 1 each), ``hit_N`` (prompt tokens already in a prefix cache, < input), ``closed``: clients
    of a closed loop (0: open loop), ``source``: how they were made."""

    arrival_s_N: np.ndarray
    input_N: np.ndarray
    output_N: np.ndarray
    hit_N: np.ndarray
    closed: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        n = len(self.input_N)
        require(1 <= n <= MAX_REQUESTS, f"requests ({n}) must be in [1, {MAX_REQUESTS}]")
        for name in ("arrival_s_N", "output_N", "hit_N"):
            require(len(getattr(self, name)) == n, f"requests {name} ({len(getattr(self, name))}) must have {n} rows")
        require(bool(np.all(np.isfinite(self.arrival_s_N))) and bool(np.all(self.arrival_s_N >= 0)),
                f"request arrival times ({self.source}) must be finite and >= 0")
        require(bool(np.all(np.diff(self.arrival_s_N) >= 0)), f"request arrival times ({self.source}) must be sorted")
        require(int(self.input_N.min()) >= 1, f"request input length ({int(self.input_N.min())}, {self.source}) "
                                              "must be >= 1")
        require(int(self.output_N.min()) >= 1, f"request output length ({int(self.output_N.min())}, "
                                               f"{self.source}) must be >= 1")
        require(int(self.hit_N.min()) >= 0 and bool(np.all(self.hit_N < self.input_N)),
                f"request prefix hit ({self.source}) must be in [0, input length)")
        require(self.closed >= 0, f"closed-loop concurrency ({self.closed}) must be >= 0")

    @property
    def n(self) -> int:
        return len(self.input_N)


def lengths(spec: str | int, n: int, rng: np.random.Generator, what: str = "--isl") -> np.ndarray:
    """``n`` lengths (int64, >= 1) from ``spec``: an integer, ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA``
    (the mean of the lengths; sigma of the log) or ``exp:MEAN``."""
    s = str(spec).strip()
    parts = s.split(":")
    try:
        v = int(parts[0]) if len(parts) == 1 else 0
        kind, args = parts[0], [float(a) for a in parts[1:]]
    except ValueError:
        raise ConfigError(f"{what} ({s!r}) must be an integer, uniform:LO:HI, lognormal:MEAN:SIGMA or exp:MEAN") from None
    from moonep_sim.limits import MAX_CONTEXT

    if len(parts) == 1:
        require(1 <= v <= MAX_CONTEXT, f"{what} ({s}) must be >= 1 token and at most {MAX_CONTEXT}")
        return np.full(n, v, np.int64)
    require(all(np.isfinite(a) and a <= MAX_CONTEXT for a in args),
            f"{what} ({s}) must give finite lengths of at most {MAX_CONTEXT} tokens")
    if kind == "uniform" and len(args) == 2:
        lo, hi = args
        require(1 <= lo <= hi, f"{what} ({s}) must have 1 <= LO <= HI")
        return rng.integers(int(lo), int(hi) + 1, n).astype(np.int64)
    if kind == "lognormal" and len(args) == 2:
        mean, sig = args
        require(mean >= 1 and sig >= 0, f"{what} ({s}) must have MEAN >= 1 and SIGMA >= 0")
        x = rng.lognormal(np.log(mean) - sig * sig / 2, sig, n)
        return np.maximum(np.rint(x), 1).astype(np.int64)
    if kind == "exp" and len(args) == 1:
        require(args[0] >= 1, f"{what} ({s}) must have MEAN >= 1")
        return np.maximum(np.rint(rng.exponential(args[0], n)), 1).astype(np.int64)
    raise ConfigError(f"{what} ({s!r}) must be an integer, uniform:LO:HI, lognormal:MEAN:SIGMA or exp:MEAN")


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times (s) of a Poisson process at ``rate`` requests/s, the first at its first gap."""
    return gamma_arrivals(rate, n, rng, cv=1.0)


def gamma_arrivals(rate: float, n: int, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """``n`` arrival times (s) whose gaps are gamma with mean ``1/rate`` and coefficient of variation
    ``cv`` (shape ``1/cv^2``; 1 = exponential gaps, Poisson)."""
    require(np.isfinite(rate) and rate > 0, f"rate ({rate}) must be > 0 requests/s")
    require(np.isfinite(cv) and cv > 0, f"arrival cv ({cv}) must be > 0")
    k = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(k, 1.0 / (k * rate), n))


def synthetic(n: int, isl: str | int, osl: str | int, seed: int = 0, *, rate: float | None = None,
              cv: float = 1.0, concurrency: int = 0, hit: float = 0.0) -> Requests:
    """``n`` requests of ``isl`` / ``osl`` lengths (:func:`lengths`), open-loop at ``rate`` (gamma
    gaps of ``cv``) or a closed loop of ``concurrency`` clients; ``hit``: the prefix-cached share of
    each prompt (0..1)."""
    require(n >= 1, f"requests ({n}) must be >= 1")
    require((rate is None) != (concurrency <= 0), "exactly one of --rate and --concurrency must be given")
    require(0.0 <= hit < 1.0, f"prefix hit ({hit}) must be in [0, 1)")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 33]))
    i, o = lengths(isl, n, rng, "--isl"), lengths(osl, n, rng, "--osl")
    arr = gamma_arrivals(rate, n, rng, cv) if rate is not None else np.zeros(n)
    h = np.minimum((i * hit).astype(np.int64), i - 1)
    how = f"{n} requests, isl {isl}, osl {osl}, " + (f"rate {rate:g}/s (cv {cv:g})" if rate is not None
                                                        else f"closed loop of {concurrency}")
    return Requests(arr, i, o, h, max(int(concurrency), 0), how)


def read_request_trace(path: str | Path, limit: int | None = None) -> Requests:
    """A JSONL request trace (see the module docstring); every bad line is one error naming its line."""
    p = Path(path)
    require(p.is_file(), f"request trace ({p}) must be a readable file")
    arr, inp, out, hit = [], [], [], []
    seen: set = set()
    with p.open("r", encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(arr) >= limit:
                break
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"request trace ({p}:{ln}) must be one JSON object a line: {e.msg}") from None
            require(isinstance(d, dict), f"request trace ({p}:{ln}) must be one JSON object a line")
            try:
                if "timestamp" in d:      # Mooncake: milliseconds, hash blocks of 512 tokens
                    t = float(d["timestamp"]) / 1e3
                    i, o = int(d["input_length"]), int(d["output_length"])
                    hs = list(d.get("hash_ids") or [])
                    shared = 0
                    for h in hs:
                        if h not in seen:
                            break
                        shared += 1
                    seen.update(hs)
                    h_tok = min(shared * MOONCAKE_BLOCK_TOKENS, i - 1)
                else:
                    t, i, o = float(d["arrival_s"]), int(d["input_len"]), int(d["output_len"])
                    h_tok = int(d.get("prefix_hit", 0))
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"request trace ({p}:{ln}) must have arrival_s, input_len, output_len "
                                  f"(or Mooncake's timestamp, input_length, output_length): {e!r}") from None
            require(np.isfinite(t) and t >= 0, f"request trace arrival ({t}, {p}:{ln}) must be finite and >= 0")
            if arr and t < arr[-1]:
                raise ConfigError(f"request trace arrival ({t:g} s, {p}:{ln}) must not be before the previous "
                                  f"line's ({arr[-1]:g} s): times must be sorted")
            require(i >= 1 and o >= 1, f"request trace lengths (input {i}, output {o}, {p}:{ln}) must be >= 1")
            require(0 <= h_tok < i, f"request trace prefix hit ({h_tok}, {p}:{ln}) must be in [0, input length {i})")
            arr.append(t)
            inp.append(i)
            out.append(o)
            hit.append(h_tok)
    require(len(arr) >= 1, f"request trace ({p}) must hold at least one request")
    a = np.asarray(arr, float)
    return Requests(a - a[0], np.asarray(inp, np.int64), np.asarray(out, np.int64), np.asarray(hit, np.int64),
                    0, f"request trace {p.name} ({len(arr)} requests)")


__all__ = ["MOONCAKE_BLOCK_TOKENS", "Requests", "gamma_arrivals", "lengths", "poisson_arrivals",
           "read_request_trace", "synthetic"]
