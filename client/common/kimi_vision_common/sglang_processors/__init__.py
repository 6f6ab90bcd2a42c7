"""SGLang's Kimi-K2.5 / K3 image processing answered by this project's processor, in the SGLang
process (the library) or by a server (the client's remote processor).

SGLang imports the package ``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE`` names and registers the
processor classes of its modules over its own (``import_processors(package, overwrite=True)``)::

    SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=kimi_vision_common.sglang_processors python -m sglang.launch_server ...

:mod:`.kimi` subclasses SGLang's ``KimiK2_5VLImageProcessor`` and ``KimiK3ImageProcessor``: SGLang
loads the images and writes the prompt as it always does; every image's pixels are ours, on every
host (SGLang's inexact GPU branches, K2.5's GPU call and K3's deferred GPU preprocessing, are never
taken). ``KIMI_PREP_SGLANG``, the one setting: ``local`` (default: the library,
``kimi_vision_prep``), ``off`` (SGLang's own), or a server's gRPC address with the remote
processor's options, as ``KIMI_PREP_VLLM`` takes them (``grpc://host:8001?deadline_s=30&fallback=local``).

Only on the SGLang versions this was proven on (:data:`PROVEN_SGLANG`): elsewhere one warning and
SGLang's own processing. SGLang skips a module of the package that fails to import with only a
warning; this package's own import raises instead, naming what is missing, so a deployment that
asked for it never runs without it unnoticed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import Any

from ..remote_setting import split_remote

log = logging.getLogger("kimi_vision_prep.sglang")

SETTING = "KIMI_PREP_SGLANG"
# (major, minor, patch) releases of SGLang whose Kimi processors these classes were proven against
# (tests/sglang, `make test`).
PROVEN_SGLANG = ((0, 5, 23),)
# SGLang's modules the subclasses build on.
SGLANG_MODULES = ("sglang.srt.multimodal.processors.kimi_k25", "sglang.srt.multimodal.processors.kimi_k3")
# The setting's modes -> the module and class of the processor whose pixels SGLang gets.
PROCESSORS = {
    "local": ("kimi_vision_prep.processor", "KimiVisionProcessor"),
    "remote": ("kimi_vision_client.remote_processor", "RemoteKimiProcessor"),
}


def sglang_version() -> tuple[int, ...] | None:
    """The installed SGLang's release as numbers, or None where none is installed."""
    try:
        text = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def chosen(value: str) -> tuple[str, dict[str, Any]] | None:
    """A value of the setting -> ``(mode, remote options)`` (mode ``local`` or ``remote``, with the
    address under ``url``), None for ``off``; ValueError for anything else."""
    if value == "off":
        return None
    if value == "local":
        return "local", {}
    address, options, plugin_options = split_remote(value)
    if plugin_options:
        raise ValueError(f"{', '.join(plugin_options)} is an option of KIMI_PREP_VLLM, not of {SETTING}")
    return "remote", {"url": address, **options}


def active_choice() -> tuple[str, dict[str, Any]] | None:
    """What the setting asks for where it can run here, else None (one warning says why). Raises
    ImportError naming what is missing where it was asked for and cannot be imported."""
    version = sglang_version()
    if version is None:  # imported outside SGLang (its documentation, a listing): nothing to register
        return None
    value = os.environ.get(SETTING, "local")
    try:
        choice = chosen(value)
    except ValueError as exc:  # SGLang does not start: the deployment asked for something that is not
        raise ValueError(f"{SETTING}={value!r}: {exc}") from None
    if choice is None:
        return None
    if version not in PROVEN_SGLANG:
        proven = ", ".join(".".join(map(str, release)) for release in PROVEN_SGLANG)
        log.warning(
            "kimi-vision-prep: SGLang %s is not one these processors were proven on (%s); SGLang's own "
            "Kimi processing is used",
            ".".join(map(str, version)),
            proven,
        )
        return None
    needed = [PROCESSORS[choice[0]][0]]
    if choice[1].get("fallback") == "local":
        needed.append(PROCESSORS["local"][0])
    for name in (*SGLANG_MODULES, *needed):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(
                f"{__name__} ({SETTING}={value}) needs {name}, which does not import here: {exc} "
                "(the library: pip install kimi-vision-prep; a server: pip install kimi-vision-client)"
            ) from exc
    return choice


# Decided once, when SGLang imports the package (before its modules).
CHOICE = active_choice()
