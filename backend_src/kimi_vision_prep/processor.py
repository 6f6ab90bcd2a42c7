"""``KimiVisionProcessor``: the checkpoint processor's two interfaces over this library.

**The checkpoint's remote code** (``KimiK25VisionProcessor``, what vLLM's and SGLang's Kimi model
files call): built from ``media_proc_cfg`` (or ``from_pretrained(folder)`` reading a checkpoint's
``preprocessor_config.json``), with ``media_proc_cfg``, ``num_frames_per_chunk``,
``make_chunk_prompt``, ``get_resize_config``, ``media_tokens_calculator``,
``split_video_chunks`` and ``preprocess(medias)``. Media items are the reference's dicts::

    {"type": "image", "image": <PIL image | encoded bytes | "data:image/...;base64,..." | path>}
    {"type": "video_chunk", "video_chunk": [<frame>, ...]}  # frames of the same kinds

An engine's wrapper of a loaded image and its file (vLLM's ``MediaWithBytes``: ``.media``,
``.original_bytes``) is taken as its ``.media``; a :class:`~.orientation.TurnedJpeg` (a JPEG opened
to stand for its EXIF-turned image) takes the library's decoders, its pixels then turned. vLLM's
calls are answered too: ``preprocess(..., do_rescale=False, do_normalize=False)`` gives uint8
``pixel_values`` (the patches before normalisation, normalised on the engine's device),
``from_pretrained(name, revision=..., trust_remote_code=...)``, ``make_chunk_prompt`` on the class.

**transformers' native image processor** (``Kimi_K25ImageProcessor``'s calls, so that
``Kimi_K25Processor(image_processor=...)`` takes it): ``__call__(images=..., return_tensors=...)``
-> ``pixel_values``, ``image_grid_thw``; ``get_number_of_image_patches(height, width)``;
``merge_size``, ``patch_size``; ``save_pretrained``.

Encoded bytes, ``data:`` URLs and paths take the library's decoders (libjpeg-turbo / simplejpeg /
nvImageCodec, exact); so does a PIL JPEG opened but not yet decoded (its file's bytes,
:func:`~.pillow_io.unloaded_jpeg_bytes`); any other PIL image is used as it is. Where
transformers is installed the class is a ``BaseImageProcessor`` returning ``BatchFeature``;
otherwise a plain class returning a dict (torch tensors for ``return_tensors="pt"``, numpy
otherwise). docs/library.md shows how an engine swaps it in.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_common.errors import InvalidImageError, InvalidRequestError
from kimi_vision_common.presets import (
    MEDIA_PROC_CFG_KEYS,
    Preset,
    get_preset,
    media_proc_cfg,
    preset_from_media_proc_cfg,
)
from kimi_vision_common.sizing import TargetSize, navit_target_size

from .decode import DecodedImage, ImageDecoder
from .extras import require_torch
from .normalize import concatenate_patches
from .orientation import TurnedJpeg
from .pillow_io import open_with_pillow, pillow_call, pillow_pixels, unloaded_jpeg_bytes
from .pipeline import PixelOutput, PreprocessResult, preprocess_bytes, preprocess_decoded, preprocess_turned
from .tokens import count_tokens
from .video import chunk_target, chunk_tokens, preprocess_frames, preprocess_video_chunk, sample_video

try:  # an optional extra: the processor is a transformers image processor where it is installed
    from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
except ImportError:
    BaseImageProcessor, BatchFeature = object, None

MEDIA_TYPES = ("image", "video_chunk")
CONFIG_NAME = "preprocessor_config.json"  # transformers' file name for an image processor's config


def unwrapped(source: Any) -> Any:
    """``source``, or the image an engine's wrapper holds beside its file (vLLM's ``MediaWithBytes``:
    the ``.media`` it loaded, whose pixels are what that engine feeds its processor)."""
    media = getattr(source, "media", None)
    return media if isinstance(media, Image.Image) and hasattr(source, "original_bytes") else source


def media_bytes(source: Any) -> bytes | None:
    """Encoded bytes of ``source``: bytes as given, a ``data:`` URL's payload, a path's content, an
    unloaded PIL JPEG's file; None for any other PIL image. :class:`InvalidImageError` otherwise."""
    source = unwrapped(source)
    if isinstance(source, Image.Image):
        return unloaded_jpeg_bytes(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise InvalidImageError("a data: URL must be base64 (data:<type>;base64,<payload>)")
        return _base64(payload, "the data: URL's base64 payload")
    if isinstance(source, (str, Path)):
        try:
            return Path(source).read_bytes()
        except OSError as exc:
            raise InvalidImageError(f"cannot read {source}: {exc.strerror}") from None
    raise InvalidImageError(f"expected a PIL image, encoded bytes, a data: URL or a path, got {type(source).__name__}")


def _base64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise InvalidImageError(f"{what} is not valid base64: {exc}") from None


def pil_decoded(image: Image.Image, preset: Preset) -> DecodedImage:
    """An opened PIL image as the decoders hand their pixels on (the preset's mode rule)."""
    pixels, resample = pillow_pixels(image, preset)
    return DecodedImage(pixels, image.width, image.height, resample, "pillow")


def rgb_frame(frame: Image.Image) -> np.ndarray:
    """uint8 ``(H, W, 3)``: a frame as the reference takes it (``convert("RGB")``)."""
    return np.asarray(pillow_call("convert a frame to RGB", frame.convert, "RGB"))


def media_item(media: Any) -> tuple[str, Any]:
    """``(type, payload)`` of one media dict; :class:`InvalidRequestError` for anything else."""
    if not isinstance(media, Mapping) or media.get("type") not in MEDIA_TYPES:
        raise InvalidRequestError(f"a media item is a dict with type {' or '.join(MEDIA_TYPES)}, got {media!r:.80}")
    kind = media["type"]
    if kind not in media:
        raise InvalidRequestError(f"a {kind} item needs its {kind!r} key")
    if kind == "video_chunk" and (isinstance(media[kind], (str, bytes)) or not isinstance(media[kind], Sequence)):
        raise InvalidRequestError("video_chunk is a list of frames")
    if kind == "video_chunk" and not media[kind]:
        raise InvalidRequestError("a video_chunk needs at least one frame")
    return kind, media[kind]


def stored_size(source: Any) -> tuple[int, int]:
    """``(width, height)`` of an image source from its header alone (no pixel decoded)."""
    source = unwrapped(source)
    if isinstance(source, Image.Image):
        return source.size
    with open_with_pillow(media_bytes(source)) as image:  # type: ignore[arg-type]
        return image.size


class class_or_instance_method:
    """A method that receives its instance, or its class where it is called on the class."""

    def __init__(self, function: Any) -> None:
        self.function = function

    def __get__(self, instance: Any, owner: type) -> Any:
        return self.function.__get__(owner if instance is None else instance, owner)


class KimiVisionProcessor(BaseImageProcessor):  # type: ignore[misc,valid-type]
    """The checkpoint's vision processor (K2.5 / K2.6 / K3), bit-equal and faster.

    ``media_proc_cfg``: a checkpoint's (the keys its processor reads override ``preset``'s values;
    other keys are kept as given and mean nothing here). ``preset``: the base for everything else
    (K3's transparency rule and prompts: ``preset="kimi-k3"``). ``decoder``: the
    :class:`~.decode.ImageDecoder` for encoded inputs (default: the shared CPU one;
    ``ImageDecoder(device="cuda")`` decodes on a GPU and returns torch CUDA tensors).
    """

    model_input_names = ["pixel_values", "grid_thws"]  # noqa: RUF012 (transformers' class attribute)
    # The base of a processor whose config names no preset (from_dict; make_chunk_prompt on the class).
    default_preset = "kimi-k2.5"

    def __init__(
        self,
        media_proc_cfg: Mapping[str, Any] | None = None,
        preset: str | Preset | None = None,
        decoder: ImageDecoder | None = None,
        **kwargs: Any,
    ) -> None:
        if BaseImageProcessor is not object:
            super().__init__(**kwargs)
        elif kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)} (transformers is not installed to keep them)")
        base = get_preset(preset or self.default_preset)
        cfg = dict(media_proc_cfg or {})
        self.preset = preset_from_media_proc_cfg(cfg, base)
        self.base_preset = base.name
        self.other_cfg = {key: value for key, value in cfg.items() if key not in MEDIA_PROC_CFG_KEYS}
        self.decoder = decoder

    # -- the checkpoint's interface ---------------------------------------------------------------

    @property
    def media_proc_cfg(self) -> dict[str, Any]:
        """The checkpoint's ``media_proc_cfg`` this processor follows (the keys it was given kept)."""
        return {**self.other_cfg, **media_proc_cfg(self.preset)}

    @property
    def num_frames_per_chunk(self) -> int:
        return self.preset.temporal_merge_kernel_size

    @class_or_instance_method
    def make_chunk_prompt(owner: Any, timestamp_text: str) -> str:
        """A video chunk's prompt; callable on the class, as the checkpoint's classmethod is (the
        class's ``default_preset``), or on an instance (its preset)."""
        preset = owner.preset if isinstance(owner, KimiVisionProcessor) else get_preset(owner.default_preset)
        return preset.video_prompt.format(timestamp=timestamp_text)

    def get_resize_config(self, media: Mapping[str, Any]) -> dict[str, int]:
        """The reference's resize config: ``num_tokens``, ``new_width``, ``new_height``,
        ``pad_width``, ``pad_height``, ``sampled_nframes``, from sizes alone."""
        kind, payload = media_item(media)
        if kind == "image":
            width, height = stored_size(payload)
            target, frames = navit_target_size(width, height, self.preset), 1
        else:
            width, height = stored_size(payload[0])
            target, frames = chunk_target(width, height, len(payload), self.preset), len(payload)
        return {
            "num_tokens": chunk_tokens(target, self.preset),
            "new_width": target.new_width,
            "new_height": target.new_height,
            "pad_width": target.pad_width,
            "pad_height": target.pad_height,
            "sampled_nframes": frames,
        }

    def media_tokens_calculator(self, media: Mapping[str, Any]) -> int:
        """The tokens ``media`` takes in the prompt, from its size only (headers for encoded input)."""
        kind, payload = media_item(media)
        if kind == "image" and not isinstance(unwrapped(payload), Image.Image):
            return count_tokens(media_bytes(payload), self.preset).num_tokens  # type: ignore[arg-type]
        return self.get_resize_config(media)["num_tokens"]

    def split_video_chunks(self, video: bytes | str) -> list[dict[str, Any]]:
        """A video (encoded bytes, base64 text or a ``data:`` URL) -> its chunks as the reference
        returns them: ``{"type": "video_chunk", "video_chunk": [PIL RGB frames], "prompt": ...}``."""
        if isinstance(video, str):
            data = media_bytes(video) if video.startswith("data:") else _base64(video, "the video's base64 text")
        else:
            data = bytes(video)
        return [
            {
                "type": "video_chunk",
                "video_chunk": [Image.fromarray(frame) for frame in chunk.frames],
                "prompt": chunk.prompt,
            }
            for chunk in sample_video(data, self.preset)  # type: ignore[arg-type]
        ]

    def preprocess(
        self,
        medias: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        return_tensors: Any = None,
        do_rescale: bool | None = None,
        do_normalize: bool | None = None,
    ) -> Any:
        """``pixel_values`` float32 ``(ΣN, 3, p, p)`` and ``grid_thws`` int64 ``(n, 3)`` of the
        media in order (the reference's concatenation; ``[]``: an empty result). Like the
        reference, one call has one verdict: the first bad item raises its typed error.

        ``do_rescale=False, do_normalize=False`` (vLLM, normalising on its device): uint8
        ``pixel_values``, the same patches before normalisation (padding 0). Either alone is refused:
        rescaling without normalising (or the reverse) is no output of the reference."""
        output = pixel_output(do_rescale, do_normalize)
        check_tensor_type(return_tensors)
        items = [medias] if isinstance(medias, Mapping) else list(medias)
        results = []
        for item in items:
            kind, payload = media_item(item)
            results.append(self._image(payload, output) if kind == "image" else self._video_chunk(payload, output))
        return _batch(_concatenated(results, "grid_thws", output), return_tensors)

    # -- transformers' native interface -----------------------------------------------------------

    @property
    def merge_size(self) -> int:
        return self.preset.merge_kernel_size

    @property
    def patch_size(self) -> int:
        return self.preset.patch_size

    def __call__(self, images: Any = None, return_tensors: Any = None, **kwargs: Any) -> Any:
        """transformers' call: an image or a list of them (one level of nesting per sample
        flattened) -> ``pixel_values`` float32 ``(ΣN, 3, p, p)``, ``image_grid_thw`` int64 ``(n, 3)``.
        Keyword arguments that would change the preprocessing are refused, not ignored."""
        changed = {key: value for key, value in kwargs.items() if value is not None and key not in PASSIVE_KWARGS}
        if changed:
            raise ValueError(f"{type(self).__name__} follows its media_proc_cfg; cannot apply {sorted(changed)}")
        check_tensor_type(return_tensors)
        flat = _flat_images(images)
        results = [self._image(image, "pixel_values") for image in flat]
        return _batch(_concatenated(results, "image_grid_thw", "pixel_values"), return_tensors)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: Mapping | None = None) -> int:
        """Patches (``grid_h * grid_w``, before merging) of a ``height x width`` image."""
        target: TargetSize = navit_target_size(width, height, self.preset)
        return target.num_patches

    def _merge_and_standardize_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        """transformers' image kwargs with this processor's values filled in (``Kimi_K25Processor.
        _get_num_multimodal_tokens`` reads ``merge_size`` there); the sizes are the config's."""
        return {**kwargs, "merge_size": self.merge_size, "patch_size": self.patch_size}

    # -- configuration ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "image_processor_type": type(self).__name__,
            "preset": self.base_preset,
            "media_proc_cfg": self.media_proc_cfg,
        }

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any], **kwargs: Any) -> KimiVisionProcessor:
        """From a ``preprocessor_config.json``'s content (a checkpoint's or one :meth:`save_pretrained`
        wrote); ``kwargs`` override it (``preset=``, ``decoder=``). A K3 checkpoint's config (its
        processor class named K3) takes the ``kimi-k3`` preset where none is given."""
        config = {**config_dict, **kwargs}
        config.setdefault("preset", config_preset(config) or cls.default_preset)
        for key in ("image_processor_type", "auto_map", "processor_class", "return_unused_kwargs"):
            config.pop(key, None)  # transformers' bookkeeping, not settings
        return cls(media_proc_cfg=config.pop("media_proc_cfg", None), **config)

    @classmethod
    def from_pretrained(
        cls, name: str | Path, *, revision: str | None = None, trust_remote_code: bool = False, **kwargs: Any
    ) -> KimiVisionProcessor:
        """From ``name/preprocessor_config.json``: a local checkpoint folder, or (where transformers
        is installed) a Hub model id at ``revision``, read through transformers' cache as
        ``AutoImageProcessor`` reads it. ``trust_remote_code`` is accepted and not needed: no code
        of the checkpoint runs. Loading options of transformers (``cache_dir``, ``token``, ...) are
        passed on to its download; other ``kwargs`` to :meth:`from_dict`."""
        del trust_remote_code
        hub_options = {key: kwargs.pop(key) for key in HUB_OPTIONS if key in kwargs}
        path = config_path(name, revision, hub_options)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise OSError(f"cannot read an image processor config from {path}: {exc}") from None
        return cls.from_dict(config, **kwargs)

    def save_pretrained(self, folder: str | Path, **kwargs: Any) -> list[str]:
        """Write ``folder/preprocessor_config.json`` (:meth:`from_pretrained` reads it back)."""
        path = Path(folder) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json_string())
        return [str(path)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(preset={self.base_preset!r}, media_proc_cfg={self.media_proc_cfg})"

    # -- the work ---------------------------------------------------------------------------------

    def _image(self, source: Any, output: PixelOutput) -> PreprocessResult:
        source = unwrapped(source)
        if isinstance(source, TurnedJpeg) and not source.loaded:
            return preprocess_turned(source.data, source.orientation, self.preset, decoder=self.decoder, output=output)
        data = media_bytes(source)
        if data is None:
            return preprocess_decoded(pil_decoded(source, self.preset), self.preset, output=output)
        return preprocess_bytes(data, self.preset, decoder=self.decoder, output=output)

    def _video_chunk(self, frames: Sequence[Any], output: PixelOutput) -> PreprocessResult:
        frames = [unwrapped(frame) for frame in frames]
        if all(not isinstance(frame, Image.Image) for frame in frames):
            encoded = [media_bytes(f) for f in frames]
            return preprocess_video_chunk(encoded, self.preset, decoder=self.decoder, output=output)  # type: ignore[arg-type]
        if not all(isinstance(frame, Image.Image) for frame in frames):
            raise InvalidRequestError("a video_chunk's frames are all PIL images or all encoded")
        return preprocess_frames([rgb_frame(frame) for frame in frames], self.preset, output=output)


# transformers' Kimi_K25Processor passes its images kwargs; these do not change the pixels.
PASSIVE_KWARGS = frozenset({"do_convert_rgb", "input_data_format", "data_format", "device", "disable_grouping"})
# transformers' download options that from_pretrained passes on (a Hub model id).
HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token", "subfolder", "proxies")


def pixel_output(do_rescale: bool | None, do_normalize: bool | None) -> PixelOutput:
    """The output vLLM's two flags ask for: both False -> uint8 patches, else float32 pixel values."""
    if do_rescale is False and do_normalize is False:
        return "pixel_patches"
    if False in (do_rescale, do_normalize):
        raise ValueError(
            f"do_rescale={do_rescale} with do_normalize={do_normalize}: both False (uint8 patches) or neither"
        )
    return "pixel_values"


def config_preset(config: Mapping[str, Any]) -> str | None:
    """``kimi-k3`` for a K3 checkpoint's ``preprocessor_config.json`` (its processor class, in
    ``image_processor_type`` or ``auto_map``, names K3); None where it names no preset."""
    names = [str(config.get("image_processor_type", "")), *map(str, dict(config.get("auto_map") or {}).values())]
    return "kimi-k3" if any("KimiK3" in name or "Kimi_K3" in name for name in names) else None


def config_path(name: str | Path, revision: str | None, hub_options: Mapping[str, Any]) -> Path:
    """``name``'s ``preprocessor_config.json``: in the folder ``name`` where that is one, else a Hub
    model id's, through transformers' download cache (OSError where it cannot be had)."""
    folder = Path(name)
    if folder.is_dir() or folder.is_absolute() or BaseImageProcessor is object:
        return folder / CONFIG_NAME
    from transformers.utils import cached_file

    try:
        resolved = cached_file(str(name), CONFIG_NAME, revision=revision, **hub_options)
    except (OSError, ValueError) as exc:  # not on the Hub, offline, not a valid model id
        raise OSError(f"cannot find {name}'s {CONFIG_NAME}: {exc}") from None
    if resolved is None:
        raise OSError(f"{name} has no {CONFIG_NAME}")
    return Path(resolved)


def _flat_images(images: Any) -> list[Any]:
    """An image, a list of images, or a list of per-sample lists -> one flat list."""
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        return [images]
    return [image for item in images for image in (item if isinstance(item, (list, tuple)) else [item])]


def _concatenated(results: list[PreprocessResult], grid_key: str, output: PixelOutput) -> dict[str, Any]:
    """The results' ``output`` arrays as one ``pixel_values`` and their grids stacked under ``grid_key``."""
    if not results:
        return {}
    return {
        "pixel_values": concatenate_patches([getattr(r, output) for r in results]),
        grid_key: np.stack([np.asarray(r.grid_thw, dtype=np.int64) for r in results]),
    }


def check_tensor_type(return_tensors: Any) -> None:
    """Refuse, before any work, a ``return_tensors`` this install cannot honour: anything but
    None/"np"/"pt", and "pt" without torch (named with the extra that brings it)."""
    kind = None if return_tensors is None else str(getattr(return_tensors, "value", return_tensors))
    if kind not in (None, "np", "pt"):
        raise ValueError(f"return_tensors must be None, 'np' or 'pt', got {return_tensors!r}")
    if kind == "pt":
        require_torch("return_tensors='pt' (return_tensors='np' gives numpy arrays)")


def _batch(data: dict[str, Any], return_tensors: Any) -> Any:
    """``data`` as the reference returns it: a ``BatchFeature`` where transformers is installed,
    else a dict; torch tensors for ``"pt"``, numpy for None or ``"np"`` (checked by
    :func:`check_tensor_type` first)."""
    if BatchFeature is not None:
        return BatchFeature(data=data, tensor_type=return_tensors)
    if return_tensors in (None, "np"):
        return data
    import torch

    return {key: torch.as_tensor(value) for key, value in data.items()}
