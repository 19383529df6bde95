"""The package's files stay small and import each other without circles.

- No import circle between files of ``moonep_sim``: the graph whose nodes are the package's files
  and whose edges are the imports each file names (parsed with ``ast``) has no cycle. Imports at
  module level and inside functions both count (a function-level import is still a dependency:
  it only hides the circle until the function runs); ``if TYPE_CHECKING:`` imports count too. An
  import names one file: ``import a.b.c`` and ``from a.b.c import x`` name ``a/b/c.py`` (or
  ``a/b/c/__init__.py``), and ``from a.b import c`` names ``a/b/c.py`` when c is a module of
  ``a.b``, else ``a/b/__init__.py``. The parent packages Python also runs on the way are not
  edges: a package's ``__init__`` re-exporting its modules is not a circle with them.
- No module over ``MAX_LINES`` lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "moonep_sim"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _files() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package modules ``path`` (module ``name``) imports, by the rule in the module docstring."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: from the module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    files = _files()
    mods = set(files)
    return {m: _imports(p, m, mods) for m, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _edge_list(graph: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    return ", ".join(f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members))


def test_no_import_circle_between_files():
    graph = _graph()
    circles = _cycles(graph)
    assert not circles, "import circles between files:\n" + "\n".join(_edge_list(graph, c) for c in circles)


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by role): {long}"


def test_the_checks_find_what_they_look_for(tmp_path):
    """The circle finder and the import parser catch the cases they must (relative imports, a
    submodule named in ``from a import b``, a function-level import, a three-file circle)."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    mods = {"moonep_sim.sim", "moonep_sim.sim.network", "moonep_sim.sim.ports", "moonep_sim.plan"}
    src = ("from . import ports\nfrom .ports import PortMap\nfrom moonep_sim.sim import network\n"
           "def f():\n    from moonep_sim.plan import Plan\n")
    probe = tmp_path / "engine.py"
    probe.write_text(src)
    got = _imports(probe, "moonep_sim.sim.engine", mods)
    assert got == {"moonep_sim.sim.ports", "moonep_sim.sim.network", "moonep_sim.plan"}


#: every function stays narrow and short -- the core (plan/, sim/, routing/), the step model, the
#: executors, the experiments, the renderers and the command line alike: none takes more than
#: MAX_PARAMS parameters (``*args`` / ``**kwargs`` count one each; ``self`` none) or runs over
#: MAX_FUNC_LINES lines. A long parameter list becomes a record (the compiled kernels take
#: ``NamedTuple``s built beside them, the plan builders ``Slots`` and ``Route``, the step
#: ``StepOptions``); a long function is split into named steps. No exception.
MAX_PARAMS, MAX_FUNC_LINES = 12, 100


def _wide_or_long(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            n = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
                 + (a.kwarg is not None) - (bool(a.args) and a.args[0].arg in ("self", "cls")))
            if n > MAX_PARAMS or node.end_lineno - node.lineno + 1 > MAX_FUNC_LINES:
                out.append(f"{path.relative_to(PKG)}:{node.name}")
    return out


def test_functions_are_narrow_and_short():
    found = sorted(f for p in sorted(PKG.rglob("*.py")) for f in _wide_or_long(p))
    assert not found, (f"functions over {MAX_PARAMS} parameters or {MAX_FUNC_LINES} lines (take a record, split by "
                       f"step): {found}")


def test_the_width_and_length_check_counts_what_it_says(tmp_path, monkeypatch):
    """Parameters: positional, keyword-only, ``*args`` and ``**kwargs`` one each, ``self`` none;
    lines: from ``def`` to the last line of the body."""
    wide = "class A:\n    def m(self, " + ", ".join(f"a{i}" for i in range(11)) + ", *r, k, **kw):\n        pass\n"
    ok = "def f(" + ", ".join(f"a{i}" for i in range(12)) + "):\n" + "    x = 1\n" * 98
    long_ = "def g():\n" + "    x = 1\n" * 100
    (PKG_PROBE := tmp_path / "moonep_sim").mkdir()
    for name, src in (("wide.py", wide), ("ok.py", ok), ("long.py", long_)):
        (PKG_PROBE / name).write_text(src)
    import sys

    monkeypatch.setattr(sys.modules[__name__], "PKG", PKG_PROBE)   # names are relative to the package
    got = {f for p in sorted(PKG_PROBE.glob("*.py")) for f in _wide_or_long(p)}
    assert got == {"wide.py:m", "long.py:g"}
