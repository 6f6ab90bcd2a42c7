"""One JPEG decoded on several cores, in row bands, by the libjpeg-turbo Pillow itself decodes with.

libjpeg-turbo decodes an image on one core, and its entropy decoding is serial. Its other half
(IDCT, chroma upsampling, colour conversion) is not: a band opens its own decompressor, reaches
its first row with ``jpeg_skip_scanlines`` (which entropy-decodes the rows above but skips their
IDCT and colour work) and decodes its own rows. Where the stream has restart markers (7 of the
benchmark's 25 photos, phones' among them), a band enters it at the restart interval that begins an iMCU row
just above its own instead, and skips only that row: the DC predictions start over at every
interval, so the headers followed by the scan from there decode, as an image of the rows left,
to the same pixels (``libjpeg/restart.c``, ``entry_row``). libjpeg-turbo decodes the upsampler's context
rows at a band's top edge rather than guessing them, so every band's rows are the rows of a
whole decode: the tests compare split decodes with Pillow at every kind of edge (iMCU-aligned
or not, one row from either end). A caller's :class:`RowConsumer` runs on the band's thread
right after its rows are decoded: the no-resize pipeline patchifies there, so the float32 write
of one band overlaps the decode of another.

The bands are not fixed in advance. The calling thread owns every row at first and decodes from
the top; each helper thread, when it starts, steals the bottom of the region with the most rows
left, split where its owner and the thief (who skips the rows above first) finish together:
a skipped row costs :data:`SKIP_COST` of a decoded one (nothing, where the thief enters at a
restart marker), a consumer adds ``row_work`` per row.
So a helper that wakes late takes less, and one that wakes after the end takes nothing: a decode
is never slower than one thread's by more than the hand-off (on this project's VM an idle
thread can take milliseconds to wake; a fixed split waited for it, BENCHMARKS.md's history). Region
bookkeeping is one compare-and-swap word per band in ``libjpeg/bands.c``. With two threads and the
image to itself a helper takes the bottom ~0.29 of a decode alone, ~0.38 with a float32 patchify,
half where it enters at a restart marker.

The libjpeg functions come from Pillow's own ``_imaging`` module (:func:`libjpeg_path`), so
the pixels are Pillow's by construction; the C part is strict like the simplejpeg route (a
libjpeg warning refuses the file, which goes on to the next route), but for the warning that
bytes were skipped before a marker, which changes no pixel (``libjpeg/binding.c``, ``on_message``).
A stream the structural scan finds damaged where libjpeg conceals it is decoded tolerant, as
Pillow decodes it: warnings let through but the end of the data, every band from the top.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# A skipped row's entropy decoding against decoding the row: jpeg_read_coefficients took a median
# 0.6 (0.3-0.85) of a whole decode's time on the benchmark photos (BENCHMARKS.md at 0a95504, "bands").
SKIP_COST = 0.6
MIN_BAND_PIXELS = 1 << 17  # smaller bands cost more in thread hand-off than they save
DECODE_ROW_MULTIPLE = 16  # band edges on iMCU rows (8 or 16 high) when no consumer asks for others


class RowConsumer(Protocol):
    """What each band does with its rows on its own thread, once they are decoded.

    ``multiple``: band edges fall on multiples of it (whole patch rows). ``row_work``: its cost per
    row against decoding the row (sets the split). ``start()`` runs once on the calling thread
    before any band starts; then ``write(pixels, row_begin, row_end)`` once per band that decoded
    rows, on that band's thread: ``pixels`` is the whole image, uint8 ``(H, W, 3)``, of which rows
    ``[row_begin, row_end)`` are final. The bands' rows cover the image once.
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

        from .. import _libjpeg

        return os.path.realpath(_libjpeg.bind(_imaging.__file__)), None
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"


def libjpeg_path() -> str | None:
    """The file of the libjpeg-turbo Pillow decodes with, bound for the ``libjpeg`` route; None
    when the route is unavailable (:func:`unavailable_reason` says why)."""
    return _binding()[0]


def unavailable_reason() -> str | None:
    """Why the ``libjpeg`` route cannot run (the extension was not built: no libjpeg 6.2 headers at
    install time; or they describe another ABI than Pillow's library), or None."""
    return _binding()[1]


def _extension() -> object:
    if libjpeg_path() is None:
        raise RuntimeError(f"the libjpeg route is unavailable: {unavailable_reason()}")
    from .. import _libjpeg

    return _libjpeg


