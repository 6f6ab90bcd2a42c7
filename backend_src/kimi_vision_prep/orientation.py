"""EXIF orientation as engines apply it when they load a photo (Pillow's ``ImageOps.exif_transpose``).

The checkpoint's processor takes pixels in stored order; an engine that turns a photo first (vLLM's
loader does) hands it the turned pixels. :func:`turned` is that turn of decoded pixels (one op, a
kernel per array type: a permutation, exact by construction), and :class:`TurnedJpeg` an opened
JPEG that stands for the turned image without decoding it, so that the library's decoders still
take its bytes (:func:`~.pipeline.preprocess_turned`).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import ExifTags, Image, ImageOps

from .kernels import NUMPY, PIL_IMAGE, TORCH, get_kernel, register_kernel

# EXIF orientation -> the Pillow transposition exif_transpose applies.
TRANSPOSITIONS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
SWAPS_SIDES = frozenset({5, 6, 7, 8})


def turned_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    """``(width, height)`` of a ``width x height`` image turned as EXIF ``orientation`` says."""
    return (height, width) if orientation in SWAPS_SIDES else (width, height)


def exif_orientation(image: Image.Image) -> int:
    """The orientation ``exif_transpose`` reads (EXIF, or XMP where EXIF has none); 1 where there is
    none or it cannot be read (a damaged EXIF block: engines keep the image as stored then)."""
    try:
        orientation = int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # Pillow raises what its EXIF parser meets
        return 1
    return orientation if orientation in TRANSPOSITIONS else 1


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


class TurnedJpeg(Image.Image):
    """A JPEG opened from ``data`` standing for the image ``exif_transpose`` makes of it: its mode,
    its turned size and the opened file's ``info``, pixels decoded only when read (then Pillow's,
    turned, as the engine's own loading gives). :class:`~.processor.KimiVisionProcessor` decodes
    its ``data`` with the library's decoders and turns the pixels instead."""

    def __init__(self, data: bytes, opened: Image.Image, orientation: int) -> None:
        super().__init__()
        self.data, self.orientation = data, orientation
        self._mode = opened.mode
        self._size = turned_size(*opened.size, orientation)
        self.info = dict(opened.info)

    @property
    def loaded(self) -> bool:
        """Whether something read its pixels (Pillow's, turned); else only its file was read."""
        return self._im is not None

    def load(self) -> Any:
        if self._im is None:
            self.im = ImageOps.exif_transpose(Image.open(io.BytesIO(self.data))).im
        return super().load()
