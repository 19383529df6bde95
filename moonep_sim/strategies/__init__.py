"""Dispatch strategies (planners). Each module registers one strategy; each returns a Plan.

Adding a strategy
-----------------
1. Create ``moonep_sim/strategies/<name>.py`` with a pure function
   ``plan(routing: GlobalRouting, ctx: PlanContext, **options) -> Plan`` -- usually built with
   :func:`moonep_sim.plan.plan_from_slots` (single hop) or by listing :class:`~moonep_sim.plan.Hop`
   objects yourself (multi-hop).
2. Decorate it with ``@register("<name>", summary="...", options={"opt": (type, default, "help")})``.
3. Add the module name to ``_MODULES`` below. Both executors run the new strategy unchanged, and
   ``tests/test_strategies_common.py`` checks its invariants with hypothesis automatically.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from moonep_sim.errors import ConfigError
from moonep_sim.plan import ClusterShape, GlobalRouting, Placement, Plan, RowCosts

_MODULES = ("moonep", "alltoall", "capacity", "allgather", "hierarchical", "deepep", "eplb", "llep", "ultraep",
            "costaware")


@dataclass(frozen=True)
class PlanContext:
    """What every planner needs besides the routing.

    cluster: ranks and nodes.  placement: home slots of experts (home groups by default).
    costs: row and weight byte sizes.  token_padding: pad each slot's rows to a multiple of this.
    topology: optional, the modelled cluster's constants (a ``moonep_sim.sim.Topology``, read
        duck-typed: link bandwidths and efficiencies, GPU rates) for planners that price their
        choices (``costaware``); None = such planners use their documented defaults. Planners
        must not need it to produce a valid Plan.
    """

    cluster: ClusterShape
    placement: Placement
    costs: RowCosts
    token_padding: int = 1
    topology: Any = None

    @classmethod
    def default(cls, num_experts: int, ranks: int, gpus_per_node: int = 0, costs: RowCosts | None = None,
                token_padding: int = 1, topology: Any = None) -> "PlanContext":
        return cls(ClusterShape(ranks, gpus_per_node), Placement.home_groups(num_experts, ranks),
                   costs or RowCosts(2, 2, 0, 0), token_padding, topology)


@dataclass(frozen=True)
class StrategySpec:
    name: str
    summary: str
    plan_fn: Callable[..., Plan]
    options: dict[str, tuple[type, Any, str]] = field(default_factory=dict)

    def defaults(self) -> dict[str, Any]:
        return {k: d for k, (_, d, _) in self.options.items()}

    def parse_options(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Options from strings (CLI ``--opt k=v``) or values, checked against the declared ones."""
        out = self.defaults()
        for k, v in raw.items():
            if k not in self.options:
                raise ConfigError(f"option ({k!r}) must be one of strategy {self.name!r}'s options: "
                                  f"{sorted(self.options) or 'none'}")
            typ = self.options[k][0]
            if isinstance(v, str) and typ is bool:
                v = v.lower() in ("1", "true", "yes", "on")
            try:
                out[k] = typ(v) if v is not None else None
            except (TypeError, ValueError):
                raise ConfigError(f"option {k} ({v!r}) must be a {typ.__name__}") from None
        return out


_REGISTRY: dict[str, StrategySpec] = {}


def register(name: str, summary: str, options: dict[str, tuple[type, Any, str]] | None = None):
    """Decorator: register ``plan_fn`` as strategy ``name``."""
    def deco(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        _REGISTRY[name] = StrategySpec(name, summary, fn, dict(options or {}))
        return fn
    return deco


def _load_all() -> None:
    for mod in _MODULES:
        try:
            importlib.import_module(f"moonep_sim.strategies.{mod}")
        except ModuleNotFoundError as e:  # a strategy module not written yet
            if e.name != f"moonep_sim.strategies.{mod}":
                raise


def available() -> dict[str, StrategySpec]:
    """All registered strategies, by name."""
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def get_strategy(name: str) -> StrategySpec:
    specs = available()
    if name not in specs:
        raise ConfigError(f"strategy ({name!r}) must be one of: {', '.join(specs)}")
    return specs[name]


def make_plan(name: str, routing: GlobalRouting, ctx: PlanContext, **options) -> Plan:
    """Plan ``routing`` with strategy ``name`` (options checked against its declared ones)."""
    spec = get_strategy(name)
    return spec.plan_fn(routing, ctx, **spec.parse_options(options))


__all__ = ["PlanContext", "StrategySpec", "available", "get_strategy", "make_plan", "register"]
