"""The structural JPEG scan that routes a file (``jpeg_scan``): its search for the next 0xFF, and
its verdict on the entropy-coded data around block edges of that search."""

from __future__ import annotations

import numpy as np
import pytest
from make_inputs import jpeg_rgb

from kimi_vision_prep.jpeg_scan import _FF_BLOCK, _next_ff, scan_jpeg


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
