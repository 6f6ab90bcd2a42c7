"""The library's input limits and its decoder's defaults, each defined here once.

A served model reads the same fields from its ``parameters`` (``kimi_vision_server/models/config.py``); where the
served default differs, ``kimi_vision_server/render/blocks.py`` says why (docs/serving.md has the table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kimi_vision_common.pillow_open import PILLOW_MAX_PIXELS

DEFAULT_MAX_ENCODED_BYTES = 64 << 20
# nvImageCodec decoders a process keeps per device: two callers decode at once without waiting.
DEFAULT_DECODER_POOL_SIZE = 2
# Which route a GPU decoder's clean JPEGs take (``ImageDecoder(gpu_route=...)``), the default first:
# "exact" (coefficients read on the CPU, libjpeg's integer arithmetic in device kernels: Pillow's
# pixels bit for bit) or "nvimgcodec" (nvImageCodec: its IDCT is not libjpeg's, up to 3 levels off).
GpuRoute = Literal["exact", "nvimgcodec"]
GPU_ROUTES: tuple[GpuRoute, ...] = ("exact", "nvimgcodec")


@dataclass(frozen=True)
class DecodeLimits:
    """Checked from an image's header, before any pixel buffer is allocated.

    ``max_pixels``: stored width x height (Pillow's own bomb threshold); ``max_encoded_bytes``:
    the encoded image."""

    max_pixels: int = PILLOW_MAX_PIXELS
    max_encoded_bytes: int = DEFAULT_MAX_ENCODED_BYTES


@dataclass(frozen=True)
class VideoLimits:
    """Checked before the work they guard (defaults in brackets).

    ``max_video_bytes`` (256 MiB): the encoded video; ``max_frame_pixels`` (3840 x 2160): a
    frame's width x height, from the stream header and again per decoded frame;
    ``max_video_frames`` (36,000: 20 minutes at 30 fps): frames (packets) of the video stream,
    counted before decoding; ``max_sampled_frames`` (4,096): frames sampled for preprocessing.
    """

    max_video_bytes: int = 256 << 20
    max_frame_pixels: int = 3840 * 2160
    max_video_frames: int = 36_000
    max_sampled_frames: int = 4096
