"""NVIDIA's perf_analyzer (the ``tritonclient==2.41.0`` wheel's, ``make perf-analyzer``) against the
server as ``make serve`` starts it (the default models, the response cache on loopback): it
measures pass after pass, the repeats answered from the cache, where an ensemble step naming the
latest version (``model_version: -1``) made it stop ("failed to find the requested model
version": in a window where the cache answered everything no step ran, and it could not tell
which version's statistics to read).

``KIMI_PERF_ANALYZER`` names the binary (``make test`` sets it; default ``.venv-perf/bin/perf_analyzer``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from make_inputs import CORPUS, kimi_prep_serve, require_tritonserver

from kimi_vision_server.launch.embedded import free_port

ROOT = Path(__file__).resolve().parents[1]
PHOTOS = ["pil__hopper.jpg", "sklearn__china.jpg", "sklearn__flower.jpg"]
MODELS = ["kimi_k25_vision", "kimi_k25_vision_u8", "kimi_k3_vision_u8"]

pytestmark = pytest.mark.server


def perf_analyzer() -> Path:
    path = Path(os.environ.get("KIMI_PERF_ANALYZER", ROOT / ".venv-perf" / "bin" / "perf_analyzer"))
    assert path.exists(), f"no {path}: `make perf-analyzer` installs it"
    return path


def cudart_dir(binary: Path) -> str:
    """``libcudart.so.12`` of the perf venv's ``nvidia-cuda-runtime-cu12`` wheel (perf_analyzer links it)."""
    code = "import nvidia.cuda_runtime as c, os; print(os.path.join(list(c.__path__)[0], 'lib'))"
    python = binary.parent / "python"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[int, int]]:
    """``kimi-prep serve --probe-port P``, as ``make serve`` runs it, on free ports: (HTTP, gRPC)."""
    require_tritonserver()
    with kimi_prep_serve([sys.executable, "-m", "kimi_vision_client.cli"], "--probe-port", str(free_port())) as ports:
        yield ports


@pytest.fixture(scope="module")
def input_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kimi-prep perf-data`` of a few corpus photos."""
    out = tmp_path_factory.mktemp("perf") / "data.json"
    command = [sys.executable, "-m", "kimi_vision_client.cli", "perf-data", "-o", str(out)]
    subprocess.run([*command, *(str(CORPUS / name) for name in PHOTOS)], check=True, capture_output=True)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_perf_analyzer_measures_the_default_serve_pass_after_pass(
    served: tuple[int, int], input_data: Path, model: str
) -> None:
    """Two concurrencies, each stabilised over passes of a fixed request count (any spread accepted:
    this is about perf_analyzer running, not about the figures); the server's statistics it reports
    show the cache answering the repeats and the ensemble's steps by version."""
    binary = perf_analyzer()
    command = [str(binary), "-m", model, "-i", "grpc", "-u", f"127.0.0.1:{served[1]}"]
    command += ["--input-data", str(input_data), "--concurrency-range", "1:2"]
    command += ["--measurement-mode", "count_windows", "--measurement-request-count", "30"]
    command += ["--stability-percentage", "1000", "--max-trials", "10", "-v"]  # -v: a line a pass
    env = {**os.environ, "LD_LIBRARY_PATH": cudart_dir(binary)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "failed to find the requested model version" not in out
    assert len(re.findall(r"Pass \[\d+\] throughput", out)) >= 6, out[-3000:]  # 3+ passes a concurrency
    hits = [int(n) for n in re.findall(r"Cache hit count: (\d+)", out)]
    assert hits and max(hits) > 0, out[-3000:]
    assert re.search(r"kimi_k\w+_decode, version: 1", out), out[-3000:]
    passes = re.findall(r"Pass \[\d+\] throughput", out)
    summary = re.findall(r"^Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec", out, re.M)
    figures = "; ".join(f"concurrency {c}: {t} infer/s, {int(u) / 1000:.1f} ms" for c, t, u in summary)
    print(f"\nperf_analyzer {model}: {figures}; {len(passes)} passes, cache hits {max(hits)}")
