"""Normalize + pad + patchify in one pass, driven by a 256x3 lookup table (spec section 4).

The normalised value of a pixel depends only on (value, channel), so the reference's float64
arithmetic is evaluated once per table entry and every output element is a single table read:
the table is exact for any mean/std. Padded pixels are uint8 0, i.e. ``table[0, c]``.

The same holds split in two: :func:`patchify_numpy` / :func:`patchify_torch` pad and patchify
the uint8 pixels (the "uint8 wire", 4x smaller than float32), and :func:`expand_patches` /
:func:`expand_patches_torch` apply the table later, possibly in another process:
``expand_patches(patchify_numpy(img, ...), table)`` equals ``write_patches_numpy(img, table, ...)``
bit for bit, because both are the same table read of the same uint8 value.
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


# ``table[v, c] == v``: the fused kernel with this table and a uint8 ``out`` pads and patchifies
# without normalising (numba compiles it as a second signature of the same kernel).
IDENTITY_TABLE = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1)
IDENTITY_TABLE.setflags(write=False)


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
    """Pad (zeros, bottom/right), normalise and patchify on the CPU, in one pass.

    ``image``: uint8 ``(H, W, 3)`` with ``H <= grid_h*p`` and ``W <= grid_w*p``; ``table``: ``(256, 3)``,
    float32 from :func:`normalize_table` or uint8 :data:`IDENTITY_TABLE`. Returns
    ``(grid_h*grid_w, 3, p, p)`` of the table's dtype (float32: the ``pixel_values``).
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected uint8 (H, W, 3), got {image.dtype} {image.shape}")
    if image.shape[0] > grid_h * patch_size or image.shape[1] > grid_w * patch_size:
        raise ValueError(f"image {image.shape[:2]} larger than the {grid_h}x{grid_w} patch grid")
    out = np.empty((grid_h * grid_w, 3, patch_size, patch_size), dtype=table.dtype)
    with parallel_kernel(out.size):
        _write_patches(image, table, out, grid_w)
    return out


def patchify_numpy(image: np.ndarray, grid_h: int, grid_w: int, patch_size: int) -> np.ndarray:
    """Pad (zeros, bottom/right) and patchify on the CPU without normalising.

    ``image``: uint8 ``(H, W, 3)`` as for :func:`write_patches_numpy`. Returns uint8
    ``(grid_h*grid_w, 3, p, p)`` in the same layout; :func:`expand_patches` turns it into the
    float32 ``pixel_values``.
    """
    return write_patches_numpy(image, IDENTITY_TABLE, grid_h, grid_w, patch_size)


@njit(parallel=True, cache=True, nogil=True)
def _expand(patches: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """``out[n, c, i] = table[patches[n, c, i], c]`` (patches flattened to ``(N, 3, p*p)``)."""
    for n in prange(patches.shape[0]):
        for c in range(3):
            for i in range(patches.shape[2]):
                out[n, c, i] = table[patches[n, c, i], c]


def expand_patches(patches: np.ndarray, table: np.ndarray) -> np.ndarray:
    """uint8 patches -> normalised float32 ``pixel_values`` (numba, parallel).

    ``patches``: uint8 ``(N, 3, p, p)`` from :func:`patchify_numpy` (or received over the uint8
    wire); ``table``: float32 ``(256, 3)`` from :func:`normalize_table`. Returns a new float32
    ``(N, 3, p, p)`` array, bit-equal to :func:`write_patches_numpy` on the same image.
    """
    if patches.dtype != np.uint8 or patches.ndim != 4 or patches.shape[1] != 3:
        raise ValueError(f"expected uint8 (N, 3, p, p), got {patches.dtype} {patches.shape}")
    if table.shape != (256, 3):
        raise ValueError(f"expected a (256, 3) table, got {table.shape}")
    # One numba signature whatever the source: a C-contiguous, read-only (N, 3, p*p) view.
    flat = np.ascontiguousarray(patches).reshape(patches.shape[0], 3, -1)
    flat = flat.view()
    flat.setflags(write=False)
    if table.flags.writeable or not table.flags.c_contiguous:
        table = np.array(table, dtype=np.float32, order="C")
        table.setflags(write=False)
    out = np.empty(flat.shape, dtype=table.dtype)
    with parallel_kernel(out.size):
        _expand(flat, table, out)
    return out.reshape(patches.shape)


def _pad_torch(image: torch.Tensor, grid_h: int, grid_w: int, patch_size: int) -> torch.Tensor:
    """uint8 ``(H, W, 3)`` zero-padded at the bottom/right to ``(grid_h*p, grid_w*p, 3)``."""
    import torch

    p = patch_size
    height, width = image.shape[0], image.shape[1]
    if (height, width) == (grid_h * p, grid_w * p):
        return image
    padded = torch.zeros((grid_h * p, grid_w * p, 3), dtype=torch.uint8, device=image.device)
    padded[:height, :width] = image
    return padded


def _to_patches_torch(values: torch.Tensor, grid_h: int, grid_w: int, patch_size: int) -> torch.Tensor:
    """``(grid_h*p, grid_w*p, 3)`` -> contiguous ``(grid_h*grid_w, 3, p, p)`` (any dtype)."""
    p = patch_size
    patches = values.view(grid_h, p, grid_w, p, 3).permute(0, 2, 4, 1, 3).reshape(grid_h * grid_w, 3, p, p)
    return patches.contiguous()  # reshape copies except for a single patch row/column (a strided view)


def _torch_table(table: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The table on ``device`` (a copy: the cached table is read-only) and the channel indices."""
    import torch

    return torch.tensor(table, device=device), torch.arange(3, device=device)


def write_patches_torch(
    image: torch.Tensor, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int
) -> torch.Tensor:
    """Same as :func:`write_patches_numpy` for a torch uint8 ``(H, W, 3)`` tensor on any device:
    one gather from the table, then a view/permute into patches. Returns float32
    ``(grid_h*grid_w, 3, p, p)`` on the image's device."""
    padded = _pad_torch(image, grid_h, grid_w, patch_size)
    lut, channel = _torch_table(table, image.device)
    values = lut[padded.long(), channel]  # (Hp, Wp, 3) float32
    return _to_patches_torch(values, grid_h, grid_w, patch_size)


def patchify_torch(image: torch.Tensor, grid_h: int, grid_w: int, patch_size: int) -> torch.Tensor:
    """Same as :func:`patchify_numpy` for a torch uint8 ``(H, W, 3)`` tensor on any device.
    Returns uint8 ``(grid_h*grid_w, 3, p, p)`` on the image's device."""
    return _to_patches_torch(_pad_torch(image, grid_h, grid_w, patch_size), grid_h, grid_w, patch_size)


def expand_patches_torch(patches: torch.Tensor, table: np.ndarray) -> torch.Tensor:
    """Same as :func:`expand_patches` for a torch uint8 ``(N, 3, p, p)`` tensor on any device (one
    gather). Returns float32 ``(N, 3, p, p)`` on the patches' device."""
    import torch

    if patches.dtype != torch.uint8 or patches.ndim != 4 or patches.shape[1] != 3:
        raise ValueError(f"expected uint8 (N, 3, p, p), got {patches.dtype} {tuple(patches.shape)}")
    lut, channel = _torch_table(table, patches.device)
    return lut[patches.long(), channel[:, None, None]]
