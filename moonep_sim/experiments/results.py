"""Typed results of :class:`~moonep_sim.experiments.Scenario`'s methods.

Each is a frozen dataclass: the headline figures as typed fields, and the full report (what the
CLI prints with ``--json`` and ``report/`` renders) from ``to_dict()``. Times carry their unit in
the name: ``_us`` simulated microseconds, ``_ms`` measured milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from moonep_sim.io import to_jsonable


@dataclass(frozen=True)
class LayerPlans:
    """One strategy's Plan of one layer (of one step of a trace: ``step``, None when merged or generated)."""

    strategy: str
    layer: int
    plan: Any  # moonep_sim.plan.Plan
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "layer": self.layer, "step": self.step,
                **to_jsonable(self.plan.summary(), lenient=True)}


@dataclass(frozen=True)
class PlansResult:
    """Every strategy's Plan of every layer, in (layer, strategy) order."""

    items: tuple[LayerPlans, ...]
    routing: Mapping[str, Any]
    model: str
    cluster: Mapping[str, int]

    def plan(self, strategy: str, layer: int | None = None, step: int | None = None) -> Any:
        """The Plan of ``strategy`` for ``layer`` and ``step`` (default: the first of each)."""
        for it in self.items:
            if it.strategy == strategy and (layer is None or it.layer == layer) and (step is None or it.step == step):
                return it.plan
        raise KeyError((strategy, layer, step))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "plans", "routing": dict(self.routing), "model": self.model, "cluster": dict(self.cluster),
                "plans": [it.to_dict() for it in self.items]}


@dataclass(frozen=True)
class SimulateResult:
    """Each strategy's layers chained as one step on the simulated cluster.

    layer_time_us: strategy -> simulated time of the layers, token-weighted mean over a trace's
    steps (each step its own batch).  per_strategy: strategy -> the simulator's result of the
    slowest step as a dict (phases, lower bound, straggler, busiest port, per rank, ...) with
    ``per_step`` (the series) and ``steps_aggregate`` (token-weighted mean, median, p90, worst).
    topology: the topology's name and every constant behind the figures.  raw: strategy -> the
    simulator's result object of that step (timeline events included when asked for).  steps:
    how the steps were costed (mode, step ids, tokens) and any warning.
    """

    strategies: tuple[str, ...]
    layer_time_us: Mapping[str, float]
    per_strategy: Mapping[str, Mapping[str, Any]]
    topology: Mapping[str, Any]
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    steps: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "simulate", "topology": dict(self.topology), "steps": dict(self.steps),
                "strategies": {n: dict(self.per_strategy[n]) for n in self.strategies}}


@dataclass(frozen=True)
class CompareResult:
    """The compare report. layer_time_us: strategy -> mean simulated layer time on the scenario's
    topology; measured_ms / local_sim_ms: with ``real``, the gloo replay's median layer time and the
    same plans simulated on ``local-gloo`` (None otherwise)."""

    strategies: tuple[str, ...]
    layer_time_us: Mapping[str, float]
    measured_ms: Mapping[str, float] | None
    local_sim_ms: Mapping[str, float] | None
    report: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_report(cls, rep: dict[str, Any]) -> "CompareResult":
        s = rep["strategies"]
        real = rep.get("real")
        return cls(tuple(s), {n: float(v["sim"]["layer_time_us_mean"]) for n, v in s.items()},
                   {n: float(v["measured_ms"]) for n, v in real["strategies"].items()} if real else None,
                   {n: float(v["simulated_ms"]) for n, v in real["strategies"].items()} if real else None, rep)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.report)


@dataclass(frozen=True)
class ReplayResult:
    """The gloo replay. measured_ms: strategy -> median over iterations of the slowest rank's layer
    time, averaged over layers.  correct: strategy -> dense check passed (None: not checked)."""

    strategies: tuple[str, ...]
    measured_ms: Mapping[str, float]
    correct: Mapping[str, bool | None]
    report: Mapping[str, Any] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.report)


@dataclass(frozen=True)
class SweepResult:
    """A sweep. values: the swept values; layer_time_us: strategy -> simulated time per value."""

    over: str
    values: tuple[float, ...]
    layer_time_us: Mapping[str, tuple[float, ...]]
    report: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_report(cls, rep: dict[str, Any]) -> "SweepResult":
        return cls(rep["over"], tuple(rep["values"]),
                   {n: tuple(v["layer_time_us"]) for n, v in rep["strategies"].items()}, rep)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.report)
