"""Terminal tables (rich) of compare, sweep and fidelity reports, built from their JSON dicts."""

from __future__ import annotations

from typing import Any, Sequence

from moonep_sim.analysis.verdict import fmt_time, verdict_line
from moonep_sim.report.plots import grouped_phases


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def _time(us: float) -> str:
    """Three significant digits, in us, ms or s."""
    return fmt_time(us) if us else "0"


def compare_table(report: dict[str, Any]) -> list:
    """Tables of one comparison: (1) simulated time per phase, ratio to the lower bound and the
    straggler; (2) load, bytes per link class, weights moved, drops; (3) with real runs, measured
    vs simulated (local-gloo) side by side."""
    from rich.table import Table

    strat = report["strategies"]
    parts = report["critical_parts"]  # the parts of sim.critical_us_mean, in run order
    groups = {n: grouped_phases(s["sim"]["phases_us_mean"]) for n, s in strat.items()}
    span_cols = [g for g in ("prefetch", "migrate") if any(gr.get(g, 0) > 0 for gr in groups.values())]
    topo = report["topology"]["name"]
    cl = report["cluster"]
    best = min(s["sim"]["layer_time_us_mean"] for s in strat.values())
    t = Table(title=(f"simulated on {topo}, EP{cl['ranks']} = {cl['nodes']} node(s) x {cl['gpus_per_node']}: "
                     f"mean per layer over {len(report['routing']['layers'])} layer(s) of {report['routing']['label']}"),
              title_justify="left")
    t.add_column("strategy", style="bold")
    t.add_column("layer time", justify="right")
    for g in parts:
        t.add_column(g, justify="right")
    for g in span_cols:
        t.add_column(f"{g} span", justify="right")
    t.add_column("x LB", justify="right")
    t.add_column("straggler")
    for n, s in strat.items():
        sim = s["sim"]
        crit = sim["critical_us_mean"]
        row = [_flag_mark(report, n), _time(sim["layer_time_us_mean"])] + [_time(crit.get(g, 0.0)) for g in parts]
        row += [_time(groups[n].get(g, 0.0)) for g in span_cols]
        row += [f"{sim['ratio_to_lower_bound']:.2f}", sim["straggler"]]
        t.add_row(*row, style="green" if sim["layer_time_us_mean"] == best else None)
    t2 = Table(title="load and traffic (from each strategy's plan; bytes summed over layers, forward + backward)",
               title_justify="left")
    for col in ("strategy", "rows max/mean", "NVLink MiB", "NIC MiB", "weights MiB", "dropped", "padded"):
        t2.add_column(col, justify="left" if col == "strategy" else "right", style="bold" if col == "strategy" else None)
    for n, s in strat.items():
        b = s["plan_bytes"]
        t2.add_row(_flag_mark(report, n), f"{s['rows_max']:,.0f}/{s['rows_mean']:,.0f} ({s['rows_max_over_mean']:.2f})",
                   _mib(b.get("intra_node", 0)), _mib(b.get("inter_node", 0)), _mib(s["weight_bytes"]),
                   f"{s['dropped']:,}", f"{s['padded']:,}")
    out = [t, t2]
    real = report.get("real")
    if real:
        t3 = Table(title=f"real: gloo, {real['nproc']} local processes, vs the same plans simulated on "
                         f"{real['topology']['name']} (per layer; measured: median over {real['iters']} interleaved "
                         f"iterations)", title_justify="left")
        for col in ("strategy", "measured", "simulated", "sim/measured", "correct"):
            t3.add_column(col, justify="left" if col == "strategy" else "right", style="bold" if col == "strategy" else None)
        for n in strat:
            r = real["strategies"].get(n)
            if not r:
                continue
            ratio = r["sim_over_measured"]
            t3.add_row(n, f"{r['measured_ms']:.2f} ms", f"{r['simulated_ms']:.2f} ms",
                       f"{ratio:.2f}" if ratio else "-", {True: "yes", False: "NO"}.get(r.get("correct"), "-"))
        out.append(t3)
    return out


def compare_footer(report: dict[str, Any]) -> list[str]:
    """Lines under the table: which constants produced the figures, and what the columns mean."""
    c = report["topology"]["constants"]
    lines = [f"simulated on topology {report['topology']['name']}: " + _topo_line(c)]
    if report.get("real"):
        lc = report["real"]["topology"]["constants"]
        lines.append(f"measured: gloo, {report['real']['nproc']} local processes; sim local-gloo: " + _topo_line(lc))
        rk = report["real"].get("ranking")
        if rk:
            lines.append(f"measured order: {rk['measured_order_text']} ('<' resolved by sign tests over matched "
                         f"iterations, Holm-corrected at {rk['alpha']:g}; '~' a measured tie); simulated order: "
                         f"{' < '.join(rk['simulated_order'])}; the simulator agrees with {rk['resolved_agree']} "
                         f"of {rk['resolved_pairs']} resolved pairs")
    lines += flag_lines(report)
    if report.get("flags"):
        lines.append("*: a flag above concerns this strategy")
    lines.append("plan .. combine: the layer time split along the rank whose expert compute ends last (they sum to "
                 "it); prefetch/migrate span: first start to last end of the weight copies")
    lines.append("NVLink / NIC MiB: bytes crossing intra-node / inter-node links, forward + backward, summed over "
                 "layers; weights MiB: expert weights moved (prefetch + migrate); x lower bound: layer time over "
                 "max(busiest-port bytes / bandwidth, even compute)")
    return lines


