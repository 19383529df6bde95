"""The package's size against a base commit, with the capabilities added since it counted apart.

    python benchmarks/line_count.py                    # the working tree against BASE (863da57)
    python benchmarks/line_count.py --base 863da57 --json out.json

Lines are ``wc -l`` lines of ``moonep_sim/**/*.py`` (code, docstrings, comments and blank lines
alike). The base is read from git (``git show BASE:path``), the current tree from the working
tree. Two accounts, both printed:

- **By file** (strict): a file counts as a *new capability* when it matches
  :data:`NEW_CAPABILITIES` (the layouts, pipelines, collectives, measured ops, memory shapes,
  serving and progress that the work since the base adds); every other file -- new files made by
  moving or splitting existing code included -- is the *rest*. Growth that a new capability adds
  inside an existing file (a flag, a branch) stays in the rest; the rest's files that grew most are
  listed, moves followed.
- **By commit**: every line of the tree is attributed with ``git blame ^BASE`` (the working tree's
  contents) to the commit that last wrote it: a line older than the base is a *base* line; a newer
  one belongs to the branch whose merge brought its commit in (the ``Merge branch 'NAME'``
  subjects on the first-parent history of ``main`` and of ``HEAD``). Lines of the branches in
  :data:`CAPABILITY_BRANCHES` are *capability* lines, wherever they sit (``step/costs.py``,
  ``cli/step.py`` ...); every other line written since the base -- the restructuring branches',
  commits made on ``main`` itself, uncommitted edits, a commit no merge names -- is *core* growth.
  The core is then the base lines still there plus the core lines: ``now = base lines kept +
  core lines + capability lines``, so nothing removed or added is left out, and the lines each
  branch wrote are listed so a reader can count a branch the other way. A capability branch's edit
  of a base line moves that line from the base to the capability (it is the branch's line now).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the commit the round started from (35,547 lines of moonep_sim/**/*.py)
BASE = "863da57"
#: the goal for the existing package: this many lines below the base, capabilities counted apart
GOAL_BELOW_BASE = 1500
#: files of new capabilities: glob patterns relative to the repository root
NEW_CAPABILITIES = (
    "moonep_sim/serve/*",                                   # serving: requests, batching, SLOs, search
    "moonep_sim/experiments/serve.py", "moonep_sim/experiments/serve_search.py",
    "moonep_sim/cli/serve.py", "moonep_sim/report/serve.py",
    "moonep_sim/step/parallel.py", "moonep_sim/step/pipelines/*",   # layouts and pipeline schedules
    "moonep_sim/step/layout_step.py", "moonep_sim/step/collectives.py",
    "moonep_sim/experiments/layout.py", "moonep_sim/experiments/layout_search.py",
    "moonep_sim/cli/layout.py", "moonep_sim/report/layout.py",
    "moonep_sim/step/measured.py", "moonep_sim/step/measured_*.py",  # measured op tables
    "moonep_sim/step/memory_fit.py", "moonep_sim/step/activations.py", "moonep_sim/step/dtypes.py",
    "moonep_sim/progress.py",                               # progress of long work
)


#: branches whose merges brought the capabilities added since the base (the line-by-commit account counts
#: their lines apart, wherever they sit); every other branch's lines, and commits made on main
#: itself, count to the core
CAPABILITY_BRANCHES = {
    "layout": "parallel layouts, pipeline schedules, collectives, the layout search",
    "memshapes": "memory under layouts, precision, recompute, model presets",
    "costs": "measured op costs, kernel families",
    "proxies": "host-proxy transports, kernel families",
    "uccl": "host-proxy transports: per-call cost and throughput on EFA",
    "p5rows": "host-proxy transports: the per-layer EFA check",
    "a2aoverlap": "pipeline schedules: the EP all-to-all overlap of interleaved pipelines",
    "serve": "serving: requests, batching, SLOs, deployment search",
    "usercli": "the command line's first hour: progress, output rules, checks before work",
    "hostile": "bad input refused in one line",
}
_NO_COMMIT = "0" * 40


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def _lines(text: str) -> int:
    return text.count("\n")


def base_files(base: str) -> dict[str, int]:
    """``{path: lines}`` of every ``moonep_sim/**/*.py`` at commit ``base``."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", base, "moonep_sim"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    names = [n for n in names if n.endswith(".py")]
    blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=ROOT, check=True, capture_output=True,
                           input="".join(f"{base}:{n}\n" for n in names).encode()).stdout
    out, pos = {}, 0
    for n in names:
        header_end = blobs.index(b"\n", pos)
        size = int(blobs[pos:header_end].split()[2])
        body = blobs[header_end + 1:header_end + 1 + size]
        out[n] = body.count(b"\n")
        pos = header_end + 1 + size + 1
    return out


