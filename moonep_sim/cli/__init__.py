"""The ``moonep-sim`` command. Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed args, returns
an exit code). Errors print one line: bad input (:class:`MoonEPSimError`) exits 2, a failed collective
(:class:`CommError`) 1, Ctrl-C 130 -- the statuses the launchers use (``errors.exit_status``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moonep_sim import __version__
from moonep_sim.errors import OneLineArgumentParser, exit_status, interrupts_deferred
from moonep_sim.memory import prefer_small_pages, reuse_freed_memory

# order = order in --help
_COMMANDS = ("demo", "models", "strategies", "trace", "plan", "simulate", "step", "serve", "topologies", "compare", "sweep",
             "calibrate", "validate", "testbed")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="moonep-sim",
        description="Simulated expert-parallel communication for MoE models: replay routing traces "
                    "through dispatch strategies, for real over gloo and on a simulated GPU cluster.")
    parser.add_argument("--version", action="version", version=f"moonep-sim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"moonep_sim.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return exit_status(_main, argv)  # 1 a failed collective, 2 bad input, 130 Ctrl-C (as the launchers)


def _main(argv: list[str] | None) -> int:
    with interrupts_deferred():  # imports every command: Ctrl-C here is one line too, as anywhere in main
        parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from moonep_sim.progress import quieted

    prefer_small_pages()  # fresh huge pages cost a command more system time than they save (moonep_sim.memory)
    reuse_freed_memory()  # a freed temporary's pages serve the next one, not fresh pages (moonep_sim.memory)
    with quieted(getattr(args, "quiet", False) is True):  # --quiet: no progress display, for this call only
        return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
