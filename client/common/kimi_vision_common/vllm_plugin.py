"""vLLM plugin: vLLM's Kimi-K2.5 / K2.6 / K3 image processing answered by this project's processor,
in the vLLM process (the library) or by a server (the client's remote processor).

Installed with either (both depend on this package) as the ``vllm.general_plugins`` entry point
``kimi_vision_prep``, which vLLM loads in each of its processes (API server, engine core, workers;
``VLLM_PLUGINS`` filters them). :func:`register` does three things, all only where vLLM's Kimi files
are where this module knows them and this vLLM is one it runs on (below; elsewhere one warning and
vLLM's own processing, never a crash):

1. **The processor.** vLLM's Kimi models build their image processor with
   ``cached_get_image_processor(..., processor_cls_overrides=KimiK25FusedVisionProcessor)``; that
   function is wrapped (where vLLM defines it and in the Kimi model modules already imported) so
   that this one call builds the class the setting names instead. Other models' calls go through
   unchanged.
2. **Encoded JPEGs reach it encoded.** Once such a processor has been built in a process (that
   process serves a Kimi model), a JPEG that would be handed over decoded is handed over opened
   only, as vLLM's ``MediaWithBytes`` (the image Pillow opened, the file's bytes): in the chat
   path (``ImageMediaIO.load_bytes``: bytes, ``data:`` URLs, files), and for an opened PIL image in
   a request's ``multi_modal_data`` (the parser), so that neither the loader, the parser nor the
   processor cache's hasher (which keys a ``MediaWithBytes`` by its bytes) decodes it first. A JPEG
   of mode RGB or L is deferred (vLLM converts L to RGB, as the processor does); where vLLM's path
   turns it to its EXIF orientation it is handed over as a :class:`~.orientation.TurnedJpeg` (the
   turned size; the processor turns the decoded pixels). Any other image takes vLLM's path
   unchanged, and the processor uses the pixels vLLM loaded.
3. **A fault of the server stays one.** vLLM wraps whatever a processor raises in a ``ValueError``
   of its own words (``InputProcessingContext.call_hf_processor``), which its API server answers
   400; ours raise a fault of the server's state as vLLM's ``RetryableRequestError`` and a verdict
   on an image as a ``ValueError`` naming the library's class and reason (:mod:`.vllm_calls`), and
   that wrapper is wrapped so it passes both as they are: 503 (retry) and 400 with our words.

``KIMI_PREP_VLLM``, the one setting the plugin reads: ``local`` (default) processes in the vLLM
process (``kimi_vision_prep.vllm_processor.VllmKimiProcessor``: the library); ``off`` leaves vLLM as
it is; a server's gRPC address (``host:port`` or ``grpc://host:port``; several replicas as
``grpc://h1:8001,h2:8001`` or one ``dns:///name:8001``; options as a query:
``grpc://host:8001?deadline_s=30&fallback=local``, :func:`remote_settings`) sends the pixels to the
served models (``kimi_vision_client.processors.vllm_processor.VllmRemoteKimiProcessor``: the client).
:data:`PROCESSORS` maps the values to the class built.

Where it runs (:mod:`.vllm_checks`): only on the vLLM versions it was proven on
(:data:`~.vllm_checks.PROVEN_VLLM`; elsewhere one warning and vLLM's own processing, unless the
setting's :data:`PLUGIN_OPTIONS` ``unproven_vllm=yes`` opts in: ``local?unproven_vllm=yes``), where
vLLM's media classes behave as it assumes (checked at register; else one warning and vLLM's own),
never with vLLM's Rust frontend (``VLLM_USE_RUST_FRONTEND``: it processes the API server's inputs
itself; one warning that the plugin is inactive), and only for a checkpoint whose ``config.json``
names a Kimi model type (``vllm_checks.MODEL_PRESETS``): another model asking vLLM for the same
class keeps vLLM's. Where vLLM charges a request's decoded bytes (vLLM 0.33's
``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES``), a deferred JPEG is charged from its header exactly as
vLLM's loader charges it before decoding, so a request over the budget is refused as stock refuses it.

This module imports neither numba nor vLLM's Kimi files: vLLM's CPU workers load the plugins before
they scan every loaded module for Triton kernels to replace, a scan that fails on llvmlite's
function wrappers (numba's), so the processor's module loads only where vLLM builds a processor.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import logging
import os
import re
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any

from PIL import Image

from .orientation import TurnedJpeg, exif_orientation
from .pillow_open import unloaded_jpeg_bytes
from .vllm_checks import (
    RUST_FRONTEND,
    behaviour_differences,
    decode_charge,
    installed_vllm_version,
    is_proven,
    model_preset,
    proven_range,
    rust_frontend_set,
)
from .wire import BALANCES

log = logging.getLogger("kimi_vision_prep.vllm")

SETTING = "KIMI_PREP_VLLM"
# The setting's values -> the module and class of the processor vLLM builds for its Kimi models
# (None: vLLM's own). The first is the default; "remote" stands for any server address.
PROCESSORS: dict[str, tuple[str, str] | None] = {
    "local": ("kimi_vision_prep.vllm_processor", "VllmKimiProcessor"),
    "off": None,
    "remote": ("kimi_vision_client.processors.vllm_processor", "VllmRemoteKimiProcessor"),
}
MODES = tuple(PROCESSORS)
# The remote processor's options a setting's query may give: a type, or the values allowed (the
# first is the default). fallback=local answers in process what the server cannot (the library).
# The shared_memory option's values -> the remote processor's ``shared_memory`` argument.
SHARED_MEMORY = {"auto": None, "yes": True, "no": False}
REMOTE_OPTIONS: dict[str, type | tuple[str, ...]] = {
    "deadline_s": float,
    "concurrency": int,
    "fallback": ("none", "local"),
    "shared_memory": tuple(SHARED_MEMORY),
    "balance": BALANCES,
}
# Options every mode but off takes, in the same query: unproven_vllm=yes runs the plugin on a vLLM
# outside the versions it was proven on (vllm_checks.PROVEN_VLLM).
PLUGIN_OPTIONS: dict[str, tuple[str, ...]] = {"unproven_vllm": ("no", "yes")}
HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")
DNS_TARGET = "dns:///"
# Where vLLM 0.32 builds image processors, and the class its Kimi models ask it for.
BUILDER_MODULE = "vllm.transformers_utils.processor"
PROCESSOR_MODULE = "vllm.transformers_utils.processors.kimi_k25_vision_fused"
PROCESSOR_NAME = "KimiK25FusedVisionProcessor"
PROCESSOR_USERS = ("vllm.model_executor.models.kimi_k25", "vllm.models.kimi_k3.common.mm_preprocess")
# Modes whose pixels vLLM's loader and the processor agree on without a conversion of their own.
DEFERRED_MODES = ("RGB", "L")


# The attribute that marks an error our processors raised for vLLM (vllm_calls), passed through
# vLLM's wrapper of processor errors (:func:`pass_server_faults`).
OURS = "raised_by_kimi_vision_prep"


class KimiProcessingState:
    """Whether this process serves a Kimi model through the plugin (set when the first
    processor the setting names is built): only then are JPEGs handed over encoded."""

    defer_jpegs = False


@dataclass(frozen=True)
class Setting:
    """A value of the setting: the mode (one of :data:`MODES`) and whether it opts in to a vLLM
    outside the proven versions."""

    mode: str
    unproven_vllm: bool = False


def parse_setting(value: str) -> Setting:
    """A value of the setting -> :class:`Setting`; ValueError for anything that is not ``local``,
    ``off`` or a server's address (:func:`remote_settings`), each with the options it takes."""
    base, _, query = value.partition("?")
    if base in PROCESSORS and base != "remote":
        options = parsed_query(query, PLUGIN_OPTIONS if base == "local" else {})
        return Setting(base, options.get("unproven_vllm") == "yes")
    _, _, plugin_options = split_remote(value)
    return Setting("remote", plugin_options.get("unproven_vllm") == "yes")


