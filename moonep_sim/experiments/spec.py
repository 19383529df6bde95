"""The one place that parses strategy names, strategy options, dtypes and id lists, and the typed
replay spec.

Every command, the Python API and the replay's rank program read strategies, ``--opt`` items and
dtype names through these functions, so a spelling accepted (or refused) by one is accepted (or
refused) by all.

:class:`ReplaySpec` is what a real replay runs: the strategies with their options, the layers, the
steps, the shapes and the iteration counts, written once as JSON (``ReplaySpec.write``) beside the
routing (a trace file by path; generated or in-memory routing written once as one safetensors
file) and read by every rank (``ReplaySpec.read``) -- no argv strings re-parsed by the ranks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from moonep_sim.errors import ConfigError, require
from moonep_sim.io import read_config_bytes, write_text_atomic

# -- clusters ----------------------------------------------------------------------------------------
def parse_cluster(cluster: Any) -> tuple[int | None, int | None]:
    """``8``, ``"8"``, ``"8/4"`` (ranks / GPUs per node), ``(8, 4)`` or a ClusterShape -> (R, G)."""
    if cluster is None:
        return None, None
    from moonep_sim.plan import ClusterShape

    if isinstance(cluster, ClusterShape):
        return cluster.ranks, cluster.gpus_per_node
    if isinstance(cluster, int):
        return cluster, None
    if isinstance(cluster, (tuple, list)):
        require(len(cluster) == 2, f"cluster ({cluster!r}) must be (ranks, gpus_per_node)")
        return int(cluster[0]), int(cluster[1]) or None
    text = str(cluster)
    r, sep, g = text.partition("/")
    try:
        return int(r), (int(g) if sep else None)
    except ValueError:
        raise ConfigError(f"cluster ({text!r}) must look like RANKS or RANKS/GPUS_PER_NODE, e.g. 16/8") from None


# -- id lists ----------------------------------------------------------------------------------------
def parse_int_list(text: str | None, what: str) -> list[int] | None:
    """``"0,2,5-7"`` -> ``[0, 2, 5, 6, 7]``; None stays None."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part[1:]:
                a, b = part.split("-", 1) if not part.startswith("-") else (part, part)
                lo, hi = int(a), int(b)
                if lo > hi:
                    raise ConfigError(f"{what} ({text!r}) must give ranges low-high: {part} runs backwards")
                if hi - lo >= 1 << 16:
                    raise ConfigError(f"{what} ({text!r}) must give ranges of at most 65536 values: {part}")
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ConfigError(f"{what} ({text!r}) must be a list of integers like 0,2,5-7") from None
    if not out:
        raise ConfigError(f"{what} ({text!r}) must name at least one integer, like 0,2,5-7")
    return out



# -- dtypes -------------------------------------------------------------------------------------------
#: canonical dtype name -> the spellings accepted for it
DTYPE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16", "bfloat16"),
    "fp8": ("fp8", "float8", "fp8_e4m3"),
    "fp32": ("fp32", "float32"),
    "fp64": ("fp64", "float64"),
}
#: the dtypes a simulated plan's rows may have (RowCosts.from_model)
DISPATCH_DTYPES = ("bf16", "fp8")
#: the dtypes a gloo replay's rows may have, and their torch names
REPLAY_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp64": "float64"}


def dtype_name(text: str, allowed: Sequence[str] = DISPATCH_DTYPES, what: str = "dispatch dtype") -> str:
    """Any accepted spelling -> its canonical name (``bfloat16`` -> ``bf16``), if in ``allowed``."""
    t = str(text).strip().lower()
    for canon, spellings in DTYPE_SPELLINGS.items():
        if t in spellings and canon in allowed:
            return canon
    accepted = ", ".join(s for c in allowed for s in DTYPE_SPELLINGS[c])
    raise ConfigError(f"{what} ({text!r}) must be one of {', '.join(allowed)} (accepted spellings: {accepted})")


def normalise_dtype(text: str) -> str:
    """``bf16`` / ``bfloat16`` -> ``bf16``; ``fp8`` -> ``fp8``; anything else is an error."""
    return dtype_name(text, DISPATCH_DTYPES)


