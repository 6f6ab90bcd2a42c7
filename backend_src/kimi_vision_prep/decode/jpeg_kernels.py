"""The rest of a libjpeg-turbo decode after entropy decoding, in torch integer ops on any device:
islow IDCT (:mod:`.idct`), chroma upsampling as ``jdsample.c`` does it with Pillow's settings,
colour conversion as ``jdcolor.c`` does it, and Pillow's CMYK inversion. One implementation for
CPU and CUDA tensors: int32/uint8 only, no float, no division, no op whose integer result differs
by device. What it is proven against is in docs/exactness.md ("Coefficients and integer kernels").

Upsampling (``jinit_upsampler``, ``do_fancy_upsampling`` TRUE, never merged: ``jdmaster.c``
``use_merged_upsample`` is false with fancy upsampling on), per component by its ratio to the
largest sampling factors:

* 1x1: the samples as they are;
* 2x1: ``h2v1_fancy_upsample`` where the component's downsampled width is > 2, else replication;
* 1x2: ``h1v2_fancy_upsample`` (libjpeg-turbo has no width condition there);
* 2x2: ``h2v2_fancy_upsample`` where the downsampled width is > 2, else replication;
* any other integral ratio (4:1:1, 4x2 ...): ``int_upsample``, replication.

The fancy filters read the neighbours of the component's real samples only: a column past the
downsampled width is the last real one, the row above the first is the first, and the row below
the last real row is that row again (``jdmainct.c``: ``set_bottom_pointers`` duplicates it; the
first iMCU row's context points at row 0). With neighbours clamped so, the first and last
columns' special cases of ``jdsample.c`` are the general formula.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..limits import DecodeLimits
from .coefficients import (
    JCS_CMYK,
    JCS_GRAYSCALE,
    JCS_RGB,
    JCS_YCBCR,
    JCS_YCCK,
    OUT_OF_RANGE,
    Coefficients,
    Component,
    read_coefficients,
)
from .idct import idct_islow
from .stats import DecodeStats

if TYPE_CHECKING:
    import torch

# jdcolor.c, SCALEBITS 16: FIX(x) = round(x * 2**16), ONE_HALF = 2**15.
SCALEBITS, ONE_HALF = 16, 1 << 15
FIX_1_40200, FIX_1_77200, FIX_0_71414, FIX_0_34414 = 91881, 116130, 46802, 22554


def _shifted(p: torch.Tensor, dim: int, step: int) -> torch.Tensor:
    """``p`` moved by one along ``dim``, edge repeated: ``step`` -1 gives each element its
    predecessor (the first its own value), +1 its successor (the last its own)."""
    import torch

    n = p.shape[dim]
    if n == 1:
        return p
    if step < 0:
        return torch.cat((p.narrow(dim, 0, 1), p.narrow(dim, 0, n - 1)), dim)
    return torch.cat((p.narrow(dim, 1, n - 1), p.narrow(dim, n - 1, 1)), dim)


def _interleave(even: torch.Tensor, odd: torch.Tensor, dim: int) -> torch.Tensor:
    """Elements of ``even`` and ``odd`` alternating along ``dim`` (twice as long)."""
    import torch

    stacked = torch.stack((even, odd), dim + 1)
    shape = list(even.shape)
    shape[dim] *= 2
    return stacked.reshape(shape)


def h2v1_fancy(p: torch.Tensor) -> torch.Tensor:
    """``h2v1_fancy_upsample``: int32 ``(H, w)`` -> ``(H, 2w)``; 3/4 nearer + 1/4 further, biases 1 and 2."""
    three = p * 3
    return _interleave((three + _shifted(p, 1, -1) + 1) >> 2, (three + _shifted(p, 1, 1) + 2) >> 2, 1)


def h1v2_fancy(p: torch.Tensor) -> torch.Tensor:
    """``h1v2_fancy_upsample``: int32 ``(h, W)`` -> ``(2h, W)``; biases 1 (row above) and 2 (below)."""
    three = p * 3
    return _interleave((three + _shifted(p, 0, -1) + 1) >> 2, (three + _shifted(p, 0, 1) + 2) >> 2, 0)


def h2v2_fancy(p: torch.Tensor) -> torch.Tensor:
    """``h2v2_fancy_upsample``: int32 ``(h, w)`` -> ``(2h, 2w)``: column sums 3 x nearer row + further
    row, then 3 x nearer sum + further sum, biases 8 and 7, >> 4."""
    three = p * 3
    sums = _interleave(three + _shifted(p, 0, -1), three + _shifted(p, 0, 1), 0)
    three_sums = sums * 3
    return _interleave(
        (three_sums + _shifted(sums, 1, -1) + 8) >> 4, (three_sums + _shifted(sums, 1, 1) + 7) >> 4, 1
    )


def upsample(plane: torch.Tensor, fh: int, fv: int, width: int, height: int) -> torch.Tensor:
    """A component's real samples, uint8 ``(downsampled_height, downsampled_width)``, at the output
    size: uint8 ``(height, width)``; ``fh``/``fv`` the integral ratios to the largest factors."""
    import torch

    dw = plane.shape[1]
    if (fh, fv) == (1, 1):
        return plane[:height, :width]
    p = plane.to(torch.int32)
    if (fh, fv) == (2, 1) and dw > 2:
        out = h2v1_fancy(p)
    elif (fh, fv) == (1, 2):
        out = h1v2_fancy(p)
    elif (fh, fv) == (2, 2) and dw > 2:
        out = h2v2_fancy(p)
    else:
        return plane.repeat_interleave(fv, 0).repeat_interleave(fh, 1)[:height, :width]
    return out[:height, :width].to(torch.uint8)


def component_plane(component: Component, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A component's real samples, uint8 ``(height, width)`` (its downsampled size) on ``device``, and
    the IDCT's out-of-range flag (0-d bool)."""
    import torch

    hb, wb = component.blocks.shape[:2]
    blocks = torch.from_numpy(component.blocks).to(device, non_blocking=True).reshape(hb * wb, 8, 8)
    quant = torch.from_numpy(component.quant).to(device, non_blocking=True)
    samples, flag = idct_islow(blocks, quant)
    plane = samples.reshape(hb, wb, 8, 8).permute(0, 2, 1, 3).reshape(hb * 8, wb * 8)
    return plane[: component.height, : component.width], flag


