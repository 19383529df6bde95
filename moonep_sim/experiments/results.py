"""Typed results of :class:`~moonep_sim.experiments.Scenario`'s methods.

Each is a frozen dataclass: the headline figures as typed fields, and the full report (what the
CLI prints with ``--json`` and ``report/`` renders) from ``to_dict()``. Times carry their unit in
the name: ``_us`` simulated microseconds, ``_ms`` measured milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from moonep_sim.io import to_jsonable


class _TakeAway:
    """What every result can do besides ``to_dict()``: ``save(folder)`` (report.json, its plots,
    report.html), ``plot(folder)`` (the plots alone), a short ``repr`` and a notebook view.
    Rendering lives in :mod:`moonep_sim.report` (imported inside the methods: the one place the
    experiments layer calls the layer above it, see tests/test_layering.py). These methods read
    ``to_dict()``: the result's ``report`` document, unless its class defines its own."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.report)

    @property
    def verdict(self) -> dict[str, Any] | None:
        """Winner, runner-up, margin, tie, confidence, mechanism, why (:mod:`~.verdict`); None if none."""
        return self.to_dict().get("verdict")

    @property
    def flags(self) -> list[dict[str, Any]]:
        """The assumptions the figures rest on (:mod:`~.flags`)."""
        return list(self.to_dict().get("flags") or [])

    def save(self, folder, *, plots: bool = True, command: str | None = None) -> dict[str, str]:
        """Write report.json, the plots (PNG) and a self-contained report.html under ``folder``;
        returns {what: path}."""
        from moonep_sim.report.save import save_report

        return save_report(dict(self.to_dict()), folder, plots=plots, command=command)

    def plot(self, folder, which: list[str] | None = None) -> dict[str, Any]:
        """Write this result's plots as PNGs under ``folder`` (``which``: some of their names, e.g.
        ``["traffic"]``); returns {name: path} (empty for a kind without plots)."""
        from moonep_sim.report.save import plot_report

        return plot_report(self.to_dict(), folder, which)

    def _summary(self) -> str:
        v = self.verdict
        if not v:
            head = ""
        elif v.get("runner_up") is None:
            head = f"; {v['winner']} alone"
        elif v["tie"]:
            head = f"; tie {' = '.join([v['winner'], *v.get('tied_with', [])])}"
        else:
            head = f"; {v['winner']} wins by {100 * v['margin']:.1f}% ({v.get('mechanism')})"
        n = len(self.flags)
        return head + (f"; {n} flag(s)" if n else "")

    def __repr__(self) -> str:
        names = ",".join(getattr(self, "strategies", None) or
                         dict.fromkeys(it.strategy for it in getattr(self, "items", ())))
        return f"{type(self).__name__}(kind={self.to_dict().get('kind')}, strategies={names}{self._summary()})"

    def _repr_html_(self) -> str:
        from moonep_sim.report.html import render_html

        return render_html(self.to_dict(), None)


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


@dataclass(frozen=True, repr=False)
class PlansResult(_TakeAway):
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


@dataclass(frozen=True, repr=False)
class SimulateResult(_TakeAway):
    """Each strategy's layers chained as one step on the simulated cluster.

    layer_time_us: strategy -> simulated time of the layers, token-weighted mean over a trace's
    steps (each step its own batch).  per_strategy: strategy -> the simulator's result of the
    slowest step as a dict (phases, lower bound, straggler, busiest port, per rank, ...) with
    ``per_step`` (the series) and ``steps_aggregate`` (token-weighted mean, median, p90, worst).
    topology: the topology's name and every constant behind the figures.  raw: strategy -> the
    simulator's result object of that step (timeline events included when asked for).  steps:
    how the steps were costed (mode, step ids, tokens) and any warning.  verdict: winner,
    runner-up, margin, tie, confidence, mechanism, why (:mod:`~.verdict`; a field here, the same
    property as every result's).
    """

    strategies: tuple[str, ...]
    layer_time_us: Mapping[str, float]
    per_strategy: Mapping[str, Mapping[str, Any]]
    topology: Mapping[str, Any]
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    steps: Mapping[str, Any] = field(default_factory=dict)
    verdict: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "simulate", "topology": dict(self.topology), "steps": dict(self.steps),
                "strategies": {n: dict(self.per_strategy[n]) for n in self.strategies},
                "flags": [f for n in self.strategies for f in self.per_strategy[n].get("flags", [])],
                "verdict": self.verdict}


@dataclass(frozen=True, repr=False)
class CompareResult(_TakeAway):
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


@dataclass(frozen=True, repr=False)
class ReplayResult(_TakeAway):
    """The gloo replay. measured_ms: strategy -> median over iterations of the slowest rank's layer
    time, averaged over layers.  correct: strategy -> dense check passed (None: not checked)."""

    strategies: tuple[str, ...]
    measured_ms: Mapping[str, float]
    correct: Mapping[str, bool | None]
    report: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True, repr=False)
class SweepResult(_TakeAway):
    """A sweep. values: the swept values; layer_time_us: strategy -> simulated time per value (at
    level step: step_time_us instead, layer_time_us empty)."""

    over: str
    values: tuple[float, ...]
    layer_time_us: Mapping[str, tuple[float, ...]]
    report: Mapping[str, Any] = field(repr=False)
    level: str = "layer"
    step_time_us: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def from_report(cls, rep: dict[str, Any]) -> "SweepResult":
        if rep.get("level") == "step":
            return cls(rep["over"], tuple(rep["values"]), {}, rep, "step",
                       {n: tuple(v["step_time_us"]) for n, v in rep["strategies"].items()})
        return cls(rep["over"], tuple(rep["values"]),
                   {n: tuple(v["layer_time_us"]) for n, v in rep["strategies"].items()}, rep)
