"""A server's address as the engines' settings take it (``KIMI_PREP_VLLM``, ``KIMI_PREP_SGLANG``):
``host:port``, ``grpc://host:port``, several (``grpc://h1:p1,h2:p2``) or ``dns:///name:port``, the
remote processor's options (:data:`REMOTE_OPTIONS`) as a URL query, the vLLM plugin's own options
(:data:`PLUGIN_OPTIONS`) beside them. The one grammar both engine folders
(:mod:`~kimi_vision_common.vllm_plugin`, :mod:`~kimi_vision_common.sglang_processors`) read.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

from .wire import BALANCES

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
# outside the versions it was proven on (vllm_plugin.checks.PROVEN_VLLM).
PLUGIN_OPTIONS: dict[str, tuple[str, ...]] = {"unproven_vllm": ("no", "yes")}
HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")
DNS_TARGET = "dns:///"


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
