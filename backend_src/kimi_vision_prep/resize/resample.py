"""Pillow 13's resampling geometry, shared by every resize kernel (``libImaging/Resample.c``).

BICUBIC: per axis, a table of fixed-point coefficients (22 fractional bits) built with Pillow's
float64 arithmetic; two separable passes, each accumulating in int32 with a rounding bias and
clipping to uint8, horizontal first (over the source rows the vertical pass reads only) except
where :func:`vertical_pass_first`; a pass whose dimension is unchanged is skipped. NEAREST is
Pillow's affine scale (``libImaging/Geometry.c``). The backends (numba in ``resize_numba``,
torch in ``resize``) differ only in how a pass is computed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kimi_vision_common.errors import UnsupportedImageError

# One resampling pass of a backend: (image (H, W, C), bounds, coef) -> resampled image.
ResamplePass = Callable[[Any, np.ndarray, np.ndarray], Any]

PRECISION_BITS = 22  # fractional bits of Pillow's 8-bit fixed-point coefficients
ROUNDING_BIAS = 1 << (PRECISION_BITS - 1)
_BICUBIC_A = -0.5
_BICUBIC_SUPPORT = 2.0
_INT_MAX = 2**31 - 1


def _bicubic_filter(x: np.ndarray) -> np.ndarray:
    """Pillow's ``bicubic_filter`` (a = -0.5) on float64 ``x``, same operation order."""
    a = _BICUBIC_A
    x = np.abs(x)
    inner = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    outer = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


def check_image(pixels: Any, is_uint8: bool, new_width: int, new_height: int) -> None:
    """Raise ValueError unless ``pixels`` is uint8 ``(H, W, 3|4)`` and the target size positive."""
    if not is_uint8 or pixels.ndim != 3 or pixels.shape[2] not in (3, 4):
        raise ValueError(f"expected uint8 (H, W, 3|4), got {pixels.dtype} {tuple(pixels.shape)}")
    if new_width < 1 or new_height < 1:
        raise ValueError(f"target size must be positive, got {new_width}x{new_height}")


# Per axis and size pair; a table is out_size * ksize * 4 bytes (about 75 KiB for 4000 -> 2073),
# so 64 entries stay a few MiB for ordinary photos.
@functools.lru_cache(maxsize=64)
def bicubic_coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` for one axis.

    Returns read-only ``(bounds, coef)``: int32 ``(out_size, 2)`` first source index and number of
    taps of each output pixel, and int32 ``(out_size, ksize)`` fixed-point weights (zero past the
    taps). Raises :class:`UnsupportedImageError` where Pillow's own table would overflow (Pillow
    raises ``MemoryError`` there).
    """
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _BICUBIC_SUPPORT * filterscale
    ksize = math.ceil(support) * 2 + 1
    if out_size > _INT_MAX // (ksize * 8):
        raise UnsupportedImageError(f"Pillow cannot resample {in_size} -> {out_size} pixels (coefficient overflow)")
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    ss = 1.0 / filterscale
    # C casts truncate toward zero; both bounds are clamped to the image afterwards.
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first
    taps = np.arange(ksize)
    weights = _bicubic_filter(((first[:, None] + taps) - center[:, None] + 0.5) * ss)
    weights = np.where(taps < count[:, None], weights, 0.0)
    total = np.zeros(out_size, dtype=np.float64)
    for k in range(ksize):  # Pillow sums left to right (np.sum would sum pairwise)
        total += weights[:, k]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None], weights)
    scaled = weights * (1 << PRECISION_BITS)
    coef = np.where(weights < 0, -0.5 + scaled, 0.5 + scaled).astype(np.int32)  # astype truncates like C
    bounds = np.stack([first, count], axis=1).astype(np.int32)
    bounds.setflags(write=False)
    coef.setflags(write=False)
    return bounds, coef


@functools.lru_cache(maxsize=64)
def nearest_indices(in_size: int, out_size: int) -> np.ndarray:
    """Source index of each output pixel of Pillow's NEAREST resize, int64 ``(out_size,)``.

    ``ImagingScaleAffine``: the position starts at ``scale * 0.5`` and is advanced by adding
    ``scale`` (float64, accumulated; ``cumsum`` adds sequentially), then truncated.
    """
    scale = in_size / out_size
    steps = np.full(out_size, scale, dtype=np.float64)
    steps[0] = scale * 0.5
    indices = np.cumsum(steps).astype(np.int64)
    indices.setflags(write=False)
    return indices


def vertical_pass_first(width: int, height: int, new_width: int, new_height: int) -> bool:
    """Whether Pillow 13 resamples vertically first: when the height loses more than twice as many
    pixels as the width (Pillow PR #9549; the rule was located against Pillow and the tests check
    both sides of it). The order matters because each pass rounds to uint8."""
    return new_height < height and height - new_height > 2 * (width - new_width)


def bicubic_two_pass(
    image: Any, new_width: int, new_height: int, horizontal: ResamplePass, vertical: ResamplePass
) -> Any:
    """``ImagingResampleInner``: one backend's two passes over ``(H, W, C)`` in Pillow's order,
    skipping a pass whose dimension is unchanged."""
    height, width = image.shape[0], image.shape[1]
    bounds_v, coef_v = bicubic_coefficients(height, new_height)
    if vertical_pass_first(width, height, new_width, new_height):
        image = vertical(image, bounds_v, coef_v)
        return horizontal(image, *bicubic_coefficients(width, new_width)) if new_width != width else image
    if new_width != width:
        # Only the source rows the vertical pass reads are resampled horizontally.
        row_first, row_last = int(bounds_v[0, 0]), int(bounds_v[-1, 0] + bounds_v[-1, 1])
        image = horizontal(image[row_first:row_last], *bicubic_coefficients(width, new_width))
        bounds_v = bounds_v - np.array([row_first, 0], dtype=np.int32)
    if new_height != height:
        image = vertical(image, bounds_v, coef_v)
    return image


@functools.cache
def unpremultiply_table() -> np.ndarray:
    """uint8 ``(256, 256)``: ``table[a, v]`` is Pillow's RGBa -> RGBA colour value (``rgba2rgbA``):
    ``min(255 * v // a, 255)`` for ``0 < a < 255``, else ``v``. A lookup is faster than dividing."""
    v = np.arange(256)[None, :]
    alpha = np.arange(256)[:, None]
    divided = np.minimum(255 * v // np.maximum(alpha, 1), 255)
    table = np.where((alpha == 0) | (alpha == 255), v, divided).astype(np.uint8)
    table.setflags(write=False)
    return table
