"""The coefficient route (decode/coefficients.py, decode/idct.py, decode/jpeg_kernels.py) against
Pillow, bit for bit: the corpus, a generated matrix (samplings, sizes 1..17 around MCU edges,
restart markers, progressive and arithmetic coding, colour spaces, qualities 1..100), and the
guards: every file the route does not take goes to Pillow with a reason, and a stream whose
dequantised values leave the range where libjpeg's C and SIMD IDCT agree is refused rather than
decoded to other pixels. The kernels run on torch CPU tensors here; the same code runs on CUDA.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from pathlib import Path

import make_inputs
import numpy as np
import pytest
from jpeg_matrix import as_ycck, cjpeg, first_scans, pillow_jpeg, quant_table_count, with_quant_tables
from make_inputs import CJPEG, CORPUS
from PIL import Image

from kimi_vision_prep.decode import coefficients as coef
from kimi_vision_prep.decode import jpeg_bands
from kimi_vision_prep.decode.stats import DecodeStats

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(jpeg_bands.libjpeg_path() is None, reason="the _libjpeg extension is not built")
needs_cjpeg = pytest.mark.skipif(CJPEG is None, reason="cjpeg not on PATH (Debian: libjpeg-turbo-progs)")

from kimi_vision_prep.decode import idct, jpeg_kernels  # noqa: E402  (after the torch skip)

SIZES = range(1, 18)
ROOT = Path(__file__).resolve().parents[1]


def outcome(data: bytes) -> str:
    """``"equal"`` where the route decodes ``data`` to Pillow's pixels in Pillow's mode, else the
    reason it gave the file to Pillow; fails where the route's pixels differ from Pillow's."""
    pixels, reason = jpeg_kernels.decode_jpeg(data)
    if reason is not None:
        assert reason in coef.REFUSALS
        return reason
    with Image.open(io.BytesIO(data)) as image:
        reference = np.asarray(image)
    assert pixels is not None and tuple(pixels.shape) == reference.shape
    differ = pixels.numpy() != reference
    assert not differ.any(), f"{differ.sum()} values differ, first at {np.argwhere(differ)[0]}"
    return "equal"


def tally(cases: dict[str, bytes]) -> Counter[str]:
    """Outcomes of ``cases`` by outcome, each case's name in the message of a failure."""
    counts: Counter[str] = Counter()
    for name, data in cases.items():
        try:
            counts[outcome(data)] += 1
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    print(dict(counts))
    return counts


def test_corpus_taken_files_equal_pillow() -> None:
    names = sorted(p.name for p in CORPUS.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".mpo"))
    counts = tally({name: (CORPUS / name).read_bytes() for name in names})
    # docs/exactness.md states the table; a guard that starts sending more files to Pillow (or
    # fewer) changes it, and the document with it.
    stated = re.search(
        r"\((\d+) of (\d+); the rest: (\d+) libjpeg\s+refusals.*?(\d+) not 8-bit, (\d+) over the limits, "
        r"(\d+) smoothed progression\)",
        (ROOT / "docs" / "exactness.md").read_text(),
        flags=re.S,
    )
    equal, total, refused, precision, too_large, smoothed = map(int, stated.groups())
    assert len(names) == total
    assert counts == {
        "equal": equal, coef.LIBJPEG_REFUSED: refused, coef.PRECISION: precision, coef.TOO_LARGE: too_large,
        coef.SMOOTHING: smoothed,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "subsampling"), [("L", 0), ("RGB", 0), ("RGB", 1), ("RGB", 2), ("CMYK", 0), ("CMYK", 2)]
)
def test_pillow_written_every_size_1_to_17(mode: str, subsampling: int) -> None:
    """Pillow's samplings (4:4:4, 4:2:2, 4:2:0) at every width and height 1..17 (MCU edges at 8, 16)."""
    cases = {
        f"{w}x{h}": pillow_jpeg(w, h, mode, seed=w * 31 + h, subsampling=subsampling) for w in SIZES for h in SIZES
    }
    assert tally(cases) == {"equal": len(cases)}


