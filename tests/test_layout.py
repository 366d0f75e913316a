"""The code layout rules: packages in layers with imports going down only, no import cycles between
the project's modules (function-level imports and package ``__init__`` edges included), and no module
above 500 lines."""

import ast
import io
import re
import tokenize
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


# The packages in layers, lowest first: a module may import only its own package and the packages of
# lower layers (function-level imports included). docs/ARCHITECTURE.md shows the same table.
LAYERS = [
    ("jaxmoe.errors", "jaxmoe.trees"),
    ("jaxmoe.extras", "jaxmoe.archs"),
    ("jaxmoe.config",),
    ("jaxmoe.model", "jaxmoe.storage", "jaxmoe.data", "torch_ref"),
    ("jaxmoe.parallel", "jaxmoe.checkpoint", "jaxmoe.port.io"),
    ("jaxmoe.port.maps",),
    ("jaxmoe.port.formats",),
    ("jaxmoe.port.commands",),
    ("jaxmoe.train",),
    ("jaxmoe.plan",),
    ("jaxmoe.cli",),
    ("parity",),
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}
# package faces that import nothing of their own: the root's lazy API (names as strings) and port's
FACES = {"jaxmoe", "jaxmoe.port"}


def unit_of(module: str) -> str:
    """The package (or top-level module) of LAYERS a module belongs to."""
    best = ""
    for unit in LAYER_OF:
        if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
            best = unit
    return best or module


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    # every module implicitly imports its own parent packages first, which is never a cycle by itself;
    # a package __init__'s imports of its own submodules ARE counted
    for n in graph:
        graph[n] = {t for t in graph[n] if not n.startswith(t + ".")}
    return graph


def test_no_import_cycles():
    graph = _graph()
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


def test_every_module_has_a_layer():
    missing = sorted(n for n in _modules() if n not in FACES and unit_of(n) not in LAYER_OF)
    assert not missing, f"modules outside every package of LAYERS (add the package to LAYERS): {missing}"


def test_imports_only_go_down():
    """No upward arrow: each import goes to the module's own package or to a lower layer."""
    bad = []
    for n, targets in _graph().items():
        if n in FACES:
            assert not targets, f"{n} is a face and imports {sorted(targets)}"
            continue
        me = unit_of(n)
        for t in sorted(targets):
            other = unit_of(t)
            if t in FACES or other == me:
                continue
            if LAYER_OF[other] >= LAYER_OF[me]:
                bad.append(f"{n} -> {t} ({me} may not import {other})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_layer_rule_catches_an_upward_import(tmp_path):
    """The rule can fail: a model module importing the trainer is reported."""
    f = tmp_path / "router.py"
    f.write_text("def f():\n    from jaxmoe.train import step\n")
    targets = _imports("jaxmoe.model.router", f, set(_modules()))
    assert "jaxmoe.train.step" in targets
    assert LAYER_OF[unit_of("jaxmoe.train.step")] > LAYER_OF[unit_of("jaxmoe.model.router")]


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


MAX_FUNCTION_LINES = 100


@pytest.mark.parametrize("folder", ["jaxmoe", "torch_ref", "parity", "bench"])
def test_no_function_above_100_lines(folder):
    """Every function of the product, the reference, the parity suites and the benchmarks reads on
    one screen or two (split it by what its parts do)."""
    long = {}
    for f in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{f.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions above {MAX_FUNCTION_LINES} lines: {long}"


def test_top_level_holds_few_modules():
    """The top of jaxmoe/ holds the command, the public API and the helpers every layer uses; the
    rest lives in the packages of LAYERS."""
    top = sorted(p.name for p in (ROOT / "jaxmoe").glob("*.py"))
    assert len(top) <= 10, top


# a figure with a unit of time or speed: "3.68 s", "1.2 GB/s", "498 tok/s", "2-3 ms"
_TIMING = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:ms|us|s|sec|seconds|min|tok/s|MB/s|GB/s|GiB/s"
                     r"|GFLOP/s|TFLOP/s|TF/s)(?![\w^/])")


def _comment_texts(source: str):
    """(line, text) of every comment and docstring-like string of a module's source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                           and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
            for i, text in enumerate(tok.string.splitlines()):
                yield tok.start[0] + i, text


def test_no_timings_in_code_comments():
    """Figures live in docs/MEASUREMENTS.md, each with its command; code keeps the reason."""
    found = [f"{f.relative_to(ROOT)}:{line}: {text.strip()[:80]}"
             for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))
             for line, text in _comment_texts(f.read_text()) if _TIMING.search(text)]
    assert not found, "timings in code comments (move them to docs/MEASUREMENTS.md):\n" + "\n".join(found)
    assert list(_comment_texts("x = 1  # 3.68 -> 2.85 s median\n")) and _TIMING.search("ran 1.2 GB/s")
    assert not _TIMING.search("2 s^2 l flops, 8 x 64 tokens")
