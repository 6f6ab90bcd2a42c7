"""What bench-local times against ours: the floor (the fastest exact single-thread decoder), the
library's decoder alone, Pillow, DALI's CPU pipeline where installed; its images and its allocator."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_client.cli.samples import bench_photos
from kimi_vision_prep import get_preset, navit_target_size
from kimi_vision_prep.decode import jpeg_bands
from kimi_vision_prep.decode.jpeg_scan import scan_jpeg
from kimi_vision_prep.decode.routes import decode_simplejpeg

from ...allocator import keep_large_buffers

Reference = Callable[[bytes, str], Any]  # (encoded image, preset name) -> anything (timed only)


@dataclass
class BenchImage:
    name: str
    data: bytes
    width: int
    height: int
    image_class: str  # "no-resize" | "downscale"
    synthetic: bool
    floor: str  # the fastest exact single-thread decoder of the file: "simplejpeg" | "libjpeg" | "pillow"


def fastest_exact_decode(im: BenchImage) -> np.ndarray:
    """The floor: RGB pixels by the fastest single-thread decoder exact for the file (``im.floor``,
    :func:`floor_decoder`), nothing else: not the attempt of a decoder that refuses the file."""
    pixels = None
    if im.floor == "simplejpeg":
        pixels = decode_simplejpeg(im.data, im.width, im.height)
    elif im.floor == "libjpeg":
        pixels = libjpeg_on_one_thread(im.data, im.width, im.height)
    return pixels if pixels is not None else pillow_rgb(im.data)


def floor_decoder(data: bytes, width: int, height: int) -> str:
    """The fastest single-thread decoder exact for the file: simplejpeg
    (:func:`~kimi_vision_prep.decode.routes.decode_simplejpeg`) where its strict mode takes it, else
    the libjpeg route on one thread (:func:`libjpeg_on_one_thread`) where that takes it, else Pillow."""
    if decode_simplejpeg(data, width, height) is not None:
        return "simplejpeg"
    if libjpeg_on_one_thread(data, width, height) is not None:
        return "libjpeg"
    return "pillow"


def libjpeg_on_one_thread(data: bytes, width: int, height: int) -> np.ndarray | None:
    """uint8 ``(height, width, 3)`` by the libjpeg route in one band, tolerant where the scan finds
    damage libjpeg conceals (as the decoder plans it), or None where it refuses the file or is
    not built."""
    if jpeg_bands.libjpeg_path() is None:
        return None
    pixels = np.empty((height, width, 3), np.uint8)
    tolerant = scan_jpeg(data).conceals_damage
    return pixels if jpeg_bands.decode_rows(data, pixels, 0, height, tolerant) else None


def pillow_rgb(data: bytes) -> np.ndarray:
    """RGB pixels by Pillow alone, the fastest way: an image that is RGB already is read out as it
    is (``convert`` to its own mode would copy every pixel first)."""
    image = Image.open(io.BytesIO(data))
    return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))


def apply_allocator(keep: bool) -> str:
    """The malloc setting of this run, applied (``keep``: :func:`~kimi_vision_server.allocator.keep_large_buffers`,
    the retention setting; else glibc's defaults, as an inference engine's process has them), as
    the label the results carry."""
    if keep and keep_large_buffers():
        return "large buffers kept on the heap (kimi_vision_server.allocator)"
    return "glibc default"


def bench_images(preset_name: str, sources: Sequence[tuple[str, bytes]] | None = None) -> list[BenchImage]:
    """``sources`` (name, encoded bytes; default: :func:`~.samples.bench_photos`) with their class
    under the preset; ``synthetic`` marks generated images."""
    preset = get_preset(preset_name)
    images = []
    named = [(name, data, False) for name, data in sources] if sources is not None else None
    for name, data, synthetic in named or [(n, d, True) for n, d in bench_photos().items()]:
        width, height = Image.open(io.BytesIO(data)).size
        target = navit_target_size(width, height, preset)
        image_class = "downscale" if target.needs_resize else "no-resize"
        floor = floor_decoder(data, width, height)
        images.append(BenchImage(name, data, width, height, image_class, synthetic, floor))
    return images


def dali_runner(preset_name: str) -> Callable[[bytes, tuple[int, int]], np.ndarray] | None:
    """DALI CPU pipeline (decode, cubic antialiased resize, normalize, CHW) or None if not installed."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        return None
    preset = get_preset(preset_name)
    mean = [255.0 * m for m in preset.image_mean]
    std = [255.0 * s for s in preset.image_std]

    @pipeline_def(batch_size=1, num_threads=2, device_id=None, prefetch_queue_depth=1, exec_dynamic=True)
    def pipeline():  # DALI graph definition
        data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
        size = fn.external_source(name="size", dtype=types.FLOAT, ndim=1)
        image = fn.decoders.image(data, device="cpu", output_type=types.RGB)
        image = fn.resize(image, size=size, interp_type=types.INTERP_CUBIC, antialias=True)
        return fn.crop_mirror_normalize(image, mean=mean, std=std, output_layout="CHW", dtype=types.FLOAT), image

    pipe = pipeline()
    pipe.build()

    def run(data: bytes, size_hw: tuple[int, int]) -> np.ndarray:
        pipe.feed_input("data", [np.frombuffer(data, np.uint8)])
        pipe.feed_input("size", [np.asarray(size_hw, np.float32)])
        _, resized = pipe.run()
        return np.asarray(resized[0])

    return run
