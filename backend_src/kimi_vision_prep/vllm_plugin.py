"""vLLM plugin: vLLM's Kimi-K2.5 / K2.6 / K3 image processing answered by :class:`KimiVisionProcessor`.

Installed with the library as the ``vllm.general_plugins`` entry point ``kimi_vision_prep``, which
vLLM loads in each of its processes (API server, engine core, workers; ``VLLM_PLUGINS`` filters
them). :func:`register` does two things, both only where vLLM's Kimi files are where this module
knows them (vLLM 0.32; elsewhere one warning and vLLM's own processing, never a crash):

1. **The processor.** vLLM's Kimi models build their image processor with
   ``cached_get_image_processor(..., processor_cls_overrides=KimiK25FusedVisionProcessor)``; that
   name is bound to :class:`VllmKimiProcessor` in the module that defines it and in the Kimi model
   modules already imported. Other models never see it.
2. **Encoded JPEGs reach it encoded.** Once such a processor has been built in a process (that
   process serves a Kimi model), a JPEG that would be handed over decoded is handed over opened
   only, as vLLM's ``MediaWithBytes`` (the image Pillow opened, the file's bytes): in the chat
   path (``ImageMediaIO.load_bytes``: bytes, ``data:`` URLs, files), and for an opened PIL image in
   a request's ``multi_modal_data`` (the parser), so that neither the loader, the parser nor the
   processor cache's hasher (which keys a ``MediaWithBytes`` by its bytes) decodes it first. Only a
   JPEG whose pixels vLLM's own path would not change is deferred: mode RGB or L (vLLM converts L
   to RGB, as the processor does) and no EXIF rotation to apply; any other image takes vLLM's path
   unchanged, and the processor uses the pixels vLLM loaded.

``KIMI_PREP_VLLM``: ``local`` (default) processes in the vLLM process; ``off`` leaves vLLM as it
is. It is the one setting the plugin reads.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from PIL import ExifTags, Image

from kimi_vision_common.errors import PreprocessError

from .pillow_io import unloaded_jpeg_bytes
from .processor import HUB_OPTIONS, KimiVisionProcessor, config_path

log = logging.getLogger("kimi_vision_prep.vllm")

SETTING = "KIMI_PREP_VLLM"
MODES = ("local", "off")
# Where vLLM 0.32 defines and imports the class its Kimi models build their processor from.
PROCESSOR_MODULE = "vllm.transformers_utils.processors.kimi_k25_vision_fused"
PROCESSOR_NAME = "KimiK25FusedVisionProcessor"
PROCESSOR_USERS = ("vllm.model_executor.models.kimi_k25", "vllm.models.kimi_k3.common.mm_preprocess")
# A checkpoint's model_type -> the preset its processor follows.
MODEL_PRESETS = {"kimi_k25": "kimi-k2.5", "kimi_k3": "kimi-k3"}
# Modes whose pixels vLLM's loader and the processor agree on without a conversion of their own.
DEFERRED_MODES = ("RGB", "L")


class KimiProcessingState:
    """Whether this process serves a Kimi model through the plugin (set when the first
    :class:`VllmKimiProcessor` is built): only then are JPEGs handed over encoded."""

    defer_jpegs = False


class VllmKimiProcessor(KimiVisionProcessor):
    """:class:`KimiVisionProcessor` as vLLM builds and calls it: ``from_pretrained(model,
    revision=..., trust_remote_code=...)`` with the preset of the checkpoint's ``model_type``, and
    a bad image raised as the ``ValueError`` vLLM answers with HTTP 400 (the library's typed error
    chained as its cause, its class named in the message)."""

    @classmethod
    def from_pretrained(cls, name: str | Path, **kwargs: Any) -> KimiVisionProcessor:
        hub = {key: kwargs[key] for key in (*HUB_OPTIONS, "revision") if key in kwargs}
        kwargs.setdefault("preset", model_preset(name, hub))
        processor = super().from_pretrained(name, **kwargs)
        KimiProcessingState.defer_jpegs = True
        return processor

    def preprocess(self, medias: Any, *args: Any, **kwargs: Any) -> Any:
        return as_value_error(super().preprocess, medias, *args, **kwargs)

    def media_tokens_calculator(self, media: Mapping[str, Any]) -> int:
        return as_value_error(super().media_tokens_calculator, media)

    def get_resize_config(self, media: Mapping[str, Any]) -> dict[str, int]:
        return as_value_error(super().get_resize_config, media)


def as_value_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, a :class:`PreprocessError` raised as ``ValueError`` (vLLM's bad input)."""
    try:
        return call(*args, **kwargs)
    except PreprocessError as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc


