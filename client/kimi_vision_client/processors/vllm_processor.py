"""``VllmRemoteKimiProcessor``: the remote processor as vLLM builds and calls it.

The vLLM plugin (:mod:`kimi_vision_common.vllm_plugin`) has vLLM build this class where its Kimi
models ask for their image processor and ``KIMI_PREP_VLLM`` holds a server's address
(``host:port`` or ``grpc://host:port?deadline_s=...&concurrency=...&fallback=...&shared_memory=...``):
the pixels of every vLLM process's Kimi requests are then the server's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kimi_vision_common.processor_api import HUB_OPTIONS
from kimi_vision_common.remote_setting import SHARED_MEMORY
from kimi_vision_common.vllm_plugin.calls import VllmCalls
from kimi_vision_common.vllm_plugin.setting import SETTING, processor_class, remote_settings

from ..remote_processor import RemoteKimiProcessor


class VllmRemoteKimiProcessor(VllmCalls, RemoteKimiProcessor):
    """The client's remote processor with vLLM's calls (:class:`~kimi_vision_common.vllm_plugin.calls.VllmCalls`),
    its server and options from the setting; ``fallback=local`` builds the library's processor
    for the same checkpoint to answer what the server cannot."""

    @classmethod
    def from_pretrained(cls, name: str | Path, **kwargs: Any) -> Any:
        url, options = remote_settings(os.environ[SETTING])
        if options.pop("fallback", "none") == "local":
            loading = {key: kwargs[key] for key in (*HUB_OPTIONS, "revision") if key in kwargs}
            kwargs["fallback"] = processor_class("local").from_pretrained(name, **loading)
        if "shared_memory" in options:
            options["shared_memory"] = SHARED_MEMORY[options["shared_memory"]]
        return super().from_pretrained(name, url=url, **options, **kwargs)
