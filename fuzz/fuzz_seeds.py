"""Seed inputs for the fuzzer: small shared-corpus files plus synthetic images of every mode.

The synthetic images come from ``tests/make_inputs.py``; they have odd sizes (partial MCUs and
patches), every chroma subsampling, alpha and palette transparency, and a few long thin images
that make both presets resize (with bicubic and with nearest).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from PIL import Image

TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import make_inputs as mi  # noqa: E402

W, H = 45, 33  # not a multiple of 8, 16 or 14
LONG = (7200, 6)  # wider than 7168: both presets resize


def _other_formats() -> dict[str, Callable[[], bytes]]:
    rgb = Image.fromarray(mi.rgb_pattern(W, H), "RGB")
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray(mi.alpha_pattern(W, H), "L"))
    return {
        "webp-lossy": lambda: mi.encode(rgb, "WEBP", quality=80),
        "webp-alpha": lambda: mi.encode(rgba, "WEBP", lossless=True),
        "bmp": lambda: mi.encode(rgb, "BMP"),
        "tiff": lambda: mi.encode(rgb, "TIFF"),
        "tiff-cmyk": lambda: mi.encode(rgb.convert("CMYK"), "TIFF"),
        "gif-trns": lambda: mi.gif_transparent(W, H),
        "gif-anim": lambda: mi.animated(W, H, "GIF"),
        "apng": lambda: mi.animated(W, H, "PNG"),
    }


def _jpegs() -> dict[str, Callable[[], bytes]]:
    seeds: dict[str, Callable[[], bytes]] = {
        f"jpeg-{sub}": (lambda sub=sub: mi.jpeg_rgb(W, H, sub)) for sub in ("4:2:0", "4:2:2", "4:4:4")
    }
    seeds |= {
        "jpeg-progressive": lambda: mi.jpeg_rgb(W, H, progressive=True),
        "jpeg-grey": lambda: mi.jpeg_grey(W, H),
        "jpeg-cmyk": lambda: mi.jpeg_cmyk(W, H),
        "jpeg-exif": lambda: mi.jpeg_with_orientation(W, H, 6),
        "jpeg-long": lambda: mi.jpeg_rgb(*LONG),
    }
    if mi.CJPEG is not None:
        seeds |= {f"cjpeg-{sample}": (lambda sample=sample: mi.cjpeg_rgb(W, H, sample)) for sample in ("1x2", "4x1")}
    return seeds


def _pngs() -> dict[str, Callable[[], bytes]]:
    modes = ("RGB", "RGBA", "LA", "L", "1", "P", "P+trns", "L+trns", "I;16")
    seeds: dict[str, Callable[[], bytes]] = {f"png-{m}": (lambda m=m: mi.png_mode(W, H, m)) for m in modes}
    seeds |= {f"png-long-{m}": (lambda m=m: mi.png_mode(*LONG, m)) for m in ("RGBA", "P+trns")}
    return seeds


def synthetic_seeds() -> dict[str, bytes]:
    """Name -> encoded bytes of every synthetic seed."""
    makers = {**_jpegs(), **_pngs(), **_other_formats()}
    return {name: make() for name, make in makers.items()}


def corpus_seeds(max_bytes: int) -> dict[str, bytes]:
    """Shared-corpus files of at most ``max_bytes`` (empty when the corpus is absent)."""
    if not mi.CORPUS.is_dir():
        return {}
    files = sorted(p for p in mi.CORPUS.iterdir() if p.is_file() and p.name != "MANIFEST.tsv" and p.suffix != ".md")
    return {p.name: p.read_bytes() for p in files if 0 < p.stat().st_size <= max_bytes}


def all_seeds(max_corpus_bytes: int) -> dict[str, bytes]:
    return {**synthetic_seeds(), **corpus_seeds(max_corpus_bytes)}


def video_seeds() -> dict[str, bytes]:
    """Name -> encoded bytes of short clips of every kind the planned video decode reads
    (``tests/make_inputs.planned_clips``: B-frame pyramids, open GOPs, a variable frame rate,
    MPEG-4, MPEG-2, HEVC; MP4, Matroska and MPEG-TS), small enough to decode many a second."""
    return mi.planned_clips(width=160, height=96, seconds=2)
