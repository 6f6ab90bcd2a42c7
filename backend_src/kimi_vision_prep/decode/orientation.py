"""The turn of decoded pixels to their EXIF orientation, as Pillow's ``ImageOps.exif_transpose`` does it.

:func:`turned` is one op with a kernel per array type (a permutation, exact by construction); it
turns the pixels of a :class:`~kimi_vision_common.orientation.TurnedJpeg` decoded by the library's
decoders (:func:`~kimi_vision_prep.pipeline.preprocess_turned`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_common.orientation import TRANSPOSITIONS

from ..kernels import NUMPY, PIL_IMAGE, TORCH, get_kernel, register_kernel

# EXIF orientation -> exif_transpose's transposition as steps on (H, W, C) pixels, in order.
STEPS: dict[int, tuple[str, ...]] = {
    1: (),
    2: ("flip_x",),
    3: ("flip_y", "flip_x"),
    4: ("flip_y",),
    5: ("swap",),
    6: ("swap", "flip_x"),
    7: ("flip_y", "flip_x", "swap"),
    8: ("swap", "flip_y"),
}


def turned(pixels: Any, orientation: int) -> Any:
    """``pixels`` (uint8 ``(H, W, C)``: numpy, torch, or a PIL image) turned as EXIF ``orientation``
    says, as a new contiguous array (the same one where there is nothing to turn)."""
    return get_kernel("turned", pixels)(pixels, orientation)


@register_kernel("turned", NUMPY)
def _turned_numpy(pixels: np.ndarray, orientation: int) -> np.ndarray:
    steps = {"flip_x": lambda a: a[:, ::-1], "flip_y": lambda a: a[::-1], "swap": lambda a: a.swapaxes(0, 1)}
    for step in STEPS[orientation]:
        pixels = steps[step](pixels)
    return np.ascontiguousarray(pixels)


@register_kernel("turned", TORCH)
def _turned_torch(pixels: Any, orientation: int) -> Any:
    steps = {"flip_x": lambda a: a.flip(1), "flip_y": lambda a: a.flip(0), "swap": lambda a: a.transpose(0, 1)}
    for step in STEPS[orientation]:
        pixels = steps[step](pixels)
    return pixels.contiguous()


@register_kernel("turned", PIL_IMAGE)
def _turned_pil(image: Image.Image, orientation: int) -> Image.Image:
    return image if orientation == 1 else image.transpose(TRANSPOSITIONS[orientation])