@needs_cjpeg
@pytest.mark.parametrize(
    "sample", ["1x2,1x1,1x1", "4x1,1x1,1x1", "4x2,1x1,1x1", "2x2,1x2,2x1", "1x1,2x2,1x1", "3x1,1x1,1x1", "1x4,1x1,1x1"]
)
def test_cjpeg_samplings(sample: str) -> None:
    """4:4:0, 4:1:1 and other integral samplings (int_upsample, h1v2, mixed ratios) by cjpeg."""
    cases = {f"{w}x{h}": cjpeg(w, h, "-sample", sample, seed=w + h) for w in SIZES for h in (1, 2, 7, 9, 16, 17)}
    assert tally(cases) == {"equal": len(cases)}


@pytest.mark.parametrize("subsampling", [0, 2])
def test_qualities_1_to_100(subsampling: int) -> None:
    cases = {f"q{q}": pillow_jpeg(37, 29, "RGB", seed=q, quality=q, subsampling=subsampling) for q in range(1, 101)}
    counts = tally(cases)
    assert counts["equal"] == len(cases), counts


def test_progressive_and_restart_markers() -> None:
    cases = {}
    for w, h in [(1, 1), (2, 17), (9, 9), (16, 15), (17, 33), (61, 43)]:
        for s in (0, 1, 2):
            cases[f"prog {w}x{h} s{s}"] = pillow_jpeg(w, h, "RGB", progressive=True, subsampling=s)
            cases[f"rst blocks {w}x{h} s{s}"] = pillow_jpeg(w, h, "RGB", restart_marker_blocks=1, subsampling=s)
            cases[f"rst rows {w}x{h} s{s}"] = pillow_jpeg(w, h, "RGB", restart_marker_rows=1, subsampling=s)
        cases[f"prog grey {w}x{h}"] = pillow_jpeg(w, h, "L", progressive=True)
        cases[f"prog cmyk {w}x{h}"] = pillow_jpeg(w, h, "CMYK", progressive=True)
    assert tally(cases) == {"equal": len(cases)}


@needs_cjpeg
def test_arithmetic_coding_and_cjpeg_colour_spaces() -> None:
    cases = {}
    for w, h in [(1, 1), (3, 17), (9, 8), (17, 16), (61, 43)]:
        for sample in ("2x2,1x1,1x1", "2x1,1x1,1x1", "1x2,1x1,1x1", "4x1,1x1,1x1"):
            cases[f"arith {w}x{h} {sample}"] = cjpeg(w, h, "-arithmetic", "-sample", sample)
            cases[f"arith prog {w}x{h} {sample}"] = cjpeg(w, h, "-arithmetic", "-progressive", "-sample", sample)
            cases[f"arith rst {w}x{h} {sample}"] = cjpeg(w, h, "-arithmetic", "-restart", "1B", "-sample", sample)
        cases[f"rgb {w}x{h}"] = cjpeg(w, h, "-rgb")
        cases[f"grey arith {w}x{h}"] = cjpeg(w, h, "-grayscale", "-arithmetic")
    assert tally(cases) == {"equal": len(cases)}


def test_ycck() -> None:
    """YCCK (Adobe transform 2): libjpeg's YCC -> RGB, inverted with K by Pillow's CMYK;I."""
    cases = {
        f"{w}x{h} s{s}": as_ycck(pillow_jpeg(w, h, "CMYK", seed=w, subsampling=s))
        for w, h in [(1, 1), (2, 3), (8, 8), (9, 17), (17, 9), (40, 33)]
        for s in (0, 2)
    }
    assert tally(cases) == {"equal": len(cases)}
    assert coef.read_coefficients(next(iter(cases.values()))).color_space == coef.JCS_YCCK


def test_incomplete_progression_goes_to_pillow_for_block_smoothing() -> None:
    """A clean stream whose progression stops early: libjpeg smooths its blocks, so Pillow decodes it."""
    full = pillow_jpeg(64, 48, "RGB", progressive=True)
    assert outcome(first_scans(full, 1)) in (coef.SMOOTHING, coef.DC_MISSING)
    assert outcome(first_scans(full, 3)) == coef.SMOOTHING
    with Image.open(io.BytesIO(first_scans(full, 3))) as image:
        image.load()  # Pillow decodes it (smoothed)


