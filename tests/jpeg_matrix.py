"""Generated JPEGs for the coefficient route's tests (tests/test_jpeg_coefficients.py): Pillow's
encoder (4:4:4, 4:2:2, 4:2:0, greyscale, CMYK, progressive, restart markers, qualities), ``cjpeg``
where present (4:4:0, 4:1:1 and other integral samplings, arithmetic coding, RGB colour space),
and byte patches of those (YCCK, incomplete progressions, quantization tables).
"""

from __future__ import annotations

import io
import subprocess

import numpy as np
from make_inputs import CJPEG, rgb_pattern
from PIL import Image


def pillow_jpeg(width: int, height: int, mode: str = "RGB", seed: int = 0, **params: object) -> bytes:
    """``rgb_pattern`` in ``mode`` (RGB, L, CMYK) written by Pillow with ``params`` (quality 90 unless given)."""
    params.setdefault("quality", 90)
    image = Image.fromarray(rgb_pattern(width, height, seed), "RGB").convert(mode)
    out = io.BytesIO()
    image.save(out, "JPEG", **params)
    return out.getvalue()


def cjpeg(width: int, height: int, *args: str, seed: int = 0) -> bytes:
    """``rgb_pattern`` written by ``cjpeg`` with ``args`` (e.g. ``-sample 1x2``, ``-arithmetic``)."""
    if CJPEG is None:
        raise RuntimeError("cjpeg is not on PATH (Debian: apt-get install libjpeg-turbo-progs)")
    ppm = b"P6 %d %d 255\n" % (width, height) + rgb_pattern(width, height, seed).tobytes()
    return subprocess.run([CJPEG, *args], input=ppm, capture_output=True, check=True, timeout=30).stdout


def segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, offset, length with the marker) of the segments before the first SOS, then the SOS."""
    out, pos = [], 2
    while pos + 4 <= len(data):
        marker, length = data[pos + 1], int.from_bytes(data[pos + 2 : pos + 4], "big")
        out.append((marker, pos, length + 2))
        if marker == 0xDA:
            break
        pos += length + 2
    return out


def as_ycck(cmyk_jpeg: bytes) -> bytes:
    """A Pillow CMYK JPEG (Adobe transform 0) relabelled YCCK (transform 2): the same coefficients,
    converted YCC -> RGB by the decoder (what libjpeg and Pillow do with such a file)."""
    for marker, pos, _length in segments(cmyk_jpeg):
        if marker == 0xEE and cmyk_jpeg[pos + 4 : pos + 9] == b"Adobe":
            return cmyk_jpeg[: pos + 15] + b"\x02" + cmyk_jpeg[pos + 16 :]
    raise ValueError("no Adobe segment")


def first_scans(progressive_jpeg: bytes, scans: int) -> bytes:
    """The stream up to its ``scans``-th scan's end, then EOI: a clean, incomplete progression."""
    starts = [k for k in range(len(progressive_jpeg) - 1) if progressive_jpeg[k : k + 2] == b"\xff\xda"]
    # A scan ends where the next table or scan segment starts (entropy data never holds FF DA/C4).
    after = range(starts[scans - 1] + 2, len(progressive_jpeg) - 1)
    cut = next(k for k in after if progressive_jpeg[k : k + 2] in (b"\xff\xc4", b"\xff\xda"))
    return progressive_jpeg[:cut] + b"\xff\xd9"


def with_quant_tables(data: bytes, tables: list[np.ndarray]) -> bytes:
    """``data`` with every DQT replaced by one 16-bit DQT (Pq 1) holding ``tables[i]`` as table i
    (64 values each, zigzag order, 1..65535): the coefficients stay, their dequantised values change."""
    body = b"".join(bytes([0x10 | i]) + t.astype(">u2").tobytes() for i, t in enumerate(tables))
    dqt = b"\xff\xdb" + (len(body) + 2).to_bytes(2, "big") + body
    out, first = bytearray(data[:2]), True
    for marker, pos, length in segments(data):
        if marker == 0xDB:
            out += dqt if first else b""
            first = False
        elif marker == 0xDA:
            out += data[pos:]
        else:
            out += data[pos : pos + length]
    return bytes(out)


def quant_table_count(data: bytes) -> int:
    """How many quantization tables the DQT segments of ``data`` define (distinct ids)."""
    ids = set()
    for marker, pos, length in segments(data):
        k = pos + 4
        while marker == 0xDB and k < pos + length:
            ids.add(data[k] & 0x0F)
            k += 1 + 64 * (2 if data[k] >> 4 else 1)
    return len(ids)
