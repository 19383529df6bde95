"""moonep-sim: a simulated expert-parallel (EP) communication layer for MoE models.

Data flow (one folder per role)::

    routing/    traces, importers, generators, router replay, load metrics
    strategies/ planners: one module per dispatch strategy, each returns a Plan
    plan/       the Plan data model, expert placement, invariants (validate)
    gloo/       executor 1: real tensors over torch.distributed (gloo)
    sim/        executor 2: a simpy model of a multi-node GPU cluster
    report/     compare, sweep, calibrate, validate, plots
    cli/        the ``moonep-sim`` command
"""

from moonep_sim.errors import MoonEPSimError

__version__ = "0.1.0"
__all__ = ["MoonEPSimError", "__version__"]
