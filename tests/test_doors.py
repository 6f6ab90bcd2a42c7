"""The client door: ``pip install ./client`` into a fresh numpy 2 venv (``make doors`` builds it at
``$KIMI_CLIENT_VENV``, default ``.venv-client``) talks to a real tritonserver and gets exact results.

The client venv has no numba, PyAV, simplejpeg, library or server; it runs ``KimiVisionClient``
and ``kimi-prep infer`` there, and this process compares what came back with in-process
preprocessing. Its errors are the shared package's classes, the ones the library raises.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kimi_vision_prep import InvalidImageError, PreprocessError, preprocess_bytes

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
CLIENT_VENV = ROOT / os.environ.get("KIMI_CLIENT_VENV", ".venv-client")
IMAGES = ["pil__hopper.jpg", "pilx__transparent.webp", "imagers__large_image.jpg"]
BAD = "pilx__broken.png"

CLIENT_SCRIPT = """
import importlib.util, json, sys
import numpy as np
from kimi_vision_client.client import KimiVisionClient
url, protocol, model, out, *paths = sys.argv[1:]
absent = [m for m in ("numba", "av", "simplejpeg", "kimi_vision_prep") if importlib.util.find_spec(m) is None]
report = {"numpy": np.__version__, "absent": absent}
arrays = {}
with KimiVisionClient(url, protocol, model) as client:
    for i, path in enumerate(paths):
        try:
            arrays[str(i)] = client.infer(open(path, "rb").read()).pixel_values
        except Exception as exc:
            report[str(i)] = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
np.savez(out, **arrays)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def client_python() -> Path:
    python = CLIENT_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no client venv at {CLIENT_VENV}: `make doors` builds it")
    return python


@pytest.mark.parametrize(("protocol", "model"), [("http", "kimi_k25_vision"), ("grpc", "kimi_k25_vision_u8")])
def test_client_only_install_gets_exact_pixels_and_the_library_error_types(  # noqa: PLR0917 (fixtures)
    triton_server, client_python: Path, corpus: Path, tmp_path: Path, protocol: str, model: str
) -> None:
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    paths = [corpus / name for name in [*IMAGES, BAD]]
    out = tmp_path / "client.npz"
    command = [str(client_python), "-c", CLIENT_SCRIPT, url, protocol, model, str(out), *map(str, paths)]
    report = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    assert report["numpy"].startswith("2.")
    assert report["absent"] == ["numba", "av", "simplejpeg", "kimi_vision_prep"]
    arrays = np.load(out)
    for i, path in enumerate(paths[:-1]):
        assert np.array_equal(arrays[str(i)], preprocess_bytes(path.read_bytes()).pixel_values), path.name
    with pytest.raises(PreprocessError) as in_process:
        preprocess_bytes(paths[-1].read_bytes())
    assert isinstance(in_process.value, InvalidImageError)
    expected_type = f"{type(in_process.value).__module__}.{type(in_process.value).__qualname__}"
    assert report[str(len(paths) - 1)].startswith(f"{expected_type}: ")


def test_client_only_kimi_prep_infer_writes_the_exact_npz(
    triton_server, client_python: Path, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "infer.npz"
    paths = [corpus / name for name in IMAGES]
    kimi_prep = client_python.parent / "kimi-prep"
    command = [str(kimi_prep), "infer", "--url", triton_server.grpc_url, "--out", str(out), "--quiet", *map(str, paths)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    expected = np.concatenate([preprocess_bytes(path.read_bytes()).pixel_values for path in paths])
    assert np.array_equal(np.load(out)["pixel_values"], expected)
    help_text = subprocess.run([str(kimi_prep), "--help"], capture_output=True, text=True, check=True).stdout
    assert "infer" in help_text and "render-repository" not in help_text  # server commands come with it

