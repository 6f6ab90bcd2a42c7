"""Pillow-exact resize (Pillow 13 ``Image.resize``), for numpy arrays (numba) and torch tensors.

``bicubic`` is Pillow's BICUBIC convolution resampling (``libImaging/Resample.c``): per axis, a
table of fixed-point coefficients (22 fractional bits) built with Pillow's float64 arithmetic, a
horizontal pass over the source rows the vertical pass reads, then a vertical pass; each pass
accumulates in int32 with a rounding bias and clips to uint8. A pass whose dimension is unchanged
is skipped, and an unchanged size is returned as is. RGBA is resized premultiplied (RGBA -> RGBa ->
resize -> RGBA) with Pillow's integer conversions, as ``Image.resize`` does.

``nearest`` is Pillow's NEAREST resize (an affine scale, ``libImaging/Geometry.c``), which Pillow
uses for palette and 1-bit sources; RGBA is not premultiplied there.

Every integer operation is reproduced, so all paths are bit-exact to Pillow; the tests compare
against Pillow itself. The torch path additionally offers ``method="antialias"``
(``interpolate(mode="bicubic", antialias=True)``, rounded): faster on GPUs, not bit-exact.
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
# One resampling pass of a backend: (image, first, count, coef) -> image.
ResamplePass = Callable[[Any, np.ndarray, np.ndarray, np.ndarray], Any]

PRECISION_BITS = 22  # fractional bits of Pillow's 8-bit fixed-point coefficients
_ROUNDING_BIAS = 1 << (PRECISION_BITS - 1)
_BICUBIC_A = -0.5
_BICUBIC_SUPPORT = 2.0
_INT_MAX = 2**31 - 1

# Horizontal-pass tile: 64 int32 lanes (rows_per_tile * channels of them are used), a constant trip
# count the compiler vectorises without a scalar tail; one tile row of uint8 is one cache line.
_TILE_LANES = 64
# Vertical-pass chunk: 16 KiB of int32 accumulators stay in L1 while every tap row is added.
_ROW_CHUNK = 4096

_PIL_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}


# --------------------------------------------------------------------------- coefficients


def _bicubic_filter(x: np.ndarray) -> np.ndarray:
    """Pillow's ``bicubic_filter`` (a = -0.5) on float64 ``x``, same operation order."""
    a = _BICUBIC_A
    x = np.abs(x)
    inner = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    outer = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


