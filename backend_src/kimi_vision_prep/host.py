"""What the host has (GPUs), and the nvImageCodec extension set that fits it.

nvImageCodec loads every extension it finds when it is imported; on a host without CUDA the GPU
ones (nvJPEG, nvJPEG2000, nvTIFF) each print red ``[ERROR] ... Failed to load`` lines. The
launcher (for the Python stubs) and the CLI (for itself) point ``NVIMGCODEC_EXTENSIONS_PATH`` at a
folder holding only the CPU extensions on such a host, through :func:`codec_env`; the library
itself never sets the environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from pathlib import Path

# The wheel's extensions that need CUDA libraries (the others run on the CPU).
GPU_EXTENSIONS = re.compile(r"^lib(nvjpeg|nvjpeg2k|nvtiff)_ext\.so")


def cuda_device_count() -> int:
    """NVIDIA GPUs the kernel exposes (``/dev/nvidiaN``), without loading CUDA or NVML."""
    return sum(1 for path in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", path.name))


def nvimgcodec_extensions() -> Path | None:
    """The extensions folder of the installed nvImageCodec wheel (found without importing it:
    importing loads every extension)."""
    spec = importlib.util.find_spec("nvidia.nvimgcodec")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "extensions"
    return folder if folder.is_dir() else None


def codec_env(cache: Path) -> dict[str, str]:
    """``{"NVIMGCODEC_EXTENSIONS_PATH": <cache>/nvimgcodec-cpu}`` on a host without GPUs (the folder
    links the wheel's CPU extensions), else nothing; an operator's own setting wins."""
    source = nvimgcodec_extensions()
    if cuda_device_count() or source is None or "NVIMGCODEC_EXTENSIONS_PATH" in os.environ:
        return {}
    folder = cache / "nvimgcodec-cpu"
    folder.mkdir(parents=True, exist_ok=True)
    for extension in source.iterdir():
        link = folder / extension.name
        if not GPU_EXTENSIONS.match(extension.name) and not link.exists():
            with contextlib.suppress(FileExistsError):  # another launcher made it first
                link.symlink_to(extension)
    return {"NVIMGCODEC_EXTENSIONS_PATH": str(folder)}
