"""What the GPU tests and ``gpu_report.py`` share: where the corpus is, and how pixels compare.

The corpus is the repository's own (``tests/data/corpus``): the device machine gets it with the
work tree.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

GPU_TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(GPU_TESTS_DIR.parent))  # tests/: make_inputs

from make_inputs import CORPUS, pillow_resize  # noqa: E402

__all__ = ["CORPUS", "pillow_resize"]
JPEG_SUFFIXES = (".jpg", ".jpeg", ".mpo")
LARGE_CLEAN_JPEG = "imagers__large_image.jpg"  # 2268x1512 baseline 4:4:4, no stream damage


@dataclass(frozen=True)
class CorpusFile:
    name: str
    sof: str  # the manifest's coding, e.g. "baseline", "extended-arith"; "" for non-JPEG

    @property
    def is_jpeg(self) -> bool:
        return self.name.lower().endswith(JPEG_SUFFIXES)

    @property
    def is_arithmetic(self) -> bool:
        return "arith" in self.sof


def accepted_files(corpus: Path) -> list[CorpusFile]:
    """The files Pillow accepts (manifest ``pil_load == "ok"``)."""
    with (corpus / "MANIFEST.tsv").open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [CorpusFile(r["filename"], r["sof"]) for r in rows if r["pil_load"] == "ok"]


def pillow_rgb(data: bytes) -> np.ndarray:
    """The reference pixels: Pillow's ``convert("RGB")``, uint8 ``(H, W, 3)``."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@dataclass(frozen=True)
class PixelDiff:
    mean_abs: float
    max_abs: int

    @property
    def exact(self) -> bool:
        return self.max_abs == 0


def pixel_diff(actual: np.ndarray, expected: np.ndarray) -> PixelDiff:
    """Mean and max absolute difference of two uint8 images of the same shape."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {actual.shape} vs {expected.shape}")
    diff = np.abs(actual.astype(np.int16) - expected.astype(np.int16))
    return PixelDiff(float(diff.mean()), int(diff.max()))


def decoded_on_host(decoded: Any) -> Any:
    """A :class:`~kimi_vision_prep.DecodedImage` with the same pixels on the host, numpy (a
    source-mode Pillow image, which only Pillow resizes, is there already)."""
    pixels = decoded.pixels if isinstance(decoded.pixels, Image.Image) else decoded.pixels.cpu().numpy()
    return dataclasses.replace(decoded, pixels=pixels, device="cpu")


def torch_antialias(tensor: Any, width: int, height: int) -> Any:
    """``interpolate(bicubic, antialias=True)`` rounded to uint8: the common torch route, close to
    Pillow but not equal (spec section 6); measured for comparison only."""
    import torch

    planar = tensor.permute(2, 0, 1)[None].to(torch.float32)
    resized = torch.nn.functional.interpolate(planar, size=(height, width), mode="bicubic", antialias=True)
    return torch.clamp(torch.round(resized[0]), 0, 255).permute(1, 2, 0).to(torch.uint8)
