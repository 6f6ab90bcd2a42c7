"""The outputs of the served models as results: sizes known before sending, arrays after.

``PIXEL_VALUES`` float32 ``[1, ΣN, 3, p, p]`` (or uint8 ``PIXEL_PATCHES``, expanded with the
preset's normalise table, bit-equal to the float32 ensemble), ``GRID_THW`` int64 ``[1, K, 3]``,
``NUM_TOKENS`` int32 ``[1, K]``: the batch dimension removed, each result a new array (a shared
memory region is reused for the next request).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from kimi_vision_common.patches import expand_patches
from kimi_vision_common.presets import Preset
from kimi_vision_common.results import ImagesResult
from kimi_vision_common.sizing import chunk_target, navit_target_size
from kimi_vision_common.wire import NUM_TOKENS_DTYPE

from .wire import GRID_THW, NUM_TOKENS, PIXEL_PATCHES, PIXEL_VALUES, Wire

OUTPUT_DTYPES: dict[str, np.dtype] = {
    PIXEL_VALUES: np.dtype(np.float32),
    PIXEL_PATCHES: np.dtype(np.uint8),
    GRID_THW: np.dtype(np.int64),
    NUM_TOKENS: np.dtype(np.int32),
}


@dataclass(frozen=True)
class VisionResult:
    """One image as the server preprocessed it (batch dimension removed).

    ``pixel_values``: float32 ``(N, 3, p, p)``; ``grid_thw``: int64 ``(3,)``; ``num_tokens``: int.
    """

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    num_tokens: int


@dataclass(frozen=True)
class WireResult:
    """One image or video chunk as the server returned it (batch dimension removed), its pixels
    not expanded: ``pixels`` uint8 ``(N, 3, p, p)`` patches on the uint8 wire (``wire.pixel_output``
    is ``PIXEL_PATCHES``), float32 ``pixel_values`` otherwise; ``grid_thw`` int64 ``(3,)``."""

    pixels: np.ndarray
    grid_thw: np.ndarray
    num_tokens: int
    wire: Wire


def image_size(data: bytes) -> tuple[int, int] | None:
    """Stored ``(width, height)`` from the header (no pixel decode), or None if Pillow cannot parse it."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception:  # any header Pillow rejects: the server will reject it too and say why
        return None


def output_byte_sizes(
    sizes: Sequence[tuple[int, int]], preset: Preset, pixel_output: str = PIXEL_VALUES
) -> dict[str, int]:
    """Bytes of each output of a request of images of ``sizes`` (width, height) under ``preset``,
    with the pixels as ``pixel_output`` (``PIXEL_VALUES`` float32 or ``PIXEL_PATCHES`` uint8)."""
    patches = sum(navit_target_size(width, height, preset).num_patches for width, height in sizes)
    patch_values = 3 * preset.patch_size * preset.patch_size
    return {
        pixel_output: patches * patch_values * OUTPUT_DTYPES[pixel_output].itemsize,
        GRID_THW: len(sizes) * 3 * OUTPUT_DTYPES[GRID_THW].itemsize,
        NUM_TOKENS: len(sizes) * OUTPUT_DTYPES[NUM_TOKENS].itemsize,
    }


def chunk_output_byte_sizes(frames: int, size: tuple[int, int], preset: Preset, pixel_output: str) -> dict[str, int]:
    """Bytes of each output of a ``frames``-frame video chunk whose first frame is ``size``
    (width, height), with the pixels as ``pixel_output``."""
    target = chunk_target(*size, frames, preset)
    patch_values = 3 * preset.patch_size * preset.patch_size
    return {
        pixel_output: frames * target.num_patches * patch_values * OUTPUT_DTYPES[pixel_output].itemsize,
        GRID_THW: 3 * OUTPUT_DTYPES[GRID_THW].itemsize,
        NUM_TOKENS: OUTPUT_DTYPES[NUM_TOKENS].itemsize,
    }


def _pixel_values(outputs: Mapping[str, np.ndarray], preset: Preset | None) -> np.ndarray:
    """float32 ``(ΣN, 3, p, p)`` of one request's outputs (a new array, so shm regions can be
    reused): ``PIXEL_PATCHES`` expanded with ``preset``'s table, ``PIXEL_VALUES`` copied."""
    if PIXEL_PATCHES in outputs:
        if preset is None:
            raise ValueError("expanding PIXEL_PATCHES needs the preset")
        return expand_patches(np.asarray(outputs[PIXEL_PATCHES][0]), preset)
    return np.array(outputs[PIXEL_VALUES][0], dtype=np.float32)


def to_vision_result(outputs: Mapping[str, np.ndarray], preset: Preset | None = None) -> VisionResult:
    """The output tensors of a one-image request -> :class:`VisionResult`."""
    return VisionResult(
        pixel_values=_pixel_values(outputs, preset),
        grid_thw=np.array(outputs[GRID_THW], dtype=np.int64).reshape(3),
        num_tokens=int(np.asarray(outputs[NUM_TOKENS]).reshape(())),
    )


def to_wire_result(outputs: Mapping[str, np.ndarray], wire: Wire) -> WireResult:
    """The output tensors of a one-image or one-chunk request -> :class:`WireResult` (a new array)."""
    return WireResult(
        pixels=np.array(outputs[wire.pixel_output][0]),
        grid_thw=np.array(outputs[GRID_THW], dtype=np.int64).reshape(3),
        num_tokens=int(np.asarray(outputs[NUM_TOKENS]).reshape(())),
        wire=wire,
    )


def to_images_result(outputs: Mapping[str, np.ndarray], preset: Preset | None = None) -> ImagesResult:
    """The output tensors of a K-image request -> :class:`~kimi_vision_prep.ImagesResult`."""
    return ImagesResult(
        pixel_values=_pixel_values(outputs, preset),
        grid_thws=np.array(outputs[GRID_THW], dtype=np.int64).reshape(-1, 3),
        num_tokens=np.array(outputs[NUM_TOKENS], dtype=NUM_TOKENS_DTYPE).reshape(-1),
    )
