"""The README's curl request, run as a newcomer runs it (bash, curl) against a real server: HTTP 200,
GRID_THW and NUM_TOKENS as JSON, and PIXEL_VALUES equal to the library's, byte for byte."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from make_inputs import require_tritonserver

from kimi_vision_prep import preprocess_bytes
from kimi_vision_server.launch.embedded import EmbeddedServer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.server


def readme_curl_block() -> str:
    """The first bash block under the README's "A request with curl" heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A request with curl") :]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]  # type: ignore[index]


@pytest.fixture(scope="module")
def server() -> Any:
    if shutil.which("curl") is None:
        pytest.skip("no curl on this host")
    require_tritonserver()
    with EmbeddedServer(models=("kimi_k25_vision",)) as embedded:
        yield embedded


def test_the_readme_curl_request_returns_the_librarys_pixels(server: Any, corpus: Path, tmp_path: Path) -> None:
    photo = corpus / "pil__hopper.jpg"
    (tmp_path / "photo.jpg").write_bytes(photo.read_bytes())
    script = readme_curl_block().replace("localhost:8000", server.http_url)
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("HTTP/1.1 200"), done.stdout
    header_length = int(re.search(r"Inference-Header-Content-Length: (\d+)", done.stdout)[1])  # type: ignore[index]
    body = (tmp_path / "response.bin").read_bytes()
    header = json.loads(body[:header_length])
    outputs = {output["name"]: output for output in header["outputs"]}
    expected = preprocess_bytes(photo.read_bytes())
    assert outputs["GRID_THW"]["data"] == [int(v) for v in expected.grid_thw]
    assert outputs["NUM_TOKENS"]["data"] == [expected.num_tokens]
    pixels = np.frombuffer(body[header_length:], np.float32)
    assert outputs["PIXEL_VALUES"]["parameters"]["binary_data_size"] == pixels.nbytes
    assert np.array_equal(pixels, expected.pixel_values.reshape(-1))