def model_preset(name: str | Path, hub: Mapping[str, Any]) -> str | None:
    """The preset of the checkpoint ``name`` by its ``config.json``'s ``model_type`` (None where it
    names none we know or cannot be read: the processor config decides then)."""
    try:
        path = config_path(name, hub.get("revision"), {k: v for k, v in hub.items() if k != "revision"})
        config = json.loads((path.parent / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return MODEL_PRESETS.get(str(config.get("model_type")))


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (every vLLM process calls it once)."""
    mode = os.environ.get(SETTING, "local")
    if mode not in MODES:
        log.warning("kimi-vision-prep: %s=%r is not one of %s; vLLM's own Kimi processor is used", SETTING, mode, MODES)
        return
    if mode == "off":
        return
    try:
        replace_processor(VllmKimiProcessor)
        defer_encoded_jpegs()
    except (ImportError, AttributeError) as exc:
        log.warning(
            "kimi-vision-prep: this vLLM's Kimi files are not where the plugin knows them (%s: %s); "
            "vLLM's own Kimi processor is used",
            type(exc).__name__,
            exc,
        )


def replace_processor(processor_class: type) -> None:
    """Bind vLLM's Kimi processor class name to ``processor_class`` where it is defined and in the
    Kimi model modules already imported (the others import it from there when they load)."""
    module = importlib.import_module(PROCESSOR_MODULE)
    getattr(module, PROCESSOR_NAME)  # AttributeError where this vLLM moved it
    for name in (PROCESSOR_MODULE, *PROCESSOR_USERS):
        if name in sys.modules:
            setattr(sys.modules[name], PROCESSOR_NAME, processor_class)


def defer_encoded_jpegs() -> None:
    """Wrap vLLM's image loader and its parser of ``image`` / ``vision_chunk`` data so that a
    JPEG is handed over opened, not decoded (the module docstring says which)."""
    from vllm.multimodal.media import MediaWithBytes
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser

    load_bytes = ImageMediaIO.load_bytes
    parse_images = MultiModalDataParser._parse_image_data
    parse_chunks = MultiModalDataParser._parse_vision_chunk_data

    def load_bytes_deferred(self: Any, data: bytes) -> Any:
        if KimiProcessingState.defer_jpegs and self.image_mode in ("RGB", None):
            image = deferrable_jpeg(io.BytesIO(data), transposed=True)
            if image is not None and within_pixel_limit(image):
                return MediaWithBytes(image, data, io_config(image, self))
        return load_bytes(self, data)

    def wrapped(image: Any, transposed: bool) -> Any:
        """An opened JPEG as the loader hands it over (``transposed``: where vLLM's path applies
        its EXIF orientation); anything else as it is."""
        if not (KimiProcessingState.defer_jpegs and isinstance(image, Image.Image)):
            return image
        data = unloaded_jpeg_bytes(image)
        if data is None or (transposed and deferrable_jpeg(image, transposed) is None):
            return image
        return MediaWithBytes(image, data)

    def parse_images_deferred(self: Any, data: Any) -> Any:
        # vLLM's parser turns each PIL image to its EXIF orientation and to RGB
        items = [wrapped(item, transposed=True) for item in data] if isinstance(data, list) else data
        return parse_images(self, wrapped(items, transposed=True))

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


def deferrable_jpeg(source: Any, transposed: bool) -> Image.Image | None:
    """The JPEG ``source`` (a file object or an opened image), opened and not decoded, when
    vLLM's loading would keep its pixels as decoded (mode RGB or L and, where vLLM applies the EXIF
    orientation, ``transposed``, none to apply); None for anything else, or what Pillow cannot open."""
    try:
        image = source if isinstance(source, Image.Image) else Image.open(source, formats=["JPEG"])
        if image.format != "JPEG" or image.mode not in DEFERRED_MODES:
            return None
        if transposed and image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            return None
    except Exception:  # vLLM's loader gives its own verdict on what Pillow cannot open
        return None
    return image


def within_pixel_limit(image: Image.Image) -> bool:
    """vLLM's ``VLLM_MAX_IMAGE_PIXELS`` holds (a larger image takes vLLM's loader, which refuses it)."""
    from vllm import envs

    limit = envs.VLLM_MAX_IMAGE_PIXELS
    return limit <= 0 or image.width * image.height <= limit


def io_config(image: Image.Image, media_io: Any) -> dict[str, Any] | None:
    """The ``io_config`` vLLM's loader records for ``image`` (where it converts the mode), so that
    the processor cache's key is the one vLLM's own loading gives."""
    if media_io.image_mode in (None, image.mode):
        return None
    return {"image_mode": media_io.image_mode, "rgba_background_color": media_io.rgba_background_color}