def ycc_to_rgb(y: torch.Tensor, cb: torch.Tensor, cr: torch.Tensor) -> torch.Tensor:
    """``jdcolor.c``'s YCbCr -> RGB (its tables' arithmetic: ``Cr_r_tab``, ``Cb_b_tab``, ``Cr_g_tab``,
    ``Cb_g_tab``, range-limited): int32 planes ``(H, W)`` -> uint8 ``(H, W, 3)``."""
    import torch

    x_b, x_r = cb - 128, cr - 128
    red = (x_r * FIX_1_40200).add_(ONE_HALF).bitwise_right_shift_(SCALEBITS).add_(y)
    green = (x_b * -FIX_0_34414).add_(ONE_HALF).sub_(x_r.mul_(FIX_0_71414)).bitwise_right_shift_(SCALEBITS).add_(y)
    blue = x_b.mul_(FIX_1_77200).add_(ONE_HALF).bitwise_right_shift_(SCALEBITS).add_(y)
    return torch.stack([c.clamp_(0, 255).to(torch.uint8) for c in (red, green, blue)], -1)


def convert(planes: list[torch.Tensor], color_space: int) -> torch.Tensor:
    """Upsampled uint8 planes ``(H, W)`` -> Pillow's pixels in its mode: uint8 ``(H, W)`` (L),
    ``(H, W, 3)`` (RGB) or ``(H, W, 4)`` (CMYK: Pillow's ``CMYK;I`` inverts what libjpeg returns;
    YCCK's C, M, Y are then the YCbCr -> RGB values and K inverted)."""
    import torch

    if color_space == JCS_GRAYSCALE:
        return planes[0]
    if color_space == JCS_RGB:
        return torch.stack(planes, -1)
    if color_space == JCS_CMYK:
        return 255 - torch.stack(planes, -1)
    wide = [p.to(torch.int32) for p in planes]
    rgb = ycc_to_rgb(*wide[:3])
    if color_space == JCS_YCBCR:
        return rgb
    if color_space == JCS_YCCK:
        return torch.cat((rgb, (255 - planes[3]).unsqueeze(-1)), -1)
    raise ValueError(f"colour space {color_space} is not converted here")


def decode_coefficients(coefs: Coefficients, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels of a frame's coefficients as Pillow decodes them, on ``device``: uint8 ``(H, W)`` (L),
    ``(H, W, 3)`` (RGB) or ``(H, W, 4)`` (CMYK), and a 0-d bool, True where they may not be Pillow's
    (a value outside the range where libjpeg's C and SIMD agree: send the file to Pillow). The
    flag is a device tensor: reading it is the one host sync."""
    import torch

    planes, flags = [], []
    for component in coefs.components:
        plane, flag = component_plane(component, device)
        fh, fv = coefs.max_h // component.h, coefs.max_v // component.v
        planes.append(upsample(plane, fh, fv, coefs.width, coefs.height))
        flags.append(flag)
    return convert(planes, coefs.color_space), torch.stack(flags).any()


def checked_pixels(coefs: Coefficients, device: str | torch.device) -> tuple[torch.Tensor | None, str | None]:
    """(pixels as :func:`decode_coefficients` gives them, None), or (None, :data:`OUT_OF_RANGE`)
    where the kernels flag a value outside the C/SIMD range. Reads the device flag (the one sync)."""
    pixels, flag = decode_coefficients(coefs, device)
    return (None, OUT_OF_RANGE) if bool(flag) else (pixels, None)


def decode_jpeg(
    data: bytes,
    device: str | torch.device = "cpu",
    limits: DecodeLimits | None = None,
    stats: DecodeStats | None = None,
) -> tuple[torch.Tensor | None, str | None]:
    """A JPEG decoded by the coefficient route: its coefficients read on the CPU
    (:func:`~.coefficients.read_coefficients`), the rest by the kernels on ``device``. Returns
    (pixels as :func:`decode_coefficients` gives them, None), or (None, the reason it goes to
    Pillow: one of :data:`~.coefficients.REFUSALS`). ``stats``: each outcome recorded there, as
    path ``"coefficients"`` or ``"pillow"`` with the reason. Reads the device flag once (a sync)."""
    coefs = read_coefficients(data, limits)
    pixels, reason = (None, coefs) if isinstance(coefs, str) else checked_pixels(coefs, device)
    if stats is not None:
        stats.record("pillow" if reason else "coefficients", reason)
    return pixels, reason
