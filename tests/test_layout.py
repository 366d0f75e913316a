"""The code layout rules: no import cycles between the project's modules (function-level imports
included), and no module above 500 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxmoe", "torch_ref", "parity")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file (top level or inside functions)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            # importing a.b.c imports the package a.b and a too; the module itself if it is ours
            while t:
                if t in known and t != name:
                    found.add(t)
                t = t.rpartition(".")[0]
    return found


def test_no_import_cycles():
    mods = _modules()
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    # a package importing its own submodules (re-exports) is not a cycle of concern: drop edges
    # from a package __init__ to modules inside it
    for n, p in mods.items():
        if p.name == "__init__.py":
            graph[n] = {t for t in graph[n] if not t.startswith(n + ".")}
    # and every module implicitly imports its parent packages, which is never a cycle by itself
    for n in graph:
        graph[n] = {t for t in graph[n] if not n.startswith(t + ".")}
    cycles = []
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


@pytest.mark.parametrize("folder", ["jaxmoe", "torch_ref", "parity", "bench", "tests"])
def test_no_module_above_500_lines(folder):
    big = {str(f.relative_to(ROOT)): n for f in (ROOT / folder).rglob("*.py")
           if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules above {MAX_LINES} lines (split them by concern): {big}"
