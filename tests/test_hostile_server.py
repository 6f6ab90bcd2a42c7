"""Hostile inputs against a real tritonserver, over gRPC and HTTP, to both vision ensembles.

The rule for every payload: the server's answer equals in-process ``preprocess_bytes`` bit for bit
when Pillow (``tests/reference.py``) accepts it, and is INVALID_ARG with the library's own message
(naming the problem) when Pillow rejects it or a limit is exceeded. Payloads are sent concurrently,
interleaved with good images, so bad and good requests share dynamic batches; the good ones must
be unaffected. Malformed requests (wrong dtype, shape, batch) get INVALID_ARG from Triton itself.
A second server renders a repository copy with a small ``max_encoded_bytes`` and a queue of one
(``max_queue_size: 1``) to show the size limit and UNAVAILABLE backpressure end to end. One fixture
sends every burst and reads the metrics endpoint and the server's RSS around them, so the tests
that check the counters and the bounded RSS stand alone, in any order.
"""

from __future__ import annotations

import io
import queue
import re
import socket
import urllib.request
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from make_inputs import animated, jpeg_rgb, jpeg_with_size, png_chunk, png_header_only, rgb_pattern
from PIL import Image
from reference import reference_preprocess
from soak import rss_growth_failures, server_rss
from tritonclient.utils import InferenceServerException

from kimi_vision_common.errors import reason_for
from kimi_vision_common.wire import ENSEMBLE_PREFIX, served_message
from kimi_vision_prep import DecodeLimits, ImageDecoder, PreprocessError, preprocess_bytes
from kimi_vision_prep.pipeline import with_index
from kimi_vision_server.launch.embedded import EmbeddedServer

pytestmark = pytest.mark.server

ENSEMBLES = {"kimi_k25_vision": "kimi-k2.5", "kimi_k3_vision": "kimi-k3"}
PROTOCOLS = {"http": httpclient, "grpc": grpcclient}
OUTPUTS = ["PIXEL_VALUES", "GRID_THW", "NUM_TOKENS"]
INVALID_ARG = ("400", "StatusCode.INVALID_ARGUMENT")
UNAVAILABLE = ("503", "StatusCode.UNAVAILABLE")
GOOD_CORPUS = ["pil__hopper.jpg", "pilx__transparent.gif", "pilx__uncompressed_la.png"]
SMALL_MAX_ENCODED_BYTES = 20_000
MIB = 1 << 20


# -- hostile payloads --------------------------------------------------------------------------------


