"""The developer benchmarks' photos: real photos of the test corpus (``tests/data/corpus``), 2x
upscales of some, and the camera photos of public test suites under ``benchmarks/data/`` (sources
and licences in its README).

The installed ``kimi-prep bench-local`` / ``bench`` (no checkout) default to generated photos instead.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "corpus"
CAMERA_PHOTOS = ROOT / "benchmarks" / "data"

# Real photos of the corpus (MANIFEST category "photo"/"edge", Pillow accepts them), chosen to cover
# both classes for K2.5; upscaled copies of the second group make the synthetic downscale set.
REAL_PHOTOS = (
    "imagers__large_image.jpg",
    "imagers__extraneous-bytes-after-sos.jpg",
    "pil__xmp_test.jpg",
    "imagers__mjpeg.jpg",
    "imagers__progressive3.jpg",
    "sklearn__china.jpg",
    "pil__iptc.jpg",
)
UPSCALED_PHOTOS = ("pil__xmp_test.jpg", "imagers__large_image.jpg", "sklearn__flower.jpg", "imagers__mjpeg.jpg")


def upscale_2x(data: bytes) -> bytes:
    """Re-encode a photo at twice its size (Lanczos, JPEG q=92, 4:2:0): a synthetic large photo."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    big = image.resize((image.width * 2, image.height * 2), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    big.save(out, "JPEG", quality=92, subsampling=2)
    return out.getvalue()


def corpus_photos() -> list[tuple[str, bytes]]:
    """(name, encoded bytes) of the real photos, then of the upscaled ones (``name@2x``)."""
    photos = [(name, (CORPUS / name).read_bytes()) for name in REAL_PHOTOS]
    return photos + [(f"{name}@2x", upscale_2x((CORPUS / name).read_bytes())) for name in UPSCALED_PHOTOS]


def camera_photos() -> list[tuple[str, bytes]]:
    """(``suite/name``, encoded bytes) of the camera photos under ``benchmarks/data/`` (1.9-12 MP)."""
    return [(str(path.relative_to(CAMERA_PHOTOS)), path.read_bytes()) for path in sorted(CAMERA_PHOTOS.glob("*/*.jpg"))]


def benchmark_photos() -> list[tuple[str, bytes]]:
    """The corpus photos, then the camera photos: what every developer benchmark of photos runs on."""
    return corpus_photos() + camera_photos()


def plain_reference() -> ModuleType:
    """``tests/reference.py``, the deliberately plain reference the exactness tests use."""
    spec = importlib.util.spec_from_file_location("kimi_plain_reference", ROOT / "tests" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
