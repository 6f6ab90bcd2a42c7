"""The NaViT size rule (spec section 3): original size -> resized size, padding and patch grid."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .presets import Preset


@dataclass(frozen=True)
class TargetSize:
    """Where an image of ``width x height`` goes under a preset.

    ``new_width x new_height`` is the resize target; ``pad_width``/``pad_height`` zero pixels are
    added on the right/bottom; the patch grid is ``grid_h x grid_w`` (``grid_thw = (1, h, w)``).
    """

    width: int
    height: int
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    grid_h: int
    grid_w: int
    num_tokens: int

    @property
    def padded_width(self) -> int:
        return self.new_width + self.pad_width

    @property
    def padded_height(self) -> int:
        return self.new_height + self.pad_height

    @property
    def num_patches(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return (1, self.grid_h, self.grid_w)

    @property
    def needs_resize(self) -> bool:
        return (self.new_width, self.new_height) != (self.width, self.height)


def navit_patch_bound(preset: Preset) -> int:
    """The most patches one image gets under the NaViT rule, padding included: ``2 * in_patch_limit``.

    The rule budgets ``in_patch_limit`` for ``(W // p) * (H // p)``, and the floors let the resized
    area per budgeted patch grow (``W / (W // p) < 2p`` at worst, for sides under ``2p``, which
    then stay small), padding adds under a merge block a side; a sweep of sizes measures ~1.08x
    at most (tests/test_patchify_backend.py). A step that takes images at their NaViT size and
    does not resize (the C patchify step) refuses an image beyond this.
    """
    return 2 * preset.in_patch_limit


def navit_target_size(width: int, height: int, preset: Preset, in_patch_limit: int | None = None) -> TargetSize:
    """Apply the reference size rule; float64 arithmetic and truncation exactly as the spec.
    ``in_patch_limit`` replaces the preset's (a video frame's budget, spec section 8)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    p = preset.patch_size
    side_limit_px = preset.patch_limit_on_one_side * p
    limit = preset.in_patch_limit if in_patch_limit is None else in_patch_limit
    s1 = math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p)))
    s2 = side_limit_px / width
    s3 = side_limit_px / height
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), side_limit_px)
    new_h = min(max(1, int(height * scale)), side_limit_px)
    f = preset.factor
    pad_w = (f - new_w % f) % f
    pad_h = (f - new_h % f) % f
    grid_h = (new_h + pad_h) // p
    grid_w = (new_w + pad_w) // p
    # The reference asserts this; validate_preset makes it unreachable, keep it loud regardless.
    assert grid_h <= preset.patch_limit_on_one_side and grid_w <= preset.patch_limit_on_one_side
    num_tokens = ((new_h + pad_h) // f) * ((new_w + pad_w) // f)
    return TargetSize(width, height, new_w, new_h, pad_w, pad_h, grid_h, grid_w, num_tokens)


def chunk_target(width: int, height: int, frames: int, preset: Preset) -> TargetSize:
    """The NaViT target of a ``frames``-frame chunk whose first frame is ``width x height``."""
    limit = preset.in_patch_limit if preset.in_patch_limit_each_frame is None else preset.in_patch_limit_each_frame
    if preset.in_patch_limit_video is not None:
        limit = min(round(preset.in_patch_limit_video / frames), limit)
    return navit_target_size(width, height, preset, in_patch_limit=limit)


def chunk_tokens(target: TargetSize, preset: Preset) -> int:
    """Tokens of a chunk: ``(gh / m) * (gw / m)`` whatever T, or ``fixed_output_tokens``."""
    return target.num_tokens if preset.fixed_output_tokens is None else preset.fixed_output_tokens
