"""Test inputs: the manifest of the test corpus (``tests/data/corpus``), and synthetic images
generated deterministically with Pillow (and ``cjpeg`` where present).

Synthetic content has sharp colour edges, gradients and noise, so chroma upsampling, resampling and
alpha handling all show up in the pixels. (The corpus helpers live here rather than being imported
from ``conftest``: with several conftest.py files, ``import conftest`` may find the wrong one.)
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Iterable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

CJPEG = shutil.which("cjpeg")
CORPUS = Path(__file__).resolve().parent / "data" / "corpus"


def pillow_resize(pixels: np.ndarray, new_width: int, new_height: int, resample: str) -> np.ndarray:
    """uint8 ``(H, W, 3|4)`` resized by Pillow itself (the reference): ``Image.resize`` in RGB/RGBA."""
    mode = {3: "RGB", 4: "RGBA"}[pixels.shape[2]]
    filters = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}
    image = Image.fromarray(np.ascontiguousarray(pixels), mode)
    return np.asarray(image.resize((new_width, new_height), filters[resample]))


def corpus_manifest() -> dict[str, dict[str, str]]:
    """Rows of ``tests/data/corpus/MANIFEST.tsv`` by file name."""
    path = CORPUS / "MANIFEST.tsv"
    with path.open(newline="") as f:
        return {row["filename"]: row for row in csv.DictReader(f, delimiter="\t")}


def corpus_names(accepted: bool) -> list[str]:
    """Corpus files whose manifest ``pil_load`` is ``ok`` (accepted) or anything else (rejected)."""
    return [name for name, row in corpus_manifest().items() if (row["pil_load"] == "ok") == accepted]


def rgb_pattern(width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 (H, W, 3): colour blocks with hard edges, a gradient and some noise."""
    rng = np.random.default_rng(seed)
    ys = np.arange(height, dtype=np.int32)[:, None]
    xs = np.arange(width, dtype=np.int32)[None, :]
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[:, :, 0] = ((xs // 5 + ys // 3) % 4) * 60
    out[:, :, 1] = xs * 255 // max(1, width - 1) // 2 + ((ys // 4) % 2) * 80
    out[:, :, 2] = ((xs // 7) % 2) * 190 + ((ys // 9) % 3) * 10
    out += rng.integers(0, 40, size=(height, width, 3), dtype=np.uint8)
    return out


def alpha_pattern(width: int, height: int, seed: int = 1) -> np.ndarray:
    """uint8 (H, W): fully transparent, fully opaque and partial regions."""
    rng = np.random.default_rng(seed)
    ys = np.arange(height, dtype=np.int32)[:, None]
    xs = np.arange(width, dtype=np.int32)[None, :]
    alpha = ((xs * 7 + ys * 3) % 256).astype(np.uint8)
    alpha[:, (xs[0] // 6) % 3 == 0] = 0
    alpha[(ys[:, 0] // 5) % 4 == 1, :] = 255
    speckle = rng.random((height, width)) < 0.05
    alpha[speckle] = rng.integers(0, 256, size=int(speckle.sum()), dtype=np.uint8)
    return alpha


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def jpeg_rgb(width: int, height: int, subsampling: str = "4:2:0", progressive: bool = False, seed: int = 0) -> bytes:
    image = Image.fromarray(rgb_pattern(width, height, seed), "RGB")
    return encode(image, "JPEG", quality=90, subsampling=subsampling, progressive=progressive)


def jpeg_with_restarts(width: int, height: int, mode: str = "RGB", subsampling: str = "4:2:0", rows: int = 0) -> bytes:
    """A JPEG (``mode`` RGB or L) with a restart marker after every ``rows`` MCU rows, or every 4
    MCUs when ``rows`` is 0."""
    image = Image.fromarray(rgb_pattern(width, height), "RGB").convert(mode)
    every = {"restart_marker_rows": rows} if rows else {"restart_marker_blocks": 4}
    return encode(image, "JPEG", quality=90, subsampling=subsampling, **every)


def restart_offsets(data: bytes) -> list[int]:
    """Offsets of the restart markers (FFD0-FFD7) in a single-scan JPEG's entropy-coded data."""
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    return [k for k in range(start, len(data) - 1) if data[k] == 0xFF and 0xD0 <= data[k + 1] <= 0xD7]


def jpeg_damaged_at_a_restart(damage: str) -> bytes:
    """:func:`jpeg_with_restarts` damaged in its third restart interval, as libjpeg meets files:
    ``junk``: 3 bytes between the interval's data and its restart marker; ``garbled``: a byte in
    the middle of the interval changed, so its MCUs decode as other codes that end before its
    data does (libjpeg skips the rest up to the marker); ``cut``: the interval's last 8 bytes
    gone, so its MCUs run into the marker (libjpeg warns "premature end of data segment")."""
    data = jpeg_with_restarts(200, 120)
    before, after = restart_offsets(data)[1:3]
    if damage == "junk":
        return data[:after] + b"\x12\x34\x56" + data[after:]
    if damage == "garbled":
        middle = (before + after) // 2
        changed = data[middle] ^ 0x5A
        assert 0xFF not in (data[middle], data[middle - 1], changed)
        return data[:middle] + bytes([changed]) + data[middle + 1 :]
    if damage == "cut":
        return data[: after - 8] + data[after:]
    raise ValueError(damage)


CONCEALED_DAMAGE = ("stray marker", "interval missing", "interval repeated", "junk between segments")


def jpeg_with_concealed_damage(damage: str, mode: str = "RGB", subsampling: str = "4:2:0") -> bytes:
    """:func:`jpeg_with_restarts` (every 4 MCUs) with damage libjpeg decodes past with a warning
    and the structural scan does not call clean: ``stray marker``: FF 9F in the middle of the third
    restart interval (libjpeg fills the rest of it with grey, then resynchronises at the next
    restart marker); ``interval missing`` / ``interval repeated``: the third interval and its
    marker gone / twice (restart markers out of sequence); ``junk between segments``: 3 bytes
    before the SOS segment (skipped)."""
    data = jpeg_with_restarts(200, 120, mode, subsampling)
    before, after = restart_offsets(data)[1:3]
    if damage == "stray marker":
        middle = (before + after) // 2
        while 0xFF in data[middle - 1 : middle + 1]:
            middle += 1
        return data[:middle] + b"\xff\x9f" + data[middle:]
    if damage == "interval missing":
        return data[: before + 2] + data[after + 2 :]
    if damage == "interval repeated":
        return data[: after + 2] + data[before + 2 : after + 2] + data[after + 2 :]
    if damage == "junk between segments":
        sos = data.index(b"\xff\xda")
        return data[:sos] + b"\x12\x34\x56" + data[sos:]
    raise ValueError(damage)


def with_comment(data: bytes, text: bytes) -> bytes:
    """``data`` (a JPEG) with a COM segment holding ``text`` right after SOI: other bytes, the same
    pixels (a repeat made unique, or two requests no cache may take for one another)."""
    return data[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + data[2:]


def jpeg_grey(width: int, height: int, progressive: bool = False) -> bytes:
    image = Image.fromarray(rgb_pattern(width, height), "RGB").convert("L")
    return encode(image, "JPEG", quality=90, progressive=progressive)


def jpeg_cmyk(width: int, height: int) -> bytes:
    image = Image.fromarray(rgb_pattern(width, height), "RGB").convert("CMYK")
    return encode(image, "JPEG", quality=90)


def jpeg_with_orientation(width: int, height: int, orientation: int) -> bytes:
    image = Image.fromarray(rgb_pattern(width, height), "RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", quality=90, exif=exif.tobytes())


def cjpeg_rgb(width: int, height: int, sample: str, restart_rows: int = 0) -> bytes:
    """A JPEG written by libjpeg-turbo's ``cjpeg -sample`` (e.g. ``1x2`` = 4:4:0, ``4x1`` = 4:1:1),
    with a restart marker every ``restart_rows`` MCU rows where that is not 0."""
    if CJPEG is None:
        raise RuntimeError("cjpeg is not on PATH (Debian: apt-get install libjpeg-turbo-progs)")
    restart = ["-restart", str(restart_rows)] if restart_rows else []
    with tempfile.TemporaryDirectory() as tmp:
        ppm = Path(tmp) / "in.ppm"
        Image.fromarray(rgb_pattern(width, height), "RGB").save(ppm)
        command = [CJPEG, "-quality", "90", "-sample", sample, *restart, str(ppm)]
        done = subprocess.run(command, capture_output=True, check=True, timeout=30)
    return done.stdout


def png_mode(width: int, height: int, mode: str) -> bytes:
    """A PNG in ``mode``: RGB, RGBA, LA, L, 1, P, or "P+trns" (palette with transparent entries)."""
    rgb = Image.fromarray(rgb_pattern(width, height), "RGB")
    alpha = Image.fromarray(alpha_pattern(width, height), "L")
    if mode == "RGBA":
        image = rgb.copy()
        image.putalpha(alpha)
        return encode(image, "PNG")
    if mode == "LA":
        image = rgb.convert("L")
        image.putalpha(alpha)
        return encode(image.convert("LA"), "PNG")
    if mode == "P":
        return encode(rgb.quantize(64), "PNG")
    if mode == "P+trns":
        pal = rgb.quantize(64)
        # Palette entries 0..63: the first few are fully transparent, a few are partial.
        trns = bytes([0, 0, 0, 64, 128, 200] + [255] * 58)
        return encode(pal, "PNG", transparency=trns)
    if mode == "L+trns":
        grey = rgb.convert("L")
        return encode(grey, "PNG", transparency=int(np.asarray(grey)[0, 0]))
    return encode(rgb.convert(mode), "PNG")


def gif_transparent(width: int, height: int) -> bytes:
    pal = Image.fromarray(rgb_pattern(width, height), "RGB").quantize(32)
    return encode(pal, "GIF", transparency=3)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature + IHDR claiming ``width x height`` RGB, with a tiny IDAT and IEND."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def jpeg_with_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` (a JPEG) with its SOF frame header rewritten to claim ``width x height``."""
    buf = bytearray(data)
    pos = 2
    while pos + 4 <= len(buf):
        assert buf[pos] == 0xFF, "not at a marker"
        marker = buf[pos + 1]
        length = struct.unpack(">H", bytes(buf[pos + 2 : pos + 4]))[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            buf[pos + 5 : pos + 9] = struct.pack(">HH", height, width)
            return bytes(buf)
        pos += 2 + length
    raise ValueError("no SOF marker found")


def animated(width: int, height: int, fmt: str) -> bytes:
    """A 3-frame animation (GIF or APNG) whose frames differ; only the first counts (spec 2)."""
    frames = [Image.fromarray(rgb_pattern(width, height, seed), "RGB") for seed in range(3)]
    if fmt == "GIF":
        frames = [frame.quantize(64) for frame in frames]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)


def photo_frames(name: str, width: int, height: int, count: int) -> list[np.ndarray]:
    """``count`` RGB frames ``(height, width, 3)`` panning across a corpus photo (real content)."""
    return list(iter_photo_frames(name, width, height, count))


def iter_photo_frames(name: str, width: int, height: int, count: int) -> Iterator[np.ndarray]:
    """:func:`photo_frames` one at a time (long clips without holding every frame)."""
    with Image.open(CORPUS / name) as image:
        photo = np.asarray(image.convert("RGB").resize((width + count, height + count // 2 + 1)))
    for i in range(count):
        yield np.ascontiguousarray(photo[i // 2 : i // 2 + height, i : i + width])


def encode_clip(  # noqa: PLR0917
    frames: Iterable[np.ndarray],
    fps: object,
    codec: str = "libx264",
    container: str = "mp4",
    pix_fmt: str = "yuv420p",
    options: dict[str, str] | None = None,
    milliseconds: Sequence[int] | None = None,
) -> bytes:
    """Frames encoded with PyAV (``fps``: an int or a Fraction such as 30000/1001); with
    ``milliseconds``, each frame shown at its own time (a variable frame rate)."""
    import av

    buffer = io.BytesIO()
    frames = iter(frames)
    first = next(frames)
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=fps, options=options or {})
        stream.height, stream.width = first.shape[:2]
        stream.pix_fmt = pix_fmt
        if milliseconds is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for i, pixels in enumerate(itertools.chain([first], frames)):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if milliseconds is not None:
                frame.pts, frame.time_base = milliseconds[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def video_clips() -> dict[str, bytes]:
    """Clips encoded here from a corpus photo: frame rates (29.97, 25, 1000), one frame, portrait,
    sizes that need a resize under K2.5 and not under K3, VP9/WebM, MPEG-4/MKV, several chunks
    with a short last one; plus the corpus's three real clips."""

    photo = "pil__xmp_test.jpg"
    encoded = {
        "h264_29.97fps_320x240.mp4": encode_clip(photo_frames(photo, 320, 240, 40), Fraction(30000, 1001)),
        "h264_25fps_1280x720.mp4": encode_clip(photo_frames(photo, 1280, 720, 30), 25),
        "mpeg4_1000fps_64x48.mkv": encode_clip(photo_frames(photo, 64, 48, 200), 1000, "mpeg4", "matroska"),
        "vp9_single_frame.webm": encode_clip(photo_frames(photo, 200, 150, 1), 25, "libvpx-vp9", "webm"),
        "vp9_portrait_180x320.webm": encode_clip(photo_frames(photo, 180, 320, 24), 24, "libvpx-vp9", "webm"),
    }
    real = ("torchcodec__av1_video.mkv", "torchcodec__h264_10bits.mp4", "torchcodec__h265_video.mp4")
    return {**encoded, **{name: (CORPUS / "video" / name).read_bytes() for name in real}}



# The longest a `kimi-prep serve` may take to be ready before a test gives up (a failsafe, not a bound).
SERVE_START_BUDGET_S = 300.0


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 (a readiness endpoint)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def wait_until_ready(process: subprocess.Popen, ready_url: str) -> None:
    """Until ``ready_url`` answers; an AssertionError where ``process`` exits first or
    :data:`SERVE_START_BUDGET_S` passes."""
    give_up = time.monotonic() + SERVE_START_BUDGET_S
    while not answers(ready_url):
        assert process.poll() is None, "kimi-prep serve exited before it was ready"
        assert time.monotonic() < give_up, "kimi-prep serve did not become ready"
        time.sleep(0.5)


def children(parent: int, name: str) -> list[int]:
    """The processes called ``name`` (their first 15 characters, as the kernel keeps them) whose
    parent is ``parent``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            command, parent_pid = fields[0].split("(", 1)[1], int(fields[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent_pid == parent and command == name[:15]:
            found.append(int(stat.parent.name))
    return found


class ServeProcess:
    """``kimi-prep serve *args`` on free ports of a loopback ``host`` (``grpc_port``: that one), in
    its own process group, so that a test can kill it whole (launcher, tritonserver, stubs) and start
    it again on the same ports. ``kimi_prep``: the command that runs the CLI (default: this
    interpreter's)."""

    def __init__(
        self,
        *args: str,
        kimi_prep: Sequence[str] = (sys.executable, "-m", "kimi_vision_client.cli"),
        host: str = "127.0.0.1",
        grpc_port: int | None = None,
    ) -> None:
        self.kimi_prep = list(kimi_prep)
        self.args = list(args)
        self.host = host
        self.ports = [free_loopback_port(), grpc_port or free_loopback_port(), free_loopback_port()]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports[1]}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports[2]}/metrics"

    def launch(self) -> None:
        """Start it without waiting (:meth:`wait_ready` waits)."""
        command = [*self.kimi_prep, "serve", *self.args]
        command += ["--host", self.host, "--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1])]
        command += ["--metrics-port", str(self.ports[2])]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def wait_ready(self) -> None:
        assert self.process is not None
        wait_until_ready(self.process, f"http://{self.host}:{self.ports[0]}/v2/health/ready")

    def tritonserver_pid(self) -> int:
        """The launcher's tritonserver child (the leader of its own process group, with its stubs)."""
        assert self.process is not None
        (pid,) = children(self.process.pid, "tritonserver")
        return pid

    def counter(self, name: str, model: str) -> int:
        """A per-model counter of tritonserver's metrics (0 where the model has none yet)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        found = re.search(rf'^{name}{{model="{model}",version="1"}} (\S+)', text, re.M)
        return int(float(found[1])) if found else 0

    def kill(self) -> None:
        """SIGKILL to tritonserver's process group (it and its stubs) and the launcher's: the way a
        machine or a pod dies, no shutdown."""
        assert self.process is not None
        for pid in children(self.process.pid, "tritonserver"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def kimi_prep_serve(kimi_prep: Sequence[str], *args: str) -> Iterator[tuple[int, int]]:
    """``kimi_prep serve *args`` on free loopback ports (``kimi_prep``: the command that runs the
    CLI), ready: (HTTP port, gRPC port); stopped at the end."""
    server = ServeProcess(*args, kimi_prep=kimi_prep)
    server.start()
    try:
        yield server.ports[0], server.ports[1]
    finally:
        server.stop()


@contextlib.contextmanager
def served(*args: str) -> Iterator[ServeProcess]:
    """``kimi-prep serve *args`` (this interpreter's) on free loopback ports, ready; stopped after.
    The calling test is skipped where no tritonserver can be found."""
    require_tritonserver()
    server = ServeProcess(*args)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def require_tritonserver() -> None:
    """Skip the calling test or fixture where no tritonserver can be found (not on PATH, no
    nvidia-pytriton): the serving tests need a real one."""
    import pytest

    from kimi_vision_server.triton_install import find_tritonserver

    try:
        find_tritonserver()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def planned_clips(width: int = 320, height: int = 240, seconds: int = 6) -> dict[str, bytes]:
    """Clips whose frames refer to others in every way a sampled decode must respect: B-frames
    (pyramid), short and open GOPs, a variable frame rate, MPEG-4 and MPEG-2 B-frames, HEVC; H.264
    length-prefixed (MP4, MKV) and with start codes (MPEG-TS)."""
    photo, fps = "pil__xmp_test.jpg", 25
    count = seconds * fps

    def frames() -> Iterator[np.ndarray]:
        return iter_photo_frames(photo, width, height, count)

    x264 = "keyint={keyint}:min-keyint={keyint}:scenecut=0:bframes=3:b-pyramid=normal:open-gop={open}"
    steps = [40, 40, 40, 120, 40, 20, 20, 80]  # ms between frames: 12.5 to 50 fps
    shown = list(itertools.accumulate(steps[i % len(steps)] for i in range(count)))
    return {
        "h264_bpyramid_keyint250.mp4": encode_clip(
            frames(), fps, options={"x264-params": x264.format(keyint=250, open=0)}
        ),
        "h264_open_gop_keyint20.mkv": encode_clip(
            frames(), fps, container="matroska", options={"x264-params": x264.format(keyint=20, open=1)}
        ),
        "h264_vfr.mp4": encode_clip(frames(), fps, options={"bf": "2"}, milliseconds=shown),
        "h264_annexb.ts": encode_clip(
            frames(), fps, container="mpegts", options={"x264-params": x264.format(keyint=50, open=0)}
        ),
        "mpeg4_bframes_gop12.mkv": encode_clip(frames(), fps, "mpeg4", "matroska", options={"bf": "2", "g": "12"}),
        "mpeg2_bframes_gop15.mkv": encode_clip(frames(), fps, "mpeg2video", "matroska", options={"bf": "2", "g": "15"}),
        "hevc_bframes_keyint30.mp4": encode_clip(
            frames(), fps, "libx265", options={"x265-params": "keyint=30:bframes=4:log-level=error"}
        ),
    }
