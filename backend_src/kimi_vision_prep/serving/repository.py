"""The model repository, rendered from the presets: every ``config.pbtxt`` and ``model.py``.

``presets.SERVED_PRESETS`` is the one source: each served preset gets the models
``<prefix>_decode``, ``_preprocess``, ``_vision``, ``_vision_u8``, ``_vision_fused`` (prefix by
:func:`~kimi_vision_prep.presets.model_prefix`: ``kimi-k2.5`` -> ``kimi_k25``); the preset of
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..presets import PRESETS, SERVED_PRESETS, Preset, model_prefix, preset_aliases, preset_parameters
from .config import DecoderSettings

InstanceKind = Literal["cpu", "gpu"]
PATCH_EMBED_MODEL = "kimi_patch_embed"


@dataclass(frozen=True)
class RenderOptions:
    """Host-dependent knobs of a rendering; the defaults are host-independent (the checked-in copy).

    ``instances``: ``instance_group`` count of every Python model; ``threads``: ``numba_threads``
    and ``decoder_threads`` of each instance (0: all cores); ``kind``: ``KIND_CPU`` / ``KIND_GPU``,
    or None to leave it unset (Triton then picks GPU where there is one, CPU elsewhere).
    """

    instances: int = 1
    threads: int = 0
    kind: InstanceKind | None = None

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.kind not in (None, "cpu", "gpu"):
            raise ValueError(f"kind must be 'cpu' or 'gpu', got {self.kind!r}")


@dataclass(frozen=True)
class ServingDefaults:
    """Serving settings that are not a preset's: batching, backpressure, the chaining example."""

    max_batch_size: int = 8
    max_queue_delay_us: int = 1000
    max_queue_size: int = 128
    queue_timeout_us: int = 30_000_000
    embed_preset: str = "kimi-k2.5"
    embed_hidden_size: int = 1152
    embed_seed: int = 0


@dataclass(frozen=True)
class ModelFiles:
    """One rendered model: ``config.pbtxt`` text, and the Python class its ``model.py`` exports
    (None for an ensemble, whose version folder only holds a ``.gitkeep``)."""

    name: str
    config: str
    python_class: str | None


# -- pbtxt pieces ---------------------------------------------------------------------------------


def _comment(text: str) -> str:
    return "".join(f"# {line}\n" if line else "#\n" for line in text.strip().splitlines())


def _tensor(name: str, data_type: str, dims: Iterable[int], extra: str = "") -> str:
    dims_text = ", ".join(str(d) for d in dims)
    return f'{{ name: "{name}" data_type: {data_type} dims: [ {dims_text} ]{" " + extra if extra else ""} }}'


def _tensor_list(key: str, entries: Iterable[tuple[str, str]]) -> str:
    """``input [...]`` / ``output [...]`` from ``(comment, tensor)`` pairs (empty comment: none)."""
    lines = []
    entries = list(entries)
    for index, (comment, tensor) in enumerate(entries):
        lines.extend(f"  # {line}" for line in comment.splitlines() if comment)
        lines.append(f"  {tensor}{',' if index < len(entries) - 1 else ''}")
    return f"{key} [\n" + "\n".join(lines) + "\n]\n"


def _parameters(values: Mapping[str, object], comment: str = "") -> str:
    lines = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())
    return (_comment(comment) if comment else "") + lines


def _head(name: str, summary: str, max_batch_size: int, backend: str = "python") -> str:
    kind = 'backend: "python"' if backend == "python" else 'platform: "ensemble"'
    return _comment(summary) + f'name: "{name}"\n{kind}\nmax_batch_size: {max_batch_size}\n'


