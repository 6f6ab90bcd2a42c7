"""``resize``: Pillow-exact resizing (Pillow 13 ``Image.resize``), one kernel per array type.

- numpy uint8 ``(H, W, 3|4)``: numba kernels (:mod:`.resize_numba`).
- torch uint8 ``(H, W, 3|4)`` on any device: integer tensor ops, the same fixed-point passes.
- ``PIL.Image.Image`` in a mode whose resize does not commute with the conversion to RGB/RGBA
  (K3's CMYK, I;16, L with a transparency key, ...): Pillow itself, in that mode, returning an
  image of the same mode (:func:`~kimi_vision_prep.pixels.as_rgb_array` converts it afterwards).

BICUBIC everywhere except ``resample="nearest"`` (Pillow's choice for palette and 1-bit sources);
RGBA arrays are resized premultiplied, as ``Image.resize`` does. All kernels are bit-exact to
Pillow; the tests compare against Pillow itself.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from kimi_vision_common.pillow_open import pillow_call

from ..kernels import PIL_IMAGE, TORCH, get_kernel, register_kernel
from ..pixels import Resample
from .resample import (
    PRECISION_BITS,
    ROUNDING_BIAS,
    bicubic_two_pass,
    check_image,
    nearest_indices,
    unpremultiply_table,
)
from .resize_numba import resize_numpy

if TYPE_CHECKING:
    import torch


__all__ = ["resize", "resize_numpy", "resize_pil", "resize_torch"]


def resize(pixels: Any, new_width: int, new_height: int, resample: Resample = "bicubic") -> Any:
    """``pixels`` resized to ``new_width x new_height`` exactly as Pillow's ``Image.resize`` does,
    by the kernel for their type; returns the same type (and dtype, and device)."""
    return get_kernel("resize", pixels)(pixels, new_width, new_height, resample)


# --------------------------------------------------------------------------- torch kernel


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
    acc = torch.full((1, 1, 1), ROUNDING_BIAS, dtype=torch.int32, device=device)
    for k in range(ksize):
        acc = acc + image.index_select(axis, index[:, k]) * weights[:, k].view(broadcast)
    return torch.clamp(acc >> PRECISION_BITS, 0, 255)


def bicubic_torch(image: torch.Tensor, new_width: int, new_height: int) -> torch.Tensor:
    """Pillow's BICUBIC with integer tensor ops on any device: uint8 ``(H, W, C)`` -> uint8
    ``(new_height, new_width, C)`` (every channel alike; no alpha handling)."""
    import torch

    resized = bicubic_two_pass(
        image.to(torch.int32),
        new_width,
        new_height,
        functools.partial(_resample_axis_torch, axis=1),
        functools.partial(_resample_axis_torch, axis=0),
    )
    return resized.to(torch.uint8)


def premultiply_torch(rgba: torch.Tensor) -> torch.Tensor:
    """Pillow's RGBA -> RGBa on a uint8 ``(H, W, 4)`` tensor: ``MULDIV255(v, a)`` per colour
    channel; returns uint8 ``(H, W, 4)``."""
    import torch

    values = rgba.to(torch.int32)
    tmp = values[..., :3] * values[..., 3:] + 128
    return torch.cat([((tmp >> 8) + tmp) >> 8, values[..., 3:]], dim=-1).to(torch.uint8)


def unpremultiply_torch(rgba: torch.Tensor) -> torch.Tensor:
    """Pillow's RGBa -> RGBA on a uint8 ``(H, W, 4)`` tensor; returns uint8 ``(H, W, 4)``."""
    import torch

    table = torch.tensor(unpremultiply_table(), device=rgba.device)
    alpha = rgba[..., 3:]
    return torch.cat([table[alpha.long(), rgba[..., :3].long()], alpha], dim=-1)


@register_kernel("resize", TORCH)
def resize_torch(pixels: torch.Tensor, new_width: int, new_height: int, resample: Resample) -> torch.Tensor:
    """uint8 ``(H, W, C)``, C in {3, 4}, on any device -> uint8 ``(new_height, new_width, C)`` on
    that device, bit-exact to ``Image.resize``."""
    import torch

    check_image(pixels, pixels.dtype == torch.uint8, new_width, new_height)
    height, width = pixels.shape[:2]
    if (width, height) == (new_width, new_height):
        return pixels
    if resample == "nearest":
        rows = torch.tensor(nearest_indices(height, new_height), device=pixels.device)
        columns = torch.tensor(nearest_indices(width, new_width), device=pixels.device)
        return pixels.index_select(0, rows).index_select(1, columns)
    if pixels.shape[2] == 4:
        return unpremultiply_torch(bicubic_torch(premultiply_torch(pixels), new_width, new_height))
    return bicubic_torch(pixels, new_width, new_height)


# --------------------------------------------------------------------------- PIL kernel

_PIL_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}


@register_kernel("resize", PIL_IMAGE)
def resize_pil(image: Image.Image, new_width: int, new_height: int, resample: Resample) -> Image.Image:
    """A Pillow image resized by Pillow in its own mode (the reference's source-mode resize for the
    modes no array kernel reproduces); an unchanged size returns ``image``. Pillow's failures
    become typed errors (:func:`~kimi_vision_common.pillow_open.pillow_call`)."""
    if image.size == (new_width, new_height):
        return image
    what = f"resize a {image.mode} image"
    return pillow_call(what, image.resize, (new_width, new_height), _PIL_FILTERS[resample])
