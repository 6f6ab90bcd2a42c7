"""Decode encoded bytes into the pixels the preset's resize step expects, with Pillow's verdict.

Routing (spec section 2; "Pillow's verdict, Pillow's pixels"):

1. ``len(data) > max_encoded_bytes`` -> :class:`ImageTooLargeError` before anything is parsed.
2. ``PIL.Image.open`` parses the header only (no pixel allocation). Its exceptions *are* the
   reference verdict for the header (unknown format, zero size, decompression bomb); the pixel
   count is then checked against ``max_pixels``.
3. A JPEG (or MPO first frame) in mode L/RGB whose :func:`scan_jpeg` is clean takes the fast route.
   On the CPU that is ``libjpeg`` first (:mod:`.jpeg_bands`: the libjpeg-turbo Pillow decodes
   with, one image in row bands on the decoder's idle threads), else ``simplejpeg`` (libjpeg-turbo
   3 with SIMD, the same accurate integer IDCT and fancy upsampling, one thread; the route where
   the ``libjpeg`` extension was not built), both in strict mode (a file libjpeg would only warn
   about raises and goes on), then nvImageCodec's CPU backend (``nvimgcodec-cpu``, exact) for
   what they refused. On a GPU it is by default the exact coefficient route (``coefficients-cuda``,
   :mod:`.coefficient_route`: coefficients read on the CPU, libjpeg's integer arithmetic in device
   kernels, Pillow's pixels bit for bit), or with ``gpu_route="nvimgcodec"`` nvImageCodec with
   ``:fancy_upsampling=1`` and no EXIF rotation (``nvimgcodec-cuda``: a CUDA tensor via DLPack;
   near-exact, different IDCT).
   The routes themselves are registered by name in :mod:`.routes`; this module plans,
   pools and threads them.
4. Everything else (CMYK/YCCK, lossless, 12-bit, damaged streams, PNG/GIF/WebP/BMP/TIFF) takes the
   planned ``pillow`` route: Pillow decodes and gives the verdict, by definition exact.
5. If the planned fast decoder is unavailable or returns no image, the image is decoded by Pillow
   and the result says so (``fallback_reason``); each reason is counted and logged once, and
   ``strict=True`` raises :class:`FallbackError` instead.

Colour semantics per preset (``Preset.transparency``, :func:`~.pillow_io.pillow_pixels`): the
pixels come back at the stored size, as RGB/RGBA arrays where converting before the resize gives
the reference's result, else as a Pillow image in its source mode (K3's CMYK, I;16, L with a
transparency key, ...), which the resize step resizes with Pillow in that mode.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from kimi_vision_common.errors import FallbackError, ImageTooLargeError, InvalidImageError, PreprocessError, detached
from kimi_vision_common.pillow_open import open_with_pillow
from kimi_vision_common.presets import Preset

from ..extras import require_torch
from ..limits import DEFAULT_DECODER_POOL_SIZE, GPU_ROUTES, DecodeLimits, GpuRoute
from ..pixels import host_to_device
from . import coefficient_route, jpeg_bands
from .coefficient_route import KernelSlot
from .jpeg_scan import scan_jpeg
from .pillow_io import pillow_pixels
from .pool import DecodePool
from .routes import (
    CPU_DECODERS,
    CPU_ROUTES,
    FANCY_UPSAMPLING_OPTIONS,
    CpuRoute,
    DecodedImage,
    DecodePath,
    Plan,
    RowsFor,
    available_routes,
    import_nvimgcodec,
)
from .stats import DecodeStats, cause_of


def _parse_device(device: str) -> tuple[str, int]:
    if device == "cpu":
        return "cpu", -1
    if device == "cuda":
        return "cuda", 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class ImageDecoder:
    """Routes, validates and decodes images for one device; owns that device's decoder pool.

    ``pool_size`` caps the nvImageCodec decoders alive in this process for this device (each holds
    scratch memory; on a GPU, device memory), ``pool_timeout_s`` bounds the wait for one.
    ``codec_threads`` is nvImageCodec's CPU thread count per decoder (0: all cores).
    ``cpu_decode_threads`` is the threads of one CPU decode call (0: all cores): the JPEGs of a
    batch that many at once, or a lone JPEG in row bands on those of them that are idle
    (:mod:`.jpeg_bands`): one pool, so a batch and a lone photo use the same cores.
    ``stats`` records every decode (default: a fresh :class:`DecodeStats` logging to the
    ``kimi_vision_prep.decode`` logger). ``cpu_routes``: the fast CPU decoders a clean JPEG may
    take, in order (default all: libjpeg, simplejpeg, then nvImageCodec for what they refuse; the
    benchmark and the exactness tests run each alone), every one exact; ``libjpeg`` is left out,
    with a warning logged once, where its extension was not built. ``gpu_route`` (``cuda`` only):
    ``"exact"`` (default, :mod:`.coefficient_route`; ``pool_size`` then caps the images being read
    and run on the device at once) or ``"nvimgcodec"`` (near-exact).
    """

    def __init__(
        self,
        device: str = "cpu",
        *,
        limits: DecodeLimits | None = None,
        strict: bool = False,
        pool_size: int = DEFAULT_DECODER_POOL_SIZE,
        pool_timeout_s: float = 30.0,
        codec_threads: int = 0,
        cpu_decode_threads: int = 0,
        stats: DecodeStats | None = None,
        cpu_routes: Sequence[DecodePath] = CPU_ROUTES,
        gpu_route: GpuRoute = GPU_ROUTES[0],
    ) -> None:
        if unknown := set(cpu_routes) - set(CPU_ROUTES):
            raise ValueError(f"cpu_routes must be among {CPU_ROUTES}, got {sorted(unknown)}")
        if gpu_route not in GPU_ROUTES:
            raise ValueError(f"gpu_route must be one of {GPU_ROUTES}, got {gpu_route!r}")
        self.gpu_route = gpu_route
        self.cpu_routes = available_routes(tuple(cpu_routes))
        self.device = device
        self.device_kind, self.device_index = _parse_device(device)
        if self.device_kind == "cuda":
            require_torch(f"ImageDecoder({device!r}) (its pixels are torch CUDA tensors)")
        self.limits = limits or DecodeLimits()
        self.strict = strict
        self.codec_threads = codec_threads
        self.cpu_decode_threads = cpu_decode_threads
        self.stats = stats or DecodeStats()
        self._codec: Any = None
        self._codec_error: str | None = None
        self._start_threads_and_locks(pool_size, pool_timeout_s)
        _decoders.add(self)

    def _start_threads_and_locks(self, pool_size: int, pool_timeout_s: float) -> None:
        """What runs on threads, and the locks, made anew: at construction, and in a forked child,
        where the parent's threads (this decoder's pool, nvImageCodec's own) do not exist, so work
        handed to them would wait forever, and a lock one of them held at the fork would never be
        released (``os.register_at_fork``, below). The thread pool and the nvImageCodec decoders
        are made on first use."""
        self._codec_lock = threading.Lock()
        exact = self._exact_on_device
        self.pool: DecodePool[Any] = DecodePool(
            KernelSlot if exact else self._make_decoder,
            cap=pool_size,
            timeout_s=pool_timeout_s,
            name=f"{'kernel slot' if exact else 'nvImageCodec decoder'} ({self.device})",
        )
        self._thread_pool: ThreadPoolExecutor | None = None  # made on first use (_threads)
        self._thread_pool_lock = threading.Lock()
        self._bands = jpeg_bands.BandDecoder(self.cpu_workers - 1, self._threads)
        self._callers: Counter[int] = Counter()  # claims by thread (claim)
        self._callers_lock = threading.Lock()

    @property
    def _libjpeg_turbo_route(self) -> DecodePath | None:
        """The first libjpeg-turbo route of ``cpu_routes``, the only one tried: both are strict, what
        one refuses the other does too."""
        return next((route for route in self.cpu_routes if route in ("libjpeg", "simplejpeg")), None)

    @property
    def _conceals_damage(self) -> bool:
        """Whether a damaged JPEG that libjpeg decodes past goes to the libjpeg route (tolerant): on
        the CPU where it is the first libjpeg-turbo route; simplejpeg is strict, so with it first
        such a file takes Pillow."""
        return self.device_kind == "cpu" and self._libjpeg_turbo_route == "libjpeg"

    # -- nvImageCodec -------------------------------------------------------------------------

    @property
    def cpu_workers(self) -> int:
        """How many JPEGs a CPU batch call decodes at once (``cpu_decode_threads``, 0: all cores)."""
        return self.cpu_decode_threads or os.cpu_count() or 1

    @property
    def torch_device(self) -> str:
        """Where this decoder's pixels live: ``"cpu"`` or ``"cuda:N"``."""
        return "cpu" if self.device_kind == "cpu" else f"cuda:{self.device_index}"

    @property
    def _exact_on_device(self) -> bool:
        """Whether clean JPEGs take the exact coefficient route (a ``cuda`` decoder, ``gpu_route="exact"``)."""
        return self.device_kind == "cuda" and self.gpu_route == "exact"

    @property
    def fast_path(self) -> DecodePath:
        if self._exact_on_device:
            return coefficient_route.COEFFICIENTS_PATH
        return "nvimgcodec-cuda" if self.device_kind == "cuda" else "nvimgcodec-cpu"

    def _nvimgcodec(self) -> Any:
        """The nvImageCodec module, or None (with ``_codec_error`` set) when it cannot load."""
        with self._codec_lock:
            if self._codec is None and self._codec_error is None:
                try:
                    self._codec = import_nvimgcodec()
                except Exception as exc:  # ImportError, or a broken CUDA install
                    self._codec_error = f"nvImageCodec unavailable ({type(exc).__name__})"
            return self._codec

    def _make_decoder(self) -> Any:
        codec = self._nvimgcodec()
        if self.device_kind == "cuda":
            backends = [codec.Backend(codec.BackendKind.GPU_ONLY), codec.Backend(codec.BackendKind.HYBRID_CPU_GPU)]
            device_id = self.device_index
        else:
            backends = [codec.Backend(codec.BackendKind.CPU_ONLY)]
            device_id = codec.NVIMGCODEC_DEVICE_CPU_ONLY
        # Never rely on defaults: up to 0.8 they use nearest-neighbour chroma (fancy_upsampling=0).
        return codec.Decoder(
            device_id=device_id,
            max_num_cpu_threads=self.codec_threads,
            backends=backends,
            options=FANCY_UPSAMPLING_OPTIONS,
        )

    def _decode_params(self) -> Any:
        codec = self._codec
        return codec.DecodeParams(apply_exif_orientation=False, color_spec=codec.ColorSpec.SRGB, allow_any_depth=False)

    # -- routing ------------------------------------------------------------------------------

    def _plan(self, data: bytes) -> Plan:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidImageError(f"expected encoded image bytes, got {type(data).__name__}")
        data = bytes(data)
        if not data:
            raise InvalidImageError("empty input: 0 bytes")
        if len(data) > self.limits.max_encoded_bytes:
            raise ImageTooLargeError(
                f"encoded image of {len(data)} bytes exceeds max_encoded_bytes={self.limits.max_encoded_bytes}"
            )
        image = open_with_pillow(data, self.limits.max_pixels)
        scan = scan_jpeg(data) if image.format in ("JPEG", "MPO") else None
        if scan is None or image.mode not in ("L", "RGB") or (scan.width, scan.height) != image.size:
            return Plan(data, image, scan, fast=False)
        fast = (
            scan.fast_decodable
            # What nvJPEG would decode otherwise than libjpeg is planned to Pillow on the GPU.
            and (self.device_kind == "cpu" or self._exact_on_device or scan.nvjpeg_decodable)
        )
        return Plan(data, image, scan, fast, damaged=self._conceals_damage and scan.conceals_damage)

    def _decode_fast(self, plans: list[Plan], rows_for: RowsFor | None) -> None:
        """Decode the fast-route plans: on the CPU each by libjpeg or else simplejpeg (the first of
        them in ``cpu_routes``), the ones it refuses in one nvImageCodec batch call (each as far as
        ``cpu_routes`` allows: what none may take is planned to Pillow); on a GPU each by the exact
        coefficient route, or all in one nvImageCodec call; mark failures for fallback."""
        if self.device_kind == "cpu":
            if self._libjpeg_turbo_route is not None:
                self._map_cpu(CPU_DECODERS[self._libjpeg_turbo_route], plans, rows_for)
            plans = [plan for plan in plans if plan.result is None and plan.fast]
            if "nvimgcodec-cpu" not in self.cpu_routes:
                for plan in plans:
                    plan.fast = False
                return
        if not plans:
            return
        if self._exact_on_device:  # a lone plan on this thread, several on up to cpu_workers threads
            decode = functools.partial(
                coefficient_route.decode_plan, device=self.torch_device, limits=self.limits, pool=self.pool
            )
            if len(plans) == 1 or self.cpu_workers == 1:
                for plan in plans:
                    decode(plan)
                return
            futures = [self._threads().submit(decode, plan) for plan in plans]
            wait(futures)  # every sibling done (its slot back) before a DecoderBusyError leaves the call
            for future in futures:
                future.result()
            return
        codec = self._nvimgcodec()
        if codec is None:
            for plan in plans:
                plan.fallback_reason = self._codec_error
            return
        try:
            with self.pool.borrow() as decoder:
                streams = [codec.CodeStream(plan.data) for plan in plans]
                if self.device_kind == "cuda":
                    import torch

                    with torch.cuda.device(self.device_index):
                        stream = torch.cuda.current_stream()
                        images = decoder.decode(streams, params=self._decode_params(), cuda_stream=stream.cuda_stream)
                        tensors = [None if im is None else torch.from_dlpack(im) for im in images]
                else:
                    images = decoder.decode(streams, params=self._decode_params())
                    tensors = [None if im is None else np.asarray(im.cpu()) for im in images]
        except PreprocessError:
            raise
        except Exception as exc:
            reason, cause = f"nvImageCodec raised {type(exc).__name__}", cause_of(exc)
            for plan in plans:
                plan.fallback_reason, plan.fallback_cause = reason, cause
            return
        for plan, pixels in zip(plans, tensors, strict=True):
            if pixels is None or tuple(pixels.shape) != (plan.image.height, plan.image.width, 3):
                plan.fallback_reason = "nvImageCodec returned no image"
                continue
            plan.result = DecodedImage(
                pixels, plan.image.width, plan.image.height, "bicubic", self.fast_path, device=self.torch_device
            )

    def _threads(self) -> ThreadPoolExecutor:
        """This decoder's CPU threads (``cpu_workers``), made on first use: the JPEGs of a batch,
        or the row bands of a lone one beside the calling thread."""
        with self._thread_pool_lock:
            if self._thread_pool is None:
                self._thread_pool = ThreadPoolExecutor(self.cpu_workers, thread_name_prefix="kimi-prep-decode")
            return self._thread_pool

    @contextlib.contextmanager
    def claim(self) -> Iterator[None]:
        """Count the calling thread as a caller of this decoder for the block (nested claims count
        once). A lone image is decoded in row bands only while its thread is the decoder's only
        caller: callers on several threads keep the cores busy already, and bands would add the
        entropy decoding of their skipped rows to that. Every decode call claims for itself; the
        pipeline claims for the whole of a call, so a caller's resize and patchify count too."""
        me = threading.get_ident()
        with self._callers_lock:
            self._callers[me] += 1
        try:
            yield
        finally:
            with self._callers_lock:
                self._callers[me] -= 1
                if not self._callers[me]:
                    del self._callers[me]

    def _sole_caller(self) -> bool:
        with self._callers_lock:
            return len(self._callers) == 1

    def _map_cpu(self, decode: CpuRoute, plans: list[Plan], rows_for: RowsFor | None) -> None:
        """``decode`` (a :data:`~.routes.CPU_DECODERS` route; they release the GIL) of each
        plan: a lone plan on the calling thread, in up to ``cpu_workers`` row bands while its thread
        is the only caller (:meth:`claim`), its rows offered to ``rows_for``; several on up to
        ``cpu_workers`` threads at once, whole."""
        if len(plans) == 1:
            decode(plans[0], self._bands, self.cpu_workers if self._sole_caller() else 1, rows_for)
        elif self.cpu_workers <= 1:
            for plan in plans:
                decode(plan, self._bands, 1, None)
        else:
            list(self._threads().map(lambda plan: decode(plan, self._bands, 1, None), plans))

    def _decode_pillow(self, plan: Plan, preset: Preset) -> DecodedImage:
        # Pillow first: an image it rejects is bad input (its verdict), not a decoder fallback.
        pixels, resample = pillow_pixels(plan.image, preset)
        if plan.fallback_reason is not None and self.strict:
            raise FallbackError(f"planned {self.fast_path} decode failed ({plan.fallback_reason}) and strict=True")
        # A source-mode Pillow image stays on the host (only Pillow can resize it): the resize
        # step moves its result to ``device``.
        if self.device_kind == "cuda" and isinstance(pixels, np.ndarray):
            pixels = host_to_device(pixels, self.torch_device)
        return DecodedImage(
            pixels,
            plan.image.width,
            plan.image.height,
            resample,
            "pillow",
            plan.fallback_reason,
            device=self.torch_device,
        )

    # -- public API ---------------------------------------------------------------------------

    def decode(self, data: bytes, preset: Preset, *, rows_for: RowsFor | None = None) -> DecodedImage:
        """Decode one image; raises a :class:`PreprocessError` subclass on bad input.

        ``rows_for(width, height)``: a :class:`~.jpeg_bands.RowConsumer` for the image's rows, or
        None. Where the image may be decoded in several row bands, each band hands its rows to it on
        the band's thread as soon as they are decoded, and the result says ``rows_consumed``;
        otherwise it is never started and the caller gets the whole pixels only."""
        result = self._decode_batch([data], preset, rows_for)[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def decode_batch(self, items: Sequence[bytes], preset: Preset) -> list[DecodedImage | PreprocessError]:
        """Decode many images: on the CPU ``cpu_workers`` at once (a lone one in row bands, see
        :meth:`claim`), on a GPU the fast-route ones in one nvImageCodec call.

        Returns one :class:`DecodedImage` or one :class:`PreprocessError` per item, in order;
        errors other than :class:`PreprocessError` propagate (they are bugs, not bad input).
        """
        return self._decode_batch(items, preset, None)

    def _decode_batch(
        self, items: Sequence[bytes], preset: Preset, rows_for: RowsFor | None
    ) -> list[DecodedImage | PreprocessError]:
        plans: list[Plan | PreprocessError] = []
        for data in items:
            try:
                plans.append(self._plan(data))
            except PreprocessError as exc:
                plans.append(detached(exc))
        results: list[DecodedImage | PreprocessError] = []
        try:
            with self.claim():
                self._decode_fast([p for p in plans if isinstance(p, Plan) and (p.fast or p.damaged)], rows_for)
            for plan in plans:
                if isinstance(plan, PreprocessError):
                    results.append(plan)
                    continue
                try:
                    result = plan.result if plan.result is not None else self._decode_pillow(plan, preset)
                except PreprocessError as exc:
                    results.append(detached(exc))
                    continue
                self.stats.record(result.decode_path, result.fallback_reason, plan.fallback_cause)
                results.append(result)
        finally:
            # The pixels are copies by now; free Pillow's decoder state and any half-loaded image
            # at once rather than when the last reference goes.
            for plan in plans:
                if isinstance(plan, Plan):
                    plan.image.close()
        return results


_default_decoders: dict[str, ImageDecoder] = {}
_default_lock = threading.Lock()
_decoders: weakref.WeakSet[ImageDecoder] = weakref.WeakSet()  # every decoder alive, for a forked child


def _after_fork_in_child() -> None:
    global _default_lock  # noqa: PLW0603 - a lock another thread held at the fork stays held
    _default_lock = threading.Lock()
    for decoder in list(_decoders):
        decoder._start_threads_and_locks(decoder.pool.cap, decoder.pool.timeout_s)
        decoder.stats.unlock_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_decoder(device: str = "cpu") -> ImageDecoder:
    """Process-wide decoder per device with :class:`ImageDecoder`'s defaults (a pool of at most 2
    decoders), created on first use; the functions that take ``decoder=`` use it when given none.
    Other settings: make an :class:`ImageDecoder` and pass it."""
    with _default_lock:
        decoder = _default_decoders.get(device)
        if decoder is None:
            decoder = ImageDecoder(device)
            _default_decoders[device] = decoder
        return decoder
