"""docs/cli.md is generated from the parsers; it must match what they say now."""

from pathlib import Path

from moonep_sim.cli.docgen import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_cli_reference_is_up_to_date():
    assert DOC.read_text() == render(), (
        "docs/cli.md is stale: regenerate it with `python -m moonep_sim.cli.docgen > docs/cli.md`")


def test_cli_reference_covers_every_command():
    text = DOC.read_text()
    for cmd in ("demo", "models", "trace import", "plan", "simulate", "topologies", "compare", "sweep",
                "calibrate", "validate", "testbed agree"):
        assert f"`moonep-sim {cmd}`" in text
    assert "`launch/replay.py`" in text