def setting_mode(value: str) -> str:
    """The mode a value of the setting names: one of :data:`MODES` (a server address: ``remote``);
    ValueError for anything else."""
    return parse_setting(value).mode


def remote_settings(value: str) -> tuple[str, dict[str, Any]]:
    """A server address of the setting -> ``(address, options)``: ``host:port``, ``grpc://host:port``,
    several (``grpc://h1:p1,h2:p2``) or ``dns:///name:port``, the remote processor's options
    (:data:`REMOTE_OPTIONS`) as a URL query (:data:`PLUGIN_OPTIONS` may stand beside them);
    ValueError otherwise."""
    address, options, _ = split_remote(value)
    return address, options


def split_remote(value: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A server address of the setting -> ``(address, remote processor's options, plugin's options)``."""
    address, _, query = value.partition("?")
    hosts = address.removeprefix(DNS_TARGET) if address.startswith(DNS_TARGET) else address.removeprefix("grpc://")
    if (
        not hosts
        or not all(HOST_PORT.match(host) for host in hosts.split(","))
        or (address.startswith(DNS_TARGET) and "," in hosts)
    ):
        raise ValueError(
            f"{value!r} is not local, off or a server's gRPC address "
            "(host:port, grpc://host:port,host:port?..., dns:///name:port?...)"
        )
    options = parsed_query(query, {**REMOTE_OPTIONS, **PLUGIN_OPTIONS})
    plugin_options = {key: options.pop(key) for key in PLUGIN_OPTIONS if key in options}
    return (address if address.startswith(DNS_TARGET) else hosts), options, plugin_options


def parsed_query(query: str, known: dict[str, type | tuple[str, ...]]) -> dict[str, Any]:
    """A URL query's options, each of ``known`` (a type, or the values allowed); ValueError otherwise."""
    options: dict[str, Any] = {}
    for key, text in urllib.parse.parse_qsl(query, strict_parsing=bool(query)):
        kind = known.get(key)
        if kind is None:
            raise ValueError(f"unknown option {key!r} (known: {', '.join(known) or 'none'})")
        if isinstance(kind, tuple) and text not in kind:
            raise ValueError(f"{key} is one of {', '.join(kind)}, not {text!r}")
        try:
            options[key] = text if isinstance(kind, tuple) else kind(text)
        except ValueError:
            raise ValueError(f"{key} is a number, not {text!r}") from None
    return options


def processor_class(mode: str) -> type:
    """The class :data:`PROCESSORS` names for ``mode``, imported (ImportError where its package is
    not installed)."""
    module_name, class_name = PROCESSORS[mode]  # type: ignore[misc]
    return getattr(importlib.import_module(module_name), class_name)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (every vLLM process calls it once)."""
    try:
        setting = parse_setting(os.environ.get(SETTING, MODES[0]))
    except ValueError as exc:
        log.warning("kimi-vision-prep: %s=%r: %s; vLLM's own Kimi processor is used", SETTING, os.environ[SETTING], exc)
        return
    if PROCESSORS[setting.mode] is None:
        return
    if rust_frontend_set():
        log.warning(
            "kimi-vision-prep: %s is set: vLLM's Rust frontend processes the requests' images itself, "
            "the plugin is inactive (vLLM's own Kimi processing)",
            RUST_FRONTEND,
        )
        return
    try:
        refusal = why_not_here(setting)
        if refusal is None:
            build_ours_for_kimi(setting.mode)
            defer_encoded_jpegs()
            pass_server_faults()
    except (ImportError, AttributeError) as exc:
        refusal = f"this vLLM's Kimi files are not where the plugin knows them ({type(exc).__name__}: {exc})"
    if refusal is not None:
        log.warning("kimi-vision-prep: %s; vLLM's own Kimi processor is used", refusal)


def why_not_here(setting: Setting) -> str | None:
    """Why the plugin does not run in this vLLM (a version outside the proven ones, not opted in;
    media classes that behave otherwise), or None."""
    version = installed_vllm_version()
    if not is_proven(version):
        if not setting.unproven_vllm:
            return (
                f"vLLM {version} is not one the plugin was proven on ({proven_range()}; "
                f"the option unproven_vllm=yes of {SETTING} runs it anyway)"
            )
        log.info("kimi-vision-prep: vLLM %s, outside %s, by the setting's unproven_vllm=yes", version, proven_range())
    differences = behaviour_differences()
    if differences:
        return "this vLLM behaves otherwise than the plugin relies on: " + "; ".join(differences)
    return None


def pass_server_faults() -> None:
    """Wrap vLLM's ``InputProcessingContext.call_hf_processor`` (which turns any error into a
    ``ValueError`` of its own words, a 400) so that what one of ours raised (marked
    :data:`OURS`) passes as it is: a ``RetryableRequestError`` for a fault of the
    server's state (vLLM answers 503), a ``VLLMServerError`` for anything else not the request's
    (500), the ``ValueError`` naming the library's class and reason for a verdict (400). Any other
    processor's errors are wrapped as before."""
    from vllm.multimodal.processing.context import InputProcessingContext

    call_hf_processor = InputProcessingContext.call_hf_processor

    def passing_ours(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call_hf_processor(self, *args, **kwargs)
        except ValueError as exc:
            raised = exc.__cause__
            if getattr(raised, OURS, False):
                raise raised from raised.__cause__  # type: ignore[misc]
            raise

    InputProcessingContext.call_hf_processor = passing_ours


def build_ours_for_kimi(mode: str) -> None:
    """Wrap vLLM's ``cached_get_image_processor`` where it is defined and in the Kimi model modules
    already imported (the others bind the wrapper when they load): asked for vLLM's Kimi class for
    a Kimi checkpoint (:func:`is_kimi`), it builds ``mode``'s class (:func:`processor_class`)
    through vLLM's own ``get_image_processor``, imported then (where that import fails: one
    warning, and vLLM's class)."""
    builder = importlib.import_module(BUILDER_MODULE)
    get_image_processor = builder.get_image_processor
    cached_get_image_processor = builder.cached_get_image_processor  # AttributeError where this vLLM moved it
    if importlib.util.find_spec(PROCESSOR_MODULE) is None:
        raise ImportError(f"no module {PROCESSOR_MODULE}")

    def build(name: str, *args: Any, processor_cls_overrides: Any = None, **kwargs: Any) -> Any:
        if getattr(processor_cls_overrides, "__name__", None) == PROCESSOR_NAME and is_kimi(name, kwargs):
            try:
                processor_cls_overrides = processor_class(mode)
            except ImportError as exc:
                log.warning("kimi-vision-prep: cannot load %s's processor (%s); vLLM's own is used", mode, exc)
        return get_image_processor(name, *args, processor_cls_overrides=processor_cls_overrides, **kwargs)

    cached_build = functools.lru_cache(build)
    for user in (BUILDER_MODULE, *PROCESSOR_USERS):
        module = sys.modules.get(user)
        if module is not None and getattr(module, "cached_get_image_processor", None) is cached_get_image_processor:
            module.cached_get_image_processor = cached_build


def is_kimi(name: str, kwargs: dict[str, Any]) -> bool:
    """Whether the checkpoint ``name`` (with vLLM's ``revision`` and Hub options) is a Kimi model by
    its ``config.json``'s ``model_type``: another model that asks for vLLM's Kimi class keeps it."""
    from .processor_api import HUB_OPTIONS

    hub = {key: kwargs[key] for key in (*HUB_OPTIONS, "revision") if key in kwargs}
    if model_preset(name, hub) is not None:
        return True
    log.info("kimi-vision-prep: %s is not a Kimi checkpoint; vLLM's own processor is built for it", name)
    return False


def defer_encoded_jpegs() -> None:
    """Wrap vLLM's image loader and its parser of ``image`` / ``vision_chunk`` data so that a
    JPEG is handed over opened, not decoded (the module docstring says which)."""
    from vllm.multimodal.media import MediaWithBytes
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser

    load_bytes = ImageMediaIO.load_bytes
    parse_images = MultiModalDataParser._parse_image_data
    parse_chunks = MultiModalDataParser._parse_vision_chunk_data

    def load_bytes_deferred(self: Any, data: bytes) -> Any:
        if KimiProcessingState.defer_jpegs and self.image_mode in ("RGB", None):
            image = opened_jpeg(io.BytesIO(data))
            if image is not None and within_pixel_limit(image):
                charge_decode_budget(self, image)
                return MediaWithBytes(as_loaded(image, data), data, io_config(image, self))
        return load_bytes(self, data)

    def wrapped(image: Any, transposed: bool) -> Any:
        """An opened JPEG as vLLM's loader hands it over (``transposed``: where vLLM's path applies
        its EXIF orientation); anything else as it is."""
        if not (KimiProcessingState.defer_jpegs and isinstance(image, Image.Image)):
            return image
        if isinstance(image, TurnedJpeg):  # the chat loader's, unwrapped by vLLM for a vision chunk
            return MediaWithBytes(image, image.data)
        if opened_jpeg(image) is None:
            return image
        data = unloaded_jpeg_bytes(image)
        if data is None:
            return image
        if transposed:
            return MediaWithBytes(as_loaded(image, data), data)
        # Its stored pixels, unturned: keyed apart from the same file through the loader, which turns them.
        unturned = exif_orientation(image) != 1
        return MediaWithBytes(image, data, {"exif_orientation": "not applied"} if unturned else None)

    def parse_images_deferred(self: Any, data: Any) -> Any:
        # vLLM's parser turns each PIL image to its EXIF orientation and to RGB
        if isinstance(data, list):
            return parse_images(self, [wrapped(item, transposed=True) for item in data])
        return parse_images(self, wrapped(data, transposed=True))

    def parse_chunks_deferred(self: Any, data: Any) -> Any:
        # a vision chunk's image reaches the processor as it is (no EXIF orientation applied)
        items = [data] if isinstance(data, dict) else data
        if isinstance(items, list):
            data = [
                {**item, "image": wrapped(item["image"], transposed=False)}
                if isinstance(item, dict) and item.get("type") == "image"
                else item
                for item in items
            ]
        return parse_chunks(self, data)

    ImageMediaIO.load_bytes = load_bytes_deferred
    MultiModalDataParser._parse_image_data = parse_images_deferred
    MultiModalDataParser._parse_vision_chunk_data = parse_chunks_deferred


def opened_jpeg(source: Any) -> Image.Image | None:
    """The JPEG ``source`` (a file object or an opened image), opened and not decoded, where its
    mode is one vLLM's loading and the processor agree on (RGB, L); None for anything else, or what
    Pillow cannot open (vLLM's loader gives its own verdict on that)."""
    try:
        image = source if isinstance(source, Image.Image) else Image.open(source, formats=["JPEG"])
    except Exception:  # Pillow raises what its parsers meet
        return None
    return image if image.format == "JPEG" and image.mode in DEFERRED_MODES else None


def as_loaded(image: Image.Image, data: bytes) -> Image.Image:
    """What vLLM's loader makes of the opened JPEG ``image`` of ``data``, still undecoded: the image
    itself, or a :class:`~.orientation.TurnedJpeg` where its EXIF orientation turns it."""
    orientation = exif_orientation(image)
    return image if orientation == 1 else TurnedJpeg(data, image, orientation)


def within_pixel_limit(image: Image.Image) -> bool:
    """vLLM's ``VLLM_MAX_IMAGE_PIXELS`` holds (a larger image takes vLLM's loader, which refuses it)."""
    from vllm import envs

    limit = envs.VLLM_MAX_IMAGE_PIXELS
    return limit <= 0 or image.width * image.height <= limit


def charge_decode_budget(media_io: Any, image: Image.Image) -> None:
    """Charge the request's decode budget where vLLM's loader has one (vLLM 0.33), as the loader
    charges an image it is about to decode (:func:`~.vllm_checks.decode_charge`; ValueError, vLLM's
    own, where the request goes over it)."""
    budget = getattr(media_io, "decoded_budget", None)
    if budget is not None:
        budget.charge(decode_charge(image))


def io_config(image: Image.Image, media_io: Any) -> dict[str, Any] | None:
    """The ``io_config`` vLLM's loader records for ``image`` (where it converts the mode), so that
    the processor cache's key is the one vLLM's own loading gives."""
    if media_io.image_mode in (None, image.mode):
        return None
    return {"image_mode": media_io.image_mode, "rgba_background_color": media_io.rgba_background_color}
