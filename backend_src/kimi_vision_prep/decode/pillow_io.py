"""Pillow as the reference: source-mode pixels of an opened image.

:func:`pillow_pixels` returns the pixels of an opened image in the form the preset's resize step
takes (:func:`~kimi_vision_prep.pixels.as_rgb_array` turns what the resize step returns into the
RGB/RGBA array the composite and patchify steps take). The header verdict and the typed errors of
a pixel-loading call are :mod:`kimi_vision_common.pillow_open`'s.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from kimi_vision_common.pillow_open import pillow_call
from kimi_vision_common.presets import Preset

from ..pixels import Resample, converted, has_alpha


def pillow_pixels(image: Image.Image, preset: Preset) -> tuple[np.ndarray | Image.Image, Resample]:
    """The pixels of an opened image as the preset's resize step takes them, and its filter.

    ``convert_rgb`` (K2.5): ``convert("RGB")``, uint8 ``(H, W, 3)``. ``chessboard`` (K3), resizing
    in the source mode: where that commutes with a per-pixel conversion, the converted array (RGB
    and L -> RGB, RGBA and LA -> RGBA, bicubic; P and 1 -> RGB or RGBA, nearest); any other mode
    (CMYK, I;16, L with a transparency key, ...) stays a Pillow image in that mode, loaded, for
    resize's PIL kernel. Always the stored size.
    """
    mode = image.mode
    if preset.transparency == "convert_rgb" or mode == "RGB" or (mode == "L" and "transparency" not in image.info):
        return converted(image, "RGB"), "bicubic"
    if mode in ("RGBA", "LA"):
        return converted(image, "RGBA"), "bicubic"
    if mode in ("P", "1"):
        return converted(image, "RGBA" if has_alpha(image) else "RGB"), "nearest"
    return pillow_call(f"decode a {mode} image", image.copy), "bicubic"
