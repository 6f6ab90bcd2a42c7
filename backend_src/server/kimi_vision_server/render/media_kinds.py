"""The rendered configs of the video and token-count models of a served preset (spec sections 8, 9):
``<prefix>_video`` (decoupled), ``<prefix>_video_chunk`` and ``<prefix>_tokens``."""

from __future__ import annotations

from kimi_vision_common.presets import Preset
from kimi_vision_common.wire import (
    FRAME_BYTES,
    FRAME_INDICES,
    GRID_THW,
    NUM_TOKENS,
    NUM_TOKENS_TRITON_TYPE,
    PIXEL_PATCHES,
    PIXEL_VALUES,
    PROMPT,
    TIMESTAMP,
    VIDEO_BYTES,
)

from . import pbtxt
from .blocks import (
    IMAGE_BYTES_INPUT,
    RAGGED,
    ModelFiles,
    ServedPreset,
    pixel_outputs,
    preset_block,
    python_model,
)


def _chunk_outputs(preset: Preset) -> list[tuple[str, str]]:
    tensors = pixel_outputs(preset.patch_size)
    return [
        ("float32 (T * grid_h * grid_w, 3, p, p): the chunk's frames T-major", tensors[PIXEL_VALUES][1]),
        ("uint8, same layout (computed instead when only it is requested)", tensors[PIXEL_PATCHES][1]),
        ("int64 (T, grid_h, grid_w)", pbtxt.tensor(GRID_THW, "TYPE_INT64", (3,))),
        (
            "int32: tokens of the chunk, whatever T (or fixed_output_tokens)",
            pbtxt.tensor(NUM_TOKENS, NUM_TOKENS_TRITON_TYPE, (1,)),
        ),
    ]


def video_model(served: ServedPreset) -> ModelFiles:
    preset, prefix, title, options, defaults = served.parts
    name = f"{prefix}_video"
    summary = (
        f"{name} ({title}): an encoded video (MP4, MKV, WebM, ...) -> its chunks, streamed: frames sampled\n"
        "at sample_fps, temporal_merge_kernel_size frames a chunk, each chunk with its prompt and timestamp.\n"
        "gRPC streaming clients only (decoupled); a cancelled stream stops decoding."
    )
    inputs = [("one encoded video", pbtxt.tensor(VIDEO_BYTES, "TYPE_STRING", (1,)))]
    outputs = [
        *_chunk_outputs(preset),
        ("the chunk's prompt: timestamp + video placeholder", pbtxt.tensor(PROMPT, "TYPE_STRING", (1,))),
        ("the chunk's start as the prompt writes it", pbtxt.tensor(TIMESTAMP, "TYPE_STRING", (1,))),
        ("int64 (T,): decoded-frame indices of the chunk", pbtxt.tensor(FRAME_INDICES, "TYPE_INT64", (-1,))),
    ]
    blocks, cls = [preset_block(preset, prefix)], "models.media.VideoModel"
    return python_model(name, summary, inputs, outputs, blocks, cls, options, defaults, "video", preset, decoupled=True)


def video_chunk_model(served: ServedPreset) -> ModelFiles:
    preset, prefix, title, options, defaults = served.parts
    name = f"{prefix}_video_chunk"
    summary = (
        f"{name} ({title}): T encoded frames -> one video chunk (every frame convert('RGB'), resized to the\n"
        "first frame's target under the per-frame budget, patchified T-major)."
    )
    inputs = [("T encoded frames (JPEG, PNG, ...)", pbtxt.tensor(FRAME_BYTES, "TYPE_STRING", (-1,), RAGGED))]
    blocks, cls = [preset_block(preset, prefix)], "models.media.VideoChunkModel"
    outputs = _chunk_outputs(preset)
    return python_model(name, summary, inputs, outputs, blocks, cls, options, defaults, "video_chunk", preset)


def tokens_model(served: ServedPreset) -> ModelFiles:
    preset, prefix, title, options, defaults = served.parts
    name = f"{prefix}_tokens"
    summary = (
        f"{name} ({title}): K encoded images -> grid_thw, num_tokens and prompt from the headers alone (no\n"
        "pixel decoded): equal to full preprocessing's for every image that preprocesses."
    )
    outputs = [
        ("int64 (K, 3)", pbtxt.tensor(GRID_THW, "TYPE_INT64", (-1, 3))),
        ("int32 (K,)", pbtxt.tensor(NUM_TOKENS, NUM_TOKENS_TRITON_TYPE, (-1,))),
        ("the image placeholder of each image", pbtxt.tensor(PROMPT, "TYPE_STRING", (-1,))),
    ]
    blocks, cls = [preset_block(preset, prefix)], "models.media.TokensModel"
    return python_model(name, summary, IMAGE_BYTES_INPUT, outputs, blocks, cls, options, defaults, "tokens", preset)


def media_models(served: ServedPreset) -> list[ModelFiles]:
    """The video, video-chunk and token-count models of one served preset."""
    return [video_model(served), video_chunk_model(served), tokens_model(served)]
