"""Normalize + pad + patchify in one pass, driven by a 256x3 lookup table (spec section 4).

The normalised value of a pixel depends only on (value, channel), so the reference's float64
arithmetic is evaluated once per table entry and every output element is a single table read:
the table is exact for any mean/std. Padded pixels are uint8 0, i.e. ``table[0, c]``.

The same holds split in two: :func:`patchify` pads and patchifies the uint8 pixels (the "uint8
wire", 4x smaller than float32), and :func:`expand_patches` applies the table later, possibly in
another process: ``expand_patches(patchify(img, ...), table)`` equals ``write_patches(img, table,
...)`` bit for bit, because both are the same table read of the same uint8 value.

Each op dispatches on its first argument (:mod:`.kernels`): numpy arrays to numba kernels, torch
tensors (any device) to one gather plus a view/permute; twins take and return the same dtypes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit, prange

from .buffers import empty_output
from .kernels import NUMPY, TORCH, get_kernel, register_kernel
from .numba_runtime import kernel_input, parallel_kernel

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


def write_patches(image: Any, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None) -> Any:
    """Pad (zeros, bottom/right), look up ``table`` and patchify in one pass.

    ``image``: uint8 ``(H, W, 3)`` with ``H <= grid_h*p`` and ``W <= grid_w*p`` (numpy, or torch on
    any device); ``table``: ``(256, 3)``, float32 from :func:`normalize_table` or uint8
    :data:`IDENTITY_TABLE`. Returns ``(grid_h*grid_w, 3, p, p)`` of the table's dtype, of the
    image's type (float32: the ``pixel_values``); written into ``out`` when given (C-contiguous,
    that shape and dtype: e.g. one frame's rows of a video chunk), else a new array.
    """
    return get_kernel("write_patches", image)(image, table, grid_h, grid_w, patch_size, out=out)


def patchify(image: Any, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None) -> Any:
    """Pad and patchify without normalising: uint8 ``(H, W, 3)`` -> uint8 ``(grid_h*grid_w, 3, p, p)``
    in the :func:`write_patches` layout (into ``out`` when given); :func:`expand_patches` turns it
    into ``pixel_values``."""
    return get_kernel("patchify", image)(image, grid_h, grid_w, patch_size, out=out)


def _checked_out(out: Any, shape: tuple[int, ...], dtype: Any) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} array of shape {shape}, got {out.dtype} {tuple(out.shape)}")


def expand_patches(patches: Any, table: np.ndarray) -> Any:
    """uint8 ``(N, 3, p, p)`` patches (numpy, or torch on any device) -> float32 ``(N, 3, p, p)``
    normalised through ``table`` (float32 ``(256, 3)``), bit-equal to :func:`write_patches` on the
    same image."""
    return get_kernel("expand_patches", patches)(patches, table)


def empty_patches(like: Any, shape: tuple[int, ...], dtype: type) -> Any:
    """A new uninitialised array of ``shape`` and numpy ``dtype`` of ``like``'s type (and device)."""
    return get_kernel("empty", like)(like, shape, dtype)


@register_kernel("empty", NUMPY)
def _empty_numpy(like: np.ndarray, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return empty_output(shape, dtype)


@register_kernel("empty", TORCH)
def _empty_torch(like: torch.Tensor, shape: tuple[int, ...], dtype: type) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, device=like.device)


def concatenate_patches(parts: Sequence[Any]) -> Any:
    """Patches of several images or frames, ``(N_i, 3, p, p)`` each and all of one type, as one
    ``(ΣN_i, 3, p, p)`` array of that type (several media along dim 0, spec section 7)."""
    return get_kernel("concatenate", parts[0])(parts)


