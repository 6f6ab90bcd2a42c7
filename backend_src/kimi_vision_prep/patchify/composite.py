"""K3 transparency: blend straight-alpha RGBA onto a chessboard (spec section 5)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from kimi_vision_common.presets import Preset

from ..kernels import NUMPY, TORCH, get_kernel, register_kernel

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=8)
def _board_rows(width: int, square: int, light: int, dark: int) -> tuple[np.ndarray, np.ndarray]:
    """The two row patterns of a chessboard ``width`` wide (even and odd square rows), uint8."""
    col = np.arange(width) // square
    even = np.where(col % 2 == 0, light, dark).astype(np.uint8)
    odd = np.where(col % 2 == 0, dark, light).astype(np.uint8)
    return even, odd


# ``A / 255`` for every alpha, float32, rounded as numpy's true division rounds it.
ALPHA_FRACTIONS = np.arange(256, dtype=np.float32) / np.float32(255.0)


def chessboard(height: int, width: int, preset: Preset) -> np.ndarray:
    """uint8 ``(H, W)``: ``light`` where ``(y // square + x // square)`` is even, else ``dark``."""
    even, odd = _board_rows(width, preset.chessboard_square, preset.chessboard_light, preset.chessboard_dark)
    rows = (np.arange(height) // preset.chessboard_square) % 2 == 0
    return np.where(rows[:, None], even[None, :], odd[None, :])


def composite_on_chessboard(rgba: Any, preset: Preset) -> Any:
    """Straight-alpha uint8 ``(H, W, 4)`` -> uint8 ``(H, W, 3)`` blended onto the preset's
    chessboard: ``a * rgb + (1 - a) * board`` in float32 with ``a = A / 255``, truncated (spec 5).
    numpy or torch (any device); returns the same type."""
    return get_kernel("composite", rgba)(rgba, preset)


@register_kernel("composite", NUMPY)
def composite_numpy(rgba: np.ndarray, preset: Preset) -> np.ndarray:
    """:func:`composite_on_chessboard` for numpy."""
    board = chessboard(rgba.shape[0], rgba.shape[1], preset)[:, :, None]
    a = ALPHA_FRACTIONS[rgba[:, :, 3:4]]
    out = a * rgba[:, :, :3] + (np.float32(1.0) - a) * board
    return out.astype(np.uint8)


@register_kernel("composite", TORCH)
def composite_torch(rgba: torch.Tensor, preset: Preset) -> torch.Tensor:
    """:func:`composite_on_chessboard` for torch (the same float32 operations), on its device."""
    import torch

    board = torch.from_numpy(chessboard(rgba.shape[0], rgba.shape[1], preset)).to(rgba.device)[:, :, None]
    # A / 255 from numpy's table: CUDA divides by a scalar as a multiply by its reciprocal, which
    # rounds some alphas differently from numpy's true division.
    a = torch.from_numpy(ALPHA_FRACTIONS).to(rgba.device)[rgba[:, :, 3:4].long()]
    out = a * rgba[:, :, :3].to(torch.float32) + (1.0 - a) * board.to(torch.float32)
    return out.to(torch.uint8)
