"""``moonep-sim strategies``: list the dispatch strategies with their options and defaults, and
where each strategy's real library runs (a simulation outside it is flagged in results)."""

from __future__ import annotations

from moonep_sim.cli.common import console, print_json


def register(sub) -> None:
    p = sub.add_parser("strategies", help="list the dispatch strategies with their options and defaults")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from moonep_sim.analysis.flags import library_of
    from moonep_sim.strategies import available

    specs = available()
    if args.json:
        print_json({n: {"summary": s.summary,
                        "real_library": {"name": library_of(n)[0], "runs": library_of(n)[1],
                                         "max_nvlink_domains": library_of(n)[2]},
                        "options": {k: {"type": getattr(o.type, "__name__", str(o.type)), "default": o.default,
                                        "help": o.help, "choices": list(o.choices) if o.choices else None}
                                    for k, o in s.options.items()}} for n, s in specs.items()})
        return 0
    c = console()
    for name, s in specs.items():
        c.print(f"[bold]{name}[/bold]: {s.summary}")
        lib, where, _ = library_of(name)
        c.print(f"    real library: {lib}; runs on: {where}", highlight=False)
        for k, o in s.options.items():
            choices = f"; one of {', '.join(map(str, o.choices))}" if o.choices else ""
            c.print(f"    {k}={o.default!r} ({getattr(o.type, '__name__', o.type)}{choices}): {o.help}", highlight=False)
    c.print("[dim]pass options as --opt STRATEGY.key=value (compare, sweep) or --opt key=value (plan, simulate)[/dim]")
    return 0
