"""Triton model-config parameters -> typed settings.

Triton hands a Python model its config as JSON (``args["model_config"]``); ``parameters`` entries
arrive as ``{"key": {"string_value": "..."}}``. Preset fields map onto :class:`~kimi_vision_prep.Preset`
through :func:`~kimi_vision_common.presets.preset_from_parameters` (the one mapping); the decoder and
runtime knobs below are the only other keys.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kimi_vision_common.errors import InvalidPresetError
from kimi_vision_common.wire import DEFAULT_MAX_IMAGES_PER_REQUEST

from ..limits import (
    DEFAULT_DECODER_POOL_SIZE,
    DEFAULT_MAX_ENCODED_BYTES,
    PILLOW_MAX_PIXELS,
    DecodeLimits,
    VideoLimits,
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def model_config_from_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The model config dict from the ``args`` Triton passes to ``initialize``."""
    raw = args["model_config"]
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters`` of a Triton model config as plain ``{key: string_value}``."""
    parameters = model_config.get("parameters") or {}
    return {key: str(value.get("string_value", "")) for key, value in parameters.items()}


def parse_bool(key: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidPresetError(f"parameter {key}={raw!r} is not a boolean (yes/no, true/false, 1/0)")


def parse_int(key: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise InvalidPresetError(f"parameter {key}={raw!r} is not an integer") from None
    if value < minimum:
        raise InvalidPresetError(f"parameter {key}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class DecoderSettings:
    """Decoder knobs of a decode model (config.pbtxt ``parameters``).

    Every default is the library's (:class:`~kimi_vision_prep.ImageDecoder`,
    :class:`~kimi_vision_prep.DecodeLimits`); what a rendered model sets instead is
    :class:`~.render_blocks.ServingDefaults`' (docs/serving.md has the table).

    ``decoder_pool_size``: nvImageCodec decoders per model instance (process);
    ``codec_threads``: nvImageCodec's CPU threads per decoder; ``cpu_decode_threads``: the threads
    of one CPU decode call, the JPEGs of a batch that many at once, a lone one in row bands (0: all
    cores, both);
    ``strict_decode``: a failed fast decode is an error instead of a counted Pillow fallback;
    ``max_images_per_request``: K of ``IMAGE_BYTES [1, K]`` (more: ImageTooLargeError);
    ``max_patches_per_request``: the NaViT patches of one request's images, counted from their
    headers before any pixel is decoded (more: ImageTooLargeError; None: no limit).
    """

    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    decoder_pool_size: int = DEFAULT_DECODER_POOL_SIZE
    codec_threads: int = 0
    cpu_decode_threads: int = 0
    max_encoded_bytes: int = DEFAULT_MAX_ENCODED_BYTES
    max_pixels: int = PILLOW_MAX_PIXELS
    strict_decode: bool = False
    max_patches_per_request: int | None = None

    @property
    def limits(self) -> DecodeLimits:
        return DecodeLimits(max_pixels=self.max_pixels, max_encoded_bytes=self.max_encoded_bytes)


def decoder_settings(parameters: Mapping[str, str]) -> DecoderSettings:
    """Read :class:`DecoderSettings` from string parameters; absent keys keep their defaults."""
    defaults = DecoderSettings()
    get = parameters.get
    return DecoderSettings(
        max_images_per_request=parse_int(
            "max_images_per_request", get("max_images_per_request", str(defaults.max_images_per_request)), 1
        ),
        decoder_pool_size=parse_int("decoder_pool_size", get("decoder_pool_size", str(defaults.decoder_pool_size)), 1),
        codec_threads=parse_int("codec_threads", get("codec_threads", str(defaults.codec_threads)), 0),
        cpu_decode_threads=parse_int(
            "cpu_decode_threads", get("cpu_decode_threads", str(defaults.cpu_decode_threads)), 0
        ),
        max_encoded_bytes=parse_int("max_encoded_bytes", get("max_encoded_bytes", str(defaults.max_encoded_bytes)), 1),
        max_pixels=parse_int("max_pixels", get("max_pixels", str(defaults.max_pixels)), 1),
        strict_decode=parse_bool("strict_decode", get("strict_decode", "no")),
        max_patches_per_request=max_patches_per_request(parameters),
    )


def max_patches_per_request(parameters: Mapping[str, str]) -> int | None:
    """``max_patches_per_request``: one request's patch budget (absent: None, no limit)."""
    raw = parameters.get("max_patches_per_request")
    return None if raw is None else parse_int("max_patches_per_request", raw, 1)


@dataclass(frozen=True)
class VideoSettings:
    """Video knobs of a video model (config.pbtxt ``parameters``): the :class:`VideoLimits` fields
    (``max_video_bytes``, ``max_frame_pixels``, ``max_video_frames``, ``max_sampled_frames``) and
    ``ffmpeg_threads`` (FFmpeg's decoder threads; 0: its default)."""

    limits: VideoLimits = dataclasses.field(default_factory=VideoLimits)
    ffmpeg_threads: int = 0


def video_settings(parameters: Mapping[str, str]) -> VideoSettings:
    """Read :class:`VideoSettings` from string parameters; absent keys keep their defaults."""
    defaults = VideoLimits()
    values = {
        field.name: parse_int(field.name, parameters.get(field.name, str(getattr(defaults, field.name))), 1)
        for field in dataclasses.fields(VideoLimits)
    }
    threads = parse_int("ffmpeg_threads", parameters.get("ffmpeg_threads", "0"), 0)
    return VideoSettings(VideoLimits(**values), threads)


def buffer_caps(parameters: Mapping[str, str]) -> dict[str, int]:
    """``scratch_cap_bytes`` / ``recycle_cap_bytes`` as :func:`~kimi_vision_prep.configure_buffers`
    keywords; an absent key is left out (the library's default stays)."""
    keys = ("scratch_cap_bytes", "recycle_cap_bytes")
    return {key: parse_int(key, parameters[key], 0) for key in keys if key in parameters}


def numba_threads(parameters: Mapping[str, str]) -> int:
    """``numba_threads``: threads of the CPU patchify kernel in this instance (0: numba's default)."""
    return parse_int("numba_threads", parameters.get("numba_threads", "0"), 0)
