"""The atomic writer: every output whole or absent, ordinary mode, nothing left behind, refusals in one line."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moonep_sim import io as mio
from moonep_sim.errors import ConfigError
from moonep_sim.routing.trace import Trace, TraceMeta, write_trace

REPO = Path(__file__).resolve().parents[1]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _tiny_trace(path: Path) -> Path:
    meta = TraceMeta(kind="tokens", num_experts=4, top_k=2, layer_ids=[0], num_tokens=3)
    ids = np.array([[[0, 1], [2, 3], [1, 2]]])
    return write_trace(path, meta, {"topk_ids": ids, "topk_weights": np.full(ids.shape, 0.5, np.float32)})


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_mode_follows_the_umask_for_json_and_traces(tmp_path, umask):
    old = os.umask(umask)
    try:
        mio.write_text_atomic(tmp_path / "a.json", "{}")
        _tiny_trace(tmp_path / "t.safetensors")
    finally:
        os.umask(old)
    for name in ("a.json", "t.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask
    assert _leftovers(tmp_path) == []
    assert Trace(tmp_path / "t.safetensors").meta.num_tokens == 3


def test_replaces_whole_and_fsyncs_before_rename(tmp_path, monkeypatch):
    dest = tmp_path / "out.json"
    dest.write_text("old")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(mio.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(mio.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    mio.write_bytes_atomic(dest, b"new" * 1000)
    assert dest.read_bytes() == b"new" * 1000
    assert events[:2] == ["fsync", "replace"]  # the data is on disk before the name points at it


def test_error_while_writing_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    dest = tmp_path / "out.json"
    dest.write_text("old")

    def broken_write(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mio.os, "write", broken_write)
    with pytest.raises(ConfigError, match=r"^output \(.*out\.json\) must be writable: No space left on device$"):
        mio.write_bytes_atomic(dest, b"new")
    assert dest.read_text() == "old"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("case, pattern", [
    ("directory", r"must be a file path: it is a directory"),
    ("missing parent", r"must be in an existing folder: .*nope does not exist"),
    ("parent is a file", r"must be in a folder: .*plain is a regular file"),
    ("named pipe", r"must be a file path: it is a named pipe"),
    ("empty", r"must be a file path"),
])
def test_refusals_are_one_line_and_write_nothing(tmp_path, case, pattern):
    (tmp_path / "plain").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    dest = {"directory": tmp_path, "missing parent": tmp_path / "nope" / "out.json",
            "parent is a file": tmp_path / "plain" / "out.json", "named pipe": tmp_path / "fifo",
            "empty": ""}[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match=pattern) as ei:
        mio.write_text_atomic(dest, "{}", what="--json")
    assert "\n" not in str(ei.value) and str(ei.value).startswith("--json (")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="must be in a writable folder"):
            mio.write_text_atomic(ro / "x.json", "{}")
    finally:
        ro.chmod(0o755)


def test_writing_onto_an_input_is_refused_by_any_name(tmp_path):
    src = tmp_path / "src.safetensors"
    _tiny_trace(src)
    data = src.read_bytes()
    (tmp_path / "link").symlink_to(src)
    os.link(src, tmp_path / "hard")
    for dest in (src, tmp_path / "link", tmp_path / "hard", tmp_path / "." / "src.safetensors"):
        with pytest.raises(ConfigError, match=r"must differ from the input .*would destroy the input"):
            mio.write_bytes_atomic(dest, b"x", what="-o", inputs=(src,))
    assert src.read_bytes() == data


def test_trace_import_onto_its_source_is_refused_and_the_source_survives(tmp_path):
    from moonep_sim.cli import main

    src = tmp_path / "ids.npy"
    np.save(src, np.array([[0, 1], [1, 2], [2, 3]]))
    before = src.read_bytes()
    assert main(["trace", "import", str(src), "-o", str(src), "--num-experts", "4"]) == 2
    assert src.read_bytes() == before


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from moonep_sim import io as mio
    def die(a, b):                    # the data is written and fsynced: die just before the rename
        os.kill(os.getpid(), signal.SIGKILL)
    mio.os.replace = die
    mio.write_bytes_atomic(sys.argv[1], b"x" * 100000)
""")


def test_a_killed_writers_temp_is_removed_by_the_next_write(tmp_path):
    dest = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(dest)], env=env)
    assert p.returncode == -signal.SIGKILL
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(".out.json.") and left[0].endswith(mio.TEMP_SUFFIX)
    assert not dest.exists()  # the reader never sees a partial file
    # a live process's temp (this one's parent: alive) is not touched
    live = tmp_path / f".other.json.{os.getppid()}.0123abcd{mio.TEMP_SUFFIX}"
    live.write_text("in progress")
    mio.write_text_atomic(tmp_path / "other.json", "{}")  # a write into the same folder cleans up
    assert _leftovers(tmp_path) == [live.name]
    assert (tmp_path / "other.json").read_text() == "{}"


def test_output_dir_checks_create_nothing(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(ConfigError, match=r"--out \(.*plain\) must be a folder: it is a regular file"):
        mio.check_output_dir(tmp_path / "plain")
    with pytest.raises(ConfigError, match=r"must be a folder path: .*plain is a regular file"):
        mio.check_output_dir(tmp_path / "plain" / "sub")
    assert mio.check_output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    assert mio.make_output_dir(tmp_path / "a" / "b").is_dir()


def test_png_and_timeline_writers_go_through_the_atomic_writer(tmp_path):
    from moonep_sim.sim.perfetto import write_trace as write_timeline

    write_timeline(tmp_path / "t.json", [{"ph": "X", "name": "a", "ts": 0, "dur": 1, "pid": 1, "tid": 0}])
    assert (tmp_path / "t.json").read_text().startswith('{"traceEvents"')
    with pytest.raises(ConfigError, match=r"^--timeline \(.*\) must be a file path: it is a directory$"):
        write_timeline(tmp_path, [])
    assert _leftovers(tmp_path) == []