def _dynamic_batching(defaults: ServingDefaults) -> str:
    waits = defaults.max_queue_size // defaults.max_batch_size
    return _comment(
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


def _instance_group(options: RenderOptions) -> str:
    if options.kind is None:
        return (
            _comment("kind unset: KIND_GPU on GPU hosts, KIND_CPU elsewhere (render with --kind to fix it).")
            + f"instance_group [ {{ count: {options.instances} }} ]\n"
        )
    return f"instance_group [ {{ count: {options.instances} kind: KIND_{options.kind.upper()} }} ]\n"


def _preset_block(preset: Preset, prefix: str) -> str:
    return _parameters(
        preset_parameters(preset),
        f"Preset {preset.name}: every field of kimi_vision_prep.Preset (read back by preset_from_parameters);\n"
        f"rendered from presets.py, the same block in every {prefix}_* Python model.",
    )


def _decoder_block(options: RenderOptions) -> str:
    settings = dataclasses.replace(DecoderSettings(), decoder_threads=options.threads)
    return (
        _parameters(
            {"decoder_pool_size": settings.decoder_pool_size, "decoder_threads": settings.decoder_threads},
            "nvImageCodec decoders alive per instance, and CPU threads per decoder (0: all cores).",
        )
        + _parameters(
            {"max_encoded_bytes": settings.max_encoded_bytes, "max_pixels": settings.max_pixels},
            "Limits checked before any pixel is decoded (encoded bytes; Pillow's bomb threshold).",
        )
        + _parameters(
            {"strict_decode": "yes" if settings.strict_decode else "no"},
            "yes: a failed fast decode is an error instead of a counted, logged Pillow fallback.",
        )
    )


def _numba_block(options: RenderOptions) -> str:
    return _parameters(
        {"numba_threads": options.threads}, "Threads of the CPU kernels per instance (0: numba's default, all cores)."
    )


def _pixel_outputs(p: int) -> dict[str, tuple[str, str]]:
    """The preprocess outputs by name: ``(comment, tensor)``."""
    return {
        "PIXEL_VALUES": (
            "float32 (grid_h * grid_w, 3, patch_size, patch_size)",
            _tensor("PIXEL_VALUES", "TYPE_FP32", (-1, 3, p, p)),
        ),
        "PIXEL_PATCHES": (
            "uint8, same layout: the patches before the normalise lookup\n"
            "(PIXEL_VALUES = normalize_table(mean, std)[PIXEL_PATCHES, c]); only requested outputs are computed.",
            _tensor("PIXEL_PATCHES", "TYPE_UINT8", (-1, 3, p, p)),
        ),
        "GRID_THW": ("int64 (1, grid_h, grid_w)", _tensor("GRID_THW", "TYPE_INT64", (3,))),
        "NUM_TOKENS": ("", _tensor("NUM_TOKENS", "TYPE_INT32", (1,))),
    }


IMAGE_BYTES_INPUT = [("", _tensor("IMAGE_BYTES", "TYPE_STRING", (1,)))]
DECODED_TENSORS = ("IMAGE", "MODE", "ORIGINAL_SIZE", "RESAMPLE")


# -- the model kinds ------------------------------------------------------------------------------


def _python_model(  # noqa: PLR0917
    name: str,
    summary: str,
    inputs: Iterable[tuple[str, str]],
    outputs: Iterable[tuple[str, str]],
    blocks: Iterable[str],
    python_class: str,
    options: RenderOptions,
    defaults: ServingDefaults,
) -> ModelFiles:
    """A Python-backend image model: batching and backpressure, tensors, instances, parameters."""
    config = (
        _head(name, summary, defaults.max_batch_size)
        + _dynamic_batching(defaults)
        + _tensor_list("input", inputs)
        + _tensor_list("output", outputs)
        + _instance_group(options)
        + "".join(blocks)
    )
    return ModelFiles(name, config, python_class)


def decode_model(
    preset: Preset, prefix: str, title: str, options: RenderOptions, defaults: ServingDefaults
) -> ModelFiles:
    name = f"{prefix}_decode"
    outputs = [
        (
            "uint8 (H, W, C): the decoded pixels at the stored size in the source mode MODE: RGB (C = 3),\n"
            "RGBA (C = 4, straight alpha, K3), or another Pillow mode's raw bytes (C bytes per pixel)",
            _tensor("IMAGE", "TYPE_UINT8", (-1, -1, -1)),
        ),
        (
            'RGB, RGBA, or a Pillow mode [+ " transparency=V"] (serving/requests.py)',
            _tensor("MODE", "TYPE_STRING", (1,)),
        ),
        (
            "(width, height) of the stored image (EXIF orientation not applied)",
            _tensor("ORIGINAL_SIZE", "TYPE_INT64", (2,)),
        ),
        ("0 bicubic, 1 nearest (palette and 1-bit sources under K3)", _tensor("RESAMPLE", "TYPE_UINT8", (1,))),
        ("nvimgcodec-cpu, nvimgcodec-cuda or pillow", _tensor("DECODE_PATH", "TYPE_STRING", (1,))),
    ]
    summary = (
        f"{name} ({title}): encoded image bytes -> pixels with Pillow's verdict. All requests of one\n"
        "execute() are decoded in one nvImageCodec batch call (fancy chroma upsampling, no EXIF rotation);\n"
        "what nvImageCodec cannot decode exactly goes through Pillow. On a GPU instance IMAGE is a CUDA\n"
        "tensor handed over through DLPack."
    )
    blocks = [_decoder_block(options), _preset_block(preset, prefix)]
    return _python_model(name, summary, IMAGE_BYTES_INPUT, outputs, blocks, "DecodeModel", options, defaults)


def preprocess_model(
    preset: Preset, prefix: str, title: str, options: RenderOptions, defaults: ServingDefaults
) -> ModelFiles:
    name = f"{prefix}_preprocess"
    inputs = [
        ("", _tensor("IMAGE", "TYPE_UINT8", (-1, -1, -1), "allow_ragged_batch: true")),
        ("", _tensor("MODE", "TYPE_STRING", (1,))),
        ("", _tensor("ORIGINAL_SIZE", "TYPE_INT64", (2,))),
        ("", _tensor("RESAMPLE", "TYPE_UINT8", (1,))),
    ]
    summary = (
        f"{name} ({title}): decoded pixels -> NaViT resize, pad, normalise, patchify.\n"
        'Host input: numba kernels (bit-exact). GPU input (FORCE_CPU_ONLY_INPUT_TENSORS "no"): wrapped\n'
        "through DLPack without a host copy and processed with torch on that device."
    )
    outputs = _pixel_outputs(preset.patch_size).values()
    blocks = [
        _parameters({"FORCE_CPU_ONLY_INPUT_TENSORS": "no"}),
        _numba_block(options),
        _preset_block(preset, prefix),
    ]
    return _python_model(name, summary, inputs, outputs, blocks, "PreprocessModel", options, defaults)


def fused_model(
    preset: Preset, prefix: str, title: str, options: RenderOptions, defaults: ServingDefaults
) -> ModelFiles:
    name = f"{prefix}_vision_fused"
    summary = (
        f"{name} ({title}): encoded image -> pixel_values / pixel_patches, grid_thw, num_tokens in ONE\n"
        f"Python model: {prefix}_vision's decode and preprocess without the ensemble hop between them (the\n"
        "decoded image copied through the stub's shared memory twice). For CPU hosts; the ensembles remain\n"
        "the way to chain further models and to scale decode and preprocess apart, as on a GPU host."
    )
    outputs = _pixel_outputs(preset.patch_size).values()
    blocks = [_decoder_block(options), _numba_block(options), _preset_block(preset, prefix)]
    return _python_model(name, summary, IMAGE_BYTES_INPUT, outputs, blocks, "FusedVisionModel", options, defaults)


def _step(model: str, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> str:
    maps = [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n' + "\n".join(maps) + "\n    }"


def _ensemble(name: str, summary: str, outputs: list[tuple[str, str]], steps: list[str], batch: int) -> ModelFiles:
    config = (
        _head(name, summary, batch, backend="ensemble")
        + _tensor_list("input", IMAGE_BYTES_INPUT)
        + _tensor_list("output", outputs)
        + "ensemble_scheduling {\n  step [\n"
        + ",\n".join(steps)
        + "\n  ]\n}\n"
    )
    return ModelFiles(name, config, None)


def _decode_step(prefix: str) -> str:
    return _step(f"{prefix}_decode", {"IMAGE_BYTES": "IMAGE_BYTES"}, {t: t.lower() for t in DECODED_TENSORS})


def _preprocess_step(prefix: str, outputs: Mapping[str, str]) -> str:
    return _step(f"{prefix}_preprocess", {t: t.lower() for t in DECODED_TENSORS}, outputs)


def vision_ensembles(preset: Preset, prefix: str, title: str, defaults: ServingDefaults) -> list[ModelFiles]:
    """``<prefix>_vision`` (float32 PIXEL_VALUES) and ``<prefix>_vision_u8`` (the uint8 wire)."""
    tensors = _pixel_outputs(preset.patch_size)
    uint8_note = (
        f"\nThe uint8 wire: {prefix}_vision with PIXEL_PATCHES (4x smaller) instead of PIXEL_VALUES; clients\n"
        "expand them with normalize_table(image_mean, image_std) of the preprocess model's preset into\n"
        f"float32 pixel_values bit-equal to {prefix}_vision's (KimiVisionClient does)."
    )
    ensembles = []
    for suffix, pixels, note in (("vision", "PIXEL_VALUES", ""), ("vision_u8", "PIXEL_PATCHES", uint8_note)):
        name = f"{prefix}_{suffix}"
        outputs = (pixels, "GRID_THW", "NUM_TOKENS")
        summary = f"{name} ({title}): encoded image -> {pixels.lower()}, grid_thw, num_tokens; decode -> preprocess."
        steps = [_decode_step(prefix), _preprocess_step(prefix, {o: o for o in outputs})]
        ensembles.append(
            _ensemble(name, summary + note, [("", tensors[o][1]) for o in outputs], steps, defaults.max_batch_size)
        )
    return ensembles


def patch_embed_model(preset: Preset, options: RenderOptions, defaults: ServingDefaults) -> ModelFiles:
    p, hidden = preset.patch_size, defaults.embed_hidden_size
    config = (
        _head(
            PATCH_EMBED_MODEL,
            "kimi_patch_embed: chaining example standing in for MoonViT's patch embedding (random weights).\n"
            f"torch Conv2d(3, {hidden}, kernel={p}, stride={p}) with PyTorch's default init drawn right after\n"
            f"torch.manual_seed({defaults.embed_seed}): reproduce in any process with\n"
            f"  torch.manual_seed({defaults.embed_seed}); torch.nn.Conv2d(3, {hidden}, kernel_size={p}, stride={p})",
            defaults.max_batch_size,
        )
        + f"dynamic_batching {{ max_queue_delay_microseconds: {defaults.max_queue_delay_us} }}\n"
        + _tensor_list("input", [("", _tensor("PIXEL_VALUES", "TYPE_FP32", (-1, 3, p, p), "allow_ragged_batch: true"))])
        + _tensor_list("output", [("", _tensor("PATCH_EMBEDS", "TYPE_FP32", (-1, hidden)))])
        + _instance_group(options)
        + _parameters(
            {
                "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
                "seed": defaults.embed_seed,
                "hidden_size": hidden,
                "patch_size": p,
            }
        )
    )
    return ModelFiles(PATCH_EMBED_MODEL, config, "PatchEmbedModel")


def embed_ensemble(preset: Preset, prefix: str, defaults: ServingDefaults) -> ModelFiles:
    name = f"{prefix}_vision_embed"
    tensors = _pixel_outputs(preset.patch_size)
    outputs = [
        ("", _tensor("PATCH_EMBEDS", "TYPE_FP32", (-1, defaults.embed_hidden_size))),
        ("", tensors["GRID_THW"][1]),
        ("", tensors["NUM_TOKENS"][1]),
    ]
    steps = [
        _decode_step(prefix),
        _preprocess_step(prefix, {"PIXEL_VALUES": "pixel_values", "GRID_THW": "GRID_THW", "NUM_TOKENS": "NUM_TOKENS"}),
        _step(PATCH_EMBED_MODEL, {"PIXEL_VALUES": "pixel_values"}, {"PATCH_EMBEDS": "PATCH_EMBEDS"}),
    ]
    summary = f"{name}: chaining example: decode -> preprocess -> patch_embed (pixel_values never leave the server)."
    return _ensemble(name, summary, outputs, steps, defaults.max_batch_size)


def repository_models(
    options: RenderOptions = RenderOptions(), defaults: ServingDefaults = ServingDefaults()
) -> list[ModelFiles]:
    """Every model of the repository, rendered (see the module docstring)."""
    models: list[ModelFiles] = []
    for preset_name in SERVED_PRESETS:
        preset, prefix = PRESETS[preset_name], model_prefix(preset_name)
        title = " / ".join(preset_aliases(preset))
        models += [
            decode_model(preset, prefix, title, options, defaults),
            preprocess_model(preset, prefix, title, options, defaults),
            *vision_ensembles(preset, prefix, title, defaults),
            fused_model(preset, prefix, title, options, defaults),
        ]
        if preset_name == defaults.embed_preset:
            models += [patch_embed_model(preset, options, defaults), embed_ensemble(preset, prefix, defaults)]
    return models


def model_presets(defaults: ServingDefaults = ServingDefaults()) -> dict[str, str]:
    """Served model name -> the name of the preset its pixels follow (the image models)."""
    names = {}
    for preset_name in SERVED_PRESETS:
        prefix = model_prefix(preset_name)
        for suffix in ("vision", "vision_u8", "vision_fused"):
            names[f"{prefix}_{suffix}"] = preset_name
    return names


def model_py(name: str, python_class: str) -> str:
    return (
        f'"""Triton Python model {name}: kimi_vision_prep.serving.models.{python_class}.\n\n'
        'Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.\n"""\n\n'
        f"from kimi_vision_prep.serving.models import {python_class}, triton_python_model\n\n"
        f"TritonPythonModel = triton_python_model({python_class})\n"
    )


def render_repository(
    out: Path, options: RenderOptions = RenderOptions(), defaults: ServingDefaults = ServingDefaults()
) -> Path:
    """Write the repository into ``out``: ``<model>/config.pbtxt`` and ``<model>/1/model.py`` (an
    ensemble's ``1/`` gets a ``.gitkeep``); model folders of ``out`` that are no longer rendered are
    removed. Returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models = repository_models(options, defaults)
    names = {model.name for model in models}
    for stale in out.glob("*/config.pbtxt"):
        if stale.parent.name not in names:
            shutil.rmtree(stale.parent)
    for model in models:
        version = out / model.name / "1"
        version.mkdir(parents=True, exist_ok=True)
        (out / model.name / "config.pbtxt").write_text(model.config)
        if model.python_class is None:
            (version / ".gitkeep").write_text("")
        else:
            (version / "model.py").write_text(model_py(model.name, model.python_class))
    return out
