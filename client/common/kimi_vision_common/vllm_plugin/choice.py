"""The first patch of vLLM: the class vLLM builds for its Kimi models' image processor, ours
(the one the setting names, :func:`~.setting.processor_class`) for a Kimi checkpoint, vLLM's for any
other (:func:`build_ours_for_kimi`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from typing import Any

from .checks import model_preset
from .setting import processor_class

log = logging.getLogger("kimi_vision_prep.vllm")

# Where vLLM 0.32 builds image processors, and the class its Kimi models ask it for.
BUILDER_MODULE = "vllm.transformers_utils.processor"
PROCESSOR_MODULE = "vllm.transformers_utils.processors.kimi_k25_vision_fused"
PROCESSOR_NAME = "KimiK25FusedVisionProcessor"
PROCESSOR_USERS = ("vllm.model_executor.models.kimi_k25", "vllm.models.kimi_k3.common.mm_preprocess")


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
    from ..processor_api import HUB_OPTIONS

    hub = {key: kwargs[key] for key in (*HUB_OPTIONS, "revision") if key in kwargs}
    if model_preset(name, hub) is not None:
        return True
    log.info("kimi-vision-prep: %s is not a Kimi checkpoint; vLLM's own processor is built for it", name)
    return False
