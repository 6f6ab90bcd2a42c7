"""The second patch of vLLM: an encoded JPEG reaches our processor encoded, in a process that
serves a Kimi model (:class:`KimiProcessingState`): vLLM's loader and its parser hand it over opened
only, as vLLM's ``MediaWithBytes`` (:func:`defer_encoded_jpegs`; the plugin's docstring says which).
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from ..orientation import TurnedJpeg, exif_orientation
from ..pillow_open import unloaded_jpeg_bytes
from .checks import decode_charge

# Modes whose pixels vLLM's loader and the processor agree on without a conversion of their own.
DEFERRED_MODES = ("RGB", "L")


class KimiProcessingState:
    """Whether this process serves a Kimi model through the plugin (set when the first
    processor the setting names is built): only then are JPEGs handed over encoded."""

    defer_jpegs = False


def defer_encoded_jpegs() -> None:
    """Wrap vLLM's image loader and its parser of ``image`` / ``vision_chunk`` data so that a
    JPEG is handed over opened, not decoded (the plugin's docstring,
    :mod:`kimi_vision_common.vllm_plugin`, says which)."""
    from vllm.multimodal.media import MediaWithBytes
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser

    load_bytes = ImageMediaIO.load_bytes
    parse_images = MultiModalDataParser._parse_image_data
    parse_chunks = MultiModalDataParser._parse_vision_chunk_data

    def load_bytes_deferred(self: Any, data: bytes) -> Any:
        if KimiProcessingState.defer_jpegs and self.image_mode in ("RGB", None):
            image = opened_jpeg(io.BytesIO(data))
            if image is not None and within_pixel_limit(image):
                charge_decode_budget(self, image)
                return MediaWithBytes(as_loaded(image, data), data, io_config(image, self))
        return load_bytes(self, data)

    def wrapped(image: Any, transposed: bool) -> Any:
        """An opened JPEG as vLLM's loader hands it over (``transposed``: where vLLM's path applies
        its EXIF orientation); anything else as it is."""
        if not (KimiProcessingState.defer_jpegs and isinstance(image, Image.Image)):
            return image
        if isinstance(image, TurnedJpeg):  # the chat loader's, unwrapped by vLLM for a vision chunk
            return MediaWithBytes(image, image.data)
        if opened_jpeg(image) is None:
            return image
        data = unloaded_jpeg_bytes(image)
        if data is None:
            return image
        if transposed:
            return MediaWithBytes(as_loaded(image, data), data)
        # Its stored pixels, unturned: keyed apart from the same file through the loader, which turns them.
        unturned = exif_orientation(image) != 1
        return MediaWithBytes(image, data, {"exif_orientation": "not applied"} if unturned else None)

    def parse_images_deferred(self: Any, data: Any) -> Any:
        # vLLM's parser turns each PIL image to its EXIF orientation and to RGB
        if isinstance(data, list):
            return parse_images(self, [wrapped(item, transposed=True) for item in data])
        return parse_images(self, wrapped(data, transposed=True))

    def parse_chunks_deferred(self: Any, data: Any) -> Any:
        # a vision chunk's image reaches the processor as it is (no EXIF orientation applied)
        items = [data] if isinstance(data, dict) else data
        if isinstance(items, list):
            data = [
                {**item, "image": wrapped(item["image"], transposed=False)}
                if isinstance(item, dict) and item.get("type") == "image"
                else item
                for item in items
            ]
        return parse_chunks(self, data)

    ImageMediaIO.load_bytes = load_bytes_deferred
    MultiModalDataParser._parse_image_data = parse_images_deferred
    MultiModalDataParser._parse_vision_chunk_data = parse_chunks_deferred


def opened_jpeg(source: Any) -> Image.Image | None:
    """The JPEG ``source`` (a file object or an opened image), opened and not decoded, where its
    mode is one vLLM's loading and the processor agree on (RGB, L); None for anything else, or what
    Pillow cannot open (vLLM's loader gives its own verdict on that)."""
    try:
        image = source if isinstance(source, Image.Image) else Image.open(source, formats=["JPEG"])
    except Exception:  # Pillow raises what its parsers meet
        return None
    return image if image.format == "JPEG" and image.mode in DEFERRED_MODES else None


def as_loaded(image: Image.Image, data: bytes) -> Image.Image:
    """What vLLM's loader makes of the opened JPEG ``image`` of ``data``, still undecoded: the image
    itself, or a :class:`~kimi_vision_common.orientation.TurnedJpeg` where its EXIF orientation turns it."""
    orientation = exif_orientation(image)
    return image if orientation == 1 else TurnedJpeg(data, image, orientation)


def within_pixel_limit(image: Image.Image) -> bool:
    """vLLM's ``VLLM_MAX_IMAGE_PIXELS`` holds (a larger image takes vLLM's loader, which refuses it)."""
    from vllm import envs

    limit = envs.VLLM_MAX_IMAGE_PIXELS
    return limit <= 0 or image.width * image.height <= limit


def charge_decode_budget(media_io: Any, image: Image.Image) -> None:
    """Charge the request's decode budget where vLLM's loader has one (vLLM 0.33), as the loader
    charges an image it is about to decode (:func:`~.checks.decode_charge`; ValueError, vLLM's
    own, where the request goes over it)."""
    budget = getattr(media_io, "decoded_budget", None)
    if budget is not None:
        budget.charge(decode_charge(image))


def io_config(image: Image.Image, media_io: Any) -> dict[str, Any] | None:
    """The ``io_config`` vLLM's loader records for ``image`` (where it converts the mode), so that
    the processor cache's key is the one vLLM's own loading gives."""
    if media_io.image_mode in (None, image.mode):
        return None
    return {"image_mode": media_io.image_mode, "rgba_background_color": media_io.rgba_background_color}
