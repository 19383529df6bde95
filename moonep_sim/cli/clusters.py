"""``moonep-sim compare --topology a,b,...``: the same compare on each cluster, one table.

A thin adapter over :func:`moonep_sim.experiments.clusters.compare_clusters` (each cluster its own
``Scenario.compare``, the routing and strategies unchanged; ``deepep`` on each cluster's native
kernel family unless ``--opt deepep.impl=`` is given); rendered by :mod:`moonep_sim.report.clusters`.
"""

from __future__ import annotations

import os
from pathlib import Path

from moonep_sim.errors import ConfigError

#: what the multi-cluster compare writes into --out
OUT_FILES = ("clusters.json",)


def is_multi(args) -> bool:
    """True when --topology lists more than one cluster (a comma list)."""
    return "," in str(args.topology)


def run_clusters(args, scenario) -> int:
    """``scenario``: compare's ``scenario(args)`` (the base Scenario of these arguments, checked)."""
    from moonep_sim.cli.common import emit_json, output_rule
    from moonep_sim.experiments.clusters import check_topologies, compare_clusters
    from moonep_sim.experiments.parallel import check_jobs
    from moonep_sim.io import dumps_strict, write_text_atomic
    from moonep_sim.progress import tracker
    from moonep_sim.report.clusters import clusters_lines, clusters_table
    from moonep_sim.report.tables import wide_console

    for flag, on in (("--real", args.real), ("--level step", args.level != "layer")):
        if on:
            raise ConfigError(f"{flag} applies to one --topology only (the multi-cluster compare is simulated, "
                              "layer level)")
    names = [t for t, _ in check_topologies(args.topology)]
    to_file = args.json not in (None, "-")
    output_rule(args, files=("json",) if to_file else (), folders={"out": OUT_FILES},
                inputs={f"--topology {t}": t for t in names if os.path.exists(t)})  # a file, any extension
    args.topology = names[0]  # the base scenario, checked; every cluster is checked again before any work
    sc = scenario(args)
    check_jobs(args.jobs)
    c = wide_console(200)
    with tracker("compare on clusters") as cb:
        doc = compare_clusters(sc, names, progress=cb, jobs=args.jobs, cluster=args.cluster)
    text = dumps_strict(doc, indent=1)
    out = Path(args.out) / "clusters.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text, what="--out")
    if emit_json(args, doc, stdout_indent=2):
        return 0
    c.print(clusters_table(doc))
    for line in clusters_lines(doc):
        c.print(line, highlight=False, markup=False, soft_wrap=True)
    c.print("wrote " + ", ".join([str(out)] + ([str(args.json)] if to_file else [])))
    return 0
