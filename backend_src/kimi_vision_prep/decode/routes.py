"""The decode routes, each registered under its name (as ``kernels.py`` registers an op's kernels):
the per-image CPU routes that a clean JPEG may take, in order (:data:`CPU_ROUTES`; ``libjpeg``:
Pillow's own libjpeg-turbo in row bands, ``simplejpeg``: libjpeg-turbo through simplejpeg), then
nvImageCodec (``nvimgcodec-cpu`` / ``nvimgcodec-cuda``, a batch call through the decoder pool,
:class:`~.decoder.ImageDecoder`) or, on a GPU by default, the exact coefficient route
(``coefficients-cuda``, :mod:`.coefficient_route`), and Pillow for everything else. Every route is strict: a file it
cannot decode exactly is left for the next (``plan.result`` stays None). ``libjpeg`` also takes a
stream damaged where libjpeg conceals it (``Plan.damaged``), tolerant as Pillow is.

What a route works on: the :class:`Plan` of one image (its bytes, Pillow's header verdict, the
JPEG scan) and, on success, a :class:`DecodedImage`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import simplejpeg
from PIL import Image

from ..buffers import scratch
from ..pixels import Resample
from . import jpeg_bands
from .jpeg_scan import JpegScan

log = logging.getLogger("kimi_vision_prep.decode")

FANCY_UPSAMPLING_OPTIONS = ":fancy_upsampling=1"

DecodePath = Literal["libjpeg", "simplejpeg", "nvimgcodec-cpu", "nvimgcodec-cuda", "coefficients-cuda", "pillow"]
CPU_ROUTES: tuple[DecodePath, ...] = ("libjpeg", "simplejpeg", "nvimgcodec-cpu")
# A consumer of a lone image's rows as they are decoded, by its stored (width, height), or None
# when it wants none of that image (:meth:`ImageDecoder.decode`).
RowsFor = Callable[[int, int], "jpeg_bands.RowConsumer | None"]
# A CPU route: decode(plan, bands, rows_for) sets plan.result, or leaves it None where it refuses.


@dataclass
class DecodedImage:
    """Decoded pixels in stored order (EXIF orientation not applied), at the stored size or already
    resized to the NaViT size of the stored size (:func:`~kimi_vision_prep.pipeline.resized_decoded`).

    ``pixels``: uint8 ``(H, W, C)``, C = 3 (RGB) or 4 (RGBA, straight alpha; K3 only), a numpy
    array or a torch CUDA tensor; or (K3, modes resized in their own mode) a loaded
    ``PIL.Image.Image`` in its source mode. Resized pixels are always RGB ``(new_h, new_w, 3)``.
    ``width``/``height``: the stored size (the NaViT rule and prompts use it), whichever size the
    pixels have. ``resample``: the filter the reference resizes this source with.
    ``rows_consumed``: the caller's row consumer (:meth:`ImageDecoder.decode`) took every row as
    it was decoded; the pixels are whole all the same.
    ``device``: the decoder's device (``"cpu"``, ``"cuda:N"``); a source-mode image that only Pillow
    can resize is resized on the host and its result moved there.
    """

    pixels: Any
    width: int
    height: int
    resample: Resample
    decode_path: DecodePath
    fallback_reason: str | None = None
    rows_consumed: bool = False
    device: str = "cpu"


@dataclass
class Plan:
    """Per-item routing decision made before any pixel is decoded."""

    data: bytes
    image: Image.Image
    scan: JpegScan | None
    fast: bool
    fallback_reason: str | None = None
    # The traceback behind ``fallback_reason`` (:func:`~.stats.cause_of`), logged with its first use.
    fallback_cause: str | None = None
    result: DecodedImage | None = None
    # Damage libjpeg conceals (:attr:`~.jpeg_scan.JpegScan.conceals_damage`), for the libjpeg route
    # tolerant (a CPU decoder's); else, or where it refuses, the Pillow route.
    damaged: bool = False


# A CPU route: ``decode(plan, bands, count, rows_for)`` sets ``plan.result``, or leaves it None where
# it refuses; ``bands`` is the decoder's row-band scheduler (:class:`~.jpeg_bands.BandDecoder`),
# ``count`` how many bands it may use, ``rows_for`` who takes a lone image's rows as they come.
CpuRoute = Callable[["Plan", "jpeg_bands.BandDecoder", int, "RowsFor | None"], None]
CPU_DECODERS: dict[DecodePath, CpuRoute] = {}


def cpu_route(name: DecodePath) -> Callable[[CpuRoute], CpuRoute]:
    """Register a per-image CPU route under ``name``."""

    def register(route: CpuRoute) -> CpuRoute:
        CPU_DECODERS[name] = route
        return route

    return register


@cpu_route("libjpeg")
def decode_libjpeg(plan: Plan, bands: jpeg_bands.BandDecoder, count: int, rows_for: RowsFor | None) -> None:
    """The ``libjpeg`` route: into :func:`~kimi_vision_prep.buffers.scratch`, in up to ``count`` row bands where the
    stream is a single scan and the image large enough for several, each band's rows handed to
    ``rows_for``'s consumer then; a damaged plan tolerant, as Pillow decodes it."""
    width, height = plan.image.size
    pixels = scratch((height, width, 3))
    single_scan = plan.scan is not None and plan.scan.single_scan
    count = bands.bands_for(width, height, count if single_scan else 1)
    consumer = rows_for(width, height) if rows_for is not None and count > 1 else None
    if bands.decode(plan.data, pixels, count, consumer, tolerant=plan.damaged):
        consumed = consumer is not None
        plan.result = DecodedImage(pixels, width, height, "bicubic", "libjpeg", rows_consumed=consumed)


@cpu_route("simplejpeg")
def decode_simplejpeg_route(plan: Plan, bands: jpeg_bands.BandDecoder, count: int, rows_for: RowsFor | None) -> None:
    """The ``simplejpeg`` route (one thread, whole images: ``bands``, ``count`` and ``rows_for`` unused)."""
    pixels = decode_simplejpeg(plan.data, plan.image.width, plan.image.height)
    if pixels is not None:
        plan.result = DecodedImage(pixels, plan.image.width, plan.image.height, "bicubic", "simplejpeg")


def decode_simplejpeg(data: bytes, width: int, height: int) -> np.ndarray | None:
    """uint8 ``(height, width, 3)`` RGB of a JPEG by simplejpeg, bit-equal to Pillow's decode
    (accurate integer IDCT, fancy upsampling; greyscale replicated like ``convert("RGB")``), or
    None where its strict mode refuses the file (libjpeg warnings: corrupt data, extraneous bytes).
    Written into :func:`~kimi_vision_prep.buffers.scratch` (arena memory inside a scope); releases the GIL."""
    out = scratch((height, width, 3))
    try:
        simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, buffer=out, strict=True)
    except ValueError:
        return None
    return out


def import_nvimgcodec() -> Any:
    from nvidia import nvimgcodec

    return nvimgcodec


def available_routes(routes: tuple[DecodePath, ...]) -> tuple[DecodePath, ...]:
    """``routes`` without ``libjpeg`` where its extension is missing (a warning, once a process)."""
    if "libjpeg" not in routes or jpeg_bands.libjpeg_path() is not None:
        return routes
    _warn_once(f"the libjpeg route is unavailable ({jpeg_bands.unavailable_reason()}): clean JPEGs take simplejpeg")
    return tuple(route for route in routes if route != "libjpeg")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
