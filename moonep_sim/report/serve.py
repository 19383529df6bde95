"""Renders serving results (``moonep-sim serve``): the terminal table, the latency CDF and the
throughput-per-GPU vs throughput-per-user Pareto front. Takes the plain dicts of
``moonep_sim.experiments.serve.run_serve``; imports no executor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from moonep_sim.report.plots import _plt, _save


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f}"


def serve_table(doc: dict[str, Any], load: dict[str, Any] | None = None):
    """A rich Table of one load: latency percentiles, throughput, SLO, KV and cost per strategy."""
    from rich.table import Table

    s = doc["setup"]
    ld = load or doc["loads"][0]
    t = Table(title=f"{s['model']} on {s['topology']}, {s['gpus']} GPUs: {s['deployment_label']}; {ld['load']}")
    cols = ("strategy", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p99", "E2E p99 s", "out/s/GPU", "in/s/GPU",
            "tok/s/user", "SLO", "goodput/GPU", "KV max", "preempt", "$/M out", "model err")
    for c in cols:
        t.add_column(c, justify="left" if c == "strategy" else "right")
    for name, f in ld["strategies"].items():
        pc = lambda k: "/".join(_ms(f[k][p]) for p in ("p50", "p99"))
        err = [e.get("median_abs_rel_error") for e in (f.get("steptime_error") or {}).values()
               if e and e.get("median_abs_rel_error") is not None]
        usd = f.get("usd_per_million_output_tokens")
        t.add_row(name, pc("ttft_s"), pc("tpot_s"), _ms(f["itl_s"]["p99"]),
                  "-" if f["e2e_s"]["p99"] is None else f"{f['e2e_s']['p99']:,.1f}",
                  f"{f['output_tokens_per_s_per_gpu']:,.1f}", f"{f['input_tokens_per_s_per_gpu']:,.1f}",
                  "-" if f["tokens_per_s_per_user"] is None else f"{f['tokens_per_s_per_user']:,.1f}",
                  "-" if f["slo_attainment"] is None else f"{f['slo_attainment']:.1%}",
                  "-" if f["goodput_tokens_per_s_per_gpu"] is None else f"{f['goodput_tokens_per_s_per_gpu']:,.1f}",
                  f"{f['kv_use_max']:.0%}", str(f["preemptions"]), "-" if usd is None else f"{usd:,.3f}",
                  f"{max(err):.1%}" if err else "-")
    return t


def latency_cdf(doc: dict[str, Any], dest: str | os.PathLike) -> Path:
    """TTFT and TPOT CDFs per strategy (the first load), from ``doc["cdf"]``."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT (ms)"), (axes[1], "tpot_s", "TPOT (ms)")):
        for name, q in doc["cdf"].items():
            if q.get(key):
                ax.plot([v * 1e3 for v in q[key]], [p / 100 for p in q["percent"]], label=name)
        slo = (doc["setup"].get("slo") or {}).get(key[:4])
        if slo:
            ax.axvline(slo * 1e3, color="k", ls="--", lw=0.8, label="SLO")
        ax.set_xlabel(label)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"latency CDF: {doc['setup']['model']}, {doc['setup']['deployment_label']}", fontsize=9)
    return _save(fig, dest)


def pareto_plot(points: Sequence[dict[str, Any]], dest: str | os.PathLike, title: str = "") -> Path:
    """Output tokens/s/GPU against tokens/s per user, every point by strategy, the front of each
    strategy joined (higher is better on both axes)."""
    from moonep_sim.serve.metrics import pareto  # a pure function on numbers

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(p["strategy"] for p in points))
    for n in names:
        ps = [p for p in points if p["strategy"] == n and p.get("tokens_per_s_per_user") is not None]
        xy = [(p["tokens_per_s_per_user"], p["output_tokens_per_s_per_gpu"]) for p in ps]
        sc = ax.scatter([x for x, _ in xy], [y for _, y in xy], s=14, alpha=0.5, label=n)
        front = pareto(xy)
        ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], color=sc.get_facecolor()[0], lw=1.5)
    ax.set_xlabel("tokens/s per user (1 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "throughput per GPU vs per user (Pareto front joined)", fontsize=9)
    return _save(fig, dest)


def print_search(doc: dict[str, Any]) -> None:
    """The search's Pareto front per strategy, the best deployment per strategy with its command,
    and why the bests differ."""
    from rich.table import Table

    from moonep_sim.report.tables import wide_console

    c = wide_console()
    s = doc["setup"]
    rows = doc["points"]
    t = Table(title=f"Pareto front: {s['model']} on {s['topology']}, {s['gpus']} GPUs, {s['load']} "
                    f"({s['deployments']} deployments x {len(s['strategies'])} strategies)")
    for col in ("strategy", "deployment", "tok/s/user", "out tok/s/GPU", "SLO met", "goodput tok/s/GPU"):
        t.add_column(col)
    for name, idx in doc["pareto"].items():
        for i in idx:
            r = rows[i]
            t.add_row(name, r["deployment"], f"{r['tokens_per_s_per_user']:.1f}", f"{r['output_tokens_per_s_per_gpu']:.1f}",
                      "-" if r["slo_attainment"] is None else f"{r['slo_attainment']:.0%}",
                      "-" if r["goodput_tokens_per_s_per_gpu"] is None else f"{r['goodput_tokens_per_s_per_gpu']:.1f}")
    c.print(t)
    for name, i in doc["best"].items():
        r = rows[i]
        c.print(f"best for {name}: {r['deployment']} (goodput {r['goodput_tokens_per_s_per_gpu'] or 0:.1f}, "
                f"{r['output_tokens_per_s_per_gpu']:.1f} out tok/s/GPU)\n  {r['command']}", highlight=False,
                markup=False)
    for d in doc["differs"]:
        c.print("differs: " + d["text"], highlight=False, markup=False)
    err = doc.get("steptime_model_error")
    c.print(f"step-time model median held-out error: {'-' if err is None else f'{err:.1%}'}", highlight=False,
            markup=False)


__all__ = ["latency_cdf", "pareto_plot", "print_search", "serve_table"]
