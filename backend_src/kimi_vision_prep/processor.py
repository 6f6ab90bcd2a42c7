"""``KimiVisionProcessor``: the checkpoint processor's interface over this library.

An engine that calls the checkpoint's vision processor (``preprocess(medias, return_tensors=...)``
and ``media_tokens_calculator(media)``) gets bit-equal ``pixel_values`` and ``grid_thws`` from
this class. Media items are the reference's dicts::

    {"type": "image", "image": <PIL image | encoded bytes | "data:image/...;base64,..." | path>}
    {"type": "video_chunk", "video_chunk": [<frame>, ...]}  # frames of the same kinds

Encoded bytes, ``data:`` URLs and paths take the library's decoders (libjpeg-turbo / simplejpeg /
nvImageCodec, exact); a PIL image is used as opened. Where transformers is installed the class is
a ``BaseImageProcessor`` returning a ``BatchFeature``; otherwise a plain class returning a dict
(torch tensors for ``return_tensors="pt"``, numpy otherwise). docs/library.md shows how an engine
swaps it in.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_common.errors import InvalidImageError, InvalidRequestError
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.sizing import navit_target_size

from .decode import DecodedImage, ImageDecoder
from .extras import require_torch
from .normalize import concatenate_patches
from .pillow_io import open_with_pillow, pillow_call, pillow_pixels
from .pipeline import PreprocessResult, preprocess_bytes, preprocess_decoded
from .tokens import count_tokens
from .video import chunk_target, chunk_tokens, preprocess_frames, preprocess_video_chunk

try:  # an optional extra: the processor is a transformers image processor where it is installed
    from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
except ImportError:
    BaseImageProcessor, BatchFeature = object, None

MEDIA_TYPES = ("image", "video_chunk")


def media_bytes(source: Any) -> bytes | None:
    """Encoded bytes of ``source``: bytes as given, a ``data:`` URL's payload, a path's content;
    None for a PIL image. Raises :class:`InvalidImageError` for anything else."""
    if isinstance(source, Image.Image):
        return None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise InvalidImageError("a data: URL must be base64 (data:<type>;base64,<payload>)")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise InvalidImageError(f"the data: URL's base64 payload is not valid: {exc}") from None
    if isinstance(source, (str, Path)):
        try:
            return Path(source).read_bytes()
        except OSError as exc:
            raise InvalidImageError(f"cannot read {source}: {exc.strerror}") from None
    raise InvalidImageError(f"expected a PIL image, encoded bytes, a data: URL or a path, got {type(source).__name__}")


def pil_decoded(image: Image.Image, preset: Preset) -> DecodedImage:
    """An opened PIL image as the decoders hand their pixels on (the preset's mode rule)."""
    pixels, resample = pillow_pixels(image, preset)
    return DecodedImage(pixels, image.width, image.height, resample, "pillow")


def rgb_frame(frame: Image.Image) -> np.ndarray:
    """uint8 ``(H, W, 3)``: a frame as the reference takes it (``convert("RGB")``)."""
    return np.asarray(pillow_call("convert a frame to RGB", frame.convert, "RGB"))


def media_item(media: Any) -> tuple[str, Any]:
    """``(type, payload)`` of one media dict; :class:`InvalidRequestError` for anything else."""
    if not isinstance(media, Mapping) or media.get("type") not in MEDIA_TYPES:
        raise InvalidRequestError(f"a media item is a dict with type {' or '.join(MEDIA_TYPES)}, got {media!r:.80}")
    kind = media["type"]
    if kind not in media:
        raise InvalidRequestError(f"a {kind} item needs its {kind!r} key")
    if kind == "video_chunk" and (isinstance(media[kind], (str, bytes)) or not isinstance(media[kind], Sequence)):
        raise InvalidRequestError("video_chunk is a list of frames")
    return kind, media[kind]


class KimiVisionProcessor(BaseImageProcessor):  # type: ignore[misc,valid-type]
    """The checkpoint's vision processor (K2.5 / K2.6 / K3 by ``preset``), bit-equal and faster.

    ``decoder``: the :class:`~.decode.ImageDecoder` for encoded inputs (default: the shared CPU
    one; ``ImageDecoder(device="cuda")`` decodes on a GPU and returns torch CUDA tensors).
    """

    model_input_names = ["pixel_values", "grid_thws"]  # noqa: RUF012 (transformers' class attribute)

    def __init__(self, preset: str | Preset = "kimi-k2.5", decoder: ImageDecoder | None = None, **kwargs: Any) -> None:
        if BaseImageProcessor is not object:
            super().__init__(**kwargs)
        self.preset = get_preset(preset)
        self.decoder = decoder

    def _image(self, source: Any) -> PreprocessResult:
        data = media_bytes(source)
        if data is None:
            return preprocess_decoded(pil_decoded(source, self.preset), self.preset)
        return preprocess_bytes(data, self.preset, decoder=self.decoder)

    def _video_chunk(self, frames: Sequence[Any]) -> PreprocessResult:
        encoded = [media_bytes(frame) for frame in frames]
        if all(data is not None for data in encoded):
            return preprocess_video_chunk(encoded, self.preset, decoder=self.decoder)  # type: ignore[arg-type]
        if any(data is not None for data in encoded):
            raise InvalidRequestError("a video_chunk's frames are all PIL images or all encoded")
        return preprocess_frames([rgb_frame(frame) for frame in frames], self.preset)

    def preprocess(self, medias: Mapping[str, Any] | Sequence[Mapping[str, Any]], return_tensors: Any = None) -> Any:
        """``pixel_values`` float32 ``(ΣN, 3, p, p)`` and ``grid_thws`` int64 ``(n, 3)`` of the
        media in order (the reference's concatenation; ``[]``: an empty result). Like the
        reference, one call has one verdict: the first bad item raises its typed error."""
        check_tensor_type(return_tensors)
        items = [medias] if isinstance(medias, Mapping) else list(medias)
        results = []
        for item in items:
            kind, payload = media_item(item)
            results.append(self._image(payload) if kind == "image" else self._video_chunk(payload))
        data = {}
        if results:
            data["pixel_values"] = concatenate_patches([r.pixel_values for r in results])
            data["grid_thws"] = np.stack([np.asarray(r.grid_thw, dtype=np.int64) for r in results])
        return _batch(data, return_tensors)

    def media_tokens_calculator(self, media: Mapping[str, Any]) -> int:
        """The tokens ``media`` takes in the prompt, from its size only (headers for encoded input)."""
        kind, payload = media_item(media)
        if kind == "image":
            data = media_bytes(payload)
            if data is not None:
                return count_tokens(data, self.preset).num_tokens
            return navit_target_size(payload.width, payload.height, self.preset).num_tokens
        if not payload:
            raise InvalidRequestError("a video_chunk needs at least one frame")
        first = media_bytes(payload[0])
        if first is None:
            width, height = payload[0].size
        else:
            with open_with_pillow(first) as image:
                width, height = image.size
        return chunk_tokens(chunk_target(width, height, len(payload), self.preset), self.preset)


def check_tensor_type(return_tensors: Any) -> None:
    """Refuse, before any work, a ``return_tensors`` this install cannot honour: anything but
    None/"np"/"pt", and "pt" without torch (named with the extra that brings it)."""
    kind = None if return_tensors is None else str(getattr(return_tensors, "value", return_tensors))
    if kind not in (None, "np", "pt"):
        raise ValueError(f"return_tensors must be None, 'np' or 'pt', got {return_tensors!r}")
    if kind == "pt":
        require_torch("return_tensors='pt' (return_tensors='np' gives numpy arrays)")


def _batch(data: dict[str, Any], return_tensors: Any) -> Any:
    """``data`` as the reference returns it: a ``BatchFeature`` where transformers is installed,
    else a dict; torch tensors for ``"pt"``, numpy for None or ``"np"`` (checked by
    :func:`check_tensor_type` first)."""
    if BatchFeature is not None:
        return BatchFeature(data=data, tensor_type=return_tensors)
    if return_tensors in (None, "np"):
        return data
    import torch

    return {key: torch.as_tensor(value) for key, value in data.items()}
