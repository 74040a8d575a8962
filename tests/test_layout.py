"""The package shows the pipeline and stays that way (issue #26): no import cycle among tracediff's
modules, no private name imported across modules, no module past what a reader holds in mind, and
the two packages a user meets (tracediff.compare, tracediff.record) importable and cheap."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tracediff"
#: A module past this many lines is split along its seams in the change that grows it (STYLE.md).
MAX_LINES = 650


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _top_level_imports(tree: ast.Module) -> set[str]:
    deps = set()
    for node in tree.body:  # module level only: imports inside functions are deliberate and lazy
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tracediff"):
            deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith("tracediff"))
    return deps


def test_no_import_cycle_among_the_modules():
    graph = {name: _top_level_imports(tree) for name, tree in _modules().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])
    assert cycles == []


def test_no_private_name_is_imported_across_modules():
    found = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tracediff"):
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_no_module_is_longer_than_a_reader_holds_in_mind():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_compare_and_record_packages_import_cheaply_and_record_stays_callable():
    code = ("import sys, tracediff.compare, tracediff.record, tracediff; "
            "print(callable(tracediff.record), tracediff.record.start.__name__, "
            "sorted(m for m in ('torch', 'numpy', 'zarr', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "start", "[]"]
