"""Videos over a gRPC stream and token counts, for
:class:`~kimi_vision_client.client.KimiVisionClient`.

``kimi_*_video`` is decoupled: one request, one response per chunk, then an empty response flagged
final (requested with ``enable_empty_final_response``). Only gRPC streams carry that; HTTP raises
a clear :class:`InvalidRequestError`. Closing the iterator early cancels the request on the
server (``stop_stream(cancel_requests=True)``), which stops its decoding.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tritonclient.grpc

from kimi_vision_common.errors import InvalidRequestError
from kimi_vision_common.patches import expand_patches
from kimi_vision_common.results import TokenCount, VideoChunkResult
from kimi_vision_common.wire import FRAME_INDICES, IMAGE_BYTES, PROMPT, TIMESTAMP, VIDEO_BYTES

from .wire import GRID_THW, NUM_TOKENS, PIXEL_PATCHES, Wire

VIDEO_OUTPUTS = (PROMPT, TIMESTAMP, FRAME_INDICES)
STREAM_TIMEOUT_S = 300.0  # the longest wait for one chunk


def sibling_model(model: str, kind: str) -> str:
    """``kimi_k25_vision_u8`` -> ``kimi_k25_<kind>``: the models of one preset share a prefix."""
    prefix = model.split("_vision", maxsplit=1)[0]
    for suffix in ("_video_chunk", "_video", "_tokens"):
        prefix = prefix.removesuffix(suffix)
    return f"{prefix}_{kind}"


def _text(array: np.ndarray) -> str:
    value = np.asarray(array).reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def chunk_from_outputs(outputs: Mapping[str, np.ndarray], wire: Wire) -> VideoChunkResult:
    """One streamed response -> :class:`~kimi_vision_common.results.VideoChunkResult` (float32 pixel_values;
    uint8 patches expanded with the wire's preset)."""
    if wire.pixel_output == PIXEL_PATCHES:
        pixel_values = expand_patches(np.asarray(outputs[PIXEL_PATCHES][0]), wire.preset)
    else:
        pixel_values = np.array(outputs[wire.pixel_output][0], dtype=np.float32)
    return VideoChunkResult(
        pixel_values=pixel_values,
        grid_thw=np.array(outputs[GRID_THW], dtype=np.int64).reshape(3),
        num_tokens=int(np.asarray(outputs[NUM_TOKENS]).reshape(())),
        prompt=_text(outputs[PROMPT]),
        timestamp=_text(outputs[TIMESTAMP]),
        frame_indices=tuple(int(i) for i in np.asarray(outputs[FRAME_INDICES]).reshape(-1)),
    )


def stream_video(
    url: str, model: str, data: bytes, wire: Wire, error_from_server: Callable[[Exception], Exception]
) -> Iterator[VideoChunkResult]:
    """The chunks of ``data`` from the decoupled ``model`` at ``url`` (gRPC), as they arrive."""
    responses: queue.Queue[tuple[Any, Exception | None]] = queue.Queue()
    client = tritonclient.grpc.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        video = tritonclient.grpc.InferInput(VIDEO_BYTES, [1, 1], "BYTES")
        video.set_data_from_numpy(np.array([[data]], dtype=np.object_))
        names = (wire.pixel_output, GRID_THW, NUM_TOKENS, *VIDEO_OUTPUTS)
        outputs = [tritonclient.grpc.InferRequestedOutput(name) for name in names]
        client.async_stream_infer(model, [video], outputs=outputs, enable_empty_final_response=True)
        while True:
            try:
                result, error = responses.get(timeout=STREAM_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"no response from {model} for {STREAM_TIMEOUT_S:g} s") from None
            if error is not None:
                raise error_from_server(error)
            response = result.get_response()
            if response.outputs:
                yield chunk_from_outputs({name: result.as_numpy(name) for name in names}, wire)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def require_grpc(protocol: str) -> None:
    if protocol != "grpc":
        raise InvalidRequestError(
            "the video models are decoupled (one response per chunk): they need a gRPC stream; "
            "use KimiVisionClient(..., protocol='grpc')"
        )


def token_counts(outputs: Mapping[str, np.ndarray]) -> list[TokenCount]:
    """A ``kimi_*_tokens`` response -> one :class:`~kimi_vision_common.results.TokenCount` per image."""
    grids = np.array(outputs[GRID_THW], dtype=np.int64).reshape(-1, 3)
    tokens = np.asarray(outputs[NUM_TOKENS]).reshape(-1)
    prompts = np.asarray(outputs[PROMPT]).reshape(-1)
    return [
        TokenCount(grid, int(count), prompt.decode() if isinstance(prompt, bytes) else str(prompt))
        for grid, count, prompt in zip(grids, tokens, prompts, strict=True)
    ]


def tokens_request(module: Any, items: Sequence[bytes]) -> tuple[list[Any], list[Any]]:
    """The inputs and requested outputs of a ``kimi_*_tokens`` request for ``items``."""
    images = module.InferInput(IMAGE_BYTES, [1, len(items)], "BYTES")
    images.set_data_from_numpy(np.array([list(items)], dtype=np.object_))
    return [images], [module.InferRequestedOutput(name) for name in (GRID_THW, NUM_TOKENS, PROMPT)]
