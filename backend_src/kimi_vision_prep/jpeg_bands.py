"""One JPEG decoded on several cores, in row bands, by the libjpeg-turbo Pillow itself decodes with.

libjpeg-turbo decodes an image on one core, and its entropy decoding is serial. Its other half
(IDCT, chroma upsampling, colour conversion) is not: band ``k`` of ``n`` opens its own
decompressor, reaches its first row with ``jpeg_skip_scanlines`` (which entropy-decodes the rows
above but skips their IDCT and colour work) and decodes its own rows. libjpeg-turbo decodes the
upsampler's context rows at a band's top edge rather than guessing them, so every band's rows
are the rows of a whole decode: the tests compare split decodes with Pillow at every kind of edge
(iMCU-aligned or not, one row from either end). A caller's :class:`RowConsumer` runs on the
band's thread right after its rows are decoded: the no-resize pipeline patchifies there, so the
float32 write of the top band overlaps the decode of the bottom one.

The libjpeg functions come from Pillow's own ``_imaging`` module (:func:`libjpeg_path`), so
the pixels are Pillow's by construction; the C part (``_libjpeg.c``) is strict like the simplejpeg
route (a libjpeg warning refuses the file, which goes on to the next route).

Where bands split: a skipped row costs :data:`SKIP_COST` of a decoded one (its entropy decoding,
measured on the benchmark photos) and a consumer adds ``row_work`` per row, so band ``k``'s work is
``SKIP_COST * s_k + (1 + row_work) * (s_{k+1} - s_k)`` for edges ``s_k`` (fractions of the height).
Equal work for every band gives ``s_k = (1 - r**k) / (1 - r**n)`` with
``r = 1 - SKIP_COST / (1 + row_work)``: the top band is the largest. Two bands of a decode alone
split at ~0.71 of the height, with a float32 patchify at ~0.62; more bands gain less and less
(skipping costs: eight bands of a decode alone still take 0.6 of one whole decode).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, wait
from typing import Protocol

import numpy as np

# A skipped row's entropy decoding against decoding the row: jpeg_read_coefficients took a median
# 0.6 (0.3-0.85) of a whole decode's time on the benchmark photos (BENCHMARKS.md, 2026-12-02 "bands").
SKIP_COST = 0.6
MIN_BAND_PIXELS = 1 << 17  # smaller bands cost more in thread hand-off than they save
DECODE_ROW_MULTIPLE = 16  # band edges on iMCU rows (8 or 16 high) when no consumer asks for others


class RowConsumer(Protocol):
    """What each band does with its rows on its own thread, once they are decoded.

    ``multiple``: band edges fall on multiples of it (whole patch rows). ``row_work``: its cost per
    row against decoding the row (sets the split). ``start()`` runs once on the calling thread
    when the image will be decoded in several bands, before any band starts; then
    ``write(pixels, row_begin, row_end)`` once per band, on that band's thread: ``pixels`` is the
    whole image, uint8 ``(H, W, 3)``, of which rows ``[row_begin, row_end)`` are final.
    """

    multiple: int
    row_work: float

    def start(self) -> None: ...

    def write(self, pixels: np.ndarray, row_begin: int, row_end: int) -> None: ...


@functools.cache
def _binding() -> tuple[str | None, str | None]:
    """(path of the bound libjpeg, None) or (None, why it is unavailable); bound once a process."""
    try:
        from PIL import _imaging

        from . import _libjpeg

        return os.path.realpath(_libjpeg.bind(_imaging.__file__)), None
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"


def libjpeg_path() -> str | None:
    """The file of the libjpeg-turbo Pillow decodes with, bound for the ``libjpeg`` route; None
    when the route is unavailable (:func:`unavailable_reason` says why)."""
    return _binding()[0]


def unavailable_reason() -> str | None:
    """Why the ``libjpeg`` route cannot run (the extension was not built: no libjpeg headers at
    install time), or None."""
    return _binding()[1]


def decode_rows(data: bytes, pixels: np.ndarray, row_begin: int, row_end: int) -> bool:
    """Decode rows ``[row_begin, row_end)`` of ``data`` into ``pixels`` (uint8 ``(H, W, 3)``,
    C-contiguous, the stored size); False when libjpeg refuses the file (an error or a warning,
    or a size other than ``pixels``'). Releases the GIL. Rows outside the image raise ValueError,
    a buffer that is not C-contiguous TypeError."""
    if libjpeg_path() is None:
        raise RuntimeError(f"the libjpeg route is unavailable: {unavailable_reason()}")
    from . import _libjpeg

    height, width = pixels.shape[0], pixels.shape[1]
    try:
        _libjpeg.decode_rows(data, pixels, width, height, row_begin, row_end)
    except _libjpeg.JpegError:
        return False
    return True


def band_edges(height: int, bands: int, multiple: int, row_work: float) -> list[int]:
    """Row edges ``[0, s_1, ..., height]`` of at most ``bands`` bands of equal work (module
    docstring), each inner edge a multiple of ``multiple``; bands that would be empty are dropped."""
    r = 1.0 - SKIP_COST / (1.0 + row_work)
    inner = [round(height * (1 - r**k) / (1 - r**bands) / multiple) * multiple for k in range(1, bands)]
    return sorted({0, height, *(edge for edge in inner if 0 < edge < height)})


class BandDecoder:
    """Decodes one image in row bands on the calling thread and up to ``helpers`` threads of
    ``threads()`` (an executor with at least that many; made by the caller on first use).

    A band goes to a helper only while one is idle (a non-blocking semaphore), so callers decoding
    on several threads at once do not oversubscribe the cores: a busy decoder decodes whole images.
    """

    def __init__(self, helpers: int, threads: Callable[[], Executor]) -> None:
        self.helpers = helpers
        self._idle = threading.BoundedSemaphore(helpers)
        self._threads = threads

    def bands_for(self, width: int, height: int, wanted: int) -> int:
        """How many bands an image of this size may take: at most ``wanted`` and ``helpers + 1``,
        each of at least :data:`MIN_BAND_PIXELS`."""
        return max(1, min(wanted, self.helpers + 1, width * height // MIN_BAND_PIXELS))

    def decode(self, data: bytes, pixels: np.ndarray, bands: int, consumer: RowConsumer | None = None) -> int:
        """Decode ``data`` into ``pixels`` (uint8 ``(H, W, 3)``, the stored size) in up to ``bands``
        bands (as many as there are idle helpers for); each band hands its rows to ``consumer`` when
        there are several. Returns the number of bands that ran (the consumer ran iff > 1), or 0
        when libjpeg refused the file (every band has stopped by then; the consumer may have seen
        some rows)."""
        height = pixels.shape[0]
        helpers = 0
        while helpers < bands - 1 and self._idle.acquire(blocking=False):
            helpers += 1
        multiple = consumer.multiple if consumer is not None else DECODE_ROW_MULTIPLE
        row_work = consumer.row_work if consumer is not None else 0.0
        edges = band_edges(height, helpers + 1, multiple, row_work)
        spans = list(itertools.pairwise(edges))
        self._release(helpers - (len(spans) - 1))  # helpers the split did not use
        if len(spans) == 1:
            return 1 if decode_rows(data, pixels, 0, height) else 0
        if consumer is not None:
            try:
                consumer.start()
            except BaseException:
                self._release(len(spans) - 1)
                raise
        helper_bands = [self._threads().submit(self._helper_band, data, pixels, span, consumer) for span in spans[1:]]
        try:
            ok = self._band(data, pixels, spans[0], consumer)
        finally:
            wait(helper_bands)  # never return while a helper still writes into pixels
        ok = all([ok, *(future.result() for future in helper_bands)])
        return len(spans) if ok else 0

    def _release(self, helpers: int) -> None:
        for _ in range(helpers):
            self._idle.release()

    @staticmethod
    def _band(data: bytes, pixels: np.ndarray, span: tuple[int, int], consumer: RowConsumer | None) -> bool:
        if not decode_rows(data, pixels, *span):
            return False
        if consumer is not None:
            consumer.write(pixels, *span)
        return True

    def _helper_band(
        self, data: bytes, pixels: np.ndarray, span: tuple[int, int], consumer: RowConsumer | None
    ) -> bool:
        try:
            return self._band(data, pixels, span, consumer)
        finally:
            self._idle.release()
