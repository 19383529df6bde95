"""The idealised cluster of the closed-form tests: the ``h800-cx7`` constants (the ``Topology``
class defaults) with links at full bandwidth and round latencies, and no kernel fixed costs,
relays, SM caps or planning work terms (:data:`IDEAL`); :func:`ideal` builds one in code,
:func:`ideal_from_dict` reads a TOML document whose left-out keys take :data:`IDEAL`."""

from __future__ import annotations

from typing import Any

from moonep_sim.sim.topology import _TABLES, Topology, topology_from_dict

#: What :func:`ideal` changes from the class defaults (field -> value).
IDEAL: dict[str, Any] = dict(
    nvlink_bandwidth_GBps=160.0, nvlink_latency_us=3.0, nvlink_efficiency=1.0, nic_latency_us=5.0,
    nic_efficiency=1.0, plan_per_entry_ns=0.0, plan_per_cell_ns=0.0, kernel_dispatch_fixed_us=0.0,
    kernel_combine_fixed_us=0.0, kernel_relay_message_rows=0, kernel_nic_message_us=0.0, sm_count=0,
    sm_copy_GBps=0.0, weights_nvlink_efficiency=0.0)


def ideal(name: str, **kw: Any) -> Topology:
    """An idealised cluster: :data:`IDEAL` under ``kw``; the other constants are ``h800-cx7``'s."""
    return Topology(name, **{**IDEAL, **kw})


def ideal_from_dict(doc: dict[str, Any]) -> Topology:
    """``topology_from_dict(doc)`` with every key ``doc`` leaves out of a table taken from :data:`IDEAL`."""
    full = {k: v for k, v in doc.items() if k not in _TABLES}
    for table, (prefix, keys) in _TABLES.items():
        given = {k: IDEAL[prefix + k] for k in keys if prefix + k in IDEAL}
        given.update(doc.get(table, {}))
        if given:
            full[table] = given
    return topology_from_dict(full)
