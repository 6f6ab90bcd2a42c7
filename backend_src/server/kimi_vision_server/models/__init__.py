"""The Triton Python models the rendered ``model.py`` files name (``images``: decode, preprocess,
fused, patch embed; ``media``: video, video chunk, tokens), their parts (components, the execute
contract, requests, tensors, config, warm-up, metrics) and, in ``patchify/``, the C step. Imports the
library and the package root (``settings``, ``host``); never ``render``, ``launch`` or ``watch``.
"""

from __future__ import annotations

import importlib
from typing import Any

# The image models by the path a repository rendered before this folder's split names them
# (``from kimi_vision_server.models import DecodeModel``): such a repository keeps loading.
_RENDERED_BEFORE = dict.fromkeys(("DecodeModel", "PreprocessModel", "FusedVisionModel", "PatchEmbedModel"), ".images")


def __getattr__(name: str) -> Any:
    """Load ``name``'s module on first use (PEP 562): importing the folder stays cheap."""
    if name not in _RENDERED_BEFORE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_RENDERED_BEFORE[name], __name__), name)
