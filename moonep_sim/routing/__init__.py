"""Routing: traces (format, importers, generators), router replay and load metrics."""

from moonep_sim.routing.trace import LayerRouting, Trace, TraceMeta, write_trace

__all__ = ["LayerRouting", "Trace", "TraceMeta", "write_trace"]
