"""The model repository, rendered from the presets: every ``config.pbtxt`` and ``model.py``.

The presets are the one source (:data:`SERVED_PRESETS` names those served): each served preset gets the models
``<prefix>_decode``, ``_preprocess``, ``_vision``, ``_vision_u8``, ``_vision_fused``, ``_vision_fused_u8``,
(``media_kinds.py``) ``_video``, ``_video_chunk``, ``_tokens`` and, in a CPU rendering
(``RenderOptions.kind == "cpu"``, what ``kimi-prep serve`` renders on a GPU-less host),
``_patchify``: the C backend ``kimi_patchify`` in place of the Python preprocess step of the
vision ensembles, which then hand it the decode step's pixels inside tritonserver (prefix by
:func:`model_prefix`: ``kimi-k2.5`` -> ``kimi_k25``); the preset of
:attr:`ServingDefaults.embed_preset` also gets the chaining example ``<prefix>_vision_embed`` over
``kimi_patch_embed``. Every value in a config comes from a preset (its parameter block, the
``patch_size`` of the output dims), :class:`~.config.DecoderSettings`' defaults,
:class:`ServingDefaults` or :class:`RenderOptions`; nothing is restated by hand.

``kimi-prep render-repository --out DIR`` writes it (``make repository`` into ``model_repository/``,
checked in and compared with a fresh rendering by a test); ``kimi-prep serve`` renders through the
same code when given ``--instances``, ``--threads`` or ``--kind``.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from kimi_vision_common.models import PATCH_EMBED_MODEL, SERVED_PRESETS, default_model_names, model_prefix
from kimi_vision_common.presets import PRESETS, Preset
from kimi_vision_common.wire import (
    DECODE_PATH,
    DECODED_TENSORS,
    GRID_THW,
    IMAGE,
    IMAGE_BYTES,
    IMAGE_SHAPES,
    MODE,
    NUM_TOKENS,
    PATCH_EMBEDS,
    PIXEL_PATCHES,
    PIXEL_VALUES,
    RESAMPLE,
    STORED_SIZES,
)

from ..host import HostLayout, host_layout
from ..settings import setting
from ..triton_install import PATCHIFY_BACKEND
from . import pbtxt
from .blocks import (
    HOST_INDEPENDENT,
    IMAGE_BYTES_INPUT,
    MODEL_VERSION,
    RAGGED,
    SERVING_DEFAULTS,
    ModelFiles,
    RenderOptions,
    ServedPreset,
    ServingDefaults,
    dynamic_batching,
    ensemble,
    ensemble_step,
    instance_group,
    pixel_outputs,
    preset_block,
    python_model,
    settings_block,
)
from .media_kinds import media_models


def preset_aliases(preset: Preset) -> list[str]:
    """Names of the registered presets equal to ``preset`` but for their name (``preset`` first)."""
    same = [name for name, other in PRESETS.items() if dataclasses.replace(other, name=preset.name) == preset]
    return sorted(same, key=lambda name: name != preset.name)


__all__ = [
    "ModelFiles",
    "RenderOptions",
    "ServingDefaults",
    "default_model_names",
    "host_rendering",
    "render_repository",
    "repository_models",
    "select_models",
]


# -- the image models -----------------------------------------------------------------------------


def decode_model(served: ServedPreset) -> ModelFiles:
    preset, prefix, title, options, defaults = served.parts
    name = f"{prefix}_decode"
    outputs = [
        (
            "uint8 (ΣHWC,): the K images, flat; each decoded and resized to its NaViT size, RGB (C = 3),\n"
            "composited under K3: the preprocess step only pads and patchifies it",
            pbtxt.tensor(IMAGE, "TYPE_UINT8", (-1,)),
        ),
        (
            "int64 (K, 4): height, width, channels, offset into IMAGE",
            pbtxt.tensor(IMAGE_SHAPES, "TYPE_INT64", (-1, 4)),
        ),
        (
            "RGB, per image (the preprocess step also takes other source modes)",
            pbtxt.tensor(MODE, "TYPE_STRING", (-1,)),
        ),
        (
            "the source's filter: 0 bicubic, 1 nearest (palette and 1-bit sources under K3)",
            pbtxt.tensor(RESAMPLE, "TYPE_UINT8", (-1,)),
        ),
        ("int64 (K, 2): stored height, width (no EXIF rotation)", pbtxt.tensor(STORED_SIZES, "TYPE_INT64", (-1, 2))),
        (
            "libjpeg, simplejpeg, nvimgcodec-cpu, nvimgcodec-cuda, coefficients-cuda or pillow",
            pbtxt.tensor(DECODE_PATH, "TYPE_STRING", (-1,)),
        ),
    ]
    summary = (
        f"{name} ({title}): encoded image bytes -> pixels with Pillow's verdict, resized to their NaViT\n"
        "size exactly (so the hop to the preprocess step carries at most the preset's patch budget). The\n"
        "images of one execute() are decoded cpu_decode_threads at a time on a CPU instance, each resized\n"
        "before the next ones (at most that many stored-size images alive), all in one batch call on a\n"
        "GPU (fancy chroma upsampling, no EXIF rotation); what the fast decoders cannot decode exactly\n"
        "goes through Pillow. On a GPU instance IMAGE is a CUDA tensor (resized with torch there)\n"
        "handed over through DLPack."
    )
    blocks = [preset_block(preset, prefix)]
    # On CPU instances the images of a batch are decoded one after the other anyway (no batch
    # call to feed), and every request of an execute holds its resized images until the execute
    # returns: one request an execute bounds a decode stub's working set (docs/security.md).
    batch = defaults.pixel_batch_size if options.kind == "cpu" else defaults.max_batch_size
    return python_model(
        name, summary, IMAGE_BYTES_INPUT, outputs, blocks, "models.images.DecodeModel", options, defaults, "decode",
        preset, batch=batch,
    )  # fmt: skip


def preprocess_model(served: ServedPreset) -> ModelFiles:
    preset, prefix, title, options, defaults = served.parts
    name = f"{prefix}_preprocess"
    inputs = [
        ("", pbtxt.tensor(IMAGE, "TYPE_UINT8", (-1,), RAGGED)),
        ("", pbtxt.tensor(IMAGE_SHAPES, "TYPE_INT64", (-1, 4), RAGGED)),
        ("", pbtxt.tensor(MODE, "TYPE_STRING", (-1,), RAGGED)),
        ("", pbtxt.tensor(RESAMPLE, "TYPE_UINT8", (-1,), RAGGED)),
        (
            "absent: each image at its stored size; present: the stored sizes, and an image may be at its NaViT size",
            pbtxt.tensor(STORED_SIZES, "TYPE_INT64", (-1, 2), f"{RAGGED} optional: true"),
        ),
    ]
    summary = (
        f"{name} ({title}): decoded pixels -> NaViT resize (unless the decode step did), pad, normalise, patchify.\n"
        'Host input: numba kernels (bit-exact). GPU input (FORCE_CPU_ONLY_INPUT_TENSORS "no"): wrapped\n'
        "through DLPack without a host copy and processed with torch on that device."
    )
    outputs = pixel_outputs(preset.patch_size).values()
    blocks = [preset_block(preset, prefix)]
    python_class, batch = "models.images.PreprocessModel", defaults.pixel_batch_size
    return python_model(
        name, summary, inputs, outputs, blocks, python_class, options, defaults, "preprocess", preset, batch=batch
    )


# The two pixel wires by model-name suffix: float32 PIXEL_VALUES, or uint8 PIXEL_PATCHES (a quarter
# of the bytes; clients expand them with the preset's table). The vision ensembles and the fused
# models offer one each, so a client naming no outputs gets, and pays for, one pixel tensor.
PIXEL_WIRES = {"": PIXEL_VALUES, "_u8": PIXEL_PATCHES}


def fused_models(served: ServedPreset) -> list[ModelFiles]:
    """``<prefix>_vision_fused`` (float32 PIXEL_VALUES) and ``<prefix>_vision_fused_u8`` (uint8
    PIXEL_PATCHES): decode and preprocess in one Python model each."""
    preset, prefix, title, options, defaults = served.parts
    tensors = pixel_outputs(preset.patch_size)
    blocks = [preset_block(preset, prefix)]
    models = []
    for wire, pixels in PIXEL_WIRES.items():
        name = f"{prefix}_vision_fused{wire}"
        summary = (
            f"{name} ({title}): encoded image -> {pixels}, GRID_THW, NUM_TOKENS\n"
            f"in ONE Python model: {prefix}_vision's decode and preprocess without the ensemble hop between\n"
            "them (the decoded image copied through the stub's shared memory twice). For CPU hosts; the\n"
            "ensembles remain the way to chain further models and to scale decode and preprocess apart."
        )
        outputs = [tensors[pixels], tensors[GRID_THW], tensors[NUM_TOKENS]]
        model = python_model(
            name, summary, IMAGE_BYTES_INPUT, outputs, blocks, "models.images.FusedVisionModel", options, defaults,
            f"vision_fused{wire}", preset, batch=defaults.pixel_batch_size,
        )  # fmt: skip
        models.append(model)
    return models


def patchify_model(served: ServedPreset) -> ModelFiles:
    """``<prefix>_patchify``: the decode step's RGB pixels at their NaViT size -> padded, normalised
    patches, in the C backend ``kimi_patchify`` (inside tritonserver: no stub, no copies through
    its shared memory); the same outputs as ``<prefix>_preprocess``."""
    preset, prefix, title, options, defaults = served.parts
    name, batch = f"{prefix}_patchify", defaults.pixel_batch_size
    summary = (
        f"{name} ({title}): RGB pixels at their NaViT size (the decode step's) -> pad, normalise, patchify,\n"
        f"in the C backend {PATCHIFY_BACKEND} (kimi_vision_server/models/patchify/): no Python stub, the\n"
        "pixels read where the decode step left them and written into the buffer Triton hands out. It\n"
        "does not resize: an image beyond patch_limit_on_one_side patches a side, or max_patches_per_image\n"
        f"patches, is refused (ImageTooLargeError); other modes and sizes go to {prefix}_preprocess."
    )
    inputs = [
        ("uint8 (ΣHWC,): the K images, flat, RGB", pbtxt.tensor(IMAGE, "TYPE_UINT8", (-1,), RAGGED)),
        ("int64 (K, 4): height, width, 3, offset", pbtxt.tensor(IMAGE_SHAPES, "TYPE_INT64", (-1, 4), RAGGED)),
    ]
    config = (
        pbtxt.head(name, summary, batch, backend=PATCHIFY_BACKEND)
        + dynamic_batching(defaults, batch)
        + pbtxt.tensor_list("input", inputs)
        + pbtxt.tensor_list("output", pixel_outputs(preset.patch_size).values())
        + instance_group(options)
        + settings_block("patchify", options, defaults, preset)
        + preset_block(preset, prefix)
    )
    return ModelFiles(name, config, None)


def _decode_step(prefix: str, tensors: Sequence[str]) -> str:
    return ensemble_step(f"{prefix}_decode", {IMAGE_BYTES: IMAGE_BYTES}, {t: t.lower() for t in tensors})


def _pixel_steps(prefix: str, options: RenderOptions, outputs: Mapping[str, str]) -> list[str]:
    """The decode step and the step that turns its pixels into ``outputs``: ``<prefix>_patchify``
    in a CPU rendering with the C step, else ``<prefix>_preprocess`` (which also runs on a GPU, through DLPack)."""
    if options.uses_c_patchify:
        model, tensors = f"{prefix}_patchify", (IMAGE, IMAGE_SHAPES)
    else:
        model, tensors = f"{prefix}_preprocess", DECODED_TENSORS
    return [_decode_step(prefix, tensors), ensemble_step(model, {t: t.lower() for t in tensors}, outputs)]


def vision_ensembles(served: ServedPreset) -> list[ModelFiles]:
    """``<prefix>_vision`` (float32 PIXEL_VALUES) and ``<prefix>_vision_u8`` (the uint8 wire)."""
    preset, prefix, title, options, defaults = served.parts
    tensors = pixel_outputs(preset.patch_size)
    uint8_note = (
        f"\nThe uint8 wire: {prefix}_vision with PIXEL_PATCHES (4x smaller) instead of PIXEL_VALUES; clients\n"
        "expand them with normalize_table(image_mean, image_std) of the preprocess model's preset into\n"
        f"float32 pixel_values bit-equal to {prefix}_vision's (KimiVisionClient does)."
    )
    ensembles = []
    for wire, pixels in PIXEL_WIRES.items():
        name = f"{prefix}_vision{wire}"
        outputs = (pixels, GRID_THW, NUM_TOKENS)
        summary = f"{name} ({title}): encoded image -> {pixels.lower()}, grid_thw, num_tokens; decode -> preprocess."
        summary += uint8_note if wire else ""
        steps = _pixel_steps(prefix, options, {o: o for o in outputs})
        tensor_list = [("", tensors[o][1]) for o in outputs]
        ensembles.append(ensemble(name, summary, tensor_list, steps, defaults.pixel_batch_size, cached=True))
    return ensembles


def patch_embed_model(preset: Preset, options: RenderOptions, defaults: ServingDefaults) -> ModelFiles:
    p, hidden, seed = preset.patch_size, setting("hidden_size").default, setting("seed").default
    config = (
        pbtxt.head(
            PATCH_EMBED_MODEL,
            "kimi_patch_embed: chaining example standing in for MoonViT's patch embedding (random weights).\n"
            f"torch Conv2d(3, {hidden}, kernel={p}, stride={p}) with PyTorch's default init drawn right after\n"
            f"torch.manual_seed({seed}): reproduce in any process with\n"
            f"  torch.manual_seed({seed}); torch.nn.Conv2d(3, {hidden}, kernel_size={p}, stride={p})",
            defaults.max_batch_size,
        )
        + f"dynamic_batching {{ max_queue_delay_microseconds: {defaults.max_queue_delay_us} }}\n"
        + pbtxt.tensor_list(
            "input", [("", pbtxt.tensor(PIXEL_VALUES, "TYPE_FP32", (-1, 3, p, p), "allow_ragged_batch: true"))]
        )
        + pbtxt.tensor_list("output", [("", pbtxt.tensor(PATCH_EMBEDS, "TYPE_FP32", (-1, hidden)))])
        + instance_group(options)
        + settings_block("patch_embed", options, defaults, None)
        + pbtxt.parameters({"patch_size": p}, "The patches' side (the preset's patch_size).")
    )
    return ModelFiles(PATCH_EMBED_MODEL, config, "models.images.PatchEmbedModel")


def embed_ensemble(served: ServedPreset) -> ModelFiles:
    preset, prefix, _, options, defaults = served.parts
    name = f"{prefix}_vision_embed"
    tensors = pixel_outputs(preset.patch_size)
    outputs = [
        ("", pbtxt.tensor(PATCH_EMBEDS, "TYPE_FP32", (-1, setting("hidden_size").default))),
        ("", tensors[GRID_THW][1]),
        ("", tensors[NUM_TOKENS][1]),
    ]
    pixels = {PIXEL_VALUES: "pixel_values", GRID_THW: GRID_THW, NUM_TOKENS: NUM_TOKENS}
    steps = [
        *_pixel_steps(prefix, options, pixels),
        ensemble_step(PATCH_EMBED_MODEL, {PIXEL_VALUES: "pixel_values"}, {PATCH_EMBEDS: PATCH_EMBEDS}),
    ]
    summary = f"{name}: chaining example: decode -> preprocess -> patch_embed (pixel_values never leave the server)."
    return ensemble(name, summary, outputs, steps, defaults.pixel_batch_size)


def host_rendering(layout: HostLayout | None = None) -> RenderOptions:
    """The rendering `kimi-prep serve` starts with no flags: ``layout`` (default: this host's,
    :func:`~.host.host_layout`) as :class:`RenderOptions`."""
    layout = layout or host_layout()
    return RenderOptions(layout.instances, layout.threads, layout.kind)  # type: ignore[arg-type]


def repository_models(
    options: RenderOptions = HOST_INDEPENDENT, defaults: ServingDefaults = SERVING_DEFAULTS
) -> list[ModelFiles]:
    """Every model of the repository, rendered (see the module docstring)."""
    models: list[ModelFiles] = []
    for preset_name in SERVED_PRESETS:
        preset, prefix = PRESETS[preset_name], model_prefix(preset_name)
        title = " / ".join(preset_aliases(preset))
        served = ServedPreset(preset, prefix, title, options, defaults)
        models += [
            decode_model(served),
            preprocess_model(served),
            *([patchify_model(served)] if options.uses_c_patchify else []),
            *vision_ensembles(served),
            *fused_models(served),
            *media_models(served),
        ]
        if preset_name == defaults.embed_preset:
            models += [patch_embed_model(preset, options, defaults), embed_ensemble(served)]
    return models


def select_models(
    models: Sequence[ModelFiles], names: Collection[str] | None = None, preset: str | None = None
) -> list[ModelFiles]:
    """``models`` narrowed to ``names`` (None: all) and, with ``preset``, to that served preset's
    models (``kimi-k2.6`` is ``kimi-k2.5``'s), each ensemble with its steps; in rendering order.
    Raises ValueError for a name or preset that is not served."""
    by_name = {model.name: model for model in models}
    wanted = list(by_name) if names is None else list(names)
    unknown = sorted(set(wanted) - set(by_name))
    if unknown:
        raise ValueError(f"not served: {', '.join(unknown)}; served models: {', '.join(by_name)}")
    if preset is not None:
        served = [name for name in SERVED_PRESETS if preset in preset_aliases(PRESETS[name])]
        if not served:
            raise ValueError(f"preset {preset!r} is not served; served presets: {', '.join(SERVED_PRESETS)}")
        wanted = [name for name in wanted if name.startswith(f"{model_prefix(served[0])}_")]
    selected: set[str] = set()
    stack = list(wanted)
    while stack:
        name = stack.pop()
        if name not in selected:
            selected.add(name)
            stack.extend(by_name[name].steps)
    return [model for model in models if model.name in selected]


def model_presets(defaults: ServingDefaults = SERVING_DEFAULTS) -> dict[str, str]:
    """Served model name -> the name of the preset its pixels follow (the image models)."""
    names = {}
    for preset_name in SERVED_PRESETS:
        prefix = model_prefix(preset_name)
        for kind in ("vision", "vision_fused"):
            for wire in PIXEL_WIRES:
                names[f"{prefix}_{kind}{wire}"] = preset_name
    return names


def model_py(name: str, python_class: str) -> str:
    """The two-line ``model.py`` of a Python model (``python_class``: ``module.Class``, the module
    dotted under ``kimi_vision_server``)."""
    module, cls = python_class.rsplit(".", 1)
    return (
        f'"""Triton Python model {name}: kimi_vision_server.{module}.{cls}.\n\n'
        'Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.\n"""\n\n'
        "from kimi_vision_server.models.contract import triton_python_model\n"
        f"from kimi_vision_server.{module} import {cls}\n\n"
        f"TritonPythonModel = triton_python_model({cls})\n"
    )


def render_repository(
    out: Path,
    options: RenderOptions = HOST_INDEPENDENT,
    defaults: ServingDefaults = SERVING_DEFAULTS,
    names: Collection[str] | None = None,
) -> Path:
    """Write the repository into ``out``: ``<model>/config.pbtxt`` and ``<model>/1/model.py`` (the
    ``1/`` of an ensemble or a C-backend model gets a ``.gitkeep``) of every model, or of ``names`` and their ensembles'
    steps; model folders of ``out`` that are no longer rendered are removed. Returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models = select_models(repository_models(options, defaults), names)
    names = {model.name for model in models}
    for stale in out.glob("*/config.pbtxt"):
        if stale.parent.name not in names:
            shutil.rmtree(stale.parent)
    for model in models:
        version = out / model.name / str(MODEL_VERSION)
        version.mkdir(parents=True, exist_ok=True)
        (out / model.name / "config.pbtxt").write_text(model.config)
        if model.python_class is None:
            (version / ".gitkeep").write_text("")
        else:
            (version / "model.py").write_text(model_py(model.name, model.python_class))
    return out
