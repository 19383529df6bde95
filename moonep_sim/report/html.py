"""One self-contained ``report.html`` from any result: its tables, its plots (PNG embedded as
base64), its verdict and flags, and the command and versions that produced it.

Generic over results: it reads the result's JSON dict (``to_dict()``: ``kind``, ``strategies``,
``verdict`` / ``verdicts``, ``flags`` ...) and a mapping of figure name -> PNG path or bytes, so
a new result kind (a step) gets a report by passing its dict and its figures. Known kinds
(``compare``, ``sweep``) get their headline table; ``steps`` (several recorded steps of
``moonep-sim step --out``: ``{kind: steps, steps: [step documents]}``) a verdict and tables per
step; any other kind gets a table of each strategy's scalar fields and of its own scalar fields. Nothing is fetched: no script, no style
sheet or image from elsewhere.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

from moonep_sim.io import to_jsonable, write_text_atomic

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td.t,th:first-child{text-align:left}.flag{color:#8a5a00}
.verdict{font-size:1.05em;background:#eef6ee;padding:.5em .8em;border-left:4px solid #2ca02c}
.tie{background:#f4f4f4;border-left-color:#999}img{max-width:100%;border:1px solid #ddd;margin:.4em 0}
code,pre{background:#f6f6f6;padding:2px 4px}pre{white-space:pre-wrap}"""

VERSION_PACKAGES = ("moonep-sim", "numpy", "simpy", "matplotlib", "torch")


