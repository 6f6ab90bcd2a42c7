"""docs/serving.md's settings table is the one the definitions and the rendering make, and every
setting a rendered model reads has its library default or is served-only by design."""

from __future__ import annotations

from kimi_vision_prep.serving.config import DecoderSettings, decoder_settings
from kimi_vision_prep.serving.render_blocks import SERVING_DEFAULTS, RenderOptions, rendered_decoder_settings
from kimi_vision_prep.serving.settings_table import DOC, MEANINGS, library_defaults, rendered_values, settings_table


def test_docs_hold_the_generated_settings_table() -> None:
    assert settings_table() in DOC.read_text(), "run: python -m kimi_vision_prep.serving.settings_table --write"


def test_every_rendered_setting_has_a_meaning_and_the_cpu_rendering_adds_none() -> None:
    for options in (RenderOptions(), RenderOptions(instances=2, threads=1, kind="cpu")):
        assert set(rendered_values(options)) <= set(MEANINGS)


def test_a_decode_model_reads_back_what_was_rendered_for_it() -> None:
    options = RenderOptions(threads=3, kind="cpu")
    rendered = rendered_decoder_settings(options, SERVING_DEFAULTS)
    values = rendered_values(options)
    parameters = {key: next(iter(values[key])) for key in ("decoder_pool_size", "codec_threads", "cpu_decode_threads")}
    read = decoder_settings(parameters)
    assert (read.decoder_pool_size, read.codec_threads, read.cpu_decode_threads) == (
        rendered.decoder_pool_size,
        rendered.codec_threads,
        rendered.cpu_decode_threads,
    )
    assert (
        read.max_images_per_request
        == library_defaults()["max_images_per_request"]
        == DecoderSettings().max_images_per_request
    )


def test_the_patchify_step_takes_the_decode_models_image_limit() -> None:
    values = rendered_values(RenderOptions(kind="cpu"))["max_images_per_request"]
    assert len(values) == 1, values  # decode, patchify, preprocess, fused, tokens: one value
    kinds = {kind for _, kind in next(iter(values.values()))}
    assert {"decode", "patchify"} <= kinds
