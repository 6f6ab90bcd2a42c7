"""What travels for one image or a video chunk's frames: its own encoded file, else a lossless file
of its pixels (:func:`encoded_losslessly`) that the server decodes to the same mode, pixels and
transparency.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from PIL import Image

from kimi_vision_common.errors import UnsupportedImageError
from kimi_vision_common.pillow_open import pillow_call
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.processor_api import chunk_of_images, media_bytes, unwrapped

# Modes a PNG holds exactly (pixels, palette, transparency); others travel as uncompressed TIFF.
PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I;16"})
# A chunk's frames are converted to RGB under every preset (the reference's convert("RGB")).
RGB_FRAMES = get_preset("kimi-k2.5")


def encoded_losslessly(image: Image.Image, preset: Preset) -> bytes:
    """A decoded image as a file the server decodes to the same mode, pixels and transparency
    (:func:`lossless_format`; TIFF uncompressed whatever compression the image was read with: TIFF
    would reuse a lossy one). A mode neither holds (HSV)
    travels converted to RGB where the preset converts every image to RGB first (K2.5), and is
    :class:`UnsupportedImageError` otherwise (K3 resizes in the source mode), as is a transparency
    key beside a mode PNG cannot hold."""
    if image.mode not in PNG_MODES and "transparency" in image.info:
        raise UnsupportedImageError(
            f"cannot send a decoded {image.mode} image with a transparency key to the server: send its file instead"
        )
    try:
        return saved(image, lossless_format(image))
    except (OSError, ValueError, KeyError) as exc:
        if preset.transparency == "convert_rgb":
            rgb = pillow_call(f"convert {image.mode} to RGB", image.convert, "RGB")
            # The preset keeps the RGB pixels alone: a transparency key goes, one PNG cannot hold
            # included (an int beside RGB, left by a loader's convert of a "1" or "L" image).
            rgb.info.pop("transparency", None)
            return saved(rgb, "PNG")
        raise UnsupportedImageError(
            f"cannot send a decoded {image.mode} image to the server ({exc}): send its encoded file instead"
        ) from None


def lossless_format(image: Image.Image) -> str:
    """PPM (no compression: the bytes as they are) for RGB and L without a transparency key, PNG
    for the other modes it holds, TIFF for the rest."""
    if image.mode in ("RGB", "L") and "transparency" not in image.info:
        return "PPM"
    return "PNG" if image.mode in PNG_MODES else "TIFF"


def saved(image: Image.Image, file_format: str) -> bytes:
    """``image`` as a lossless ``file_format`` file (PNG at its fastest level, TIFF uncompressed)."""
    out = io.BytesIO()
    options = {"PNG": {"compress_level": 1}, "TIFF": {"compression": "raw"}}.get(file_format, {})
    image.save(out, format=file_format, **options)
    return out.getvalue()


def encoded(source: Any, preset: Preset) -> bytes:
    """What travels for one image or frame: its own file, else a lossless file of its pixels."""
    data = media_bytes(source)
    return data if data is not None else encoded_losslessly(unwrapped(source), preset)


def chunk_frames(frames: Sequence[Any]) -> list[bytes]:
    """A video chunk's frames as files: all encoded, or all PIL images, by the rule every
    processor follows (:func:`~kimi_vision_common.processor_api.chunk_of_images`)."""
    frames = [unwrapped(frame) for frame in frames]
    chunk_of_images(frames)
    return [encoded(frame, RGB_FRAMES) for frame in frames]
