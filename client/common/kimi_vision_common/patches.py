"""The normalise table and the uint8 wire's expansion: numpy only.

Normalisation depends only on (value, channel), so the reference's float64 arithmetic, done once
per value into a float32 ``(256, 3)`` table, is exact for any mean/std; uint8 patches read
through it are bit-equal to the fused float32 output.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .presets import Preset, get_preset


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


def expand_with_table(patches: np.ndarray, table: np.ndarray) -> np.ndarray:
    """uint8 ``(N, 3, p, p)`` -> float32 ``(N, 3, p, p)`` with ``out[n, c] = table[patches[n, c], c]``."""
    patches = np.asarray(patches)
    if patches.dtype != np.uint8 or patches.ndim != 4 or patches.shape[1] != 3:
        raise ValueError(f"expected uint8 (N, 3, p, p), got {patches.dtype} {patches.shape}")
    if table.shape != (256, 3):
        raise ValueError(f"expected a (256, 3) table, got {table.shape}")
    out = np.empty(patches.shape, np.float32)
    for channel in range(3):
        np.take(np.ascontiguousarray(table[:, channel], dtype=np.float32), patches[:, channel], out=out[:, channel])
    return out


def expand_with_table_torch(patches: Any, table: np.ndarray) -> Any:
    """:func:`expand_with_table` for a torch uint8 ``(N, 3, p, p)`` tensor: one gather on its device
    (torch, where installed: only a caller holding a tensor calls this)."""
    import torch

    if patches.dtype != torch.uint8 or patches.ndim != 4 or patches.shape[1] != 3:
        raise ValueError(f"expected uint8 (N, 3, p, p), got {patches.dtype} {tuple(patches.shape)}")
    lut = torch.tensor(table, device=patches.device)  # a copy: the cached table is read-only
    channel = torch.arange(3, device=patches.device)
    return lut[patches.long(), channel[:, None, None]]


def expand_patches(pixel_patches: np.ndarray, preset: str | Preset = "kimi-k2.5") -> np.ndarray:
    """uint8 ``(N, 3, p, p)`` numpy patches -> float32 ``pixel_values`` under ``preset``'s mean/std,
    bit-equal to the fused ``output="pixel_values"`` (the library's
    ``pixel_values_from_patches`` also takes torch tensors)."""
    preset = get_preset(preset)
    return expand_with_table(pixel_patches, normalize_table(preset.image_mean, preset.image_std))
