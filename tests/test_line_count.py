"""benchmarks/line_count.py's two accounts on a small repository built here: by file (new
capability files apart) and by commit (each line to the branch whose merge brought it)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "line_count.py"


def _load():
    spec = importlib.util.spec_from_file_location("line_count_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _git(root: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(root)}
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True, env=env).stdout


def _write(root: Path, path: str, lines: list[str]) -> None:
    p = root / path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(f"{x}\n" for x in lines))


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """base: core.py (10 lines). Branch ``serve`` (a capability branch) adds 3 lines to core.py and
    the new capability file serve/engine.py (5 lines); branch ``tiers`` removes 4 base lines of
    core.py and adds 2; a commit on main itself adds 1; one line is left uncommitted."""
    r = tmp_path
    _git(r, "init", "-q", "-b", "main")
    _write(r, "moonep_sim/core.py", [f"base {i}" for i in range(10)])
    _git(r, "add", "-A")
    _git(r, "commit", "-qm", "base")
    base = _git(r, "rev-parse", "HEAD").strip()
    _git(r, "checkout", "-qb", "serve")
    _write(r, "moonep_sim/core.py", [f"base {i}" for i in range(10)] + ["serve a", "serve b", "serve c"])
    _write(r, "moonep_sim/serve/engine.py", [f"engine {i}" for i in range(5)])
    _git(r, "add", "-A")
    _git(r, "commit", "-qm", "serving")
    _git(r, "checkout", "-q", "main")
    _git(r, "checkout", "-qb", "tiers")
    _write(r, "moonep_sim/core.py", ["tiers x", "tiers y"] + [f"base {i}" for i in range(4, 10)])
    _git(r, "commit", "-qam", "fewer lines")
    _git(r, "checkout", "-q", "main")
    _git(r, "merge", "-q", "--no-ff", "serve", "-m", "Merge branch 'serve': serving")
    _git(r, "merge", "-q", "--no-ff", "tiers", "-m", "Merge branch 'tiers'")
    with open(r / "moonep_sim/core.py", "a") as f:
        f.write("on main\n")
    _git(r, "commit", "-qam", "a fix on main")
    with open(r / "moonep_sim/core.py", "a") as f:
        f.write("not committed\n")
    mod = _load()
    monkeypatch.setattr(mod, "ROOT", r)
    monkeypatch.setattr(mod, "NEW_CAPABILITIES", ("moonep_sim/serve/*",))
    return mod, base


def test_both_accounts_add_up_to_the_tree(repo):
    mod, base = repo
    r = mod.count(base)
    # core.py now: tiers x, tiers y, base 4..9, serve a..c, on main, not committed = 13; engine.py 5
    assert (r["base"], r["now"], r["new_capabilities"], r["rest"], r["rest_change"]) == (10, 18, 5, 13, 3)
    c = r["by_commit"]
    assert c["base_lines_kept"] == 6                        # base 4..9
    assert c["capability_lines"] == 3 + 5                   # serve's lines, inside core.py and in its own file
    assert c["core_lines"] == 2 + 1 + 1                     # tiers', main's, uncommitted
    assert c["core_now"] == 10 and c["core_change"] == 0    # 4 base lines removed, 4 core lines written
    assert c["by_branch"] == {"serve": 8, "tiers": 2, "main": 1, "uncommitted": 1}
    assert c["capability_inside_existing_files"] == [{"file": "moonep_sim/core.py", "lines": 3}]
    assert c["base_lines_kept"] + c["core_lines"] + c["capability_lines"] == r["now"]
