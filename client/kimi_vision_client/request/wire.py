"""How a served model returns its pixels, learnt from the server's model configs.

A model whose config lists a ``PIXEL_PATCHES`` output is served over the uint8 wire, and the
preset (mean/std for the table, sizes for shared memory) is read from the ``parameters`` of the
model that produces the pixels (the model itself, or the ensemble step that yields them), so a
renamed or re-parameterised model still expands exactly; the client keeps no table of models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kimi_vision_common.errors import PreprocessError
from kimi_vision_common.presets import PRESETS, Preset, preset_from_parameters
from kimi_vision_common.wire import GRID_THW, NUM_TOKENS, PIXEL_PATCHES, PIXEL_VALUES


def largest_preset() -> Preset:
    """The registered preset with the largest patch budget (its outputs bound every other's)."""
    return max(PRESETS.values(), key=lambda p: (p.in_patch_limit, p.patch_limit_on_one_side))


@dataclass(frozen=True)
class Wire:
    """How a model's pixels travel, as learnt from the server by :func:`learn_wire`.

    ``pixel_output``: ``PIXEL_VALUES`` (float32, used as received) or ``PIXEL_PATCHES`` (uint8,
    expanded on the client). ``preset``: sizes shared-memory regions and, on the uint8 wire, gives
    the normalise table (``normalize_table(preset.image_mean, preset.image_std)``).
    """

    pixel_output: str
    preset: Preset

    @property
    def outputs(self) -> tuple[str, str, str]:
        """The output names requested per image."""
        return (self.pixel_output, GRID_THW, NUM_TOKENS)


def config_parameters(config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters`` of a model config (HTTP / gRPC JSON) as plain ``{key: string_value}``."""
    return {key: str(value.get("string_value", "")) for key, value in (config.get("parameters") or {}).items()}


def producer_preset(
    get_config: Callable[[str], Mapping[str, Any]], config: Mapping[str, Any], tensor: str, depth: int = 0
) -> Preset | None:
    """The preset of the model that produces output ``tensor`` of ``config``: for an ensemble, the
    step whose ``output_map`` yields it (followed recursively); otherwise the model's own
    ``parameters`` when they name a ``preset``. None when no model on the way names one."""
    for step in (config.get("ensemble_scheduling") or {}).get("step", []):
        for key, value in (step.get("output_map") or {}).items():
            if value == tensor and depth < 8:
                return producer_preset(get_config, get_config(step["model_name"]), key, depth + 1)
    parameters = config_parameters(config)
    return preset_from_parameters(parameters) if "preset" in parameters else None


def learn_wire(get_config: Callable[[str], Mapping[str, Any]], model: str, preset: Preset | None = None) -> Wire:
    """Ask the server how ``model`` returns its pixels (``get_config(name)`` is a model-config call).

    A model whose outputs include ``PIXEL_PATCHES`` is served over the uint8 wire (also when it
    offers ``PIXEL_VALUES`` as well, like ``kimi_*_preprocess``: the patches expand bit-equal and
    are a quarter of the bytes), else it returns ``PIXEL_VALUES``. The preset is ``preset`` if
    given, else the one in the config parameters of the model producing the pixels (the model
    itself, or the ensemble step that yields them), else (float32 only: it just sizes regions) the
    largest registered preset. A uint8 model with no
    known preset is read over float32 if it offers ``PIXEL_VALUES`` too, and otherwise raises
    :class:`PreprocessError`: a guessed table would give wrong values.
    """
    config = get_config(model)
    names = {output.get("name") for output in config.get("output", [])}
    candidates = [name for name in (PIXEL_PATCHES, PIXEL_VALUES) if name in names] or [PIXEL_VALUES]
    for pixel_output in candidates:
        found = preset or producer_preset(get_config, config, pixel_output)
        if found is not None:
            return Wire(pixel_output, found)
        if pixel_output == PIXEL_VALUES:
            return Wire(PIXEL_VALUES, largest_preset())
    raise PreprocessError(
        f"model {model!r} returns uint8 PIXEL_PATCHES but its config names no preset to expand them "
        "with; pass preset= to KimiVisionClient"
    )
