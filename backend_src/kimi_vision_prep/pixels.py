"""The pixels the stages hand each other (a foundation: imports no stage).

:data:`Resample`: the filter an image is resized with (decode picks it, resize applies it);
:func:`host_to_device`: host pixels moved to a decoder's torch device; :func:`as_rgb_array` (an op
with a kernel per type): what the resize step returns as the RGB/RGBA array the composite and
patchify steps take, converted as Pillow converts (:func:`converted`, :func:`has_alpha`).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from PIL import Image

from kimi_vision_common.pillow_open import pillow_call

from .kernels import NUMPY, PIL_IMAGE, TORCH, get_kernel, register_kernel

# The filter an image is resized with: Pillow resizes palette and 1-bit images with NEAREST.
Resample = Literal["bicubic", "nearest"]


def host_to_device(pixels: np.ndarray, device: str) -> Any:
    """uint8 ``pixels`` copied to a torch tensor on ``device`` (``"cuda:N"``), same shape."""
    import torch

    # Pillow's arrays are read-only views; torch wants a writable host buffer to upload.
    return torch.from_numpy(np.require(pixels, requirements=["C", "W"])).to(device)


def has_alpha(image: Image.Image) -> bool:
    """An alpha band or a transparency key (the K3 rule for "has transparency")."""
    return "A" in image.getbands() or "transparency" in image.info


def converted(image: Image.Image, mode: str) -> np.ndarray:
    """``image`` converted to ``mode`` as a uint8 array (Pillow's errors typed)."""
    what = f"convert {image.mode} to {mode}"
    if image.mode == mode:
        # Pillow's convert to an image's own mode copies every pixel (40 MB at 10 MP, ~14 ms
        # here): the loaded image's pixels are read out once instead.
        pillow_call(what, image.load)
        return np.asarray(image)
    return np.asarray(pillow_call(what, image.convert, mode))


def as_rgb_array(pixels: Any) -> Any:
    """uint8 ``(H, W, 3)`` RGB or ``(H, W, 4)`` straight-alpha RGBA: arrays and tensors as they
    are, a Pillow image converted (RGBA when it has transparency, else RGB)."""
    return get_kernel("as_rgb_array", pixels)(pixels)


@register_kernel("as_rgb_array", NUMPY)
@register_kernel("as_rgb_array", TORCH)
def _rgb_array_as_is(pixels: Any) -> Any:
    return pixels


@register_kernel("as_rgb_array", PIL_IMAGE)
def _rgb_array_from_pil(image: Image.Image) -> np.ndarray:
    return converted(image, "RGBA" if has_alpha(image) else "RGB")
