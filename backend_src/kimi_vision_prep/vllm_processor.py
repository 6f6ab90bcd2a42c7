"""``VllmKimiProcessor``: :class:`~.processor.KimiVisionProcessor` as vLLM builds and calls it.

The vLLM plugin (:mod:`kimi_vision_common.vllm_plugin`, ``KIMI_PREP_VLLM=local``) has vLLM build
this class where its Kimi models ask for their image processor; this module loads numba, so only a
process that builds one imports it.
"""

from __future__ import annotations

from kimi_vision_common.vllm_plugin.calls import VllmCalls

from .processor import KimiVisionProcessor


class VllmKimiProcessor(VllmCalls, KimiVisionProcessor):
    """The library's processor with vLLM's calls (:class:`~kimi_vision_common.vllm_plugin.calls.VllmCalls`)."""
