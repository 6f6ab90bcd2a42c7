"""The layer rule, checked on the source: every import of every module, module-level, inside
functions and under ``TYPE_CHECKING`` alike.

    kimi_vision_common  <-  kimi_vision_prep (core)  <-  kimi_vision_server  <-  CLI
    kimi_vision_common  <-  kimi_vision_client

The CLI layer is ``kimi_vision_server.cli`` (its commands and ``bench_local/`` use the client's
front); the client needs neither the library nor the server.

Inside a package, its folders (:data:`UNIT_RULES`, :data:`IMPORTED_ONLY_BY`): a library stage
(decode, resize, patchify, video) imports no other stage, only the root foundations; the server's
render, models and watch import no other job (launch renders and starts the watchdog); the client
builds up from transport to its processors; the CLIs and the engine folders are nobody's dependency.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kimi_vision_common": ROOT / "client" / "common" / "kimi_vision_common",
    "kimi_vision_client": ROOT / "client" / "kimi_vision_client",
    "kimi_vision_prep": ROOT / "backend_src" / "kimi_vision_prep",
    "kimi_vision_server": ROOT / "backend_src" / "server" / "kimi_vision_server",
}
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


def import_nodes(module: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement of ``module`` anywhere in its source, with the absolute name it imports
    from (``from . import x`` in ``pkg.mod`` -> ``pkg``; a plain ``import`` -> "")."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield node, ""
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                yield node, ".".join([*base, node.module] if node.module else base)
            else:
                yield node, node.module or ""


def imports_of(module: str) -> set[str]:
    """The absolute names ``module`` imports anywhere in its source (``from . import x`` -> ``pkg.x``)."""
    names: set[str] = set()
    for node, stem in import_nodes(module):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        else:
            names.add(stem)
            names.update(f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in MODULES)
    return names


def layer(module: str) -> str:
    if module.startswith("kimi_vision_common"):
        return "common"
    if module.startswith("kimi_vision_client"):
        return "client"
    if module == "kimi_vision_server.cli" or module.startswith("kimi_vision_server.cli."):
        return "cli"
    return "serving" if module.startswith("kimi_vision_server") else "core"


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


# Extras a common or client module may use where they are installed (the processor interface is a
# transformers image processor there, and returns torch tensors when asked), never require.
OPTIONAL = ("torch", "transformers")


def required_imports_of(module: str) -> set[str]:
    """The names ``module`` imports at module level outside a ``try`` that catches ImportError:
    those it cannot load without (a function's import runs only where it is called)."""
    tree = ast.parse(MODULES[module].read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
        ):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            if isinstance(inner, ast.Import):
                names.update(alias.name for alias in inner.names)
            elif isinstance(inner, ast.ImportFrom) and not inner.level:
                names.add(inner.module or "")
    return names


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) in ("common", "client")))
def test_common_and_client_import_no_heavy_dependency(module: str) -> None:
    """No heavy import at all, but the client's tritonclient and, where installed only, torch and
    transformers (optional: in a function or behind ``except ImportError``)."""
    allowed = {"tritonclient"} if layer(module) == "client" else set()
    heavy = {name for name in imports_of(module) if name.split(".")[0] in set(HEAVY) - allowed - set(OPTIONAL)}
    assert not heavy, f"{module} imports {sorted(heavy)}"
    required = {name for name in required_imports_of(module) if name.split(".")[0] in OPTIONAL}
    assert not required, f"{module} cannot load without {sorted(required)}"


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


