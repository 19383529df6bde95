"""Chrome / Perfetto trace (Trace Event Format JSON) of a simulation.

Process 1 "ranks": one thread (track) per rank with complete events (``ph: "X"``) for planning,
each dispatch / combine hop (from sending to having received), expert compute and stalls.
Process 2 "ports": one counter track (``ph: "C"``) per busy port with its utilisation (0..1) over
time, sampled at every rate recomputation, plus one track per busy port with the transfers that
crossed it. Timestamps are simulated microseconds (the format's unit). Open in ui.perfetto.dev.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from moonep_sim.io import write_text_atomic

MAX_PORT_TRACKS = 16
MAX_FLOW_EVENTS = 20000


def trace_events(spans, net, rec: dict[str, np.ndarray], ranks: int) -> list[dict[str, Any]]:
    """The events of a run: ``spans`` are ``moonep_sim.sim.engine.Span`` records, ``net`` the
    FlowNetwork and ``rec`` its flow records."""
    ev: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "ranks"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "ports"}},
    ]
    for r in range(ranks):
        ev.append({"ph": "M", "pid": 1, "tid": r, "name": "thread_name", "args": {"name": f"rank {r}"}})
    for s in spans:  # moonep_sim.sim.engine.Span
        ev.append({"ph": "X", "pid": 1, "tid": int(s.rank), "name": s.name, "ts": float(s.start_us),
                   "dur": float(max(s.end_us - s.start_us, 0.0)), "cat": s.name.split(".")[0],
                   "args": {"kind": s.kind.value, "direction": s.direction.value}})
    pb = net.port_bytes()
    ports = net.ports
    busy = pb / ports.cap_P[:-1]
    top = [int(p) for p in np.argsort(-busy)[:MAX_PORT_TRACKS] if pb[p] > 0]
    for k, p in enumerate(top):
        ev.append({"ph": "M", "pid": 2, "tid": k, "name": "thread_name", "args": {"name": ports.name(p)}})
    for t, util in net.util_samples:
        for p in top:
            ev.append({"ph": "C", "pid": 2, "name": f"util {ports.name(p)}", "ts": float(t),
                       "args": {"utilisation": round(float(util[p]), 6)}})
    if rec["src"].size and top:
        path = ports.route(rec["src"], rec["dst"], net.flow_sm(rec), net.flow_nic(rec))
        for k, p in enumerate(top):
            fl = np.flatnonzero((path == p).any(axis=1))
            for f in fl[: max(MAX_FLOW_EVENTS // len(top), 1)].tolist():
                ev.append({"ph": "X", "pid": 2, "tid": k, "name": net.phase_name(int(rec["phase"][f])),
                           "ts": float(rec["ready"][f]), "dur": float(max(rec["end"][f] - rec["ready"][f], 0.0)),
                           "args": {"src": int(rec["src"][f]), "dst": int(rec["dst"][f]),
                                    "bytes": float(rec["bytes"][f])}})
    return ev


def write_trace(path: str | os.PathLike, events: list[dict[str, Any]], metadata: dict[str, Any] | None = None) -> None:
    """Write ``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}`` atomically."""
    doc = {"traceEvents": events, "displayTimeUnit": "ns", "otherData": metadata or {}}
    write_text_atomic(path, json.dumps(doc), what="--timeline")


__all__ = ["trace_events", "write_trace"]
