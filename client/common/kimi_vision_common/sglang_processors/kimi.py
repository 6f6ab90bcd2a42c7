"""SGLang's Kimi-K2.5 and K3 processors with this project's pixels (the package's docstring says how
SGLang finds them).

Each subclass keeps SGLang's request path (its loader, the prompt's expansion, its items and
caches) and changes three things:

- **The wrapper always takes its CPU call.** SGLang's wrapper around the checkpoint's processor
  (``KimiGPUProcessorWrapper`` / ``KimiK3GPUProcessorWrapper``) processes on the GPU where CUDA is
  there (torch's antialiased bicubic: off Pillow) and otherwise calls the checkpoint's remote code;
  ours always takes that second call, with the checkpoint's processor replaced by
  :class:`PixelsOfOurs`: the checkpoint's text handling, our pixels. K3's deferred GPU
  preprocessing is never chosen.
- **JPEGs reach our decoder encoded.** SGLang's loader decodes every image with Pillow (and JPEGs
  with nvJPEG where CUDA is there: its IDCT is not libjpeg's). A JPEG sent as bytes or a ``data:``
  URL that the loader would hand over as Pillow decodes it (K2.5: mode RGB; K3: any mode) is handed
  over opened but not decoded (:class:`EncodedJpegLoader`, below SGLang's Kimi identity step, which
  still hashes the file's bytes), and the processor decodes the file (the library's exact decoders;
  a remote processor sends the file). Anything else is SGLang's Pillow image, never its GPU decode.
- **Errors say whose they are**: a verdict on an image is SGLang's client error (``ValueError``,
  answered 400) naming our class and reason; a fault of the server's state is an HTTP 503 (retry
  it); anything else of ours a ``RuntimeError`` (500).
"""

from __future__ import annotations

import copy
import importlib
import io
from collections.abc import Mapping
from typing import Any

from PIL import Image
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.multimodal.processors import kimi_k3, kimi_k25
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor, build_processor_fingerprint
from sglang.srt.utils import ImageData
from sglang.srt.utils.common import get_image_bytes

from ..errors import PreprocessError, ServerUnavailableError
from ..faults import is_verdict
from ..remote_setting import SHARED_MEMORY
from . import CHOICE, PROCESSORS


class PixelsOfOurs:
    """The checkpoint's processor as SGLang's wrapper calls it, ``__call__(text=, medias=, ...)``:
    its text handling as it is (the checkpoint's own tokenizer call), the pixels of ``media_processor``
    (ours: the library's or a server's); ``media_processor`` answers the checkpoint's interface
    (``media_proc_cfg``, ``media_tokens_calculator``) from headers alone."""

    def __init__(self, checkpoint: Any, media_processor: Any) -> None:
        self.checkpoint = checkpoint
        self.media_processor = media_processor
        self.tokenizer = checkpoint.tokenizer
        self.image_processor = getattr(checkpoint, "image_processor", None)

    def __call__(self, text: Any = None, medias: list[Mapping[str, Any]] | None = None, **kwargs: Any) -> Any:
        kwargs.pop("device", None)  # SGLang's fast-processor device: ours decides where it works
        out = self.checkpoint(text=text, **kwargs)
        if medias:
            try:
                pixels = self.media_processor.preprocess(list(medias), return_tensors="pt")
            except PreprocessError:
                raise
            except Exception as exc:  # a bug or out of memory of ours: SGLang's 500, never its 400
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
            out["pixel_values"] = pixels["pixel_values"]
            out["grid_thws"] = pixels["grid_thws"]
        return out


def ours_for(checkpoint: Any, preset: str) -> PixelsOfOurs:
    """:class:`PixelsOfOurs` around ``checkpoint`` (the remote code SGLang loaded), our processor
    built for its ``media_proc_cfg`` as the setting chose (:data:`~kimi_vision_common.sglang_processors.CHOICE`)."""
    assert CHOICE is not None
    mode, options = CHOICE
    module_name, class_name = PROCESSORS[mode]
    cls = getattr(importlib.import_module(module_name), class_name)
    options = dict(options)
    if options.pop("fallback", "none") == "local":
        local_module, local_class = PROCESSORS["local"]
        fallback_cls = getattr(importlib.import_module(local_module), local_class)
        options["fallback"] = fallback_cls(media_proc_cfg=checkpoint.media_processor.media_proc_cfg, preset=preset)
    if "shared_memory" in options:
        options["shared_memory"] = SHARED_MEMORY[options["shared_memory"]]
    processor = cls(media_proc_cfg=checkpoint.media_processor.media_proc_cfg, preset=preset, **options)
    return PixelsOfOurs(checkpoint, processor)


