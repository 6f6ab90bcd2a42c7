"""``KimiVisionProcessor``: the checkpoint processor's two interfaces, computed in this process.

The interfaces (the checkpoint's remote code, transformers' native image processor, vLLM's calls)
are :class:`~kimi_vision_common.processor_api.ProcessorInterface`'s; this class gives the pixels.
An engine's wrapper of a loaded image and its file (vLLM's ``MediaWithBytes``: ``.media``,
``.original_bytes``) is taken as its ``.media``; a :class:`~kimi_vision_common.orientation.TurnedJpeg`
(a JPEG opened to stand for its EXIF-turned image) takes the library's decoders, its pixels then
turned. Encoded bytes, ``data:`` URLs and paths take the library's decoders (libjpeg-turbo /
simplejpeg / nvImageCodec, exact); so does a PIL JPEG opened but not yet decoded (its file's bytes,
:func:`~kimi_vision_common.pillow_open.unloaded_jpeg_bytes`); any other PIL image is used as it is.
It also splits a video into the reference's chunks (:meth:`KimiVisionProcessor.split_video_chunks`).
docs/library.md shows how an engine swaps it in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_common.orientation import TurnedJpeg
from kimi_vision_common.pillow_open import pillow_call
from kimi_vision_common.presets import Preset
from kimi_vision_common.processor_api import (
    MediaItem,
    ProcessorInterface,
    base64_payload,
    chunk_of_images,
    media_bytes,
    media_item,
    unwrapped,
)
from kimi_vision_common.results import PixelOutput

from .decode.decoder import DecodedImage, ImageDecoder
from .decode.pillow_io import pillow_pixels
from .extras import TORCH_EXTRA
from .patchify.normalize import concatenate_patches
from .pipeline import PreprocessResult, preprocess_bytes, preprocess_decoded, preprocess_turned
from .tokens import count_tokens
from .video.sampling import sample_video
from .video_pipeline import preprocess_frames, preprocess_video_chunk


def pil_decoded(image: Image.Image, preset: Preset) -> DecodedImage:
    """An opened PIL image as the decoders hand their pixels on (the preset's mode rule)."""
    pixels, resample = pillow_pixels(image, preset)
    return DecodedImage(pixels, image.width, image.height, resample, "pillow")


def rgb_frame(frame: Image.Image) -> np.ndarray:
    """uint8 ``(H, W, 3)``: a frame as the reference takes it (``convert("RGB")``)."""
    return np.asarray(pillow_call("convert a frame to RGB", frame.convert, "RGB"))


class KimiVisionProcessor(ProcessorInterface):
    """The checkpoint's vision processor (K2.5 / K2.6 / K3), bit-equal and faster, in this process.

    ``media_proc_cfg`` and ``preset`` as :class:`~kimi_vision_common.processor_api.ProcessorInterface`
    takes them. ``decoder``: the :class:`~.decode.decoder.ImageDecoder` for encoded inputs (default: the
    shared CPU one; ``ImageDecoder(device="cuda")`` decodes on a GPU and returns torch CUDA tensors).
    """

    torch_install = TORCH_EXTRA

    def __init__(
        self,
        media_proc_cfg: Mapping[str, Any] | None = None,
        preset: str | Preset | None = None,
        decoder: ImageDecoder | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(media_proc_cfg, preset, **kwargs)
        self.decoder = decoder

    def media_tokens_calculator(self, media: Mapping[str, Any]) -> int:
        """The tokens ``media`` takes in the prompt, from its size only (an encoded image's header,
        checked against the library's decode limits as preprocessing checks it)."""
        kind, payload = media_item(media)
        if kind == "image" and not isinstance(unwrapped(payload), Image.Image):
            return count_tokens(media_bytes(payload), self.preset).num_tokens  # type: ignore[arg-type]
        return super().media_tokens_calculator(media)

    def split_video_chunks(self, video: bytes | str) -> list[dict[str, Any]]:
        """A video (encoded bytes, base64 text or a ``data:`` URL) -> its chunks as the reference
        returns them: ``{"type": "video_chunk", "video_chunk": [PIL RGB frames], "prompt": ...}``."""
        if isinstance(video, str):
            data = media_bytes(video) if video.startswith("data:") else base64_payload(video, "the video's base64 text")
        else:
            data = bytes(video)
        return [
            {
                "type": "video_chunk",
                "video_chunk": [Image.fromarray(frame) for frame in chunk.frames],
                "prompt": chunk.prompt,
            }
            for chunk in sample_video(data, self.preset)  # type: ignore[arg-type]
        ]

    # -- the work ---------------------------------------------------------------------------------

    def _pixels(self, items: Sequence[MediaItem], output: PixelOutput) -> tuple[Any, np.ndarray]:
        results = [
            self._image(payload, output) if kind == "image" else self._video_chunk(payload, output)
            for kind, payload in items
        ]
        pixels = concatenate_patches([getattr(r, output) for r in results])
        return pixels, np.stack([np.asarray(r.grid_thw, dtype=np.int64) for r in results])

    def _image(self, source: Any, output: PixelOutput) -> PreprocessResult:
        source = unwrapped(source)
        if isinstance(source, TurnedJpeg) and not source.loaded:
            return preprocess_turned(source.data, source.orientation, self.preset, decoder=self.decoder, output=output)
        data = media_bytes(source)
        if data is None:
            return preprocess_decoded(pil_decoded(source, self.preset), self.preset, output=output)
        return preprocess_bytes(data, self.preset, decoder=self.decoder, output=output)

    def _video_chunk(self, frames: Sequence[Any], output: PixelOutput) -> PreprocessResult:
        frames = [unwrapped(frame) for frame in frames]
        if not chunk_of_images(frames):
            encoded = [media_bytes(f) for f in frames]
            return preprocess_video_chunk(encoded, self.preset, decoder=self.decoder, output=output)  # type: ignore[arg-type]
        return preprocess_frames([rgb_frame(frame) for frame in frames], self.preset, output=output)
