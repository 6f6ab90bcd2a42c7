"""Preprocessing presets: the single source of truth for every model constant.

A preset is a frozen dataclass. As strings (a served model's ``parameters``) its fields map
one-to-one onto their names (:func:`preset_parameters` / :func:`preset_from_parameters`), so a new
NaViT-style model is a new preset, not a code change, and a client learns a served model's preset
from its config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import InvalidPresetError

Transparency = Literal["convert_rgb", "chessboard"]
TimestampMode = Literal["hh:mm:ss.fff", "mm:ss.fff", "mm:ss"]
TIMESTAMP_MODES: tuple[str, ...] = ("hh:mm:ss.fff", "mm:ss.fff", "mm:ss")
# Optional fields ("none" in a config parameter): absent in the checkpoint's media_proc_cfg.
OPTIONAL_FIELDS = (
    "in_patch_limit_each_frame",
    "in_patch_limit_video",
    "max_num_frames_each_video",
    "fixed_output_tokens",
)


@dataclass(frozen=True)
class Preset:
    """Constants of one checkpoint's image and video processor (spec sections 1, 8, 9).

    Video fields carry the reference's ``media_proc_cfg`` names: ``sample_fps`` (frames sampled per
    second of video), ``temporal_merge_kernel_size`` (frames per chunk), ``in_patch_limit_each_frame``
    (per-frame patch budget; None: ``in_patch_limit``), ``in_patch_limit_video`` (a chunk's budget,
    shared by its frames; None: none), ``max_num_frames_each_video`` (caps the sampled count, the
    model's rule: silently), ``fixed_output_tokens`` (replaces a chunk's token count),
    ``timestamp_mode``. ``image_prompt`` / ``video_prompt``: the placeholder text serving engines
    expand (``{width}``, ``{height}``: the stored size; ``{timestamp}``: the chunk's start).
    """

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
    sample_fps: float = 2.0
    temporal_merge_kernel_size: int = 4
    in_patch_limit_each_frame: int | None = 4096
    in_patch_limit_video: int | None = None
    max_num_frames_each_video: int | None = None
    fixed_output_tokens: int | None = None
    timestamp_mode: TimestampMode = "hh:mm:ss.fff"
    image_prompt: str = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    video_prompt: str = "{timestamp}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"

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
        "temporal_merge_kernel_size": preset.temporal_merge_kernel_size,
        **{key: getattr(preset, key) for key in OPTIONAL_FIELDS if getattr(preset, key) is not None},
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
    fps = preset.sample_fps
    if not isinstance(fps, float) or not math.isfinite(fps) or fps <= 0:
        raise InvalidPresetError(f"preset {preset.name!r}: sample_fps must be a positive float, got {fps!r}")
    if preset.timestamp_mode not in TIMESTAMP_MODES:
        raise InvalidPresetError(
            f"preset {preset.name!r}: timestamp_mode must be one of {', '.join(TIMESTAMP_MODES)}, "
            f"got {preset.timestamp_mode!r}"
        )


KIMI_K25 = Preset(name="kimi-k2.5")
KIMI_K3 = Preset(
    name="kimi-k3",
    in_patch_limit=65536,
    transparency="chessboard",
    sample_fps=8.0,
    in_patch_limit_each_frame=16384,
    image_prompt="<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>",
)

PRESETS: dict[str, Preset] = {
    KIMI_K25.name: KIMI_K25,
    "kimi-k2.6": dataclasses.replace(KIMI_K25, name="kimi-k2.6"),
    KIMI_K3.name: KIMI_K3,
}


def preset_parameters(preset: Preset) -> dict[str, str]:
    """``preset`` as the config.pbtxt string parameters :func:`preset_from_parameters` reads back:
    ``preset`` (the name) and every other field."""
    parameters = {"preset": preset.name}
    for field in dataclasses.fields(Preset):
        if field.name != "name":
            parameters[field.name] = _format_field(getattr(preset, field.name))
    return parameters


def get_preset(preset: str | Preset) -> Preset:
    """Return ``preset`` itself or the registered preset of that name."""
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise InvalidPresetError(f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}") from None


def _format_field(value: object) -> str:
    """A field's value as a config.pbtxt string parameter (:func:`_parse_field` reads it back)."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(repr, value))
    return repr(value) if isinstance(value, float) else str(value)


def _parse_field(field: dataclasses.Field, raw: str) -> object:
    if field.name in OPTIONAL_FIELDS and raw.strip().lower() in ("", "none"):
        return None
    if field.name in ("image_mean", "image_std"):
        return tuple(float(v) for v in raw.replace(",", " ").split())
    if field.name in ("name", "transparency", "timestamp_mode", "image_prompt", "video_prompt"):
        return raw if field.name.endswith("_prompt") else raw.strip()
    if field.name == "sample_fps":
        return float(raw)
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


# The keys of a checkpoint's ``media_proc_cfg`` (preprocessor_config.json) that its processor reads,
# each the Preset field of the same name.
MEDIA_PROC_CFG_KEYS = (
    "patch_size",
    "merge_kernel_size",
    "in_patch_limit",
    "patch_limit_on_one_side",
    "image_mean",
    "image_std",
    "sample_fps",
    "temporal_merge_kernel_size",
    "in_patch_limit_each_frame",
    "in_patch_limit_video",
    "max_num_frames_each_video",
    "fixed_output_tokens",
    "timestamp_mode",
)


def media_proc_cfg(preset: Preset) -> dict[str, object]:
    """``preset`` as a checkpoint's ``media_proc_cfg``: the keys its processor reads, JSON types
    (lists for ``image_mean`` / ``image_std``)."""
    values = {key: getattr(preset, key) for key in MEDIA_PROC_CFG_KEYS}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}


def preset_from_media_proc_cfg(cfg: Mapping[str, object], base: Preset) -> Preset:
    """``base`` with every :data:`MEDIA_PROC_CFG_KEYS` value ``cfg`` holds (a checkpoint's
    ``media_proc_cfg``); the fields it has no key for (transparency, prompts) stay ``base``'s.
    Values are checked as any preset's (:class:`InvalidPresetError`)."""
    overrides: dict[str, object] = {}
    for key in MEDIA_PROC_CFG_KEYS:
        if key not in cfg:
            continue
        value = cfg[key]
        if key in ("image_mean", "image_std") and isinstance(value, (list, tuple)):
            value = tuple(float(v) for v in value)
        elif key == "sample_fps" and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        overrides[key] = value
    return dataclasses.replace(base, **overrides)