# Inside a package: the unit of a module is its folder below the package (``decode`` for
# ``kimi_vision_prep.decode.routes``), else its own name (a root module). A unit listed here may
# import, of its own package, only itself and the units named; a unit not listed may import any.
LIBRARY_STAGES = ("decode", "resize", "patchify", "video")
# What the stages hand each other and share (the root modules a stage may import); every other root
# module (pipeline, video_pipeline, processor, ...) is where the stages meet and may import any.
LIBRARY_FOUNDATIONS = frozenset({"kernels", "limits", "buffers", "numba_runtime", "extras", "pixels"})
# The server's root modules, shared by all its jobs (settings, the host's layout, the Triton install
# and its malloc): they import no folder of the server.
SERVER_ROOT = frozenset({"settings", "host", "triton_install", "allocator"})
UNIT_RULES: dict[str, dict[str, frozenset[str]]] = {
    "kimi_vision_prep": {
        # A stage imports no other stage and no meeting module; decode binds the _libjpeg extension.
        **{stage: LIBRARY_FOUNDATIONS | {stage} for stage in LIBRARY_STAGES},
        "decode": LIBRARY_FOUNDATIONS | {"decode", "_libjpeg"},
        **dict.fromkeys(LIBRARY_FOUNDATIONS, LIBRARY_FOUNDATIONS),
    },
    # The server's jobs: rendering the repository, the Triton models, launching tritonserver and
    # watching its stubs, each a folder on the root modules every job shares; launch renders and
    # starts the watchdog; the CLI (cli/) is above them all.
    "kimi_vision_server": {
        **dict.fromkeys(SERVER_ROOT, SERVER_ROOT),
        "render": SERVER_ROOT | {"render"},
        "models": SERVER_ROOT | {"models"},
        "watch": frozenset({"watch"}),
        "launch": SERVER_ROOT | {"launch", "render", "watch"},
    },
    # The client from the wire up: transport <- request <- servers <- the client's front <- the
    # processors engines build; the CLI (cli/) above all of them.
    "kimi_vision_client": {
        "transport": frozenset({"transport"}),
        "request": frozenset({"request", "transport"}),
        "servers": frozenset({"servers", "request", "transport"}),
        "client": frozenset({"client", "servers", "request", "transport"}),
        "processors": frozenset({"processors", "remote_processor", "client", "servers", "request", "transport"}),
        "remote_processor": frozenset({"remote_processor", "processors", "client", "servers", "request", "transport"}),
    },
    # The engines' folders stand on the common modules; remote_setting (the address grammar both
    # engines read) on the wire's names only.
    "kimi_vision_common": {"remote_setting": frozenset({"remote_setting", "wire"})},
}
# Units of a package that only the units named may import (their own modules aside): the engine
# folders of the shared package are no other module's dependency, and nothing of the client
# depends on its CLI.
IMPORTED_ONLY_BY: dict[str, dict[str, frozenset[str]]] = {
    "kimi_vision_server": {"cli": frozenset({"cli"})},
    "kimi_vision_common": {
        "vllm_plugin": frozenset({"vllm_plugin"}),
        "sglang_processors": frozenset({"sglang_processors"}),
    },
    "kimi_vision_client": {"cli": frozenset({"cli"})},
}


def unit_of(module: str) -> tuple[str, str]:
    """(package, unit) of a dotted module name; the unit of a package's ``__init__`` is ``__init__``."""
    package, _, rest = module.partition(".")
    return package, rest.split(".")[0] if rest else "__init__"


def imported_units(module: str) -> set[tuple[str, str]]:
    """The (package, unit) pairs ``module`` imports anywhere in its source; ``from pkg import name``
    counts as the unit ``name`` where it is a module or folder of ``pkg``, else as ``pkg``'s ``__init__``."""
    units: set[tuple[str, str]] = set()
    for node, stem in import_nodes(module):
        if isinstance(node, ast.Import):
            units.update(unit_of(alias.name) for alias in node.names if alias.name.split(".")[0] in PACKAGES)
        elif stem.split(".")[0] not in PACKAGES:
            continue
        elif "." in stem:
            units.add(unit_of(stem))
        else:
            for alias in node.names:
                child = f"{stem}.{alias.name}"
                is_unit = child in MODULES or PACKAGES[stem].joinpath(alias.name).is_dir()
                is_extension = alias.name.startswith("_")  # from pkg import _libjpeg: a C extension
                units.add(unit_of(child) if is_unit or is_extension else (stem, "__init__"))
    return units


@pytest.mark.parametrize("module", sorted(m for m in MODULES if unit_of(m)[1] in UNIT_RULES.get(unit_of(m)[0], {})))
def test_each_folder_imports_only_the_units_its_rule_allows(module: str) -> None:
    package, unit = unit_of(module)
    allowed = UNIT_RULES[package][unit]
    wrong = {u for p, u in imported_units(module) if p == package and u not in allowed}
    assert not wrong, f"{module} ({unit}) imports {sorted(wrong)} of {package}; its rule allows {sorted(allowed)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if unit_of(m)[0] in IMPORTED_ONLY_BY))
def test_a_reserved_unit_is_imported_only_by_its_own(module: str) -> None:
    package, unit = unit_of(module)
    reserved = IMPORTED_ONLY_BY[package]
    wrong = {u for p, u in imported_units(module) if p == package and unit not in reserved.get(u, {unit})}
    assert not wrong, f"{module} ({unit}) imports {sorted(wrong)}, reserved to {[sorted(reserved[u]) for u in wrong]}"


def test_every_folder_rule_names_units_that_exist() -> None:
    """A rule naming a folder or module that is not there (a rename the rule missed) checks nothing."""
    extensions = {"_libjpeg", "_triton_patchify"}  # the C extensions, built by setup.py
    for package in sorted(PACKAGES):
        rules = UNIT_RULES.get(package, {})
        units = {unit_of(m)[1] for m in MODULES if m.startswith(package + ".")} | extensions
        reserved = IMPORTED_ONLY_BY.get(package, {})
        named = {*rules, *reserved} | {u for allowed in (*rules.values(), *reserved.values()) for u in allowed}
        assert named <= units, f"{package}: {sorted(named - units)} are not units of it"