def tree_files() -> dict[str, int]:
    """``{path: lines}`` of every ``moonep_sim/**/*.py`` in the working tree."""
    return {str(p.relative_to(ROOT)): _lines(p.read_text()) for p in sorted((ROOT / "moonep_sim").rglob("*.py"))}


def changes(base: str) -> list[tuple[int, str]]:
    """``(net lines, path)`` per changed file of the rest since ``base``, renames followed (``git diff
    -M --numstat``: a moved file counts only its edits, under its new path)."""
    out = subprocess.run(["git", "diff", "-M", "--numstat", base, "--", "moonep_sim"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        added, removed, path = line.split("\t", 2)
        if added == "-" or not path.endswith(".py"):
            continue
        if "=>" in path:   # "a/{b => c}/d.py" or "a.py => b.py": the new path
            pre, _, rest = path.partition("{")
            if rest:
                mid, _, post = rest.partition("}")
                path = pre + mid.split(" => ")[1] + post
            else:
                path = path.split(" => ")[1]
            path = path.replace("//", "/")
        if not is_new_capability(path) and int(added) != int(removed):
            rows.append((int(added) - int(removed), path))
    return sorted(rows)


def is_new_capability(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pat) for pat in NEW_CAPABILITIES)


def commit_branches(base: str) -> dict[str, str]:
    """``{commit: branch}`` of every commit since ``base``: the ``NAME`` of the ``Merge branch
    'NAME'`` merge on the first-parent history of ``main`` (then of ``HEAD``) that brought it in;
    ``main`` for a commit made on main itself or brought by another merge, the checked-out branch's
    name for one made on it."""
    here = _git("rev-parse", "--abbrev-ref", "HEAD").strip()
    refs = [r for r in ("main", "HEAD") if r == "HEAD" or _git("branch", "--list", r).strip()]
    out: dict[str, str] = {}
    for ref in refs:
        own = "main" if ref == "main" or here == "main" else here
        for line in _git("log", "--first-parent", "--format=%H %P%x09%s", f"{base}..{ref}").splitlines():
            shas, _, subject = line.partition("\t")
            sha, *parents = shas.split()
            m = re.match(r"Merge branch '([^']+)'", subject)
            label = m.group(1) if m and len(parents) > 1 else own
            out.setdefault(sha, label)
            if len(parents) > 1:
                for c in _git("rev-list", parents[1], f"^{parents[0]}", f"^{base}").split():
                    out.setdefault(c, label)
    return out


def blame_lines(base: str, paths: list[str], branches: dict[str, str]) -> dict[str, Counter]:
    """``{path: Counter(owner -> lines)}`` of the working tree's files: ``base`` for a line older
    than ``base``, else the branch of the commit that last wrote it (:func:`commit_branches`;
    ``uncommitted`` for a line not committed yet)."""
    out = {}
    for path in paths:
        c: Counter = Counter()
        r = subprocess.run(["git", "blame", "--porcelain", "--contents", path, f"^{base}", "--", path], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode:   # not in HEAD yet: every line uncommitted
            c["uncommitted"] = _lines((ROOT / path).read_text())
        else:
            sha = None
            for line in r.stdout.splitlines():
                if line.startswith("\t"):
                    c[sha] += 1
                elif re.match(r"[0-9a-f]{40} ", line):
                    s = line[:40]
                    sha = "uncommitted" if s == _NO_COMMIT else branches.get(s, "base")
        out[path] = c
    return out


def by_commit(base: str, now: dict[str, int]) -> dict:
    """The line-by-commit account (module docstring): base lines kept, core and capability lines,
    the lines each branch wrote, and the files holding most capability lines outside the new
    capability files."""
    per_file = blame_lines(base, sorted(now), commit_branches(base))
    owners: Counter = Counter()
    inside: Counter = Counter()
    for path, c in per_file.items():
        owners.update(c)
        if not is_new_capability(path):
            inside[path] = sum(n for o, n in c.items() if o in CAPABILITY_BRANCHES)
    cap = sum(n for o, n in owners.items() if o in CAPABILITY_BRANCHES)
    core = sum(n for o, n in owners.items() if o not in CAPABILITY_BRANCHES and o != "base")
    return {"base_lines_kept": owners["base"], "core_lines": core, "capability_lines": cap,
            "core_now": owners["base"] + core,
            "by_branch": {o: n for o, n in owners.most_common() if o != "base"},
            "capability_inside_existing_files": [{"file": p, "lines": n} for p, n in inside.most_common(12) if n]}


def count(base: str = BASE) -> dict:
    """The totals: ``base``, ``now``, ``new_capabilities`` (with their files), ``rest`` and
    ``rest_change`` (rest minus base), and the files of the rest that grew or shrank most (moves
followed: a moved file counts its edits only)."""
    old, now = base_files(base), tree_files()
    new = {p: n for p, n in now.items() if is_new_capability(p)}
    rest = sum(n for p, n in now.items() if p not in new)
    changed = changes(base)
    commits = by_commit(base, now)
    commits["core_change"] = commits["core_now"] - sum(old.values())
    return {"base_commit": base, "base": sum(old.values()), "now": sum(now.values()),
            "new_capabilities": sum(new.values()), "new_capability_files": dict(sorted(new.items())),
            "rest": rest, "rest_change": rest - sum(old.values()),
            "shrank_most": [{"file": p, "lines": d} for d, p in changed[:12]],
            "grew_most": [{"file": p, "lines": d} for d, p in reversed(changed[-12:])],
            "by_commit": commits}


def _goal(change: int) -> str:
    """Where a change against the base stands against :data:`GOAL_BELOW_BASE`."""
    gap = change + GOAL_BELOW_BASE
    return (f"; goal {-GOAL_BELOW_BASE:+,}: " + ("met" if gap <= 0 else f"not met, {gap:,} lines short"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help=f"the commit to compare with (default {BASE})")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    r = count(a.base)
    print(f"moonep_sim/**/*.py at {r['base_commit']}: {r['base']:,} lines; now: {r['now']:,}")
    print(f"  new capabilities: {r['new_capabilities']:,} lines in {len(r['new_capability_files'])} files")
    print(f"  the rest: {r['rest']:,} lines ({r['rest_change']:+,} against the base)" + _goal(r["rest_change"]))
    print("  the rest's files that grew most (moves followed): " + ", ".join(f"{g['file']} {g['lines']:+d}" for g in r["grew_most"]))
    print("  shrank most: " + ", ".join(f"{g['file']} {g['lines']:+d}" for g in r["shrank_most"]))
    c = r["by_commit"]
    print(f"by commit (git blame ^{r['base_commit']}): base lines kept {c['base_lines_kept']:,}, core lines written "
          f"since {c['core_lines']:,}, capability lines {c['capability_lines']:,}")
    print(f"  the core: {c['core_now']:,} lines ({c['core_change']:+,} against the base)" + _goal(c["core_change"]))
    print("  lines written since the base, by branch: " + ", ".join(
        f"{o} {n:,}{' (capability)' if o in CAPABILITY_BRANCHES else ''}" for o, n in c["by_branch"].items()))
    print("  capability lines inside existing files: " + ", ".join(
        f"{g['file']} {g['lines']}" for g in c["capability_inside_existing_files"]))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
