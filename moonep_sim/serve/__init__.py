"""Serving: requests arriving at workers that run scheduler iterations, each timed by the step model.

Reads bottom-up: ``requests`` (arrivals and lengths) -> ``steptime`` (what an iteration costs) ->
``engine`` (the event-driven scheduler) -> ``metrics`` (latency, throughput, SLOs, cost) ->
``deployment`` (workers, layouts and memory). Above the step model (``moonep_sim.step``), below
``moonep_sim.experiments``; the guide is docs/serving.md.
"""