# -- strategies and their options ---------------------------------------------------------------------
def split_names(text: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``."""
    return [s.strip() for s in str(text).split(",") if s.strip()]


def parse_opt_items(items: Sequence[str] | None, names: Sequence[str], *, plain: str = "single",
                    flag: str = "--opt") -> dict[str, dict[str, str]]:
    """``STRATEGY.key=value`` items -> ``{strategy: {key: value}}`` (keys with ``-`` read as ``_``).

    plain: what a ``key=value`` without a strategy means: ``single`` -- allowed only when one
    strategy is named; ``all`` -- every strategy's option."""
    per: dict[str, dict[str, str]] = {n: {} for n in names}
    for o in items or []:
        if "=" not in o:
            raise ConfigError(f"{flag} ({o!r}) must look like STRATEGY.key=value, e.g. capacity.cf=1.25")
        k, v = o.split("=", 1)
        head, dot, rest = k.partition(".")
        if dot and head.strip() in per:
            targets, key = [head.strip()], rest
        elif dot:
            raise ConfigError(f"{flag} strategy ({head.strip()!r}) must be one of the strategies ({', '.join(names)})")
        elif plain == "all" or len(names) == 1:
            targets, key = list(names), k
        else:
            raise ConfigError(f"{flag} ({o!r}) must look like STRATEGY.key=value, e.g. capacity.cf=1.25, "
                              "when several strategies are named")
        for n in targets:
            per[n][key.strip().replace("-", "_")] = v.strip()
    return per


def strategy_list(strategies: "str | Sequence[str] | Sequence[tuple[str, Mapping[str, Any]]]",
                  options: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Strategies and their options, checked against the registry: ``"a,b"``, ``["a", "b"]`` or
    ``[("a", {...})]``; ``options`` maps a strategy to its options (merged). Each strategy's
    options are checked by its own ``parse_options`` (an unknown option or a bad value: one line)."""
    from moonep_sim.strategies import get_strategy

    items: list = split_names(strategies) if isinstance(strategies, str) else list(strategies)
    pairs = [(it, {}) if isinstance(it, str) else (it[0], dict(it[1])) for it in items]
    names = [n for n, _ in pairs]
    require(len(names) > 0, "strategies must name at least one strategy")
    require(len(set(names)) == len(names), f"strategies ({', '.join(names)}) must not repeat a strategy")
    for s in options or {}:
        require(s in names, f"option strategy ({s!r}) must be one of the strategies ({', '.join(names)})")
    out = []
    for n, o in pairs:
        merged = {**o, **dict((options or {}).get(n, {}))}
        get_strategy(n).parse_options(merged)
        out.append((n, merged))
    return tuple(out)


# -- the replay's typed spec --------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplaySpec:
    """What every rank of a gloo replay runs (see the module doc). steps: ``--steps`` text
    (:func:`moonep_sim.routing.steps.parse_step_mode`: default each step its own batch)."""

    trace: str
    strategies: tuple[tuple[str, dict[str, Any]], ...]
    layers: tuple[int, ...] | None = None
    steps: str | None = None
    hidden: int = 64
    ffn: int = 128
    iters: int = 3
    warmup: int = 1
    gpus_per_node: int = 0
    token_padding: int = 1
    backward: bool = False
    check: bool | None = None
    max_tokens: int = 0
    dispatch_dtype: str = "fp32"
    seed: int = 0
    timeout_s: float = 60.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["strategies"] = [[n, dict(o)] for n, o in self.strategies]
        return json.dumps({"moonep_sim_replay_spec": 1, **d}, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str, where: str = "--spec") -> "ReplaySpec":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: expected a replay spec (JSON), found invalid JSON ({e.msg})") from None
        require(isinstance(d, dict) and d.pop("moonep_sim_replay_spec", None) == 1,
                f"{where}: expected a moonep-sim replay spec (key moonep_sim_replay_spec = 1)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        require(not unknown, f"{where}: field ({', '.join(unknown)}) must be one of {', '.join(sorted(known))}")
        d["strategies"] = tuple((str(n), dict(o)) for n, o in d.get("strategies", []))
        if d.get("layers") is not None:
            d["layers"] = tuple(int(x) for x in d["layers"])
        return cls(**d)

    def write(self, path: str | Path) -> Path:
        write_text_atomic(path, self.to_json())
        return Path(path)

    @classmethod
    def read(cls, path: str | Path) -> "ReplaySpec":
        p = Path(path)
        raw = read_config_bytes(p, "--spec", "JSON")  # a pipe, a folder, a huge or deeply nested file: one line
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--spec ({path}) must be a UTF-8 replay spec file: {e}") from None
        return cls.from_json(text, str(p))


__all__ = ["DISPATCH_DTYPES", "DTYPE_SPELLINGS", "REPLAY_DTYPES", "ReplaySpec", "dtype_name", "normalise_dtype",
           "parse_opt_items", "split_names", "strategy_list"]
