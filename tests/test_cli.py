"""``kimi-prep``: preprocess / infer / serve / demo through ``main(argv)``.

Expected arrays are recomputed here with ``kimi_vision_prep.preprocess_bytes`` on the same files.
"""

from __future__ import annotations

import io
import json
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from make_inputs import jpeg_damaged_at_a_restart, jpeg_with_concealed_damage, png_mode
from PIL import Image

from kimi_vision_client.cli import front as cli
from kimi_vision_client.cli.samples import sample_images
from kimi_vision_prep import PreprocessError, concat_results, preprocess_bytes
from kimi_vision_server.cli import bench_local
from kimi_vision_server.host import host_layout

# A CPU rendering's pixel step is the C backend's patchify, elsewhere the Python preprocess step.
DEFAULT_KINDS = ("vision", "vision_u8", "decode", "patchify")
GOOD = ["pil__hopper.jpg", "pilx__transparent.webp", "pil__iptc.jpg", "pilx__p_trns_single.png"]
BAD = ["pilx__broken.png", "pil__truncated_jpeg.jpg"]
# Bad files interleaved with good ones: the good ones must come out unaffected and in order.
MIXED = [GOOD[0], BAD[0], GOOD[1], GOOD[2], BAD[1], GOOD[3]]


def tokens_serve_command() -> tuple[list[str], int]:
    """`kimi-prep serve --models kimi_k25_tokens` on free ports: (the command line, its HTTP port)."""
    import sys

    from kimi_vision_server.launch.embedded import free_port

    ports = [free_port() for _ in range(3)]
    command = [sys.executable, "-m", "kimi_vision_client.cli", "serve", "--models", "kimi_k25_tokens"]
    command += ["--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    return command, ports[0]


def wait_for_tokens_model(http_port: int, deadline: float) -> None:
    """Until the server on ``http_port`` says kimi_k25_tokens is ready; fails at the monotonic ``deadline``."""
    import time

    while not tokens_model_ready(http_port):
        if time.monotonic() >= deadline:
            pytest.fail("kimi-prep serve did not become ready")
        time.sleep(0.5)


def tokens_model_ready(http_port: int) -> bool:
    """Whether the server on ``http_port`` says kimi_k25_tokens is ready."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/kimi_k25_tokens/ready", timeout=2):
            return True
    except OSError:
        return False


def expected_npz(paths: list[Path], preset: str) -> dict[str, np.ndarray]:
    """The npz ``kimi-prep`` should write for ``paths``: the accepted images, in order."""
    results, names = [], []
    for path in paths:
        try:
            results.append(preprocess_bytes(path.read_bytes(), preset))
        except PreprocessError:
            continue
        names.append(str(path))
    pixel_values, grid_thws = concat_results(results)
    return {
        "pixel_values": pixel_values,
        "grid_thws": grid_thws,
        "num_tokens": np.array([r.num_tokens for r in results], dtype=np.int32),  # NUM_TOKENS' wire dtype
        "names": np.array(names),
    }


def assert_npz_equal(path: Path, expected: dict[str, np.ndarray]) -> None:
    with np.load(path) as got:
        assert sorted(got.files) == sorted(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert np.array_equal(got[key], value), key


def assert_reports(out: str, err: str, good: list[Path], bad: list[Path]) -> None:
    """One summary line per good image on stdout, one error line per bad image on stderr."""
    out_lines = out.splitlines()
    for path in good:
        assert sum(line.startswith(f"{path}: ") for line in out_lines) == 1, path
    for path in bad:
        (line,) = [line for line in err.splitlines() if line.startswith(f"{path}: error: ")]
        with pytest.raises(PreprocessError) as raised:
            preprocess_bytes(path.read_bytes())
        assert f"{type(raised.value).__name__}: {raised.value}" in line
    assert f"{len(bad)} of {len(good) + len(bad)} inputs failed" in err


# -- preprocess (in-process) ------------------------------------------------------------------


def test_preprocess_writes_good_images_and_reports_bad_ones(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [corpus / name for name in MIXED]
    out = tmp_path / "result.npz"
    code = cli.main(["preprocess", "--out", str(out), *map(str, paths)])
    captured = capsys.readouterr()
    assert code != 0
    assert_reports(captured.out, captured.err, [corpus / n for n in GOOD], [corpus / n for n in BAD])
    assert_npz_equal(out, expected_npz(paths, "kimi-k2.5"))


def test_preprocess_summary_lines_and_preset(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [corpus / name for name in GOOD]
    out = tmp_path / "k3.npz"
    assert cli.main(["preprocess", "--preset", "kimi-k3", "--out", str(out), *map(str, paths)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for path, line in zip(paths, lines, strict=True):
        result = preprocess_bytes(path.read_bytes(), "kimi-k3")
        target = result.target
        assert line.startswith(f"{path}: {target.width}x{target.height} -> {target.new_width}x{target.new_height}")
        assert f"{result.num_tokens} tokens" in line and result.decode_path in line
    assert_npz_equal(out, expected_npz(paths, "kimi-k3"))


def test_unreadable_file_is_a_per_file_error(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jpg"
    out = tmp_path / "result.npz"
    assert cli.main(["preprocess", "--out", str(out), str(missing), str(corpus / GOOD[0])]) != 0
    assert f"{missing}: error: FileNotFoundError" in capsys.readouterr().err
    assert_npz_equal(out, expected_npz([corpus / GOOD[0]], "kimi-k2.5"))


def test_directories_expand_to_their_image_files(corpus: Path, tmp_path: Path) -> None:
    (tmp_path / "nested").mkdir()
    for name, target in [(GOOD[0], "b.jpg"), (GOOD[1], "nested/a.webp"), (GOOD[2], "c.JPG")]:
        (tmp_path / target).write_bytes((corpus / name).read_bytes())
    (tmp_path / "notes.txt").write_text("not an image")
    single = corpus / GOOD[3]
    assert cli.expand_paths([tmp_path, single]) == [
        tmp_path / "b.jpg",
        tmp_path / "c.JPG",
        tmp_path / "nested" / "a.webp",
        single,
    ]


def test_serve_forwards_its_options_to_the_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kimi_vision_server.launch import command, serve
    from kimi_vision_server.render.repository import RenderOptions

    calls: list[object] = []

    def fake_serve(spec: object) -> int:
        calls.append(spec)
        return 7

    monkeypatch.setattr(serve, "serve", fake_serve)
    ports = ["--http-port", "9000", "--grpc-port", "9001", "--metrics-port", "9002", "--probe-port", "9003"]
    assert cli.main(["serve", "--model-repository", str(tmp_path), *ports]) == 7
    assert cli.main(["serve", *ports, "--instances", "3", "--threads", "1", "--kind", "cpu"]) == 7
    assert cli.main(["serve", "--all", "--preset", "kimi-k2.6"]) == 7
    assert cli.main(["serve", "--models", "kimi_k3_tokens", "kimi_k25_vision_embed"]) == 7
    given, rendered, everything_k25, chosen = calls
    assert given.ports == rendered.ports == command.Ports(9000, 9001, 9002, 9003)
    assert (given.model_repository, given.render, given.models) == (tmp_path, None, None)  # served as it is
    assert (rendered.model_repository, rendered.render) == (None, RenderOptions(3, 1, "cpu"))  # rendered afresh
    layout = host_layout()  # no flags: the host's layout
    assert everything_k25.render == RenderOptions(layout.instances, layout.threads, layout.kind)
    # The default set: the image ensembles (float32 and uint8 wire) of each served preset, with their steps.
    assert set(rendered.models) == {f"{p}_{k}" for p in ("kimi_k25", "kimi_k3") for k in DEFAULT_KINDS}
    assert all(name.startswith("kimi_k25_") or name == "kimi_patch_embed" for name in everything_k25.models)
    assert {"kimi_k25_video", "kimi_k25_tokens", "kimi_patch_embed"} <= set(everything_k25.models)
    pixel_step = "kimi_k25_patchify" if layout.kind == "cpu" else "kimi_k25_preprocess"
    assert set(chosen.models) == {"kimi_k3_tokens", "kimi_k25_vision_embed", "kimi_k25_decode", pixel_step,
                                  "kimi_patch_embed"}  # fmt: skip
    assert cli.main(["serve", "--models", "kimi_k3_tokens", "--", "--log-verbose=1", "--trace-config=rate=100"]) == 7
    assert calls[-1].extra_args == ["--log-verbose=1", "--trace-config=rate=100"]  # to tritonserver, as they are
    assert cli.main(["preprocess", "x.jpg", "--", "--log-verbose=1"]) == cli.EXIT_USAGE
    # A given repository is served as it is: render options or a selection with it are a usage error.
    assert cli.main(["serve", "--model-repository", str(tmp_path), "--instances", "2"]) == cli.EXIT_USAGE
    assert cli.main(["serve", "--model-repository", str(tmp_path), "--all"]) == cli.EXIT_USAGE
    assert cli.main(["serve", "--models", "kimi_k9_vision"]) == cli.EXIT_USAGE
    assert cli.main(["serve", "--preset", "kimi-k9"]) == cli.EXIT_USAGE


@pytest.mark.parametrize(
    ("cores", "gpus", "expected"),
    [
        (1, 0, (1, 1, "cpu")), (2, 0, (2, 1, "cpu")), (8, 0, (4, 2, "cpu")), (64, 0, (16, 2, "cpu")),
        (1, 1, (1, 1, "gpu")), (2, 1, (1, 2, "gpu")), (8, 1, (1, 4, "gpu")), (64, 1, (1, 4, "gpu")),
        (8, 8, (1, 1, "gpu")), (64, 8, (1, 4, "gpu")),
    ],
)  # fmt: skip
def test_host_layout_formula(cores: int, gpus: int, expected: tuple[int, int, str]) -> None:
    """CPU-only: instances x threads = cores (1 thread up to 4 cores, 2 above; at most 16 instances);
    GPUs: one KIND_GPU instance per GPU, the cores shared out (at most 4 threads each)."""
    layout = host_layout(cores, gpus)
    assert (layout.instances, layout.threads, layout.kind) == expected
    assert f"{cores} CPU cores, {gpus} GPUs" in layout.describe()


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "800000 100000\n"}, 8), ({"cpu.max": "150000 100000\n"}, 2), ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None),
    ],
)  # fmt: skip
def test_a_containers_cpu_limit_is_read_from_its_cgroup(
    files: dict[str, str], expected: int | None, tmp_path: Path
) -> None:
    """A Kubernetes ``limits.cpu`` (cgroup v2 or v1), rounded up to whole cores, bounds the layout's
    cores: os.cpu_count() counts the whole node."""
    from kimi_vision_server.host import available_cores, cpu_quota_cores

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota_cores(tmp_path) == expected
    assert available_cores(tmp_path) == min(len(os.sched_getaffinity(0)), expected or 10**6)


def test_render_repository_writes_the_rendering(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kimi_vision_server.render.repository import RenderOptions, repository_models

    assert cli.main(["render-repository", "--out", str(tmp_path / "r"), "--instances", "2"]) == cli.EXIT_OK
    models = repository_models(RenderOptions(instances=2))
    assert sorted(p.parent.name for p in (tmp_path / "r").glob("*/config.pbtxt")) == sorted(m.name for m in models)
    for model in models:
        assert (tmp_path / "r" / model.name / "config.pbtxt").read_text() == model.config
    assert f"rendered {len(models)} models" in capsys.readouterr().out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_infer_without_a_server_fails_once_and_clearly(
    corpus: Path, capsys: pytest.CaptureFixture[str], protocol: str
) -> None:
    from kimi_vision_server.launch.embedded import free_port

    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    code = cli.main(["infer", "--url", url, "--protocol", protocol, str(corpus / GOOD[0])])
    assert code == cli.EXIT_UNAVAILABLE
    expected = (
        f"kimi-prep: cannot connect to {url} ({protocol}): connection refused; "
        "is the server running? start one with `kimi-prep serve`"
    )
    assert capsys.readouterr().err.strip().splitlines() == [expected]


# -- against the real server --------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize(
    "case",
    [
        "http kimi_k25_vision",
        "grpc kimi_k25_vision",
        "grpc+shm kimi_k25_vision",
        "http kimi_k25_vision_u8",  # the uint8 wire: the same npz
        "grpc+shm kimi_k25_vision_u8",
        "grpc kimi_k25_vision_fused",  # decode + preprocess in one model: the same npz
        "grpc+shm kimi_k25_vision_fused",
    ],
)
def test_infer_equals_preprocess(
    triton_server: object, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    mode, model = case.split()
    protocol, _, shm = mode.partition("+")
    paths = [corpus / name for name in MIXED]
    out = tmp_path / "infer.npz"
    url = getattr(triton_server, f"{protocol}_url")
    argv = ["infer", "--url", url, "--protocol", protocol, "--model", model, "--concurrency", "2", "--out", str(out)]
    code = cli.main([*argv, *(["--shm"] if shm else []), *map(str, paths)])
    captured = capsys.readouterr()
    assert code != 0
    assert_reports(captured.out, captured.err, [corpus / n for n in GOOD], [corpus / n for n in BAD])
    assert_npz_equal(out, expected_npz(paths, "kimi-k2.5"))


@pytest.mark.server
def test_infer_u8_k3_equals_preprocess(triton_server: Any, corpus: Path, tmp_path: Path) -> None:
    """``--model kimi_k3_vision_u8``: chessboard-composited K3 results through the uint8 wire."""
    paths = [corpus / name for name in GOOD]
    out = tmp_path / "k3.npz"
    argv = ["infer", "--url", triton_server.grpc_url, "--model", "kimi_k3_vision_u8", "--quiet"]
    assert cli.main([*argv, "--out", str(out), *map(str, paths)]) == cli.EXIT_OK
    assert_npz_equal(out, expected_npz(paths, "kimi-k3"))


@pytest.mark.server
def test_demo_round_trips_the_samples_over_both_protocols(
    triton_server: object, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo starts its own server; the fixture only guarantees a tritonserver is available.
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    for protocol in ("http", "grpc"):
        for name, data in sample_images().items():
            result = preprocess_bytes(data)
            (line,) = [line for line in out.splitlines() if line.startswith(f"[{protocol}] {name}: ")]
            assert f"grid {'x'.join(map(str, result.grid_thw))}, {result.num_tokens} tokens" in line


def video_npz(path: Path, preset: str) -> dict[str, np.ndarray]:
    """The npz entries of a video: its chunks as tests/reference.py computes them."""
    import reference

    chunks = reference.reference_video(path.read_bytes(), preset)
    return {
        "pixel_values": np.concatenate([c.pixel_values for c in chunks]),
        "grid_thws": np.stack([c.grid_thw for c in chunks]),
        "num_tokens": np.array([c.num_tokens for c in chunks], dtype=np.int32),
        "names": np.array([f"{path} [chunk {i}]" for i in range(len(chunks))], dtype=np.str_),
    }


def test_preprocess_takes_videos_by_content(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    video = tmp_path / "clip.bin"  # no telling suffix: told apart by content
    video.write_bytes((corpus / "video" / "torchcodec__av1_video.mkv").read_bytes())
    out = tmp_path / "video.npz"
    assert cli.main(["preprocess", "--preset", "kimi-k2.5", "--quiet", "--out", str(out), str(video)]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"{video} [chunk {i}]" for i in range(3)]
    assert "at 00:00:02.200, frames 55,69,83,96" in lines[1]
    assert_npz_equal(out, video_npz(video, "kimi-k2.5"))


@pytest.mark.server
def test_infer_sends_several_images_per_request_and_streams_videos(
    triton_server: Any, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [corpus / name for name in GOOD]
    out = tmp_path / "grouped.npz"
    argv = ["infer", "--url", triton_server.grpc_url, "--images-per-request", "3", "--quiet", "--out", str(out)]
    assert cli.main([*argv, *map(str, paths)]) == cli.EXIT_OK
    assert_npz_equal(out, expected_npz(paths, "kimi-k2.5"))
    video = corpus / "video" / "torchcodec__h265_video.mp4"
    out = tmp_path / "video.npz"
    argv = ["infer", "--url", triton_server.grpc_url, "--model", "kimi_k3_vision", "--quiet", "--out", str(out)]
    assert cli.main([*argv, str(video)]) == cli.EXIT_OK
    assert_npz_equal(out, video_npz(video, "kimi-k3"))
    capsys.readouterr()


def test_preprocess_on_a_cpu_host_prints_no_codec_errors(corpus: Path, tmp_path: Path) -> None:
    """On a host without GPUs nvImageCodec loads only its CPU extensions: no red "Failed to load"
    lines from the GPU ones (host.codec_env); the fast path is still nvImageCodec's."""
    import os
    import re
    import subprocess
    import sys

    from kimi_vision_server.host import cuda_device_count

    if cuda_device_count():
        pytest.skip("a GPU host loads every extension")
    env = {k: v for k, v in os.environ.items() if k != "NVIMGCODEC_EXTENSIONS_PATH"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    # A clean JPEG (libjpeg) and one libjpeg's strict mode refuses (nvImageCodec's CPU backend).
    refused = tmp_path / "cut-restart-interval.jpg"
    refused.write_bytes(jpeg_damaged_at_a_restart("cut"))
    files = [str(corpus / GOOD[0]), str(refused)]
    command = [sys.executable, "-m", "kimi_vision_client.cli", "preprocess", *files]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert not re.search(r"\[ERROR\]|Failed to load nv|Traceback", done.stdout + done.stderr), done.stderr
    assert "libjpeg" in done.stdout and "nvimgcodec-cpu" in done.stdout
    links = sorted(p.name for p in (tmp_path / "kimi_vision_prep" / "nvimgcodec-cpu").iterdir())
    assert any(name.startswith("libjpeg_turbo_ext") for name in links)
    assert not any(name.startswith(("libnvjpeg", "libnvtiff")) for name in links)


@pytest.mark.server
def test_serve_on_a_cpu_host_is_quiet(triton_server: Any) -> None:
    """`kimi-prep serve`: no error-looking line on a healthy CPU-only start and shutdown (the CUDA
    lines tritonserver cannot avoid are dropped by an explicit list, said once), and it serves."""
    import re
    import signal
    import subprocess
    import time

    from kimi_vision_server.host import cuda_device_count

    if cuda_device_count():
        pytest.skip("GPU host")
    command, http_port = tokens_serve_command()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_tokens_model(http_port, time.monotonic() + 240)
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
    noisy = [
        line
        for line in output.splitlines()
        if re.search(r"\[ERROR\]|^E\d{4} |Traceback|Failed to initialize NVML|Failed to load nv", line)
    ]
    assert not noisy, noisy
    assert output.count("CPU-only host: CUDA and pinned memory disabled") == 1
    assert "stub exit seen" not in output  # a shutdown on purpose is not reported as stub deaths


@pytest.mark.server
def test_serve_starts_its_tritonserver_again_when_it_dies(triton_server: Any) -> None:
    """docs/faults.md: a tritonserver that dies (here SIGKILL; the Python backend can abort it when a
    stub dies holding a shared-memory lock) is started again by `kimi-prep serve`, which says so
    and serves on; a SIGINT then stops it cleanly (0)."""
    import signal
    import subprocess
    import time

    command, http_port = tokens_serve_command()

    def tritonservers() -> list[int]:
        """The launcher's tritonserver children (the watchdog's thread starts the later ones)."""
        tasks = Path(f"/proc/{process.pid}/task").iterdir()
        children = [pid for task in tasks for pid in (task / "children").read_text().split()]
        return [int(pid) for pid in children if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"]

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        wait_for_tokens_model(http_port, deadline)
        (first,) = tritonservers()
        os.kill(first, signal.SIGKILL)

        def served_again() -> bool:
            return tritonservers() not in ([], [first]) and tokens_model_ready(http_port)

        while not served_again() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served_again(), "no new tritonserver served"
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    assert f"tritonserver (pid {first}) exited by itself (killed by SIGKILL (9)); starting it again" in output


@pytest.mark.server
def test_installed_wheels_serve_without_a_checkout(triton_server: Any, tmp_path: Path) -> None:
    """The library's and the server's wheels, installed on their own (no checkout), from another
    folder: `kimi-prep demo` renders its repository from the presets, serves, and checks the
    results bit for bit."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    pip = [sys.executable, "-m", "pip", "-q"]
    for source in (root, root / "backend_src" / "server"):
        subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                       check=True, capture_output=True, timeout=600)  # fmt: skip
    wheels = sorted(map(str, (tmp_path / "dist").glob("*.whl")))
    assert [Path(w).name.split("-")[0] for w in wheels] == ["kimi_vision_prep", "kimi_vision_server"]
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), *wheels],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", "import kimi_vision_prep as p, kimi_vision_server as s, sys; "
         "from kimi_vision_client import cli; print(p.__file__, s.__file__, file=sys.stderr); "
         "sys.exit(cli.main(['demo']))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    library, server = done.stderr.splitlines()[0].split()
    assert library.startswith(str(tmp_path / "site")) and server.startswith(str(tmp_path / "site"))  # not the checkout
    assert "all results bit-equal to in-process preprocessing" in done.stderr


def test_perf_data_is_perf_analyzers_bytes_format(corpus: Path, tmp_path: Path) -> None:
    """``{"content": {"b64": base64(4-byte LE length + bytes)}, "shape": [1]}`` per request, in order."""
    import base64
    import json
    import struct

    paths = [corpus / name for name in GOOD[:3]]
    out = tmp_path / "data.json"
    assert cli.main(["perf-data", "-o", str(out), *map(str, paths)]) == cli.EXIT_OK
    requests = json.loads(out.read_text())["data"]
    assert len(requests) == len(paths)
    for path, request in zip(paths, requests, strict=True):
        tensor = request["IMAGE_BYTES"]
        raw = base64.b64decode(tensor["content"]["b64"])
        (length,) = struct.unpack("<I", raw[:4])
        assert tensor["shape"] == [1] and raw[4:] == path.read_bytes() and length == len(raw) - 4


def test_bench_local_writes_every_timing_json_and_plot(corpus: Path, tmp_path: Path) -> None:
    """`kimi-prep bench-local` on two corpus photos: every image timed four ways (interleaved; no
    reference processor is given to the installed command), the class summary, the batch and
    profile figures, JSON and PNG written. No timing is asserted."""
    images = [corpus / "pil__iptc.jpg", corpus / "imagers__large_image.jpg"]
    argv = ["bench-local", "--repeats", "2", "--out-dir", str(tmp_path), "--images", *map(str, images)]
    assert cli.main(argv) == cli.EXIT_OK
    result = json.loads((tmp_path / "bench_local.json").read_text())
    assert (tmp_path / "bench_local.png").stat().st_size > 0
    assert [row["image"]["image_class"] for row in result["rows"]] == ["no-resize", "downscale"]
    for row in result["rows"]:
        for way in ("ours", "floor", "decode", "pillow_decode"):
            assert 0 < row[way]["min_ms"] <= row[way]["median_ms"], (way, row[way])
        assert "reference" not in row
    assert {"all", "no-resize", "downscale", "batch"} <= set(result["summary"])
    assert {"ours_over_floor", "ours_over_decode", "decode_over_floor"} <= set(result["summary"]["all"])
    batch = result["summary"]["batch"]
    assert len(batch["round_ratios"]) == bench_local.BATCH_ROUNDS and min(batch["round_ratios"]) > 0  # one per round
    assert batch["default_over_single_thread"] == statistics.median(batch["round_ratios"])  # the paired figure
    assert len(batch["ceiling_round_ratios"]) == bench_local.BATCH_ROUNDS and min(batch["ceiling_round_ratios"]) > 0
    assert {p["size"] for p in result["profile"]} == {"1080p", "9 MP", "12 MP"}


def test_bench_floor_is_the_one_exact_decoder_that_takes_the_file(corpus: Path) -> None:
    """The floor of a clean JPEG is simplejpeg; of one its strict mode refuses but the libjpeg
    route takes on one thread (bytes skipped before a marker; damage libjpeg conceals, tolerant),
    that route alone, not a refused simplejpeg attempt and then it; of another format, Pillow.
    Each gives Pillow's RGB pixels."""
    names = ("imagers__extraneous-bytes-after-sos.jpg", "pil__iptc.jpg")
    sources = [(name, (corpus / name).read_bytes()) for name in names]
    sources += [("stray marker", jpeg_with_concealed_damage("stray marker")), ("png", png_mode(64, 48, "RGB"))]
    images = bench_local.bench_images("kimi-k2.5", sources)
    assert [im.floor for im in images] == ["libjpeg", "simplejpeg", "libjpeg", "pillow"]
    for im in images:
        expected = np.asarray(Image.open(io.BytesIO(im.data)).convert("RGB"))
        np.testing.assert_array_equal(bench_local.fastest_exact_decode(im), expected)


def test_timed_rounds_gives_each_rounds_rate_and_cpu_per_image(corpus: Path) -> None:
    """bench-local's threaded rounds: one (img/s, CPU ms per image) per round, after a warm-up round."""
    images = bench_local.bench_images("kimi-k2.5", [(p.name, p.read_bytes()) for p in (corpus / "pil__iptc.jpg",)])
    rounds = bench_local.timed_rounds(images, "kimi-k2.5", 2, 2, output="pixel_patches")
    assert len(rounds) == 2 and all(rate > 0 and cpu_ms > 0 for rate, cpu_ms in rounds)