def versions() -> dict[str, str]:
    """Python and the installed versions of the packages behind the figures."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for p in VERSION_PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def provenance(command: str | None = None) -> dict[str, Any]:
    """The command (default: this process's argv), the versions, the UTC time and the machine."""
    cmd = command if command is not None else shlex.join(["moonep-sim" if sys.argv[0].endswith(
        ("moonep-sim", "__main__.py")) else sys.argv[0], *sys.argv[1:]])
    return {"command": cmd, "versions": versions(),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)"}


def _e(v: Any) -> str:
    return html.escape(str(v))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _table(head: list[str], rows: list[list[Any]], cls: str = "") -> str:
    h = "".join(f"<th>{_e(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f'<td class="{"n" if isinstance(c, (int, float)) else "t"}">{_e(_fmt(c))}</td>'
                                    for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _verdict_html(v: Mapping[str, Any] | None) -> str:
    if not v:
        return "<p>no verdict (fewer than two strategies with figures)</p>"
    if v.get("runner_up") is None:
        return f'<p class="verdict">{_e(v["why"])}</p>'
    head = (f"{' = '.join([v['winner'], *v.get('tied_with', [])])}: a tie" if v["tie"] else
            f"{v['winner']} wins by {100 * v['margin']:.1f}% over {v['runner_up']}")
    out = [f'<p class="verdict{" tie" if v["tie"] else ""}"><b>{_e(head)}</b> -- mechanism: '
           f'<b>{_e(v.get("mechanism") or "-")}</b>; confidence: {_e(v["confidence"]["level"])}<br>{_e(v["why"])}</p>',
           f"<p>confidence basis: {_e(v['confidence']['basis'])}</p>"]
    rows = [[o["strategy"], f"{100 * o['margin']:+.1f}%", "yes" if o["tie"] else "no", o.get("mechanism") or "-",
             o["why"]] for o in v.get("others", [])]
    if rows:
        out.append(_table(["against the winner", "margin", "tie", "mechanism", "why"], rows, "others"))
    return "\n".join(out)


def _compare_table(d: Mapping[str, Any]) -> str:
    parts = list(d.get("critical_parts") or [])
    head = ["strategy", "layer time (us)", *[f"{p} (us)" for p in parts], "x lower bound", "straggler",
            "rows max/mean", "NVLink MiB", "NIC MiB", "weights MiB", "dropped", "padded"]
    rows = []
    for n, s in d["strategies"].items():
        sim, b = s["sim"], s.get("plan_bytes", {})
        rows.append([n, sim["layer_time_us_mean"], *[sim["critical_us_mean"].get(p, 0.0) for p in parts],
                     sim["ratio_to_lower_bound"], sim["straggler"], s["rows_max_over_mean"],
                     b.get("intra_node", 0) / 2**20, b.get("inter_node", 0) / 2**20, s["weight_bytes"] / 2**20,
                     s["dropped"], s["padded"]])
    out = _table(head, rows, "main")
    real = d.get("real")
    if real:  # measured (gloo) beside the same plans simulated on local-gloo
        rr = [[n, r["measured_ms"], r["simulated_ms"], r.get("sim_over_measured") or "-",
               {True: "yes", False: "NO"}.get(r.get("correct"), "-")] for n, r in real["strategies"].items()]
        out += (f"<p>real: gloo, {_e(real['nproc'])} local processes, median over {_e(real['iters'])} interleaved "
                f"iterations, vs the same plans simulated on {_e(real['topology']['name'])}</p>"
                + _table(["strategy", "measured ms", "simulated ms", "sim/measured", "correct"], rr, "real"))
        if real.get("verdict"):  # beside the simulated verdict: who won on this machine, and why
            out += "<h3>Measured verdict (local gloo)</h3>" + _verdict_html(real["verdict"])
    return out


def _sweep_table(d: Mapping[str, Any]) -> str:
    names = list(d["strategies"])
    vs = d.get("verdicts") or []
    rows = []
    step = d.get("level") == "step"   # a step-level sweep: its step time, peak memory and OOM
    for i, x in enumerate(d["values"]):
        r = [x, *[d["strategies"][n]["layer_time_us"][i] if not step else _step_cell(d["strategies"][n], i)
                  for n in names]]
        v = vs[i] if i < len(vs) else None
        if v:
            r.append("none fits" if v.get("no_fit") else
                     " = ".join([v["winner"], *v.get("tied_with", [])]) + " tie" if v["tie"] else
                     f"{v['winner']} +{100 * v['margin']:.1f}% ({v.get('mechanism') or '-'})")
            r.append(v["why"])
        rows.append(r)
    return _table([d["over"], *[f"{n} (us)" for n in names], *(["verdict", "why"] if vs else [])], rows, "main")


def _step_cell(s: Mapping[str, Any], i: int) -> str:
    oom = " OOM" if s["oom"][i] else ""
    return f"{_fmt(s['step_time_us'][i])} us; {_fmt(s['peak_memory_bytes'][i] / 2**30)} GiB{oom}"


def _winner_table(d: Mapping[str, Any]) -> str:
    rows = []
    for y, row in zip(d["y"]["values"], d["cells"]):
        out = [y]
        for c in row:
            v = c.get("verdict") or {}
            who = " = ".join(c["tied"]) + " (tie)" if c.get("tied") else c["winner"]
            conf = (v.get("confidence") or {}).get("level", "-")
            oom = f"; OOM: {', '.join(c['oom'])}" if c.get("oom") else ""   # a step-level cell
            out.append(f"{who} +{100 * c['margin']:.1f}% ({v.get('mechanism') or '-'}; {conf}{oom})")
        rows.append(out)
    return _table([f"{d['y']['knob']} \\ {d['x']['knob']}", *[f"{x:g}" for x in d["x"]["values"]]], rows, "main")


def _generic_tables(d: Mapping[str, Any]) -> str:
    out = []
    st = d.get("strategies")
    if isinstance(st, Mapping) and st and all(isinstance(v, Mapping) for v in st.values()):
        keys = [k for k, v in next(iter(st.values())).items() if isinstance(v, (int, float, str, bool))]
        out.append(_table(["strategy", *keys], [[n, *[v.get(k, "") for k in keys]] for n, v in st.items()], "main"))
    scal = [[k, v] for k, v in d.items() if isinstance(v, (int, float, str, bool)) and k != "kind"]
    if scal:
        out.append(_table(["field", "value"], scal))
    return "\n".join(out)


def _figure_src(v: bytes | str | os.PathLike) -> str:
    data = v if isinstance(v, (bytes, bytearray, memoryview)) else Path(v).read_bytes()
    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode("ascii")


def render_html(data: Mapping[str, Any], figures: Mapping[str, bytes | str | os.PathLike] | None = None, *,
                title: str | None = None, prov: Mapping[str, Any] | None = None) -> str:
    """The report as one HTML document (see the module docstring). ``prov``: :func:`provenance`."""
    kind = data.get("kind", "result")
    prov = dict(prov or data.get("provenance") or provenance())
    model = data.get("model")
    routing = data.get("routing") if isinstance(data.get("routing"), Mapping) else {}
    label = routing.get("label") or (model.get("name", "") if isinstance(model, Mapping) else str(model or ""))
    title = title or f"moonep-sim {kind}: {label}"
    body = [f"<h1>{_e(title)}</h1>"]
    topo = data.get("topology") or {}
    if not isinstance(topo, Mapping):  # a winner map names its topology only
        topo = {"name": str(topo)}
    if topo:
        body.append(f"<p>simulated on <b>{_e(topo.get('name', '?'))}</b>; cluster {_e(data.get('cluster', ''))}</p>")
    body.append("<h2>Verdict</h2>")
    steps = data.get("steps") if kind == "steps" else None  # several recorded steps (moonep-sim step --out)
    if steps:
        body += [f"<h3>recorded step {i}</h3>" + _verdict_html(d.get("verdict")) for i, d in enumerate(steps)]
    elif "verdicts" in data or "cells" in data:
        body.append("<p>one verdict per point (cell), in the table below</p>")
    else:
        body.append(_verdict_html(data.get("verdict")))
    flags = data.get("flags") or []
    body.append("<h2>Flags</h2>")
    body.append("<ul>" + "".join(f'<li class="flag"><b>{_e(f["code"])}</b>'
                                 f'{" (" + _e(f["strategy"]) + ")" if f.get("strategy") else ""}: {_e(f["text"])}</li>'
                                 for f in flags) + "</ul>" if flags else "<p>none: no figure rests on an assumption "
                                                                      "this project knows to flag</p>")
    body.append("<h2>Tables</h2>")
    if kind == "compare" and "strategies" in data:
        body.append(_compare_table(data))
    elif kind == "sweep" and "values" in data:
        body.append(_sweep_table(data))
    elif kind == "winner_map" and "cells" in data:
        body.append(_winner_table(data))
    elif steps:
        body += [f"<h3>recorded step {i}</h3>" + _generic_tables(d) for i, d in enumerate(steps)]
    else:
        body.append(_generic_tables(data))
    if figures:
        body.append("<h2>Plots</h2>")
        for name, v in figures.items():
            body.append(f'<figure><img alt="{_e(name)}" src="{_figure_src(v)}"><figcaption>{_e(name)}</figcaption>'
                        "</figure>")
    body.append("<h2>How it was produced</h2>")
    rows = [["command", prov.get("command", "")], ["date (UTC)", prov.get("date_utc", "")],
            ["machine", prov.get("machine", "")], *[[k, v] for k, v in (prov.get("versions") or {}).items()]]
    if topo:
        rows += [[f"topology {k}", v] for k, v in (topo.get("constants") or {}).items()
                 if isinstance(v, (int, float, str))]
    body.append(_table(["", ""], rows, "provenance"))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_html(data: Mapping[str, Any], dest: str | os.PathLike,
               figures: Mapping[str, bytes | str | os.PathLike] | None = None, **kw: Any) -> Path:
    """Write :func:`render_html` to ``dest`` atomically; returns the path."""
    dest = Path(dest)
    write_text_atomic(dest, render_html(data, figures, **kw))
    return dest


def write_report(doc: Mapping[str, Any], staging: Path, out: Path,
                 figures: Mapping[str, bytes | str | os.PathLike]) -> dict[str, str]:
    """A command's report folder: ``doc`` with its provenance and the final paths of its files,
    written as report.json and report.html (embedding ``figures``, the PNGs already written under
    ``staging`` as ``<name>.png``) into ``staging``, the folder that becomes ``out`` once complete
    (``moonep_sim.io.staged_dir``); a provenance ``doc`` already carries is kept. Returns {what: final path}."""
    import json

    files = {k: str(out / f"{k}.png") for k in figures}
    files.update(html=str(out / "report.html"), report=str(out / "report.json"))
    d = dict(doc)
    d.setdefault("provenance", provenance())
    d["files"] = dict(files)
    write_html(d, staging / "report.html", figures)
    write_text_atomic(staging / "report.json", json.dumps(to_jsonable(d, lenient=True), indent=1))
    return files


__all__ = ["provenance", "render_html", "versions", "write_html", "write_report"]
