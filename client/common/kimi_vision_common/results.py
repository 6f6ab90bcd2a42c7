"""What the processor returns, in process and from a server: plain dataclasses of arrays.

Pixel arrays are numpy on the CPU (a torch tensor where the library ran on CUDA); shapes and
dtypes are in each docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import numpy as np

# What preprocessing produces per image: normalised float32 ``pixel_values`` (the processor's
# output, the default) or the uint8 ``pixel_patches`` they are a table lookup of.
PixelOutput = Literal["pixel_values", "pixel_patches"]
PIXEL_OUTPUTS: tuple[str, ...] = get_args(PixelOutput)


@dataclass(frozen=True)
class TokenCount:
    """``grid_thw`` int64 ``(3,)`` = ``(1, gh, gw)``, ``num_tokens`` and the image's ``prompt``."""

    grid_thw: np.ndarray
    num_tokens: int
    prompt: str


@dataclass
class ImagesResult:
    """Several images as the processor returns them (spec section 7): the single-image results
    concatenated in order.

    ``pixel_values``: float32 ``(ΣN, 3, p, p)`` (None with ``output="pixel_patches"``);
    ``pixel_patches``: uint8 ``(ΣN, 3, p, p)`` (only with ``output="pixel_patches"``);
    ``grid_thws``: int64 ``(n, 3)``; ``num_tokens``: int32 ``(n,)`` (:data:`~.wire.NUM_TOKENS_DTYPE`);
    ``decode_paths``: per image.
    """

    pixel_values: Any
    grid_thws: np.ndarray
    num_tokens: np.ndarray
    decode_paths: tuple[str, ...] = ()
    pixel_patches: Any = None


@dataclass
class VideoChunkResult:
    """One chunk of a video: ``pixel_values`` float32 ``(T*gh*gw, 3, p, p)`` (or ``pixel_patches``
    uint8), ``grid_thw`` int64 ``(3,)`` = ``(T, gh, gw)``, ``num_tokens``, the chunk's ``prompt``
    and ``timestamp`` (as in the prompt) and the decoded-frame indices it holds."""

    pixel_values: Any
    grid_thw: np.ndarray
    num_tokens: int
    prompt: str
    timestamp: str
    frame_indices: tuple[int, ...]
    pixel_patches: Any = None


class HasPixelValues(Protocol):
    """A result with float32 ``pixel_values (N, 3, p, p)`` and int64 ``grid_thw (3,)``:
    the library's ``PreprocessResult``, the client's ``VisionResult``."""

    pixel_values: Any
    grid_thw: np.ndarray


def concat_results(results: Sequence[HasPixelValues], patch_size: int = 14) -> tuple[np.ndarray, np.ndarray]:
    """Several images as the processor returns them: float32 ``pixel_values (ΣN, 3, p, p)`` and
    int64 ``grid_thws (n, 3)`` (empty arrays of those shapes for no results). Needs float32 results
    (``output="pixel_values"``); ``patch_size`` only shapes the empty case."""
    if any(r.pixel_values is None for r in results):
        raise ValueError("concat_results needs pixel_values; expand pixel_patches with pixel_values_from_patches")
    if not results:
        return np.zeros((0, 3, patch_size, patch_size), np.float32), np.zeros((0, 3), np.int64)
    pixel_values = np.concatenate([np.asarray(r.pixel_values, dtype=np.float32) for r in results], axis=0)
    grid_thws = np.stack([np.asarray(r.grid_thw) for r in results]).astype(np.int64)
    return pixel_values, grid_thws
