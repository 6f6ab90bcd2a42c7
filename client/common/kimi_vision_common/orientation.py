"""EXIF orientation as engines apply it when they load a photo (Pillow's ``ImageOps.exif_transpose``).

The checkpoint's processor takes pixels in stored order; an engine that turns a photo first (vLLM's
loader does) hands it the turned pixels. :class:`TurnedJpeg` is an opened JPEG that stands for the
turned image without decoding it, so that its bytes can still go to an exact decoder (the library's,
whose ``turned`` op turns the decoded pixels) instead of being decoded where the engine opened it.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import ExifTags, Image, ImageOps

# EXIF orientation -> the Pillow transposition exif_transpose applies.
TRANSPOSITIONS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
SWAPS_SIDES = frozenset({5, 6, 7, 8})


def turned_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    """``(width, height)`` of a ``width x height`` image turned as EXIF ``orientation`` says."""
    return (height, width) if orientation in SWAPS_SIDES else (width, height)


def exif_orientation(image: Image.Image) -> int:
    """The orientation ``exif_transpose`` reads (EXIF, or XMP where EXIF has none); 1 where there is
    none or it cannot be read (a damaged EXIF block: engines keep the image as stored then)."""
    try:
        orientation = int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # Pillow raises what its EXIF parser meets
        return 1
    return orientation if orientation in TRANSPOSITIONS else 1



def turned_info(opened: Image.Image) -> dict[str, Any]:
    """The ``info`` ``exif_transpose`` gives ``opened`` turned: the file's, its orientation taken out
    of the EXIF and XMP (so nothing turns it again). Pillow's own code on a 1x1 stand-in carrying
    ``opened``'s ``info``: no pixel of the file is decoded."""
    stand_in = Image.new(opened.mode, (1, 1))
    stand_in.info = dict(opened.info)
    return ImageOps.exif_transpose(stand_in).info


class TurnedJpeg(Image.Image):
    """A JPEG opened from ``data`` standing for the image ``exif_transpose`` makes of it: its mode,
    its turned size and the turned image's ``info`` (:func:`turned_info`: no orientation left to
    apply), pixels decoded only when read (then Pillow's, turned, as the engine's own loading
    gives). :class:`~.processor.KimiVisionProcessor` decodes its ``data`` with the library's
    decoders and turns the pixels instead. Pickled as its file and orientation (never its pixels),
    so it stays undecoded across processes."""

    def __init__(self, data: bytes, opened: Image.Image, orientation: int) -> None:
        super().__init__()
        self.data, self.orientation = data, orientation
        self._mode = opened.mode
        self._size = turned_size(*opened.size, orientation)
        self.info = turned_info(opened)

    @property
    def loaded(self) -> bool:
        """Whether something read its pixels (Pillow's, turned); else only its file was read."""
        return self._im is not None

    def load(self) -> Any:
        if self._im is None:
            self.im = ImageOps.exif_transpose(Image.open(io.BytesIO(self.data))).im
        return super().load()

    def __reduce__(self) -> tuple[Any, tuple[bytes, int]]:
        return reopened, (self.data, self.orientation)


def reopened(data: bytes, orientation: int) -> TurnedJpeg:
    """A :class:`TurnedJpeg` of ``data`` opened again (unpickling: the header read, nothing decoded)."""
    return TurnedJpeg(data, Image.open(io.BytesIO(data)), orientation)
