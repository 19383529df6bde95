"""``moonep-sim topologies``: list the topology presets with their constants and sources."""

from __future__ import annotations

from moonep_sim.cli.common import console, print_json


def register(sub) -> None:
    p = sub.add_parser("topologies", help="list the simulator's topology presets, constants and sources")
    p.add_argument("--json", action="store_true", help="print every constant as JSON")
    p.add_argument("--show", metavar="NAME_OR_FILE", default=None, help="print one topology as TOML")
    p.set_defaults(func=run)


def run(args) -> int:
    from moonep_sim.sim.topology import calibrated_topology_path, list_topologies, load_topology

    if args.show:
        print(load_topology(args.show).to_toml(), end="")
        return 0
    topos = [load_topology(n) for n in list_topologies()]
    cal = calibrated_topology_path()
    if args.json:
        print_json({"topologies": [dict(t.constants(), file=t.path) for t in topos],
                    "calibrated_local_gloo": str(cal), "calibrated_exists": cal.is_file()})
        return 0
    from moonep_sim.report.tables import fitted_table

    def n(v: float) -> str:  # short, never in exponent form
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"

    def nvl(t) -> str:
        s = f"{n(t.nvlink_bandwidth_GBps)}x{n(t.nvlink_efficiency)}"
        return s + (f" (mesh, {n(t.nvlink_peer_GBps)} per peer)" if t.nvlink_peer_GBps else "")

    def nic(t) -> str:
        s = f"{n(t.nic_bandwidth_GBps)}x{n(t.nic_efficiency)}"
        if t.nic_rails_per_node:
            s += f", {t.nic_rails_per_node} rails ({n(t.nics_per_gpu)} per GPU)"
        return s + (f", {n(t.nic_message_rate_Mps)} M msg/s per NIC" if t.nic_message_rate_Mps else "")

    rows = [[t.name, str(t.gpus_per_node) + (f" x {t.nodes} nodes" if t.nodes else ""), nvl(t), nic(t),
             n(t.fabric_oversubscription),
             f"{n(t.gpu_tflops)}x{n(t.gpu_compute_efficiency)}", n(t.gpu_mem_bandwidth_GBps), n(t.gpu_launch_us)]
            for t in topos]
    tab = fitted_table("topology presets (GB/s per direction per GPU, x the efficiency the simulator applies)",
                       ("name", "GPUs per node", "NVLink", "NIC", "over- sub", "TFLOP/s", "HBM GB/s", "launch us"), rows)
    c = console()
    c.print(tab)
    krows = []
    for t in topos:
        cap = t.sm_bytes_per_us(t.sm_count) / 1e3
        krows.append([t.name, f"{t.sm_count} x {t.sm_copy_GBps:g}" if t.sm_count else "off",
                   f"{cap:,.0f}" if t.sm_count else "-",
                   f"{t.kernel_dispatch_fixed_us:g} / {t.kernel_combine_fixed_us:g}",
                   f"{t.kernel_relay_message_rows}" if t.kernel_relay_message_rows else "off (whole hops)",
                   f"{t.kernel_nic_message_us:g}",
                   f"{t.weights_engine}, {t.weights_nvlink_bytes_per_us / 1e3:,.0f} / {t.weights_nic_bytes_per_us / 1e3:,.1f}",
                   f"{t.plan_fixed_us:g} + {t.plan_per_entry_ns:g} + {t.plan_per_cell_ns:g}"])
    kt = fitted_table("GPU kernel terms (0 = off; moonep_sim.sim.kernels; status of each in the sources below)",
                      ("name", "SMs x GB/s per SM", "SM cap GB/s (all SMs)", "fixed us dispatch/combine",
                       "relay rows/msg", "NIC us/msg", "weights (engine, NVLink/NIC GB/s)",
                       "planning us + ns/entry + ns/(E x R)"), krows, wrap=True)
    c.print(kt)
    # the SM budgets the strategies declare (option ``sms``; -1 = all SMs; None = the kernel family's) and the
    # cap each gets
    from moonep_sim.plan.kernel import FAMILIES
    from moonep_sim.strategies import available

    budgets = {}
    for name, spec in available().items():
        if "sms" in spec.options:
            b = spec.options["sms"].default
            if b is None and "impl" in spec.options:
                b = FAMILIES[spec.options["impl"].default].sms
            budgets[name] = b
    if budgets:
        brows = [[t.name] + [(f"{t.sm_bytes_per_us(t.sm_count if b < 0 else b) / 1e3:,.0f}" if t.sm_count and b else "-")
                             for b in budgets.values()] for t in topos]
        c.print(fitted_table("SM cap per GPU and direction (GB/s) at each strategy's declared SM budget (option sms; "
                             "'-' = no cap)", ["name"] + [f"{k} ({'all' if b < 0 else b} SMs)" for k, b in budgets.items()],
                             brows))
    _families_tables(c, topos, fitted_table)
    for t in topos:
        c.print(f"[bold]{t.name}[/bold] ({t.path}): {t.description}")
        for k, v in t.sources.items():
            c.print(f"  {k}: {v}")
    c.print(f"local-gloo calibrated file: {cal} ({'present, used' if cal.is_file() else 'absent, defaults used'})")
    return 0


def _families_tables(c, topos, fitted_table) -> None:
    """The kernel families (``impl=`` of deepep / deepep-ll) with their terms, and which were checked
    on which preset against what (``moonep_sim.plan.checks``)."""
    from rich.markup import escape

    from moonep_sim.plan.kernel import FAMILIES
    from moonep_sim.sim.kernels import checked_on

    def fixed(f) -> str:  # "topo" = the topology's [kernel] values (DeepEP V1's fits)
        d, c = f.dispatch_fixed_us, f.combine_fixed_us
        base = "topo" if d is None and c is None else f"{'topo' if d is None else f'{d:g}'}/{'topo' if c is None else f'{c:g}'}"
        return base + (f" + {f.extra_fixed_us:g}" if f.extra_fixed_us else "")

    rows = [[f.name, f"{f.library} ({f.vendor})", f.mode, "all" if f.sms < 0 else str(f.sms), fixed(f),
             f"{f.message_us:g}", f"{f.sm_copy_factor:g}", f.reduce,
             "per rank" if f.dedup_per_rank else ("per selection" if f.mode == "ll" else
                                                  "per node, relayed" + (" in chunks" if f.chunks else "")),
             f.epilogue or "-", ", ".join(f.transports)] for f in FAMILIES.values()]
    c.print(fitted_table("kernel families (impl= of deepep / deepep-ll; moonep_sim.plan.kernel.FAMILIES; fixed us "
                         "'topo' = the topology's \\[kernel], + the family's extra)",
                         ("impl", "library", "mode", "SMs", "fixed us", "own us/msg", "SM rate x", "reduce", "messages",
                          "epilogue", "transports"), rows, wrap=True))
    chk = [[t.name, "; ".join(f"{fam}: {what}" for fam, what in checked_on(t.name)) or
            "none: every family's figure on this preset is a prediction from assumed terms"] for t in topos]
    c.print(fitted_table("kernel families checked on each preset, and against what (benchmarks/fidelity_gpu.py)",
                         ("preset", "families checked (rows)"), chk, wrap=True))
    for f in FAMILIES.values():
        c.print(f"[bold]{f.name}[/bold] ({f.library}):")
        for k, s in f.sources.items():
            c.print(f"  {k}: {escape(s)}")
