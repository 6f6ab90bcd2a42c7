"""libjpeg-turbo's accurate integer IDCT (``jidctint.c``, ``jpeg_idct_islow``) in torch integer ops:
dequantisation and both passes, for blocks on any device, the same code on CPU and CUDA.

What it computes is libjpeg's C arithmetic (``CONST_BITS`` 13, ``PASS1_BITS`` 2, the 12 ``FIX_*``
constants, ``DESCALE`` by 11 then 18, the sample ``+ CENTERJSAMPLE`` clamped). Pillow decodes with
libjpeg-turbo's SIMD IDCT (AVX2/SSE2/NEON), which keeps some values in 16-bit lanes: the
dequantised coefficients (``pmullw``), the pair sums ``in0 +- in4``, ``in7 + in3``, ``in5 + in1`` of
either pass (``paddw``), the first pass's outputs (``packssdw``, saturating), and the outputs
(saturated to a byte, where C wraps them ``& 1023`` into ``range_limit``). Where all of these are in
range the C and SIMD results are the same numbers; every JPEG an encoder writes stays in range. A
stream that leaves it is flagged (:func:`idct_islow`'s second result) and goes to Pillow, so no
pixel depends on which of the two a Pillow build runs.

int32 throughout, with the SIMD code's grouping of the sums (its ``pmaddwd`` pairs): with every
16-bit value clamped to its range before it is used, no intermediate exceeds 2.12e9 < 2**31 (the
bound is in the test), so nothing overflows on any device, flagged inputs included (their pixels
are discarded). No float, no division, no op whose integer semantics differ between CPU and CUDA:
``*``, ``+``, ``-``, ``>>`` (arithmetic on signed ints in torch on both; no left shift of a
negative value: a multiplication instead), ``clamp``, ``aminmax``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONST_BITS, PASS1_BITS = 13, 2
# jidctint.c's FIX_* (CONST_BITS 13): FIX(x) = round(x * 2**13).
F_0_298, F_0_390, F_0_541, F_0_765 = 2446, 3196, 4433, 6270
F_0_899, F_1_175, F_1_501, F_1_847 = 7373, 9633, 12299, 15137
F_1_961, F_2_053, F_2_562, F_3_072 = 16069, 16819, 20995, 25172
INT16 = (-32768, 32767)
# Outputs (before + CENTERJSAMPLE) where C's range_limit[x & 1023] and SIMD's saturation agree.
OUTPUT_RANGE = (-512, 511)
BLOCKS_PER_CHUNK = 1 << 14  # bounds the temporaries: 16 Ki blocks x 64 x 4 bytes = 4 MiB each


def _outside(t: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    """0-d bool: some value of ``t`` is outside ``bounds`` (inclusive)."""
    low, high = t.aminmax()
    return (low < bounds[0]) | (high > bounds[1])


def _pass(x: torch.Tensor, shift: int, flags: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D pass of ``jpeg_idct_islow`` over ``x`` int32 ``(8, ...)``, the coefficient index
    first (values within int16); returns int32 ``(8, ...)``, the sample index first, descaled by
    ``shift``. The pair sums SIMD forms in 16 bits are checked (``flags``) and clamped as it would."""
    import torch

    s04 = torch.stack((x[0] + x[4], x[0] - x[4]))
    z34 = torch.stack((x[7] + x[3], x[5] + x[1]))
    flags += [_outside(s04, INT16), _outside(z34, INT16)]
    s04, z34 = s04.clamp_(*INT16), z34.clamp_(*INT16)
    # Even part: tmp0/tmp1 = (in0 +- in4) << CONST_BITS, with DESCALE's rounding (every output has
    # one of them once); tmp3/tmp2 = the rotation of in2, in6.
    tmp01 = s04.mul_(1 << CONST_BITS).add_(1 << (shift - 1))
    tmp3 = (x[2] * (F_0_541 + F_0_765)).add_(x[6] * F_0_541)
    tmp2 = (x[2] * F_0_541).add_(x[6] * (F_0_541 - F_1_847))
    tmp10, tmp13, tmp11, tmp12 = tmp01[0] + tmp3, tmp01[0] - tmp3, tmp01[1] + tmp2, tmp01[1] - tmp2
    # Odd part: z3 = in7 + in3, z4 = in5 + in1, z5 folded in.
    z3 = (z34[0] * (F_1_175 - F_1_961)).add_(z34[1] * F_1_175)
    z4 = (z34[0] * F_1_175).add_(z34[1] * (F_1_175 - F_0_390))
    o0 = (x[7] * (F_0_298 - F_0_899)).add_(x[1] * -F_0_899).add_(z3)
    o1 = (x[5] * (F_2_053 - F_2_562)).add_(x[3] * -F_2_562).add_(z4)
    o2 = (x[5] * -F_2_562).add_(x[3] * (F_3_072 - F_2_562)).add_(z3)
    o3 = (x[7] * -F_0_899).add_(x[1] * (F_1_501 - F_0_899)).add_(z4)
    out = torch.empty_like(x)
    for index, (even, odd) in enumerate(((tmp10, o3), (tmp11, o2), (tmp12, o1), (tmp13, o0))):
        torch.add(even, odd, out=out[index])
        torch.sub(even, odd, out=out[7 - index])
    return out.bitwise_right_shift_(shift)


def idct_islow(blocks: torch.Tensor, quant: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of quantized blocks, as libjpeg's islow IDCT gives them.

    ``blocks``: int16 ``(N, 8, 8)`` (natural order, ``[.., v, u]``: vertical frequency v, horizontal
    u); ``quant``: int16 ``(8, 8)``, same device. Returns uint8 ``(N, 8, 8)`` (``[.., y, x]``) and a
    0-d bool tensor, True where some value left the range where libjpeg's C and SIMD IDCT agree
    (then the samples are not libjpeg's: the caller sends the file to Pillow). No host sync."""
    import torch

    flags: list[torch.Tensor] = []
    out = torch.empty(blocks.shape, dtype=torch.uint8, device=blocks.device)
    q = quant.to(torch.int32)
    for start in range(0, blocks.shape[0], BLOCKS_PER_CHUNK):
        chunk = blocks[start : start + BLOCKS_PER_CHUNK]
        dq = chunk.to(torch.int32) * q  # |coef * q| <= 2**30: exact in int32
        flags.append(_outside(dq, INT16))
        # Pass 1 on columns: (v, N, u) in, (y, N, u) out.
        ws = _pass(dq.clamp_(*INT16).permute(1, 0, 2).contiguous(), CONST_BITS - PASS1_BITS, flags)
        flags.append(_outside(ws, INT16))
        # Pass 2 on rows: (u, y, N) in, (x, y, N) out.
        pixels = _pass(ws.clamp_(*INT16).permute(2, 0, 1).contiguous(), CONST_BITS + PASS1_BITS + 3, flags)
        flags.append(_outside(pixels, OUTPUT_RANGE))
        out[start : start + chunk.shape[0]] = pixels.add_(128).clamp_(0, 255).permute(2, 1, 0).to(torch.uint8)
    if not flags:
        return out, torch.zeros((), dtype=torch.bool, device=blocks.device)
    return out, torch.stack(flags).any()
