"""The structural JPEG scan that routes a file (``jpeg_scan``): its search for the next 0xFF, and
its verdict on the entropy-coded data around block edges of that search."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from make_inputs import jpeg_rgb
from PIL import Image

from kimi_vision_prep.decode.jpeg_scan import _FF_BLOCK, _next_ff, scan_jpeg


def _naive_next_ff(buf: np.ndarray, pos: int) -> int:
    hits = np.flatnonzero(buf[pos:] == 0xFF)
    return pos + int(hits[0]) if hits.size else len(buf)


@pytest.mark.parametrize("length", [0, 1, _FF_BLOCK - 1, _FF_BLOCK, _FF_BLOCK + 1, 3 * _FF_BLOCK + 5])
def test_next_ff_finds_every_position_from_every_start(length: int) -> None:
    """One 0xFF at each offset (block edges included), searched from every start before and after
    it; and none at all."""
    rng = np.random.default_rng(length)
    background = rng.integers(0, 0xFF, length, dtype=np.uint8)  # no 0xFF
    for at in [None, *range(length)]:
        buf = background.copy()
        if at is not None:
            buf[at] = 0xFF
        for start in range(length + 1):
            assert _next_ff(buf, start) == _naive_next_ff(buf, start), (at, start)


def test_next_ff_on_dense_and_random_bytes() -> None:
    rng = np.random.default_rng(0)
    for density in (0.0, 0.004, 0.05, 1.0):
        buf = np.where(rng.random(5000) < density, 0xFF, rng.integers(0, 0xFF, 5000)).astype(np.uint8)
        for start in range(0, 5000, 37):
            assert _next_ff(buf, start) == _naive_next_ff(buf, start)


@pytest.mark.parametrize("offset", [0, 1, _FF_BLOCK - 1, _FF_BLOCK, _FF_BLOCK + 1])
def test_scan_verdicts_do_not_depend_on_where_blocks_fall(offset: int) -> None:
    """A clean JPEG, its entropy data cut short, and an unknown marker put into it: the same
    verdicts wherever the scan's blocks begin (an APP segment of ``offset`` bytes shifts them)."""
    data = jpeg_rgb(96, 64)
    app = b"\xff\xe5" + (offset + 2).to_bytes(2, "big") + bytes(offset)
    shifted = data[:2] + app + data[2:]
    sos = shifted.index(b"\xff\xda")
    middle = (sos + len(shifted)) // 2
    assert scan_jpeg(shifted).reason == "clean"
    assert scan_jpeg(shifted[:-2]).reason == "missing EOI (truncated)"
    with_marker = shifted[:middle] + b"\xff\x01" + shifted[middle:]
    assert scan_jpeg(with_marker).reason == "unexpected marker"
    with_restart = shifted[:middle] + b"\xff\xd0" + shifted[middle:]
    assert scan_jpeg(with_restart).reason == "bad restart marker sequence"


def _segments(data: bytes) -> list[tuple[int, bytes]]:
    """The marker segments of a JPEG up to its SOS as ``(marker, body)``, then ``(0, rest)``: the SOS onwards."""
    out, pos = [], 2
    while data[pos + 1] != 0xDA:
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        out.append((data[pos + 1], data[pos + 4 : pos + 2 + length]))
        pos += 2 + length
    return [*out, (0, data[pos:])]


def _join(segments: list[tuple[int, bytes]]) -> bytes:
    out = bytearray(b"\xff\xd8")
    for marker, body in segments:
        out += body if marker == 0 else bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body
    return bytes(out)


def _recoded(segments: list[tuple[int, bytes]], *, jfif: bool, adobe: int | None, ids: bytes) -> bytes:
    """A JPEG from ``segments`` with or without its JFIF APP0, with an Adobe APP14 of transform
    ``adobe`` (None: none), and its three components (SOF and SOS) numbered ``ids``."""
    out = [] if adobe is None else [(0xEE, b"Adobe" + bytes([0, 100, 0, 0, 0, 0, adobe]))]
    for marker, body in segments:
        if marker == 0xE0 and not jfif:
            continue
        numbered = bytearray(body)
        if marker == 0xC0:  # SOF0: P, Y, X, Nf, then (id, sampling, table) per component
            numbered[6], numbered[9], numbered[12] = ids
        elif marker == 0:  # SOS: the marker, length, Ns, then (id, tables) per component
            numbered[5], numbered[7], numbered[9] = ids
        out.append((marker, bytes(numbered)))
    return _join(out)


@pytest.mark.parametrize("jfif", [True, False])
@pytest.mark.parametrize("adobe", [None, 0, 1])
@pytest.mark.parametrize("ids", [b"\x01\x02\x03", b"RGB"])
def test_rgb_coded_is_libjpegs_reading_of_the_colour_space(jfif: bool, adobe: int | None, ids: bytes) -> None:
    """Pillow (libjpeg) decodes each variant; where it converted nothing (RGB-coded), its pixels
    differ from those of the same stream read as YCbCr."""
    original = jpeg_rgb(48, 32, subsampling="4:4:4")
    variant = _recoded(_segments(original), jfif=jfif, adobe=adobe, ids=ids)
    as_ycbcr = np.asarray(Image.open(io.BytesIO(original)).convert("RGB"))
    decoded = np.asarray(Image.open(io.BytesIO(variant)).convert("RGB"))

    assert scan_jpeg(variant).clean
    assert scan_jpeg(variant).rgb_coded == (not np.array_equal(decoded, as_ycbcr))
    assert scan_jpeg(variant).nvjpeg_decodable == (not scan_jpeg(variant).rgb_coded)


def test_a_stream_without_huffman_tables_is_noted_and_not_for_nvjpeg() -> None:
    original = jpeg_rgb(48, 32)
    without = _join([(m, b) for m, b in _segments(original) if m != 0xC4])

    assert (scan_jpeg(original).huffman_tables, scan_jpeg(original).nvjpeg_decodable) == (True, True)
    assert (scan_jpeg(without).huffman_tables, scan_jpeg(without).nvjpeg_decodable) == (False, False)


def test_a_progressive_stream_of_dc_scans_only_is_not_for_nvjpeg(corpus: Path) -> None:
    assert scan_jpeg(jpeg_rgb(48, 32, progressive=True)).ac_coded
    dc_only = scan_jpeg((corpus / "imagers__progressive-missing-ac.jpg").read_bytes())

    assert (dc_only.clean, dc_only.ac_coded, dc_only.nvjpeg_decodable) == (True, False, False)
