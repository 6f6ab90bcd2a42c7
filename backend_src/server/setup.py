"""Dependencies and the C step of kimi-vision-server (the rest of the build is in pyproject.toml).

The library, the client and the shared package are folders of this checkout, named by absolute
path so that ``pip install ./backend_src/server`` finds them without an index.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The C step's sources (models/patchify/README.md): one extension, kimi_vision_server._triton_patchify.
PATCHIFY = "kimi_vision_server/models/patchify"


def common_module(name: str):
    """``kimi_vision_common/<name>.py`` loaded from its file (it imports nothing; the shared package
    need not be installed where this builds)."""
    source = ROOT / "client" / "common" / "kimi_vision_common" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kimi_{name}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithGeneratedHeaders(build_ext):
    """Write the C step's ``kimi_errors.h`` (its error tags and Triton codes) and
    ``kimi_messages.h`` (the words of its checks) from ``kimi_vision_common`` into the build folder
    before compiling."""

    def run(self) -> None:
        include = Path(self.build_temp) / "generated"
        include.mkdir(parents=True, exist_ok=True)
        (include / "kimi_errors.h").write_text(common_module("errors").c_error_header())
        (include / "kimi_messages.h").write_text(common_module("messages").c_message_header())
        for extension in self.extensions:
            extension.include_dirs.append(str(include))
        super().run()


setup(
    # The Triton backend kimi_patchify (the C API, no Python): the last step of the vision ensembles
    # in a CPU rendering (repository.py). Built as a module of the package so that it ships in the
    # wheel; the launcher lays it out as <backends>/kimi_patchify/libtriton_kimi_patchify.so; never
    # imported. Without a C compiler the package installs without it: CPU renderings then use the
    # Python preprocess step (the launcher says so once at start).
    ext_modules=[
        Extension(
            "kimi_vision_server._triton_patchify",
            sources=[f"{PATCHIFY}/{name}.c" for name in ("backend", "execute", "kernels", "kimi_json")],
            depends=[f"{PATCHIFY}/{name}.h" for name in ("kimi_patchify", "triton_api", "kimi_json")],
            extra_compile_args=["-O3", "-Wall", "-Wextra"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildWithGeneratedHeaders},
    install_requires=[
        f"kimi-vision-prep @ {ROOT.as_uri()}",
        f"kimi-vision-common @ {(ROOT / 'client' / 'common').as_uri()}",
        # The kimi-prep front the server's commands join, and the demo's and bench's client.
        f"kimi-vision-client @ {(ROOT / 'client').as_uri()}",
    ],
    extras_require={
        # The embedded tritonserver 2.51 (CPU) with the Python backend, for hosts without their own
        # (NGC images bring one). Its Python stub is built against numpy 1.x: with numpy 2 every
        # output tensor arrives empty, so this install (only) keeps numpy 1.
        "embedded": ["nvidia-pytriton==0.7.0", "numpy>=1.26,<2"],
        # The library's nvImageCodec per CUDA major.
        "cu12": [f"kimi-vision-prep[cu12] @ {ROOT.as_uri()}"],
        "cu13": [f"kimi-vision-prep[cu13] @ {ROOT.as_uri()}"],
    },
)
