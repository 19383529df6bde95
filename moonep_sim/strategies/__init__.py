"""Dispatch strategies (planners). Each module registers one strategy; each returns a Plan.

Adding a strategy
-----------------
1. Create ``moonep_sim/strategies/<name>.py`` with a pure function
   ``plan(routing: GlobalRouting, ctx: PlanContext, *, opt1, opt2) -> Plan`` built with the public
   builders of ``moonep_sim.plan`` (:func:`~moonep_sim.plan.plan_from_slots` for a single hop,
   :func:`~moonep_sim.plan.plan_from_routes` / :func:`~moonep_sim.plan.assemble_plan` for hops
   of your own). Pass ``options={...}`` to the builder only for what the planner resolves or
   measures (a default it computed, a statistic); the registry does the rest.
2. Decorate it with ``@register("<name>", summary="...", options={"opt": Option(type, default,
   "help", choices=..., check=..., constraint=...)})``. The schema is the one source of defaults
   (the function's options take none) and of validation: values from strings are converted
   strictly (booleans accept true/false, yes/no, on/off, 1/0 only), checked against ``choices``
   and ``check``; a bad value is a one-line :class:`~moonep_sim.errors.ConfigError`.
3. Add the module name to ``_MODULES`` below. :func:`make_plan` parses the options, times the
   planner and stamps the Plan's ``strategy``, ``options`` (parsed, overlaid with what the planner
   reported) and ``plan_seconds``. Both executors run the new strategy unchanged, and
   ``tests/test_strategies_common.py`` checks its invariants with hypothesis automatically.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from moonep_sim.errors import ConfigError
from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, Plan, RowCosts
from moonep_sim.registry import Registry

_MODULES = ("moonep", "alltoall", "capacity", "allgather", "hierarchical", "deepep", "deepep_ll", "fused_moe", "eplb",
            "llep", "ultraep", "costaware")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class PlanContext:
    """What every planner needs besides the routing.

    cluster: ranks and nodes.  placement: home slots of experts (home groups by default).
    costs: row and weight byte sizes.  token_padding: pad each slot's rows to a multiple of this.
    topology: optional, the modelled cluster's constants (a ``moonep_sim.sim.Topology``, read
        duck-typed: link bandwidths and efficiencies, GPU rates) for planners that price their
        choices (``costaware``); None = such planners price with the default preset's constants
        (``h800-cx7``, read from its shipped file: ``costaware.preset_constants``). Planners must
        not need it to produce a valid Plan.
    perf: where the builders take their compiled kernels (:class:`~moonep_sim.perf.PerfConfig`;
        the same Plan whatever it says).
    """

    cluster: ClusterShape
    placement: Placement
    costs: RowCosts
    token_padding: int = 1
    topology: Any = None
    perf: PerfConfig = DEFAULT_PERF

    @classmethod
    def default(cls, num_experts: int, ranks: int, gpus_per_node: int = 0, costs: RowCosts | None = None,
                token_padding: int = 1, topology: Any = None) -> "PlanContext":
        return cls(ClusterShape(ranks, gpus_per_node), Placement.home_groups(num_experts, ranks),
                   costs or RowCosts(2, 2, 0, 0), token_padding, topology)


@dataclass(frozen=True)
class Option:
    """One strategy option's schema.

    type: ``bool``, ``int``, ``float``, ``str`` or a converter function (its ``__name__`` names the
        expected form in errors).  default: the value when not given (the one source of defaults).
    help: one line for ``--help`` and docs.  choices: the allowed values (None: any).
    check: a predicate the converted value must satisfy (None: any); ``constraint`` words it for
        the error (``"must be >= 0 (0 = no limit)"``).
    hi: the largest value a number may take (an integer or float option always has one: from
        :data:`OPTION_LIMITS`, else :data:`DEFAULT_OPTION_LIMIT`, filled in by :func:`register`);
        a float must also be finite.
    """

    type: Any
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    constraint: str = ""
    hi: float | None = None

    def parse(self, strategy: str, name: str, v: Any) -> Any:
        """Convert and check one value (a string from ``--opt k=v`` or a Python value); a bad one
        raises ``ConfigError("option NAME (VALUE) must ...: strategy S")``."""
        if v is None:
            return None

        def bad(what: str, shown: Any = v) -> ConfigError:
            return ConfigError(f"option {name} ({_show(shown)}) {what} (strategy {strategy})")

        typ = self.type
        if typ is bool:
            if isinstance(v, str):
                low = v.strip().lower()
                if low not in _TRUE + _FALSE:
                    raise bad(f"must be a boolean: one of {'/'.join(_TRUE + _FALSE)}")
                v = low in _TRUE
            elif isinstance(v, (bool, int, np.bool_, np.integer)) and v in (0, 1):
                v = bool(v)
            else:
                raise bad("must be a boolean (true or false)")
        elif typ is int:
            try:
                if isinstance(v, (bool, np.bool_)) or (isinstance(v, float) and not v.is_integer()):
                    raise ValueError
                v = int(v)
            except (TypeError, ValueError):
                raise bad("must be an integer") from None
        elif typ is float:
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise bad("must be a number") from None
        else:
            try:
                v = typ(v)
            except (TypeError, ValueError) as e:
                raise bad(f"must be a {getattr(typ, '__name__', 'value')}: {e}") from None
        if self.choices is not None and v not in self.choices:
            alts = [repr(c) for c in self.choices]
            raise bad("must be " + (" or ".join(alts) if len(alts) <= 2 else ", ".join(alts[:-1]) + " or " + alts[-1]), v)
        if self.check is not None and not self.check(v):
            raise bad(self.constraint or "is out of range", v)
        if typ in (int, float) and not np.isfinite(v):
            raise bad("must be a finite number", v)
        if self.hi is not None and typ in (int, float) and v > self.hi:
            raise bad(f"must be at most {self.hi:g} (the option's bound: {self.help})", v)
        return v


def _show(v: Any) -> str:
    """A value as an error message shows it: numbers plainly (``0``, ``-1.5``, ``nan``), strings quoted."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, np.ndarray):
        return f"array of shape {list(v.shape)}"
    return repr(v)


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy: its name, one-line summary, planner function and option schema."""

    name: str
    summary: str
    plan_fn: Callable[..., Plan]
    options: dict[str, Option] = field(default_factory=dict)

    def defaults(self) -> dict[str, Any]:
        return {k: o.default for k, o in self.options.items()}

    def parse_options(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Options from strings (CLI ``--opt k=v``) or values, checked against the schema; every
        option present (defaults filled in)."""
        out = self.defaults()
        for k, v in raw.items():
            if k not in self.options:
                raise ConfigError(f"option ({k!r}) must be one of strategy {self.name!r}'s options: "
                                  f"{sorted(self.options) or 'none'}")
            out[k] = self.options[k].parse(self.name, k, v)
        return out

    def plan(self, routing: GlobalRouting, ctx: PlanContext, **options) -> Plan:
        """Parse ``options``, run the planner and stamp the Plan (see the module docstring)."""
        opts = self.parse_options(options)
        t0 = time.perf_counter()
        p = self.plan_fn(routing, ctx, **opts)
        seconds = time.perf_counter() - t0
        return dataclasses.replace(p, strategy=self.name, options={**opts, **p.options}, plan_seconds=seconds)


