"""The numpy kernel of ``resize``: Pillow-exact BICUBIC and NEAREST in numba (parallel, no GIL).

RGBA is resized premultiplied (RGBA -> RGBa -> resize -> RGBA) with Pillow's integer conversions,
as ``Image.resize`` does; pixels are handled as one little-endian uint32 word where that helps (R
in the low byte, A in the high byte). Every integer operation of ``libImaging/Resample.c`` is
reproduced, so the result is bit-exact; the tests compare against Pillow itself.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
from numba import njit, prange

from .buffers import scratch
from .kernels import NUMPY, register_kernel
from .numba_runtime import kernel_input, parallel_kernel
from .resample import (
    PRECISION_BITS,
    ROUNDING_BIAS,
    bicubic_two_pass,
    check_image,
    nearest_indices,
    unpremultiply_table,
    vertical_pass_first,
)

if TYPE_CHECKING:
    from .decode import Resample

# Horizontal-pass tile: 64 lanes (rows_per_tile * channels of them used), a constant trip count the
# compiler vectorises without a scalar tail; one uint8 tile row is one cache line.
_TILE_LANES = 64
# Vertical-pass chunk: 16 KiB of int32 accumulators stay in L1 while every tap row is added.
_ROW_CHUNK = 4096


@njit(cache=True, nogil=True, inline="always")
def _premultiply_word(pixel: np.uint32) -> np.uint32:
    """Pillow's ``rgbA2rgba`` on one RGBA word: ``MULDIV255(v, a)`` per colour channel,
    ``tmp = v * a + 128; ((tmp >> 8) + tmp) >> 8``."""
    alpha = pixel >> np.uint32(24)
    result = pixel & np.uint32(0xFF000000)
    for shift in (0, 8, 16):
        tmp = ((pixel >> np.uint32(shift)) & np.uint32(255)) * alpha + np.uint32(128)
        result |= (((tmp >> np.uint32(8)) + tmp) >> np.uint32(8)) << np.uint32(shift)
    return result


@njit(cache=True, nogil=True, inline="always")
def _load_tile(src: np.ndarray, r0: int, n_rows: int, tile: np.ndarray, premultiply: bool) -> None:
    """``tile[x, r*C + c] = src[r0 + r, x, c]`` for ``r < n_rows`` (C = 3, or 4 moved as words and
    optionally premultiplied on the way)."""
    if src.shape[2] == 4:
        tile_words = tile.view(np.uint32)
        for r in range(n_rows):
            row_words = src[r0 + r].view(np.uint32)
            for x in range(src.shape[1]):
                word = row_words[x, 0]
                tile_words[x, r] = _premultiply_word(word) if premultiply else word
    else:
        for r in range(n_rows):
            row = src[r0 + r]
            lane = r * 3
            for x in range(src.shape[1]):
                tile[x, lane] = row[x, 0]
                tile[x, lane + 1] = row[x, 1]
                tile[x, lane + 2] = row[x, 2]


@njit(cache=True, nogil=True, inline="always")
def _store_tile(tile: np.ndarray, r0: int, n_rows: int, out: np.ndarray) -> None:
    """Inverse of :func:`_load_tile`: ``out[r0 + r, x, c] = tile[x, r*C + c]``."""
    if out.shape[2] == 4:
        tile_words = tile.view(np.uint32)
        for r in range(n_rows):
            row_words = out[r0 + r].view(np.uint32)
            for x in range(out.shape[1]):
                row_words[x, 0] = tile_words[x, r]
    else:
        for r in range(n_rows):
            row = out[r0 + r]
            lane = r * 3
            for x in range(out.shape[1]):
                row[x, 0] = tile[x, lane]
                row[x, 1] = tile[x, lane + 1]
                row[x, 2] = tile[x, lane + 2]


@njit(parallel=True, cache=True, nogil=True)
def _resample_horizontal(src: np.ndarray, bounds: np.ndarray, coef: np.ndarray, out: np.ndarray,
                         premultiply: bool) -> None:
    """Horizontal pass: uint8 C-contiguous ``src (rows, W, C)`` -> ``out (rows, W_out, C)``.

    Rows go in tiles of ``64 // C``, transposed to ``(W, 64)`` so that the taps of one output
    column accumulate for all the tile's rows and channels in contiguous int32 lanes; the clipped
    results are staged as ``(W_out, 64)`` and transposed back.
    """
    n_rows, width, channels = src.shape
    out_width = out.shape[1]
    tile_rows = _TILE_LANES // channels
    for t in prange((n_rows + tile_rows - 1) // tile_rows):
        r0 = t * tile_rows
        nr = min(tile_rows, n_rows - r0)
        tile = np.empty((width, _TILE_LANES), dtype=np.uint8)  # unused lanes are never stored
        _load_tile(src, r0, nr, tile, premultiply)
        result = np.empty((out_width, _TILE_LANES), dtype=np.uint8)
        acc = np.empty(_TILE_LANES, dtype=np.int32)
        for xo in range(out_width):
            acc[:] = np.int32(ROUNDING_BIAS)
            for k in range(bounds[xo, 1]):
                w = coef[xo, k]
                column = tile[bounds[xo, 0] + k]
                for j in range(_TILE_LANES):
                    acc[j] = acc[j] + np.int32(w * np.int32(column[j]))
            clipped = result[xo]
            for j in range(_TILE_LANES):
                clipped[j] = np.uint8(min(max(acc[j] >> np.int32(PRECISION_BITS), np.int32(0)), np.int32(255)))
        _store_tile(result, r0, nr, out)


@njit(parallel=True, cache=True, nogil=True)
def _resample_vertical(src: np.ndarray, bounds: np.ndarray, coef: np.ndarray, out: np.ndarray) -> None:
    """Vertical pass: uint8 ``src (H, L)`` -> ``out (H_out, L)``, a weighted sum of whole rows.

    Explicit int32 operations on 1-D chunk views keep every loop in 32-bit vector lanes (numba's
    default int64 promotion measured 2.6x slower here)."""
    length = src.shape[1]
    for y in prange(out.shape[0]):
        acc_buffer = np.empty(_ROW_CHUNK, dtype=np.int32)
        for c0 in range(0, length, _ROW_CHUNK):
            n = min(_ROW_CHUNK, length - c0)
            acc = acc_buffer[:n]
            acc[:] = np.int32(ROUNDING_BIAS)
            for k in range(bounds[y, 1]):
                w = coef[y, k]
                row = src[bounds[y, 0] + k, c0 : c0 + n]
                for i in range(n):
                    acc[i] = acc[i] + np.int32(w * np.int32(row[i]))
            out_chunk = out[y, c0 : c0 + n]
            for i in range(n):
                out_chunk[i] = np.uint8(min(max(acc[i] >> np.int32(PRECISION_BITS), np.int32(0)), np.int32(255)))


@njit(parallel=True, cache=True, nogil=True)
def _premultiply(pixels: np.ndarray, out: np.ndarray) -> None:
    """RGBA -> RGBa on uint32 ``(N,)`` words into ``out``."""
    for i in prange(pixels.shape[0]):
        out[i] = _premultiply_word(pixels[i])


@njit(parallel=True, cache=True, nogil=True)
def _unpremultiply(pixels: np.ndarray, table: np.ndarray) -> None:
    """RGBa -> RGBA in place on uint32 ``(N,)`` words through :func:`unpremultiply_table`."""
    for i in prange(pixels.shape[0]):
        pixel = pixels[i]
        row = table[pixel >> np.uint32(24)]
        result = pixel & np.uint32(0xFF000000)
        for shift in (0, 8, 16):
            result |= np.uint32(row[(pixel >> np.uint32(shift)) & np.uint32(255)]) << np.uint32(shift)
        pixels[i] = result


def premultiply_numpy(rgba: np.ndarray) -> np.ndarray:
    """uint8 ``(H, W, 4)`` straight alpha -> premultiplied (Pillow's RGBA -> RGBa), a new array."""
    out = scratch(rgba.shape)
    with parallel_kernel(out.size):
        _premultiply(kernel_input(rgba).view(np.uint32).reshape(-1), out.view(np.uint32).reshape(-1))
    return out


def unpremultiply_numpy(rgba: np.ndarray) -> np.ndarray:
    """uint8 C-contiguous ``(H, W, 4)`` premultiplied -> straight alpha (Pillow's RGBa -> RGBA), in place."""
    with parallel_kernel(rgba.size):
        _unpremultiply(rgba.view(np.uint32).reshape(-1), unpremultiply_table())
    return rgba


def _horizontal_pass_numpy(
    image: np.ndarray, bounds: np.ndarray, coef: np.ndarray, premultiply: bool = False
) -> np.ndarray:
    """uint8 C-contiguous ``(H, W, C)`` -> uint8 ``(H, len(bounds), C)``; ``premultiply`` (C = 4)
    converts RGBA -> RGBa while loading the source."""
    out = scratch((image.shape[0], bounds.shape[0], image.shape[2]))
    with parallel_kernel(out.size):
        _resample_horizontal(kernel_input(image), kernel_input(bounds), coef, out, premultiply)
    return out


def _vertical_pass_numpy(image: np.ndarray, bounds: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """uint8 C-contiguous ``(H, W, C)`` -> uint8 ``(len(bounds), W, C)``."""
    out = scratch((bounds.shape[0], *image.shape[1:]))
    with parallel_kernel(out.size):
        rows = kernel_input(image).reshape(image.shape[0], -1)
        _resample_vertical(rows, kernel_input(bounds), coef, out.reshape(out.shape[0], -1))
    return out


def bicubic_numpy(pixels: np.ndarray, new_width: int, new_height: int, premultiply: bool = False) -> np.ndarray:
    """Pillow's BICUBIC on uint8 ``(H, W, C)`` -> uint8 ``(new_height, new_width, C)``.

    ``premultiply`` (RGBA): resample RGBa, the source premultiplied as Pillow does; the result
    stays premultiplied. When the horizontal pass reads the source, it premultiplies on the fly,
    sparing a full-size copy.
    """
    height, width = pixels.shape[:2]
    image = kernel_input(pixels)
    fused = new_width != width and not vertical_pass_first(width, height, new_width, new_height)
    if premultiply and not fused:
        image = premultiply_numpy(image)
    horizontal = functools.partial(_horizontal_pass_numpy, premultiply=premultiply and fused)
    return bicubic_two_pass(image, new_width, new_height, horizontal, _vertical_pass_numpy)


@register_kernel("resize", NUMPY)
def resize_numpy(pixels: np.ndarray, new_width: int, new_height: int, resample: Resample) -> np.ndarray:
    """uint8 ``(H, W, C)``, C in {3, 4} -> uint8 ``(new_height, new_width, C)``, bit-exact to
    ``Image.resize`` (C = 4: RGBA, straight alpha, resized premultiplied)."""
    check_image(pixels, pixels.dtype == np.uint8, new_width, new_height)
    height, width = pixels.shape[:2]
    if (width, height) == (new_width, new_height):
        return pixels
    if resample == "nearest":
        return pixels[nearest_indices(height, new_height)][:, nearest_indices(width, new_width)]
    if pixels.shape[2] == 4:
        return unpremultiply_numpy(bicubic_numpy(pixels, new_width, new_height, premultiply=True))
    return bicubic_numpy(pixels, new_width, new_height)