def encode(image: Image.Image, fmt: str, **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def corrupt_entropy(jpeg: bytes) -> bytes:
    """Flip bits in the middle of the entropy-coded data (after the last SOS), not in any header."""
    start = jpeg.rfind(b"\xff\xda") + 20
    data = bytearray(jpeg)
    for offset in range(start, len(data) - 4, max(1, (len(data) - start) // 12)):
        data[offset] = (data[offset] ^ 0x5A) if data[offset] != 0xFF else 0x00
    return bytes(data)


def gif_bomb() -> bytes:
    """GIF whose logical screen is 65535x65535 (the image block is 1x1)."""
    screen = b"GIF89a" + (65535).to_bytes(2, "little") * 2 + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"
    block = b"\x2c" + b"\x00\x00" * 2 + b"\x01\x00\x01\x00" + b"\x00" + b"\x02\x02\x44\x01\x00"
    return screen + block + b"\x3b"


def webp_bomb() -> bytes:
    """WebP VP8X header declaring a 16384x16384 canvas, no image data."""
    vp8x = b"VP8X" + (10).to_bytes(4, "little") + b"\x00\x00\x00\x00" + (16383).to_bytes(3, "little") * 2
    return b"RIFF" + (4 + len(vp8x)).to_bytes(4, "little") + b"WEBP" + vp8x


def png_bomb() -> bytes:
    """A valid zlib stream inflating to a 20000x20000 grey image (~400 MB) in a ~400 KB PNG."""
    height, width = 20_000, 20_000
    raw = zlib_compress_zeros(height * (width + 1))
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + b"\x08\x00\x00\x00\x00"
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", raw) + png_chunk(b"IEND", b"")


def zlib_compress_zeros(size: int) -> bytes:
    import zlib

    compressor = zlib.compressobj(9)
    chunk = b"\x00" * MIB
    parts = [compressor.compress(chunk) for _ in range(size // MIB)]
    parts.append(compressor.compress(b"\x00" * (size % MIB)))
    return b"".join(parts) + compressor.flush()


def multi_frame_tiff() -> bytes:
    frames = [Image.fromarray(rgb_pattern(64, 48, seed), "RGB") for seed in range(3)]
    return encode(frames[0], "TIFF", save_all=True, append_images=frames[1:])


def animated_webp() -> bytes:
    frames = [Image.fromarray(rgb_pattern(64, 48, seed), "RGB") for seed in range(3)]
    return encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=100, lossless=True)


def jpeg_big_exif_icc() -> bytes:
    """JPEG with a ~60 KB APP1 (EXIF) and a 200 KB ICC profile split over four APP2 segments."""
    image = Image.fromarray(rgb_pattern(96, 64), "RGB")
    exif = b"Exif\x00\x00" + b"MM\x00\x2a\x00\x00\x00\x08" + b"\x00\x00" + bytes(60_000)
    icc = bytes(np.random.default_rng(7).integers(0, 256, 200_000, dtype=np.uint8))
    return encode(image, "JPEG", quality=90, exif=exif[6:], icc_profile=icc)


def minimal_zip(payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("image.jpg", payload)
    return buffer.getvalue()


MINIMAL_PDF = (
    b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\n"
    b"trailer<</Root 1 0 R>>\n%%EOF\n"
)


@dataclass(frozen=True)
class Case:
    label: str
    data: bytes
    keyword: str | None = None  # a word the rejection message must contain


def hostile_cases(corpus: Path, tmp: Path, url: str) -> list[Case]:
    jpeg = jpeg_rgb(160, 120)
    real_file = tmp / "real_image.jpg"
    real_file.write_bytes(jpeg_rgb(64, 64, seed=5))
    cases = [
        Case("empty", b"", "empty"),
        *(Case(f"jpeg cut at {cut}", jpeg[:cut]) for cut in (2, 3, 40, 200)),
        *(Case(f"jpeg cut at {cut}", jpeg[:cut], "truncated") for cut in (len(jpeg) // 2, len(jpeg) - 2)),
        Case("corrupt entropy data", corrupt_entropy(jpeg)),
        Case("random bytes", np.random.default_rng(1).bytes(3000), "identify"),
        Case("SOI + random bytes", b"\xff\xd8\xff" + np.random.default_rng(2).bytes(3000)),
        Case("text /etc/passwd", b"/etc/passwd", "identify"),
        Case("text url", url.encode(), "identify"),
        Case("path of a real image file", str(real_file).encode(), "identify"),
        Case("file:// url of a real image", f"file://{real_file}".encode(), "identify"),
        Case("minimal pdf", MINIMAL_PDF, "identify"),
        Case("zip holding a jpeg", minimal_zip(jpeg), "identify"),
        Case("png bomb (real 20000x20000 zlib stream)", png_bomb(), "exceeds"),
        Case("png header 30000x30000", png_header_only(30_000, 30_000), "exceeds"),
        Case("gif bomb 65535x65535", gif_bomb(), "exceeds"),
        Case("webp bomb 16384x16384", webp_bomb(), "exceeds"),
        Case("jpeg header 65500x65500", jpeg_with_size(jpeg, 65_500, 65_500), "exceeds"),
        Case("jpeg header zero width", jpeg_with_size(jpeg, 0, 120), "identify"),
        Case("jpeg header zero height", jpeg_with_size(jpeg, 160, 0), "identify"),
        Case("animated gif", animated(64, 48, "GIF")),
        Case("animated png", animated(64, 48, "PNG")),
        Case("multi-frame tiff", multi_frame_tiff()),
        Case("animated webp", animated_webp()),
        Case("jpeg with 60 KB APP1 and 200 KB ICC", jpeg_big_exif_icc()),
    ]
    for name in (
        "ljt__monkey12.jpg",  # 12-bit
        "ljt__testimgari.jpg",  # arithmetic coding
        "imagers__jpeg_lossless_sel1-8bit.jpg",  # lossless
        "imagers__XA1.jpg",  # lossless, rejected by Pillow
        "pil__pil_sample_cmyk.jpg",  # Adobe YCCK
        "imagers__jpg-cmyk-1.jpg",  # CMYK
        "pil__sugarshack.mpo",  # multi-picture
        "pil__icc_profile_big.jpg",  # multi-segment ICC
        "pil__truncated_jpeg.jpg",
        "imagers__max_size.jpg",
        "imagers__null_height.jpg",
    ):
        cases.append(Case(f"corpus {name}", (corpus / name).read_bytes()))
    return cases


# -- expected outcomes, computed in process ---------------------------------------------------------


@dataclass
class Expected:
    """What the server must answer: outputs (accepted) or the library's error (rejected)."""

    outputs: dict[str, np.ndarray] | None
    error: PreprocessError | None
    decode_path: str | None


def expect(data: bytes, preset: str, decoder: ImageDecoder | None = None) -> Expected:
    """In-process result; cross-checked against the plain Pillow reference's verdict and pixels."""
    try:
        result = preprocess_bytes(data, preset, decoder=decoder)
    except PreprocessError as exc:
        if decoder is None:  # default limits: a rejection must be Pillow's
            with pytest.raises(Exception):  # noqa: B017  (any exception is a Pillow rejection)
                reference_preprocess(data, preset)
        return Expected(None, exc, None)
    reference = reference_preprocess(data, preset)
    np.testing.assert_array_equal(result.pixel_values, reference.pixel_values)
    outputs = {
        "PIXEL_VALUES": result.pixel_values,
        "GRID_THW": result.grid_thw,
        "NUM_TOKENS": np.array(result.num_tokens, dtype=np.int32),
    }
    return Expected(outputs, None, result.decode_path)


def server_message(error: InferenceServerException) -> str:
    return ENSEMBLE_PREFIX.sub("", error.message() or "")


def assert_outcome(label: str, expected: Expected, result: Any, error: InferenceServerException | None) -> None:
    if expected.outputs is None:
        assert expected.error is not None
        assert error is not None, f"{label}: accepted by the server, rejected in process ({expected.error})"
        assert error.status() in INVALID_ARG, f"{label}: {error.status()} {error.message()}"
        # the class tag, then the library's text for the request's image 0
        assert server_message(error) == served_message(with_index(expected.error, "image", 0)), label
        return
    assert error is None, f"{label}: {error.status()} {error.message()}"
    np.testing.assert_array_equal(result.as_numpy("PIXEL_VALUES")[0], expected.outputs["PIXEL_VALUES"], label)
    np.testing.assert_array_equal(result.as_numpy("GRID_THW")[0, 0], expected.outputs["GRID_THW"], label)
    assert int(result.as_numpy("NUM_TOKENS")[0, 0]) == int(expected.outputs["NUM_TOKENS"]), label


# -- sending -----------------------------------------------------------------------------------------


def image_input(protocol: str, data: bytes) -> Any:
    tensor = PROTOCOLS[protocol].InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
    return tensor


def burst(server: EmbeddedServer, protocol: str, model: str, payloads: list[bytes]) -> list[tuple[Any, Any]]:
    """Send all payloads at once (async); ``(result, error)`` per payload, in order."""
    module = PROTOCOLS[protocol]
    outputs = [module.InferRequestedOutput(name) for name in OUTPUTS]
    if protocol == "http":
        client = httpclient.InferenceServerClient(server.http_url, concurrency=16)
        try:
            handles = [client.async_infer(model, [image_input(protocol, d)], outputs=outputs) for d in payloads]
            answers = []
            for handle in handles:
                try:
                    answers.append((handle.get_result(), None))
                except InferenceServerException as exc:
                    answers.append((None, exc))
            return answers
        finally:
            client.close()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    try:
        for index, data in enumerate(payloads):
            client.async_infer(
                model,
                [image_input(protocol, data)],
                lambda result, error, index=index: done.put((index, result, error)),
                outputs=outputs,
            )
        answers_by_index = dict((i, (r, e)) for i, r, e in (done.get(timeout=180) for _ in payloads))
        return [answers_by_index[i] for i in range(len(payloads))]
    finally:
        client.close()


# -- metrics -----------------------------------------------------------------------------------------

METRIC_LINE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


def read_metrics(server: EmbeddedServer) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric_by(samples: list[tuple[str, dict[str, str], float]], name: str, label: str) -> Counter[str]:
    totals: Counter[str] = Counter()
    for metric, labels, value in samples:
        if metric == name and label in labels:
            totals[labels[label]] += value
    return totals


def delta(after: Counter[str], before: Counter[str]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def closed_port() -> Iterator[socket.socket]:
    """A listening socket nobody should connect to: the server must never fetch a URL it is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield sock


@pytest.fixture(scope="module")
def cases(corpus: Path, tmp_path_factory: pytest.TempPathFactory, closed_port: socket.socket) -> list[Case]:
    port = closed_port.getsockname()[1]
    return hostile_cases(corpus, tmp_path_factory.mktemp("hostile"), f"http://127.0.0.1:{port}/x.jpg")


@pytest.fixture(scope="module")
def good_images(corpus: Path) -> list[bytes]:
    return [(corpus / name).read_bytes() for name in GOOD_CORPUS]


@dataclass
class HostileRun:
    """Every burst of the module, sent by one fixture (so each test below stands alone): the four
    (model, protocol) bursts of hostile inputs next to good ones, what each answered, what the
    library says each must answer, and the server's metrics and RSS around them."""

    answers: dict[tuple[str, str], list[tuple[str, str | None, Expected, Any, Any]]]
    metrics_before: list[tuple[str, dict[str, str], float]]
    metrics_after: list[tuple[str, dict[str, str], float]]
    rss_after_first_burst: dict[str, int]
    rss_at_end: dict[str, int]
    expected_errors: Counter[str]
    expected_decodes: Counter[str]


@pytest.fixture(scope="module")
def hostile_run(triton_server: EmbeddedServer, cases: list[Case], good_images: list[bytes]) -> HostileRun:
    assert triton_server.process is not None
    metrics_before = read_metrics(triton_server)
    answers: dict[tuple[str, str], list[tuple[str, str | None, Expected, Any, Any]]] = {}
    errors: Counter[str] = Counter()
    decodes: Counter[str] = Counter()
    rss_after_first_burst: dict[str, int] = {}
    for model in sorted(ENSEMBLES):
        expected_cache: dict[bytes, Expected] = {}
        for protocol in sorted(PROTOCOLS):
            jobs: list[tuple[str, bytes, str | None]] = []
            for index, case in enumerate(cases):
                jobs.append((case.label, case.data, case.keyword))
                jobs.append((f"good image next to {case.label}", good_images[index % len(good_images)], None))
            replies = burst(triton_server, protocol, model, [data for _, data, _ in jobs])
            rows = answers[model, protocol] = []
            for (label, data, keyword), (result, error) in zip(jobs, replies, strict=True):
                expected = expected_cache.get(data) or expected_cache.setdefault(data, expect(data, ENSEMBLES[model]))
                rows.append((label, keyword, expected, result, error))
                if expected.error is not None:
                    errors[reason_for(expected.error)] += 1
                else:
                    decodes[str(expected.decode_path)] += 1
            rss_after_first_burst = rss_after_first_burst or server_rss(triton_server.process.pid)
    return HostileRun(
        answers,
        metrics_before,
        read_metrics(triton_server),
        rss_after_first_burst,
        server_rss(triton_server.process.pid),
        errors,
        decodes,
    )


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("model", sorted(ENSEMBLES))
def test_hostile_inputs_in_shared_batches(hostile_run: HostileRun, protocol: str, model: str) -> None:
    for label, keyword, expected, result, error in hostile_run.answers[model, protocol]:
        assert_outcome(f"{label} [{protocol} {model}]", expected, result, error)
        if keyword is not None:
            assert error is not None and keyword in server_message(error).lower(), (label, keyword)


def test_server_fetched_no_url(closed_port: socket.socket, hostile_run: HostileRun) -> None:
    """Nothing connected to the port whose URL was sent as image bytes."""
    with pytest.raises(BlockingIOError):
        closed_port.accept()


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("model", sorted(ENSEMBLES))
def test_malformed_requests_are_invalid_arg(
    triton_server: EmbeddedServer, good_images: list[bytes], protocol: str, model: str
) -> None:
    module = PROTOCOLS[protocol]
    client = module.InferenceServerClient(triton_server.http_url if protocol == "http" else triton_server.grpc_url)
    data = good_images[0]

    def rejected(tensor: Any) -> str:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [tensor])
        assert info.value.status() in INVALID_ARG, info.value
        return info.value.message() or ""

    try:
        int32 = module.InferInput("IMAGE_BYTES", [1, 1], "INT32")
        int32.set_data_from_numpy(np.zeros((1, 1), dtype=np.int32))
        assert "INT32" in rejected(int32)
        deep = module.InferInput("IMAGE_BYTES", [1, 1, 1], "BYTES")  # [1, K] holds K images; a third dim does not
        deep.set_data_from_numpy(np.array([[[data]]], dtype=np.object_))
        assert "shape" in rejected(deep)
        nine = module.InferInput("IMAGE_BYTES", [9, 1], "BYTES")
        nine.set_data_from_numpy(np.array([[data]] * 9, dtype=np.object_))
        assert "batch" in rejected(nine).lower()
        result = client.infer(model, [image_input(protocol, data)])  # still fine afterwards
        expected = expect(data, ENSEMBLES[model])
        assert_outcome("good after malformed", expected, result, None)
    finally:
        client.close()


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """The repository with a queue of one per model and ``max_encoded_bytes`` 20000 (vision ensembles only)."""
    from kimi_vision_server.render.repository import render_repository

    repository = render_repository(tmp_path_factory.mktemp("tight") / "model_repository", names=sorted(ENSEMBLES))
    for config in repository.glob("*/config.pbtxt"):
        text = re.sub(r"max_queue_size: \d+", "max_queue_size: 1", config.read_text())
        text = re.sub(
            r'(key: "max_encoded_bytes" value: \{ string_value: )"\d+"', rf'\1"{SMALL_MAX_ENCODED_BYTES}"', text
        )
        config.write_text(text)
    with EmbeddedServer(repository) as server:
        yield server


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_payload_over_max_encoded_bytes(tight_server: EmbeddedServer, protocol: str) -> None:
    big = jpeg_rgb(400, 300, subsampling="4:4:4")
    assert len(big) > SMALL_MAX_ENCODED_BYTES
    decoder = ImageDecoder(limits=DecodeLimits(max_encoded_bytes=SMALL_MAX_ENCODED_BYTES))
    for model, preset in ENSEMBLES.items():
        expected = expect(big, preset, decoder)
        assert expected.error is not None and "max_encoded_bytes" in str(expected.error)
        ((result, error),) = burst(tight_server, protocol, model, [big])
        assert_outcome(f"{len(big)} bytes [{protocol} {model}]", expected, result, error)


def test_full_queue_is_unavailable_and_others_succeed(tight_server: EmbeddedServer) -> None:
    """40 concurrent requests into a queue of one: some are rejected UNAVAILABLE by Triton before any
    model runs; every request that was admitted is bit-exact."""
    data = jpeg_rgb(120, 90, seed=9)
    before = read_metrics(tight_server)
    answers = burst(tight_server, "grpc", "kimi_k3_vision", [data] * 40)
    expected = expect(data, "kimi-k3")
    statuses = Counter("OK" if error is None else str(error.status()) for _, error in answers)
    unavailable = [error for _, error in answers if error is not None and error.status() in UNAVAILABLE]
    assert unavailable, statuses
    assert all("queue" in (error.message() or "").lower() for error in unavailable), unavailable[0].message()
    for result, error in answers:
        if error is None or error.status() not in UNAVAILABLE:
            assert_outcome("admitted request", expected, result, error)
    # Triton rejected them before the model ran: the model counted no errors.
    after = read_metrics(tight_server)
    name = "kimi_prep_errors_total"
    errors = delta(metric_by(after, name, "reason"), metric_by(before, name, "reason"))
    assert not errors, errors
    assert tight_server.is_ready()


def test_metrics_count_errors_by_reason_and_decodes_by_path(hostile_run: HostileRun) -> None:
    """Over the module's bursts, the server counted exactly the errors and decodes the library
    expects of them."""
    before, after = hostile_run.metrics_before, hostile_run.metrics_after
    errors = delta(
        metric_by(after, "kimi_prep_errors_total", "reason"), metric_by(before, "kimi_prep_errors_total", "reason")
    )
    decodes = delta(
        metric_by(after, "kimi_prep_decodes_total", "path"), metric_by(before, "kimi_prep_decodes_total", "path")
    )
    assert errors == {k: float(v) for k, v in hostile_run.expected_errors.items()}
    assert decodes == {k: float(v) for k, v in hostile_run.expected_decodes.items()}


def test_server_ready_and_rss_bounded(triton_server: EmbeddedServer, hostile_run: HostileRun) -> None:
    assert triton_server.is_ready()
    first, end = hostile_run.rss_after_first_burst, hostile_run.rss_at_end
    print(f"RSS after first burst: {first}\nRSS at end: {end}")
    # Three more bursts of the same inputs after the first: a per-request leak of the bombs'
    # buffers (hundreds of MB each) would show; allocator noise stays well under 100 MiB.
    assert not rss_growth_failures(first, end, 0.25, 100)
