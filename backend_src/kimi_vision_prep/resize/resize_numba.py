"""The numpy kernel of ``resize``: Pillow-exact BICUBIC and NEAREST in numba (parallel, no GIL).

RGBA is resized premultiplied (RGBA -> RGBa -> resize -> RGBA) with Pillow's integer conversions,
as ``Image.resize`` does; pixels are handled as one little-endian uint32 word where that helps (R
in the low byte, A in the high byte). Every integer operation of ``libImaging/Resample.c`` is
reproduced, so the result is bit-exact; the tests compare against Pillow itself.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..buffers import scratch
from ..kernels import NUMPY, register_kernel
from ..numba_runtime import kernel_input, load_word, parallel_kernel
from ..pixels import Resample
from .resample import (
    PRECISION_BITS,
    ROUNDING_BIAS,
    bicubic_two_pass,
    check_image,
    nearest_indices,
    unpremultiply_table,
    vertical_pass_first,
)

# Horizontal-pass tiles: a constant lane count the compiler vectorises without a scalar tail.
# RGB: 24 rows stored channel-major (lane c*24 + r), so that the bytes of eight rows at one
# position make one uint64 word, eight such words transposed by one vector shuffle. RGBA: 16 rows
# of uint32 pixel words (lane 4*r + c).
_RGB_TILE_ROWS = 24
_RGB_TILE_LANES = 3 * _RGB_TILE_ROWS
_WORD_TILE_ROWS = 16
_WORD_TILE_LANES = 4 * _WORD_TILE_ROWS
# Vertical-pass chunk: 16 KiB of int32 accumulators stay in L1 while every tap row is added.
_ROW_CHUNK = 4096
# Byte ``k`` of word ``r`` of an 8x8 byte transposition comes from byte ``r`` of word ``k``: in the
# 64 bytes of eight little-endian uint64 words (x86-64 and aarch64), output byte ``8r + k`` is
# input byte ``8k + r``.
_TRANSPOSE_8X8 = [8 * (j % 8) + j // 8 for j in range(64)]


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


@intrinsic
def _transpose_bytes(typingctx: Any, words: types.UniTuple) -> Any:
    """Eight uint64 words as an 8x8 byte matrix (row ``k``: word ``k``), transposed: one vector
    shuffle, which LLVM lowers to the host's byte permutes (one ``vpermi2b`` with AVX-512
    VBMI). Pure data movement: the same bytes on every target."""
    if not (isinstance(words, types.UniTuple) and words.count == 8 and words.dtype == types.uint64):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        (words_in,) = args
        word, index = ir.IntType(64), ir.IntType(32)
        vector = ir.Constant(ir.VectorType(word, 8), ir.Undefined)
        for k in range(8):
            vector = builder.insert_element(vector, builder.extract_value(words_in, k), ir.Constant(index, k))
        as_bytes = builder.bitcast(vector, ir.VectorType(ir.IntType(8), 64))
        mask = ir.Constant(ir.VectorType(index, 64), _TRANSPOSE_8X8)
        transposed = builder.bitcast(builder.shuffle_vector(as_bytes, as_bytes, mask), ir.VectorType(word, 8))
        result = ir.Constant(words_in.type, ir.Undefined)
        for k in range(8):
            result = builder.insert_value(result, builder.extract_element(transposed, ir.Constant(index, k)), k)
        return result

    return words(words), codegen


@intrinsic
def _store_word(typingctx: Any, row: types.Array, i: types.Integer, word: types.Integer) -> Any:
    """``row[i : i + 8] = word``'s little-endian bytes, one unaligned 8-byte store (LLVM does not
    merge eight byte stores into one here)."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8 and word == types.uint64):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        array, offset, value = args
        data = context.make_array(signature.args[0])(context, builder, array).data
        pointer = builder.bitcast(builder.gep(data, [offset]), ir.IntType(64).as_pointer())
        builder.store(value, pointer, align=1)
        return context.get_dummy_value()

    return types.void(row, i, word), codegen


