"""The video and token-count models: ``kimi_*_video`` (decoupled), ``kimi_*_video_chunk``, ``kimi_*_tokens``.

=========================  ===============================  ================================================
model                      inputs                           outputs (the leading 1 is the batch dimension)
=========================  ===============================  ================================================
``kimi_*_video``           VIDEO_BYTES bytes ``[1, 1]``     one response per chunk, as soon as it is ready:
(decoupled)                                                 PIXEL_VALUES float32 ``[1, T*gh*gw, 3, p, p]``
                                                            (or PIXEL_PATCHES uint8 when only they are
                                                            requested), GRID_THW int64 ``[1, 3]``,
                                                            NUM_TOKENS int32 ``[1, 1]``, PROMPT and
                                                            TIMESTAMP bytes ``[1, 1]``, FRAME_INDICES int64
                                                            ``[1, T]``; then an empty response flagged
                                                            final (an error mid-stream: one error response
                                                            flagged final, after the chunks sent)
``kimi_*_video_chunk``     FRAME_BYTES bytes ``[1, T]``     the chunk tensors above (no PROMPT, TIMESTAMP,
                                                            FRAME_INDICES)
``kimi_*_tokens``          IMAGE_BYTES bytes ``[1, K]``     GRID_THW int64 ``[1, K, 3]``, NUM_TOKENS int32
                                                            ``[1, K]``, PROMPT bytes ``[1, K]``, from the
                                                            headers only
=========================  ===============================  ================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kimi_vision_common.errors import VideoTooLargeError
from kimi_vision_common.presets import preset_from_parameters
from kimi_vision_common.results import VideoChunkResult
from kimi_vision_common.wire import (
    FRAME_BYTES,
    FRAME_INDICES,
    GRID_THW,
    IMAGE_BYTES,
    NUM_TOKENS,
    NUM_TOKENS_DTYPE,
    PIXEL_PATCHES,
    PIXEL_VALUES,
    PROMPT,
    TIMESTAMP,
    VIDEO_BYTES,
)
from kimi_vision_prep.pipeline import PIXEL_OUTPUTS, PixelOutput, map_indexed
from kimi_vision_prep.tokens import count_tokens
from kimi_vision_prep.video_pipeline import preprocess_frames, preprocess_video, preprocess_video_chunk

from .components import apply_numba_threads, settings_decoder
from .config import decoder_settings, video_settings
from .contract import Result, ServingModel, StreamingModel
from .requests import images_from_input, strings_from_input
from .warmup import warmup_clip, warmup_frames, warmup_images


def pixel_output(requested: frozenset[str] | None) -> str:
    """``pixel_patches`` when a request names PIXEL_PATCHES and not PIXEL_VALUES, else ``pixel_values``."""
    if requested is not None and PIXEL_PATCHES in requested and PIXEL_VALUES not in requested:
        return "pixel_patches"
    return "pixel_values"


def chunk_outputs(result: Any) -> dict[str, Any]:
    """The tensors of one chunk (a ``PreprocessResult`` or a ``VideoChunkResult``)."""
    outputs: dict[str, Any] = {
        GRID_THW: np.asarray(result.grid_thw, dtype=np.int64)[None],
        NUM_TOKENS: np.array([[result.num_tokens]], dtype=NUM_TOKENS_DTYPE),
    }
    if result.pixel_values is not None:
        outputs[PIXEL_VALUES] = result.pixel_values[None]
    if result.pixel_patches is not None:
        outputs[PIXEL_PATCHES] = result.pixel_patches[None]
    return outputs


class TokensModel(ServingModel):
    """``kimi_*_tokens``: grid, tokens and prompt of K images from their headers (no pixels)."""

    stage = "tokens"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.preset = preset_from_parameters(self.parameters)
        self.settings = decoder_settings(self.parameters)
        self.io.log("info", f"{self.name}: preset {self.preset.name}, {self.settings}")

    def count(self, request: Any) -> Result:
        items = images_from_input(self.io.get_input(request, IMAGE_BYTES), self.settings.max_images_per_request)
        counts = map_indexed(lambda data: count_tokens(data, self.preset, limits=self.settings.limits), items, "image")
        return {
            GRID_THW: np.array([[c.grid_thw for c in counts]], dtype=np.int64),
            NUM_TOKENS: np.array([[c.num_tokens for c in counts]], dtype=NUM_TOKENS_DTYPE),
            PROMPT: np.array([[c.prompt.encode() for c in counts]], dtype=np.object_),
        }

    def handle(self, requests: Sequence[Any]) -> list[Result]:
        return self.per_request(requests, self.count)


class VideoChunkModel(ServingModel):
    """``kimi_*_video_chunk``: T encoded frames -> one chunk (frames decoded like
    ``Image.open(...).convert("RGB")`` under every preset, through the routed decoder)."""

    stage = "video_chunk"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.preset = preset_from_parameters(self.parameters)
        self.settings = decoder_settings(self.parameters)
        self.video = video_settings(self.parameters)
        self.decoder = settings_decoder(self.settings, self.device)
        apply_numba_threads(self.parameters)
        images = warmup_images()
        for output in PIXEL_OUTPUTS:  # each warm-up image a one-frame chunk
            for data in images:
                preprocess_video_chunk([data], self.preset, decoder=self.decoder, output=output)
        self.io.log("info", f"{self.name}: preset {self.preset.name}, {self.settings}, {self.video}")

    def chunk(self, request: Any) -> Result:
        frames = strings_from_input(self.io.get_input(request, FRAME_BYTES), FRAME_BYTES)
        if len(frames) > self.video.limits.max_sampled_frames:
            raise VideoTooLargeError(
                f"{len(frames)} frames exceed max_sampled_frames={self.video.limits.max_sampled_frames}"
            )
        output = pixel_output(self.requested_outputs(request))
        return chunk_outputs(preprocess_video_chunk(frames, self.preset, decoder=self.decoder, output=output))

    def handle(self, requests: Sequence[Any]) -> list[Result]:
        return self.per_request(requests, self.chunk)


class VideoModel(StreamingModel):
    """``kimi_*_video`` (decoupled): one video a request, one response per chunk as it is ready;
    a cancelled stream stops decoding (``kimi_prep_video_frames_decoded_total`` shows it)."""

    stage = "video"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.preset = preset_from_parameters(self.parameters)
        self.video = video_settings(self.parameters)
        apply_numba_threads(self.parameters)
        clip, frames = warmup_clip(), warmup_frames()
        for output in PIXEL_OUTPUTS:
            for _ in self.chunks(clip, output):
                pass
            for frame in frames:
                preprocess_frames([frame, frame], self.preset, output)
        self.io.log("info", f"{self.name}: preset {self.preset.name}, {self.video}")

    def chunks(
        self, data: bytes, output: PixelOutput, on_frame: Callable[[], None] | None = None
    ) -> Iterator[VideoChunkResult]:
        """The chunks of one video under this model's settings."""
        return preprocess_video(
            data, self.preset, output=output, limits=self.video.limits, threads=self.video.ffmpeg_threads,
            on_frame=on_frame,
        )

    def stream(self, request: Any) -> Iterator[Result]:
        (data,) = strings_from_input(self.io.get_input(request, VIDEO_BYTES), VIDEO_BYTES)
        output = pixel_output(self.requested_outputs(request))
        for chunk in self.chunks(data, output, on_frame=lambda: self.metrics.count_video_frames(1)):
            outputs = chunk_outputs(chunk)
            outputs[PROMPT] = np.array([[chunk.prompt.encode()]], dtype=np.object_)
            outputs[TIMESTAMP] = np.array([[chunk.timestamp.encode()]], dtype=np.object_)
            outputs[FRAME_INDICES] = np.array([chunk.frame_indices], dtype=np.int64)
            yield outputs
