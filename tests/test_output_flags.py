"""One output-flag convention across simulate, compare, sweep and step (cli/common.add_output_flags):
``--json [FILE]`` (stdout without FILE), ``--out DIR``, ``--no-plots``, ``--quiet``; ``--json -``
still works with a one-line deprecation on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moonep_sim.cli import build_parser, main
from moonep_sim.cli.common import json_target

COMMANDS = {
    "simulate": ["simulate", "--trace", "T", "--strategy", "alltoall"],
    "compare": ["compare", "--trace", "T"],
    "sweep": ["sweep", "--model", "kimi-k3", "--over", "maxvio"],
    "step": ["step", "--trace", "T"],
}
TRACE = Path(__file__).resolve().parents[1] / "traces" / "synthetic_e64_k8_maxvio1.safetensors"


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_costing_command_spells_its_outputs_alike(cmd, capsys):
    p = build_parser()
    base = COMMANDS[cmd]
    assert json_target(p.parse_args(base)) is None
    assert json_target(p.parse_args(base + ["--json"])) == "-"
    assert json_target(p.parse_args(base + ["--json", "r.json"])) == "r.json"
    a = p.parse_args(base + ["--out", "d", "--no-plots", "--quiet"])
    assert (a.out, a.no_plots, a.quiet) == ("d", True, True)
    assert p.parse_args(base + ["-q"]).quiet
    assert capsys.readouterr().err == ""
    assert json_target(p.parse_args(base + ["--json", "-"])) == "-"  # the older spelling, for one release
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moonep-sim: deprecated: --json - is now a bare --json")


def test_json_to_a_file_keeps_the_table_and_bare_json_replaces_it(tmp_path, capsys):
    argv = ["simulate", "--trace", str(TRACE), "--strategy", "alltoall,deepep", "--ranks", "8", "--quiet"]
    assert main(argv + ["--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert "verdict" in out and set(doc["strategies"]) == {"alltoall", "deepep"}
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategies"].keys() == doc["strategies"].keys()
