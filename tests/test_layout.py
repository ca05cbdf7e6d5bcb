"""The code layout rules of issue 17, checked on the source (no imports, milliseconds): no module
over 450 lines, no function over 80 lines unless a ``# long:`` comment on its first lines says
why, and no import cycle among the library's modules (module-level imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = sorted(
    p for pattern in ("eagle3/**/*.py", "tasks/*.py", "flows/*.py") for p in ROOT.glob(pattern)
)
MAX_MODULE, MAX_FUNCTION = 450, 80


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_no_module_over_450_lines():
    long = {_rel(p): n for p in CODE if (n := p.read_text().count("\n")) > MAX_MODULE}
    assert not long, f"modules over {MAX_MODULE} lines: {long}"


def test_no_function_over_80_lines():
    long = {}
    for p in CODE:
        lines = p.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                head = "\n".join(lines[node.lineno - 1 : node.lineno + 3])
                if n > MAX_FUNCTION and "# long:" not in head:
                    long[f"{_rel(p)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION} lines (say why with '# long:'): {long}"


def _module_name(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(p: Path, modules: set[str]) -> set[str]:
    """eagle3 modules imported at module level (not inside functions or TYPE_CHECKING)."""
    me = _module_name(p)
    package = me if p.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.parse(p.read_text()).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        out |= {n for n in names if n in modules and n != me}
    return out


def test_no_import_cycle():
    files = sorted(ROOT.glob("eagle3/**/*.py"))
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, modules) for p in files}
    # a package's __init__ re-exporting its own submodules is not a cycle of the code's logic
    for m, deps in graph.items():
        graph[m] = {d for d in deps if not (d.startswith(m + ".") and m in modules)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(d) :], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
