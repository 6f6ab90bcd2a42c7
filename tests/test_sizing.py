"""The NaViT size rule (spec section 3): worked examples, properties against the plain reference,
and preset validation."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import PRESETS as REF_PRESETS
from reference import ref_size

from kimi_vision_prep import KIMI_K3, KIMI_K25, InvalidPresetError, Preset, navit_target_size

# Copied from the spec's worked examples:
# (preset, W, H, new_w, new_h, pad_w, pad_h, grid_h, grid_w, tokens)
WORKED_EXAMPLES = [
    ("kimi-k2.5", 2048, 2048, 1795, 1795, 25, 25, 130, 130, 4225),
    ("kimi-k2.5", 4000, 3000, 2073, 1554, 27, 14, 112, 150, 4200),
    ("kimi-k2.5", 3840, 2160, 2392, 1345, 16, 27, 98, 172, 4214),
    ("kimi-k2.5", 1920, 1080, 1920, 1080, 12, 12, 78, 138, 2691),
    ("kimi-k2.5", 640, 480, 640, 480, 4, 24, 36, 46, 414),
    ("kimi-k2.5", 10, 10, 10, 10, 18, 18, 2, 2, 1),
    ("kimi-k2.5", 100, 10000, 71, 7168, 13, 0, 512, 6, 768),
    ("kimi-k3", 4000, 3000, 4000, 3000, 4, 24, 216, 286, 15444),
    ("kimi-k3", 8000, 8000, 3586, 3586, 26, 26, 258, 258, 16641),
]
LIBRARY_PRESETS = {"kimi-k2.5": KIMI_K25, "kimi-k3": KIMI_K3}


@pytest.mark.parametrize("example", WORKED_EXAMPLES, ids=lambda e: f"{e[0]}-{e[1]}x{e[2]}")
def test_worked_example(example: tuple) -> None:
    name, width, height, new_w, new_h, pad_w, pad_h, grid_h, grid_w, tokens = example
    target = navit_target_size(width, height, LIBRARY_PRESETS[name])
    assert (target.width, target.height) == (width, height)
    assert (target.new_width, target.new_height) == (new_w, new_h)
    assert (target.pad_width, target.pad_height) == (pad_w, pad_h)
    assert (target.grid_h, target.grid_w) == (grid_h, grid_w)
    assert target.grid_thw == (1, grid_h, grid_w)
    assert target.num_tokens == tokens
    assert (target.padded_width, target.padded_height) == (new_w + pad_w, new_h + pad_h)
    assert target.needs_resize == ((new_w, new_h) != (width, height))


@pytest.mark.parametrize("example", WORKED_EXAMPLES, ids=lambda e: f"{e[0]}-{e[1]}x{e[2]}")
def test_reference_reproduces_worked_example(example: tuple) -> None:
    """The plain reference the other tests rely on agrees with the spec's own numbers."""
    name, width, height, *expected = example
    size = ref_size(width, height, REF_PRESETS[name])
    assert [size.new_w, size.new_h, size.pad_w, size.pad_h, size.grid_h, size.grid_w, size.num_tokens] == expected


def test_padding_can_exceed_in_patch_limit() -> None:
    """Spec: 2048x2048 under K2.5 gives 16900 patches (> 16384): caps must use the padded grid."""
    target = navit_target_size(2048, 2048, KIMI_K25)
    assert target.num_patches == 16900 > KIMI_K25.in_patch_limit


def assert_matches_reference(width: int, height: int, preset: Preset, ref_preset: dict[str, object]) -> None:
    target = navit_target_size(width, height, preset)
    size = ref_size(width, height, ref_preset)
    got = (target.new_width, target.new_height, target.pad_width, target.pad_height)
    assert got == (size.new_w, size.new_h, size.pad_w, size.pad_h)
    assert (target.grid_h, target.grid_w, target.num_tokens) == (size.grid_h, size.grid_w, size.num_tokens)


sides = st.one_of(st.integers(1, 64), st.integers(1, 20000), st.integers(1, 70000))


@settings(max_examples=400, deadline=None)
@given(width=sides, height=sides, name=st.sampled_from(sorted(LIBRARY_PRESETS)))
def test_shipped_presets_match_reference(width: int, height: int, name: str) -> None:
    assert_matches_reference(width, height, LIBRARY_PRESETS[name], REF_PRESETS[name])


@settings(max_examples=300, deadline=None)
@given(width=sides, height=sides, name=st.sampled_from(sorted(LIBRARY_PRESETS)))
def test_size_invariants(width: int, height: int, name: str) -> None:
    preset = LIBRARY_PRESETS[name]
    target = navit_target_size(width, height, preset)
    side_px = preset.patch_limit_on_one_side * preset.patch_size
    assert 1 <= target.new_width <= min(width, side_px)  # never upscales, never past the side limit
    assert 1 <= target.new_height <= min(height, side_px)
    assert target.padded_width % preset.factor == 0 and target.padded_height % preset.factor == 0
    assert 0 <= target.pad_width < preset.factor and 0 <= target.pad_height < preset.factor
    assert target.grid_h <= preset.patch_limit_on_one_side and target.grid_w <= preset.patch_limit_on_one_side
    merge = preset.merge_kernel_size
    assert target.num_tokens == (target.grid_h // merge) * (target.grid_w // merge)


@st.composite
def custom_presets(draw: st.DrawFn) -> tuple[Preset, dict[str, object]]:
    """A valid custom preset and the same numbers as a reference dict."""
    patch = draw(st.integers(1, 32))
    merge = draw(st.integers(1, 4))
    side = merge * draw(st.integers(1, 300))
    limit = draw(st.integers(1, 200000))
    preset = Preset(
        name="custom", patch_size=patch, merge_kernel_size=merge, in_patch_limit=limit, patch_limit_on_one_side=side
    )
    ref = dict(REF_PRESETS["kimi-k2.5"])
    ref.update(patch_size=patch, merge_kernel_size=merge, in_patch_limit=limit, patch_limit_on_one_side=side)
    return preset, ref


@settings(max_examples=300, deadline=None)
@given(width=sides, height=sides, presets=custom_presets())
def test_custom_presets_match_reference(width: int, height: int, presets: tuple[Preset, dict[str, object]]) -> None:
    preset, ref = presets
    assert_matches_reference(width, height, preset, ref)
    target = navit_target_size(width, height, preset)
    assert target.grid_h <= preset.patch_limit_on_one_side and target.grid_w <= preset.patch_limit_on_one_side


def test_side_limit_not_multiple_of_merge_is_rejected() -> None:
    with pytest.raises(InvalidPresetError, match="multiple of merge_kernel_size"):
        Preset(name="bad", patch_limit_on_one_side=511)
    with pytest.raises(InvalidPresetError):
        dataclasses.replace(KIMI_K25, merge_kernel_size=3)  # 512 % 3 != 0


def test_rejected_side_limit_would_break_the_reference_assertion() -> None:
    """Why the rule exists: with a per-side limit of 511 patches and merge 2, a 7154-px side pads
    to 512 patches, past the limit the reference asserts."""
    ref = dict(REF_PRESETS["kimi-k2.5"], patch_limit_on_one_side=511, in_patch_limit=10**9)
    size = ref_size(511 * 14, 100, ref)
    assert size.grid_w > 511


@pytest.mark.parametrize("width,height", [(0, 10), (10, 0), (-1, 5)])
def test_non_positive_size_rejected(width: int, height: int) -> None:
    with pytest.raises(ValueError):
        navit_target_size(width, height, KIMI_K25)
