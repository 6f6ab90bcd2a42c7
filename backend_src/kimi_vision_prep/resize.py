"""Pillow-exact resize (Pillow 13 ``Image.resize``), for numpy arrays (numba) and torch tensors.

``bicubic`` is Pillow's BICUBIC convolution resampling (``libImaging/Resample.c``): per axis, a
table of fixed-point coefficients (22 fractional bits) built with Pillow's float64 arithmetic and
two separable passes, each accumulating in int32 with a rounding bias and clipping to uint8. The
passes run horizontal first (over the source rows the vertical pass reads only), except that
Pillow 13 runs the vertical pass first when the height shrinks much more than the width (see
:func:`vertical_pass_first`). A pass whose dimension is unchanged is skipped, and an unchanged
size is returned as is. RGBA is resized premultiplied (RGBA -> RGBa -> resize -> RGBA) with
Pillow's integer conversions, as ``Image.resize`` does.

``nearest`` is Pillow's NEAREST resize (an affine scale, ``libImaging/Geometry.c``), which Pillow
uses for palette and 1-bit sources; RGBA is not premultiplied there.

Every integer operation is reproduced, so all paths are bit-exact to Pillow; the tests compare
against Pillow itself. The torch path additionally offers ``method="antialias"``
(``interpolate(mode="bicubic", antialias=True)``, rounded): not bit-exact.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numba import njit, prange
from PIL import Image

from .errors import UnsupportedImageError
from .numba_runtime import parallel_kernel

if TYPE_CHECKING:
    import torch

    from .decode import Resample

ResizeMethod = Literal["exact", "antialias"]
# One resampling pass of a backend: (image (H, W, C), bounds, coef) -> resampled image.
ResamplePass = Callable[[Any, np.ndarray, np.ndarray], Any]

PRECISION_BITS = 22  # fractional bits of Pillow's 8-bit fixed-point coefficients
_ROUNDING_BIAS = 1 << (PRECISION_BITS - 1)
_BICUBIC_A = -0.5
_BICUBIC_SUPPORT = 2.0
_INT_MAX = 2**31 - 1

# Horizontal-pass tile: 64 lanes (rows_per_tile * channels of them used), a constant trip count the
# compiler vectorises without a scalar tail; one uint8 tile row is one cache line.
_TILE_LANES = 64
# Vertical-pass chunk: 16 KiB of int32 accumulators stay in L1 while every tap row is added.
_ROW_CHUNK = 4096

_PIL_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}


# --------------------------------------------------------------------------- geometry


def _bicubic_filter(x: np.ndarray) -> np.ndarray:
    """Pillow's ``bicubic_filter`` (a = -0.5) on float64 ``x``, same operation order."""
    a = _BICUBIC_A
    x = np.abs(x)
    inner = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    outer = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


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