def test_importing_the_library_loads_no_kernel_codec_or_server_module() -> None:
    """``python -X importtime -c "import kimi_vision_prep"``: no numba, PyAV, nvImageCodec, torch,
    tritonclient, server or client module among what it imports."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import kimi_vision_prep"],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    project = ("kimi_vision_prep.", "kimi_vision_server", "kimi_vision_client")
    heavy = {name for name in loaded if name.split(".")[0] in HEAVY or name.startswith(project)}
    assert not heavy, sorted(heavy)


@pytest.fixture(scope="module")
def library_wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel ``pip install .`` installs, built from a copy of this checkout's files (tracked and
    new, not ignored: no build folder or in-place extension of this checkout leaks into it)."""
    source, out = tmp_path_factory.mktemp("checkout"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("kimi_vision_prep-*.whl")
    return zipfile.ZipFile(wheel)


def test_library_wheel_holds_the_library_modules_only(library_wheel: zipfile.ZipFile) -> None:
    """Every file is the library package's or the wheel's metadata, and its modules are exactly the
    library folder's: no server, CLI, client or benchmark module."""
    names = library_wheel.namelist()
    outside = [n for n in names if not n.startswith(("kimi_vision_prep/", "kimi_vision_prep-"))]
    assert not outside, outside
    modules = {n.removeprefix("kimi_vision_prep/") for n in names if n.endswith(".py")}
    folder = PACKAGES["kimi_vision_prep"]
    assert modules == {p.relative_to(folder).as_posix() for p in folder.rglob("*.py")}


def test_library_wheel_imports_no_client_or_server_and_reads_no_checkout_file(library_wheel: zipfile.ZipFile) -> None:
    """No module of the wheel imports ``kimi_vision_client`` or ``kimi_vision_server``, and none
    finds a file from its own location (``__file__``): the installed library reads nothing of a
    checkout."""
    for name in (n for n in library_wheel.namelist() if n.endswith(".py")):
        tree = ast.parse(library_wheel.read(name))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        foreign = {m for m in imported if m.split(".")[0] in ("kimi_vision_client", "kimi_vision_server")}
        assert not foreign, f"{name} imports {sorted(foreign)}"
        own_location = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "__file__"]
        assert not own_location, f"{name} uses __file__ on lines {own_location}"


def layout_section(package: str) -> str:
    """docs/layout.md's section of ``package`` (from its heading to the next)."""
    text = (ROOT / "docs" / "layout.md").read_text()
    return re.search(rf"^## `[^`]*{package}/`.*?(?=^## |\Z)", text, flags=re.S | re.M)[0]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_layout_doc_lists_each_folder_of_a_package(package: str) -> None:
    """The first column of docs/layout.md's tables names every folder of the package, no other."""
    listed = set(re.findall(r"^\| `(\w+)/` \|", layout_section(package), flags=re.M))
    folders = {p.parent.name for p in PACKAGES[package].glob("*/__init__.py")}
    assert listed == folders


def test_the_layout_doc_names_the_root_modules_the_folder_rules_use() -> None:
    """The library's foundations and the server's root modules, as docs/layout.md states them."""
    foundations = re.search(r"^\| foundations \|[^\n]*", layout_section("kimi_vision_prep"), flags=re.M)[0]
    assert set(re.findall(r"`(\w+)\.py`", foundations)) == LIBRARY_FOUNDATIONS
    server_root = re.search(r"Root modules, .*?\n\n", layout_section("kimi_vision_server"), flags=re.S)[0]
    assert set(re.findall(r"`(\w+)\.py`", server_root)) == SERVER_ROOT


def test_the_decode_modules_names_import_from_the_decode_folder() -> None:
    """``from kimi_vision_prep.decode import ImageDecoder`` (the module ``decode`` before it was a
    folder) gives the classes the folder's modules define."""
    from kimi_vision_prep import decode
    from kimi_vision_prep.decode import decoder, routes, stats

    assert decode.ImageDecoder is decoder.ImageDecoder and decode.default_decoder is decoder.default_decoder
    assert decode.DecodedImage is routes.DecodedImage and decode.DecodeStats is stats.DecodeStats
    for name in ("DecodePath", "CPU_ROUTES", "FANCY_UPSAMPLING_OPTIONS", "import_nvimgcodec"):
        assert getattr(decode, name) is getattr(routes, name)
