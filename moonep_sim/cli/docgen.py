"""Render the command-line reference (docs/cli.md) from the argparse parsers themselves.

    python -m moonep_sim.cli.docgen > docs/cli.md

``tests/test_cli_docs.py`` fails when docs/cli.md differs from this output, so the reference never
drifts from the parsers.
"""

from __future__ import annotations

import argparse
import functools
import sys

WIDTH = 100  # fixed, so the output does not depend on the terminal


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    base = parser.formatter_class
    if not getattr(base, "_docgen_fixed", False):
        fixed = functools.partial(base, width=WIDTH, max_help_position=32)
        fixed._docgen_fixed = True  # type: ignore[attr-defined]
        parser.formatter_class = fixed  # type: ignore[assignment]


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    out: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:  # argparse has no public walk over subcommands
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # aliases map to the same parser
                    seen.add(id(sub))
                    out.append((name, sub))
    return out


def _section(parser: argparse.ArgumentParser, level: int, lines: list[str]) -> None:
    _fixed_width(parser)
    lines += [f"{'#' * level} `{parser.prog}`", "", "```", parser.format_help().rstrip(), "```", ""]
    for _, sub in _subparsers(parser):
        _section(sub, min(level + 1, 4), lines)


def render() -> str:
    from moonep_sim.cli import build_parser
    from moonep_sim.experiments.ranks.replay_args import build_parser as replay_parser

    lines = ["# Command-line reference", "",
             "Generated from the parsers by `python -m moonep_sim.cli.docgen > docs/cli.md`; do not edit",
             "by hand (a test checks it is up to date). What each command is for: the README's",
             "\"CLI at a glance\"; how to use them together: [getting-started.md](getting-started.md).", "",
             "## Output flags (every costing command)", "",
             "`simulate`, `compare`, `sweep` and `step` (and every command that costs routing) share one",
             "convention (`moonep_sim.cli.common.add_output_flags`):", "",
             "- `--json [FILE]`: the JSON result on stdout instead of the table, or written to FILE (the",
             "  table still printed); `--json -`, the older spelling of a bare `--json`, still works for one",
             "  release with a deprecation line on stderr;",
             "- `--out DIR`: the report folder (report.json or sweep.json, the PNG plots, report.html);",
             "- `--no-plots`: the report without its PNG plots;",
             "- `--quiet` (`-q`): no progress display. Progress is a bar on stderr when stderr is a terminal,",
             "  removed when the work ends; piped or redirected there is none (`MOONEP_SIM_PROGRESS=lines`",
             "  prints plain lines on stderr instead, for CI logs); the table, the JSON and the files are the",
             "  same either way.", ""]
    _section(build_parser(), 2, lines)
    _section(replay_parser(), 2, lines)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
