"""Images generated at runtime (no binary files in the package, no checkout needed).

:func:`sample_images` (``kimi-prep demo``): each exercises a different route: a 4:2:0 JPEG
(nvImageCodec, fancy chroma upsampling), a PNG with alpha (Pillow; K2.5 drops alpha, K3 composites
it onto the chessboard) and a JPEG large enough to be resized by the NaViT rule.
:func:`bench_photos` (``kimi-prep bench-local`` / ``bench``): camera-sized JPEGs from VGA to 12 MP.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def gradient_rgb(width: int, height: int) -> np.ndarray:
    """uint8 ``(height, width, 3)``: horizontal red, vertical green and diagonal blue ramps."""
    x = np.linspace(0, 255, width)[None, :]
    y = np.linspace(0, 255, height)[:, None]
    red = np.broadcast_to(x, (height, width))
    green = np.broadcast_to(y, (height, width))
    blue = (red + green) / 2
    return np.stack([red, green, blue], axis=-1).round().astype(np.uint8)


def encode(image: Image.Image, image_format: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def sample_images() -> dict[str, bytes]:
    """File name -> encoded bytes of three deterministic sample images."""
    gradient = Image.fromarray(gradient_rgb(640, 480))
    rgba = np.dstack([gradient_rgb(300, 200), np.tile(np.linspace(0, 255, 300).astype(np.uint8), (200, 1))])
    large = Image.fromarray(gradient_rgb(2400, 1800))
    return {
        "gradient_420.jpg": encode(gradient, "JPEG", quality=90, subsampling="4:2:0"),
        "alpha_ramp.png": encode(Image.fromarray(rgba), "PNG"),
        "large_resized.jpg": encode(large, "JPEG", quality=85, subsampling="4:2:0"),
    }


# (width, height) of the generated benchmark photos: VGA and 1080p fit K2.5's patch budget, the
# 4:3 12 MP landscape and portrait (a phone's) and 4000x3000 are downscaled.
BENCH_PHOTO_SIZES = ((640, 480), (1920, 1080), (4032, 3024), (3024, 4032), (4000, 3000))


def photo_like(width: int, height: int, seed: int) -> np.ndarray:
    """uint8 ``(height, width, 3)``: colour ramps with sensor-like noise (JPEG compresses it like a
    photo, unlike a flat gradient)."""
    rng = np.random.default_rng(seed)
    base = gradient_rgb(width, height).astype(np.int16)
    noise = rng.integers(-12, 13, size=(height, width, 3), dtype=np.int16)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def bench_photos() -> dict[str, bytes]:
    """Name -> 4:2:0 JPEG (quality 90) of each :data:`BENCH_PHOTO_SIZES`, deterministic."""
    photos = {}
    for seed, (width, height) in enumerate(BENCH_PHOTO_SIZES):
        image = Image.fromarray(photo_like(width, height, seed))
        photos[f"generated_{width}x{height}.jpg"] = encode(image, "JPEG", quality=90, subsampling="4:2:0")
    return photos
