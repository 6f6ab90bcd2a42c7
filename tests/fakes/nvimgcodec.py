"""A fake ``nvidia.nvimgcodec`` for the CUDA decode path, which needs a GPU to run for real.

It records how the library builds and calls the decoder (device id, backends, options, decode
parameters, CUDA stream) and answers with images that expose ``__dlpack__`` over a CPU torch
tensor of the image's stored size holding a marker pattern (not decoded pixels: the fake proves
the calls and the hand-off, the GPU check proves the pixels), so ``torch.from_dlpack`` runs for
real. ``outcome`` chooses what
the next decode call does: ``"ok"`` (images), ``"none"`` (``None`` per item, as nvImageCodec does
for an image it cannot decode) or ``"raise"``.
"""

from __future__ import annotations

import enum
import io
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

Outcome = Literal["ok", "none", "raise"]

NVIMGCODEC_DEVICE_CPU_ONLY = -99  # a value no real device id can take


class BackendKind(enum.Enum):
    CPU_ONLY = "cpu_only"
    GPU_ONLY = "gpu_only"
    HYBRID_CPU_GPU = "hybrid_cpu_gpu"
    HW_GPU_ONLY = "hw_gpu_only"


class ColorSpec(enum.Enum):
    SRGB = "srgb"
    UNCHANGED = "unchanged"


@dataclass(frozen=True)
class Backend:
    backend_kind: BackendKind


@dataclass(frozen=True)
class DecodeParams:
    apply_exif_orientation: bool = True
    color_spec: ColorSpec = ColorSpec.SRGB
    allow_any_depth: bool = False


@dataclass(frozen=True)
class CodeStream:
    data: bytes


class FakeDecodeError(RuntimeError):
    """What the fake raises for ``outcome == "raise"``."""


class FakeImage:
    """A "decoded" image: uint8 ``(H, W, 3)`` of the header's size, a marker pattern (values from
    the position), in a CPU tensor handed out through DLPack."""

    def __init__(self, data: bytes) -> None:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        marker = (np.arange(height * width * 3, dtype=np.int64) % 251).astype(np.uint8)
        self.tensor = torch.from_numpy(marker.reshape(height, width, 3))

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.tensor.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.tensor.__dlpack_device__()

    def cpu(self) -> np.ndarray:
        return self.tensor.numpy()


@dataclass
class DecodeCall:
    decoder: Decoder
    streams: list[CodeStream]
    params: DecodeParams | None
    cuda_stream: int | None
    images: list[FakeImage | None]


@dataclass
class FakeNvImgCodec:
    """Module stand-in: the attributes ``decode/decoder.py`` reads, plus what the tests inspect."""

    outcome: Outcome = "ok"
    decoders: list[Decoder] = field(default_factory=list)
    calls: list[DecodeCall] = field(default_factory=list)

    NVIMGCODEC_DEVICE_CPU_ONLY = NVIMGCODEC_DEVICE_CPU_ONLY
    Backend = Backend
    BackendKind = BackendKind
    ColorSpec = ColorSpec
    CodeStream = CodeStream
    DecodeParams = DecodeParams

    def Decoder(self, **kwargs: Any) -> Decoder:  # named like the real API's class
        decoder = Decoder(self, **kwargs)
        self.decoders.append(decoder)
        return decoder


class Decoder:
    def __init__(
        self,
        codec: FakeNvImgCodec,
        *,
        device_id: int = -1,
        max_num_cpu_threads: int = 0,
        backends: list[Backend] | None = None,
        options: str = "",
    ) -> None:
        self.codec = codec
        self.device_id = device_id
        self.max_num_cpu_threads = max_num_cpu_threads
        self.backend_kinds = [b.backend_kind for b in backends or []]
        self.options = options

    def decode(
        self, srcs: list[CodeStream], *, params: DecodeParams | None = None, cuda_stream: int | None = None
    ) -> list[FakeImage | None]:
        if self.codec.outcome == "raise":
            raise FakeDecodeError("decoder state corrupted")
        images = [FakeImage(s.data) if self.codec.outcome == "ok" else None for s in srcs]
        self.codec.calls.append(DecodeCall(self, list(srcs), params, cuda_stream, images))
        return images
