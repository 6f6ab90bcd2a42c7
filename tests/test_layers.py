"""The layer rule, checked on the source: every import of every module, module-level, inside
functions and under ``TYPE_CHECKING`` alike.

    kimi_vision_common  <-  kimi_vision_prep (core)  <-  kimi_vision_prep.serving  <-  CLI
    kimi_vision_common  <-  kimi_vision_client

The CLI layer is ``kimi_vision_prep.cli`` and ``kimi_vision_prep.bench_local`` (they use the
client's front); the client needs neither the library nor the server.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kimi_vision_common": ROOT / "client" / "common" / "kimi_vision_common",
    "kimi_vision_client": ROOT / "client" / "kimi_vision_client",
    "kimi_vision_prep": ROOT / "backend_src" / "kimi_vision_prep",
}
CLI_MODULES = ("kimi_vision_prep.cli", "kimi_vision_prep.bench_local")
HEAVY = ("numba", "av", "simplejpeg", "nvidia", "torch", "transformers", "tritonclient")


def module_names() -> dict[str, Path]:
    """Every module of the three packages by dotted name."""
    names = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            dotted = ".".join((package, *parts)).removesuffix(".__init__")
            names[dotted] = path
    return names


MODULES = module_names()


def imports_of(module: str) -> set[str]:
    """The absolute names ``module`` imports anywhere in its source (``from . import x`` -> ``pkg.x``)."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            names.add(stem)
            names.update(f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in MODULES)
    return names


def layer(module: str) -> str:
    if module.startswith("kimi_vision_common"):
        return "common"
    if module.startswith("kimi_vision_client"):
        return "client"
    if module in CLI_MODULES:
        return "cli"
    return "serving" if module.startswith("kimi_vision_prep.serving") else "core"


# What each layer may import from the project (anything else of the project is a violation).
ALLOWED = {
    "common": {"common"},
    "client": {"common", "client"},
    "core": {"common", "core"},
    "serving": {"common", "core", "serving"},
    "cli": {"common", "core", "serving", "cli", "client"},
}


def project_imports(module: str) -> set[str]:
    return {name for name in imports_of(module) if name in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_only_its_own_and_lower_layers(module: str) -> None:
    wrong = {name for name in project_imports(module) if layer(name) not in ALLOWED[layer(module)]}
    assert not wrong, f"{module} ({layer(module)}) imports {sorted(wrong)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) in ("common", "client")))
def test_common_and_client_import_no_heavy_dependency(module: str) -> None:
    allowed = {"tritonclient"} if layer(module) == "client" else set()
    heavy = {name for name in imports_of(module) if name.split(".")[0] in set(HEAVY) - allowed}
    assert not heavy, f"{module} imports {sorted(heavy)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) == "core"))
def test_core_knows_nothing_of_triton(module: str) -> None:
    triton_modules = ("tritonclient", "triton_python_backend_utils")
    triton = {name for name in imports_of(module) if name.split(".")[0] in triton_modules}
    assert not triton, f"{module} imports {sorted(triton)}"


def test_no_import_cycle_between_modules() -> None:
    """Between modules (a package's ``__init__`` importing its own modules aside): no cycle, lazy or
    type-only imports included."""
    graph = {m: {n for n in project_imports(m) if n != m and not m.startswith(n + ".")} for m in MODULES}
    for package in PACKAGES:
        graph[package] = set()  # a package's __init__ re-exports its modules lazily; it is not a layer
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for name in sorted(graph[module]):
            if state.get(name) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name) :], name]))
            if name not in state:
                visit(name, [*path, name])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_importing_the_library_loads_no_kernel_codec_or_server_module() -> None:
    """``python -X importtime -c "import kimi_vision_prep"``: no numba, PyAV, nvImageCodec, torch,
    tritonclient or serving module among what it imports."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import kimi_vision_prep"],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    heavy = {name for name in loaded if name.split(".")[0] in HEAVY or name.startswith("kimi_vision_prep.")}
    assert not heavy, sorted(heavy)