def test_unsupported_streams_go_to_pillow_with_their_reason() -> None:
    truncated = pillow_jpeg(64, 48)[:-300]
    assert outcome(truncated) == coef.LIBJPEG_REFUSED
    assert outcome(b"\xff\xd8\xff\xd9") == coef.LIBJPEG_REFUSED
    assert coef.read_coefficients(pillow_jpeg(64, 48), coef.DecodeLimits(max_pixels=64 * 48 - 1)) == coef.TOO_LARGE
    # A 1-pixel-wide column pads each block row to 8 coefficients a row (libjpeg keeps them too):
    # within the pixel budget, over it in coefficients.
    column = pillow_jpeg(1, 64, subsampling=0)
    assert coef.read_coefficients(column, coef.DecodeLimits(max_pixels=100)) == coef.TOO_LARGE
    assert not isinstance(coef.read_coefficients(column, coef.DecodeLimits(max_pixels=8 * 64)), str)
    assert not coef.supported_sampling([(3, 1), (2, 1), (1, 1)])
    assert coef.supported_sampling([(4, 2), (1, 1), (2, 1)])


def test_fuzzed_quant_tables_are_refused_or_equal() -> None:
    """Dequantised values fuzzed through 16-bit quantization tables (the coefficients stay, their
    products grow up to beyond int16): every stream is either decoded to Pillow's pixels or sent to
    Pillow as out of range; both happen."""
    rng = np.random.default_rng(63)
    counts: Counter[str] = Counter()
    for k in range(60):
        base = pillow_jpeg(24 + k % 9, 16 + k % 7, "RGB", seed=k, quality=int(rng.integers(50, 101)), subsampling=k % 3)
        scale = int(rng.choice([4, 16, 64, 256, 1024, 8192, 65535]))
        tables = [rng.integers(1, scale + 1, 64) for _ in range(quant_table_count(base))]
        counts[outcome(with_quant_tables(base, tables))] += 1
    print(dict(counts))
    assert set(counts) == {"equal", coef.OUT_OF_RANGE}, counts


