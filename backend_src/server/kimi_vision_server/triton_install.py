"""Find a ``tritonserver``: the NGC one on PATH, else the one the ``nvidia-pytriton`` wheel ships.

On an NGC Triton container ``tritonserver`` is on PATH with its own backends. Elsewhere the PyPI
wheel ``nvidia-pytriton`` ships tritonserver 2.51 with the Python backend (it runs on CPU); its
backend directory is laid out once in a cache dir (``$XDG_CACHE_HOME/kimi_vision_prep/triton`` or
``~/.cache/kimi_vision_prep/triton``) with the Python stub matching the running interpreter, and
the environment is set so that stub loads this interpreter's libpython and this venv's packages.
The C backend ``kimi_patchify`` (``models/patchify/``, built with the package) is laid out
next to it (:func:`patchify_library`). There tritonserver runs with jemalloc where the host has
it (``allocator.server_allocator_env``), and the stubs start through :data:`STUB_WRAPPER`, which
keeps it out of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import kimi_vision_prep

from .allocator import SERVER_ONLY_ENV, server_allocator_env
from .host import codec_env

PACKAGE_ROOT = Path(__file__).resolve().parent  # .../kimi_vision_server
LIBRARY_ROOT = Path(kimi_vision_prep.__file__).resolve().parent
STUB = "triton_python_backend_stub"
PATCHIFY_BACKEND = "kimi_patchify"
# The Python backend runs <backends>/python/triton_python_backend_stub; this script stands there and
# runs the real stub (in bin/, under its own name, which the watchdog looks for) without the
# entries of tritonserver's environment that are its own (allocator.SERVER_ONLY_ENV).
STUB_WRAPPER = f"""#!/bin/sh
for name in ${SERVER_ONLY_ENV}; do unset "$name"; done
unset {SERVER_ONLY_ENV}
exec "${{0%/*}}/bin/{STUB}" "$@"
"""


@dataclass(frozen=True)
class TritonInstall:
    """How to run a tritonserver: the binary, its ``--backend-directory`` (None: its default), env."""

    binary: Path
    backend_directory: Path | None
    env: dict[str, str]
    embedded: bool

    @property
    def cache_directory(self) -> Path | None:
        """Where its response caches are (``caches/local/libtritoncache_local.so`` beside ``bin/``,
        as the wheel and the NGC image lay them out); None: its own default."""
        caches = self.binary.parent.parent / "caches"
        return caches if (caches / "local").is_dir() else None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kimi_vision_prep"


def cache_dir() -> Path:
    return cache_root() / "triton"


def default_model_repository() -> Path | None:
    """``model_repository/`` of the source checkout this package runs from; None for an installed
    package (the launcher then renders the repository from the presets)."""
    checkout = PACKAGE_ROOT.parents[2] / "model_repository"
    return checkout if (checkout / "kimi_k25_vision" / "config.pbtxt").is_file() else None


def _stub_env(env: dict[str, str]) -> None:
    """Let the stubs import this package, the library and this venv's packages, write no
    ``__pycache__`` into the model repository, and give numba a writable on-disk cache
    (site-packages often is not writable, and stubs may run as another user)."""
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    folders = dict.fromkeys(str(package.parent) for package in (PACKAGE_ROOT, LIBRARY_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*folders, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The repository stays as rendered (it may be read-only, and `diff -r` with a fresh rendering stays empty).
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    env.setdefault("NUMBA_CACHE_DIR", str(cache_root() / "numba"))


def patchify_library() -> Path | None:
    """The built ``kimi_patchify`` backend: the package's ``_triton_patchify`` extension (a plain
    shared object; Triton loads it as ``libtriton_kimi_patchify.so``); None where the install had
    no C compiler (it is an optional extension)."""
    spec = importlib.util.find_spec(f"{PACKAGE_ROOT.name}._triton_patchify")  # found, not imported
    return None if spec is None or spec.origin is None else Path(spec.origin)


def _layout_embedded_backends(pytriton_dir: Path) -> Path:
    """``<cache>/<version>/backends/`` with ``python/`` (the backend library, utils, the matching
    stub in ``bin/`` and :data:`STUB_WRAPPER` in the stub's place) and ``kimi_patchify/``."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    stub = pytriton_dir / "tritonserver" / "python_backend_stubs" / version[2:] / STUB
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version[2:]} ({stub})")
    source = pytriton_dir / "tritonserver" / "backends" / "python"
    files = {  # path under backends/ -> its source
        "python/libtriton_python.so": source / "libtriton_python.so",
        "python/triton_python_backend_utils.py": source / "triton_python_backend_utils.py",
        f"python/bin/{STUB}": stub,
    }
    library = patchify_library()
    if library is not None:
        files[f"{PATCHIFY_BACKEND}/libtriton_{PATCHIFY_BACKEND}.so"] = library
    stamp = "|".join([*(f"{f}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files.values()), STUB_WRAPPER])
    backends = cache_dir() / f"{version}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}" / "backends"
    if (backends / "python" / STUB).exists():
        remove_unused_layouts(backends.parent)
        return backends
    backends.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="backends.", dir=backends.parent))
    for name, path in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, staging / name)
    wrapper = staging / "python" / STUB
    wrapper.write_text(STUB_WRAPPER)
    wrapper.chmod(0o755)
    try:
        staging.rename(backends)  # atomic: a concurrent launcher may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    remove_unused_layouts(backends.parent)
    return backends


