"""The architecture, held by tests: packages import only the layers below them, in the order
docs/architecture.md writes down, and every file that page names exists; no import cycle inside
llmtrain/ (lazy imports included), the config package never imports torch, the CLI's entry module
imports only the standard library (so `llmtrain --help` answers instantly), no function is over
120 lines, no module over 600, and the step loop `fit` is under 100 (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmtrain"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_FUNCTION_LINES = 120
MAX_FIT_LINES = 100
MAX_MODULE_LINES = 600  # a longer module usually holds several jobs


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imported(path: Path) -> set[str]:
    """The llmtrain modules a file imports anywhere (inside functions too): a lazy import is still a
    dependency, and a cycle through one is still a cycle."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            # `import a.b.c` loads a, a.b and a.b.c: every package on the way runs its __init__
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in MODULES)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle() -> None:
    graph = {name: _imported(path) - {name} for name, path in MODULES.items()}
    # A package's __init__ that imports its own submodule is not a cycle of two modules.
    graph = {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in graph.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def documented_layers() -> list[str]:
    """The layers as docs/architecture.md lists them under "## Layers", top first: each line of its
    first code block starts with a package (or a top-level module) of llmtrain."""
    section = ARCHITECTURE.read_text().split("\n## Layers\n", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines()[1:] if line.strip()]


def _unit(module: str) -> str:
    """The layer a module belongs to: its package under llmtrain, or its own name at the top."""
    return module.split(".")[1] if module.count(".") else module


def test_the_documented_layers_are_the_packages() -> None:
    layers = documented_layers()
    units = {_unit(name) for name in MODULES if name != "llmtrain"} - {"__main__"}
    assert len(layers) == len(set(layers)), "a layer listed twice"
    assert set(layers) == units


def test_packages_import_only_the_layers_below_them() -> None:
    rank = {unit: i for i, unit in enumerate(reversed(documented_layers()))}  # 0: the bottom
    upward = []
    for name, path in MODULES.items():
        own = _unit(name)
        if own not in rank:  # llmtrain/__init__.py (the version), __main__.py (runs the CLI)
            continue
        for imported in sorted(_imported(path)):
            other = _unit(imported)
            if other != own and other in rank and rank[other] > rank[own]:
                upward.append(f"{name} imports {imported}")
    assert upward == []


def test_the_files_the_architecture_page_names_exist() -> None:
    """A path in docs/architecture.md (`training/setup.py`, `tests/test_train.py`) is a file here:
    the page and the code say the same."""
    named = set(re.findall(r"(?<![\w./-])((?:[a-z_]+/)+[a-z_0-9]+\.py)\b", ARCHITECTURE.read_text()))
    missing = sorted(path for path in named
                     if not any((base / path).exists() for base in (PACKAGE, ROOT, ROOT / "tests")))
    assert missing == []


def _run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=PACKAGE.parent).stdout.strip()


def test_config_imports_no_torch() -> None:
    modules = sorted(name for name in MODULES if name == "llmtrain.config" or name.startswith("llmtrain.config."))
    code = (f"import sys; import {', '.join(modules)}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hydra', 'numpy')))")
    # hydra is imported only inside the functions that register and convert (the CLI calls them)
    assert _run_python(code) == "[]"


def test_the_cli_entry_module_imports_only_the_standard_library() -> None:
    tree = ast.parse((PACKAGE / "cli" / "__init__.py").read_text())
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    imported = {alias.name.split(".")[0] for node in top_level if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in top_level if isinstance(node, ast.ImportFrom) and node.module}
    imported.discard("__future__")
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    # and at run time: importing it (what `llmtrain --help` does first) loads nothing heavy
    loaded = _run_python("import sys; import llmtrain.cli; "
                         "print(sorted({m.split('.')[0] for m in sys.modules} "
                         "& {'torch', 'numpy', 'hydra', 'omegaconf', 'rich'}))")
    assert loaded == "[]"


def _functions() -> list[tuple[str, int]]:
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{name}.{node.name} (line {node.lineno})", node.end_lineno - node.lineno + 1))
    return found


def test_no_function_is_over_120_lines() -> None:
    assert [(name, n) for name, n in _functions() if n > MAX_FUNCTION_LINES] == []


def test_no_module_is_over_600_lines() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_the_step_loop_reads_in_one_sitting() -> None:
    fit = [n for name, n in _functions() if name.startswith("llmtrain.training.loop.fit ")]
    assert fit, "llmtrain.training.loop.fit is the step loop"
    assert fit[0] < MAX_FIT_LINES


@pytest.mark.parametrize("package", ["training"])
def test_ruff_complexity(package: str) -> None:
    """McCabe complexity at most 20 in training/ (ruff C901, configured in pyproject.toml)."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this Python")
    done = subprocess.run([str(ruff), "check", "--select", "C901", str(PACKAGE / package)], capture_output=True,
                          text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stdout
