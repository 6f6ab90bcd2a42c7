"""Triton model-config parameters -> typed settings.

Triton hands a Python model its config as JSON (``args["model_config"]``); ``parameters`` entries
arrive as ``{"key": {"string_value": "..."}}``. Preset fields map onto :class:`~kimi_vision_prep.Preset`
through :func:`~kimi_vision_common.presets.preset_from_parameters`; every other key is a
:class:`~.settings.Setting` of :data:`~.settings.SETTINGS`, and the dataclasses here are typed
views of those a model kind reads (their defaults are the settings' defaults).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kimi_vision_prep.limits import DecodeLimits, GpuRoute, VideoLimits

from ..settings import default_of, setting

View = TypeVar("View")


def model_config_from_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The model config dict from the ``args`` Triton passes to ``initialize``."""
    raw = args["model_config"]
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters`` of a Triton model config as plain ``{key: string_value}``."""
    parameters = model_config.get("parameters") or {}
    return {key: str(value.get("string_value", "")) for key, value in parameters.items()}


@dataclass(frozen=True)
class DecoderSettings:
    """The decoder knobs a model that decodes images reads (their meanings, defaults and served
    values: :data:`~.settings.SETTINGS`, docs/serving.md's table)."""

    max_images_per_request: int = default_of("max_images_per_request")  # type: ignore[assignment]
    decoder_pool_size: int = default_of("decoder_pool_size")  # type: ignore[assignment]
    codec_threads: int = default_of("codec_threads")  # type: ignore[assignment]
    cpu_decode_threads: int = default_of("cpu_decode_threads")  # type: ignore[assignment]
    max_encoded_bytes: int = default_of("max_encoded_bytes")  # type: ignore[assignment]
    max_pixels: int = default_of("max_pixels")  # type: ignore[assignment]
    strict_decode: bool = default_of("strict_decode")  # type: ignore[assignment]
    gpu_route: GpuRoute = default_of("gpu_route")  # type: ignore[assignment]  # noqa: RUF009 - a str
    max_patches_per_request: int | None = default_of("max_patches_per_request")  # type: ignore[assignment]

    @property
    def limits(self) -> DecodeLimits:
        return DecodeLimits(max_pixels=self.max_pixels, max_encoded_bytes=self.max_encoded_bytes)


def read_view(view: type[View], parameters: Mapping[str, str], **given: Any) -> View:
    """The dataclass ``view`` with each field (but those ``given``) parsed by its setting."""
    names = [field.name for field in dataclasses.fields(view) if field.name not in given]  # type: ignore[arg-type]
    return view(**given, **{name: setting(name).parse(parameters) for name in names})


def decoder_settings(parameters: Mapping[str, str]) -> DecoderSettings:
    """Read :class:`DecoderSettings` from string parameters; absent keys keep their defaults."""
    return read_view(DecoderSettings, parameters)


@dataclass(frozen=True)
class VideoSettings:
    """Video knobs of a video model (config.pbtxt ``parameters``): the :class:`VideoLimits` fields
    (``max_video_bytes``, ``max_frame_pixels``, ``max_video_frames``, ``max_sampled_frames``) and
    ``ffmpeg_threads`` (FFmpeg's decoder threads; 0: its default)."""

    limits: VideoLimits = dataclasses.field(default_factory=VideoLimits)
    ffmpeg_threads: int = default_of("ffmpeg_threads")  # type: ignore[assignment]


def video_settings(parameters: Mapping[str, str]) -> VideoSettings:
    """Read :class:`VideoSettings` from string parameters; absent keys keep their defaults."""
    return read_view(VideoSettings, parameters, limits=read_view(VideoLimits, parameters))


def buffer_caps(parameters: Mapping[str, str]) -> dict[str, int]:
    """``scratch_cap_bytes`` / ``recycle_cap_bytes`` as :func:`~kimi_vision_prep.configure_buffers`
    keywords; an absent key is left out (the library's default stays)."""
    keys = ("scratch_cap_bytes", "recycle_cap_bytes")
    return {key: setting(key).parse(parameters) for key in keys if key in parameters}  # type: ignore[misc]


def numba_threads(parameters: Mapping[str, str]) -> int:
    """``numba_threads``: threads of the CPU patchify kernel in this instance (0: numba's default)."""
    return setting("numba_threads").parse(parameters)  # type: ignore[return-value]
