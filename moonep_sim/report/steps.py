"""Renders step results (``moonep-sim step``): the terminal table and the Gantt chart.

Takes the plain dicts of :class:`moonep_sim.experiments.step.StepResult` (``to_dict()``) and the
timeline records of ``moonep_sim.step.schedule.timeline_records``; imports no executor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from moonep_sim.report.plots import _plt, _save


def _t(us: float) -> str:
    return f"{us / 1e3:,.2f} ms" if us >= 1e3 else f"{us:,.1f} us"


def step_table(doc: dict[str, Any]):
    """A rich Table: the step time first, then what share of it each strategy's communication is."""
    from rich.table import Table

    s = doc["setup"]
    title = (f"{s['mode']} step of {s['model']} on {s['topology']}, EP{s['ranks']} ({s['gpus_per_node']} per node), "
             f"{s['tokens_per_rank']} tokens/rank, context {s['context']}, overlap {s['overlap']}")
    t = Table(title=title)
    for col in ("strategy", "step time", "exposed comm (share)", "tokens/s/GPU", "MFU", "peak memory", "OOM",
                "rows max/mean", "slowest layer"):
        t.add_column(col, justify="left" if col in ("strategy", "slowest layer") else "right")
    for name, d in doc["strategies"].items():
        slow = max(d["layers"], key=lambda x: x["time_us"]) if d["layers"] else None
        cap = d["gpu_memory_bytes"]
        oom = "?" if d["oom"] is None else ("OOM" if d["oom"] else "fits")
        st = f"L{slow['layer']} {slow['kind']}: {slow['straggler'].get('cause')}" if slow else ""
        t.add_row(name, _t(d["step_time_us"]), f"{_t(d['exposed_comm_us'])} ({d['comm_share']:.0%})",
                  f"{d['tokens_per_s_per_gpu']:,.0f}", f"{d['mfu']:.1%}",
                  f"{d['peak_memory_bytes'] / 2**30:,.1f} / {cap / 2**30:,.0f} GiB" if cap else
                  f"{d['peak_memory_bytes'] / 2**30:,.1f} GiB", oom, f"{d['rows_max_mean']:.2f}", st)
    return t


def per_step_table(docs: Sequence[dict[str, Any]]):
    """Several recorded steps: one row per step (its id, tokens, each strategy's step time, the
    fastest), the compact view of what :func:`step_table` shows per step."""
    from rich.table import Table

    names = list(docs[0]["strategies"])
    t = Table(title=f"step time per recorded step ({len(docs)} steps)")
    for col in ("step", "tokens", *names, "fastest"):
        t.add_column(col, justify="left" if col in ("step", "fastest") else "right")
    for d in docs:
        st = d["strategies"]
        best = min(names, key=lambda n: (bool(st[n].get("oom")) or bool(st[n].get("dropped")), st[n]["step_time_us"]))
        t.add_row(str(d["setup"].get("step_id")), f"{d['setup'].get('step_tokens')}",
                  *[_t(st[n]["step_time_us"]) for n in names], best)
    return t


