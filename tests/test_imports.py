"""No import circle in the package, including circles hidden behind function-local or type-only imports,
and the layout's rules: nothing imports the command lines, no private name crosses a package, and
modules, functions and the package root stay small.

Two circle checks: every module imported first, each in a fresh interpreter (so a module-level circle that
a lucky import order hides fails), and the static graph of every import statement in the package (so a
circle split across a function-local or ``TYPE_CHECKING`` import, which only bites when that function
runs or the type checker reads it, fails too).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import iterserve

ROOT = Path(iterserve.__file__).resolve().parent


def package_modules() -> list[str]:
    """Every module of the package, found on disk (nothing is imported to list them)."""
    names = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if "_build" not in parts and "__pycache__" not in parts:
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _source(module: str) -> Path:
    path = ROOT.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(module: str, modules: set[str], top_level_only: bool = False,
             type_only: bool = True) -> tuple[set[str], set[str]]:
    """(package modules, other top-level packages) that ``module`` imports: inside functions too unless
    ``top_level_only``, and under ``if TYPE_CHECKING:`` too unless not ``type_only``."""
    source = _source(module)
    tree = ast.parse(source.read_text(), str(source))
    package = module if source.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    internal = {m for m in found if m in modules and m != module}
    external = {m.split(".")[0] for m in found if not m.startswith("iterserve")}
    return internal, external


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_scanner_sees_a_circle_through_a_function_local_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    modules = set(package_modules())
    assert "iterserve.bench.batch" in _imports("iterserve.bench.validate", modules)[0]


def test_no_import_circle_in_the_import_statements():
    modules = set(package_modules())
    graph = {m: set(_imports(m, modules)[0]) for m in modules}
    # the package's __init__ re-exports the public API; a module importing ``iterserve`` itself for a
    # name would close a circle through it, which is what this check is for, so that edge is kept
    assert _cycles(graph) == []


FIRST_IMPORTS = """
import importlib, os, sys, traceback
for name in sys.argv[2].split(","):  # third-party packages, loaded once: they take no part in our circles
    try:
        importlib.import_module(name)
    except Exception:
        pass
assert not any(m == "iterserve" or m.startswith("iterserve.") for m in sys.modules)
running = set()
for module in sys.argv[1].split(","):
    if len(running) >= (os.cpu_count() or 1):
        running.discard(os.wait()[0])
    pid = os.fork()
    if pid == 0:  # a child with no iterserve module loaded yet: `module` is the first one imported
        try:
            importlib.import_module(module)
        except BaseException:
            print(module, traceback.format_exc().strip().splitlines()[-1], flush=True)
            os._exit(1)
        os._exit(0)
    running.add(pid)
for pid in running:
    os.waitpid(pid, 0)
