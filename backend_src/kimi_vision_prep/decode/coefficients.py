"""A JPEG's quantized DCT coefficients from the CPU, for the integer kernels of :mod:`.jpeg_kernels`.

The entropy decoding (the serial half of a JPEG decode) runs in the libjpeg-turbo Pillow decodes
with (``libjpeg/coefficients.c``: ``jpeg_read_coefficients``; baseline, progressive, arithmetic,
restart markers), strict like the ``libjpeg`` route; what follows it (dequantisation, islow IDCT,
upsampling, colour) is integer arithmetic that libjpeg specifies exactly, done by the kernels on
the CPU or a device. :func:`read_coefficients` returns the blocks, or the reason the file must go
to Pillow instead (:data:`REFUSALS`), which a caller counts.

Buffers are sized from the header and bounded like every other decode (:class:`~..limits.DecodeLimits`):
the stored pixels against ``max_pixels``, the bytes against ``max_encoded_bytes``, before any is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..buffers import scratch
from ..limits import DecodeLimits
from . import jpeg_bands

# J_COLOR_SPACE values of jpeglib.h (62 ABI) the kernels convert, with the Pillow mode they give.
JCS_GRAYSCALE, JCS_RGB, JCS_YCBCR, JCS_CMYK, JCS_YCCK = 1, 2, 3, 4, 5
MODES = {JCS_GRAYSCALE: "L", JCS_RGB: "RGB", JCS_YCBCR: "RGB", JCS_CMYK: "CMYK", JCS_YCCK: "CMYK"}
COMPONENTS = {JCS_GRAYSCALE: 1, JCS_RGB: 3, JCS_YCBCR: 3, JCS_CMYK: 4, JCS_YCCK: 4}

# Why a file goes to Pillow instead (fixed strings: a caller counts them).
UNAVAILABLE = "coefficients: the libjpeg extension is unavailable"
TOO_LARGE = "coefficients: over the decode limits"
LIBJPEG_REFUSED = "coefficients: libjpeg error or warning (damage, truncation, lossless, unsupported coding)"
PRECISION = "coefficients: not 8-bit samples"
COLOR_SPACE = "coefficients: colour space the kernels do not convert"
SAMPLING = "coefficients: sampling factors the kernels do not upsample"
SMOOTHING = "coefficients: progressive scans leave block smoothing to apply"
DC_MISSING = "coefficients: a component without DC coefficients"
OUT_OF_RANGE = "kernels: a value outside the range where libjpeg's C and SIMD IDCT agree"
REFUSALS = (UNAVAILABLE, TOO_LARGE, LIBJPEG_REFUSED, PRECISION, COLOR_SPACE, SAMPLING, SMOOTHING, DC_MISSING,
            OUT_OF_RANGE)


@dataclass(frozen=True)
class Component:
    """One colour component as decoded: ``blocks`` int16 ``(height_in_blocks, width_in_blocks, 8, 8)``
    (quantized coefficients, natural order: ``[.., v, u]`` is row frequency v, column frequency u),
    ``quant`` int16 ``(8, 8)`` (the table as libjpeg's islow IDCT multiplies by it: a 16-bit entry
    above 32767 is negative there, as in C and SIMD), sampling factors ``h``, ``v``, and the
    samples that are the image's (``width`` x ``height``, ``downsampled_width/height`` in libjpeg)."""

    blocks: np.ndarray
    quant: np.ndarray
    h: int
    v: int
    width: int
    height: int


@dataclass(frozen=True)
class Coefficients:
    """A JPEG frame's coefficients: ``width`` x ``height`` pixels, libjpeg's ``color_space`` guess
    (``JCS_*`` above), ``mode`` Pillow's mode for it (``L``, ``RGB``, ``CMYK``), ``components`` in
    frame order, ``max_h``/``max_v`` the largest sampling factors."""

    width: int
    height: int
    color_space: int
    mode: str
    components: tuple[Component, ...]
    max_h: int
    max_v: int


def supported_sampling(factors: list[tuple[int, int]]) -> bool:
    """Whether every component upsamples by integral factors (libjpeg's ``jinit_upsampler`` refuses
    others: ``JERR_FRACT_SAMPLE_NOTIMPL``); ``factors``: ``(h, v)`` per component."""
    max_h, max_v = max(h for h, _ in factors), max(v for _, v in factors)
    return all(max_h % h == 0 and max_v % v == 0 for h, v in factors)


def read_coefficients(data: bytes, limits: DecodeLimits | None = None) -> Coefficients | str:
    """The coefficients of ``data``, or the reason (one of :data:`REFUSALS`) it goes to Pillow.

    Header first (strict), its size checked against ``limits``; then the int16 blocks of every
    component, read into one buffer sized from the header (:func:`~..buffers.scratch`: inside a
    scratch scope, valid until it exits). Releases the GIL while libjpeg reads."""
    limits = limits or DecodeLimits()
    if jpeg_bands.libjpeg_path() is None:
        return UNAVAILABLE
    from .. import _libjpeg

    if len(data) > limits.max_encoded_bytes:
        return TOO_LARGE
    try:
        width, height, precision, _progressive, _arith, color_space, parts = _libjpeg.coefficient_header(data)
    except _libjpeg.JpegError:
        return LIBJPEG_REFUSED
    if width * height > limits.max_pixels or width == 0 or height == 0:
        return TOO_LARGE
    if precision != 8:
        return PRECISION
    if color_space not in MODES or COMPONENTS[color_space] != len(parts):
        return COLOR_SPACE
    if not supported_sampling([(h, v) for h, v, *_ in parts]):
        return SAMPLING
    counts = [wb * hb for _, _, wb, hb, _, _ in parts]
    # libjpeg's own whole-image arrays (2 bytes a coefficient, as ours) pad each component's blocks
    # to its sampling factors: a narrow or short header pads far past its pixels, so the padded
    # coefficients are held to the pixel budget itself, one per pixel of each component.
    padded = [-(-wb // h) * h * -(-hb // v) * v for h, v, wb, hb, _, _ in parts]
    if sum(padded) * 64 > limits.max_pixels * len(parts):
        return TOO_LARGE
    blocks = scratch((sum(counts), 8, 8), np.int16)  # arena memory in a scratch scope: no page faults
    quant = np.empty((len(parts), 8, 8), dtype=np.uint16)
    try:
        smoothing, dc_missing = _libjpeg.read_coefficients(data, blocks, quant)
    except _libjpeg.JpegError:
        return LIBJPEG_REFUSED
    if smoothing:
        return SMOOTHING
    if dc_missing:
        return DC_MISSING
    components, start = [], 0
    for (h, v, wb, hb, dw, dh), count, table in zip(parts, counts, quant.view(np.int16), strict=True):
        components.append(Component(blocks[start : start + count].reshape(hb, wb, 8, 8), table, h, v, dw, dh))
        start += count
    return Coefficients(
        width, height, color_space, MODES[color_space], tuple(components),
        max(c.h for c in components), max(c.v for c in components),
    )
