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


def test_architecture_names_every_module():
    """docs/ARCHITECTURE.md names every module of the three packages (a new file gets its row)."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in _modules().values()
               if f"`{p.relative_to(ROOT)}`" not in doc and p.read_text().strip()]
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def _project_files():
    for folder in PACKAGES + ("bench", "tests"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_private_name_imported_across_modules():
    """A name another module needs is public where it lives: no ``from jaxmoe.x import _y``."""
    bad = []
    for f in _project_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                bad += [f"{f.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, f"private names imported across modules: {bad}"


def test_no_module_getattr_forwarding():
    """No module forwards names it does not define through ``__getattr__``, except the package's
    lazy public API (jaxmoe/__init__.py: ``import jaxmoe.config`` must not import jax, and a
    package's ``__init__`` runs on every submodule import)."""
    allowed = {"jaxmoe/__init__.py"}
    bad = [str(f.relative_to(ROOT)) for f in _project_files()
           if str(f.relative_to(ROOT)) not in allowed
           and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(f.read_text()).body)]
    assert not bad, f"module __getattr__ shims: {bad}"


def test_the_dispatcher_is_bound_when_the_model_is_built():
    """Only constructors take the expert-parallel dispatcher (``Transformer(..., dispatch=)``,
    ``Model(cfg, dispatch)``, the template cache); no call below the model's own takes one."""
    bad = []
    for f in sorted((ROOT / "jaxmoe").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name not in ("__init__", "template"):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                if "dispatch" in names:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not bad, f"functions taking a dispatch= argument: {bad}"
