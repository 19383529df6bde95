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
    from rich.table import Table
    tab = Table(title="topology presets (bandwidths GB/s per direction per GPU; x efficiency = used by the simulator)")
    for col in ("name", "GPUs/node", "NVLink", "NIC", "oversub", "TFLOP/s", "HBM GB/s", "launch us", "from"):
        tab.add_column(col)
    for t in topos:
        tab.add_row(t.name, str(t.gpus_per_node), f"{t.nvlink_bandwidth_GBps:g} x{t.nvlink_efficiency:g}",
                    f"{t.nic_bandwidth_GBps:g} x{t.nic_efficiency:g}", f"{t.fabric_oversubscription:g}",
                    f"{t.gpu_tflops:g} x{t.gpu_compute_efficiency:g}", f"{t.gpu_mem_bandwidth_GBps:g}",
                    f"{t.gpu_launch_us:g}", t.path)
    c = console()
    c.print(tab)
    kt = Table(title="GPU kernel terms (0 = off; moonep_sim.sim.kernels; status of each in the sources below)")
    for col in ("name", "SMs x GB/s per SM", "SM cap GB/s (all SMs)", "fixed us dispatch/combine", "relay rows/msg",
                "NIC us/msg", "weights (engine, NVLink/NIC GB/s)", "planning us + ns/entry + ns/(E x R)"):
        kt.add_column(col)
    for t in topos:
        cap = t.sm_bytes_per_us(t.sm_count) / 1e3
        kt.add_row(t.name, f"{t.sm_count} x {t.sm_copy_GBps:g}" if t.sm_count else "off",
                   f"{cap:,.0f}" if t.sm_count else "-",
                   f"{t.kernel_dispatch_fixed_us:g} / {t.kernel_combine_fixed_us:g}",
                   f"{t.kernel_relay_message_rows}" if t.kernel_relay_message_rows else "off (whole hops)",
                   f"{t.kernel_nic_message_us:g}",
                   f"{t.weights_engine}, {t.weights_nvlink_bytes_per_us / 1e3:,.0f} / {t.weights_nic_bytes_per_us / 1e3:,.1f}",
                   f"{t.plan_fixed_us:g} + {t.plan_per_entry_ns:g} + {t.plan_per_cell_ns:g}")
    c.print(kt)
    for t in topos:
        c.print(f"[bold]{t.name}[/bold]: {t.description}")
        for k, v in t.sources.items():
            c.print(f"  {k}: {v}")
    c.print(f"local-gloo calibrated file: {cal} ({'present, used' if cal.is_file() else 'absent, defaults used'})")
    return 0
