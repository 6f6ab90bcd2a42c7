"""What the image models are built from: decoding and preprocessing, each set up completely in
its constructor from the model's parameters (no setup calls to order), warmed up on creation."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..decode import DecodedImage, DecodeStats, ImageDecoder
from ..numba_runtime import set_num_threads
from ..presets import Preset
from .config import decoder_settings, numba_threads
from .contract import ServingModel
from .requests import PIXEL_SELECTIONS, Outputs, image_bytes_from_input, preprocess_outputs
from .warmup import warmup_images


class ImageDecoding:
    """``IMAGE_BYTES`` in: the decoder of the model's :class:`~.config.DecoderSettings`, every decode
    recorded once (``DecodeStats``: metrics by path, fallbacks counted and logged once per reason).

    ``warmup``: :func:`~.warmup.warmup_images` decoded by this decoder (so the first request pays
    no decoder creation), the images the preprocessing warm-up then takes; they are not counted
    in the metrics (which count requests).
    """

    def __init__(self, model: ServingModel, preset: Preset) -> None:
        self.model = model
        self.preset = preset
        self.settings = settings = decoder_settings(model.parameters)
        warn = lambda message: model.io.log("warn", f"{model.name}: {message}")  # noqa: E731
        stats = DecodeStats(warn=warn, on_decode=self._count)
        self.decoder = ImageDecoder(
            model.device,
            limits=settings.limits,
            strict=settings.strict_decode,
            pool_size=settings.decoder_pool_size,
            decoder_threads=settings.decoder_threads,
            stats=stats,
        )
        self.warmup: list[DecodedImage] = []
        self._warming_up = True
        images = warmup_images()
        for data, result in zip(images, self.decoder.decode_batch(images, preset), strict=True):
            if isinstance(result, BaseException):
                raise RuntimeError(f"warm-up decode of a {len(data)}-byte image failed: {result}")
            self.warmup.append(result)
        self._warming_up = False

    def _count(self, path: str, fallback_reason: str | None) -> None:
        if self._warming_up:
            return
        self.model.metrics.count_decode(path)
        if fallback_reason is not None:
            self.model.metrics.count_fallback(fallback_reason)

    def decode_requests(self, requests: Sequence[Any]) -> list[DecodedImage | BaseException]:
        """The requests' images, all decoded in one batch call: a :class:`DecodedImage` or the
        error per request, in order."""
        model = self.model
        items = model.per_request(requests, lambda r: image_bytes_from_input(model.io.get_input(r, "IMAGE_BYTES")))
        decoded = iter(self.decoder.decode_batch([x for x in items if isinstance(x, bytes)], self.preset))
        return [item if isinstance(item, BaseException) else next(decoded) for item in items]


class ImagePreprocessing:
    """Decoded pixels -> the outputs a request asks for (numba on the host, torch on a GPU), with
    the ``numba_threads`` parameter applied to this process (0: numba's default), and every
    ``warmup`` image run through each pixel selection of :data:`~.requests.PIXEL_SELECTIONS` (loads
    or compiles the kernels)."""

    def __init__(self, model: ServingModel, preset: Preset, warmup: Iterable[DecodedImage]) -> None:
        self.model = model
        self.preset = preset
        self.threads = numba_threads(model.parameters)
        if self.threads:
            set_num_threads(self.threads)
        for decoded in warmup:
            for requested in PIXEL_SELECTIONS:
                preprocess_outputs(decoded, preset, requested)

    def outputs(self, decoded: DecodedImage, request: Any) -> Outputs:
        """The outputs ``request`` asked for (all when it cannot say)."""
        return preprocess_outputs(decoded, self.preset, self.model.io.requested_outputs(request))