#: The strategies by name; the module list is :data:`_MODULES` (registering a name again replaces it).
_REGISTRY: Registry[StrategySpec] = Registry("strategy", __name__, _MODULES, replace=True)


#: Upper bounds of the options that size work or memory (checked before planning; listed by
#: ``moonep-sim strategies``): SM counts at most 1024 (a GPU has ~132), node/rank/replica counts
#: at most MAX_RANKS, costaware's grid 4096 targets (each a full assignment: 1e8 took 78 s).
OPTION_LIMITS: dict[tuple[str, str], float] = {
    ("costaware", "grid"): 4096, ("costaware", "sms"): 1024, ("deepep", "sms"): 1024, ("deepep-ll", "sms"): 1024,
    ("moonep", "sms"): 1024, ("deepep", "max_nodes"): 1 << 14, ("deepep-ll", "max_tokens"): 1 << 20,
    ("eplb", "num_redundant"): 1 << 20, ("eplb", "groups"): 1 << 16, ("llep", "alpha"): 1e6, ("llep", "m"): 1 << 28,
    ("llep", "lambda"): 1e6, ("ultraep", "replica_cap"): 1 << 14, ("ultraep", "domain"): 1 << 14,
    ("ultraep", "max_replicas"): 1 << 14,
}
DEFAULT_OPTION_LIMIT = float(1 << 31)
"""The bound of an integer or float option not in :data:`OPTION_LIMITS`."""


def register(name: str, summary: str, options: dict[str, Option] | None = None):
    """Decorator: register ``plan_fn`` as strategy ``name`` with its option schema."""
    schema = {}
    for k, o in (options or {}).items():
        o = o if isinstance(o, Option) else Option(*o)  # (type, default, help) also accepted
        if o.type in (int, float) and o.hi is None:
            o = dataclasses.replace(o, hi=OPTION_LIMITS.get((name, k), DEFAULT_OPTION_LIMIT))
        schema[k] = o

    def deco(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        _REGISTRY.register(StrategySpec(name, summary, fn, schema))
        return fn
    return deco


def available() -> dict[str, StrategySpec]:
    """All registered strategies, by name (sorted): the one list every report and test uses."""
    return dict(sorted(_REGISTRY.items()))


def get_strategy(name: str) -> StrategySpec:
    specs = available()
    if name not in specs:
        raise ConfigError(f"strategy ({name!r}) must be one of: {', '.join(specs)}")
    return specs[name]


def make_plan(name: str, routing: GlobalRouting, ctx: PlanContext, **options) -> Plan:
    """Plan ``routing`` with strategy ``name``: options checked against its schema; the Plan
    stamped with the strategy's name, its options and the planning time."""
    return get_strategy(name).plan(routing, ctx, **options)


@dataclass(frozen=True)
class Planner:
    """A strategy bound to its context and options: ``planner(routing) -> Plan``.

    What an executor that plans per step takes (the gloo ``Buffer``'s ``planner``): it needs no
    strategy registry of its own. ``name`` and ``options`` (parsed, defaults filled in) identify
    it, e.g. to check that every rank plans alike.
    """

    name: str
    ctx: PlanContext
    options: dict[str, Any]

    def __call__(self, routing: GlobalRouting) -> Plan:
        return make_plan(self.name, routing, self.ctx, **self.options)


def planner(name: str, ctx: PlanContext, **options) -> Planner:
    """Strategy ``name`` bound to ``ctx`` and ``options`` (checked now, so a bad option fails
    before any communication)."""
    spec = get_strategy(name)
    return Planner(name, ctx, spec.parse_options(options))


__all__ = ["Option", "PlanContext", "Planner", "StrategySpec", "available", "get_strategy", "make_plan", "planner",
           "register"]
