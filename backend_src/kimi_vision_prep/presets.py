"""Preprocessing presets: the single source of truth for every model constant.

A preset is a frozen dataclass. Triton ``config.pbtxt`` parameters map one-to-one onto its field
names (see :func:`preset_from_parameters`), so a new NaViT-style model is a new preset, not a code
change.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import InvalidPresetError

Transparency = Literal["convert_rgb", "chessboard"]


@dataclass(frozen=True)
class Preset:
    """Constants of one checkpoint's image processor (spec section 1)."""

    name: str
    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # "convert_rgb": Pillow convert("RGB") before resize, alpha dropped (K2.5).
    # "chessboard": resize in the source mode, then composite alpha onto a chessboard (K3).
    transparency: Transparency = "convert_rgb"
    chessboard_square: int = 8
    chessboard_light: int = 255
    chessboard_dark: int = 180
    video_patch_limit_per_frame: int = 4096
    video_frames_per_chunk: int = 4

    def __post_init__(self) -> None:
        validate_preset(self)

    @property
    def factor(self) -> int:
        """Padding granularity in pixels: ``merge_kernel_size * patch_size``."""
        return self.merge_kernel_size * self.patch_size


def validate_preset(preset: Preset) -> None:
    """Reject presets the reference processor cannot serve (spec section 3)."""
    ints = {
        "patch_size": preset.patch_size,
        "merge_kernel_size": preset.merge_kernel_size,
        "in_patch_limit": preset.in_patch_limit,
        "patch_limit_on_one_side": preset.patch_limit_on_one_side,
        "chessboard_square": preset.chessboard_square,
        "video_patch_limit_per_frame": preset.video_patch_limit_per_frame,
        "video_frames_per_chunk": preset.video_frames_per_chunk,
    }
    for key, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidPresetError(f"preset {preset.name!r}: {key} must be a positive int, got {value!r}")
    if preset.patch_limit_on_one_side % preset.merge_kernel_size:
        # Padding to a multiple of merge*patch could then push one side past the limit, which the
        # reference asserts against.
        raise InvalidPresetError(
            f"preset {preset.name!r}: patch_limit_on_one_side ({preset.patch_limit_on_one_side}) must be "
            f"a multiple of merge_kernel_size ({preset.merge_kernel_size})"
        )
    for key in ("image_mean", "image_std"):
        values = getattr(preset, key)
        if len(values) != 3 or not all(isinstance(v, float) and math.isfinite(v) for v in values):
            raise InvalidPresetError(f"preset {preset.name!r}: {key} must be 3 finite floats, got {values!r}")
    if any(v == 0.0 for v in preset.image_std):
        raise InvalidPresetError(f"preset {preset.name!r}: image_std must be non-zero")
    if preset.transparency not in ("convert_rgb", "chessboard"):
        raise InvalidPresetError(
            f"preset {preset.name!r}: transparency must be 'convert_rgb' or 'chessboard', got {preset.transparency!r}"
        )
    for key in ("chessboard_light", "chessboard_dark"):
        if not 0 <= getattr(preset, key) <= 255:
            raise InvalidPresetError(f"preset {preset.name!r}: {key} must be in 0..255")


KIMI_K25 = Preset(name="kimi-k2.5")
KIMI_K3 = Preset(
    name="kimi-k3",
    in_patch_limit=65536,
    transparency="chessboard",
    video_patch_limit_per_frame=16384,
)

PRESETS: dict[str, Preset] = {
    KIMI_K25.name: KIMI_K25,
    "kimi-k2.6": dataclasses.replace(KIMI_K25, name="kimi-k2.6"),
    KIMI_K3.name: KIMI_K3,
}


# The presets the model repository serves, each as the models ``<model_prefix>_*`` (rendered by
# ``kimi-prep render-repository``). kimi-k2.6 is kimi-k2.5's preset under another name: served once.
SERVED_PRESETS: tuple[str, ...] = (KIMI_K25.name, KIMI_K3.name)


def model_prefix(preset_name: str) -> str:
    """The model-name prefix of a served preset: ``kimi-k2.5`` -> ``kimi_k25``, ``kimi-k3`` -> ``kimi_k3``."""
    return preset_name.replace(".", "").replace("-", "_")


def preset_aliases(preset: Preset) -> list[str]:
    """Names of the registered presets equal to ``preset`` but for their name (``preset`` first)."""
    same = [name for name, other in PRESETS.items() if dataclasses.replace(other, name=preset.name) == preset]
    return sorted(same, key=lambda name: name != preset.name)


def preset_parameters(preset: Preset) -> dict[str, str]:
    """``preset`` as the config.pbtxt string parameters :func:`preset_from_parameters` reads back:
    ``preset`` (the name) and every other field."""
    parameters = {"preset": preset.name}
    for field in dataclasses.fields(Preset):
        if field.name != "name":
            value = getattr(preset, field.name)
            parameters[field.name] = ",".join(map(repr, value)) if isinstance(value, tuple) else str(value)
    return parameters


def get_preset(preset: str | Preset) -> Preset:
    """Return ``preset`` itself or the registered preset of that name."""
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise InvalidPresetError(f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}") from None


def _parse_field(field: dataclasses.Field, raw: str) -> object:
    if field.name in ("image_mean", "image_std"):
        return tuple(float(v) for v in raw.replace(",", " ").split())
    if field.name in ("name", "transparency"):
        return raw.strip()
    return int(raw)


def preset_from_parameters(parameters: Mapping[str, str]) -> Preset:
    """Build a preset from Triton ``config.pbtxt`` string parameters.

    ``preset`` names the base preset (default ``kimi-k2.5``); every other key that is a
    :class:`Preset` field overrides it. Unknown keys are ignored (they belong to other layers).
    """
    base = get_preset(parameters.get("preset", KIMI_K25.name).strip())
    fields = {f.name: f for f in dataclasses.fields(Preset)}
    overrides: dict[str, object] = {}
    for key, raw in parameters.items():
        if key in fields and key != "name":
            try:
                overrides[key] = _parse_field(fields[key], raw)
            except ValueError:
                raise InvalidPresetError(f"parameter {key}={raw!r} is not a valid {fields[key].type}") from None
    return dataclasses.replace(base, **overrides) if overrides else base
