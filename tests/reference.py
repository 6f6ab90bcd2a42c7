"""A deliberately plain reference of the Kimi image and video processor, written straight from the spec.

It shares no code with ``kimi_vision_prep``: only Pillow (default settings), numpy, math and, for
videos, PyAV (every frame decoded, ``to_ndarray(format="rgb24")``, the spec's contract). Every
step is the obvious one (spec sections 2-5, 7-9), so a disagreement with the library is a library
bug or a spec ambiguity, never a shared mistake.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from datetime import datetime, timezone

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
        # spec section 8
        "sample_fps": 2.0,
        "temporal_merge_kernel_size": 4,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "max_num_frames_each_video": None,
        "fixed_output_tokens": None,
        "timestamp_mode": "hh:mm:ss.fff",
    },
    "kimi-k3": {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 65536,
        "patch_limit_on_one_side": 512,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "transparency": "chessboard",
        "sample_fps": 8.0,
        "temporal_merge_kernel_size": 4,
        "in_patch_limit_each_frame": 16384,
        "in_patch_limit_video": None,
        "max_num_frames_each_video": None,
        "fixed_output_tokens": None,
        "timestamp_mode": "hh:mm:ss.fff",
    },
}
PRESETS["kimi-k2.6"] = PRESETS["kimi-k2.5"]
IMAGE_PROMPTS = {
    "kimi-k2.5": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    "kimi-k3": "<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>",
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


def ref_size(width: int, height: int, preset: dict[str, object], limit: int | None = None) -> RefSize:
    """Spec section 3, line by line (float64, floor division, int() truncation); ``limit`` replaces
    ``in_patch_limit`` (a video chunk's, section 8)."""
    p = preset["patch_size"]
    m = preset["merge_kernel_size"]
    limit = preset["in_patch_limit"] if limit is None else limit
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


# -- several media, video chunks, videos, token counts (spec sections 7-9) ------------------------


def reference_images(items: list[bytes], preset_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Section 7: ``pixel_values (ΣN, 3, p, p)``, ``grid_thws (n, 3)``, token counts ``(n,)``."""
    p = PRESETS[preset_name]["patch_size"]
    results = [reference_preprocess(data, preset_name) for data in items]
    if not results:
        return np.zeros((0, 3, p, p), np.float32), np.zeros((0, 3), np.int64), np.zeros((0,), np.int64)
    return (
        np.concatenate([r.pixel_values for r in results]),
        np.stack([r.grid_thw for r in results]),
        np.array([r.num_tokens for r in results], dtype=np.int64),
    )


@dataclass
class RefChunk:
    pixel_values: np.ndarray  # float32 (T*gh*gw, 3, p, p)
    grid_thw: np.ndarray  # int64 (3,) = (T, gh, gw)
    num_tokens: int
    timestamp: str = ""
    prompt: str = ""
    frame_indices: tuple[int, ...] = ()


def reference_chunk(frames: list[np.ndarray], preset_name: str) -> RefChunk:
    """Section 8, a video chunk of RGB uint8 frames: the first frame's size, the per-frame budget,
    every frame resized to that target (Pillow BICUBIC), padded, normalised, patchified T-major."""
    preset = PRESETS[preset_name]
    height, width = frames[0].shape[:2]
    limit = preset["in_patch_limit_each_frame"] or preset["in_patch_limit"]
    if preset["in_patch_limit_video"] is not None:
        limit = min(round(preset["in_patch_limit_video"] / len(frames)), limit)
    size = ref_size(width, height, preset, limit)
    patches = []
    for frame in frames:
        image = Image.fromarray(frame, "RGB")
        if image.size != (size.new_w, size.new_h):
            image = image.resize((size.new_w, size.new_h), Image.Resampling.BICUBIC)
        patches.append(normalize_patchify(np.asarray(image), size, preset))
    m = preset["merge_kernel_size"]
    tokens = (size.grid_h // m) * (size.grid_w // m)
    if preset["fixed_output_tokens"] is not None:
        tokens = preset["fixed_output_tokens"]
    grid_thw = np.array([len(frames), size.grid_h, size.grid_w], dtype=np.int64)
    return RefChunk(np.concatenate(patches), grid_thw, tokens)


def reference_frames_chunk(frames: list[bytes], preset_name: str) -> RefChunk:
    """A chunk of encoded frames: each ``Image.open(...).convert("RGB")`` (every preset)."""
    return reference_chunk([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in frames], preset_name)


def reference_timestamp(t: float, mode: str) -> str:
    clock = datetime.fromtimestamp(t, tz=timezone.utc)
    if mode == "mm:ss":
        return clock.strftime("%M:%S")
    fmt = "%H:%M:%S" if mode == "hh:mm:ss.fff" else "%M:%S"
    return clock.strftime(fmt) + f".{int((t % 1) * 1000):03d}"


def reference_video(data: bytes, preset_name: str) -> list[RefChunk]:
    """Section 8, a whole video: every frame of the first video stream decoded (PyAV), sampled at
    ``min(sample_fps, fps)``, chunked, each chunk with its timestamp and prompt."""
    import av

    preset = PRESETS[preset_name]
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    num_frames = len(frames)
    sample_fps = min(preset["sample_fps"], fps)
    n = max(round(num_frames * sample_fps / fps), 1)
    if preset["max_num_frames_each_video"] is not None:
        n = min(n, preset["max_num_frames_each_video"])
    frame_inds = np.linspace(0, num_frames - 1, n).round().astype(int)
    size = preset["temporal_merge_kernel_size"]
    chunks = []
    for start in range(0, n, size):
        group = [int(i) for i in frame_inds[start : start + size]]
        chunk = reference_chunk([frames[i] for i in group], preset_name)
        chunk.timestamp = reference_timestamp(group[0] / fps, preset["timestamp_mode"])
        chunk.prompt = f"{chunk.timestamp}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
        chunk.frame_indices = tuple(group)
        chunks.append(chunk)
    return chunks


def reference_token_count(data: bytes, preset_name: str) -> tuple[np.ndarray, int, str]:
    """Section 9: ``grid_thw``, ``num_tokens`` and the prompt from ``Image.open(...).size`` alone."""
    width, height = Image.open(io.BytesIO(data)).size
    size = ref_size(width, height, PRESETS[preset_name])
    prompt = IMAGE_PROMPTS["kimi-k3" if preset_name == "kimi-k3" else "kimi-k2.5"].format(W=width, H=height)
    return np.array([1, size.grid_h, size.grid_w], dtype=np.int64), size.num_tokens, prompt

