"""Bad inputs: the verdict equals the reference's (Pillow's), errors are typed and say what is wrong,
and no input hangs or kills the process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from make_inputs import (
    CORPUS,
    corpus_names,
    gif_transparent,
    jpeg_grey,
    jpeg_rgb,
    jpeg_with_size,
    png_header_only,
    png_mode,
)
from PIL import Image, UnidentifiedImageError
from reference import reference_preprocess

import kimi_vision_prep
from kimi_vision_prep import (
    DecodeLimits,
    ImageDecoder,
    ImageTooLargeError,
    InvalidImageError,
    PreprocessError,
    UnsupportedImageError,
    preprocess_bytes,
)

PRESET_NAMES = ("kimi-k2.5", "kimi-k3")
BAD_INPUT_ERRORS = (InvalidImageError, ImageTooLargeError, UnsupportedImageError)
REJECTED = corpus_names(accepted=False)


def reference_error(data: bytes, preset: str) -> Exception | None:
    """The exception the reference raises on ``data``, or None when it accepts it."""
    try:
        reference_preprocess(data, preset)
    except Exception as exc:  # any failure is a rejection
        return exc
    return None


def library_outcome(data: bytes, preset: str, decoder: ImageDecoder | None = None) -> object:
    """The library's result, or the PreprocessError it raised (anything else propagates)."""
    try:
        return kimi_vision_prep.preprocess_bytes(data, preset, decoder=decoder)
    except PreprocessError as exc:
        return exc


def assert_message_names_problem(error: PreprocessError, ref_error: Exception, size: int) -> None:
    message = str(error).lower()
    if isinstance(ref_error, Image.DecompressionBombError):
        assert isinstance(error, ImageTooLargeError)
        assert "exceeds" in message or "too large" in message, message
    elif isinstance(ref_error, UnidentifiedImageError):
        assert "identify" in message or (size == 0 and "empty" in message), message
    elif "truncated" in str(ref_error).lower():
        assert "truncated" in message, message
    else:  # Pillow's own words are passed on
        assert str(ref_error).lower() in message, (message, str(ref_error))


def assert_same_verdict(data: bytes, preset: str, label: str) -> None:
    """Rejected by both (typed, explained) or accepted by both with identical outputs."""
    ref_error = reference_error(data, preset)
    outcome = library_outcome(data, preset)
    if ref_error is not None:
        assert isinstance(outcome, BAD_INPUT_ERRORS), (label, preset, f"reference raised {ref_error!r}", outcome)
        assert_message_names_problem(outcome, ref_error, len(data))
        return
    assert not isinstance(outcome, PreprocessError), (label, preset, "reference accepts", outcome)
    ref = reference_preprocess(data, preset)
    assert np.array_equal(np.asarray(outcome.pixel_values), ref.pixel_values), (label, preset)
    assert np.array_equal(outcome.grid_thw, ref.grid_thw), (label, preset)
    assert outcome.num_tokens == ref.num_tokens


# --- the corpus's broken files ------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("name", REJECTED)
def test_corpus_rejected_file(corpus: Path, name: str, preset: str) -> None:
    data = (corpus / name).read_bytes()
    ref_error = reference_error(data, preset)
    assert ref_error is not None, f"the reference accepts {name}, the manifest says it does not"
    outcome = library_outcome(data, preset)
    assert isinstance(outcome, BAD_INPUT_ERRORS), outcome
    assert_message_names_problem(outcome, ref_error, len(data))


def test_corpus_has_rejected_files() -> None:
    assert len(REJECTED) >= 15


# --- truncations and corruptions ----------------------------------------------------------------

SOURCES: dict[str, Callable[[], bytes]] = {
    "jpeg420": lambda: jpeg_rgb(64, 48, "4:2:0"),
    "jpeg444_progressive": lambda: jpeg_rgb(64, 48, "4:4:4", progressive=True),
    "jpeg_grey": lambda: jpeg_grey(40, 40),
    "png_rgba": lambda: png_mode(37, 29, "RGBA"),
    "gif_trns": lambda: gif_transparent(40, 30),
}


