"""``moonep-sim models``: list the model presets."""

from __future__ import annotations

from moonep_sim.cli.common import console, print_json
from moonep_sim.models import PRESETS


def register(sub) -> None:
    p = sub.add_parser("models", help="list model presets (experts, top-k, widths, row and weight bytes)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.json:
        print_json([m.to_dict() for m in PRESETS.values()])
        return 0
    from moonep_sim.report.tables import fitted_table

    rows = [[m.name, str(m.num_experts), str(m.top_k), str(m.shared_experts), str(m.hidden), str(m.expert_ffn),
             str(m.dispatch_hidden), str(m.row_bytes_bf16), str(m.row_bytes_fp8),
             f"{m.expert_weight_bytes / 2**20:.1f}"] for m in PRESETS.values()]
    t = fitted_table("model presets (row: dispatched row width; B: bytes of one row; expert MiB: gate+up+down, bf16)",
                     ("name", "E", "K", "shared", "hidden", "H'", "row", "bf16 B", "fp8 B", "expert MiB"), rows)
    c = console()
    c.print(t)
    for m in PRESETS.values():
        if m.note or m.source:
            c.print(f"[dim]{m.name}: {'; '.join(x for x in (m.note, m.source and 'source: ' + m.source) if x)}[/dim]")
    return 0