"""


def test_the_first_import_check_fails_on_a_circle(tmp_path):
    pkg = tmp_path / "circle"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from circle.b import B\nA = 1\n")
    (pkg / "b.py").write_text("B = 2\n\n\ndef late():\n    return 0\n\n\nfrom circle.a import A  # noqa\n")
    proc = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, "circle.b,circle.a", ""], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=60)
    # b first works (b defines B before it imports a); a first fails: the order-hidden circle
    assert proc.stdout.splitlines() == ["circle.a ImportError: cannot import name 'A' from partially initialized "
                                        "module 'circle.a' (most likely due to a circular import) "
                                        f"({pkg / 'a.py'})"]


def test_every_module_imports_first_in_a_fresh_interpreter():
    """One fresh interpreter loads the third-party libraries, then forks a child per module, so each
    module is imported first, before any other of the package, as cheaply as a fork."""
    modules = package_modules()
    external = set().union(*(_imports(m, set(modules), top_level_only=True, type_only=False)[1] for m in modules))
    external -= set(sys.stdlib_module_names) | {"__future__"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, ",".join(modules), ",".join(sorted(external))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", f"modules that fail when imported first:\n{proc.stdout}"
    assert "torch" in external and len(modules) > 40


@pytest.mark.parametrize("module", ["iterserve.planner.roofline", "iterserve.config.units", "iterserve.bench.knee"])
def test_pure_modules_import_no_torch(module):
    """The planner's arithmetic and the shared helpers need no torch, nor do the modules they import
    (their packages' ``__init__`` aside, which re-export the public API)."""
    modules = set(package_modules())
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            internal, external = _imports(m, modules, top_level_only=True, type_only=False)
            assert "torch" not in external, f"{module} imports torch through {m}"
            todo += internal


def test_the_scanner_sees_type_only_imports():
    modules = set(package_modules())
    assert "iterserve.engine.structured_output" in _imports("iterserve.engine.sequence", modules)[0]
    assert "iterserve.engine.structured_output" not in _imports("iterserve.engine.sequence", modules,
                                                                  type_only=False)[0]


def test_nothing_imports_a_command_line():
    """The command lines (iterserve/cli/) sit on top: the engine, the server and the tools take settings
    as objects, so no module outside cli/ imports from it."""
    modules = set(package_modules())
    for m in modules:
        if m != "iterserve.cli" and not m.startswith("iterserve.cli."):
            found = {i for i in _imports(m, modules)[0] if i == "iterserve.cli" or i.startswith("iterserve.cli.")}
            assert not found, f"{m} imports the command line {sorted(found)}"


def _package(module: str) -> str:
    return module if _source(module).name == "__init__.py" else module.rpartition(".")[0]


def test_no_private_name_crosses_a_package():
    """A ``_name`` is its package's business: importing one from another package means it is not private."""
    modules = set(package_modules())
    for m in modules:
        for node in ast.walk(ast.parse(_source(m).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("iterserve") \
                    and not node.level:
                target = node.module if node.module in modules else node.module.rpartition(".")[0]
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private or _package(target) == _package(m), f"{m} imports {private} from {node.module}"


def test_modules_and_functions_stay_small():
    """No module over 500 lines, no function over 80, and at most 8 modules at the package root."""
    for m in package_modules():
        source = _source(m)
        text = source.read_text()
        assert len(text.splitlines()) <= 500, f"{source} has {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                assert length <= 80, f"{source}:{node.lineno} {node.name} has {length} lines"
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= 8, f"{len(root)} modules at the package root: {root}"


KERNEL_CHOICE = "iterserve.platforms.ops"  # the one module that decides between the C++ kernels and the reference


def reads_kernel_ops(source: str) -> bool:
    """Whether ``source`` reads the loaded extension (``iterserve.kernels.ops``): as an attribute of the
    ``kernels`` module under any name it is imported as, or imported by name."""
    tree = ast.parse(source)
    names = {"kernels"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("iterserve", "iterserve.kernels"):
            names |= {a.asname or a.name for a in node.names if node.module == "iterserve" and a.name == "kernels"}
            if node.module == "iterserve.kernels" and any(a.name == "ops" for a in node.names):
                return True
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "iterserve.kernels" and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "ops":
            target = node.value
            if isinstance(target, ast.Name) and target.id in names:
                return True
            if isinstance(target, ast.Attribute) and target.attr == "kernels":  # iterserve.kernels.ops
                return True
    return False


@pytest.mark.parametrize("source,reads", [
    ("from iterserve import kernels\nx = kernels.ops is None", True),
    ("from iterserve import kernels as k\nx = k.ops", True),
    ("import iterserve.kernels as kx\nx = kx.ops", True),
    ("import iterserve.kernels\nx = iterserve.kernels.ops", True),
    ("from iterserve.kernels import ops", True),
    ("from iterserve import kernels\nkernels.run_on_pool()", False),
    ("x = backend.ops.rms_norm", False),
])
def test_the_scanner_sees_a_read_of_the_kernels(source, reads):
    assert reads_kernel_ops(source) is reads


def test_one_module_decides_between_the_kernels_and_the_reference():
    """Every other module looks its kernels up on the op set that module chose (``ops_for``, ``cpu_kernels``),
    instead of asking again whether the extension loaded."""
    readers = {m for m in package_modules() if reads_kernel_ops(_source(m).read_text())}
    assert readers == {KERNEL_CHOICE}


def cxx_functions(text: str) -> list[tuple[int, int]]:
    """(first line, lines) of every function body at namespace level in C++ source: braces counted after
    comments are dropped; a brace opened by a namespace, struct, class or union does not count as a body."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    stack: list[tuple[bool, int]] = []  # (is a body, line it opened on)
    found, line, last_end = [], 1, 0
    for i, ch in enumerate(text):
        if ch == "\n":
            line += 1
        elif ch == "{":
            head = text[last_end:i]
            scope = re.search(r"\b(namespace|struct|class|union)\b[^()]*$|extern\s+\"C\"\s*$", head)
            stack.append((scope is None, line))
            last_end = i + 1
        elif ch in ";}":
            if ch == "}":
                body, opened = stack.pop()
                if body and all(not b for b, _ in stack):
                    found.append((opened, line - opened + 1))
            last_end = i + 1
    return found


def test_cxx_scanner_measures_a_function():
    source = ("namespace a {\nstruct S { int f() {\n return 1; } };\n"
              "int g(int x) {\n  if (x) {\n    return 2;\n  }\n  return 3;\n}\n}\n")
    assert cxx_functions(source) == [(2, 2), (4, 6)]


def test_cxx_functions_stay_small():
    """The C++ kernels keep Python's limit on functions: none over 80 lines."""
    for path in sorted((ROOT / "csrc").glob("*.[ch]*")):
        for first, length in cxx_functions(path.read_text()):
            assert length <= 80, f"{path}:{first} a function of {length} lines"


def test_cxx_modules_stay_small():
    """The C++ sources and headers keep Python's limit on modules: none over 500 lines."""
    paths = sorted(p for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".h"))
    assert len(paths) > 10
    for path in paths:
        lines = len(path.read_text().splitlines())
        assert lines <= 500, f"{path} has {lines} lines"
