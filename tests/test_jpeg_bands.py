"""The ``libjpeg`` route: one JPEG decoded in row bands by the libjpeg-turbo Pillow decodes with.

Pillow is the reference: every band split, at every kind of edge, must give Pillow's pixels; a
file libjpeg warns about is refused in every split, unless the warning is only of bytes skipped
before a marker; a band below a restart marker enters the stream there; the pipeline's band patchify equals the
plain reference; bands only run where a helper is idle and the caller is the decoder's only one.
"""

from __future__ import annotations

import io
import itertools
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from make_inputs import (
    CJPEG,
    CONCEALED_DAMAGE,
    cjpeg_rgb,
    jpeg_damaged_at_a_restart,
    jpeg_grey,
    jpeg_rgb,
    jpeg_with_concealed_damage,
    jpeg_with_restarts,
)
from PIL import Image
from reference import reference_preprocess

import kimi_vision_prep
from kimi_vision_prep import ImageDecoder, InvalidImageError
from kimi_vision_prep.decode import decoder as decode_module
from kimi_vision_prep.decode import jpeg_bands
from kimi_vision_prep.decode import routes as decode_routes
from kimi_vision_prep.decode.jpeg_scan import scan_jpeg

# Clean corpus JPEGs of every layout the route meets: 4:2:0, 4:2:2 and 4:4:4 chroma, grey,
# restart markers, non-multiple-of-16 sizes, progressive (decoded in one band), a camera photo.
CORPUS_JPEGS = (
    "imagers__large_image.jpg",
    "pil__xmp_test.jpg",
    "sklearn__china.jpg",
    "imagers__restarts.jpg",
    "imagers__jpg-size-33x33.jpg",
    "imagers__grayscale_16x24_sampling2x2.jpg",
    "imagers__tower_grayscale.jpg",
    "imagers__jpg-progressive.jpg",
    "ljt__testorig.jpg",
    "pil__hopper.jpg",
)


def pillow_rgb(data: bytes, block: int | None = None) -> np.ndarray:
    """Pillow's decode; ``block``: fed to libjpeg that many bytes at a time (its source suspends
    at the end of each and resumes with the next; Pillow's default is 64 KiB)."""
    image = Image.open(io.BytesIO(data))
    if block is not None:
        image.decodermaxblock = block
    return np.asarray(image.convert("RGB"))


