"""Bit-exact Kimi vision preprocessing: decode, NaViT resize, normalize and patchify.

Importing the package is cheap and reads and writes no process settings (environment, malloc,
threads): each public name below loads its module on first use (numba kernels, PyAV and
nvImageCodec load only when an op needs them), and every knob is a function argument or a
settings object with a documented default.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it (``kimi_vision_common`` holds what the client shares).
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "CancelledError",
            "DecoderBusyError",
            "FallbackError",
            "ImageTooLargeError",
            "InvalidImageError",
            "InvalidPresetError",
            "InvalidRequestError",
            "InvalidVideoError",
            "PreprocessError",
            "ServerUnavailableError",
            "UnsupportedImageError",
            "VideoTooLargeError",
        ),
        "kimi_vision_common.errors",
    ),
    **dict.fromkeys(
        ("KIMI_K3", "KIMI_K25", "PRESETS", "Preset", "get_preset", "preset_from_parameters"),
        "kimi_vision_common.presets",
    ),
    **dict.fromkeys(("TargetSize", "navit_target_size"), "kimi_vision_common.sizing"),
    **dict.fromkeys(("ImagesResult", "TokenCount", "VideoChunkResult", "concat_results"), "kimi_vision_common.results"),
    **dict.fromkeys(("buffer_stats", "configure_buffers"), "kimi_vision_prep.buffers"),
    **dict.fromkeys(("DecodeLimits", "VideoLimits"), "kimi_vision_prep.limits"),
    "DecodedImage": "kimi_vision_prep.decode.routes",
    **dict.fromkeys(("ImageDecoder", "default_decoder"), "kimi_vision_prep.decode.decoder"),
    "set_num_threads": "kimi_vision_prep.numba_runtime",
    **dict.fromkeys(
        (
            "PixelOutput",
            "PreprocessResult",
            "pixel_values_from_patches",
            "preprocess_batch",
            "preprocess_bytes",
            "preprocess_decoded",
            "preprocess_images",
            "resized_decoded",
        ),
        "kimi_vision_prep.pipeline",
    ),
    "looks_like_video": "kimi_vision_common.media",
    "KimiVisionProcessor": "kimi_vision_prep.processor",
    "count_tokens": "kimi_vision_prep.tokens",
    **dict.fromkeys(
        (
            "preprocess_frames",
            "preprocess_video",
            "preprocess_video_chunk",
        ),
        "kimi_vision_prep.video_pipeline",
    ),
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (derived from the one table above)


def __getattr__(name: str) -> Any:
    """Load the module that defines ``name`` on first use (PEP 562) and keep the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
