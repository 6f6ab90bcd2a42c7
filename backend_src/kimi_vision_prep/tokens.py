"""Token counts from the header alone (spec section 9): what a scheduler needs before any pixel.

:func:`count_tokens` parses the image header with Pillow (``Image.open``: no pixel is decoded),
applies the NaViT rule and renders the preset's prompt, in microseconds. It validates the header,
not the pixels: an image whose header parses but whose data is corrupt still gets a count (and
fails later, in preprocessing). For every image that preprocesses, the grid and the token count
equal full preprocessing's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kimi_vision_common.errors import ImageTooLargeError, InvalidImageError, InvalidRequestError, PreprocessError
from kimi_vision_common.messages import PATCHES_OVER_BUDGET, TOO_MANY_IMAGES
from kimi_vision_common.pillow_open import open_with_pillow
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.results import TokenCount
from kimi_vision_common.sizing import navit_target_size

from .limits import DecodeLimits


def image_prompt(width: int, height: int, preset: Preset) -> str:
    """The preset's image placeholder (K3's names the stored size; ``<|media_pad|>`` stands for
    ``num_tokens`` tokens the serving engine expands)."""
    return preset.image_prompt.format(width=width, height=height)


def count_tokens(data: bytes, preset: str | Preset = "kimi-k2.5", *, limits: DecodeLimits | None = None) -> TokenCount:
    """Encoded image -> :class:`TokenCount` from its header; raises what the header check raises
    (:class:`InvalidImageError`, :class:`ImageTooLargeError` over ``limits``, default
    :class:`DecodeLimits`)."""
    preset = get_preset(preset)
    limits = limits or DecodeLimits()
    if not isinstance(data, (bytes, bytearray, memoryview)) or not data:
        raise InvalidImageError("expected encoded image bytes, got none")
    if len(data) > limits.max_encoded_bytes:
        raise ImageTooLargeError(
            f"encoded image of {len(data)} bytes exceeds max_encoded_bytes={limits.max_encoded_bytes}"
        )
    with open_with_pillow(bytes(data), limits.max_pixels) as image:
        width, height = image.size
    target = navit_target_size(width, height, preset)
    grid_thw = np.asarray(target.grid_thw, dtype=np.int64)
    return TokenCount(grid_thw, target.num_tokens, image_prompt(width, height, preset))


def check_image_count(count: int, max_images_per_request: int) -> None:
    """InvalidRequestError when one request holds more than ``max_images_per_request`` images (a
    count, not a size)."""
    if count > max_images_per_request:
        raise InvalidRequestError(TOO_MANY_IMAGES % (count, max_images_per_request))


def check_patch_total(patches: int, max_patches_per_request: int | None) -> None:
    """ImageTooLargeError when one request's ``patches`` exceed ``max_patches_per_request`` (None: no limit)."""
    if max_patches_per_request is not None and patches > max_patches_per_request:
        raise ImageTooLargeError(PATCHES_OVER_BUDGET % (patches, max_patches_per_request))


def check_patch_budget(
    images: Sequence[bytes],
    preset: str | Preset,
    max_patches_per_request: int | None,
    *,
    limits: DecodeLimits | None = None,
) -> None:
    """The per-request budget, from the images' headers alone (before any pixel is decoded): the
    NaViT patches of every image whose header parses, summed, against ``max_patches_per_request``
    (None: no limit). An image whose header does not parse is left to the decoder's verdict."""
    if max_patches_per_request is None:
        return
    preset = get_preset(preset)
    total = 0
    for data in images:
        try:
            grid = count_tokens(data, preset, limits=limits).grid_thw
        except PreprocessError:
            continue
        total += int(grid[1] * grid[2])
    check_patch_total(total, max_patches_per_request)
