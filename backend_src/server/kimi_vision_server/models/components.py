"""What the image models are built from: decoding and preprocessing, each set up completely in
its constructor from the model's parameters (no setup calls to order), warmed up on creation."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kimi_vision_common.errors import PreprocessError
from kimi_vision_common.presets import Preset
from kimi_vision_common.wire import IMAGE_BYTES
from kimi_vision_prep.decode.decoder import DecodedImage, DecodeStats, ImageDecoder
from kimi_vision_prep.numba_runtime import set_num_threads
from kimi_vision_prep.pipeline import resized_decoded, with_index
from kimi_vision_prep.repeat_cache import RepeatCache, RepeatKey, repeat_key
from kimi_vision_prep.tokens import check_patch_budget

from ..settings import setting
from .config import DecoderSettings, decoder_settings, numba_threads
from .contract import ServingModel
from .requests import PIXEL_SELECTIONS, Outputs, images_from_input, preprocess_outputs
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
        self.decoder = settings_decoder(settings, model.device, DecodeStats(warn=warn, on_decode=self._count))
        # A GPU instance keeps its own resized images of repeats: tritonserver caches no CUDA answer.
        repeat_bytes = setting("repeat_cache_bytes").parse(model.parameters)
        self.repeats = RepeatCache(repeat_bytes) if repeat_bytes and self.decoder.device_kind == "cuda" else None
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

    def request_images(self, request: Any) -> list[bytes]:
        """One request's encoded images within its limits: at most ``max_images_per_request`` of
        them, at most ``max_patches_per_request`` NaViT patches in all (from their headers: nothing
        is decoded for a request over budget)."""
        settings = self.settings
        images = images_from_input(self.model.io.get_input(request, IMAGE_BYTES), settings.max_images_per_request)
        check_patch_budget(images, self.preset, settings.max_patches_per_request, limits=settings.limits)
        return images

    def decode_requests(self, requests: Sequence[Any], resize: bool) -> list[list[DecodedImage] | BaseException]:
        """The images of every request, each resized to its NaViT size right after its decode where
        ``resize`` (:func:`~kimi_vision_prep.pipeline.resized_decoded`): per request, in order, its
        K images or its error (the first bad image's, with its index).

        On a GPU, or without ``resize``, all of them are decoded in one batch call. On the CPU with
        ``resize`` they are decoded :attr:`~kimi_vision_prep.decode.decoder.ImageDecoder.cpu_workers` at a
        time, each resized before the next call: so at most that many stored-size images are
        alive at once (a batch of eight 12 MP photos decoded at once held 8 x 36 MB)."""
        model = self.model
        items = model.per_request(requests, self.request_images)
        flat = [image for item in items if not isinstance(item, BaseException) for image in item]
        repeats = self.repeats if resize else None
        keys = [repeat_key(data, self.preset) for data in flat] if repeats is not None else []
        kept = [repeats.get(key) for key in keys] if repeats is not None else [None] * len(flat)
        todo = [data for data, image in zip(flat, kept, strict=True) if image is None]
        at_once = self.decoder.cpu_workers if resize and self.decoder.device_kind == "cpu" else len(todo)
        keep = lambda result: not resize or isinstance(result, BaseException)  # noqa: E731
        fresh: list[DecodedImage | BaseException] = []
        for start in range(0, len(todo), max(at_once, 1)):
            # A comprehension: no name outlives it to keep a stored-size image through the next call.
            fresh += [
                result if keep(result) else model.attempt(resized_decoded, result, self.preset)
                for result in self.decoder.decode_batch(todo[start : start + at_once], self.preset)
            ]
        new = iter(fresh)
        results = [image if image is not None else next(new) for image in kept]
        if repeats is not None:
            self._keep_repeats(repeats, keys, kept, results)
        decoded = iter(results)
        return [
            item if isinstance(item, BaseException) else _first_error([next(decoded) for _ in item]) for item in items
        ]

    def _keep_repeats(
        self,
        repeats: RepeatCache,
        keys: list[RepeatKey],
        kept: list[DecodedImage | None],
        results: list[DecodedImage | BaseException],
    ) -> None:
        """Count the lookups and keep what was decoded now (errors are not kept: a bad input fails again)."""
        hits = sum(image is not None for image in kept)
        self.model.metrics.count_repeat("hit", hits)
        self.model.metrics.count_repeat("miss", len(kept) - hits)
        for key, image, result in zip(keys, kept, results, strict=True):
            if image is None and isinstance(result, DecodedImage):
                repeats.put(key, result)


def settings_decoder(settings: DecoderSettings, device: str, stats: DecodeStats | None = None) -> ImageDecoder:
    """The :class:`ImageDecoder` of a model's :class:`~.config.DecoderSettings` on ``device``."""
    return ImageDecoder(
        device,
        limits=settings.limits,
        strict=settings.strict_decode,
        pool_size=settings.decoder_pool_size,
        codec_threads=settings.codec_threads,
        cpu_decode_threads=settings.cpu_decode_threads,
        stats=stats,
        gpu_route=settings.gpu_route,
    )


def apply_numba_threads(parameters: Mapping[str, str]) -> int:
    """Apply the ``numba_threads`` parameter to this process (0: numba's default); returns it."""
    threads = numba_threads(parameters)
    if threads:
        set_num_threads(threads)
    return threads


def _first_error(images: list[DecodedImage | BaseException]) -> list[DecodedImage] | BaseException:
    """A request's decoded images, or the first failure among them (one request, one verdict; a
    bad image's error says which one)."""
    for index, image in enumerate(images):
        if isinstance(image, BaseException):
            return with_index(image, "image", index) if isinstance(image, PreprocessError) else image
    return images  # type: ignore[return-value]


class ImagePreprocessing:
    """Decoded pixels -> the outputs a request asks for (numba on the host, torch on a GPU), with
    the ``numba_threads`` parameter applied to this process (0: numba's default), and every
    ``warmup`` image run through each pixel selection of :data:`~.requests.PIXEL_SELECTIONS` (loads
    or compiles the kernels)."""

    def __init__(self, model: ServingModel, preset: Preset, warmup: Iterable[Sequence[DecodedImage]]) -> None:
        self.model = model
        self.preset = preset
        self.threads = apply_numba_threads(model.parameters)
        for images in warmup:
            for requested in PIXEL_SELECTIONS:
                preprocess_outputs(images, preset, requested)

    def outputs(self, decoded: Sequence[DecodedImage], request: Any) -> Outputs:
        """The outputs ``request`` asked for (all of the config's when it cannot say) of its images."""
        return preprocess_outputs(decoded, self.preset, self.model.requested_outputs(request))
