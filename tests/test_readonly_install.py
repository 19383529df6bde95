"""A read-only install runs: kernels cached where numba can write, compiled in memory (said once)
where nothing can be written (moonep_sim/jit.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numba
import numba.core.caching
import numpy as np
import pytest

from moonep_sim import jit

REPO = Path(__file__).resolve().parents[1]


def _unwritable(*a, **k):
    raise OSError(30, "Read-only file system")


def _twice(x):
    return 2 * x


def _thrice(x):
    return 3 * x


def test_no_writable_cache_folder_compiles_in_memory_and_says_so_once(monkeypatch, capsys):
    """Every cache folder numba would try is unwritable: numba itself refuses ``cache=True``; the
    project's decorator compiles in memory instead, with one note for the whole process."""
    monkeypatch.setattr(numba.core.caching._CacheLocator, "ensure_cache_path", _unwritable)
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    monkeypatch.setattr(jit, "_said", False)
    with pytest.raises(RuntimeError, match="cannot cache"):
        numba.njit(cache=True)(_twice)
    f, g = jit.njit(nogil=True)(_twice), jit.njit(nogil=True)(_thrice)
    assert capsys.readouterr().err == ""  # said when a kernel compiles, not when it is defined
    assert f(np.int64(21)) == 42 and g(np.int64(2)) == 6
    assert capsys.readouterr().err.splitlines() == [jit.NO_CACHE_NOTE]


def test_a_writable_numba_cache_dir_is_used(tmp_path):
    """``NUMBA_CACHE_DIR`` names a writable folder: a fresh process caches its kernels there (numba
    reads the variable when it is imported, so the check runs in a process of its own) and says
    nothing."""
    code = ("import numpy as np; from moonep_sim import jit\n"
            "def thrice(x):\n    return 3 * x\n"
            "assert jit.njit()(thrice)(np.int64(5)) == 15\n")
    script = tmp_path / "k.py"
    script.write_text(code)
    cache = tmp_path / "cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert any(p.suffix == ".nbi" for p in cache.rglob("*")), "no cache index written to NUMBA_CACHE_DIR"
    assert r.stderr == ""


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def _chmod_tree(root: Path, writable: bool) -> None:
    for p in [root, *root.rglob("*")]:
        if p.is_dir():
            p.chmod(0o755 if writable else 0o555)
        else:
            p.chmod(0o644 if writable else 0o444)


@pytest.mark.slow
def test_a_read_only_copy_of_the_package_with_a_read_only_home_runs(tmp_path):
    """The package copied to a folder made read-only, HOME read-only, no NUMBA_CACHE_DIR: ``--version``,
    ``models``, a small ``simulate`` and a small ``step`` all exit 0; the kernels are compiled in memory
    (the note once per command) and nothing is written into the copy or the home. Run as root, where
    a mode bit stops nothing, each ``__pycache__`` and ``~/.cache`` is a plain file, which no one can
    create a folder under."""
    pkg, home, cwd = tmp_path / "site", tmp_path / "home", tmp_path / "cwd"
    shutil.copytree(REPO / "moonep_sim", pkg / "moonep_sim", ignore=shutil.ignore_patterns("__pycache__"))
    for d in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (d / "__pycache__").write_bytes(b"")
    home.mkdir()
    (home / ".cache").write_bytes(b"")
    cwd.mkdir()
    _chmod_tree(pkg, writable=False)
    _chmod_tree(home, writable=False)
    before = _tree(pkg), _tree(home)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH", "MOONEP_SIM_HOME", "MOONEP_SIM_CACHE")}
    env.update(HOME=str(home), PYTHONPATH=str(pkg))
    runs = {"version": (["--version"], False), "models": (["models"], False),
            "simulate": (["simulate", "--gen", "maxvio=1.5,model=mixtral-8x7b,tokens-per-rank=64", "--strategy",
                          "moonep", "--ranks", "2"], True),
            "step": (["step", "--gen", "maxvio=1.5,model=mixtral-8x7b,tokens-per-rank=64", "--ranks", "2",
                      "--strategies", "alltoall,moonep", "--mode", "decode"], True)}
    try:
        for name, (argv, compiles) in runs.items():
            p = subprocess.run([sys.executable, "-m", "moonep_sim", *argv], cwd=cwd, env=env, capture_output=True,
                               text=True, timeout=600, stdin=subprocess.DEVNULL)
            assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stderr[-2000:]}"
            assert "Traceback" not in p.stderr, p.stderr
            notes = p.stderr.count(jit.NO_CACHE_NOTE)
            assert notes == (1 if compiles else 0), f"{name}: {notes} notes\n{p.stderr}"
        assert (_tree(pkg), _tree(home)) == before, "the read-only copy or home changed"
    finally:
        _chmod_tree(pkg, writable=True)
        _chmod_tree(home, writable=True)


@pytest.mark.slow  # builds a small step-time grid
def test_serve_with_an_unwritable_cache_folder_runs_and_says_so(tmp_path, monkeypatch, capsys):
    """The step-time cache under a read-only home cannot be written: the run goes on (exit 0, its
    result printed) and one warning line says the cache was not kept. ``.cache`` is a plain file, so
    no one -- root included -- can create the folder under it."""
    from moonep_sim.cli import main

    (tmp_path / ".cache").write_bytes(b"")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MOONEP_SIM_CACHE", raising=False)
    argv = ["serve", "--model", "olmoe-1b-7b", "--topology", "h100-cx7", "--worker",
            "workers=1,dp=4,ep=4,max_running=8,token_budget=256", "--num-requests", "20", "--isl", "64", "--osl", "8",
            "--rate", "50", "--draws", "1", "--strategies", "alltoall", "--json"]
    assert main(argv) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("moonep-sim:")]
    assert len(err) == 1 and err[0].startswith("moonep-sim: warning: step-time cache not written"), err
    assert (tmp_path / ".cache").read_bytes() == b""
