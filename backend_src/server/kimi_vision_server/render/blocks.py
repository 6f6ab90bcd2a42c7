"""The building blocks of the rendered model repository: options, serving defaults, config pieces.

``repository.py`` (image models) and ``media_kinds.py`` (video and token-count models) compose
their configs from these; every value comes from a preset, :class:`~.config.DecoderSettings`'
defaults, :class:`ServingDefaults` or :class:`RenderOptions`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from kimi_vision_common.presets import Preset, preset_parameters
from kimi_vision_common.sizing import navit_patch_bound
from kimi_vision_common.wire import (
    GRID_THW,
    IMAGE_BYTES,
    NUM_TOKENS,
    NUM_TOKENS_TRITON_TYPE,
    PIXEL_PATCHES,
    PIXEL_VALUES,
)

from ..settings import Rendering, rendered_parameters, setting
from . import pbtxt

InstanceKind = Literal["cpu", "gpu"]

RAGGED = "allow_ragged_batch: true"


@dataclass(frozen=True)
class RenderOptions:
    """Host-dependent knobs of a rendering; the defaults are host-independent (the checked-in copy).

    ``instances``: ``instance_group`` count of every Python model; ``threads``: ``numba_threads``
    and the decode threads (``codec_threads``, ``cpu_decode_threads``, ``ffmpeg_threads``) of each
    instance (0: all cores); ``kind``: ``KIND_CPU`` / ``KIND_GPU``,
    or None to leave it unset (Triton then picks GPU where there is one, CPU elsewhere);
    ``c_patchify``: a CPU rendering ends the vision ensembles with the C step ``<prefix>_patchify``
    (False: with the Python preprocess step, where the C backend is not built).
    """

    instances: int = 1
    threads: int = 0
    kind: InstanceKind | None = None
    c_patchify: bool = True

    @property
    def uses_c_patchify(self) -> bool:
        """Whether the vision ensembles end with the C step (a CPU rendering that has it)."""
        return self.kind == "cpu" and self.c_patchify

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.kind not in (None, "cpu", "gpu"):
            raise ValueError(f"kind must be 'cpu' or 'gpu', got {self.kind!r}")


@dataclass(frozen=True)
class ServingDefaults:
    """Serving settings that are not a preset's: batching, backpressure, the chaining example.

    ``max_batch_size``: requests one execute of a decode (nvImageCodec decodes them in one batch
    call), tokens, video or patch-embed model takes. ``pixel_batch_size``: the same for the models
    that return pixels (preprocess, fused) and the ensembles through them (an ensemble may not
    batch more than a step): every output of a batch lives in the stub at once, twice (numpy, then
    its shared memory; float32 is up to 37 MiB a request), so 1 caps an instance's working set at
    one request; the images a request carries (K) are unaffected. Measured: BENCHMARKS.md, "Served: memory"
    under load.

    ``response_cache_bytes``: the size of tritonserver's response cache that ``kimi-prep serve``
    starts on loopback, all it may hold (docs/serving.md, "Repeats"); beyond loopback none unless
    the operator sizes one: Triton keys entries by a 64-bit non-cryptographic hash of the model and
    the input bytes, which a crafted request can collide with another's (docs/security.md).

    ``budget_images``: a request's ``max_patches_per_request`` is this many times the preset's
    ``in_patch_limit`` (:meth:`patch_budget`): every single image the reference accepts fits (one
    image's NaViT grid is at most ~1.08x ``in_patch_limit`` after padding), and so do several
    smaller ones, while what one request can make the server hold stays bounded (docs/security.md
    has the memory formula this enters).
    """

    def patch_budget(self, preset: Preset) -> int:
        """``max_patches_per_request`` of a served preset's models that return patches."""
        return self.budget_images * preset.in_patch_limit

    max_batch_size: int = 8
    pixel_batch_size: int = 1
    max_queue_delay_us: int = 1000
    max_queue_size: int = 128
    queue_timeout_us: int = 30_000_000
    budget_images: int = 2
    embed_preset: str = "kimi-k2.5"
    response_cache_bytes: int = 512 << 20


HOST_INDEPENDENT = RenderOptions()  # the checked-in repository's options


@dataclass(frozen=True)
class ServedPreset:
    """What every model kind of one served preset is rendered from: the preset, its model-name
    prefix, a title for comments (its names), the render options and the serving defaults."""

    preset: Preset
    prefix: str
    title: str
    options: RenderOptions
    defaults: ServingDefaults

    @property
    def parts(self) -> tuple[Preset, str, str, RenderOptions, ServingDefaults]:
        return self.preset, self.prefix, self.title, self.options, self.defaults


SERVING_DEFAULTS = ServingDefaults()


@dataclass(frozen=True)
class ModelFiles:
    """One rendered model: ``config.pbtxt`` text, and the Python class its ``model.py`` exports as
    ``module.Class`` of ``kimi_vision_server`` (None for an ensemble or a C-backend model,
    whose version folder only holds a ``.gitkeep``)."""

    name: str
    config: str
    python_class: str | None
    steps: tuple[str, ...] = ()  # an ensemble's composing models


# -- blocks of the model kinds --------------------------------------------------------------------


def dynamic_batching(defaults: ServingDefaults, batch: int) -> str:
    waits = defaults.max_queue_size // batch
    return pbtxt.comment(
        f"Backpressure (docs/errors.md): at most {defaults.max_queue_size} requests wait ({waits} full batches) "
        f"and none longer than\n{defaults.queue_timeout_us // 1_000_000} s; beyond either Triton answers "
        "UNAVAILABLE at once instead of queueing without bound.\n"
        'A client may ask for a shorter timeout per request (the "timeout" parameter), never a longer one.'
    ) + (
        "dynamic_batching {\n"
        f"  max_queue_delay_microseconds: {defaults.max_queue_delay_us}\n"
        "  default_queue_policy {\n"
        f"    max_queue_size: {defaults.max_queue_size}\n"
        "    timeout_action: REJECT\n"
        f"    default_timeout_microseconds: {defaults.queue_timeout_us}\n"
        "    allow_timeout_override: true\n"
        "  }\n"
        "}\n"
    )


def instance_group(options: RenderOptions) -> str:
    if options.kind is None:
        return (
            pbtxt.comment("kind unset: KIND_GPU on GPU hosts, KIND_CPU elsewhere (render with --kind to fix it).")
            + f"instance_group [ {{ count: {options.instances} }} ]\n"
        )
    return f"instance_group [ {{ count: {options.instances} kind: KIND_{options.kind.upper()} }} ]\n"


def preset_block(preset: Preset, prefix: str) -> str:
    return pbtxt.parameters(
        preset_parameters(preset),
        f"Preset {preset.name}: every field of kimi_vision_prep.Preset (read back by preset_from_parameters);\n"
        f"rendered from presets.py, the same block in every {prefix}_* model but the ensembles.",
    )


def settings_block(kind: str, options: RenderOptions, defaults: ServingDefaults, preset: Preset | None) -> str:
    """The :data:`~.settings.SETTINGS` a model of ``kind`` reads, with their rendered values
    (``preset``: whose request budget; None for a model of no preset)."""
    budget = 0 if preset is None else defaults.patch_budget(preset)
    bound = 0 if preset is None else navit_patch_bound(preset)
    values = rendered_parameters(Rendering(kind, options.threads, budget, bound))
    meanings = "\n".join(f"{name}: {setting(name).meaning}" for name in values)
    return pbtxt.parameters(values, "Settings (kimi_vision_server.settings; docs/serving.md):\n" + meanings)


def pixel_outputs(p: int) -> dict[str, tuple[str, str]]:
    """The preprocess outputs by name: ``(comment, tensor)``."""
    return {
        PIXEL_VALUES: (
            "float32 (grid_h * grid_w, 3, patch_size, patch_size)",
            pbtxt.tensor(PIXEL_VALUES, "TYPE_FP32", (-1, 3, p, p)),
        ),
        PIXEL_PATCHES: (
            "uint8, same layout: the patches before the normalise lookup\n"
            "(PIXEL_VALUES = normalize_table(mean, std)[PIXEL_PATCHES, c]); only requested outputs are computed.",
            pbtxt.tensor(PIXEL_PATCHES, "TYPE_UINT8", (-1, 3, p, p)),
        ),
        GRID_THW: (
            "int64 (K, 3): (1, grid_h, grid_w) of each image",
            pbtxt.tensor(GRID_THW, "TYPE_INT64", (-1, 3)),
        ),
        NUM_TOKENS: ("int32 (K,)", pbtxt.tensor(NUM_TOKENS, NUM_TOKENS_TRITON_TYPE, (-1,))),
    }


# K encoded images a request ([1, K]); requests of different K are batched together (ragged).
IMAGE_BYTES_INPUT = [
    ("K encoded images, 1 <= K <= max_images_per_request", pbtxt.tensor(IMAGE_BYTES, "TYPE_STRING", (-1,), RAGGED))
]
ENSEMBLE_IMAGE_BYTES_INPUT = [("K encoded images", pbtxt.tensor(IMAGE_BYTES, "TYPE_STRING", (-1,)))]


# -- the model kinds ------------------------------------------------------------------------------


def python_model(  # noqa: PLR0917
    name: str,
    summary: str,
    inputs: Iterable[tuple[str, str]],
    outputs: Iterable[tuple[str, str]],
    blocks: Iterable[str],
    python_class: str,
    options: RenderOptions,
    defaults: ServingDefaults,
    kind: str,
    preset: Preset,
    decoupled: bool = False,
    batch: int | None = None,
) -> ModelFiles:
    """A Python-backend model: batching and backpressure, tensors, instances, parameters;
    ``python_class`` is ``module.Class`` under ``kimi_vision_server``; ``decoupled``: any
    number of responses a request (a stream); ``batch``: its ``max_batch_size`` (default
    ``defaults.max_batch_size``); ``kind`` and ``preset``: which settings it gets (:func:`settings_block`)."""
    batch = defaults.max_batch_size if batch is None else batch
    policy = (
        pbtxt.comment("Decoupled: one response per chunk as it is ready, then an empty one flagged final.")
        + "model_transaction_policy { decoupled: true }\n"
        if decoupled
        else ""
    )
    config = (
        pbtxt.head(name, summary, batch)
        + policy
        + dynamic_batching(defaults, batch)
        + pbtxt.tensor_list("input", inputs)
        + pbtxt.tensor_list("output", outputs)
        + instance_group(options)
        + settings_block(kind, options, defaults, preset)
        + "".join(blocks)
    )
    return ModelFiles(name, config, python_class)


# Every model of a rendering has this one version (its folder), and an ensemble step names it: with
# "-1" (the latest) perf_analyzer 2.41 cannot tell which version's statistics to read in a window
# where the response cache answered every request and no step ran ("failed to find the requested
# model version").
MODEL_VERSION = 1


def ensemble_step(model: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> str:
    maps = [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    head = f'    {{\n      model_name: "{model}"\n      model_version: {MODEL_VERSION}\n'
    return head + "\n".join(maps) + "\n    }"


RESPONSE_CACHE = pbtxt.comment(
    "A repeat of a request (this model, the same input bytes) is answered from tritonserver's response\n"
    "cache when it has one (kimi-prep serve --response-cache-mib; docs/serving.md, \"Repeats\"); answers\n"
    "on a GPU (CUDA tensors) are not cached."
) + "response_cache { enable: true }\n"


def ensemble(
    name: str, summary: str, outputs: list[tuple[str, str]], steps: list[str], batch: int, *, cached: bool = False
) -> ModelFiles:
    """An ensemble of ``steps`` taking the encoded images; ``cached``: its answers go to the response cache."""
    config = (
        pbtxt.head(name, summary, batch, backend="ensemble")
        + pbtxt.tensor_list("input", ENSEMBLE_IMAGE_BYTES_INPUT)
        + pbtxt.tensor_list("output", outputs)
        + "ensemble_scheduling {\n  step [\n"
        + ",\n".join(steps)
        + "\n  ]\n}\n"
        + (RESPONSE_CACHE if cached else "")
    )
    step_models = tuple(re.findall(r'model_name: "([^"]+)"', "".join(steps)))
    return ModelFiles(name, config, None, step_models)
