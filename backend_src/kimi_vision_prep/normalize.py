"""Normalize + pad + patchify in one pass, driven by a 256x3 lookup table (spec section 4).

The normalised value of a pixel depends only on (value, channel), so the reference's float64
arithmetic is evaluated once per table entry and every output element is a single table read:
the table is exact for any mean/std. Padded pixels are uint8 0, i.e. ``table[0, c]``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
from numba import njit, prange

from .numba_runtime import parallel_kernel

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=16)  # a few presets per process
def normalize_table(mean: tuple[float, float, float], std: tuple[float, float, float]) -> np.ndarray:
    """float32 ``(256, 3)`` table: ``table[v, c]`` is the reference's normalised value of ``v``.

    Reference semantics: ``x = float32(v / 255.0)`` (float64 division), then ``x -= mean`` and
    ``x *= 1 / std`` with float64 operands, each stored back to float32.
    """
    x = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
    table = np.repeat(x[:, None], 3, axis=1)
    table -= np.asarray(mean, dtype=np.float64)
    table *= 1.0 / np.asarray(std, dtype=np.float64)
    table.setflags(write=False)
    return table


@njit(parallel=True, cache=True, nogil=True)
def _write_patches(image: np.ndarray, table: np.ndarray, out: np.ndarray, grid_w: int) -> None:
    """``out[gy*grid_w + gx, c, y, x] = table[image[gy*p + y, gx*p + x, c], c]`` (0 past the edge)."""
    height, width = image.shape[0], image.shape[1]
    p = out.shape[2]
    grid_h = out.shape[0] // grid_w
    for gy in prange(grid_h):
        for gx in range(grid_w):
            n = gy * grid_w + gx
            for c in range(3):
                pad_value = table[0, c]
                for y in range(p):
                    iy = gy * p + y
                    for x in range(p):
                        ix = gx * p + x
                        if iy < height and ix < width:
                            out[n, c, y, x] = table[image[iy, ix, c], c]
                        else:
                            out[n, c, y, x] = pad_value


def write_patches_numpy(
    image: np.ndarray, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int
) -> np.ndarray:
    """Pad (zeros, bottom/right), normalise and patchify on the CPU.

    ``image``: uint8 ``(H, W, 3)`` with ``H <= grid_h*p`` and ``W <= grid_w*p``.
    Returns float32 ``(grid_h*grid_w, 3, p, p)``.
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected uint8 (H, W, 3), got {image.dtype} {image.shape}")
    if image.shape[0] > grid_h * patch_size or image.shape[1] > grid_w * patch_size:
        raise ValueError(f"image {image.shape[:2]} larger than the {grid_h}x{grid_w} patch grid")
    out = np.empty((grid_h * grid_w, 3, patch_size, patch_size), dtype=np.float32)
    with parallel_kernel(out.size):
        _write_patches(image, table, out, grid_w)
    return out


def write_patches_torch(
    image: torch.Tensor, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int
) -> torch.Tensor:
    """Same as :func:`write_patches_numpy` for a torch uint8 ``(H, W, 3)`` tensor on any device:
    one gather from the table, then a view/permute into patches."""
    import torch

    p = patch_size
    height, width = image.shape[0], image.shape[1]
    padded = image
    if (height, width) != (grid_h * p, grid_w * p):
        padded = torch.zeros((grid_h * p, grid_w * p, 3), dtype=torch.uint8, device=image.device)
        padded[:height, :width] = image
    lut = torch.tensor(table, device=image.device)  # (256, 3); a copy: the cached table is read-only
    channel = torch.arange(3, device=image.device)
    values = lut[padded.long(), channel]  # (Hp, Wp, 3) float32
    return values.view(grid_h, p, grid_w, p, 3).permute(0, 2, 4, 1, 3).reshape(grid_h * grid_w, 3, p, p)
