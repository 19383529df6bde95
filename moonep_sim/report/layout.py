"""Renders a step under a parallel layout (``moonep-sim step --tp ... --pp ...``) and a layout
search: terminal tables from the plain dicts of ``StepResult.to_dict()`` and
``moonep_sim.experiments.layout_search``; imports no executor."""

from __future__ import annotations

from typing import Any


def _t(us: float) -> str:
    return f"{us / 1e3:,.2f} ms" if us >= 1e3 else f"{us:,.1f} us"


def layout_table(doc: dict[str, Any]):
    """A rich Table of a layout step: step time, tokens/s per GPU, MFU, pipeline bubble, exposed
    DP and TP/CP communication, the peak memory of the fullest pipeline rank."""
    from rich.table import Table

    s = doc["setup"]
    p = s["parallel"]
    title = (f"{s['mode']} step of {s['model']} on {s['topology']}, {s['gpus']} GPUs as {s['layout']} "
             f"(pp schedule {p['pp_schedule']}, {p['micro_batches']} micro-batch(es) of {p['micro_batch_size']}, "
             f"ZeRO {p['zero']}); MoE layers over EP groups of {s['ep_group_ranks']} ranks "
             f"({s['ep_group_gpus_per_node']} per node), {s['tokens_per_rank']} tokens per rank per micro-batch, "
             f"context {s['context']}, overlap {s['overlap']}")
    t = Table(title=title)
    for col in ("strategy", "step time", "tokens/s/GPU", "MFU", "bubble", "DP exposed", "TP/CP comm",
                "peak memory (pp rank)", "OOM"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for name, d in doc["strategies"].items():
        slow = d["pipeline_ranks"][d["slowest_rank"]]
        cap = d["gpu_memory_bytes"]
        oom = "?" if d["oom"] is None else ("OOM" if d["oom"] else "fits")
        mem = f"{d['peak_memory_bytes'] / 2**30:,.1f}" + (f" / {cap / 2**30:,.0f} GiB" if cap else " GiB")
        t.add_row(name, _t(d["step_time_us"]), f"{d['tokens_per_s_per_gpu']:,.0f}", f"{d['mfu']:.1%}",
                  f"{d['pipeline']['bubble_fraction']:.1%}", _t(slow["dp_grad_exposed_us"] + slow["param_gather_us"]),
                  _t(sum(x["tp_cp_comm_us"] for x in d["stages"])), f"{mem} ({d['peak_memory_pp_rank']})", oom)
    return t


def layout_footer(doc: dict[str, Any]) -> list[str]:
    """What the layout step assumed (one line each)."""
    s = doc["setup"]
    out = [f"assumed: {a}" for a in s.get("assumptions", ())]
    if s.get("reused_layers"):
        out.append(f"{s['reused_layers']} MoE layer(s) reuse another layer's routing and simulation "
                   f"(--distinct-layers {s['distinct_layers']})")
    return out


def search_table(rep: dict[str, Any]):
    """A rich Table of a layout search: per strategy, its ranked layouts (fits first)."""
    from rich.table import Table

    t = Table(title=(f"layouts of {rep['model']} ({rep['mode']}) on {rep['gpus']} GPUs of {rep['topology']}: "
                     f"{rep['valid']} valid, {rep['fit']} fit in memory ({rep['seconds']:.1f} s, "
                     f"{rep.get('cpu_seconds', 0.0):.1f} CPU s)"))
    for col in ("strategy", "rank", "layout", "tokens/s/GPU", "step time", "bubble", "peak memory", "fits"):
        t.add_column(col, justify="left" if col in ("strategy", "layout") else "right")
    for name, rows in rep["ranked"].items():
        for i, r in enumerate(rows):
            t.add_row(name if i == 0 else "", str(i + 1), r["layout"], f"{r['tokens_per_s_per_gpu']:,.0f}",
                      _t(r["step_time_us"]), f"{r['bubble_fraction']:.1%}",
                      f"{r['peak_memory_bytes'] / 2**30:,.1f} GiB", "yes" if r["fits"] else "OOM")
    return t


__all__ = ["layout_footer", "layout_table", "search_table"]
