"""Every setting a served model reads from its ``config.pbtxt`` parameters, declared once.

A :class:`Setting` holds everything about one knob: its parameter name and meaning, its type and
lower bound, the library's default (where the library has the knob), the model kinds whose configs
carry it, and, where a rendered model gets another value, that value and why. From :data:`SETTINGS`
come the parser (:meth:`Setting.parse`, the typed views of ``config.py``), the rendered parameters
(:func:`rendered_parameters`), docs/serving.md's table (``settings_table.py``) and the limits the C
step reads from its config. Adding a setting is one entry here plus the code that uses it.

A preset's own fields are the other schema (``kimi_vision_common.presets``: one parameter each).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kimi_vision_common.errors import InvalidPresetError
from kimi_vision_common.wire import DEFAULT_MAX_IMAGES_PER_REQUEST
from kimi_vision_prep.buffers import DEFAULT_RECYCLE_CAP_BYTES, DEFAULT_SCRATCH_CAP_BYTES
from kimi_vision_prep.limits import DEFAULT_DECODER_POOL_SIZE, GPU_ROUTES, DecodeLimits, VideoLimits

Value = int | bool | str | None
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(key: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidPresetError(f"parameter {key}={raw!r} is not a boolean (yes/no, true/false, 1/0)")


def parse_choice(key: str, raw: str, choices: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in choices:
        raise InvalidPresetError(f"parameter {key}={raw!r} must be one of {', '.join(choices)}")
    return value


def parse_int(key: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise InvalidPresetError(f"parameter {key}={raw!r} is not an integer") from None
    if value < minimum:
        raise InvalidPresetError(f"parameter {key}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class Rendering:
    """What a served value may depend on: the model kind (``decode``, ``vision_fused_u8``, ...,
    ``patch_embed``), the instance's threads (0: all cores), the preset's request budget in
    patches (``ServingDefaults.patch_budget``) and the most patches one of its images may have
    (``kimi_vision_common.sizing.navit_patch_bound``)."""

    kind: str
    threads: int
    patch_budget: int
    image_patch_bound: int = 0


# Model kinds, by what they do with their input.
DECODERS = frozenset({"decode", "vision_fused", "vision_fused_u8", "video_chunk"})  # nvImageCodec, libjpeg, Pillow
HEADER_READERS = DECODERS | {"tokens"}  # read image headers against the size limits
PIXEL_MODELS = frozenset({"preprocess", "vision_fused", "vision_fused_u8"})  # return pixels (Python)
BUDGETED = frozenset({"decode", "preprocess", "patchify", "vision_fused", "vision_fused_u8"})  # hold patches
KERNEL_MODELS = frozenset({"decode", "preprocess", "vision_fused", "vision_fused_u8", "video", "video_chunk"})
PYTHON_MODELS = KERNEL_MODELS | {"tokens", "patch_embed"}
VIDEO_MODELS = frozenset({"video", "video_chunk"})


@dataclass(frozen=True)
class Setting:
    """One served setting. ``default``: the library's (None: no limit), or, where the library has no
    such knob (``library=False``), the value every rendering writes; ``served``: the value a
    rendering writes instead, and ``why`` it differs; ``models``: the kinds whose configs carry it
    (the parser of another kind ignores it); ``choices``: a string setting's values (else an integer
    or, ``boolean``, a yes/no)."""

    name: str
    meaning: str
    models: frozenset[str]
    default: Value
    minimum: int = 0
    boolean: bool = False
    choices: tuple[str, ...] = ()
    library: bool = True
    served: Callable[[Rendering], Value] | None = None
    why: str = ""

    def parse(self, parameters: Mapping[str, str]) -> Value:
        """The value in ``parameters`` (strings, as Triton hands them), else the default."""
        raw = parameters.get(self.name)
        if raw is None:
            return self.default
        if self.choices:
            return parse_choice(self.name, raw, self.choices)
        return parse_bool(self.name, raw) if self.boolean else parse_int(self.name, raw, self.minimum)

    def rendered(self, rendering: Rendering) -> Value:
        return self.default if self.served is None else self.served(rendering)

    def text(self, value: Value) -> str:
        """``value`` as a parameter string (booleans as yes/no)."""
        if isinstance(value, bool):
            return "yes" if value else "no"
        return "none" if value is None else str(value)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "max_images_per_request", "images (K) of one request", BUDGETED | HEADER_READERS,
        DEFAULT_MAX_IMAGES_PER_REQUEST, minimum=1,
    ),
    Setting(
        "max_patches_per_request", "NaViT patches of one request's images, from their headers", BUDGETED,
        None, minimum=1, served=lambda r: r.patch_budget,
        why="bounds what one request makes the server hold (docs/security.md): ServingDefaults.budget_images "
        "x in_patch_limit, so every single image the reference accepts fits",
    ),
    Setting(
        "max_patches_per_image", "patches one image may have after padding (the C step does not resize)",
        frozenset({"patchify"}), None, minimum=1, served=lambda r: r.image_patch_bound,
        why="a step that does not resize refuses an image beyond the NaViT rule's bound (navit_patch_bound), so "
        "no request can make it write more than a preset's images can need",
    ),
    Setting("max_encoded_bytes", "bytes of one encoded image", HEADER_READERS, DecodeLimits().max_encoded_bytes, 1),
    Setting("max_pixels", "stored width x height of one image", HEADER_READERS, DecodeLimits().max_pixels, 1),
    Setting(
        "strict_decode", "a failed fast decode is an error, not a Pillow fallback", DECODERS, False, boolean=True
    ),
    Setting(
        "gpu_route", "what a GPU instance decodes clean JPEGs with: exact (coefficients read on the CPU, libjpeg's "
        "integer IDCT, upsampling and colour in device kernels: Pillow's pixels) or nvimgcodec (its IDCT is not "
        "libjpeg's: up to 3 levels off); a CPU instance ignores it", DECODERS, GPU_ROUTES[0], choices=GPU_ROUTES,
    ),
    Setting(
        "decoder_pool_size", "GPU decodes at once (exact route) or nvImageCodec decoders kept, per instance", DECODERS,
        DEFAULT_DECODER_POOL_SIZE, minimum=1, served=lambda r: 1,
        why="an instance runs one execute at a time (its images share one nvImageCodec batch call, or on the exact "
        "route take the device one after another while the others' coefficients are read), so a second decoder "
        "would only hold scratch memory (device memory on a GPU)",
    ),
    Setting(
        "codec_threads", "nvImageCodec CPU threads per decoder (0: all cores)", DECODERS, 0,
        served=lambda r: r.threads, why="the host's layout: threads per instance",
    ),
    Setting(
        "cpu_decode_threads", "threads of one CPU decode call: images at once, a lone JPEG's row bands (0: all cores)",
        DECODERS, 0, served=lambda r: r.threads, why="the host's layout: threads per instance",
    ),
    Setting(
        "repeat_cache_bytes",
        "GPU memory a decode instance keeps for resized images of repeated inputs (0: none; on a CPU tritonserver's "
        "response cache answers repeats)", frozenset({"decode"}), 0, served=lambda r: 256 << 20,
        why="tritonserver caches no answer held on a GPU (docs/serving.md, Repeats): 256 MiB holds 26 K2.5 images "
        "at the patch cap",
    ),
    Setting(
        "numba_threads", "threads of the CPU kernels (0: all cores)", KERNEL_MODELS, 0,
        served=lambda r: r.threads, why="the host's layout: threads per instance",
    ),
    *(
        Setting(name, meaning, models, getattr(VideoLimits(), name), minimum=1)
        for name, meaning, models in (
            ("max_video_bytes", "bytes of one encoded video", frozenset({"video"})),
            ("max_frame_pixels", "width x height of one video frame", frozenset({"video"})),
            ("max_video_frames", "frames of a video stream, counted before decoding", frozenset({"video"})),
            ("max_sampled_frames", "frames sampled from one video (T of a chunk request)", VIDEO_MODELS),
        )
    ),
    Setting(
        "ffmpeg_threads",
        "FFmpeg threads of a planned H.264, MPEG-4 or MPEG-2 decode (0: the cores the frame kernels leave; "
        "HEVC and whole decodes keep the reference's)",
        frozenset({"video"}), 0, served=lambda r: r.threads, why="the host's layout: threads per instance",
    ),
    Setting(
        "scratch_cap_bytes", "scratch arena kept per thread for reuse", PYTHON_MODELS, DEFAULT_SCRATCH_CAP_BYTES,
        served=lambda r: 64 << 20 if r.kind in PIXEL_MODELS else 0,
        why="64 MiB holds a K2.5 float32 output, so a request's pixels land on the last one's pages (page faults "
        "-90% in the preprocess stubs); the other stubs' working sets do not fit it, and one that did would add "
        "~64 MiB a stub (BENCHMARKS.md's history)",
    ),
    Setting(
        "recycle_cap_bytes", "freed output buffers kept for reuse", PYTHON_MODELS, DEFAULT_RECYCLE_CAP_BYTES,
        served=lambda r: 0,
        why="a stub's outputs leave it as copies, so a free list only adds memory there (~400 MiB over the pair)",
    ),
    Setting(
        "FORCE_CPU_ONLY_INPUT_TENSORS", "the Python backend's: no: inputs stay on the GPU (DLPack hand-off)",
        frozenset({"preprocess", "patch_embed"}), False, boolean=True, library=False,
    ),
    Setting("hidden_size", "the chaining example's Conv2d width", frozenset({"patch_embed"}), 1152, 1, library=False),
    Setting("seed", "the chaining example's weight seed", frozenset({"patch_embed"}), 0, library=False),
)  # fmt: skip
SETTINGS_BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}


def setting(name: str) -> Setting:
    return SETTINGS_BY_NAME[name]


def default_of(name: str) -> Value:
    """The library's default of setting ``name`` (the dataclass defaults of ``config.py``)."""
    return SETTINGS_BY_NAME[name].default


def rendered_parameters(rendering: Rendering) -> dict[str, str]:
    """The ``parameters`` a model of ``rendering.kind`` gets: every setting that applies to it, in
    :data:`SETTINGS` order, with its rendered value."""
    return {s.name: s.text(s.rendered(rendering)) for s in SETTINGS if rendering.kind in s.models}
