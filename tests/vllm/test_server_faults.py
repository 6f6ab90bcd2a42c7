"""A fault of the server is not the request's, in vLLM: through vLLM's own renderer (its API
server's input path), the remote form pointed at a server that does not answer ends a chat's
request with vLLM's ``RetryableRequestError``, which vLLM's API server answers 503 (retry it), while
a bad image ends it with the ``ValueError`` vLLM answers 400. The answer is what vLLM's
``create_error_response`` (its exception handlers' one function) makes of the error raised."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from checkpoints import vllm_environment, write_checkpoint

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "data" / "corpus"
DEADLINE_S = 1.0

RENDERS_A_CHAT = """
import json, sys
sys.path.insert(0, {here!r})
from vllm_side import renderer
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.renderers.params import ChatParams
render = renderer(__import__("pathlib").Path({checkpoint!r}), True, __import__("pathlib").Path({corpus!r}))
answers = {{}}
for name, url in {urls!r}.items():
    messages = [{{"role": "user", "content": [{{"type": "image_url", "image_url": {{"url": url}}}},
                                             {{"type": "text", "text": "describe this"}}]}}]
    try:
        render.render_chat([messages], ChatParams())
        answers[name] = {{"accepted": True}}
    except Exception as exc:
        response = create_error_response(exc)
        answers[name] = {{"class": type(exc).__name__, "code": response.error.code, "message": response.error.message}}
print("ANSWERS " + json.dumps(answers))
"""


def answers(checkpoint: Path, setting: str, urls: dict[str, str]) -> dict[str, dict]:
    code = RENDERS_A_CHAT.format(here=str(HERE), checkpoint=str(checkpoint), corpus=str(CORPUS), urls=urls)
    done = subprocess.run(
        [sys.executable, "-c", code], env=vllm_environment(setting), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("ANSWERS "))
    return json.loads(line.removeprefix("ANSWERS "))


def test_a_server_that_does_not_answer_is_vllms_503(tmp_path: Path) -> None:
    with socket.socket() as nothing_listens:
        nothing_listens.bind(("127.0.0.1", 0))
        port = nothing_listens.getsockname()[1]
    checkpoint = write_checkpoint(tmp_path / "k25", "kimi-k2.5")
    photo = (CORPUS / "sklearn__china.jpg").as_uri()
    got = answers(checkpoint, f"grpc://127.0.0.1:{port}?deadline_s={DEADLINE_S:g}", {"photo": photo})
    print(f"\nvLLM's answer, server down: {got}")
    assert got["photo"]["class"] == "RetryableRequestError" and got["photo"]["code"] == 503
    assert "DeadlineExceededError" in got["photo"]["message"] and f"127.0.0.1:{port}" in got["photo"]["message"]


def test_a_bad_image_is_vllms_400_with_our_words_in_process_and_remote(tmp_path: Path, server: str) -> None:
    """A truncated JPEG (vLLM's loader opens it; decoding finds it short), in process and from a
    live server: 400, the message the library's class and reason (not vLLM's wrapper's words)."""
    checkpoint = write_checkpoint(tmp_path / "k25", "kimi-k2.5")
    bad = {"truncated": (CORPUS / "pil__truncated_jpeg.jpg").as_uri()}
    for setting in ("local", f"grpc://{server}"):
        got = answers(checkpoint, setting, bad)
        print(f"\nvLLM's answers, {setting}: {got}")
        for name, answer in got.items():
            assert answer.get("code") == 400, (setting, name, answer)
            assert answer["message"].startswith("InvalidImageError: truncated image"), answer
