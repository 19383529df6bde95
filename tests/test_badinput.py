"""The bad-input corpus (tests/badinput/corpus.py): every case exits 2 with exactly one stderr line
``moonep-sim: error: ...`` naming the file or argument, writes no output and leaves no temporary file.

Cases run in-process (``moonep_sim.cli.main``, SystemExit caught) to keep the corpus fast; a few run
as real subprocesses to hold the contract end to end (exit status, stderr, nothing on disk).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "badinput"))

from corpus import cases  # noqa: E402

from moonep_sim.cli import main  # noqa: E402

CASES = cases()
CASE_LIMIT_S = 60  # a refusal is immediate: anything near this is a hang or a runaway computation
REPO = HERE.parent
# a handful run as subprocesses: one per group
SUBPROCESS = sorted({c.group: c.id for c in CASES if "big" not in c.tags}.values())


def _snapshot(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")} | {
        str(p.relative_to(folder)) for p in folder.rglob(".*")}


def _contents(folder: Path) -> dict[str, bytes]:
    """Every regular file's bytes (links not followed): an input written over shows here."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.is_symlink()}


def _check(case, rc, err, indir, outdir, inputs_before, contents_before=None):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, f"{case.id}: exit {rc}\n{err}"
    assert len(lines) == 1, f"{case.id}: {len(lines)} stderr lines:\n{err}"
    assert lines[0].startswith("moonep-sim: error: "), f"{case.id}: {lines[0]}"
    assert re.search(case.names, lines[0]), f"{case.id}: the line must name {case.names!r}: {lines[0]}"
    assert "Traceback" not in err and "internal error" not in err, err
    assert _snapshot(outdir) == set(), f"{case.id}: left in the output folder: {_snapshot(outdir)}"
    assert _snapshot(indir) == inputs_before, f"{case.id}: input folder changed: {_snapshot(indir) ^ inputs_before}"
    if contents_before is not None:
        assert _contents(indir) == contents_before, f"{case.id}: an input's content changed"


@pytest.fixture(scope="module", autouse=True)
def bounded_memory():
    """A case that would allocate what its input cannot justify fails with MemoryError here instead
    of taking the machine's memory: address space capped at what this process maps now + 8 GiB."""
    import resource

    vm_kib = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
    old = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm_kib * 1024 + (8 << 30)
    if old[0] == resource.RLIM_INFINITY or old[0] > cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_AS, old)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    indir, outdir, cwd = tmp_path / "in", tmp_path / "out", tmp_path / "cwd"
    for d in (indir, outdir, cwd):
        d.mkdir()
    monkeypatch.chdir(cwd)  # default output folders would land here
    return indir, outdir, cwd


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if "big" in c.tags else [])
                                  for c in CASES])
def test_bad_input_in_process(case, dirs, capsys):
    indir, outdir, cwd = dirs
    argv = case.build(indir, outdir)
    before, contents = _snapshot(indir), _contents(indir)

    def too_long(signum, frame):  # a bound on a hang or a runaway allocation, not synchronisation
        raise TimeoutError(f"{case.id}: still running after {CASE_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(CASE_LIMIT_S)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse refusals
        rc = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = capsys.readouterr().err
    _check(case, rc, err, indir, outdir, before, contents)
    assert _snapshot(cwd) == set(), f"{case.id}: wrote into the working folder: {_snapshot(cwd)}"


@pytest.mark.parametrize("case_id", SUBPROCESS)
def test_bad_input_as_a_subprocess(case_id, dirs):
    indir, outdir, cwd = dirs
    case = next(c for c in CASES if c.id == case_id)
    argv = case.build(indir, outdir)
    before = _snapshot(indir)
    p = subprocess.run([sys.executable, "-m", "moonep_sim", *argv], capture_output=True, text=True, cwd=cwd,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300, stdin=subprocess.DEVNULL)
    _check(case, p.returncode, p.stderr, indir, outdir, before)
    assert _snapshot(cwd) == set()


def test_corpus_is_large_and_covers_every_group():
    groups = {c.group for c in CASES}
    assert {"trace reader", "importer", "special files", "outputs", "output over input", "model files", "HF configs",
            "topology values", "sweep axes", "generator keys", "strategy options", "cluster addresses"} <= groups
    assert len(CASES) >= 150, len(CASES)


def test_huge_token_positions_keep_their_order(tmp_path):
    """Positions near 2^62 (no overflow of the token key): tokens stay in position order."""
    import json

    from moonep_sim.routing.importers import load_source

    pos = [(1 << 62) + 1, 5, (1 << 62) - 7]
    recs = [{"problem_id": 0, "token_idx": p, "layer": 0, "experts": e} for p, e in zip(pos, ([0, 1], [2, 3], [1, 3]))]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    imp = load_source(tmp_path / "r.jsonl", steps_from="none")
    assert imp.tensors["topk_ids"][0].tolist() == [[2, 3], [1, 3], [0, 1]]
