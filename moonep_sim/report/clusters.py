"""The multi-cluster comparison (``moonep-sim compare --topology a,b,...``, benchmarks/cluster_compare.py)
rendered from its document (:func:`moonep_sim.experiments.clusters.compare_clusters`): one table
(a row per cluster and point), "does the winner change?" one line per point, the flags beside."""

from __future__ import annotations

from typing import Any


def _call(r: dict[str, Any]) -> str:
    v = r["verdict"]
    if v.get("tie"):
        return "tie: " + " / ".join([v["winner"], *(v.get("tied_with") or [v["runner_up"]])]) + \
            f" (+{100 * v['margin']:.1f}%)"
    if v.get("runner_up") is None:
        return str(v["winner"])
    extra = "".join(f"; {x}" for x in (v.get("mechanism"), v.get("confidence") and f"confidence {v['confidence']}")
                    if x)
    return f"{v['winner']} (+{100 * v['margin']:.1f}% to {v['runner_up']}{extra})"


def cluster_cell(r: dict[str, Any]) -> str:
    """cluster (G per node; NVLink / NIC GB/s per GPU, effective; TFLOP/s)."""
    return (f"{r['topology']} ({r['gpus_per_node']}; {r['nvlink_GBps']:.0f} / {r['nic_GBps']:.0f}; "
            f"{r['tflops']:.0f})")


def impl_cell(r: dict[str, Any]) -> str:
    k = r.get("kernels") or {}
    return ", ".join(f"{d['impl']}" + ("" if d["source"] == "native" else f" ({d['source']})")
                     for s, d in k.items() if s in ("deepep", "deepep-ll")) or "-"


def _marks(doc: dict[str, Any], r: dict[str, Any], s: str) -> str:
    return "*" if any(f.get("strategy") == s and f.get("topology") == r["topology"] for f in doc.get("flags") or []) else ""


def clusters_table(doc: dict[str, Any]):
    """The one table: per (point,) cluster the strategies' layer times, the verdict and its why."""
    from rich.table import Table

    pts = doc["points"]
    strategies = doc["strategies"]
    t = Table(title=f"the same comparison on {len(doc['topologies'])} clusters, EP{doc['ranks']}: mean layer time "
                    f"(ms) per strategy; the verdict of each cluster's compare", title_justify="left")
    if len(pts) > 1:
        t.add_column("point")
    t.add_column("cluster (G; NVLink / NIC GB/s; TFLOP/s)", max_width=24)
    t.add_column("deepep impl", max_width=16)
    for s in strategies:
        t.add_column(s, justify="right", no_wrap=True)
    t.add_column("verdict (margin; mechanism; confidence)", max_width=30)
    t.add_column("why", min_width=40)
    for p in pts:
        for r in p["clusters"]:
            best = min(r["layer_time_us"].values())
            cells = [f"{r['layer_time_us'][s] / 1e3:.2f}{_marks(doc, r, s)}" for s in strategies]
            cells = [f"[green]{c}[/green]" if r["layer_time_us"][s] == best else c for c, s in zip(cells, strategies)]
            row = ([p["label"]] if len(pts) > 1 else []) + [cluster_cell(r), impl_cell(r), *cells, _call(r),
                                                            r["verdict"].get("why") or "-"]
            t.add_row(*row)
    return t


def change_line(p: dict[str, Any], bold: bool = False) -> str:
    """Does the winner change? One line for one point."""
    b = "**" if bold else ""
    wc = p["winner_change"]
    margins = ", ".join(f"{r['topology']} +{100 * r['verdict']['margin']:.1f}% ({r['verdict']['runner_up']})"
                        for r in p["clusters"] if r["verdict"].get("runner_up"))
    return (f"{p['label']}: " + "; ".join(f"{b}{w['call']}{b} on {', '.join(w['topologies'])}" for w in wc["winners"])
            + (" (the winner changes with the cluster)" if wc["changes"] else " (the same winner on every cluster)")
            + (f". Runner-up margins: {margins}." if margins else "."))


def flag_lines(doc: dict[str, Any]) -> list[str]:
    """The flags beside the table, one line per (code, text) with the clusters it holds on (the
    cluster's name in a text shared by several reads "each")."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for f in doc.get("flags") or []:
        text = f["text"].replace(f" on {f.get('topology')}", " on each") if f.get("topology") else f["text"]
        by.setdefault((f["code"], text), []).append(f)
    return [f"flag {code} ({', '.join(f.get('topology') or '-' for f in fs)}): {text if len(fs) > 1 else fs[0]['text']}"
            for (code, text), fs in by.items()]


def clusters_lines(doc: dict[str, Any]) -> list[str]:
    """Under the table: does the winner change (a line per point), the kernel families and the flags."""
    out = ["does the winner change?"] + [f"  {change_line(p)}" for p in doc["points"]]
    first = doc["points"][0]["clusters"]
    kern = [f"{r['topology']}: {d['impl']} ({d['reason']})" for r in first for s, d in (r.get("kernels") or {}).items()
            if s == "deepep"]
    if kern:
        out.append("deepep's kernel family per cluster (" + doc.get("native_kernels", "") + "): " + "; ".join(kern))
    out += flag_lines(doc)
    if doc.get("flags"):
        out.append("*: a flag above concerns this strategy on this cluster")
    return out


__all__ = ["change_line", "cluster_cell", "clusters_lines", "clusters_table", "flag_lines",
           "impl_cell"]
