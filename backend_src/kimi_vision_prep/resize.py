"""Pillow-exact resize: one dispatch point per device.

``bicubic`` is Pillow's BICUBIC (RGBA premultiplied, as Pillow does for RGBA); ``nearest`` is
Pillow's NEAREST (used for palette and 1-bit sources).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from .decode import Resample

_PIL_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}


def resize_pillow(pixels: np.ndarray, new_width: int, new_height: int, resample: Resample) -> np.ndarray:
    """uint8 ``(H, W, C)`` -> uint8 ``(new_height, new_width, C)`` through Pillow itself."""
    mode = {3: "RGB", 4: "RGBA"}[pixels.shape[2]]
    image = Image.fromarray(np.ascontiguousarray(pixels), mode)
    return np.asarray(image.resize((new_width, new_height), _PIL_FILTERS[resample]))


def resize(pixels: Any, new_width: int, new_height: int, resample: Resample) -> Any:
    """Resize a numpy array or torch tensor uint8 ``(H, W, C)``; returns the same kind."""
    if (pixels.shape[1], pixels.shape[0]) == (new_width, new_height):
        return pixels
    if isinstance(pixels, np.ndarray):
        return resize_pillow(pixels, new_width, new_height, resample)
    import torch

    resized = resize_pillow(pixels.cpu().numpy(), new_width, new_height, resample)
    return torch.from_numpy(resized).to(pixels.device)