def resolved_line(report: dict[str, Any]) -> str | None:
    """Which pairs of strategies the real measurements resolved (the rest are measured ties)."""
    rk = (report.get("real") or {}).get("ranking")
    if not rk:
        return None
    if not rk.get("resolved"):
        return (f"the measurements resolved no pair of strategies (all {rk['pairs']} pairs are measured ties at "
                f"this noise level; more --iters may resolve some)")
    return (f"the measurements resolved {len(rk['resolved'])} of {rk['pairs']} pairs: {', '.join(rk['resolved'])} "
            f"(the other pairs are measured ties)")


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """The computed verdict (winner, margin, confidence, mechanism, why), then one line per other
    strategy against the winner, and the confidence basis; built from the report's ``verdict``
    (and, with a real replay, the measured verdict and its basis after it)."""
    v = report.get("verdict")
    if not v:
        return []
    out = [verdict_line(v)]
    for o in v.get("others", [])[1:]:
        head = f"tie with {v['winner']}" if o["tie"] else f"{100 * o['margin']:+.1f}% vs {v['winner']}"
        mech = f", {o['mechanism']}" if o.get("mechanism") else ""
        out.append(f"  {o['strategy']}: {head}{mech}: {o['why']}")
    out.append(f"  confidence basis: {v['confidence']['basis']}")
    mv = (report.get("real") or {}).get("verdict")
    if mv:  # the measured verdict beside the simulated one (same times as the measured order)
        out.append("measured " + verdict_line(mv))
        out.append(f"  measured confidence basis: {mv['confidence']['basis']}")
    return out


def flag_lines(report: dict[str, Any]) -> list[str]:
    """One line per flag (assumptions the figures rest on), for under the table."""
    return [f"flag {f['code']}: {f['text']}" for f in report.get("flags") or []]


def _flag_mark(report: dict[str, Any], name: str) -> str:
    """``name`` with a ``*`` when a flag concerns it (the flags are listed under the table)."""
    return name + ("*" if any(f.get("strategy") == name for f in report.get("flags") or []) else "")


def _topo_line(c: dict[str, Any]) -> str:
    keys = [("gpus_per_node", "G={}"), ("nvlink_bandwidth_GBps", "NVLink {} GB/s"),
            ("nvlink_latency_us", "{} us"), ("nic_bandwidth_GBps", "NIC {} GB/s"),
            ("gpu_tflops", "{} TFLOP/s"), ("gpu_compute_efficiency", "eff {}")]
    out = []
    for k, fmt in keys:
        if k in c:
            v = c[k]
            out.append(fmt.format(f"{v:g}" if isinstance(v, float) else v))
    return ", ".join(out)


def sweep_table(report: dict[str, Any]):
    return sweep_grid(report, f"sweep over {report['over']}: simulated layer time (x lower bound) -- "
                              f"{report['model']['name']} on {report['topology']['name']}",
                      lambda s, i: f"{_time(s['layer_time_us'][i])} ({s['ratio_to_lower_bound'][i]:.2f}x)",
                      lambda n: _flag_mark(report, n))


def sweep_grid(rep: dict[str, Any], title: str, cell, head=str):
    """A sweep's table (layer or step level): a row per swept value, a column per strategy
    (``head(name)`` over ``cell(its series, value index)``), then each point's verdict."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column(rep["over"], justify="right")
    for n in rep["strategies"]:
        t.add_column(head(n), justify="right")
    vs = rep.get("verdicts") or []
    if vs:
        t.add_column("verdict (mechanism)")
    for i, v in enumerate(rep["values"]):
        t.add_row(f"{v:g}", *[cell(s, i) for s in rep["strategies"].values()],
                  *([_verdict_cell(vs[i] if i < len(vs) else None)] if vs else []))
    return t


def _verdict_cell(v: dict[str, Any] | None) -> str:
    """``winner +m% (mechanism)``, ``a = b tie``, or ``-``."""
    if not v:
        return "-"
    if v.get("runner_up") is None:
        return v["winner"] or "none fits"
    if v["tie"]:
        return " = ".join([v["winner"], *v.get("tied_with", [])]) + " tie"
    return f"{v['winner']} +{100 * v['margin']:.1f}% ({v.get('mechanism') or '-'})"


def fidelity_table(report: dict[str, Any]):
    from rich.table import Table

    t = Table(title=f"fidelity: measured (gloo, {report['nproc']} processes) vs simulated ({report['topology']['name']})",
              title_justify="left")
    for col in ("case", "strategy", "measured ms", "simulated ms", "error"):
        t.add_column(col, justify="left" if col in ("case", "strategy") else "right")
    for c in report["cases"]:
        t.add_row(c["case"], c["strategy"], f"{c['measured_ms']:.2f}", f"{c['simulated_ms']:.2f}",
                  f"{c['error'] * 100:+.0f}%")
    return t


def fitted_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], wrap: bool = False):
    """A compact table whose cells never truncate: every column is at least as wide as its widest
    value (headers may wrap instead), no vertical rules. Eight-column presets fit in 80 columns.
    ``wrap``: only the first column (the names users type) is kept whole; other cells may wrap."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1), collapse_padding=True)
    for i, col in enumerate(columns):
        width = max([len(str(r[i])) for r in rows] + [1])
        longest_word = max(len(w) for w in str(col).split())
        if wrap and i > 0:
            t.add_column(col, justify="right", min_width=min(longest_word, 8), overflow="fold")
        else:
            t.add_column(col, justify="left" if i == 0 else "right", min_width=width,
                         max_width=max(width, longest_word), no_wrap=i == 0)
    for r in rows:
        t.add_row(*map(str, r))
    return t


def wide_console(min_width: int = 132):
    """A rich console; when the output is not a terminal (a file, a pipe), at least ``min_width``
    columns wide so that report tables do not wrap."""
    from rich.console import Console

    c = Console()
    if not c.is_terminal and c.width < min_width:
        c = Console(width=min_width)
    return c
