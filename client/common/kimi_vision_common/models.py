"""The served models' names, part of the contract between the model repository and its clients.

Each served preset gets the models ``<prefix>_<kind>`` (``kimi-k2.5`` -> ``kimi_k25_vision``, ...);
the repository renderer (``kimi_vision_server.render.repository``) builds them from these names, and
a client can tell a model this project renders from a name it has never heard of.
"""

from __future__ import annotations

from .presets import KIMI_K3, KIMI_K25

# The presets the model repository serves. kimi-k2.6 is kimi-k2.5's preset under another name: served once.
SERVED_PRESETS: tuple[str, ...] = (KIMI_K25.name, KIMI_K3.name)
# The models of each served preset (``patchify`` only in a CPU rendering, where the C step ends the
# vision ensembles), and the chaining example's two models (one preset's only).
PRESET_MODEL_KINDS: tuple[str, ...] = (
    "decode",
    "preprocess",
    "patchify",
    "vision",
    "vision_u8",
    "vision_fused",
    "vision_fused_u8",
    "video",
    "video_chunk",
    "tokens",
)
PATCH_EMBED_MODEL = "kimi_patch_embed"
EMBED_ENSEMBLE_KIND = "vision_embed"


def model_prefix(preset_name: str) -> str:
    """The model-name prefix of a served preset: ``kimi-k2.5`` -> ``kimi_k25``, ``kimi-k3`` -> ``kimi_k3``."""
    return preset_name.replace(".", "").replace("-", "_")


def is_project_model(name: str) -> bool:
    """Whether some rendering of the repository has a model called ``name``."""
    if name == PATCH_EMBED_MODEL:
        return True
    kinds = (*PRESET_MODEL_KINDS, EMBED_ENSEMBLE_KIND)
    return any(name == f"{model_prefix(preset)}_{kind}" for preset in SERVED_PRESETS for kind in kinds)


# What `kimi-prep serve` serves unless told otherwise: each served preset's image ensembles (float32
# and uint8 wire), which bring their decode and preprocess steps; `--all` serves every model.
DEFAULT_SERVED_KINDS = ("vision", "vision_u8")


def default_model_names() -> tuple[str, ...]:
    """The models ``kimi-prep serve`` serves by default (their steps come with them)."""
    return tuple(f"{model_prefix(name)}_{kind}" for name in SERVED_PRESETS for kind in DEFAULT_SERVED_KINDS)
