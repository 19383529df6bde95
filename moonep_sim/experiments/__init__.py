"""Experiments: the one place that turns a scenario into runs (the Python API to script against).

    from moonep_sim.experiments import Scenario, GeneratorSpec

    sc = Scenario(routing="gen:model=olmoe-1b-7b,maxvio=4,tokens-per-rank=256", cluster="16/8",
                  strategies=["alltoall", "deepep", "moonep"], topology="h800-cx7")
    sc.plans()         # each strategy's Plan per layer           -> PlansResult
    sc.simulate()      # the layers as one step, per strategy      -> SimulateResult
    sc.compare()       # the compare report (real=True: + gloo)    -> CompareResult
    sc.sweep(over="maxvio")                                        # -> SweepResult
    Scenario(routing="traces/mixtral-8x7b_humaneval.safetensors", cluster=4).replay(nproc=4)

Modules: :mod:`~.routing` (trace / generator spec / in-memory routing, one grammar and one set of
defaults), :mod:`~.scenario`, :mod:`~.results` (typed results with ``to_dict()``),
:mod:`~.compare`, :mod:`~.clusters` (the same compare on several clusters), :mod:`~.sweep`, :mod:`~.validate` (fidelity against gloo replays),
:mod:`~.calibrate` (measure this machine: the local-gloo topology), :mod:`~.ranks` (the rank
programs: the gloo replay's, ``launch/replay.py``, which binds strategies to the gloo executor, and
the calibration's measurements),
:mod:`~.seeds` (sweeps over several seeds). What the figures say (verdicts, flags, rankings) is
:mod:`moonep_sim.analysis`. Results render
themselves (``save``, ``plot``) through :mod:`moonep_sim.report`. Every ``moonep-sim`` command is a thin adapter over
these; :mod:`moonep_sim.report` only renders what they return. docs/experiments.md has the guide.
"""

from moonep_sim.experiments.results import (CompareResult, LayerPlans, PlansResult, ReplayResult, SimulateResult,
                                            SweepResult)
from moonep_sim.experiments.routing import GEN_DEFAULTS, GeneratorSpec, RoutingSource, open_routing
from moonep_sim.experiments.scenario import (DEFAULT_STRATEGIES, DEFAULT_TOPOLOGY, Scenario, normalise_dtype,
                                             parse_cluster, strategy_list)

__all__ = ["Scenario", "GeneratorSpec", "GEN_DEFAULTS", "RoutingSource", "open_routing", "PlansResult", "LayerPlans",
           "SimulateResult", "CompareResult", "ReplayResult", "SweepResult", "DEFAULT_STRATEGIES",
           "DEFAULT_TOPOLOGY", "normalise_dtype", "parse_cluster", "strategy_list"]