@njit(cache=True, nogil=True, inline="always")
def _transpose_8x8(rows: np.ndarray, i: int, words: np.ndarray, group: int) -> None:
    """Bytes ``i .. i+7`` of the eight uint8 rows ``rows[r]`` (tile rows ``8*group + r``) into the
    channel-major tile viewed as uint64 ``words``: row byte ``p`` (pixel ``p // 3``, channel
    ``p % 3``) of all eight rows becomes word ``3p + group``, whose byte ``r`` is ``rows[r][p]``."""
    a = _transpose_bytes(
        (
            load_word(rows[0], i),
            load_word(rows[1], i),
            load_word(rows[2], i),
            load_word(rows[3], i),
            load_word(rows[4], i),
            load_word(rows[5], i),
            load_word(rows[6], i),
            load_word(rows[7], i),
        )
    )
    base = 3 * i + group
    words[base], words[base + 3], words[base + 6], words[base + 9] = a[0], a[1], a[2], a[3]
    words[base + 12], words[base + 15], words[base + 18], words[base + 21] = a[4], a[5], a[6], a[7]


@njit(cache=True, nogil=True, inline="always")
def _transpose_back_8x8(words: np.ndarray, group: int, i: int, rows: np.ndarray) -> None:
    """Inverse of :func:`_transpose_8x8`: words ``3p + group`` for ``p`` in ``i .. i+7`` into bytes
    ``i .. i+7`` of the eight rows ``rows[r]``."""
    base = 3 * i + group
    a = _transpose_bytes(
        (
            words[base],
            words[base + 3],
            words[base + 6],
            words[base + 9],
            words[base + 12],
            words[base + 15],
            words[base + 18],
            words[base + 21],
        )
    )
    _store_word(rows[0], i, a[0])
    _store_word(rows[1], i, a[1])
    _store_word(rows[2], i, a[2])
    _store_word(rows[3], i, a[3])
    _store_word(rows[4], i, a[4])
    _store_word(rows[5], i, a[5])
    _store_word(rows[6], i, a[6])
    _store_word(rows[7], i, a[7])


@njit(cache=True, nogil=True, inline="always")
def _move_rgb_tile(image: np.ndarray, r0: int, n_rows: int, tile: np.ndarray, into_tile: bool) -> None:
    """Between rows ``r0 .. r0 + n_rows - 1`` of uint8 ``image (H, W, 3)`` and the channel-major
    tile ``(W, 72)``, ``tile[x, c*24 + r]`` being ``image[r0 + r, x, c]``: into the tile (the
    source rows) or out of it (the result rows). Whole groups of eight rows move by
    :func:`_transpose_8x8` and :func:`_transpose_back_8x8`, the rest byte by byte."""
    width = image.shape[1]
    n_bytes = 3 * width
    words = tile.reshape(-1).view(np.uint64)
    flat = image.reshape(image.shape[0], n_bytes)
    full_groups = n_rows // 8
    for g in range(full_groups):
        rows = flat[r0 + 8 * g : r0 + 8 * g + 8]
        i = 0
        while i + 8 <= n_bytes:
            if into_tile:
                _transpose_8x8(rows, i, words, g)
            else:
                _transpose_back_8x8(words, g, i, rows)
            i += 8
        for p in range(i, n_bytes):
            for r in range(8):
                lane = (p % 3) * _RGB_TILE_ROWS + 8 * g + r
                if into_tile:
                    tile[p // 3, lane] = rows[r, p]
                else:
                    rows[r, p] = tile[p // 3, lane]
    for r in range(8 * full_groups, n_rows):
        row = image[r0 + r]
        for x in range(width):
            for c in range(3):
                if into_tile:
                    tile[x, c * _RGB_TILE_ROWS + r] = row[x, c]
                else:
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
        _move_rgb_tile(src, r0, nr, tile, True)
        result = np.empty((out.shape[1], _RGB_TILE_LANES), dtype=np.uint8)
        _resample_tile(tile, bounds, coef, result, _RGB_TILE_LANES)
        _move_rgb_tile(out, r0, nr, result, False)


@njit(parallel=True, cache=True, nogil=True)
def _resample_horizontal_rgba(
    src: np.ndarray, bounds: np.ndarray, coef: np.ndarray, out: np.ndarray, premultiply: bool
) -> None:
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
