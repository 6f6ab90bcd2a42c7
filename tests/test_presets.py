"""Presets: the spec's constants, config.pbtxt-style parameters, and the Triton error-code table."""

from __future__ import annotations

import pytest

from kimi_vision_common.errors import reason_for, triton_code_for
from kimi_vision_prep import (
    KIMI_K3,
    KIMI_K25,
    PRESETS,
    CancelledError,
    DecoderBusyError,
    FallbackError,
    ImageTooLargeError,
    InvalidImageError,
    InvalidPresetError,
    InvalidRequestError,
    PreprocessError,
    Preset,
    UnsupportedImageError,
    get_preset,
    preset_from_parameters,
)

# Spec section 1, copied.
SPEC_TABLE = {
    "kimi-k2.5": dict(
        patch_size=14, merge_kernel_size=2, in_patch_limit=16384, patch_limit_on_one_side=512,
        image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), transparency="convert_rgb",
        # spec section 8 (media_proc_cfg)
        sample_fps=2.0, temporal_merge_kernel_size=4, in_patch_limit_each_frame=4096, in_patch_limit_video=None,
        max_num_frames_each_video=None, fixed_output_tokens=None, timestamp_mode="hh:mm:ss.fff",
    ),
    "kimi-k3": dict(
        patch_size=14, merge_kernel_size=2, in_patch_limit=65536, patch_limit_on_one_side=512,
        image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), transparency="chessboard",
        sample_fps=8.0, temporal_merge_kernel_size=4, in_patch_limit_each_frame=16384, in_patch_limit_video=None,
        max_num_frames_each_video=None, fixed_output_tokens=None, timestamp_mode="hh:mm:ss.fff",
    ),
}  # fmt: skip
SPEC_TABLE["kimi-k2.6"] = SPEC_TABLE["kimi-k2.5"]


@pytest.mark.parametrize("name", sorted(SPEC_TABLE))
def test_shipped_presets_match_spec(name: str) -> None:
    preset = get_preset(name)
    assert preset.name == name
    for key, value in SPEC_TABLE[name].items():
        assert getattr(preset, key) == value, key
    assert (preset.chessboard_square, preset.chessboard_light, preset.chessboard_dark) == (8, 255, 180)
    assert preset.factor == 28


def test_get_preset_names_and_identity() -> None:
    assert set(PRESETS) == {"kimi-k2.5", "kimi-k2.6", "kimi-k3"}
    assert get_preset("kimi-k2.5") is KIMI_K25
    assert get_preset("kimi-k3") is KIMI_K3
    custom = Preset(name="custom", in_patch_limit=1024)
    assert get_preset(custom) is custom


def test_get_preset_unknown_name_lists_known() -> None:
    with pytest.raises(InvalidPresetError, match=r"kimi-k2\.5") as info:
        get_preset("kimi-k9")
    assert "kimi-k9" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parameters_default_to_k25() -> None:
    assert preset_from_parameters({}) is KIMI_K25


def test_parameters_select_base_preset() -> None:
    assert preset_from_parameters({"preset": "kimi-k3"}) is KIMI_K3
    assert preset_from_parameters({"preset": " kimi-k3 "}) is KIMI_K3


def test_parameters_override_fields() -> None:
    preset = preset_from_parameters(
        {
            "preset": "kimi-k3",
            "in_patch_limit": "4096",
            "patch_limit_on_one_side": "256",
            "patch_size": "16",
            "image_mean": "0.48145466, 0.4578275, 0.40821073",
            "image_std": "0.26862954 0.26130258 0.27577711",
            "transparency": "convert_rgb",
            "chessboard_dark": "128",
            "temporal_merge_kernel_size": "8",
            "sample_fps": "1.5",
            "in_patch_limit_video": "8192",
            "fixed_output_tokens": "none",
            "timestamp_mode": "mm:ss",
        }
    )
    assert preset.name == "kimi-k3"
    assert preset.in_patch_limit == 4096
    assert preset.patch_limit_on_one_side == 256
    assert preset.patch_size == 16
    assert preset.factor == 32
    assert preset.image_mean == (0.48145466, 0.4578275, 0.40821073)
    assert preset.image_std == (0.26862954, 0.26130258, 0.27577711)
    assert preset.transparency == "convert_rgb"
    assert preset.chessboard_dark == 128
    assert preset.temporal_merge_kernel_size == 8 and preset.sample_fps == 1.5
    assert preset.in_patch_limit_video == 8192 and preset.fixed_output_tokens is None
    assert preset.timestamp_mode == "mm:ss"
    # Fields not overridden come from the base preset.
    assert preset.in_patch_limit_each_frame == KIMI_K3.in_patch_limit_each_frame
    assert preset.merge_kernel_size == 2


