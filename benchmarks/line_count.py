"""The package's size against a base commit, with this round's new capabilities counted apart.

    python benchmarks/line_count.py                    # the working tree against BASE (863da57)
    python benchmarks/line_count.py --base 863da57 --json out.json

Lines are ``wc -l`` lines of ``moonep_sim/**/*.py`` (code, docstrings, comments and blank lines
alike). The base is read from git (``git show BASE:path``), the current tree from the working
tree. A file counts as a *new capability* when it matches :data:`NEW_CAPABILITIES` (the layouts,
pipelines, collectives, measured ops, memory shapes, serving and progress that this round's other
work adds); every other file -- new files made by moving or splitting existing code included -- is
the *rest*, which is what a line budget on the existing package is measured on. Growth that a new
capability adds inside an existing file (a flag, a branch) stays in the rest: the output lists the
existing files that grew most so a reader can see it.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the commit the round started from (35,547 lines of moonep_sim/**/*.py)
BASE = "863da57"
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


def count(base: str = BASE) -> dict:
    """The totals: ``base``, ``now``, ``new_capabilities`` (with their files), ``rest`` and
    ``rest_change`` (rest minus base), and the files of the rest that grew or shrank most (moves
followed: a moved file counts its edits only)."""
    old, now = base_files(base), tree_files()
    new = {p: n for p, n in now.items() if is_new_capability(p)}
    rest = sum(n for p, n in now.items() if p not in new)
    changed = changes(base)
    return {"base_commit": base, "base": sum(old.values()), "now": sum(now.values()),
            "new_capabilities": sum(new.values()), "new_capability_files": dict(sorted(new.items())),
            "rest": rest, "rest_change": rest - sum(old.values()),
            "shrank_most": [{"file": p, "lines": d} for d, p in changed[:12]],
            "grew_most": [{"file": p, "lines": d} for d, p in reversed(changed[-12:])]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help=f"the commit to compare with (default {BASE})")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    r = count(a.base)
    print(f"moonep_sim/**/*.py at {r['base_commit']}: {r['base']:,} lines; now: {r['now']:,}")
    print(f"  new capabilities: {r['new_capabilities']:,} lines in {len(r['new_capability_files'])} files")
    print(f"  the rest: {r['rest']:,} lines ({r['rest_change']:+,} against the base)")
    print("  the rest's files that grew most (moves followed): " + ", ".join(f"{g['file']} {g['lines']:+d}" for g in r["grew_most"]))
    print("  shrank most: " + ", ".join(f"{g['file']} {g['lines']:+d}" for g in r["shrank_most"]))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