def split_rows(height: int) -> list[list[int]]:
    """Band edges at every kind of place: iMCU-aligned (8, 16) or not, one row from either end,
    the middle, and three bands."""
    candidates = (1, 7, 8, 9, 15, 16, 17, 14 * 3, height // 2, height - 16, height - 1)
    inner = sorted({e for e in candidates if 0 < e < height})
    return [[0, e, height] for e in inner] + ([[0, height // 3, 2 * height // 3, height]] if height >= 3 else [])


def decode_split(data: bytes, edges: list[int], tolerant: bool = False) -> np.ndarray:
    height, width = Image.open(io.BytesIO(data)).size[::-1]
    pixels = np.zeros((height, width, 3), np.uint8)
    for begin, end in itertools.pairwise(edges):
        assert jpeg_bands.decode_rows(data, pixels, begin, end, tolerant), (begin, end)
    return pixels


def synthetic_jpegs() -> dict[str, bytes]:
    jpegs = {
        "420": jpeg_rgb(301, 203, "4:2:0"),
        "422": jpeg_rgb(203, 301, "4:2:2"),
        "444": jpeg_rgb(150, 77, "4:4:4"),
        "grey": jpeg_grey(97, 131),
        "420 restarts": jpeg_with_restarts(301, 400, rows=1),
        "420 restarts every 4 MCUs": jpeg_with_restarts(301, 400),
    }
    if CJPEG:  # 4:4:0 and 4:1:1: vertical-only and 4x horizontal chroma
        jpegs |= {"440": cjpeg_rgb(157, 99, "1x2,1x1,1x1"), "411": cjpeg_rgb(157, 99, "4x1,1x1,1x1")}
    return jpegs


def test_the_bound_library_is_the_one_pillow_decodes_with() -> None:
    path = jpeg_bands.libjpeg_path()
    assert path is not None, jpeg_bands.unavailable_reason()
    assert re.search(r"libjpeg[^/]*\.so", path), path
    from PIL import _imaging

    maps = Path("/proc/self/maps").read_text()
    assert path in maps and _imaging.__file__ in maps


@pytest.mark.parametrize("name", CORPUS_JPEGS)
def test_every_split_of_a_corpus_jpeg_is_pillows(corpus: Path, name: str) -> None:
    data = (corpus / name).read_bytes()
    expected = pillow_rgb(data)
    for edges in split_rows(expected.shape[0]):
        np.testing.assert_array_equal(decode_split(data, edges), expected, err_msg=f"{name} split at {edges}")


@pytest.mark.parametrize("kind", list(synthetic_jpegs()))
def test_every_split_of_each_chroma_layout_is_pillows(kind: str) -> None:
    data = synthetic_jpegs()[kind]
    expected = pillow_rgb(data)
    for edges in split_rows(expected.shape[0]):
        np.testing.assert_array_equal(decode_split(data, edges), expected, err_msg=f"{kind} split at {edges}")


SKIPPED_BYTES_CORPUS_JPEGS = ("imagers__extraneous-data.jpg", "imagers__extraneous-bytes-after-sos.jpg")


def skipped_bytes_jpegs(corpus: Path) -> dict[str, bytes]:
    """JPEGs libjpeg only warns about for bytes it skips before a marker: two of the corpus and
    two made here (junk before a restart marker, an interval whose garbled codes end early)."""
    return {name: (corpus / name).read_bytes() for name in SKIPPED_BYTES_CORPUS_JPEGS} | {
        damage: jpeg_damaged_at_a_restart(damage) for damage in ("junk", "garbled")
    }


@pytest.mark.parametrize("name", [*SKIPPED_BYTES_CORPUS_JPEGS, "junk", "garbled"])
def test_bytes_skipped_before_a_marker_refuse_nothing_and_every_split_is_pillows(corpus: Path, name: str) -> None:
    """libjpeg warns that it skipped bytes before a marker (simplejpeg's strict mode refuses the
    file for it) and decodes on as in a clean stream: the route takes the file, every split gives
    Pillow's pixels, and the pipeline the reference's."""
    data = skipped_bytes_jpegs(corpus)[name]
    with pytest.raises(ValueError, match="extraneous bytes before marker"):
        simplejpeg.decode_jpeg(data, strict=True)
    expected = pillow_rgb(data)
    for edges in split_rows(expected.shape[0]):
        np.testing.assert_array_equal(decode_split(data, edges), expected, err_msg=f"{name} split at {edges}")
    result = kimi_vision_prep.preprocess_bytes(data, decoder=ImageDecoder())
    assert (result.decode_path, result.fallback_reason) == ("libjpeg", None)
    np.testing.assert_array_equal(result.pixel_values, reference_preprocess(data, "kimi-k2.5").pixel_values)


def test_any_other_libjpeg_warning_refuses_the_file_in_every_band() -> None:
    """Strict otherwise: a restart interval cut short (libjpeg warns of a premature end of data
    and fills in the rest) is refused whichever rows a band decodes (the last band reads on to
    the end of the stream), and the decoder sends it on to nvImageCodec, which gives Pillow's."""
    data = jpeg_damaged_at_a_restart("cut")
    with pytest.raises(ValueError, match="premature end of data segment"):
        simplejpeg.decode_jpeg(data, strict=True)
    height, width = Image.open(io.BytesIO(data)).size[::-1]
    pixels = np.zeros((height, width, 3), np.uint8)
    for begin in (0, height // 2, height - 1):
        assert not jpeg_bands.decode_rows(data, pixels, begin, height), begin
    result = kimi_vision_prep.preprocess_bytes(data, decoder=ImageDecoder())
    assert (result.decode_path, result.fallback_reason) == ("nvimgcodec-cpu", None)
    np.testing.assert_array_equal(result.pixel_values, reference_preprocess(data, "kimi-k2.5").pixel_values)


def test_a_truncated_stream_is_refused_from_the_top_and_from_a_restart_marker() -> None:
    """The end of the data comes before the image's: refused whether the band reads the stream from
    its start or enters it at a restart marker (which would otherwise read on past the end)."""
    data = jpeg_with_restarts(333, 600, rows=1)[:-300]
    pixels = np.zeros((600, 333, 3), np.uint8)
    libjpeg = jpeg_bands._extension()
    for begin in (0, 300, 599):
        with pytest.raises(libjpeg.JpegError):
            libjpeg.decode_rows(data, pixels, 333, 600, begin, 600)
    complete = jpeg_with_restarts(333, 600, rows=1)
    assert libjpeg.decode_rows(complete, pixels, 333, 600, 599, 600)[2] > 0  # the entry is there


def damaged(data: bytes, rng: np.random.Generator) -> bytes:
    """``data`` with 1-3 random changes in its scan data: a byte changed, 1-5 bytes dropped or
    1-5 random bytes inserted."""
    out = bytearray(data)
    start = out.index(b"\xff\xda") + 14
    for _ in range(int(rng.integers(1, 4))):
        at, kind = int(rng.integers(start, len(out) - 2)), int(rng.integers(0, 3))
        if kind == 0:
            out[at] ^= int(rng.integers(1, 256))
        elif kind == 1:
            del out[at : at + int(rng.integers(1, 6))]
        else:
            out[at:at] = rng.integers(0, 256, int(rng.integers(1, 6)), dtype=np.uint8).tobytes()
    return bytes(out)


def test_damaged_restart_streams_the_route_takes_are_pillows_whole_and_entered() -> None:
    """Randomly damaged scans of restart-marker JPEGs that the scan still finds clean (300, seeded):
    wherever both bands of a split decode take the file, so does a whole decode, with the same
    pixels; wherever a whole decode takes it, Pillow opens it to the same pixels."""
    libjpeg = jpeg_bands._extension()
    bases = [jpeg_with_restarts(300, 520, rows=1), jpeg_with_restarts(300, 520), jpeg_with_restarts(300, 520, rows=2)]
    rng = np.random.default_rng(7)
    taken = entered = 0
    for trial in range(300):
        data = damaged(bases[trial % 3], rng)
        if scan_jpeg(data).reason != "clean":
            continue
        whole = np.zeros((520, 300, 3), np.uint8)
        whole_ok = jpeg_bands.decode_rows(data, whole, 0, 520)
        split, row = np.zeros_like(whole), int(rng.integers(1, 520))
        try:
            libjpeg.decode_rows(data, split, 300, 520, 0, row)
            entered += libjpeg.decode_rows(data, split, 300, 520, row, 520)[2] > 0
        except libjpeg.JpegError:
            split = None
        if split is not None:
            assert whole_ok, trial
            np.testing.assert_array_equal(split, whole, err_msg=f"trial {trial}, split at {row}")
        if whole_ok:
            taken += 1
            np.testing.assert_array_equal(whole, pillow_rgb(data), err_msg=f"trial {trial}")
    assert taken > 100 and entered > 50, (taken, entered)


CAMERA_PHOTOS = Path(__file__).resolve().parents[1] / "benchmarks" / "data"


def concealed_damage_jpegs(corpus: Path) -> dict[str, bytes]:
    """Streams the scan finds damaged where libjpeg decodes past with a warning: a camera's
    (a 16 KB run of FF bytes, then a stray marker), the corpus's (bytes between segments, then a
    progressive 4x4 frame), and made ones in three layouts."""
    made = {
        f"{damage}, {mode} {subsampling}": jpeg_with_concealed_damage(damage, mode, subsampling)
        for damage in CONCEALED_DAMAGE
        for mode, subsampling in (("RGB", "4:2:0"), ("RGB", "4:4:4"), ("L", "4:2:0"))
    }
    return {
        "corrupted.jpg": (CAMERA_PHOTOS / "exif-samples" / "corrupted.jpg").read_bytes(),
        "imagers__partial_progressive.jpg": (corpus / "imagers__partial_progressive.jpg").read_bytes(),
    } | made


CONCEALED_DAMAGE_NAMES = [
    "corrupted.jpg",
    "imagers__partial_progressive.jpg",
    *(f"{d}, {m}" for d in CONCEALED_DAMAGE for m in ("RGB 4:2:0", "RGB 4:4:4", "L 4:2:0")),
]


@pytest.mark.parametrize("name", CONCEALED_DAMAGE_NAMES)
def test_damage_libjpeg_conceals_is_decoded_as_pillow_decodes_it_in_every_split(corpus: Path, name: str) -> None:
    """Tolerant (every warning let through but the end of the data, every band from the top):
    every split gives Pillow's pixels, which Pillow gives fed in any chunk size (its source
    suspends and resumes where ours holds the whole file). The decoder takes such a file by the
    libjpeg route, and the pipeline gives the reference's pixel values."""
    data = concealed_damage_jpegs(corpus)[name]
    assert scan_jpeg(data).conceals_damage, scan_jpeg(data)
    expected = pillow_rgb(data)
    np.testing.assert_array_equal(pillow_rgb(data, block=997), expected)
    for edges in split_rows(expected.shape[0]):
        np.testing.assert_array_equal(decode_split(data, edges, True), expected, err_msg=f"{name} split at {edges}")
    result = kimi_vision_prep.preprocess_bytes(data, decoder=ImageDecoder())
    assert (result.decode_path, result.fallback_reason) == ("libjpeg", None)
    np.testing.assert_array_equal(result.pixel_values, reference_preprocess(data, "kimi-k2.5").pixel_values)


def test_damage_the_strict_route_refuses_is_what_tolerance_lets_through() -> None:
    """Strict, the stray marker and the restart markers out of sequence refuse the file."""
    for damage in ("stray marker", "interval missing", "interval repeated"):
        data = jpeg_with_concealed_damage(damage)
        pixels = np.zeros((120, 200, 3), np.uint8)
        assert not jpeg_bands.decode_rows(data, pixels, 0, 120), damage
        assert jpeg_bands.decode_rows(data, pixels, 0, 120, tolerant=True), damage


def test_a_damaged_stream_that_ends_early_or_errs_is_refused_and_gets_pillows_verdict(corpus: Path) -> None:
    """Tolerance stops at the end of the data (Pillow calls the file truncated) and at libjpeg's
    errors (Pillow's "broken data stream"): refused in every band, and the decoder raises Pillow's
    verdict."""
    truncated = jpeg_with_concealed_damage("stray marker")[:-300]
    erring = (corpus / "imagers__40bb78b1ac031125a6d8466b374962a8.jpg").read_bytes()  # an unsupported marker
    for data in (truncated, erring):
        assert scan_jpeg(data).conceals_damage
        width, height = Image.open(io.BytesIO(data)).size
        pixels = np.zeros((height, width, 3), np.uint8)
        for begin in (0, height // 2, height - 1):
            assert not jpeg_bands.decode_rows(data, pixels, begin, height, tolerant=True), begin
        with pytest.raises(OSError):
            pillow_rgb(data)
        with pytest.raises(InvalidImageError):
            kimi_vision_prep.preprocess_bytes(data, decoder=ImageDecoder())


def concealable_damage(data: bytes, rng: np.random.Generator) -> bytes:
    """:func:`damaged` and damage of the kinds libjpeg conceals: a stray marker (FF and a random
    byte) put in the scan data, a restart interval dropped or repeated."""
    out = damaged(data, rng) if rng.integers(0, 2) else data
    start = out.index(b"\xff\xda") + 14
    kind = int(rng.integers(0, 3))
    restarts = [k for k in range(start, len(out) - 2) if out[k] == 0xFF and 0xD0 <= out[k + 1] <= 0xD7]
    if kind == 0 or len(restarts) < 3:
        at = int(rng.integers(start, len(out) - 2))
        return out[:at] + bytes([0xFF, int(rng.integers(1, 256))]) + out[at:]
    i = int(rng.integers(0, len(restarts) - 1))
    interval = out[restarts[i] + 2 : restarts[i + 1] + 2]
    if kind == 1:
        return out[: restarts[i] + 2] + out[restarts[i + 1] + 2 :]
    return out[: restarts[i + 1] + 2] + interval + out[restarts[i + 1] + 2 :]


def test_randomly_damaged_streams_get_pillows_verdict_and_pixels() -> None:
    """300 seeded damaged streams (with and without restart markers, colour and grey) that the scan
    finds damaged where libjpeg conceals it: where Pillow decodes one, the decoder gives its pixels
    (most by the libjpeg route) and so does a split tolerant decode; where Pillow refuses, the
    decoder raises."""
    bases = [
        jpeg_with_restarts(300, 520, rows=1),
        jpeg_with_restarts(300, 520),
        jpeg_with_restarts(300, 520, "L"),
        jpeg_rgb(300, 520),
    ]
    rng = np.random.default_rng(11)
    decoder = ImageDecoder()
    preset = kimi_vision_prep.get_preset("kimi-k2.5")
    verdicts = {"pixels": 0, "libjpeg": 0, "refused": 0}
    for trial in range(300):
        data = concealable_damage(bases[trial % len(bases)], rng)
        if not scan_jpeg(data).conceals_damage:
            continue
        try:
            expected = pillow_rgb(data)
        except OSError:
            expected = None
        if expected is None:
            with pytest.raises(InvalidImageError):
                decoder.decode(data, preset)
            verdicts["refused"] += 1
            continue
        decoded = decoder.decode(data, preset)
        np.testing.assert_array_equal(np.asarray(decoded.pixels), expected, err_msg=f"trial {trial}")
        verdicts["pixels"] += 1
        verdicts["libjpeg"] += decoded.decode_path == "libjpeg"
        split, row = np.zeros_like(expected), int(rng.integers(1, 520))
        if jpeg_bands.decode_rows(data, split, 0, row, True) and jpeg_bands.decode_rows(data, split, row, 520, True):
            np.testing.assert_array_equal(split, expected, err_msg=f"trial {trial}, split at {row}")
    assert verdicts["libjpeg"] > 100 and verdicts["refused"] > 5, verdicts


def test_rows_outside_the_image_or_a_wrong_buffer_raise() -> None:
    data = jpeg_rgb(40, 30)
    with pytest.raises(ValueError, match="rows"):
        jpeg_bands.decode_rows(data, np.zeros((30, 40, 3), np.uint8), 10, 31)
    with pytest.raises(TypeError, match="read-write bytes-like"):  # not C-contiguous
        jpeg_bands.decode_rows(data, np.zeros((30, 40, 3), np.uint8, order="F"), 0, 30)
    for shape in ((31, 40, 3), (30, 41, 3)):  # not the size libjpeg decodes: refused, like a bad file
        assert not jpeg_bands.decode_rows(data, np.zeros(shape, np.uint8), 0, shape[0])


class RecordingConsumer:
    """A row consumer that records what each band delivered, on which thread."""

    multiple = 14
    row_work = 0.6

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.started = 0
        self.bands: list[tuple[int, int, str]] = []
        self.lock = threading.Lock()
        self.hold = hold  # when set, each band waits for it before returning

    def start(self) -> None:
        self.started += 1

    def write(self, pixels: np.ndarray, row_begin: int, row_end: int) -> None:
        with self.lock:
            self.bands.append((row_begin, row_end, threading.current_thread().name))
        if self.hold is not None:
            assert self.hold.wait(10)


def assert_rows_covered_once(consumer: RecordingConsumer, height: int) -> list[tuple[int, int]]:
    spans = sorted((begin, end) for begin, end, _ in consumer.bands)
    assert spans[0][0] == 0 and spans[-1][1] == height, spans
    assert all(a[1] == b[0] and a[1] % 14 == 0 for a, b in itertools.pairwise(spans)), spans
    return spans


class HelperFirstConsumer(RecordingConsumer):
    """A consumer that holds the caller's thread at its first rows until a helper has handed rows
    over: the caller has then committed only those rows, so a helper always finds a band to take,
    however the threads are scheduled."""

    def __init__(self) -> None:
        super().__init__()
        self.helper_wrote = threading.Event()

    def write(self, pixels: np.ndarray, row_begin: int, row_end: int) -> None:
        super().write(pixels, row_begin, row_end)
        if threading.current_thread() is threading.main_thread():
            assert self.helper_wrote.wait(60), "no helper took a band while the caller waited"
        else:
            self.helper_wrote.set()


def test_helpers_take_bands_and_every_row_is_handed_over_once() -> None:
    data = jpeg_rgb(640, 1400, seed=3)
    expected = pillow_rgb(data)
    with ThreadPoolExecutor(2, thread_name_prefix="helper") as pool:
        bands = jpeg_bands.BandDecoder(2, lambda: pool)
        pixels = np.zeros_like(expected)
        consumer = HelperFirstConsumer()
        assert bands.decode(data, pixels, 3, consumer)
        np.testing.assert_array_equal(pixels, expected)
        assert consumer.started == 1
        assert len(assert_rows_covered_once(consumer, 1400)) >= 2
        assert {thread.split("_")[0] for *_, thread in consumer.bands} >= {"MainThread", "helper"}


def share(
    data: bytes, pixels: np.ndarray, regions: np.ndarray, index: int, row_cost: float = 1.0
) -> tuple[int, int, int]:
    """One band of a shared decode, straight from the extension (multiple 14, at least 28 rows):
    its rows ``[begin, end)`` and the row it entered the stream at (0: the top)."""
    from kimi_vision_prep import _libjpeg

    height, width = pixels.shape[:2]
    return _libjpeg.decode_share(data, pixels, width, height, regions, index, 14, 28, jpeg_bands.SKIP_COST, row_cost)


def test_a_late_helper_takes_the_bottom_of_what_is_left_and_nothing_after_the_end() -> None:
    """The stealing rule, band by band: a helper that finds the owner at row c of [c, H) takes the
    bottom from the split where both finish together (skipping costs SKIP_COST a row), on a
    multiple of 14, and lowers the owner's limit to it; the owner then stops there. With nothing
    (or too little) left it takes nothing."""
    data = jpeg_rgb(320, 1000, seed=6)
    expected, height = pillow_rgb(data), 1000
    for committed, row_cost in ((0, 1.0), (0, 1.6), (200, 1.0)):
        pixels = np.zeros_like(expected)
        regions = np.array([height << 32 | committed, 0], np.uint64)
        begin, end, entered = share(data, pixels, regions, 1, row_cost)
        split = row_cost * (committed + height) / (2 * row_cost - jpeg_bands.SKIP_COST)
        assert (begin, end, entered) == (-(-int(split) // 14) * 14, height, 0), (committed, row_cost)
        assert int(regions[0]) == begin << 32 | committed and int(regions[1]) == height << 32 | height
        np.testing.assert_array_equal(pixels[begin:], expected[begin:])
        if committed == 0:  # the owner decodes up to the new limit and stops there
            assert share(data, pixels, regions, 0) == (0, begin, 0)
            np.testing.assert_array_equal(pixels, expected)
    for committed in (height, height - 20, 500):  # done, too little left, or not worth the skipping
        regions = np.array([height << 32 | committed, 0], np.uint64)
        assert share(data, np.zeros_like(expected), regions, 1) == (0, 0, 0)
        assert int(regions[0]) == height << 32 | committed and int(regions[1]) == 0


def restart_entry(begin: int, imcu: int) -> int:
    """Where a band from ``begin`` enters a stream with a restart marker after every MCU row: the
    iMCU row above ``begin``'s iMCU row (its context) must start interval 8k, k >= 1, so that the
    entered stream's markers count from RST0; 0 where none is above."""
    context_rows = [j * imcu for j in range(8, begin // imcu, 8) if (j + 1) * imcu <= begin]
    return max(context_rows, default=0)


def test_a_helper_entering_at_a_restart_marker_splits_the_rows_evenly() -> None:
    """With a restart marker above the split, the thief skips nothing but the rows from its entry
    (restart_entry): the rows are split half and half, on a multiple of 14, and the owner stops
    at the split; both bands give Pillow's rows."""
    data = jpeg_with_restarts(320, 1000, rows=1)
    expected, height = pillow_rgb(data), 1000
    for committed in (0, 200):
        pixels = np.zeros_like(expected)
        regions = np.array([height << 32 | committed, 0], np.uint64)
        begin, end, entered = share(data, pixels, regions, 1)
        assert begin == -(-(committed + height) // 2 // 14) * 14 and end == height, committed
        assert entered == restart_entry(begin, 16) > 0
        np.testing.assert_array_equal(pixels[begin:], expected[begin:])
        if committed == 0:
            assert share(data, pixels, regions, 0) == (0, begin, 0)
            np.testing.assert_array_equal(pixels, expected)


def restart_jpegs() -> dict[str, tuple[bytes, int, bool]]:
    """JPEGs with a restart marker after every MCU row, by layout, with their iMCU height and
    whether a band may enter them (not a grey image of 2x2 sampling, whose MCU rows are not its
    iMCU rows)."""
    jpegs = {
        "420": (jpeg_with_restarts(333, 600, rows=1), 16, True),
        "422": (jpeg_with_restarts(333, 600, subsampling="4:2:2", rows=1), 8, True),
        "444": (jpeg_with_restarts(333, 600, subsampling="4:4:4", rows=1), 8, True),
        "grey": (jpeg_with_restarts(333, 600, mode="L", subsampling="4:4:4", rows=1), 8, True),
        "grey 2x2": (jpeg_with_restarts(333, 600, mode="L", rows=1), 16, False),
    }
    if CJPEG:
        jpegs |= {
            "440": (cjpeg_rgb(157, 600, "1x2,1x1,1x1", 1), 16, True),
            "411": (cjpeg_rgb(157, 600, "4x1,1x1,1x1", 1), 8, True),
        }
    return jpegs


@pytest.mark.parametrize("kind", list(restart_jpegs()))
def test_a_band_below_a_restart_marker_enters_the_stream_there_and_gives_pillows_rows(kind: str) -> None:
    """A band that starts below an iMCU row beginning restart interval 8k enters the stream there
    (restart_entry) instead of skipping every row above, at each kind of edge around such a row,
    and its rows are Pillow's."""
    data, imcu, enters = restart_jpegs()[kind]
    expected = pillow_rgb(data)
    height, width = expected.shape[:2]
    libjpeg = jpeg_bands._extension()  # bound to Pillow's libjpeg
    for entry in (8 * imcu, 16 * imcu, 32 * imcu):
        for begin in (entry + imcu - 1, entry + imcu, entry + imcu + 1, entry + 2 * imcu - 1, height - 1):
            pixels = np.zeros_like(expected)
            first, end, entered = libjpeg.decode_rows(data, pixels, width, height, begin, height)
            assert (first, end, entered) == (begin, height, restart_entry(begin, imcu) if enters else 0), (kind, begin)
            np.testing.assert_array_equal(pixels[begin:], expected[begin:], err_msg=f"{kind} from row {begin}")


def test_a_busy_helper_is_not_waited_for() -> None:
    """While the decoder's helper runs another image's band, a decode runs alone, all its rows
    on the calling thread, and takes the helper again once it is back."""
    data = jpeg_rgb(640, 1400, seed=4)
    with ThreadPoolExecutor(1) as pool:
        bands = jpeg_bands.BandDecoder(1, lambda: pool)
        assert bands._idle.acquire(blocking=False)  # the helper is busy elsewhere
        alone = RecordingConsumer()
        assert bands.decode(data, np.zeros((1400, 640, 3), np.uint8), 2, alone)
        assert [(b, e, t) for b, e, t in alone.bands] == [(0, 1400, "MainThread")]
        bands._idle.release()
        pixels = np.zeros((1400, 640, 3), np.uint8)
        assert bands.decode(data, pixels, 2)
        np.testing.assert_array_equal(pixels, pillow_rgb(data))
        assert bands._idle.acquire(blocking=False)  # released again after the decode


def test_pipeline_patchifies_in_bands_exactly(corpus: Path) -> None:
    """A photo the NaViT rule keeps at its stored size: the bands pad, normalise and patchify their
    own rows (``rows_consumed``), in both outputs and into a caller's ``out``, equal to the
    reference; a wrong ``out`` is refused and leaves the decoder able to split again."""
    data = (corpus / "pil__xmp_test.jpg").read_bytes()  # 2000x1072: no resize under K2.5
    decoder = ImageDecoder(cpu_decode_threads=2)
    seen: list[bool] = []
    real_decode = decoder.decode

    def recorded_decode(*args: object, **kwargs: object) -> decode_module.DecodedImage:
        decoded = real_decode(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(decoded.rows_consumed)
        return decoded

    decoder.decode = recorded_decode  # type: ignore[method-assign]
    expected = reference_preprocess(data, "kimi-k2.5").pixel_values
    result = kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    np.testing.assert_array_equal(result.pixel_values, expected)
    assert result.decode_path == "libjpeg"
    patches = kimi_vision_prep.preprocess_bytes(data, decoder=decoder, output="pixel_patches").pixel_patches
    np.testing.assert_array_equal(kimi_vision_prep.pixel_values_from_patches(patches), expected)
    out = np.full(expected.shape, np.nan, np.float32)
    assert kimi_vision_prep.preprocess_bytes(data, decoder=decoder, out=out).pixel_values is out
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="out must be"):
        kimi_vision_prep.preprocess_bytes(data, decoder=decoder, out=np.empty((3, 3, 14, 14), np.float32))
    kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert seen == [True, True, True, True], seen


def recorded_bands(decoder: ImageDecoder, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The band counts the decoder asks its band decoder for, in order."""
    asked: list[int] = []
    real = decoder._bands.decode

    def decode(data: bytes, pixels: np.ndarray, bands: int, consumer: object = None, tolerant: bool = False) -> int:
        asked.append(bands)
        return real(data, pixels, bands, consumer, tolerant)  # type: ignore[arg-type]

    monkeypatch.setattr(decoder._bands, "decode", decode)
    return asked


def test_a_thread_that_is_not_the_decoders_only_caller_decodes_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers at once (the second a claim held by this thread) keep the cores busy already:
    a lone image is then decoded in one band."""
    decoder, preset = ImageDecoder(cpu_decode_threads=2), kimi_vision_prep.get_preset("kimi-k2.5")
    asked = recorded_bands(decoder, monkeypatch)
    data = jpeg_rgb(640, 700, seed=5)
    decoder.decode(data, preset)
    with decoder.claim(), ThreadPoolExecutor(1) as other:
        other.submit(decoder.decode, data, preset).result()
    assert asked == [2, 1]


def test_progressive_small_and_batched_images_take_one_band(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bands pay only for a single-scan stream (a progressive one is entropy-decoded whole before
    its first row), for images of more than one band's worth of pixels, decoded alone."""
    decoder, preset = ImageDecoder(cpu_decode_threads=4), kimi_vision_prep.get_preset("kimi-k2.5")
    asked = recorded_bands(decoder, monkeypatch)
    progressive, baseline = jpeg_rgb(640, 700, progressive=True), jpeg_rgb(640, 700)
    assert not scan_jpeg(progressive).single_scan and scan_jpeg(baseline).single_scan
    for data in (progressive, jpeg_rgb(64, 48), baseline):
        np.testing.assert_array_equal(decoder.decode(data, preset).pixels, pillow_rgb(data))
    decoder.decode_batch([baseline, baseline], preset)
    assert asked == [1, 1, 3, 1, 1]


def test_without_the_extension_clean_jpegs_take_simplejpeg_and_the_log_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(jpeg_bands, "_binding", lambda: (None, "ImportError: no _libjpeg"))
    decode_routes._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="kimi_vision_prep.decode"):
        decoder = ImageDecoder()
    assert decoder.cpu_routes == ("simplejpeg", "nvimgcodec-cpu")
    assert "libjpeg route is unavailable (ImportError: no _libjpeg)" in caplog.text
    data = jpeg_rgb(64, 48)
    result = kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert result.decode_path == "simplejpeg"
    np.testing.assert_array_equal(result.pixel_values, reference_preprocess(data, "kimi-k2.5").pixel_values)