def c_islow(blocks: np.ndarray, quant: np.ndarray) -> np.ndarray:
    """jidctint.c's jpeg_idct_islow transcribed literally (JLONG int64, ``range_limit[x & 1023]``)."""
    c = blocks.astype(np.int64) * quant.astype(np.int64)

    def one_d(x: list[np.ndarray], shift: int) -> list[np.ndarray]:
        z1 = (x[2] + x[6]) * 4433
        tmp2, tmp3 = z1 + x[6] * -15137, z1 + x[2] * 6270
        tmp0, tmp1 = (x[0] + x[4]) << 13, (x[0] - x[4]) << 13
        t10, t13, t11, t12 = tmp0 + tmp3, tmp0 - tmp3, tmp1 + tmp2, tmp1 - tmp2
        a0, a1, a2, a3 = x[7], x[5], x[3], x[1]
        z1, z2, z3, z4 = a0 + a3, a1 + a2, a0 + a2, a1 + a3
        z5 = (z3 + z4) * 9633
        a0, a1, a2, a3 = a0 * 2446, a1 * 16819, a2 * 25172, a3 * 12299
        z1, z2, z3, z4 = z1 * -7373, z2 * -20995, z3 * -16069 + z5, z4 * -3196 + z5
        a0, a1, a2, a3 = a0 + z1 + z3, a1 + z2 + z4, a2 + z2 + z3, a3 + z1 + z4
        out = [t10 + a3, t11 + a2, t12 + a1, t13 + a0, t13 - a0, t12 - a1, t11 - a2, t10 - a3]
        return [(o + (1 << (shift - 1))) >> shift for o in out]

    ws = np.stack(one_d([c[:, k, :] for k in range(8)], 11), 1)
    x = np.stack(one_d([ws[:, :, k] for k in range(8)], 18), 2)
    wrapped = ((x + 512) & 1023) - 512
    return np.clip(wrapped + 128, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("magnitude", [16, 128, 1024, 32767])
def test_idct_equals_libjpeg_c_where_not_flagged(magnitude: int) -> None:
    """The torch IDCT against jidctint.c's C arithmetic on random blocks (amplitudes falling with
    frequency from ``magnitude``), one block at a time: equal wherever the block is not flagged;
    flagged blocks are the ones where SIMD could give other samples than C."""
    rng = np.random.default_rng(magnitude)
    envelope = magnitude >> (np.add.outer(np.arange(8), np.arange(8)) // 2)
    blocks = (rng.integers(-1 << 15, 1 << 15, (300, 8, 8)) * envelope >> 15).astype(np.int16)
    blocks[:, 0, 0] = rng.integers(-300, 300, 300)
    quant = rng.integers(1, 4, (8, 8)).astype(np.int16)
    expected = c_islow(blocks, quant)
    flagged = 0
    for block, want in zip(blocks, expected, strict=True):
        got, flag = idct.idct_islow(torch.from_numpy(block[None]), torch.from_numpy(quant))
        if bool(flag):
            flagged += 1
        else:
            assert np.array_equal(got[0].numpy(), want)
    print(magnitude, flagged)
    assert flagged < len(blocks) if magnitude <= 128 else flagged > 0


def test_idct_int32_intermediates_fit() -> None:
    """The bound idct.py relies on: with every 16-bit input within int16, no sum of _pass (its
    grouping) exceeds 2**31 - 1. Each value's bound is 32768 x the sum of its |constants|."""
    f = idct
    even = (1 << 15 << f.CONST_BITS) + 32768 * max(f.F_0_541 + f.F_0_765 + f.F_0_541, f.F_0_541 + f.F_1_847 - f.F_0_541)
    z = 32768 * max(abs(f.F_1_175 - f.F_1_961) + f.F_1_175, f.F_1_175 + f.F_1_175 - f.F_0_390)
    odd = z + 32768 * max(
        abs(f.F_0_298 - f.F_0_899) + f.F_0_899,
        abs(f.F_2_053 - f.F_2_562) + f.F_2_562,
        f.F_2_562 + f.F_3_072 - f.F_2_562,
        f.F_0_899 + f.F_1_501 - f.F_0_899,
    )
    assert even + odd + (1 << 17) < 2**31 - 1


def test_outcomes_are_recorded_with_their_reasons() -> None:
    stats = DecodeStats(warn=lambda _message: None)
    jpeg_kernels.decode_jpeg(pillow_jpeg(16, 16), stats=stats)
    jpeg_kernels.decode_jpeg(b"\xff\xd8\xff\xd9", stats=stats)
    assert stats.snapshot() == {"paths": {"coefficients": 1, "pillow": 1}, "fallbacks": {coef.LIBJPEG_REFUSED: 1}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the kernels are proven on CPU tensors here")
def test_cuda_equals_cpu_on_the_corpus() -> None:
    """Where a device is present: the same kernels on CUDA tensors give the CPU's pixels and flags."""
    for path in sorted(p for p in CORPUS.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".mpo")):
        coefs = coef.read_coefficients(path.read_bytes())
        if isinstance(coefs, str):
            continue
        cpu, cpu_flag = jpeg_kernels.decode_coefficients(coefs, "cpu")
        cuda, cuda_flag = jpeg_kernels.decode_coefficients(coefs, "cuda")
        assert bool(cpu_flag) == bool(cuda_flag) and torch.equal(cpu, cuda.cpu()), path.name


def test_damaged_streams_are_refused_or_equal_pillow() -> None:
    """Damage at a restart marker (junk, a garbled or cut interval) and the damage libjpeg decodes
    past with a warning (a stray marker, an interval missing or repeated, junk between segments):
    each file is either refused (libjpeg's warning; a garbled interval's values may also leave the
    C/SIMD range) or taken and equal to Pillow's concealment."""
    cases = {f"restart {d}": make_inputs.jpeg_damaged_at_a_restart(d) for d in ("junk", "garbled", "cut")}
    for damage in make_inputs.CONCEALED_DAMAGE:
        for mode in ("RGB", "L"):
            cases[f"{damage} {mode}"] = make_inputs.jpeg_with_concealed_damage(damage, mode=mode)
    counts = tally(cases)  # a taken file differing from Pillow fails here; a refusal is any of REFUSALS
    assert counts[coef.LIBJPEG_REFUSED] > 0  # the warning path is met, not only clean files