@register_kernel("concatenate", NUMPY)
def _concatenate_numpy(parts: Sequence[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@register_kernel("concatenate", TORCH)
def _concatenate_torch(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


# --------------------------------------------------------------------------- numba kernels


@njit(parallel=True, cache=True, nogil=True)
def _write_patches_by_pixel(image: np.ndarray, table: np.ndarray, out: np.ndarray, grid_w: int) -> None:
    """``out[gy*grid_w + gx, c, y, x] = table[image[gy*p + y, gx*p + x, c], c]`` (``table[0, c]``
    past the edge), each pixel's three bytes read once: the faster order for uint8 patches.

    The edge test is per patch row, not per element: the inner loops are branch-free (measured
    1.1-2x faster than a per-element bounds test)."""
    height, width = image.shape[0], image.shape[1]
    p = out.shape[2]
    grid_h = out.shape[0] // grid_w
    for gy in prange(grid_h):
        y0 = gy * p
        rows = max(0, min(p, height - y0))
        for gx in range(grid_w):
            n = gy * grid_w + gx
            x0 = gx * p
            cols = max(0, min(p, width - x0))
            for y in range(p):
                filled = cols if y < rows else 0
                for x in range(filled):
                    out[n, 0, y, x] = table[image[y0 + y, x0 + x, 0], 0]
                    out[n, 1, y, x] = table[image[y0 + y, x0 + x, 1], 1]
                    out[n, 2, y, x] = table[image[y0 + y, x0 + x, 2], 2]
                for x in range(filled, p):
                    out[n, 0, y, x] = table[0, 0]
                    out[n, 1, y, x] = table[0, 1]
                    out[n, 2, y, x] = table[0, 2]


@njit(parallel=True, cache=True, nogil=True)
def _write_patches_by_plane(image: np.ndarray, table: np.ndarray, out: np.ndarray, grid_w: int) -> None:
    """As :func:`_write_patches_by_pixel`, one channel plane of a patch after the other: each patch
    is written as one ascending stream, the faster order for float32 patches of large images
    (1.4x at 3 MP, BENCHMARKS.md). The two kernels repeat the patch-grid loop on purpose: one loop
    calling a per-patch function of either order measured 0.73-0.95x."""
    height, width = image.shape[0], image.shape[1]
    p = out.shape[2]
    grid_h = out.shape[0] // grid_w
    for gy in prange(grid_h):
        y0 = gy * p
        rows = max(0, min(p, height - y0))
        for gx in range(grid_w):
            n = gy * grid_w + gx
            x0 = gx * p
            cols = max(0, min(p, width - x0))
            for c in range(3):
                pad = table[0, c]
                for y in range(p):
                    filled = cols if y < rows else 0
                    for x in range(filled):
                        out[n, c, y, x] = table[image[y0 + y, x0 + x, c], c]
                    for x in range(filled, p):
                        out[n, c, y, x] = pad


@register_kernel("write_patches", NUMPY)
def write_patches_numpy(
    image: np.ndarray, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: np.ndarray | None = None
) -> np.ndarray:
    """:func:`write_patches` for numpy (numba, parallel)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected uint8 (H, W, 3), got {image.dtype} {image.shape}")
    if image.shape[0] > grid_h * patch_size or image.shape[1] > grid_w * patch_size:
        raise ValueError(f"image {image.shape[:2]} larger than the {grid_h}x{grid_w} patch grid")
    shape = (grid_h * grid_w, 3, patch_size, patch_size)
    if out is None:
        out = empty_output(shape, table.dtype)
    elif out.shape != shape or out.dtype != table.dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous {table.dtype} array of shape {shape}")
    kernel = _write_patches_by_plane if out.itemsize >= 4 else _write_patches_by_pixel
    with parallel_kernel(out.size):
        kernel(kernel_input(image), kernel_input(table), out, grid_w)
    return out


@register_kernel("patchify", NUMPY)
def patchify_numpy(
    image: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: np.ndarray | None = None
) -> np.ndarray:
    """:func:`patchify` for numpy: the numba pass with :data:`IDENTITY_TABLE`."""
    return write_patches_numpy(image, IDENTITY_TABLE, grid_h, grid_w, patch_size, out=out)


@njit(parallel=True, cache=True, nogil=True)
def _expand(patches: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """``out[n, c, i] = table[patches[n, c, i], c]`` (patches flattened to ``(N, 3, p*p)``)."""
    for n in prange(patches.shape[0]):
        for c in range(3):
            for i in range(patches.shape[2]):
                out[n, c, i] = table[patches[n, c, i], c]


@register_kernel("expand_patches", NUMPY)
def expand_patches_numpy(patches: np.ndarray, table: np.ndarray) -> np.ndarray:
    """:func:`expand_patches` for numpy (numba, parallel); a new array."""
    if patches.dtype != np.uint8 or patches.ndim != 4 or patches.shape[1] != 3:
        raise ValueError(f"expected uint8 (N, 3, p, p), got {patches.dtype} {patches.shape}")
    if table.shape != (256, 3):
        raise ValueError(f"expected a (256, 3) table, got {table.shape}")
    flat = kernel_input(patches).reshape(patches.shape[0], 3, -1)
    table = kernel_input(np.asarray(table, dtype=np.float32))
    out = empty_output(flat.shape, table.dtype)
    with parallel_kernel(out.size):
        _expand(flat, table, out)
    return out.reshape(patches.shape)


# --------------------------------------------------------------------------- torch kernels


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


@register_kernel("write_patches", TORCH)
def write_patches_torch(
    image: torch.Tensor, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None
) -> torch.Tensor:
    """:func:`write_patches` for torch: one gather from the table, then a view/permute into
    patches, on the image's device (copied into ``out`` when given)."""
    padded = _pad_torch(image, grid_h, grid_w, patch_size)
    lut, channel = _torch_table(table, image.device)
    values = lut[padded.long(), channel]  # (Hp, Wp, 3) of the table's dtype
    return _into(out, _to_patches_torch(values, grid_h, grid_w, patch_size))


def _into(out: Any, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    _checked_out(out, tuple(result.shape), result.dtype)
    return out.copy_(result)


@register_kernel("patchify", TORCH)
def patchify_torch(image: torch.Tensor, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None) -> torch.Tensor:
    """:func:`patchify` for torch, on the image's device (copied into ``out`` when given)."""
    return _into(out, _to_patches_torch(_pad_torch(image, grid_h, grid_w, patch_size), grid_h, grid_w, patch_size))


@register_kernel("expand_patches", TORCH)
def expand_patches_torch(patches: torch.Tensor, table: np.ndarray) -> torch.Tensor:
    """:func:`expand_patches` for torch: one gather, on the patches' device."""
    import torch

    if patches.dtype != torch.uint8 or patches.ndim != 4 or patches.shape[1] != 3:
        raise ValueError(f"expected uint8 (N, 3, p, p), got {patches.dtype} {tuple(patches.shape)}")
    lut, channel = _torch_table(table, patches.device)
    return lut[patches.long(), channel[:, None, None]]