def cut_points(size: int) -> list[int]:
    """20 cuts: the first bytes (magic/header), spread through the body, the last bytes."""
    spread = [size * k // 10 for k in range(1, 10)]
    return sorted({1, 2, 3, 4, 11, 20, *spread, size - 20, size - 3, size - 2, size - 1} - {0, size})


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_truncated_verdict_matches_reference(source: str) -> None:
    data = SOURCES[source]()
    cuts = cut_points(len(data))
    assert len(cuts) >= 18
    for cut in cuts:
        for preset in PRESET_NAMES:
            assert_same_verdict(data[:cut], preset, f"{source}[:{cut}] of {len(data)}")


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_corrupted_byte_verdict_matches_reference(source: str) -> None:
    """One byte overwritten at 40 random places: same verdict, same pixels when accepted."""
    data = SOURCES[source]()
    rng = np.random.default_rng(sorted(SOURCES).index(source))
    for _ in range(40):
        corrupt = bytearray(data)
        position = int(rng.integers(2, len(data)))
        corrupt[position] = int(rng.integers(0, 256))
        assert_same_verdict(bytes(corrupt), "kimi-k2.5", f"{source} byte {position} := {corrupt[position]}")


# --- crafted inputs -----------------------------------------------------------------------------


def good_jpeg() -> bytes:
    return jpeg_rgb(64, 48)


# name -> (bytes, expected error type, a word the message must contain)
CRAFTED: dict[str, tuple[Callable[[], bytes], type[PreprocessError], str]] = {
    "empty": (lambda: b"", InvalidImageError, "empty"),
    "random_bytes": (lambda: np.random.default_rng(7).integers(0, 256, 5000, dtype=np.uint8).tobytes(),
                     InvalidImageError, "identify"),
    "path_text": (lambda: b"/etc/passwd", InvalidImageError, "identify"),
    "url_text": (lambda: b"http://example.com/x.jpg", InvalidImageError, "identify"),
    "jpeg_65500x65500": (lambda: jpeg_with_size(good_jpeg(), 65500, 65500), ImageTooLargeError, "exceeds"),
    "jpeg_zero_width": (lambda: jpeg_with_size(good_jpeg(), 0, 48), InvalidImageError, "identify"),
    "jpeg_zero_height": (lambda: jpeg_with_size(good_jpeg(), 64, 0), InvalidImageError, "identify"),
    "png_20000x20000": (lambda: png_header_only(20000, 20000), ImageTooLargeError, "exceeds"),
    "png_zero_width": (lambda: png_header_only(0, 10), InvalidImageError, "identify"),
    "png_no_pixel_data": (lambda: png_header_only(4000, 4000), InvalidImageError, "truncated"),
}  # fmt: skip


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_input_rejected(name: str, preset: str) -> None:
    make, error_type, word = CRAFTED[name]
    data = make()
    assert reference_error(data, preset) is not None, "the reference accepts it"
    outcome = library_outcome(data, preset)
    assert isinstance(outcome, error_type), outcome
    assert word in str(outcome).lower(), str(outcome)


@pytest.mark.parametrize("claimed", [(640, 480), (32, 24), (65, 49), (64, 200)])
@pytest.mark.parametrize("progressive", [False, True])
def test_jpeg_with_wrong_size_header_follows_reference(claimed: tuple[int, int], progressive: bool) -> None:
    """A frame header claiming another size: Pillow accepts (warning) and so must the library, with
    Pillow's pixels (grey fill of the missing area)."""
    data = jpeg_with_size(jpeg_rgb(64, 48, progressive=progressive), *claimed)
    for preset in PRESET_NAMES:
        assert_same_verdict(data, preset, f"claims {claimed}")


def structural_mutations() -> dict[str, bytes]:
    """Malformed-but-maybe-accepted JPEG streams: trailing data, fill bytes, stray markers."""
    base = jpeg_rgb(64, 48)
    progressive = jpeg_rgb(64, 48, progressive=True)
    sos = base.index(b"\xff\xda")
    last_scan = progressive.rindex(b"\xff\xda")
    return {
        "trailing_junk": base + b"junk" * 10,
        "trailing_second_jpeg": base + progressive,
        "trailing_ff": base + b"\xff" * 5,
        "second_eoi": base + b"\xff\xd9",
        "fill_bytes_before_sos": base[:sos] + b"\xff\xff\xff" + base[sos:],
        "comment_before_sos": base[:sos] + b"\xff\xfe\x00\x05abc" + base[sos:],
        "app15_before_sos": base[:sos] + b"\xff\xef\x00\x04ab" + base[sos:],
        "junk_before_eoi": base[:-2] + b"\x12\x34" + base[-2:],
        "stray_restart_marker": base[:-10] + b"\xff\xd0" + base[-10:],
        "dnl_marker": base[:-2] + b"\xff\xdc\x00\x04\x00\x30" + base[-2:],
        "progressive_without_last_scan": progressive[:last_scan] + b"\xff\xd9",
        "bytes_before_soi": b"\x00" + base,
        "sos_before_sof": base[:2] + base[sos:],
    }


STRUCTURAL = structural_mutations()


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("name", sorted(STRUCTURAL))
def test_structurally_odd_jpeg_follows_reference(name: str, preset: str) -> None:
    assert_same_verdict(STRUCTURAL[name], preset, name)


def test_max_encoded_bytes() -> None:
    data = good_jpeg()
    small = ImageDecoder(limits=DecodeLimits(max_encoded_bytes=len(data) - 1))
    outcome = library_outcome(data, "kimi-k2.5", small)
    assert isinstance(outcome, ImageTooLargeError)
    assert "max_encoded_bytes" in str(outcome) and "exceeds" in str(outcome)
    exact = ImageDecoder(limits=DecodeLimits(max_encoded_bytes=len(data)))
    assert not isinstance(library_outcome(data, "kimi-k2.5", exact), PreprocessError)


@pytest.mark.parametrize("data_kind", ["jpeg", "png"])
def test_max_pixels(data_kind: str) -> None:
    data = good_jpeg() if data_kind == "jpeg" else png_mode(64, 48, "RGBA")
    small = ImageDecoder(limits=DecodeLimits(max_pixels=64 * 48 - 1))
    outcome = library_outcome(data, "kimi-k3", small)
    assert isinstance(outcome, ImageTooLargeError)
    assert "max_pixels" in str(outcome) and "64x48" in str(outcome)
    exact = ImageDecoder(limits=DecodeLimits(max_pixels=64 * 48))
    assert not isinstance(library_outcome(data, "kimi-k3", exact), PreprocessError)


@pytest.mark.parametrize("value", [None, 123, "not bytes", ["x"]])
def test_non_bytes_input_is_invalid(value: object) -> None:
    with pytest.raises(InvalidImageError):
        kimi_vision_prep.preprocess_bytes(value)  # type: ignore[arg-type]


# --- hang / crash guard -------------------------------------------------------------------------

CHILD = r"""
import sys
from pathlib import Path
import kimi_vision_prep as k
directory, preset = Path(sys.argv[1]), sys.argv[2]
for path in sorted(directory.iterdir()):
    try:
        k.preprocess_bytes(path.read_bytes(), preset)
        verdict = "ok"
    except k.PreprocessError as exc:
        verdict = type(exc).__name__
    except BaseException as exc:
        verdict = "UNEXPECTED:" + type(exc).__name__
    print(f"{path.name}\t{verdict}", flush=True)
print("DONE", flush=True)
"""


def write_bad_inputs(directory: Path, corpus: Path) -> dict[str, bytes]:
    inputs: dict[str, bytes] = {f"corpus_{name}": (corpus / name).read_bytes() for name in REJECTED}
    inputs.update({f"crafted_{name}": make() for name, (make, _, _) in CRAFTED.items()})
    inputs.update({f"structural_{name}": data for name, data in STRUCTURAL.items()})
    for source, make in SOURCES.items():
        data = make()
        inputs.update({f"cut_{source}_{cut}": data[:cut] for cut in cut_points(len(data))})
    for name, data in inputs.items():
        (directory / name).write_bytes(data)
    return inputs


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_bad_inputs_do_not_hang_or_crash(tmp_path: Path, corpus: Path, preset: str) -> None:
    inputs = write_bad_inputs(tmp_path, corpus)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), preset],
        capture_output=True,
        text=True,
        timeout=10,
        env=dict(os.environ),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "DONE", done.stdout[-2000:]
    verdicts = dict(line.split("\t") for line in lines[:-1])
    assert set(verdicts) == set(inputs)
    allowed = {cls.__name__ for cls in BAD_INPUT_ERRORS} | {"ok"}
    unexpected = {name: v for name, v in verdicts.items() if v not in allowed}
    assert not unexpected, unexpected
    for name, verdict in verdicts.items():
        assert (verdict == "ok") == (reference_error(inputs[name], preset) is None), (name, verdict)