def test_parameters_ignore_unknown_keys_and_name() -> None:
    preset = preset_from_parameters({"preset": "kimi-k2.5", "max_batch_size": "8", "name": "evil"})
    assert preset is KIMI_K25


@pytest.mark.parametrize(
    "params",
    [
        {"in_patch_limit": "abc"},
        {"in_patch_limit": "1.5"},
        {"in_patch_limit": "0"},
        {"patch_size": "-14"},
        {"patch_limit_on_one_side": "511"},  # not a multiple of merge_kernel_size
        {"merge_kernel_size": "3"},
        {"image_mean": "0.5,0.5"},
        {"image_mean": "a,b,c"},
        {"image_std": "0.5,0,0.5"},
        {"image_std": "nan,0.5,0.5"},
        {"transparency": "white"},
        {"chessboard_light": "300"},
        {"preset": "kimi-k9"},
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_bad_parameters_raise_invalid_preset(params: dict[str, str]) -> None:
    with pytest.raises(InvalidPresetError):
        preset_from_parameters(params)


# The Triton mapping (errors.py is its single source of truth; this is its contract).
TRITON_CODES = [
    (InvalidImageError("x"), "INVALID_ARG", "invalid_image"),
    (UnsupportedImageError("x"), "INVALID_ARG", "unsupported_image"),
    (ImageTooLargeError("x"), "INVALID_ARG", "too_large"),
    (InvalidRequestError("x"), "INVALID_ARG", "invalid_request"),
    (InvalidPresetError("x"), "INVALID_ARG", "invalid_preset"),
    (DecoderBusyError("x"), "UNAVAILABLE", "decoder_busy"),
    (FallbackError("x"), "INTERNAL", "fallback_forbidden"),
    (CancelledError("x"), "CANCELLED", "cancelled"),
    (PreprocessError("x"), "INTERNAL", "internal"),
    (RuntimeError("x"), "INTERNAL", "internal"),
    (KeyError("x"), "INTERNAL", "internal"),
]


def code_case_id(value: object) -> str:
    return type(value).__name__ if isinstance(value, Exception) else str(value)


@pytest.mark.parametrize("exc,code,reason", TRITON_CODES, ids=code_case_id)
def test_triton_code_for(exc: BaseException, code: str, reason: str) -> None:
    assert triton_code_for(exc) == code
    assert reason_for(exc) == reason


def test_all_public_errors_are_preprocess_errors() -> None:
    for exc, _, _ in TRITON_CODES[:9]:
        assert isinstance(exc, PreprocessError)


def test_the_client_knows_every_model_name_a_rendering_has() -> None:
    """kimi_vision_common.models (what a client knows) names exactly the models of the renderings."""
    from kimi_vision_common.models import PRESET_MODEL_KINDS, SERVED_PRESETS, is_project_model, model_prefix
    from kimi_vision_server.render.repository import RenderOptions, repository_models

    rendered = {m.name for kind in (None, "cpu", "gpu") for m in repository_models(RenderOptions(kind=kind))}
    assert all(is_project_model(name) for name in rendered)
    per_preset = {f"{model_prefix(preset)}_{kind}" for preset in SERVED_PRESETS for kind in PRESET_MODEL_KINDS}
    assert per_preset <= rendered
    assert not is_project_model("kimi_nope") and not is_project_model("kimi_k9_vision")
