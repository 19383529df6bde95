"""``moonep-sim models``: list the model presets."""

from __future__ import annotations

from moonep_sim.cli.common import console, print_json
from moonep_sim.models import PRESETS


def register(sub) -> None:
    p = sub.add_parser("models", help="list model presets (experts, top-k, widths, row and weight bytes, layers, "
                                      "parameters)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _count(n: int) -> str:
    return f"{n / 1e12:.2f}T" if n >= 1e12 else f"{n / 1e9:.1f}B"


def _pattern(m) -> str:
    """The layers' attention kinds by count, in first-seen order (``69 linear + 24 gated-mla``)."""
    kinds = [m.attention_kind(l) for l in range(m.layers)]
    return " + ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))


def run(args) -> int:
    from moonep_sim.step.stack import parameter_counts  # the attention registry's counts (no simulator import)

    params = {name: parameter_counts(m) for name, m in PRESETS.items()}
    if args.json:
        print_json([{**m.to_dict(), "parameters": params[m.name]} for m in PRESETS.values()])
        return 0
    from moonep_sim.report.tables import fitted_table

    rows = [[m.name, str(m.num_experts), str(m.top_k), str(m.shared_experts), str(m.hidden), str(m.expert_ffn),
             str(m.dispatch_hidden), str(m.row_bytes_bf16), str(m.row_bytes_fp8),
             f"{m.expert_weight_bytes / 2**20:.1f}"] for m in PRESETS.values()]
    t = fitted_table("model presets (row: dispatched row width; B: bytes of one row; expert MiB: gate+up+down, bf16)",
                     ("name", "E", "K", "shared", "hidden", "H'", "row", "bf16 B", "fp8 B", "expert MiB"), rows)
    c = console()
    c.print(t)
    c.print(fitted_table("layers and parameters (total: every weight; active: what one token multiplies by, the "
                         "input embedding left out)", ("name", "layers", "MoE", "attention", "total", "active"),
                         [[m.name, str(m.layers), str(m.moe_layers), _pattern(m), _count(params[m.name]["total"]),
                           _count(params[m.name]["active"])] for m in PRESETS.values()]))
    for m in PRESETS.values():
        if m.note or m.source:
            c.print(f"[dim]{m.name}: {'; '.join(x for x in (m.note, m.source and 'source: ' + m.source) if x)}[/dim]")
    return 0
