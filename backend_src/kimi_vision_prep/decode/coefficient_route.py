"""The exact GPU route (``coefficients-cuda``): a JPEG's coefficients read on the CPU
(:func:`~.coefficients.read_coefficients`), the rest of the decode by the integer kernels of
:mod:`.jpeg_kernels` on the decoder's device, bit for bit Pillow's pixels (docs/exactness.md,
"Coefficients and integer kernels"). It is what a ``cuda`` :class:`~.decoder.ImageDecoder` takes by
default (``gpu_route="exact"``); ``gpu_route="nvimgcodec"`` keeps nvImageCodec (near-exact: its IDCT
is not libjpeg's).

Each image's decode holds a slot of the decoder's pool (:class:`~.pool.DecodePool`) from the
coefficient read to the end of its kernels: at most ``pool_size`` images are being read or run at
once, so the pool caps the host memory of the reads (the blocks and libjpeg's own copy) and the
device temporaries of the kernels (the coefficients, int32 planes) as it caps nvImageCodec's
decoders. The decoded pixels outlive the slot: they are the caller's, as nvImageCodec's are. A file
the route refuses keeps ``plan.result`` None with ``plan.fallback_reason`` set (one of
:data:`~.coefficients.REFUSALS`, or the kernels' exception with its traceback in
``plan.fallback_cause`` for the log): the decoder gives it to Pillow and counts the reason.
"""

from __future__ import annotations

from typing import Any

from kimi_vision_common.errors import PreprocessError

from ..limits import DecodeLimits
from .coefficients import read_coefficients
from .jpeg_kernels import checked_pixels
from .pool import DecodePool
from .routes import DecodedImage, DecodePath, Plan
from .stats import cause_of

COEFFICIENTS_PATH: DecodePath = "coefficients-cuda"
WRONG_SIZE = "kernels: pixels of another size than the header's"


class KernelSlot:
    """What the exact route's pool lends: a permit to run one image's kernels on the device (no
    state: the pool's cap is the point)."""


def kernels_raised(exc: BaseException) -> str:
    """The fallback reason of a kernel run that raised (a fixed string per exception type)."""
    return f"kernels raised {type(exc).__name__}"


def as_rgb(pixels: Any) -> Any:
    """The kernels' pixels as the nvImageCodec route gives them: uint8 ``(H, W, 3)``; a grey
    ``(H, W)`` replicated to three channels as Pillow's ``convert("RGB")`` does."""
    if pixels.dim() == 2:
        return pixels.unsqueeze(-1).expand(-1, -1, 3).contiguous()
    return pixels


def decode_plan(plan: Plan, device: str, limits: DecodeLimits, pool: DecodePool[KernelSlot]) -> None:
    """Decode ``plan`` (a JPEG planned to the fast route, mode L or RGB) on ``device``: sets
    ``plan.result`` (uint8 ``(H, W, 3)`` tensor on ``device``), or ``plan.fallback_reason``.
    Raises only :class:`PreprocessError` (the pool's :class:`DecoderBusyError`)."""
    import torch

    with pool.borrow():
        coefs = read_coefficients(plan.data, limits)
        if isinstance(coefs, str):
            plan.fallback_reason = coefs
            return
        try:
            with torch.cuda.device(torch.device(device).index or 0):
                pixels, reason = checked_pixels(coefs, device)  # its sync: the kernels are done
                pixels = None if pixels is None else as_rgb(pixels)
        except PreprocessError:
            raise
        except Exception as exc:  # a device error (out of memory, ...): Pillow decodes it
            # Caught inside the slot: the traceback, which holds the kernels' temporaries, is gone
            # before the slot is lent again.
            plan.fallback_reason, plan.fallback_cause = kernels_raised(exc), cause_of(exc)
            return
    if reason is not None:
        plan.fallback_reason = reason
        return
    width, height = plan.image.size
    if tuple(pixels.shape) != (height, width, 3):
        plan.fallback_reason = WRONG_SIZE
        return
    plan.result = DecodedImage(pixels, width, height, "bicubic", COEFFICIENTS_PATH, device=device)
