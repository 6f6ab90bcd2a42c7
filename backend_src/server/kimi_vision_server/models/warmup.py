"""Warm-up inputs: every compiled path runs once in ``initialize``, so no request pays for numba
compilation or decoder creation (images and, for the video models, clips and frames)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from kimi_vision_common.presets import Preset
from kimi_vision_prep.decode.decoder import DecodedImage
from kimi_vision_prep.decode.pillow_io import pillow_pixels


def _ramps() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint32 RGBA ramps (values < 251): a small ``(48, 64, 4)`` one, and a tall ``(7300, 16, 4)``
    and a wide ``(16, 7300, 4)`` one whose long side every shipped preset must resize (> 512
    patches)."""
    ramp = np.arange(48 * 64 * 4, dtype=np.uint32).reshape(48, 64, 4) % 251
    tall = np.tile(ramp[:1, :16], (7300, 1, 1))
    return ramp, tall, tall.transpose(1, 0, 2)


def warmup_images() -> list[bytes]:
    """Small encoded images that exercise every compiled path: an RGB JPEG (fast decode, no resize),
    tall and wide RGB JPEGs and RGBA PNGs that every shipped preset must resize (a side > 512
    patches: both pass orders, premultiplied RGBA under K3) and a small RGBA PNG (alpha, no resize)."""

    def encode(pixels: np.ndarray, mode: str, fmt: str) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(pixels).astype(np.uint8), mode).save(buffer, format=fmt)
        return buffer.getvalue()

    ramp, tall, wide = _ramps()
    return [
        encode(ramp[:, :, :3], "RGB", "JPEG"),
        encode(tall[:, :, :3], "RGB", "JPEG"),
        encode(wide[:, :, :3], "RGB", "JPEG"),
        encode(tall, "RGBA", "PNG"),
        encode(wide, "RGBA", "PNG"),
        encode(ramp, "RGBA", "PNG"),
    ]


def warmup_decoded(preset: Preset) -> list[DecodedImage]:
    """:func:`warmup_images` decoded in-process with Pillow (no nvImageCodec decoder created)."""
    decoded = []
    for data in warmup_images():
        with Image.open(io.BytesIO(data)) as image:
            pixels, resample = pillow_pixels(image, preset)
            decoded.append(DecodedImage(pixels, image.width, image.height, resample, "pillow"))
    return decoded


def warmup_clip() -> bytes:
    """An MPEG-4 clip with B-frames (16 frames of 64x48 at 8 fps, FFmpeg's own encoder): the
    planned decode, its frame digest and the chunk writers."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=8, options={"bf": "2", "g": "8"})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for step in range(16):
            ramp = (np.arange(48 * 64 * 3).reshape(48, 64, 3) * (step + 1)) % 251
            for packet in stream.encode(av.VideoFrame.from_ndarray(ramp.astype(np.uint8), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def warmup_frames() -> list[np.ndarray]:
    """A tall and a wide RGB frame that every shipped preset resizes (a side > 512 patches): the
    frame resize in both pass orders."""
    _, tall, wide = _ramps()
    return [np.ascontiguousarray(pixels[:, :, :3], dtype=np.uint8) for pixels in (tall, wide)]
