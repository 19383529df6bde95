"""The output rule: no output over an input (checked before any work, by device and inode), and an
output folder whole or absent (assembled beside it, moved in when complete)."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

import pytest

from moonep_sim import io as mio
from moonep_sim.cli import build_parser, main
from moonep_sim.errors import ConfigError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "badinput"))

from output_cases import FILE_OUTPUTS, FOLDER_OUTPUTS  # noqa: E402

#: flags that write a file or a folder when given a value (a ``--json`` switch prints instead)
OUTPUT_FLAGS = {"-o", "--out", "--timeline", "--gantt", "--json", "--markdown", "--topology-out"}


def _subcommands(parser, prefix=()):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _subcommands(sp, (*prefix, name))
    if prefix:
        yield prefix, parser


def test_every_output_flag_of_every_command_is_in_the_corpus():
    covered = {(cmd, f) for cmd, (_, _, flags) in FILE_OUTPUTS.items() for f in flags}
    covered |= {(cmd, "--out") for cmd in FOLDER_OUTPUTS} | {("validate", "--out")}
    missing = []
    for path, sp in _subcommands(build_parser()):
        cmd = "-".join(path)
        for a in sp._actions:
            flags = set(a.option_strings) & OUTPUT_FLAGS
            if not flags or a.nargs == 0 or (a.default is False and a.const is True):
                continue  # a switch (--json that prints), not a path
            if cmd == "calibrate":
                continue  # writes a calibration file and reads no input: held by test_calibrate_refuses_...
            if not any((cmd, f) in covered for f in a.option_strings):
                missing.append(f"{cmd} {'/'.join(a.option_strings)}")
    assert missing == [], f"output flags without an over-input case in tests/badinput/output_cases.py: {missing}"


def _trace(path: Path) -> Path:
    from moonep_sim.routing.generators import generate_trace

    generate_trace(path, 8, 2, 64, 1, layers=1, maxvio=1.0)
    return path


def test_compare_with_a_full_disk_leaves_no_plot_behind(tmp_path, monkeypatch, capsys):
    """The second plot fails (ENOSPC): exit 2, one line, and neither the folder nor layer_time.png exists."""
    from moonep_sim.report import plots

    t = _trace(tmp_path / "t.safetensors")
    real = plots.rows_per_rank

    def full(report, dest):
        raise ConfigError(f"output ({dest}) must be writable: {os.strerror(errno.ENOSPC)}")
    monkeypatch.setattr(plots, "rows_per_rank", full)
    rc = main(["compare", "--trace", str(t), "--strategies", "alltoall", "--ranks", "2", "--out",
               str(tmp_path / "res" / "cmp"), "--json"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("[compare")]
    assert rc == 2 and len(err) == 1 and "No space left" in err[0], err
    assert f"({tmp_path / 'res' / 'cmp' / 'rows_per_rank.png'})" in err[0]  # the final name, not the staging one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]  # no res/, no temporary
    monkeypatch.setattr(plots, "rows_per_rank", real)
    assert main(["compare", "--trace", str(t), "--strategies", "alltoall", "--ranks", "2", "--out",
                 str(tmp_path / "res" / "cmp"), "--json"]) == 0
    assert {p.name for p in (tmp_path / "res" / "cmp").iterdir()} == {"report.json", "report.html", "layer_time.png",
                                                                      "rows_per_rank.png", "traffic.png"}


def test_staged_folder_into_an_existing_one_keeps_other_files_and_replaces_its_own(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "mine.txt").write_text("keep")
    (d / "report.json").write_text("old")
    with mio.staged_dir(d) as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(mio.TEMP_SUFFIX)
        (tmp / "report.json").write_text("new")
        assert (d / "report.json").read_text() == "old"  # nothing moves before the folder is complete
    assert (d / "mine.txt").read_text() == "keep" and (d / "report.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_staged_folder_failure_leaves_nothing_and_a_killed_ones_is_removed_later(tmp_path):
    with pytest.raises(RuntimeError):
        with mio.staged_dir(tmp_path / "a" / "b") as tmp:
            (tmp / "x.png").write_bytes(b"png")
            raise RuntimeError("the plot failed")
    assert list(tmp_path.iterdir()) == []
    stale = tmp_path / f".b.{2 ** 22 + 12345}.0123abcd{mio.TEMP_SUFFIX}"  # a pid no process has
    stale.mkdir()
    (stale / "x.png").write_bytes(b"half")
    with mio.staged_dir(tmp_path / "b") as tmp:
        (tmp / "y").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_output_rule_compares_by_inode_through_links(tmp_path):
    src = tmp_path / "m.json"
    src.write_text("{}")
    os.link(src, tmp_path / "hard.json")
    os.symlink(src, tmp_path / "soft.json")
    for out in ("m.json", "hard.json", "soft.json"):
        with pytest.raises(ConfigError, match=r"^-o \(.*\) must differ from the input --model \(.*m\.json\)"):
            mio.check_outputs({"-o": tmp_path / out}, {"--model": src})
    mio.check_outputs({"-o": tmp_path / "new.json"}, {"--model": src, "--topology": "h800-cx7"})  # a preset name


def test_calibrate_refuses_its_output_over_a_measurements_file_of_an_input(tmp_path, capsys):
    """calibrate -o X also writes X.measurements.json: a directory there is refused before measuring."""
    (tmp_path / "x.measurements.json").mkdir()
    rc = main(["calibrate", "--quick", "-o", str(tmp_path / "x.toml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "measurements file" in err[0]


def test_json_output_is_strict_and_names_where_a_non_finite_value_is():
    import json

    assert json.loads(mio.dumps_strict({"a": [1.5, {"b": 2}]})) == {"a": [1.5, {"b": 2}]}
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ConfigError, match=r"JSON output must hold finite numbers: a\[1\]\.b \("):
            mio.dumps_strict({"a": [1, {"b": bad}]})


STEP_GEN = ["step", "--gen", "model=mixtral-8x7b,maxvio=1,tokens-per-rank=64", "--ranks", "2", "--strategies",
            "alltoall", "--mode", "decode", "--topology", "local-gloo"]


@pytest.mark.parametrize("argv, dest", [
    pytest.param([*STEP_GEN, "--json", "{d}/s.json"], "s.json", marks=pytest.mark.slow),
    pytest.param([*STEP_GEN, "--timeline", "{d}/t.json"], "t.json", marks=pytest.mark.slow),
    pytest.param([*STEP_GEN, "--out", "{d}/res", "--no-plots"], "res", marks=pytest.mark.slow),
    (["trace", "gen", "--num-experts", "8", "--top-k", "2", "--tokens", "64", "--seed", "1", "--uniform", "-o",
      "{d}/g.safetensors"], "g.safetensors"),
    (["simulate", "--gen", "maxvio=1", "--strategy", "alltoall", "--ranks", "2", "--timeline", "{d}/t.json"], "t.json"),
])
def test_a_full_disk_leaves_no_partial_file(argv, dest, tmp_path, monkeypatch, capsys):
    """Every write fails with ENOSPC after its first 100 bytes (as a full disk would): exit 2, one line
    naming the output where the user looks for it, and the folder holds nothing -- no partial file, no
    temporary, no staged folder."""
    real_write = os.write
    budget = {"n": 100}

    def full(fd, data):
        if budget["n"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, bytes(data)[: budget["n"]])
        budget["n"] -= n
        return n
    monkeypatch.setattr(mio.os, "write", full)
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    rc = main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("moonep-sim:")]
    assert rc == 2 and len(err) == 1 and "No space left" in err[0], err
    assert str(tmp_path / dest) in err[0]
    assert list(tmp_path.iterdir()) == []
