"""The checkpoint processor's two interfaces, answered the same by every way of doing the work.

:class:`ProcessorInterface` is what an engine calls: the checkpoint's remote code
(``KimiK25VisionProcessor``: ``media_proc_cfg``, ``num_frames_per_chunk``, ``make_chunk_prompt``,
``get_resize_config``, ``media_tokens_calculator``, ``preprocess(medias)``, vLLM's
``do_rescale`` / ``do_normalize``) and transformers' native image processor (``__call__``,
``get_number_of_image_patches``, ``merge_size``, ``patch_size``, ``save_pretrained``,
``from_pretrained``). Media items are the reference's dicts::

    {"type": "image", "image": <PIL image | encoded bytes | "data:image/...;base64,..." | path>}
    {"type": "video_chunk", "video_chunk": [<frame>, ...]}  # frames of the same kinds

Sizes and token counts come from headers and the config alone (no pixel decoded). The pixels are
a subclass's one method, :meth:`ProcessorInterface._pixels`: the library's
``KimiVisionProcessor`` computes them in process, the client's ``RemoteKimiProcessor`` asks a
server. Where transformers is installed the class is a ``BaseImageProcessor`` returning
``BatchFeature``; otherwise a plain class returning a dict (torch tensors for
``return_tensors="pt"``, numpy otherwise).
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .errors import InvalidImageError, InvalidRequestError
from .pillow_open import open_with_pillow, unloaded_jpeg_bytes
from .presets import MEDIA_PROC_CFG_KEYS, Preset, get_preset, media_proc_cfg, preset_from_media_proc_cfg
from .results import PixelOutput
from .sizing import chunk_target, chunk_tokens, navit_target_size

try:  # an optional extra: the processor is a transformers image processor where it is installed
    from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
except ImportError:
    BaseImageProcessor, BatchFeature = object, None

MEDIA_TYPES = ("image", "video_chunk")
CONFIG_NAME = "preprocessor_config.json"  # transformers' file name for an image processor's config
# transformers' Kimi_K25Processor passes its images kwargs; these do not change the pixels.
PASSIVE_KWARGS = frozenset({"do_convert_rgb", "input_data_format", "data_format", "device", "disable_grouping"})
# transformers' download options that from_pretrained passes on (a Hub model id).
HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token", "subfolder", "proxies")
# One media item, as the processor works on it: its type ("image" / "video_chunk") and payload.
MediaItem = tuple[str, Any]


def unwrapped(source: Any) -> Any:
    """``source``, or the image an engine's wrapper holds beside its file (vLLM's ``MediaWithBytes``:
    the ``.media`` it loaded, whose pixels are what that engine feeds its processor)."""
    media = getattr(source, "media", None)
    return media if isinstance(media, Image.Image) and hasattr(source, "original_bytes") else source


def chunk_of_images(frames: Sequence[Any]) -> bool:
    """Whether a video chunk's frames (unwrapped, :func:`unwrapped`) are PIL images, opened or
    decoded (True: processed as the images they are), or all encoded (False: bytes, ``data:`` URLs,
    paths). The one rule of every processor; a chunk of both kinds is :class:`InvalidRequestError`."""
    images = [isinstance(frame, Image.Image) for frame in frames]
    if any(images) and not all(images):
        raise InvalidRequestError("a video_chunk's frames are all PIL images or all encoded")
    return any(images)


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
        return base64_payload(payload, "the data: URL's base64 payload")
    if isinstance(source, (str, Path)):
        try:
            return Path(source).read_bytes()
        except OSError as exc:
            raise InvalidImageError(f"cannot read {source}: {exc.strerror}") from None
    raise InvalidImageError(f"expected a PIL image, encoded bytes, a data: URL or a path, got {type(source).__name__}")


def base64_payload(text: str, what: str) -> bytes:
    """``text`` base64-decoded; :class:`InvalidImageError` naming ``what`` where it is not base64."""
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise InvalidImageError(f"{what} is not valid base64: {exc}") from None


def media_item(media: Any) -> MediaItem:
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


class ProcessorInterface(BaseImageProcessor):  # type: ignore[misc,valid-type]
    """The checkpoint's vision processor (K2.5 / K2.6 / K3) as engines call it; subclasses give
    the pixels (:meth:`_pixels`).

    ``media_proc_cfg``: a checkpoint's (the keys its processor reads override ``preset``'s values;
    other keys are kept as given and mean nothing here). ``preset``: the base for everything else
    (K3's transparency rule and prompts: ``preset="kimi-k3"``).
    """

    model_input_names = ["pixel_values", "grid_thws"]  # noqa: RUF012 (transformers' class attribute)
    # The base of a processor whose config names no preset (from_dict; make_chunk_prompt on the class).
    default_preset = "kimi-k2.5"
    # How this install gets torch, for return_tensors="pt" where it lacks it.
    torch_install = "pip install torch"

    def __init__(
        self, media_proc_cfg: Mapping[str, Any] | None = None, preset: str | Preset | None = None, **kwargs: Any
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

    # -- the pixels: a subclass's -----------------------------------------------------------------

    def _pixels(self, items: Sequence[MediaItem], output: PixelOutput) -> tuple[Any, np.ndarray]:
        """``(pixel_values, grid_thws)`` of ``items`` (at least one) in order: ``output``'s array
        ``(ΣN, 3, p, p)`` (float32 ``pixel_values`` or uint8 ``pixel_patches``; numpy or torch) and
        int64 ``(n, 3)``; the first bad item raises its typed error."""
        raise NotImplementedError

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
        preset = owner.preset if isinstance(owner, ProcessorInterface) else get_preset(owner.default_preset)
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
        return self.get_resize_config(media)["num_tokens"]

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
        self.check_tensor_type(return_tensors)
        items = [media_item(item) for item in ([medias] if isinstance(medias, Mapping) else list(medias))]
        return batch_feature(self._keyed(items, "grid_thws", output), return_tensors)

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
        self.check_tensor_type(return_tensors)
        items = [("image", image) for image in flat_images(images)]
        return batch_feature(self._keyed(items, "image_grid_thw", "pixel_values"), return_tensors)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: Mapping | None = None) -> int:
        """Patches (``grid_h * grid_w``, before merging) of a ``height x width`` image."""
        return navit_target_size(width, height, self.preset).num_patches

    def _merge_and_standardize_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        """transformers' image kwargs with this processor's values filled in (``Kimi_K25Processor.
        _get_num_multimodal_tokens`` reads ``merge_size`` there); the sizes are the config's."""
        return {**kwargs, "merge_size": self.merge_size, "patch_size": self.patch_size}

    def check_tensor_type(self, return_tensors: Any) -> None:
        """Refuse, before any work, a ``return_tensors`` this install cannot honour: anything but
        None/"np"/"pt", and "pt" without torch (saying how to get it)."""
        kind = None if return_tensors is None else str(getattr(return_tensors, "value", return_tensors))
        if kind not in (None, "np", "pt"):
            raise ValueError(f"return_tensors must be None, 'np' or 'pt', got {return_tensors!r}")
        if kind == "pt" and importlib.util.find_spec("torch") is None:
            raise ModuleNotFoundError(
                f"return_tensors='pt' needs torch, which this install lacks: {self.torch_install} "
                "(return_tensors='np' gives numpy arrays)",
                name="torch",
            )

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
    def from_dict(cls, config_dict: Mapping[str, Any], **kwargs: Any) -> Any:
        """From a ``preprocessor_config.json``'s content (a checkpoint's or one :meth:`save_pretrained`
        wrote); ``kwargs`` override it (``preset=``, and a subclass's own arguments). A K3
        checkpoint's config (its processor class named K3) takes the ``kimi-k3`` preset where none
        is given."""
        config = {**config_dict, **kwargs}
        config.setdefault("preset", config_preset(config) or cls.default_preset)
        for key in ("image_processor_type", "auto_map", "processor_class", "return_unused_kwargs"):
            config.pop(key, None)  # transformers' bookkeeping, not settings
        return cls(media_proc_cfg=config.pop("media_proc_cfg", None), **config)

    @classmethod
    def from_pretrained(
        cls, name: str | Path, *, revision: str | None = None, trust_remote_code: bool = False, **kwargs: Any
    ) -> Any:
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

    def _keyed(self, items: Sequence[MediaItem], grid_key: str, output: PixelOutput) -> dict[str, Any]:
        """The pixels of ``items`` as ``pixel_values`` and their grids under ``grid_key`` ({} for none)."""
        if not items:
            return {}
        pixels, grids = self._pixels(items, output)
        return {"pixel_values": pixels, grid_key: grids}


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


def flat_images(images: Any) -> list[Any]:
    """An image, a list of images, or a list of per-sample lists -> one flat list."""
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        return [images]
    return [image for item in images for image in (item if isinstance(item, (list, tuple)) else [item])]


def batch_feature(data: dict[str, Any], return_tensors: Any) -> Any:
    """``data`` as the reference returns it: a ``BatchFeature`` where transformers is installed,
    else a dict; torch tensors for ``"pt"``, numpy for None or ``"np"`` (checked by
    :meth:`ProcessorInterface.check_tensor_type` first)."""
    if BatchFeature is not None:
        return BatchFeature(data=data, tensor_type=return_tensors)
    if return_tensors in (None, "np"):
        return data
    import torch

    return {key: torch.as_tensor(value) for key, value in data.items()}
