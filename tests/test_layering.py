"""The package reads bottom-up: routing -> plan -> strategies -> (sim, gloo) -> (step, integrations) -> analysis ->
serve -> experiments -> report -> testbed -> cli. No module imports a package above its own (function-level imports included),
report/ only renders (it imports none of the executors, planners or experiments) and gloo/ never
imports the strategies."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moonep_sim"
# the shared base (errors, io, models, data) sits below everything
# the step model and integrations (model libraries over the gloo executor) sit above the executors, below experiments;
# result analysis (verdicts, flags, rankings over the figures) above them, below serving and the experiments
LEVEL = {"routing": 1, "plan": 2, "strategies": 3, "sim": 4, "gloo": 4, "step": 4.5, "integrations": 4.5,
         "analysis": 4.6, "serve": 4.75, "experiments": 5, "report": 6, "testbed": 7, "cli": 8}


# what each package may not import (function-level imports included), beyond the levels above:
# the executors and the renderers stay apart from the planners and from what runs them. The same
# rules as the project's before-stop hook.
FORBIDDEN = {
    "routing": {"plan", "strategies", "sim", "gloo", "experiments", "report", "testbed", "cli"},
    "plan": {"strategies", "sim", "gloo", "experiments", "report", "testbed", "cli"},
    "strategies": {"sim", "gloo", "experiments", "report", "testbed", "cli"},
    "sim": {"gloo", "step", "experiments", "report", "testbed", "cli"},
    "step": {"gloo", "integrations", "experiments", "report", "testbed", "cli"},  # composes Plans and the simulator
    "analysis": {"gloo", "integrations", "serve", "experiments", "report", "testbed", "cli"},  # reads figures, runs nothing
    "serve": {"gloo", "integrations", "experiments", "report", "testbed", "cli"},  # requests over the step model
    "gloo": {"strategies", "experiments", "report", "testbed", "cli"},  # the executor takes a planner callable
    "report": {"gloo", "sim", "step", "strategies", "experiments", "testbed", "cli"},  # renders the dicts it is given
}


def _imports(path: Path) -> set[str]:
    """The moonep_sim packages ``path`` imports (``from moonep_sim import x`` counts as x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            if node.module == "moonep_sim":
                out.update(f"moonep_sim.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m.split(".")[1] for m in out if m.startswith("moonep_sim.") and len(m.split(".")) > 1}


def _packages() -> dict[str, list[Path]]:
    return {p.name: sorted(p.rglob("*.py")) for p in PKG.iterdir() if p.is_dir() and p.name in LEVEL}


def test_every_package_has_a_level():
    assert set(_packages()) == set(LEVEL), "a new package needs its place in LEVEL (and in docs/concepts.md)"


# the one sanctioned upward call: a result renders itself (``save``, ``plot``, ``_repr_html_``) through
# the renderer, inside its methods; report/ imports nothing from experiments/, so there is no circle
UPWARD_ALLOWED = {("experiments/results.py", "report")}


def test_no_package_imports_a_package_above_it():
    bad = []
    for pkg, files in _packages().items():
        for f in files:
            for dep in _imports(f):
                if (str(f.relative_to(PKG)), dep) in UPWARD_ALLOWED:
                    continue
                if dep in LEVEL and LEVEL[dep] > LEVEL[pkg]:
                    bad.append(f"{f.relative_to(PKG.parent)} imports moonep_sim.{dep}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_package_imports_what_it_must_not():
    """report imports nothing from experiments/sim/gloo/strategies (the dicts it renders carry what
    it needs); gloo does not import the strategies (the replay program above it binds them)."""
    pkgs = _packages()
    bad = [f"{f.relative_to(PKG.parent)} imports moonep_sim.{dep}" for pkg, deny in FORBIDDEN.items()
           for f in pkgs[pkg] for dep in sorted(_imports(f) & deny)]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_testbed_does_not_use_report():
    bad = [f"{f.relative_to(PKG.parent)}" for f in _packages()["testbed"] if "report" in _imports(f)]
    assert not bad, bad
