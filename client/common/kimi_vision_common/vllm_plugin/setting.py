"""``KIMI_PREP_VLLM``, the one setting the vLLM plugin reads: a mode (``local``, ``off``) or a
server's address (:mod:`~kimi_vision_common.remote_setting`), the opt-in to a vLLM outside the
proven versions, and the class each mode has vLLM build (:data:`PROCESSORS`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..remote_setting import PLUGIN_OPTIONS, parsed_query, split_remote

SETTING = "KIMI_PREP_VLLM"
# The setting's values -> the module and class of the processor vLLM builds for its Kimi models
# (None: vLLM's own). The first is the default; "remote" stands for any server address.
PROCESSORS: dict[str, tuple[str, str] | None] = {
    "local": ("kimi_vision_prep.vllm_processor", "VllmKimiProcessor"),
    "off": None,
    "remote": ("kimi_vision_client.processors.vllm_processor", "VllmRemoteKimiProcessor"),
}
MODES = tuple(PROCESSORS)


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


def processor_class(mode: str) -> type:
    """The class :data:`PROCESSORS` names for ``mode``, imported (ImportError where its package is
    not installed)."""
    module_name, class_name = PROCESSORS[mode]  # type: ignore[misc]
    return getattr(importlib.import_module(module_name), class_name)
