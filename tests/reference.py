"""A deliberately plain reference of the Kimi image processor, written straight from the spec.

It shares no code with ``kimi_vision_prep``: only Pillow (default settings), numpy and math. Every
step is the obvious one (spec sections 2-5), so a disagreement with the library is a library bug
or a spec ambiguity, never a shared mistake.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

# Copied from the spec (section 1), not imported from the library.
PRESETS: dict[str, dict[str, object]] = {
    "kimi-k2.5": {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 16384,
        "patch_limit_on_one_side": 512,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "transparency": "convert_rgb",
    },
    "kimi-k3": {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 65536,
        "patch_limit_on_one_side": 512,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "transparency": "chessboard",
    },
}
CHESSBOARD_SQUARE = 8
CHESSBOARD_LIGHT = 255
CHESSBOARD_DARK = 180


@dataclass(frozen=True)
class RefSize:
    """Output of the spec's size rule for one ``width x height`` image."""

    new_w: int
    new_h: int
    pad_w: int
    pad_h: int
    grid_h: int
    grid_w: int
    num_tokens: int


@dataclass
class RefResult:
    pixel_values: np.ndarray  # float32 (N, 3, p, p)
    grid_thw: np.ndarray  # int64 (3,)
    num_tokens: int
    size: RefSize


def ref_size(width: int, height: int, preset: dict[str, object]) -> RefSize:
    """Spec section 3, line by line (float64, floor division, int() truncation)."""
    p = preset["patch_size"]
    m = preset["merge_kernel_size"]
    limit = preset["in_patch_limit"]
    side = preset["patch_limit_on_one_side"]
    s1 = math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p)))
    s2 = side * p / width
    s3 = side * p / height
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = m * p
    pad_w = (f - new_w % f) % f
    pad_h = (f - new_h % f) % f
    grid_h = (new_h + pad_h) // p
    grid_w = (new_w + pad_w) // p
    num_tokens = ((new_h + pad_h) // f) * ((new_w + pad_w) // f)
    return RefSize(new_w, new_h, pad_w, pad_h, grid_h, grid_w, num_tokens)


def chessboard_blend(rgba: np.ndarray) -> np.ndarray:
    """Spec section 5: float32 blend of straight-alpha RGBA onto the chessboard, truncated to uint8."""
    height, width = rgba.shape[:2]
    ys = np.arange(height)[:, None] // CHESSBOARD_SQUARE
    xs = np.arange(width)[None, :] // CHESSBOARD_SQUARE
    board = np.where((ys + xs) % 2 == 0, CHESSBOARD_LIGHT, CHESSBOARD_DARK).astype(np.uint8)[:, :, None]
    alpha = rgba[:, :, 3:4].astype(np.float32) / np.float32(255.0)
    rgb = rgba[:, :, :3].astype(np.float32)
    out = alpha * rgb + (np.float32(1.0) - alpha) * board.astype(np.float32)
    assert out.dtype == np.float32
    return out.astype(np.uint8)


def k25_rgb(image: Image.Image, size: RefSize) -> np.ndarray:
    """K2.5: convert("RGB") first (alpha dropped), then Pillow BICUBIC."""
    rgb = image.convert("RGB")
    if (size.new_w, size.new_h) != rgb.size:
        rgb = rgb.resize((size.new_w, size.new_h), Image.Resampling.BICUBIC)
    return np.asarray(rgb)


def k3_rgb(image: Image.Image, size: RefSize) -> np.ndarray:
    """K3: resize in the source mode (Pillow picks NEAREST for P/1, premultiplies RGBA/LA), then
    RGB as is / no alpha -> RGB / else RGBA on a chessboard."""
    resized = image
    if (size.new_w, size.new_h) != image.size:
        resized = image.resize((size.new_w, size.new_h), Image.Resampling.BICUBIC)
    if resized.mode == "RGB":
        return np.asarray(resized)
    if "A" not in resized.getbands() and "transparency" not in resized.info:
        return np.asarray(resized.convert("RGB"))
    return chessboard_blend(np.asarray(resized.convert("RGBA")))


def normalize_patchify(rgb: np.ndarray, size: RefSize, preset: dict[str, object]) -> np.ndarray:
    """Zero-pad bottom/right, normalise exactly as the spec says, cut into (N, 3, p, p) patches."""
    p = preset["patch_size"]
    padded = np.zeros((size.new_h + size.pad_h, size.new_w + size.pad_w, 3), dtype=np.uint8)
    padded[: size.new_h, : size.new_w] = rgb
    x = (padded / 255.0).astype(np.float32)
    x -= np.asarray(preset["image_mean"], dtype=np.float64)
    x *= 1.0 / np.asarray(preset["image_std"], dtype=np.float64)
    assert x.dtype == np.float32
    patches = x.reshape(size.grid_h, p, size.grid_w, p, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(patches.reshape(size.grid_h * size.grid_w, 3, p, p))


def reference_preprocess(data: bytes, preset_name: str) -> RefResult:
    """The reference processor on encoded bytes. Raises whatever Pillow raises on bad input."""
    preset = PRESETS[preset_name]
    image = Image.open(io.BytesIO(data))
    size = ref_size(image.width, image.height, preset)
    if preset["transparency"] == "convert_rgb":
        rgb = k25_rgb(image, size)
    else:
        rgb = k3_rgb(image, size)
    assert rgb.shape == (size.new_h, size.new_w, 3) and rgb.dtype == np.uint8
    pixel_values = normalize_patchify(rgb, size, preset)
    grid_thw = np.array([1, size.grid_h, size.grid_w], dtype=np.int64)
    return RefResult(pixel_values, grid_thw, size.num_tokens, size)


def reference_verdict(data: bytes, preset_name: str) -> str:
    """``"ok"`` when the reference accepts ``data``, else the name of the exception it raised."""
    try:
        reference_preprocess(data, preset_name)
    except Exception as exc:  # the verdict is any failure at all
        return type(exc).__name__
    return "ok"
