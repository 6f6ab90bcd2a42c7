"""Every message says what happened and what to do, and exits with the code the docs give.

In process: decode failures in words, what non-image bytes are, counts as request errors, help
that shows every default. Against real servers: a model that is not served names the flag that
serves it (exit 3), a refused connection says so, a failed image of a group does not fail the
others, folders are walked, a start is quiet and ends in one ready line, a model that fails to
load is named while the others serve.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from make_inputs import encode_clip, photo_frames, png_header_only, require_tritonserver

import kimi_vision_prep as kvp
from kimi_vision_client.cli import front as cli
from kimi_vision_client.client import KimiVisionClient
from kimi_vision_common.errors import InvalidImageError, InvalidRequestError, ModelNotServedError
from kimi_vision_server import triton_install
from kimi_vision_server.launch.embedded import EmbeddedServer, free_port

HOPPER = "pil__hopper.jpg"
READY_LINE_WAIT_S = 600  # a guard against a hang, not a bound on the start


def error_of(data: bytes) -> str:
    with pytest.raises(InvalidImageError) as info:
        kvp.preprocess_bytes(data)
    return str(info.value)


# -- in process ----------------------------------------------------------------------------------


def test_a_truncated_jpeg_says_truncated(corpus: Path) -> None:
    data = (corpus / HOPPER).read_bytes()
    assert error_of(data[: len(data) // 2]).startswith("truncated image: the file ends early")


def test_a_header_without_pixels_says_truncated_and_warns_nothing() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        message = error_of(png_header_only(12000, 12000))
    assert message.startswith("truncated image:")
    assert not caught, [str(w.message) for w in caught]


def test_non_image_bytes_are_named(tmp_path: Path) -> None:
    clip = encode_clip(photo_frames("pil__xmp_test.jpg", 64, 48, 4), 25)
    assert "these bytes are a video" in error_of(clip[: len(clip) // 2])  # truncated MP4 too
    assert "these bytes are a data: URL" in error_of(b"data:image/jpeg;base64,/9j/4AAQSkZJRg==")
    assert "these bytes are a URL" in error_of(b"https://example.com/photo.jpg")
    assert "these bytes are a file path" in error_of(str(tmp_path / "photo.jpg").encode())


def test_too_many_images_is_a_request_error_not_a_size(corpus: Path) -> None:
    data = (corpus / HOPPER).read_bytes()
    with pytest.raises(InvalidRequestError, match=r"17 images in one request: at most 16"):
        kvp.preprocess_images([data] * 17)


def help_texts() -> list[tuple[str, str, str]]:
    """``(command, option, help as printed)`` of every option of every kimi-prep command that takes a
    value and is not required (flags say what they turn on; a required option has no default)."""
    import argparse

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    found = []
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and action.nargs != 0 and not action.required:
                text = formatter._get_help_string(action) % {"default": action.default}  # type: ignore[attr-defined]
                found.append((name, action.option_strings[-1], " ".join(text.split())))
    return found


def test_help_shows_every_default_once() -> None:
    texts = help_texts()
    assert {name for name, _, _ in texts} >= {"infer", "bench", "serve", "render-repository", "preprocess"}
    wrong = [(name, option, text) for name, option, text in texts if text.lower().count("default") != 1]
    assert not wrong
    shown = {(name, option): text for name, option, text in texts}
    assert "(default: 8000)" in shown["serve", "--http-port"]
    assert "(default: 1)" in shown["render-repository", "--instances"]
    assert "(default: 1,2,4,8)" in shown["bench", "--concurrency"]
    assert "model_repository/" not in shown["serve", "--model-repository"]


def test_images_per_request_over_the_limit_is_refused_up_front(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["infer", "--images-per-request", "17", "x.jpg"])
    assert info.value.code == cli.EXIT_USAGE
    assert "at most 16 images per request" in capsys.readouterr().err


def test_connection_refused_says_so(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"127.0.0.1:{free_port()}"
    assert cli.main(["infer", "--url", url, str(corpus / HOPPER)]) == cli.EXIT_UNAVAILABLE
    assert "connection refused; is the server running?" in capsys.readouterr().err


def test_unused_backend_layouts_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layouts = tmp_path / "triton"
    current, old = layouts / "py3.11-aaaa", layouts / "py3.11-bbbb"
    for folder in (current, old):
        (folder / "backends").mkdir(parents=True)
    stale = time.time() - 2 * triton_install.LAYOUT_GRACE_S
    os.utime(old, (stale, stale))
    assert triton_install.remove_unused_layouts(current) == [old]
    assert current.exists() and not old.exists()


# -- against a server that serves the image ensemble only -----------------------------------------


@pytest.fixture(scope="module")
def vision_only() -> Any:
    require_tritonserver()
    with EmbeddedServer(models=("kimi_k25_vision",)) as server:
        yield server


@pytest.mark.server
def test_a_video_for_a_server_without_the_video_model_names_the_flag(
    vision_only: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(encode_clip(photo_frames("pil__xmp_test.jpg", 64, 48, 8), 25))
    assert cli.main(["infer", "--url", vision_only.grpc_url, str(clip)]) == cli.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "does not serve 'kimi_k25_video'" in err and "kimi-prep serve --models kimi_k25_video" in err
    assert "Traceback" not in err


@pytest.mark.server
def test_count_tokens_without_the_tokens_model_names_the_flag(vision_only: Any, corpus: Path) -> None:
    with KimiVisionClient(vision_only.grpc_url, "grpc", "kimi_k25_vision") as client:
        with pytest.raises(ModelNotServedError, match=r"kimi-prep serve --models kimi_k25_tokens"):
            client.count_tokens([(corpus / HOPPER).read_bytes()])


@pytest.mark.server
def test_a_bad_image_in_a_group_fails_alone_and_folders_are_walked(
    vision_only: Any, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    names = ["1.jpg", "a/2.jpg", "a/b/3.jpg", "a/empty.jpg"]
    for name in names[:3]:
        (tmp_path / name).write_bytes((corpus / HOPPER).read_bytes())
    (tmp_path / names[3]).write_bytes(b"")
    code = cli.main(["infer", "--url", vision_only.grpc_url, "--images-per-request", "4", "--quiet", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == cli.EXIT_SOME_FAILED
    assert captured.out.count("25 tokens") == 3  # the three good ones, found in every subfolder
    (error,) = captured.err.strip().splitlines()[:-1]
    assert error.startswith(f"{tmp_path / 'a' / 'empty.jpg'}: error: InvalidImageError:") and "image 3" not in error


@pytest.mark.server
def test_a_video_in_a_folder_is_reported_and_the_images_are_processed(
    vision_only: Any, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server has no video model: the clip gets an error line that says how to serve one, every
    image of the folder is still processed, and the exit code says some failed."""
    for index in range(3):
        (tmp_path / f"{index}.jpg").write_bytes((corpus / HOPPER).read_bytes())
    (tmp_path / "clip.mp4").write_bytes(encode_clip(photo_frames("pil__xmp_test.jpg", 64, 48, 8), 25))
    out = tmp_path / "out.npz"
    code = cli.main(["infer", "--url", vision_only.grpc_url, "--quiet", "--out", str(out), str(tmp_path)])
    captured = capsys.readouterr()
    assert code == cli.EXIT_SOME_FAILED
    assert captured.out.count("25 tokens") == 3
    error, count = captured.err.strip().splitlines()
    assert error.startswith(f"{tmp_path / 'clip.mp4'}: error: ModelNotServedError:")
    assert "kimi-prep serve --models kimi_k25_video" in error
    assert count == "1 of 4 inputs failed"
    assert len(np.load(out)["names"]) == 3


