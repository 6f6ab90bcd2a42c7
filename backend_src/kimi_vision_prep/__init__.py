"""Bit-exact Kimi vision preprocessing: decode, NaViT resize, normalize and patchify."""
from __future__ import annotations

import os
import tempfile

# numba's on-disk cache must be writable (site-packages often is not, and Triton stubs run as
# another user); set before numba is first imported.
os.environ.setdefault(
    "NUMBA_CACHE_DIR",
    os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(tempfile.gettempdir()), "kimi_vision_prep_numba"),
)

from .decode import DecodedImage, DecodeLimits, ImageDecoder, default_decoder
from .errors import (
    CancelledError,
    DecoderBusyError,
    FallbackError,
    ImageTooLargeError,
    InvalidImageError,
    InvalidPresetError,
    InvalidRequestError,
    PreprocessError,
    UnsupportedImageError,
)
from .pipeline import (
    PixelOutput,
    PreprocessResult,
    concat_results,
    pixel_values_from_patches,
    preprocess_batch,
    preprocess_bytes,
    preprocess_decoded,
)
from .presets import KIMI_K3, KIMI_K25, PRESETS, Preset, get_preset, preset_from_parameters
from .sizing import TargetSize, navit_target_size

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
    "InvalidImageError",
    "InvalidPresetError",
    "InvalidRequestError",
    "PixelOutput",
    "PreprocessError",
    "PreprocessResult",
    "Preset",
    "TargetSize",
    "UnsupportedImageError",
    "concat_results",
    "default_decoder",
    "get_preset",
    "navit_target_size",
    "pixel_values_from_patches",
    "preprocess_batch",
    "preprocess_bytes",
    "preprocess_decoded",
    "preset_from_parameters",
]
