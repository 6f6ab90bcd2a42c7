"""The public pipeline: bytes -> decoded pixels -> resized -> ``pixel_values``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .composite import composite_on_chessboard, composite_on_chessboard_torch
from .decode import DecodedImage, ImageDecoder, default_decoder
from .errors import PreprocessError
from .normalize import normalize_table, write_patches_numpy, write_patches_torch
from .presets import Preset, get_preset
from .resize import resize
from .sizing import TargetSize, navit_target_size


@dataclass
class PreprocessResult:
    """One image's processor output.

    ``pixel_values``: float32 ``(N, 3, p, p)`` with ``N = grid_h * grid_w`` (numpy on the CPU path,
    a torch tensor on CUDA). ``grid_thw``: int64 ``(3,)`` = ``(1, grid_h, grid_w)``.
    """

    pixel_values: Any
    grid_thw: np.ndarray
    num_tokens: int
    decode_path: str
    fallback_reason: str | None
    target: TargetSize

    @property
    def width(self) -> int:
        return self.target.width

    @property
    def height(self) -> int:
        return self.target.height


def resize_to_target(decoded: DecodedImage, target: TargetSize, preset: Preset) -> Any:
    """Resized RGB uint8 ``(new_h, new_w, 3)``, alpha composited for chessboard presets."""
    pixels = resize(decoded.pixels, target.new_width, target.new_height, decoded.resample)
    if tuple(pixels.shape[:2]) != (target.new_height, target.new_width):
        raise AssertionError(f"resize produced {tuple(pixels.shape)}, expected {target.new_height}x{target.new_width}")
    if pixels.shape[2] == 4:
        if isinstance(pixels, np.ndarray):
            return composite_on_chessboard(pixels, preset)
        return composite_on_chessboard_torch(pixels, preset)
    return pixels


def preprocess_decoded(decoded: DecodedImage, preset: str | Preset = "kimi-k2.5") -> PreprocessResult:
    """Resize, pad, normalise and patchify one decoded image (numpy -> numba, torch -> torch)."""
    preset = get_preset(preset)
    target = navit_target_size(decoded.width, decoded.height, preset)
    rgb = resize_to_target(decoded, target, preset)
    table = normalize_table(preset.image_mean, preset.image_std)
    write = write_patches_numpy if isinstance(rgb, np.ndarray) else write_patches_torch
    pixel_values = write(rgb, table, target.grid_h, target.grid_w, preset.patch_size)
    return PreprocessResult(
        pixel_values=pixel_values,
        grid_thw=np.asarray(target.grid_thw, dtype=np.int64),
        num_tokens=target.num_tokens,
        decode_path=decoded.decode_path,
        fallback_reason=decoded.fallback_reason,
        target=target,
    )


def preprocess_bytes(
    data: bytes, preset: str | Preset = "kimi-k2.5", *, decoder: ImageDecoder | None = None
) -> PreprocessResult:
    """Encoded image bytes -> :class:`PreprocessResult`; raises a typed :class:`PreprocessError`."""
    preset = get_preset(preset)
    decoded = (decoder or default_decoder()).decode(data, preset)
    return preprocess_decoded(decoded, preset)


def preprocess_batch(
    items: Sequence[bytes], preset: str | Preset = "kimi-k2.5", *, decoder: ImageDecoder | None = None
) -> list[PreprocessResult | PreprocessError]:
    """Many images, decoded in one batch; one result or one typed error per item, in order."""
    preset = get_preset(preset)
    results: list[PreprocessResult | PreprocessError] = []
    for decoded in (decoder or default_decoder()).decode_batch(items, preset):
        if isinstance(decoded, PreprocessError):
            results.append(decoded)
            continue
        try:
            results.append(preprocess_decoded(decoded, preset))
        except PreprocessError as exc:
            results.append(exc)
    return results


def concat_results(results: Sequence[PreprocessResult]) -> tuple[np.ndarray, np.ndarray]:
    """Several images as the processor returns them: ``pixel_values (ΣN, 3, p, p)``, ``grid_thws (n, 3)``."""
    pixel_values = np.concatenate([np.asarray(r.pixel_values) for r in results], axis=0)
    grid_thws = np.stack([r.grid_thw for r in results]).astype(np.int64)
    return pixel_values, grid_thws