@pytest.mark.server
def test_a_model_no_rendering_has_is_not_suggested_to_serve(vision_only: Any, corpus: Path) -> None:
    with KimiVisionClient(vision_only.grpc_url, "grpc", "kimi_nope") as client:
        with pytest.raises(ModelNotServedError) as info:
            client.require_model()
    assert "no kimi-prep repository has a model of that name" in str(info.value)
    assert "serve --models kimi_nope" not in str(info.value) and "kimi_k25_vision" in str(info.value)


# -- kimi-prep serve as a user starts it -------------------------------------------------------------


def start_serve(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    """``kimi-prep serve ARGS`` on free ports, its output into ``log``; the lines up to the ready
    line and those written with it."""
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    with log.open("wb") as sink:
        command = [sys.executable, "-m", "kimi_vision_client.cli", "serve", *ports, *args]
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    started = time.monotonic()
    while "kimi-prep: ready:" not in log.read_text() and process.poll() is None:
        if time.monotonic() - started > READY_LINE_WAIT_S:
            break
        time.sleep(0.2)
    time.sleep(1)  # the lines written with the ready line
    return process, log.read_text().splitlines()


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)
    process.wait(timeout=120)


@pytest.mark.server
def test_a_start_is_quiet_and_ends_in_one_ready_line(tmp_path: Path) -> None:
    process, lines = start_serve(["--models", "kimi_k25_tokens"], tmp_path / "serve.log")
    try:
        ready = [line for line in lines if line.startswith("kimi-prep: ready: 1 of 1 models (kimi_k25_tokens) at")]
        assert ready, lines
        assert len(lines) <= 20, lines
        assert not any(line.startswith(("I1", "+--", "| ")) for line in lines), lines  # no info lines, no tables
    finally:
        stop(process)


@pytest.mark.server
def test_a_model_that_fails_to_load_is_named_and_the_others_serve(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    subprocess.run(
        [sys.executable, "-m", "kimi_vision_client.cli", "render-repository", "--out", str(repository)],
        check=True,
        capture_output=True,
    )
    for model in repository.iterdir():
        if model.name not in ("kimi_k25_tokens", "kimi_k3_tokens"):
            subprocess.run(["rm", "-r", str(model)], check=True)
    broken = repository / "kimi_k3_tokens" / "config.pbtxt"
    text = broken.read_text().replace('"max_pixels" value: { string_value: "', '"max_pixels" value: { string_value: "x')
    broken.write_text(text)
    process, lines = start_serve(["--model-repository", str(repository)], tmp_path / "serve.log")
    try:
        assert any(line.startswith("kimi-prep: ready: 1 of 2 models (kimi_k25_tokens)") for line in lines), lines
        (failed,) = [line for line in lines if line.startswith("kimi-prep: not serving kimi_k3_tokens:")]
        assert "max_pixels" in failed, failed
        assert process.poll() is None  # still serving the other
    finally:
        stop(process)


def test_building_the_parser_changes_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's commands join the parser through an entry point; joining sets nothing (the
    codec environment is set when a command runs)."""
    from kimi_vision_server.host import codec_env
    from kimi_vision_server.triton_install import cache_root

    for key in codec_env(cache_root()):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    parser = cli.build_parser()
    assert "serve" in parser.format_help()
    assert dict(os.environ) == before