def _bicubic_two_pass(
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
        bounds_v.setflags(write=False)  # like the cached tables: one numba specialisation, not two
    if new_height != height:
        image = vertical(image, bounds_v, coef_v)
    return image


# --------------------------------------------------------------------------- numba kernels
# RGBA pixels are handled as one little-endian uint32 word where that helps (R in the low byte,
# A in the high byte).


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
            acc[:] = np.int32(_ROUNDING_BIAS)
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
            acc[:] = np.int32(_ROUNDING_BIAS)
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


# --------------------------------------------------------------------------- numpy path


def _check_image(pixels: Any, is_uint8: bool, new_width: int, new_height: int) -> None:
    if not is_uint8 or pixels.ndim != 3 or pixels.shape[2] not in (3, 4):
        raise ValueError(f"expected uint8 (H, W, 3|4), got {pixels.dtype} {tuple(pixels.shape)}")
    if new_width < 1 or new_height < 1:
        raise ValueError(f"target size must be positive, got {new_width}x{new_height}")


def premultiply_numpy(rgba: np.ndarray) -> np.ndarray:
    """uint8 ``(H, W, 4)`` straight alpha -> premultiplied (Pillow's RGBA -> RGBa), a new array."""
    out = np.empty(rgba.shape, dtype=np.uint8)
    with parallel_kernel(out.size):
        _premultiply(np.ascontiguousarray(rgba).view(np.uint32).reshape(-1), out.view(np.uint32).reshape(-1))
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
    out = np.empty((image.shape[0], bounds.shape[0], image.shape[2]), dtype=np.uint8)
    with parallel_kernel(out.size):
        _resample_horizontal(image, bounds, coef, out, premultiply)
    return out


def _vertical_pass_numpy(image: np.ndarray, bounds: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """uint8 C-contiguous ``(H, W, C)`` -> uint8 ``(len(bounds), W, C)``."""
    out = np.empty((bounds.shape[0], *image.shape[1:]), dtype=np.uint8)
    with parallel_kernel(out.size):
        _resample_vertical(image.reshape(image.shape[0], -1), bounds, coef, out.reshape(out.shape[0], -1))
    return out


def bicubic_numpy(pixels: np.ndarray, new_width: int, new_height: int, premultiply: bool = False) -> np.ndarray:
    """Pillow's BICUBIC on uint8 ``(H, W, C)`` -> uint8 ``(new_height, new_width, C)``.

    ``premultiply`` (RGBA): resample RGBa, the source premultiplied as Pillow does; the result
    stays premultiplied. When the horizontal pass reads the source, it premultiplies on the fly,
    sparing a full-size copy.
    """
    height, width = pixels.shape[:2]
    image = np.ascontiguousarray(pixels)
    fused = new_width != width and not vertical_pass_first(width, height, new_width, new_height)
    if premultiply and not fused:
        image = premultiply_numpy(image)
    horizontal = functools.partial(_horizontal_pass_numpy, premultiply=premultiply and fused)
    return _bicubic_two_pass(image, new_width, new_height, horizontal, _vertical_pass_numpy)


def resize_numpy(pixels: np.ndarray, new_width: int, new_height: int, resample: Resample) -> np.ndarray:
    """uint8 ``(H, W, C)`` -> uint8 ``(new_height, new_width, C)``, bit-exact to ``Image.resize``."""
    _check_image(pixels, pixels.dtype == np.uint8, new_width, new_height)
    height, width = pixels.shape[:2]
    if (width, height) == (new_width, new_height):
        return pixels
    if resample == "nearest":
        return pixels[nearest_indices(height, new_height)][:, nearest_indices(width, new_width)]
    if pixels.shape[2] == 4:
        return unpremultiply_numpy(bicubic_numpy(pixels, new_width, new_height, premultiply=True))
    return bicubic_numpy(pixels, new_width, new_height)


# --------------------------------------------------------------------------- torch path


def _resample_axis_torch(image: torch.Tensor, bounds: np.ndarray, coef: np.ndarray, axis: int) -> torch.Tensor:
    """One exact pass along ``axis`` (0: vertical, 1: horizontal) of int32 ``(H, W, C)``: the int32
    sum of gathered taps times fixed-point coefficients, plus the bias, shifted and clipped."""
    import torch

    device = image.device
    ksize = int(bounds[:, 1].max())
    # Taps past the count have weight 0; clamping their index keeps the gather in bounds.
    index = torch.tensor(np.minimum(bounds[:, :1] + np.arange(ksize), image.shape[axis] - 1), device=device)
    weights = torch.tensor(coef[:, :ksize], device=device)
    broadcast = (-1, 1, 1) if axis == 0 else (1, -1, 1)
    acc = torch.full((1, 1, 1), _ROUNDING_BIAS, dtype=torch.int32, device=device)
    for k in range(ksize):
        acc = acc + image.index_select(axis, index[:, k]) * weights[:, k].view(broadcast)
    return torch.clamp(acc >> PRECISION_BITS, 0, 255)


def bicubic_torch(image: torch.Tensor, new_width: int, new_height: int) -> torch.Tensor:
    """Pillow's BICUBIC with integer tensor ops on any device: int32 ``(H, W, C)`` with values in
    0..255 -> int32 ``(new_height, new_width, C)``, no alpha handling."""
    return _bicubic_two_pass(
        image,
        new_width,
        new_height,
        functools.partial(_resample_axis_torch, axis=1),
        functools.partial(_resample_axis_torch, axis=0),
    )


def bicubic_antialias_torch(image: torch.Tensor, new_width: int, new_height: int) -> torch.Tensor:
    """``interpolate(mode="bicubic", antialias=True)`` rounded and clipped: int32 ``(H, W, C)`` ->
    int32 ``(new_height, new_width, C)``. Close to Pillow (the tests measure it), not equal."""
    import torch

    planar = image.permute(2, 0, 1)[None].to(torch.float32)
    resized = torch.nn.functional.interpolate(
        planar, size=(new_height, new_width), mode="bicubic", align_corners=False, antialias=True
    )
    return torch.clamp(torch.round(resized[0]), 0, 255).permute(1, 2, 0).to(torch.int32)


def premultiply_torch(rgba: torch.Tensor) -> torch.Tensor:
    """Torch :func:`premultiply_numpy`: uint8 ``(H, W, 4)`` -> int32 ``(H, W, 4)`` premultiplied."""
    import torch

    values = rgba.to(torch.int32)
    tmp = values[..., :3] * values[..., 3:] + 128
    return torch.cat([((tmp >> 8) + tmp) >> 8, values[..., 3:]], dim=-1)


def unpremultiply_torch(rgba: torch.Tensor) -> torch.Tensor:
    """Torch :func:`unpremultiply_numpy`: int32 ``(H, W, 4)`` premultiplied -> int32 straight alpha."""
    import torch

    table = torch.tensor(unpremultiply_table(), dtype=torch.int32, device=rgba.device)
    alpha = rgba[..., 3:]
    return torch.cat([table[alpha.long(), rgba[..., :3].long()], alpha], dim=-1)


def resize_torch(
    pixels: torch.Tensor, new_width: int, new_height: int, resample: Resample, method: ResizeMethod = "exact"
) -> torch.Tensor:
    """uint8 ``(H, W, C)`` tensor on any device -> uint8 ``(new_height, new_width, C)`` on that device.

    ``method="exact"`` is bit-exact to ``Image.resize``; ``"antialias"`` uses torch's antialiased
    bicubic for BICUBIC (NEAREST is always exact).
    """
    import torch

    _check_image(pixels, pixels.dtype == torch.uint8, new_width, new_height)
    if method not in ("exact", "antialias"):
        raise ValueError(f"method must be 'exact' or 'antialias', got {method!r}")
    height, width = pixels.shape[:2]
    if (width, height) == (new_width, new_height):
        return pixels
    if resample == "nearest":
        rows = torch.tensor(nearest_indices(height, new_height), device=pixels.device)
        columns = torch.tensor(nearest_indices(width, new_width), device=pixels.device)
        return pixels.index_select(0, rows).index_select(1, columns)
    bicubic = bicubic_torch if method == "exact" else bicubic_antialias_torch
    if pixels.shape[2] == 4:
        resized = unpremultiply_torch(bicubic(premultiply_torch(pixels), new_width, new_height))
    else:
        resized = bicubic(pixels.to(torch.int32), new_width, new_height)
    return resized.to(torch.uint8)


# --------------------------------------------------------------------------- dispatch


def resize_pillow(pixels: np.ndarray, new_width: int, new_height: int, resample: Resample) -> np.ndarray:
    """uint8 ``(H, W, C)`` -> uint8 ``(new_height, new_width, C)`` through Pillow itself (the reference)."""
    mode = {3: "RGB", 4: "RGBA"}[pixels.shape[2]]
    image = Image.fromarray(np.ascontiguousarray(pixels), mode)
    return np.asarray(image.resize((new_width, new_height), _PIL_FILTERS[resample]))


def resize(pixels: Any, new_width: int, new_height: int, resample: Resample, method: ResizeMethod = "exact") -> Any:
    """Resize uint8 ``(H, W, C)``, C in {3, 4}, bit-exact to Pillow's ``Image.resize``: a numpy array
    through the numba kernels, a torch tensor with tensor ops on its device. Returns the same kind.
    ``method`` applies to tensors only (numpy is always exact)."""
    if isinstance(pixels, np.ndarray):
        if method != "exact":
            raise ValueError(f"method={method!r} is only available for torch tensors")
        return resize_numpy(pixels, new_width, new_height, resample)
    return resize_torch(pixels, new_width, new_height, resample, method)
