"""Pillow as the reference: source-mode pixels of an opened image.

:func:`pillow_pixels` returns the pixels of an opened image in the form the preset's resize step
takes, and :func:`as_rgb_array` (an op with a kernel per type) turns what the resize step returns
into the RGB/RGBA array the composite and patchify steps take. The header verdict and the typed
errors of a pixel-loading call are :mod:`kimi_vision_common.pillow_open`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_common.pillow_open import pillow_call
from kimi_vision_common.presets import Preset

from .kernels import NUMPY, PIL_IMAGE, TORCH, get_kernel, register_kernel
from .resample import Resample


def has_alpha(image: Image.Image) -> bool:
    """An alpha band or a transparency key (the K3 rule for "has transparency")."""
    return "A" in image.getbands() or "transparency" in image.info


def _converted(image: Image.Image, mode: str) -> np.ndarray:
    what = f"convert {image.mode} to {mode}"
    if image.mode == mode:
        # Pillow's convert to an image's own mode copies every pixel (40 MB at 10 MP, ~14 ms
        # here): the loaded image's pixels are read out once instead.
        pillow_call(what, image.load)
        return np.asarray(image)
    return np.asarray(pillow_call(what, image.convert, mode))


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
        return _converted(image, "RGB"), "bicubic"
    if mode in ("RGBA", "LA"):
        return _converted(image, "RGBA"), "bicubic"
    if mode in ("P", "1"):
        return _converted(image, "RGBA" if has_alpha(image) else "RGB"), "nearest"
    return pillow_call(f"decode a {mode} image", image.copy), "bicubic"


def as_rgb_array(pixels: Any) -> Any:
    """uint8 ``(H, W, 3)`` RGB or ``(H, W, 4)`` straight-alpha RGBA: arrays and tensors as they
    are, a Pillow image converted (RGBA when it has transparency, else RGB)."""
    return get_kernel("as_rgb_array", pixels)(pixels)


@register_kernel("as_rgb_array", NUMPY)
@register_kernel("as_rgb_array", TORCH)
def _rgb_array_as_is(pixels: Any) -> Any:
    return pixels


@register_kernel("as_rgb_array", PIL_IMAGE)
def _rgb_array_from_pil(image: Image.Image) -> np.ndarray:
    return _converted(image, "RGBA" if has_alpha(image) else "RGB")
