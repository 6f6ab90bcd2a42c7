"""Bit-exact Kimi vision preprocessing: decode, NaViT resize, normalize and patchify.

Importing the package reads and writes no process settings (environment, malloc, threads): every
knob is a function argument or a settings object with a documented default.
"""

from __future__ import annotations

from .buffers import buffer_stats, configure_buffers
from .decode import DecodedImage, DecodeLimits, ImageDecoder, default_decoder
from .errors import (
    CancelledError,
    DecoderBusyError,
    FallbackError,
    ImageTooLargeError,
    InvalidImageError,
    InvalidPresetError,
    InvalidRequestError,
    InvalidVideoError,
    PreprocessError,
    ServerUnavailableError,
    UnsupportedImageError,
    VideoTooLargeError,
)
from .numba_runtime import set_num_threads
from .pipeline import (
    ImagesResult,
    PixelOutput,
    PreprocessResult,
    concat_results,
    pixel_values_from_patches,
    preprocess_batch,
    preprocess_bytes,
    preprocess_decoded,
    preprocess_images,
    resized_decoded,
)
from .presets import KIMI_K3, KIMI_K25, PRESETS, Preset, get_preset, preset_from_parameters
from .sizing import TargetSize, navit_target_size
from .tokens import TokenCount, count_tokens
from .video import (
    VideoChunkResult,
    VideoLimits,
    looks_like_video,
    preprocess_frames,
    preprocess_video,
    preprocess_video_chunk,
)

__all__ = [
    "KIMI_K3",
    "KIMI_K25",
    "PRESETS",
    "CancelledError",
    "DecodeLimits",
    "DecodedImage",
    "DecoderBusyError",
    "FallbackError",
    "ImageDecoder",
    "ImageTooLargeError",
    "ImagesResult",
    "InvalidImageError",
    "InvalidPresetError",
    "InvalidRequestError",
    "InvalidVideoError",
    "PixelOutput",
    "PreprocessError",
    "PreprocessResult",
    "Preset",
    "ServerUnavailableError",
    "TargetSize",
    "TokenCount",
    "UnsupportedImageError",
    "VideoChunkResult",
    "VideoLimits",
    "VideoTooLargeError",
    "buffer_stats",
    "concat_results",
    "configure_buffers",
    "count_tokens",
    "default_decoder",
    "get_preset",
    "looks_like_video",
    "navit_target_size",
    "pixel_values_from_patches",
    "preprocess_batch",
    "preprocess_bytes",
    "preprocess_decoded",
    "preprocess_frames",
    "preprocess_images",
    "preprocess_video",
    "preprocess_video_chunk",
    "preset_from_parameters",
    "resized_decoded",
    "set_num_threads",
]