@functools.lru_cache(maxsize=64)  # two entries per (source, target) size pair; each <= out*ksize*4 bytes
def bicubic_coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` for one axis.

    Returns read-only ``(first, count, coef)``: int32 ``(out_size,)`` first source index and
    number of taps of each output pixel, and int32 ``(out_size, ksize)`` fixed-point weights
    (zero past ``count``). Raises :class:`UnsupportedImageError` where Pillow's own table would
    overflow (it raises ``MemoryError`` there).
    """
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _BICUBIC_SUPPORT * filterscale
    ksize = math.ceil(support) * 2 + 1
    if out_size > _INT_MAX // (ksize * 8):
        raise UnsupportedImageError(f"Pillow cannot resample {in_size} -> {out_size} pixels (coefficient overflow)")
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    ss = 1.0 / filterscale
    # C casts truncate toward zero; both values are clamped at 0 afterwards anyway.
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
    tables = (first.astype(np.int32), count.astype(np.int32), coef)
    for table in tables:
        table.setflags(write=False)
    return tables


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
    pixels as the width (Pillow PR #9549, found and checked against Pillow by the tests). The order
    matters because each pass rounds to uint8."""
    return new_height < height and height - new_height > 2 * (width - new_width)


def _bicubic_two_pass(
    image: Any, new_width: int, new_height: int, horizontal: ResamplePass, vertical: ResamplePass
) -> Any:
    """``ImagingResampleInner``: the two passes of one backend in Pillow's order, skipping a pass
    whose dimension is unchanged. ``image`` is ``(H, W, C)``; a pass maps an image and one axis's
    :func:`bicubic_coefficients` to the resampled image."""
    height, width = image.shape[0], image.shape[1]
    first_v, count_v, coef_v = bicubic_coefficients(height, new_height)
    if vertical_pass_first(width, height, new_width, new_height):
        image = vertical(image, first_v, count_v, coef_v)
        return horizontal(image, *bicubic_coefficients(width, new_width)) if new_width != width else image
    if new_width != width:
        # Only the source rows the vertical pass reads are resampled horizontally.
        row_first, row_last = int(first_v[0]), int(first_v[-1] + count_v[-1])
        image = horizontal(image[row_first:row_last], *bicubic_coefficients(width, new_width))
        first_v = first_v - row_first
    if new_height != height:
        image = vertical(image, first_v, count_v, coef_v)
    return image


# --------------------------------------------------------------------------- numba kernels


@njit(parallel=True, cache=True, nogil=True)
def _resample_horizontal(
    src: np.ndarray, first: np.ndarray, count: np.ndarray, coef: np.ndarray, out: np.ndarray
) -> None:
    """Horizontal pass: uint8 ``src (rows, W, C)`` -> uint8 ``out (rows, W_out, C)``.

    Rows are processed in tiles of ``64 // C``; a tile is transposed to ``(W, 64)`` so that the
    taps of one output column are accumulated for all its rows and channels in contiguous lanes.
    """
    n_rows, width, channels = src.shape
    tile_rows = _TILE_LANES // channels
    for t in prange((n_rows + tile_rows - 1) // tile_rows):
        r0 = t * tile_rows
        nr = min(tile_rows, n_rows - r0)
        tile = np.empty((width, _TILE_LANES), dtype=np.uint8)  # unused lanes are never written out
        for r in range(nr):
            for x in range(width):
                for c in range(channels):
                    tile[x, r * channels + c] = src[r0 + r, x, c]
        acc = np.empty(_TILE_LANES, dtype=np.int32)
        for xo in range(out.shape[1]):
            acc[:] = _ROUNDING_BIAS
            for k in range(count[xo]):
                w = coef[xo, k]
                column = tile[first[xo] + k]
                for j in range(_TILE_LANES):
                    acc[j] += w * np.int32(column[j])
            for r in range(nr):
                for c in range(channels):
                    out[r0 + r, xo, c] = min(max(acc[r * channels + c] >> PRECISION_BITS, 0), 255)


@njit(parallel=True, cache=True, nogil=True)
def _resample_vertical(src: np.ndarray, first: np.ndarray, count: np.ndarray, coef: np.ndarray,
                       out: np.ndarray) -> None:
    """Vertical pass: uint8 ``src (H, L)`` -> uint8 ``out (H_out, L)``, whole rows as vectors."""
    length = src.shape[1]
    for y in prange(out.shape[0]):
        acc = np.empty(_ROW_CHUNK, dtype=np.int32)
        for c0 in range(0, length, _ROW_CHUNK):
            n = min(_ROW_CHUNK, length - c0)
            acc[:n] = _ROUNDING_BIAS
            for k in range(count[y]):
                w = coef[y, k]
                row = src[first[y] + k, c0 : c0 + n]
                for i in range(n):
                    acc[i] += w * np.int32(row[i])
            for i in range(n):
                out[y, c0 + i] = min(max(acc[i] >> PRECISION_BITS, 0), 255)


# The alpha kernels see an RGBA pixel as one little-endian uint32 (R in the low byte, A in the high
# byte), which lets the compiler vectorise them across pixels.


@njit(parallel=True, cache=True, nogil=True)
def _premultiply(pixels: np.ndarray, out: np.ndarray) -> None:
    """Pillow's RGBA -> RGBa on uint32 ``(N,)`` pixels: ``MULDIV255(v, a)`` per colour channel,
    ``tmp = v * a + 128; ((tmp >> 8) + tmp) >> 8``."""
    for i in prange(pixels.shape[0]):
        p = np.uint32(pixels[i])
        alpha = p >> np.uint32(24)
        result = p & np.uint32(0xFF000000)
        for shift in (0, 8, 16):
            tmp = ((p >> np.uint32(shift)) & np.uint32(255)) * alpha + np.uint32(128)
            result |= (((tmp >> np.uint32(8)) + tmp) >> np.uint32(8)) << np.uint32(shift)
        out[i] = result


@functools.cache
def unpremultiply_table() -> np.ndarray:
    """uint8 ``(256, 256)``: ``table[a, v]`` is Pillow's RGBa -> RGBA colour value (``rgba2rgbA``):
    ``min(255 * v // a, 255)`` for ``0 < a < 255``, else ``v``. A lookup beats the division."""
    v = np.arange(256)[None, :]
    alpha = np.arange(256)[:, None]
    divided = np.minimum(255 * v // np.maximum(alpha, 1), 255)
    table = np.where((alpha == 0) | (alpha == 255), v, divided).astype(np.uint8)
    table.setflags(write=False)
    return table


@njit(parallel=True, cache=True, nogil=True)
def _unpremultiply(pixels: np.ndarray, table: np.ndarray) -> None:
    """RGBa -> RGBA in place on uint32 ``(N,)`` pixels through :func:`unpremultiply_table`."""
    for i in prange(pixels.shape[0]):
        p = pixels[i]
        row = table[p >> np.uint32(24)]
        result = p & np.uint32(0xFF000000)
        for shift in (0, 8, 16):
            result |= np.uint32(row[(p >> np.uint32(shift)) & np.uint32(255)]) << np.uint32(shift)
        pixels[i] = result


# --------------------------------------------------------------------------- numpy path


def _check_image(shape: tuple[int, ...], dtype: Any, new_width: int, new_height: int) -> None:
    if len(shape) != 3 or shape[2] not in (3, 4) or str(dtype) not in ("uint8", "torch.uint8"):
        raise ValueError(f"expected uint8 (H, W, 3|4), got {dtype} {tuple(shape)}")
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


def _horizontal_pass_numpy(image: np.ndarray, first: np.ndarray, count: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """uint8 C-contiguous ``(H, W, C)`` -> uint8 ``(H, len(first), C)``."""
    out = np.empty((image.shape[0], first.shape[0], image.shape[2]), dtype=np.uint8)
    with parallel_kernel(out.size):
        _resample_horizontal(image, first, count, coef, out)
    return out


def _vertical_pass_numpy(image: np.ndarray, first: np.ndarray, count: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """uint8 C-contiguous ``(H, W, C)`` -> uint8 ``(len(first), W, C)``."""
    out = np.empty((first.shape[0], *image.shape[1:]), dtype=np.uint8)
    with parallel_kernel(out.size):
        _resample_vertical(image.reshape(image.shape[0], -1), first, count, coef, out.reshape(out.shape[0], -1))
    return out


def bicubic_numpy(pixels: np.ndarray, new_width: int, new_height: int) -> np.ndarray:
    """Pillow's BICUBIC on uint8 ``(H, W, C)`` -> uint8 ``(new_height, new_width, C)``, no alpha handling."""
    return _bicubic_two_pass(
        np.ascontiguousarray(pixels), new_width, new_height, _horizontal_pass_numpy, _vertical_pass_numpy
    )


def resize_numpy(pixels: np.ndarray, new_width: int, new_height: int, resample: Resample) -> np.ndarray:
    """uint8 ``(H, W, C)`` -> uint8 ``(new_height, new_width, C)``, bit-exact to ``Image.resize``."""
    _check_image(pixels.shape, pixels.dtype, new_width, new_height)
    height, width = pixels.shape[:2]
    if (width, height) == (new_width, new_height):
        return pixels
    if resample == "nearest":
        return pixels[nearest_indices(height, new_height)][:, nearest_indices(width, new_width)]
    if pixels.shape[2] == 4:
        resized = bicubic_numpy(premultiply_numpy(pixels), new_width, new_height)
        return unpremultiply_numpy(resized)
    return bicubic_numpy(pixels, new_width, new_height)


# --------------------------------------------------------------------------- torch path


def _resample_axis_torch(
    image: torch.Tensor, first: np.ndarray, count: np.ndarray, coef: np.ndarray, axis: int
) -> torch.Tensor:
    """One exact pass along ``axis`` (0: vertical, 1: horizontal) of int32 ``(H, W, C)``: the int32
    sum of gathered taps times fixed-point coefficients, plus the bias, shifted and clipped."""
    import torch

    device = image.device
    ksize = int(count.max())
    # Taps past ``count`` have weight 0; clamping their index keeps the gather in bounds.
    index = torch.tensor(np.minimum(first[:, None] + np.arange(ksize), image.shape[axis] - 1), device=device)
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
    int32 ``(new_height, new_width, C)``. Close to Pillow (see tests for the measured error), not equal."""
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

    _check_image(tuple(pixels.shape), pixels.dtype, new_width, new_height)
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
    """Resize a numpy array (numba kernels) or torch tensor (tensor ops on its device), uint8
    ``(H, W, C)`` with C in {3, 4}; returns the same kind, bit-exact to Pillow's ``Image.resize``.
    ``method`` applies to tensors only (numpy is always exact)."""
    if isinstance(pixels, np.ndarray):
        if method != "exact":
            raise ValueError(f"method={method!r} is only available for torch tensors")
        return resize_numpy(pixels, new_width, new_height, resample)
    return resize_torch(pixels, new_width, new_height, resample, method)
