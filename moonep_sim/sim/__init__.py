"""Executor 2: a discrete-event (simpy) model of a multi-node GPU cluster that times any Plan.

Topologies (``topology``), a flow-level max-min fair network (``network``), a roofline grouped
GEMM (``compute``), host CPU sharing (``cpu``), faults (``faults``), the lower bound
(``lower_bound``) and Perfetto traces (``perfetto``). A step is simulated by ``timeline`` (the
front: :func:`simulate_layer`, :func:`simulate_layers`) from ``options`` (:class:`SimOptions`),
``program`` (a layer's direction as phases grouped by kind, with its local work), ``engine`` (the
simpy processes per rank) and ``analysis`` (phase spans, straggler, busiest port, :class:`SimResult`).
"""

from moonep_sim.sim.faults import DegradedLink, SlowGPU, Stall, parse_faults
from moonep_sim.sim.lower_bound import LowerBound, lower_bound
from moonep_sim.sim.timeline import SimOptions, SimResult, simulate_layer, simulate_layers
from moonep_sim.sim.topology import (Topology, calibrated_topology_path, list_topologies, load_topology,
                                     read_topology_file)


__all__ = ["DegradedLink", "LowerBound", "SimOptions", "SimResult", "SlowGPU", "Stall", "Topology",
           "calibrated_topology_path", "list_topologies", "load_topology", "lower_bound",
           "parse_faults", "read_topology_file", "simulate_layer", "simulate_layers"]