LAYOUT_GRACE_S = 60.0


def remove_unused_layouts(current: Path) -> list[Path]:
    """Remove the other layouts under :func:`cache_dir` (each install or rebuild of the backends
    makes a new one, ~3 MB) that no running process names on its command line (a tritonserver
    started from one has it in ``--backend-directory``); the removed ones."""
    # A layout another launcher is writing right now is young: left alone.
    others = [
        path
        for path in current.parent.iterdir()
        if path != current and path.is_dir() and time.time() - path.stat().st_mtime > LAYOUT_GRACE_S
    ]
    if not others:  # the usual start: nothing to look up in /proc
        return []
    command_lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            command_lines.append(cmdline.read_bytes().decode(errors="replace"))
    unused = [path for path in others if not any(str(path) in line for line in command_lines)]
    for path in unused:
        shutil.rmtree(path, ignore_errors=True)
    return unused


def find_tritonserver() -> TritonInstall:
    """``tritonserver`` on PATH (NGC container), else the embedded one from ``nvidia-pytriton``."""
    # A GPU-less host loads only nvImageCodec's CPU extensions (host.py: no red "Failed to load"
    # lines); operator values win. glibc's retention stays off: keeping the peak heap cost
    # ~600-930 MiB under load (allocator.py's docstring, BENCHMARKS.md's history).
    env = {**codec_env(cache_root()), **os.environ}
    _stub_env(env)
    on_path = shutil.which("tritonserver", path=os.environ.get("PATH"))
    if on_path:
        return TritonInstall(Path(on_path), None, env, embedded=False)
    try:
        import pytriton
    except ImportError:
        raise RuntimeError(
            "no tritonserver on PATH and nvidia-pytriton is not installed: "
            "`pip install './backend_src/server[embedded]'` or run inside an NGC tritonserver container"
        ) from None
    pytriton_dir = Path(pytriton.__file__).resolve().parent
    binary = pytriton_dir / "tritonserver" / "bin" / "tritonserver"
    backends = _layout_embedded_backends(pytriton_dir)
    libs = [pytriton_dir.parent / "nvidia_pytriton.libs", Path(sysconfig.get_config_var("LIBDIR") or "")]
    # The stub would otherwise resolve the system libpython instead of this interpreter's.
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*(str(p) for p in libs if str(p)), env.get("LD_LIBRARY_PATH", "")])
    server_only = server_allocator_env(os.environ)  # only here: the stubs start from our STUB_WRAPPER
    env.update(server_only)
    env[SERVER_ONLY_ENV] = " ".join(server_only)
    return TritonInstall(binary, backends, env, embedded=True)
