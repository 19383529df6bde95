"""Routing: traces (format, importers, generators), router replay and load metrics."""

from moonep_sim.routing.trace import LayerRouting, Trace, TraceMeta, write_trace
from moonep_sim.routing.generators import generate, generate_layer, generate_trace
from moonep_sim.routing.importers import detect_format, import_trace, load_source
from moonep_sim.routing.metrics import EPLayout, gini, inspect_trace, maxvio
from moonep_sim.routing.recorder import record
from moonep_sim.routing.steps import StepSelection, parse_steps, read_layer, select_layer, token_ranges
from moonep_sim.routing.router import (quantile_offsets, replay_layer, replay_trace, route_group,
                                       route_quantile, route_topk)

__all__ = ["LayerRouting", "Trace", "TraceMeta", "write_trace",
           "generate", "generate_layer", "generate_trace",
           "detect_format", "import_trace", "load_source",
           "EPLayout", "gini", "inspect_trace", "maxvio",
           "record", "StepSelection", "parse_steps", "read_layer", "select_layer", "token_ranges",
           "quantile_offsets", "replay_layer", "replay_trace", "route_group", "route_quantile", "route_topk"]
