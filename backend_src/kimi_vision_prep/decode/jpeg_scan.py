"""Structural scan of a JPEG stream: decides whether the fast decoder may be trusted with it.

nvImageCodec's CPU backend is libjpeg-turbo with a memory source; Pillow feeds libjpeg-turbo
through a suspending source. They agree on every well-formed stream, but not on damaged ones:
a truncated file gets grey-filled by the former and rejected by Pillow, an unknown marker inside
entropy data is a fatal error in Pillow but may yield a partial image, junk between segments makes
nvImageCodec's parser give up. So a stream goes to the fast decoder only when this scan finds it
*clean*; anything else takes the planned Pillow route, which gives Pillow's verdict by definition,
but for damage libjpeg conceals (:attr:`JpegScan.conceals_damage`), which the ``libjpeg`` route
decodes as Pillow does, the same library with warnings let through.

The scan is linear in the stream and walks entropy-coded data byte by byte in numba (a 12 MP
photo scans in about a millisecond).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, uint8, uint64

# Outcome codes of _scan: module-level ints (numba reads them as compile-time constants), each an
# index into SCAN_REASONS.
(
    CLEAN,
    NO_SOI,
    BYTES_BETWEEN_SEGMENTS,
    SEGMENT_PAST_END,
    UNEXPECTED_MARKER,
    BAD_RESTART,
    TRUNCATED,
    SECOND_SOF,
    SOS_BEFORE_SOF,
    NO_SCAN,
    SECOND_SCAN,
) = range(11)
SCAN_REASONS = (
    "clean",
    "no SOI marker",
    "bytes between segments",
    "segment runs past the end of data",
    "unexpected marker",
    "bad restart marker sequence",
    "missing EOI (truncated)",
    "more than one SOF",
    "SOS before SOF",
    "no scan before EOI",
    "second scan in a single-scan sequential frame",
)

# Verdicts of damage libjpeg decodes past with a warning (what follows it is read as libjpeg reads
# it, whatever this scan would have found there): not the end of the data, which Pillow calls
# truncated, nor a second frame or scan, which libjpeg refuses.
CONCEALED_DAMAGE = frozenset(SCAN_REASONS[code] for code in (UNEXPECTED_MARKER, BAD_RESTART, BYTES_BETWEEN_SEGMENTS))

# SOF markers libjpeg-turbo's DCT decoder handles and nvImageCodec decodes like Pillow:
# baseline, extended and progressive Huffman, extended and progressive arithmetic.
_FAST_SOF = (0xC0, 0xC1, 0xC2, 0xC9, 0xCA)


# Bytes per block of :func:`_next_ff`'s skip: entropy-coded data has a 0xFF about every 256 bytes.
_FF_BLOCK = 64


@njit(cache=True, nogil=True)
def _next_ff(buf: np.ndarray, pos: int) -> int:
    """The index of the first 0xFF byte of ``buf`` (uint8) at or after ``pos``, or ``len(buf)``.

    Blocks without one are skipped by a max over the block, which LLVM vectorises: 2.5-3x faster
    than a byte-by-byte test over the benchmark photos. Unsigned indices (numba wraps a signed
    one, which keeps a loop scalar) and a block end that is not a constant (a constant trip count
    is unrolled into scalar code before the vectoriser sees it)."""
    n, at = uint64(buf.shape[0]), uint64(pos)
    while at < n:
        end = min(at + uint64(_FF_BLOCK), n)
        block_max = uint8(0)
        for k in range(at, end):
            block_max = max(block_max, buf[k])
        if block_max == 0xFF:
            break
        at = end
    while at < n and buf[at] != 0xFF:
        at += uint64(1)
    return np.int64(at)


# What _scan notes in its ``facts`` array (int64), by index.
_SAW_JFIF, _ADOBE_TRANSFORM, _RGB_COMPONENT_IDS, _SAW_DHT, _LAST_COEFFICIENT = range(5)


# Over 60 lines (a reason kept beside it): one numba pass over the marker segments, a switch on
# each marker; split, its running state (position, counts, facts) would cross kernel calls per segment.
@njit(cache=True, nogil=True)
def _scan(buf: np.ndarray, facts: np.ndarray) -> tuple[int, int, int, int, int, int, int]:
    """Walk the marker structure of ``buf`` (uint8).

    Returns ``(code, sof_marker, precision, height, width, components, scans)``; notes in ``facts``
    (int64, 5) what sets the colour space and tables: a JFIF APP0, the Adobe APP14's transform
    plus one (0: none), component IDs ``R, G, B``, a DHT before the first scan; and the last
    coefficient any scan codes (its ``Se``).
    """
    n = buf.shape[0]
    sof = -1
    precision = 0
    height = 0
    width = 0
    comps = 0
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return NO_SOI, sof, precision, height, width, comps, 0
    pos = 2
    restart_interval = 0
    scans = 0
    first_scan_components = 0
    while True:
        # Expect a marker: 0xFF, optional 0xFF fill bytes, then the marker code.
        if pos >= n:
            return TRUNCATED, sof, precision, height, width, comps, scans
        if buf[pos] != 0xFF:
            return BYTES_BETWEEN_SEGMENTS, sof, precision, height, width, comps, scans
        while pos < n and buf[pos] == 0xFF:
            pos += 1
        if pos >= n:
            return TRUNCATED, sof, precision, height, width, comps, scans
        marker = buf[pos]
        pos += 1
        if marker == 0xD9:  # EOI: done; trailing data (MPO frames, padding) is not read by Pillow
            if sof < 0:
                return UNEXPECTED_MARKER, sof, precision, height, width, comps, scans
            if scans == 0:
                return NO_SCAN, sof, precision, height, width, comps, scans
            return CLEAN, sof, precision, height, width, comps, scans
        if marker in {0, 1} or 208 <= marker <= 216:
            return UNEXPECTED_MARKER, sof, precision, height, width, comps, scans
        if pos + 2 > n:
            return SEGMENT_PAST_END, sof, precision, height, width, comps, scans
        length = (np.int64(buf[pos]) << 8) | np.int64(buf[pos + 1])
        if length < 2 or pos + length > n:
            return SEGMENT_PAST_END, sof, precision, height, width, comps, scans
        body = pos + 2
        if 192 <= marker <= 207 and marker not in {196, 200, 204}:
            if sof >= 0:
                return SECOND_SOF, sof, precision, height, width, comps, scans
            sof = marker
            if length < 8:
                return SEGMENT_PAST_END, sof, precision, height, width, comps, scans
            precision = buf[body]
            height = (np.int64(buf[body + 1]) << 8) | np.int64(buf[body + 2])
            width = (np.int64(buf[body + 3]) << 8) | np.int64(buf[body + 4])
            comps = buf[body + 5]
            if comps == 3 and length >= 17 and buf[body + 6] == 82 and buf[body + 9] == 71 and buf[body + 12] == 66:
                facts[_RGB_COMPONENT_IDS] = 1
        elif marker == 0xE0 and length >= 7:  # APP0: JFIF?
            jfif = buf[body] == 74 and buf[body + 1] == 70 and buf[body + 2] == 73 and buf[body + 3] == 70
            if jfif and buf[body + 4] == 0:
                facts[_SAW_JFIF] = 1
        elif marker == 0xEE and length >= 14:  # APP14: Adobe, its colour transform in the last byte
            if buf[body] == 65 and buf[body + 1] == 100 and buf[body + 2] == 111 and buf[body + 3] == 98:
                facts[_ADOBE_TRANSFORM] = np.int64(buf[body + 11]) + 1
        elif marker == 0xC4:
            if scans == 0:
                facts[_SAW_DHT] = 1
        elif marker == 0xDD:  # DRI
            if length < 4:
                return SEGMENT_PAST_END, sof, precision, height, width, comps, scans
            restart_interval = (np.int64(buf[body]) << 8) | np.int64(buf[body + 1])
        elif marker == 0xDA:  # SOS: entropy-coded data follows the header
            if sof < 0:
                return SOS_BEFORE_SOF, sof, precision, height, width, comps, scans
            if length < 3:
                return SEGMENT_PAST_END, sof, precision, height, width, comps, scans
            # libjpeg: a sequential frame whose first scan holds every component has one scan; another
            # SOS is a fatal error (JERR_EOI_EXPECTED) that Pillow reports and nvImageCodec ignores.
            if scans == 0:
                first_scan_components = buf[body]
            elif sof not in (0xC2, 0xCA) and first_scan_components == comps:
                return SECOND_SCAN, sof, precision, height, width, comps, scans
            spectral_end = body + 2 + 2 * np.int64(buf[body])  # Se, after Ns and its component pairs
            if spectral_end < n:
                facts[_LAST_COEFFICIENT] = max(facts[_LAST_COEFFICIENT], np.int64(buf[spectral_end]))
            pos += length
            scans += 1
            next_rst = 0
            while True:
                pos = _next_ff(buf, pos)
                if pos >= n:
                    return TRUNCATED, sof, precision, height, width, comps, scans
                # 0xFF: stuffed zero, restart marker, fill bytes, or the marker ending the scan.
                q = pos + 1
                while q < n and buf[q] == 0xFF:
                    q += 1
                if q >= n:
                    return TRUNCATED, sof, precision, height, width, comps, scans
                code = buf[q]
                if code == 0x00:
                    pos = q + 1
                    continue
                if 0xD0 <= code <= 0xD7:
                    if restart_interval == 0 or code != 0xD0 + next_rst:
                        return BAD_RESTART, sof, precision, height, width, comps, scans
                    next_rst = (next_rst + 1) & 7
                    pos = q + 1
                    continue
                # End of this scan: the next segment must be one libjpeg expects between scans.
                if not (code in {217, 218, 196, 219, 221, 204, 254} or 224 <= code <= 239):
                    return UNEXPECTED_MARKER, sof, precision, height, width, comps, scans
                break
            continue
        elif not (marker in {219, 204, 254} or 224 <= marker <= 239):
            return UNEXPECTED_MARKER, sof, precision, height, width, comps, scans
        pos += length


@dataclass(frozen=True)
class JpegScan:
    """What the structural scan found. ``reason`` is ``"clean"`` for a stream the fast path takes."""

    reason: str
    sof_marker: int
    precision: int
    width: int
    height: int
    components: int
    scans: int
    rgb_coded: bool = False  # 3 components coded as RGB, not YCbCr (libjpeg's rule, :func:`_rgb_coded`)
    huffman_tables: bool = True  # a DHT before the first scan (MJPEG frames rely on the default tables)
    ac_coded: bool = True  # some scan codes AC coefficients (a progressive stream may stop at DC)

    @property
    def clean(self) -> bool:
        return self.reason == "clean"

    @property
    def single_scan(self) -> bool:
        """One sequential scan: libjpeg entropy-decodes it as rows are asked for, so a row band
        below the top skips the IDCT and colour work of the rows above it (:mod:`.jpeg_bands`).
        A progressive or multi-scan stream is entropy-decoded whole before the first row."""
        return self.scans == 1 and self.sof_marker not in (0xC2, 0xCA)

    @property
    def nvjpeg_decodable(self) -> bool:
        """What nvJPEG decodes as libjpeg does, given :attr:`fast_decodable`: Huffman-coded (it has
        no arithmetic decoder), with tables of its own (it refuses MJPEG's implied ones), grey or
        YCbCr (it converts an RGB-coded frame as YCbCr), with AC coefficients (it refuses a
        progressive stream of DC scans only)."""
        return self.sof_marker not in (0xC9, 0xCA) and self.huffman_tables and not self.rgb_coded and self.ac_coded

    @property
    def fast_decodable(self) -> bool:
        """Clean, 8-bit, a DCT process nvImageCodec decodes like Pillow, grey or 3-component."""
        return self.clean and self._fast_frame

    @property
    def conceals_damage(self) -> bool:
        """Damaged in a way libjpeg decodes past with a warning (:data:`CONCEALED_DAMAGE`: a stray
        marker in or between segments, restart markers out of sequence, junk between segments), in
        a frame that is otherwise :attr:`fast_decodable`. Pillow decodes such a stream with libjpeg,
        ignoring its warnings; so does the ``libjpeg`` route, tolerant (:func:`~.jpeg_bands.decode_rows`)."""
        return self.reason in CONCEALED_DAMAGE and self._fast_frame

    @property
    def _fast_frame(self) -> bool:
        return (
            self.sof_marker in _FAST_SOF
            and self.precision == 8
            and self.components in (1, 3)
            and self.width > 0
            and self.height > 0
        )


def scan_jpeg(data: bytes) -> JpegScan:
    """Scan a JPEG byte string; never raises on malformed data."""
    facts = np.zeros(5, dtype=np.int64)
    code, sof, precision, height, width, comps, scans = _scan(np.frombuffer(data, dtype=np.uint8), facts)
    return JpegScan(
        SCAN_REASONS[code],
        int(sof),
        int(precision),
        int(width),
        int(height),
        int(comps),
        int(scans),
        rgb_coded=int(comps) == 3 and _rgb_coded(facts),
        huffman_tables=bool(facts[_SAW_DHT]),
        ac_coded=bool(facts[_LAST_COEFFICIENT] > 0),
    )


def _rgb_coded(facts: np.ndarray) -> bool:
    """libjpeg's guess of a 3-component frame's colour space (``default_decompress_parms``): a
    JFIF APP0 means YCbCr; else an Adobe APP14's transform (0: RGB); else IDs ``R, G, B`` mean RGB."""
    if facts[_SAW_JFIF]:
        return False
    if facts[_ADOBE_TRANSFORM]:
        return facts[_ADOBE_TRANSFORM] == 1
    return bool(facts[_RGB_COMPONENT_IDS])
