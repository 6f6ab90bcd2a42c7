"""The settings schema (kimi_vision_server/settings.py) is the one source: docs/serving.md's table is made from
it, every rendered parameter that is not a preset's is one of its settings, and a model reads back
what was rendered for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kimi_vision_common.presets import KIMI_K3, KIMI_K25, Preset
from kimi_vision_common.sizing import navit_patch_bound
from kimi_vision_server.models.config import DecoderSettings, decoder_settings
from kimi_vision_server.render.blocks import SERVING_DEFAULTS, RenderOptions
from kimi_vision_server.render.settings_table import rendered_values, settings_table
from kimi_vision_server.settings import SETTINGS, Rendering, rendered_parameters

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def test_docs_hold_the_generated_settings_table() -> None:
    command = "python -m kimi_vision_server.render.settings_table --write docs/serving.md"
    assert settings_table() in DOC.read_text(), f"run: {command}"


def test_every_rendered_setting_is_declared_once() -> None:
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    preset_fields = {field.name for field in dataclasses.fields(Preset)} | {"preset"}
    for options in (RenderOptions(), RenderOptions(instances=2, threads=1, kind="cpu")):
        assert set(rendered_values(options)) - preset_fields - {"patch_size"} <= set(names)


def test_a_served_value_that_differs_says_why() -> None:
    for setting in SETTINGS:
        if setting.served is not None:
            assert setting.why, setting.name


def test_a_decode_model_reads_back_what_was_rendered_for_it() -> None:
    rendering = Rendering("decode", threads=3, patch_budget=SERVING_DEFAULTS.patch_budget(KIMI_K25))
    read = decoder_settings(rendered_parameters(rendering))
    assert (read.codec_threads, read.cpu_decode_threads, read.decoder_pool_size) == (3, 3, 1)
    assert read.max_patches_per_request == 2 * KIMI_K25.in_patch_limit
    assert read.max_images_per_request == DecoderSettings().max_images_per_request
    assert decoder_settings({}) == DecoderSettings()


def test_the_patchify_step_takes_the_decode_models_limits() -> None:
    """The C step reads max_images_per_request and max_patches_per_request from its config (the
    decode model's values, from the same declarations) and its per-image bound."""
    for preset in (KIMI_K25, KIMI_K3):
        budget = SERVING_DEFAULTS.patch_budget(preset)
        decode = rendered_parameters(Rendering("decode", 0, budget))
        patchify = rendered_parameters(Rendering("patchify", 0, budget, navit_patch_bound(preset)))
        assert patchify["max_patches_per_image"] == str(2 * preset.in_patch_limit)
        assert set(patchify) == {"max_images_per_request", "max_patches_per_request", "max_patches_per_image"}
        shared = ("max_images_per_request", "max_patches_per_request")
        assert all(patchify[key] == decode[key] for key in shared)
    values = rendered_values(RenderOptions(kind="cpu"))["max_images_per_request"]
    assert len(values) == 1, values
    assert {"decode", "patchify"} <= {kind for _, kind in next(iter(values.values()))}
