"""The decode stage: encoded bytes -> pixels at the stored size, with Pillow's verdict (the routes,
their decoder pool, the JPEG scan, libjpeg-turbo in row bands, EXIF orientation of decoded pixels).

May import the root foundations (kernels, limits, buffers, numba_runtime, extras, pixels) and
kimi_vision_common; never another stage (resize, patchify, video) nor a root meeting module.
"""

from __future__ import annotations

import importlib
from typing import Any

# The names the module ``kimi_vision_prep.decode`` held before this folder, by the module now
# defining each (``from kimi_vision_prep.decode import ImageDecoder`` keeps working).
_EXPORTS = {
    **dict.fromkeys(("ImageDecoder", "default_decoder"), ".decoder"),
    **dict.fromkeys(
        ("DecodedImage", "DecodePath", "CPU_ROUTES", "FANCY_UPSAMPLING_OPTIONS", "import_nvimgcodec"), ".routes"
    ),
    "DecodeStats": ".stats",
}


def __getattr__(name: str) -> Any:
    """Load ``name``'s module on first use (PEP 562): importing the folder stays cheap."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
