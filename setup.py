"""Dependencies and C extensions of kimi-vision-prep (the rest of the build is in pyproject.toml).

Here rather than in pyproject.toml because the shared package and the client are folders of this
checkout, named by absolute path so that pip finds them without an index, and because pyproject's
``ext-modules`` table is still experimental in setuptools (it warns on every build).
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
COMMON = f"kimi-vision-common @ {(ROOT / 'client' / 'common').as_uri()}"
CLIENT = f"kimi-vision-client @ {(ROOT / 'client').as_uri()}"



class BuildWithGeneratedHeaders(build_ext):
    """Write the C step's ``kimi_errors.h`` (its error tags and Triton codes, from
    ``kimi_vision_common/errors.py``) into the build folder before compiling."""

    def run(self) -> None:
        source = ROOT / "client" / "common" / "kimi_vision_common" / "errors.py"
        spec = importlib.util.spec_from_file_location("kimi_errors", source)
        errors = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(errors)
        include = Path(self.build_temp) / "generated"
        include.mkdir(parents=True, exist_ok=True)
        (include / "kimi_errors.h").write_text(errors.c_error_header())
        for extension in self.extensions:
            extension.include_dirs.append(str(include))
        super().run()


EXTENSIONS = [
    # Rows of a JPEG by Pillow's own libjpeg-turbo, in bands on several threads (jpeg_bands.py).
    # Built against the system's libjpeg headers (Debian libjpeg62-turbo-dev; the Makefile installs
    # them); optional: without them the package installs and clean JPEGs take simplejpeg (said once
    # in the log).
    Extension(
        "kimi_vision_prep._libjpeg",
        sources=["backend_src/kimi_vision_prep/_libjpeg.c"],
        libraries=["dl"],
        optional=True,
    ),
    # The Triton backend kimi_patchify (the C API, no Python): the last step of the vision ensembles
    # in a CPU rendering (serving/repository.py). Built as a module of the package so that it ships
    # in the wheel; the launcher lays it out as <backends>/kimi_patchify/libtriton_kimi_patchify.so;
    # never imported. Without a C compiler the package installs without it: CPU renderings then use
    # the Python preprocess step (the launcher says so once at start).
    Extension(
        "kimi_vision_prep._triton_patchify",
        sources=["backend_src/kimi_vision_prep/_triton_patchify.c"],
        extra_compile_args=["-O3", "-Wall", "-Wextra"],
        optional=True,
    ),
]

setup(
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": BuildWithGeneratedHeaders},
    # The library door: numpy 1 or 2.
    install_requires=[
        COMMON,
        "numpy>=1.26",
        "numba>=0.60",
        # The reference build: Pillow's verdict and pixels are the contract.
        "pillow==13.0.0",
        # The CPU fast route for clean JPEGs (libjpeg-turbo 3, SIMD; bit-equal to Pillow, decode.py).
        "simplejpeg==1.9.0",
        # FFmpeg through PyAV: video decode (its wheels bundle FFmpeg; tests also encode clips with it).
        "av>=14",
    ],
    extras_require={
        # The kimi-prep front (the client's) for hosts that bring their own tritonserver (NGC images).
        "cli": [CLIENT],
        # The server door: embedded tritonserver 2.51 (CPU) and the kimi-prep front with its client.
        # The tritonserver Python stub is built against numpy 1.x: with numpy 2 every output tensor
        # arrives empty, so the serving environment (only) keeps numpy 1.
        "serve": ["nvidia-pytriton==0.7.0", "numpy>=1.26,<2", CLIENT],
        # KimiVisionProcessor as a transformers BaseImageProcessor (plain class without it).
        "transformers": ["transformers>=4.45"],
        # nvImageCodec per CUDA major (its CPU backend works on hosts without CUDA).
        "cu12": ["nvidia-nvimgcodec-cu12>=0.9"],
        "cu13": ["nvidia-nvimgcodec-cu13>=0.9"],
        # CPU installs pin exactly this build (a range resolves to a CUDA build of several GB).
        "torch": ["torch==2.13.0"],
        "bench": ["matplotlib"],
        # Coverage-guided fuzzing (fuzz/fuzz_preprocess.py); Linux x86_64 wheels only.
        "fuzz": ["atheris>=2.3; sys_platform == 'linux' and platform_machine == 'x86_64'"],
        # check-jsonschema (the compose spec) and kubernetes-validate: the deploy files' schemas, offline.
        "test": ["pytest>=8", "hypothesis", "ruff", "matplotlib", "pyyaml", "check-jsonschema", "kubernetes-validate"],
    },
)