def decode_rows(data: bytes, pixels: np.ndarray, row_begin: int, row_end: int, tolerant: bool = False) -> bool:
    """Decode rows ``[row_begin, row_end)`` of ``data`` into ``pixels`` (uint8 ``(H, W, 3)``,
    C-contiguous, the stored size) on this thread; False when libjpeg refuses the file (an error
    or a warning other than of bytes skipped before a marker, or a size other than ``pixels``').
    ``tolerant``: a damaged stream (:attr:`~.jpeg_scan.JpegScan.conceals_damage`), decoded as
    Pillow decodes it: libjpeg's warnings let through, but the end of the data before EOI (Pillow:
    truncated). Releases the GIL. Rows outside the image raise ValueError, a buffer that is not
    C-contiguous TypeError."""
    libjpeg = _extension()
    try:
        libjpeg.decode_rows(data, pixels, pixels.shape[1], pixels.shape[0], row_begin, row_end, tolerant)
    except libjpeg.JpegError:
        return False
    return True


@dataclass(frozen=True)
class _SharedDecode:
    """One image decoded by several bands: what each band's call into ``_libjpeg`` needs.
    ``regions``: one word per band (``libjpeg/bands.c``), band 0's set to own every row."""

    data: bytes
    pixels: np.ndarray
    regions: np.ndarray
    multiple: int  # a stolen region starts on a multiple of this
    min_rows: int  # and holds at least this many rows
    row_cost: float  # a decoded row's cost with the consumer's work (skipped: SKIP_COST)
    consumer: RowConsumer | None
    tolerant: bool  # a damaged stream: as :func:`decode_rows`, every band from the top

    def band(self, index: int) -> bool:
        """Decode band ``index``'s rows (band 0 from the top, a helper's stolen ones) and hand them
        to the consumer; False when libjpeg refused the file."""
        libjpeg = _extension()
        height, width = self.pixels.shape[0], self.pixels.shape[1]
        try:
            begin, end, _ = libjpeg.decode_share(
                self.data,
                self.pixels,
                width,
                height,
                self.regions,
                index,
                self.multiple,
                self.min_rows,
                SKIP_COST,
                self.row_cost,
                self.tolerant,
            )
        except libjpeg.JpegError:
            return False
        if self.consumer is not None and end > begin:
            self.consumer.write(self.pixels, begin, end)
        return True


class BandDecoder:
    """Decodes one image on the calling thread and up to ``helpers`` threads of ``threads()`` (an
    executor with at least that many; made by the caller on first use).

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

    def decode(
        self,
        data: bytes,
        pixels: np.ndarray,
        bands: int,
        consumer: RowConsumer | None = None,
        tolerant: bool = False,
    ) -> bool:
        """Decode ``data`` into ``pixels`` (uint8 ``(H, W, 3)``, the stored size) on this thread
        and up to ``bands - 1`` idle helpers; with a consumer, every row goes through it (started
        first), whether or not a helper took a band. False when libjpeg refused the file (every
        band has stopped by then; the consumer may have seen some rows). ``tolerant`` as for
        :func:`decode_rows`."""
        height, width = pixels.shape[0], pixels.shape[1]
        helpers = 0
        while helpers < bands - 1 and self._idle.acquire(blocking=False):
            helpers += 1
        if consumer is None and helpers == 0:
            return decode_rows(data, pixels, 0, height, tolerant)
        if consumer is not None:
            try:
                consumer.start()
            except BaseException:
                self._release(helpers)
                raise
        regions = np.zeros(helpers + 1, np.uint64)
        regions[0] = height << 32  # band 0 owns rows [0, height)
        multiple = consumer.multiple if consumer is not None else DECODE_ROW_MULTIPLE
        row_cost = 1.0 + (consumer.row_work if consumer is not None else 0.0)
        min_rows = max(multiple, MIN_BAND_PIXELS // width)
        shared = _SharedDecode(data, pixels, regions, multiple, min_rows, row_cost, consumer, tolerant)
        helper_bands = [self._threads().submit(self._helper_band, shared, index) for index in range(1, helpers + 1)]
        try:
            ok = shared.band(0)
        finally:
            for band in helper_bands:
                if band.cancel():  # never started: the caller's band has done its rows by now
                    self._release(1)
            wait(helper_bands)  # never return while a helper still writes into pixels
        return ok and all(band.result() for band in helper_bands if not band.cancelled())

    def _release(self, helpers: int) -> None:
        for _ in range(helpers):
            self._idle.release()

    def _helper_band(self, shared: _SharedDecode, index: int) -> bool:
        try:
            return shared.band(index)
        finally:
            self._idle.release()