def aggregate_table(agg: dict[str, Any]):
    """The per-step aggregate (``doc["aggregate"]``): per strategy the step time's token-weighted
    mean, median, p90 and worst step, and the steps it was fastest in."""
    from rich.table import Table

    n = agg["steps"]
    tok = [x for x in agg.get("tokens") or [] if x is not None]
    t = Table(title=f"step time over {n} recorded step(s) of {sum(tok):,} tokens (each step its own batch)")
    for col in ("strategy", "token-weighted mean", "median", "p90", "worst (step)", "tokens/s/GPU (mean)",
                "fastest in"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    rows = agg["strategies"]
    for name in sorted(rows, key=lambda k: rows[k]["step_time_us"]["token_weighted_mean"]):
        a = rows[name]["step_time_us"]
        w = agg["wins"].get(name)
        t.add_row(name, _t(a["token_weighted_mean"]), _t(a["median"]), _t(a["p90"]),
                  f"{_t(a['worst'])} ({a['worst_step']})",
                  f"{rows[name]['tokens_per_s_per_gpu']['token_weighted_mean']:,.0f}",
                  f"{w} of {n}" if w is not None else "- (OOM or dropped rows)")
    return t


def aggregate_lines(agg: dict[str, Any]) -> list[str]:
    """The aggregate's verdict line: the fastest by the token-weighted mean, and its step wins."""
    rows = agg["strategies"]
    ok = [k for k in rows if k not in set(agg.get("excluded_from_wins") or ())] or list(rows)
    best = min(ok, key=lambda k: rows[k]["step_time_us"]["token_weighted_mean"])
    out = [f"over the steps: {best} is fastest by the token-weighted mean step time and fastest in "
           f"{agg['wins'].get(best, 0)} of {agg['steps']} step(s)"]
    if agg.get("excluded_from_wins"):
        out.append("not ranked (out of memory or dropped rows in some step): " + ", ".join(agg["excluded_from_wins"]))
    return out


def step_footer(doc: dict[str, Any]) -> list[str]:
    """Lines under the table: stand-ins and reused layers, static buffers and why they cost."""
    s = doc["setup"]
    out = []
    if s.get("stand_ins"):
        sk = s.get("standin_skew") or {}
        at = (f"maxvio {sk['maxvio']:.3g}, measured over {sk['tokens']:,} tokens of {sk['layers']} recorded layer(s), "
              "every recorded step pooled" if sk else "the trace's measured skew")
        out.append(f"{s['stand_ins']} MoE layer(s) are STAND-INS (the trace lacks them): drawn at {at}; "
                   "see layers_routing in --json")
    if s.get("merged") and s.get("mode") != "decode":
        out.append("steps merged: the recorded steps are costed as one batch that never ran together; sequences "
                   f"keep one pass's length (context {s['context']})")
    elif s.get("merged"):
        out.append(f"steps merged: the recorded steps are costed as one decode batch of {s['tokens_per_rank']} "
                   f"sequences per rank that never ran together, at an ASSUMED context of {s['context']} (the trace "
                   "records no KV context: give --context)")
    if s.get("zero_token_ranks"):
        out.append(f"{s['zero_token_ranks']} rank(s) hold no token in this step (fewer tokens than ranks)")
    if s.get("reused_layers"):
        out.append(f"{s['reused_layers']} MoE layer(s) reuse another layer's routing and simulation "
                   f"(--distinct-layers {s['distinct_layers']})")
    for name, d in doc["strategies"].items():
        S = d.get("static_tokens")
        if S:
            out.append(f"{name}: its static Buffer holds {S} tokens per rank, so every pass is padded from "
                       f"{s['tokens_per_rank']} to {S} tokens: it dispatches, computes and combines "
                       f"{S / max(s['tokens_per_rank'], 1):.0f}x the rows a dynamic all-to-all does")
    for name, d in doc["strategies"].items():
        pad, real = d.get("padded_rows_per_rank", 0.0), d.get("real_rows_per_rank", 0.0)
        why = []
        if real > 0 and pad > 1.5 * real:
            why.append(f"its busiest rank holds {pad:,.0f} rows per MoE layer for at most {real:,.0f} real ones (padding)")
        if d.get("copies_per_layer", 0.0) >= 0.5:
            why.append(f"it copies {d['copies_per_layer']:.1f} expert(s) per MoE layer (weights moved every step)")
        if why:
            out.append(f"{name}: " + "; ".join(why))
    if s.get("compute_profile"):
        out.append(f"compute times from the profile {s['compute_profile']}")
    else:
        src = s.get("compute_sources") or {}
        meas = sorted(n for n, v in src.items() if str(v).startswith("measured"))
        roof = sorted(n for n, v in src.items() if v == "roofline-compute")
        if meas:
            label = src[meas[0]].split(", per-expert")[0]
            out.append(f"compute: {', '.join(meas)} {label}; roofline-compute: {', '.join(roof) or 'none'}; "
                       "communication: each MoE layer simulated alone")
        else:
            out.append("compute: roofline-compute (defaults, docs/steps.md; no measured table for this GPU or "
                       "aiconfigurator-core not installed); communication: each MoE layer simulated alone")
    return out


def step_gantt(records: Sequence[dict[str, Any]], end_by_rank: dict[int, float], dest: str | os.PathLike,
               title: str = "", max_ranks: int = 8) -> Path:
    """Compute and communication streams per rank, the slowest rank at the top (at most
    ``max_ranks`` ranks, slowest first)."""
    plt = _plt()
    ranks = sorted(end_by_rank, key=lambda r: -end_by_rank[r])[:max_ranks]
    colours = {"expert": "#d62728", "expert_bwd": "#d62728", "attn_core": "#1f77b4", "attn_proj": "#17becf",
               "shared_expert": "#ff7f0e", "dense_ffn": "#8c564b", "dispatch": "#2ca02c", "combine": "#9467bd",
               "combine_bwd": "#2ca02c", "dispatch_bwd": "#9467bd", "grad_reduce": "#e377c2", "lm_head": "#bcbd22",
               "loss": "#dbdb8d", "norm": "#c7c7c7", "router": "#aec7e8", "embed": "#c49c94"}
    fig, ax = plt.subplots(figsize=(12, 0.7 * 2 * len(ranks) + 1.5))
    t_max = max(end_by_rank.values()) if end_by_rank else 1.0
    unit, f = ("ms", 1e-3) if t_max >= 1e3 else ("us", 1.0)
    labels, pos = [], {}
    for k, r in enumerate(ranks):
        for j, stream in enumerate(("compute", "comm")):
            y = (len(ranks) - 1 - k) * 2 + (1 - j)
            pos[(r, stream)] = y
            labels.append((y, f"rank {r} {stream}"))
    for rec in records:
        y = pos.get((rec["rank"], rec["stream"]))
        if y is None or rec["end_us"] <= rec["start_us"]:
            continue
        base = rec["name"].split(".")[-1]
        base = base[:-4] if base.endswith("_bwd") and base[:-4] in colours and base not in colours else base
        ax.broken_barh([(rec["start_us"] * f, (rec["end_us"] - rec["start_us"]) * f)], (y - 0.4, 0.8),
                       facecolors=colours.get(base, "#7f7f7f"), edgecolor="none")
    ax.set_yticks([y for y, _ in labels])
    ax.set_yticklabels([s for _, s in labels])
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or "step timeline (slowest rank first)")
    from matplotlib.patches import Patch

    seen = sorted({n for n in (rec["name"][:-4] if rec["name"].endswith("_bwd") and rec["name"] not in colours
                               else rec["name"] for rec in records) if n in colours})
    ax.legend(handles=[Patch(color=colours[n], label=n) for n in seen], loc="upper right", fontsize=7, ncol=4)
    return _save(fig, dest)


__all__ = ["aggregate_lines", "aggregate_table", "per_step_table", "step_footer", "step_gantt", "step_table"]