def sglang_error(exc: Exception) -> Exception:
    """What SGLang's API server answers for ``exc``, our class and reason named: a verdict on the
    request's input as ``ValueError`` (400), a fault of the server's state as an HTTPException 503
    (``fastapi``, SGLang's), anything else as ``RuntimeError`` (500)."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PreprocessError) and is_verdict(exc):
        return ValueError(message)
    if isinstance(exc, ServerUnavailableError):
        from fastapi import HTTPException

        return HTTPException(status_code=503, detail=message)
    return RuntimeError(message)


class CpuCall:
    """A mixin before SGLang's wrapper class: every call takes the wrapper's CPU call."""

    def __call__(self, text: Any = None, images: Any = None, **kwargs: Any) -> Any:
        images = images or kwargs.pop("images", None)
        original_input_ids = kwargs.pop("sglang_original_input_ids", None)
        return self._cpu_call(text, images, original_input_ids, **kwargs)  # type: ignore[attr-defined]

    def preprocess_fingerprint_payload(self) -> Any:
        # Artifacts SGLang keys by this fingerprint are ours: never one SGLang's own pixels made.
        return {"stock": super().preprocess_fingerprint_payload(), "pixels": "kimi_vision_prep"}  # type: ignore[misc]


class K25Wrapper(CpuCall, kimi_k25.KimiGPUProcessorWrapper):
    pass


class K3Wrapper(CpuCall, kimi_k3.KimiK3GPUProcessorWrapper):
    def prepare_image_features(self, images: list[Any]) -> Any:
        """SGLang's per-image features (its preprocess cache's), always by the CPU call."""
        sizes = [kimi_k25._get_image_dimensions(image) for image in images]
        configs = [
            kimi_k25.navit_resize_config(
                width,
                height,
                self._patch_size,
                self._merge_kernel_size,
                self._in_patch_limit,
                self._patch_limit_on_one_side,
                self._fixed_output_tokens,
            )
            for width, height in sizes
        ]
        output = self._cpu_call(self._image_token * len(images), images)
        grids = [tuple(int(value) for value in grid) for grid in output["image_grid_thw"].tolist()]
        counts = [grid[0] * grid[1] * grid[2] for grid in grids]
        return list(output["pixel_values"].split(counts)), sizes, configs, grids


class OursMixin:
    """Before SGLang's Kimi processor class: our wrapper around our pixels, no GPU decode, errors
    that say whose they are."""

    WRAPPER: type = object
    PRESET = ""  # our preset of the model SGLang's class serves
    gpu_image_decode = False

    def __init__(self, hf_config: Any, server_args: Any, _processor: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, server_args, _processor, *args, **kwargs)  # type: ignore[call-arg]
        wrapper = copy.copy(self._processor)  # type: ignore[has-type]
        wrapper.__class__ = self.WRAPPER
        wrapper._hf_processor = ours_for(wrapper._hf_processor, self.PRESET)
        wrapper.media_processor = wrapper._hf_processor.media_processor
        self._processor = wrapper
        if self.processor_fingerprint is not None:  # type: ignore[has-type]
            self.processor_fingerprint = build_processor_fingerprint(self, hf_config)

    def _preprocessing_competes_with_the_scheduler(self) -> bool:
        # SGLang runs one processor thread, on its event loop, where its processing would use the
        # GPU; ours works on the CPU or waits on a server on every host: its worker threads apply.
        return False

    async def process_mm_data_async(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().process_mm_data_async(*args, **kwargs)  # type: ignore[misc]
        except PreprocessError as exc:
            raise sglang_error(exc) from exc


class EncodedJpegLoader(BaseMultimodalProcessor):
    """SGLang's image loading, except a JPEG it would hand over as Pillow decodes it: that one
    opened and not decoded. Listed after SGLang's Kimi class, so it runs beneath its identity step."""

    @classmethod
    def _load_single_item(
        cls,
        data: Any,
        modality: Any,
        frame_count_limit: Any = None,
        audio_sample_rate: Any = None,
        discard_alpha_channel: bool = True,
    ) -> Any:
        if modality == Modality.IMAGE and not cls._is_preprocessed_input(data):
            image = opened_jpeg(data, keep_mode=not discard_alpha_channel)
            if image is not None:
                return image
        return super()._load_single_item(data, modality, frame_count_limit, audio_sample_rate, discard_alpha_channel)


def opened_jpeg(data: Any, keep_mode: bool) -> Image.Image | None:
    """``data`` (bytes, a ``data:`` URL, SGLang's ``ImageData`` of one) opened by Pillow, not
    decoded, where it is a JPEG of mode RGB (any mode with ``keep_mode``); None for anything else,
    which SGLang's loader loads (a download, a path, a damaged header, another format) as it does."""
    if isinstance(data, ImageData):
        data = data.url
    if not (isinstance(data, bytes) or (isinstance(data, str) and data.startswith("data:"))):
        return None
    try:
        raw = get_image_bytes(data)
        if not raw.startswith(b"\xff\xd8"):
            return None
        image = Image.open(io.BytesIO(raw))
    except Exception:  # SGLang's loader says what is wrong with it, as it always does
        return None
    return image if image.format == "JPEG" and (keep_mode or image.mode == "RGB") else None


class KimiK25Processor(OursMixin, kimi_k25.KimiK2_5VLImageProcessor, EncodedJpegLoader):
    """SGLang's K2.5 processing, our pixels."""

    WRAPPER = K25Wrapper
    PRESET = "kimi-k2.5"
    models = list(kimi_k25.KimiK2_5VLImageProcessor.models) if CHOICE is not None else []


class KimiK3Processor(OursMixin, kimi_k3.KimiK3ImageProcessor, EncodedJpegLoader):
    """SGLang's K3 processing, our pixels; its deferred GPU preprocessing never chosen."""

    WRAPPER = K3Wrapper
    PRESET = "kimi-k3"
    models = list(kimi_k3.KimiK3ImageProcessor.models) if CHOICE is not None else []

    def _should_defer_gpu_preprocessing(self, images: Any) -> bool:
        return False
