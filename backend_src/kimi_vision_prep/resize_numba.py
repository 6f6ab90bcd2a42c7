"""The numpy kernel of ``resize``: Pillow-exact BICUBIC and NEAREST in numba (parallel, no GIL).

RGBA is resized premultiplied (RGBA -> RGBa -> resize -> RGBA) with Pillow's integer conversions,
as ``Image.resize`` does; pixels are handled as one little-endian uint32 word where that helps (R
in the low byte, A in the high byte). Every integer operation of ``libImaging/Resample.c`` is
reproduced, so the result is bit-exact; the tests compare against Pillow itself.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from .buffers import scratch
from .kernels import NUMPY, register_kernel
from .numba_runtime import kernel_input, parallel_kernel
from .resample import (
    PRECISION_BITS,
    ROUNDING_BIAS,
    Resample,
    bicubic_two_pass,
    check_image,
    nearest_indices,
    unpremultiply_table,
    vertical_pass_first,
)

# Horizontal-pass tiles: a constant lane count the compiler vectorises without a scalar tail.
# RGB: 24 rows stored channel-major (lane c*24 + r), so that eight rows' bytes move as one uint64
# transposed in registers. RGBA: 16 rows of uint32 pixel words (lane 4*r + c).
_RGB_TILE_ROWS = 24
_RGB_TILE_LANES = 3 * _RGB_TILE_ROWS
_WORD_TILE_ROWS = 16
_WORD_TILE_LANES = 4 * _WORD_TILE_ROWS
# Vertical-pass chunk: 16 KiB of int32 accumulators stay in L1 while every tap row is added.
_ROW_CHUNK = 4096
# Masks of the three swap stages of an 8x8 byte transposition in eight uint64 words (byte r of a
# word is lane r of the tile viewed as uint64: little-endian hosts, as x86-64 and aarch64 are).
_MASK_32 = np.uint64(0x00000000FFFFFFFF)
_MASK_16 = np.uint64(0x0000FFFF0000FFFF)
_MASK_8 = np.uint64(0x00FF00FF00FF00FF)


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
def _swap_bytes(a: np.uint64, b: np.uint64, shift: np.uint64, mask: np.uint64) -> tuple[np.uint64, np.uint64]:
    """One stage of the 8x8 transposition: exchange ``a``'s high and ``b``'s low ``shift``-bit fields."""
    t = ((a >> shift) ^ b) & mask
    return a ^ (t << shift), b ^ t


@njit(cache=True, nogil=True, inline="always")
def _load_word(row: np.ndarray, i: int) -> np.uint64:
    """uint64 of bytes ``row[i : i + 8]``, little-endian (the compiler emits one unaligned load)."""
    word = np.uint64(0)
    for k in range(8):
        word |= np.uint64(row[i + k]) << np.uint64(8 * k)
    return word


@njit(cache=True, nogil=True, inline="always")
def _transpose_8x8(rows: np.ndarray, i: int, words: np.ndarray, group: int) -> None:
    """Bytes ``i .. i+7`` of the eight uint8 rows ``rows[r]`` (tile rows ``8*group + r``) into the
    channel-major tile viewed as uint64 ``words``: row byte ``p`` (pixel ``p // 3``, channel
    ``p % 3``) of all eight rows becomes one word, whose byte ``r`` is ``rows[r][p]``."""
    a0, a1, a2, a3 = _load_word(rows[0], i), _load_word(rows[1], i), _load_word(rows[2], i), _load_word(rows[3], i)
    a4, a5, a6, a7 = _load_word(rows[4], i), _load_word(rows[5], i), _load_word(rows[6], i), _load_word(rows[7], i)
    s32, s16, s8 = np.uint64(32), np.uint64(16), np.uint64(8)
    a0, a4 = _swap_bytes(a0, a4, s32, _MASK_32)
    a1, a5 = _swap_bytes(a1, a5, s32, _MASK_32)
    a2, a6 = _swap_bytes(a2, a6, s32, _MASK_32)
    a3, a7 = _swap_bytes(a3, a7, s32, _MASK_32)
    a0, a2 = _swap_bytes(a0, a2, s16, _MASK_16)
    a1, a3 = _swap_bytes(a1, a3, s16, _MASK_16)
    a4, a6 = _swap_bytes(a4, a6, s16, _MASK_16)
    a5, a7 = _swap_bytes(a5, a7, s16, _MASK_16)
    a0, a1 = _swap_bytes(a0, a1, s8, _MASK_8)
    a2, a3 = _swap_bytes(a2, a3, s8, _MASK_8)
    a4, a5 = _swap_bytes(a4, a5, s8, _MASK_8)
    a6, a7 = _swap_bytes(a6, a7, s8, _MASK_8)
    words_per_pixel = _RGB_TILE_LANES // 8
    words_per_channel = _RGB_TILE_ROWS // 8
    for k, word in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
        p = i + k
        words[(p // 3) * words_per_pixel + (p % 3) * words_per_channel + group] = word


@njit(cache=True, nogil=True, inline="always")
def _load_rgb_tile(src: np.ndarray, r0: int, n_rows: int, tile: np.ndarray) -> None:
    """``tile[x, c*24 + r] = src[r0 + r, x, c]`` for ``r < n_rows``: whole groups of eight rows by
    :func:`_transpose_8x8`, the rest byte by byte."""
    width = src.shape[1]
    n_bytes = 3 * width
    words = tile.reshape(-1).view(np.uint64)
    flat = src.reshape(src.shape[0], n_bytes)
    full_groups = n_rows // 8
    for g in range(full_groups):
        rows = flat[r0 + 8 * g : r0 + 8 * g + 8]
        i = 0
        while i + 8 <= n_bytes:
            _transpose_8x8(rows, i, words, g)
            i += 8
        for p in range(i, n_bytes):
            for r in range(8):
                tile[p // 3, (p % 3) * _RGB_TILE_ROWS + 8 * g + r] = rows[r, p]
    for r in range(8 * full_groups, n_rows):
        row = src[r0 + r]
        for x in range(width):
            for c in range(3):
                tile[x, c * _RGB_TILE_ROWS + r] = row[x, c]


@njit(cache=True, nogil=True, inline="always")
def _store_rgb_tile(tile: np.ndarray, r0: int, n_rows: int, out: np.ndarray) -> None:
    """Inverse of :func:`_load_rgb_tile` (bytewise: a transposed store measured no faster)."""
    for r in range(n_rows):
        row = out[r0 + r]
        for x in range(out.shape[1]):
            for c in range(3):
                row[x, c] = tile[x, c * _RGB_TILE_ROWS + r]


@njit(cache=True, nogil=True, inline="always")
def _load_word_tile(src: np.ndarray, r0: int, n_rows: int, tile: np.ndarray, premultiply: bool) -> None:
    """``tile[x, 4*r + c] = src[r0 + r, x, c]`` for ``r < n_rows``, moved as uint32 RGBA words and
    optionally premultiplied on the way."""
    tile_words = tile.view(np.uint32)
    for r in range(n_rows):
        row_words = src[r0 + r].view(np.uint32)
        for x in range(src.shape[1]):
            word = row_words[x, 0]
            tile_words[x, r] = _premultiply_word(word) if premultiply else word


@njit(cache=True, nogil=True, inline="always")
def _store_word_tile(tile: np.ndarray, r0: int, n_rows: int, out: np.ndarray) -> None:
    """Inverse of :func:`_load_word_tile` (without the premultiplication)."""
    tile_words = tile.view(np.uint32)
    for r in range(n_rows):
        row_words = out[r0 + r].view(np.uint32)
        for x in range(out.shape[1]):
            row_words[x, 0] = tile_words[x, r]


@njit(cache=True, nogil=True, inline="always")
def _resample_tile(tile: np.ndarray, bounds: np.ndarray, coef: np.ndarray, result: np.ndarray, lanes: int) -> None:
    """``result[xo, j] = clip((sum_k coef[xo, k] * tile[bounds[xo, 0] + k, j] + bias) >> 22)``:
    the taps of one output column accumulate for every lane (tile row and channel) in int32."""
    acc = np.empty(lanes, dtype=np.int32)
    for xo in range(result.shape[0]):
        acc[:] = np.int32(ROUNDING_BIAS)
        for k in range(bounds[xo, 1]):
            w = coef[xo, k]
            column = tile[bounds[xo, 0] + k]
            for j in range(lanes):
                acc[j] = acc[j] + np.int32(w * np.int32(column[j]))
        clipped = result[xo]
        for j in range(lanes):
            clipped[j] = np.uint8(min(max(acc[j] >> np.int32(PRECISION_BITS), np.int32(0)), np.int32(255)))


@njit(parallel=True, cache=True, nogil=True)
def _resample_horizontal_rgb(src: np.ndarray, bounds: np.ndarray, coef: np.ndarray, out: np.ndarray) -> None:
    """Horizontal pass: uint8 C-contiguous ``src (rows, W, 3)`` -> ``out (rows, W_out, 3)``, in
    tiles of 24 rows transposed to ``(W, 72)`` (see :func:`_resample_tile`) and back."""
    n_rows, width = src.shape[:2]
    for t in prange((n_rows + _RGB_TILE_ROWS - 1) // _RGB_TILE_ROWS):
        r0 = t * _RGB_TILE_ROWS
        nr = min(_RGB_TILE_ROWS, n_rows - r0)
        tile = np.empty((width, _RGB_TILE_LANES), dtype=np.uint8)  # lanes of missing rows are never stored
        _load_rgb_tile(src, r0, nr, tile)
        result = np.empty((out.shape[1], _RGB_TILE_LANES), dtype=np.uint8)
        _resample_tile(tile, bounds, coef, result, _RGB_TILE_LANES)
        _store_rgb_tile(result, r0, nr, out)


@njit(parallel=True, cache=True, nogil=True)
def _resample_horizontal_rgba(src: np.ndarray, bounds: np.ndarray, coef: np.ndarray, out: np.ndarray,
                              premultiply: bool) -> None:
    """Horizontal pass: uint8 C-contiguous ``src (rows, W, 4)`` -> ``out (rows, W_out, 4)``, in
    tiles of 16 rows of pixel words (``premultiply``: RGBA -> RGBa while loading)."""
    n_rows, width = src.shape[:2]
    for t in prange((n_rows + _WORD_TILE_ROWS - 1) // _WORD_TILE_ROWS):
        r0 = t * _WORD_TILE_ROWS
        nr = min(_WORD_TILE_ROWS, n_rows - r0)
        tile = np.empty((width, _WORD_TILE_LANES), dtype=np.uint8)
        _load_word_tile(src, r0, nr, tile, premultiply)
        result = np.empty((out.shape[1], _WORD_TILE_LANES), dtype=np.uint8)
        _resample_tile(tile, bounds, coef, result, _WORD_TILE_LANES)
        _store_word_tile(result, r0, nr, out)


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
        if image.shape[2] == 3:
            _resample_horizontal_rgb(kernel_input(image), kernel_input(bounds), coef, out)
        else:
            _resample_horizontal_rgba(kernel_input(image), kernel_input(bounds), coef, out, premultiply)
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