# -- rejected images free their memory at once ----------------------------------------------------


def live_pillow_images() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, Image.Image))


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_rejected_images_are_freed_without_the_cycle_collector(preset: str) -> None:
    """A half-decoded image Pillow rejects must not outlive its error. A stored traceback (or its
    implicit ``__context__``) used to form a reference cycle that held each rejected image (12 MB
    for pil__ultrahdr.jpg) until the cycle collector ran: a decode stub's heap grew by hundreds of
    MiB under a stream of bad uploads."""
    truncated = jpeg_rgb(1200, 900)[:20000]  # header intact, entropy data cut: Pillow loads part, then fails
    payloads = [(CORPUS / name).read_bytes() for name in REJECTED] + [truncated, b"", b"not an image"]
    decoder = ImageDecoder()
    Image.init()  # every plugin imported now (PalmImagePlugin keeps a module-level image)
    gc.collect()
    gc.disable()
    try:
        before = live_pillow_images()
        for data in payloads:
            results = decoder.decode_batch([data, data], kimi_vision_prep.get_preset(preset))
            assert all(isinstance(r, PreprocessError) for r in results)
            assert all(r.__traceback__ is None and r.__context__ is None for r in results)
            del results
            results = kimi_vision_prep.preprocess_batch([data], preset, decoder=decoder)
            del results
        assert live_pillow_images() == before
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["pil__hopper.jpg", "pilx__p_trns_single.png"])
def test_base64_text_of_an_image_gets_a_hint_not_a_guess(corpus: Path, name: str) -> None:
    """A JSON client that base64-encodes the file is told so and how to send bytes; the text is
    never decoded as if it were the image (the reference rejects it too)."""
    import base64

    text = base64.b64encode((corpus / name).read_bytes())
    with pytest.raises(InvalidImageError, match="base64 text of an image: send the raw bytes"):
        preprocess_bytes(text)
    assert reference_error(text, "kimi-k2.5") is not None
    with pytest.raises(InvalidImageError) as plain:
        preprocess_bytes(b"plain text, not base64 of an image!")
    assert "base64" not in str(plain.value)
