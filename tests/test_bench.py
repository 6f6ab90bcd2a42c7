"""``kimi-prep bench`` against the embedded server: a short sweep writes its JSON and plot, error-free.

No timing is asserted (the host is shared); only that every level ran, counted its requests and
read Triton's per-model split.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kimi_vision_client.cli import front as cli
from kimi_vision_prep import preprocess_bytes

pytestmark = pytest.mark.server


@pytest.mark.parametrize("shm", [False, True], ids=["wire", "shm"])
def test_bench_sweep_writes_json_and_plot(triton_server: Any, corpus: Path, tmp_path: Path, shm: bool) -> None:
    images = [corpus / "pil__iptc.jpg", corpus / "sklearn__china.jpg"]
    argv = ["bench", "--url", triton_server.grpc_url, "--concurrency", "1,2", "--requests", "4", "--quiet"]
    argv += ["--out-dir", str(tmp_path), *(["--shm"] if shm else []), "--images", *map(str, images)]
    assert cli.main(argv) == cli.EXIT_OK
    result = json.loads((tmp_path / "bench_server.json").read_text())
    assert (tmp_path / "bench_server.png").stat().st_size > 0
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert (level["requests"], level["errors"]) == (4, 0)
        assert level["images_s"] > 0 and level["p50_ms"] <= level["p99_ms"]
        assert {"kimi_k25_vision", "kimi_k25_decode", "kimi_k25_patchify"} <= set(level["server"])  # the CPU rendering
        assert level["server"]["kimi_k25_patchify"]["requests"] == 4


@pytest.mark.parametrize("model", ["kimi_k25_vision_u8", "kimi_k25_vision_fused_u8"])
@pytest.mark.parametrize("shm", [False, True], ids=["wire", "shm"])
def test_bench_u8_counts_the_bytes_received(
    triton_server: Any, corpus: Path, tmp_path: Path, shm: bool, model: str
) -> None:
    """Against ``kimi_k25_vision_u8`` and ``kimi_k25_vision_fused_u8`` "MB/s out" is the uint8 patches
    (plus grid and tokens) actually received, not the float32 pixel_values the client expands them
    into; the fused model runs alone (no decode / patchify step in the server split)."""
    names = ["pil__iptc.jpg", "sklearn__china.jpg"]
    images = [corpus / name for name in names]
    argv = ["bench", "--url", triton_server.grpc_url, "--model", model, "--concurrency", "1,2"]
    argv += ["--requests", "4", "--quiet", "--out-dir", str(tmp_path), *(["--shm"] if shm else [])]
    assert cli.main([*argv, "--images", *map(str, images)]) == cli.EXIT_OK
    result = json.loads((tmp_path / "bench_server.json").read_text())
    # 4 requests per level, round-robin over 2 images: each image twice.
    per_image = [preprocess_bytes(path.read_bytes()).pixel_values.nbytes // 4 + 3 * 8 + 4 for path in images]
    for level in result["levels"]:
        assert (level["requests"], level["errors"]) == (4, 0)
        if model == "kimi_k25_vision_fused_u8":
            assert set(level["server"]) == {model} and level["server"][model]["requests"] == 4
        else:
            assert {model, "kimi_k25_patchify"} <= set(level["server"])
        received = level["mb_out_s"] * level["wall_s"] * 1e6
        assert received == pytest.approx(2 * sum(per_image), rel=1e-9)


def test_bench_reports_unavailable_server(tmp_path: Path) -> None:
    from kimi_vision_server.launch.embedded import free_port

    argv = ["bench", "--url", f"127.0.0.1:{free_port()}", "--requests", "1", "--out-dir", str(tmp_path)]
    assert cli.main(argv) == cli.EXIT_UNAVAILABLE
    assert not (tmp_path / "bench_server.json").exists()


def test_bench_serving_plots_a_saved_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench_serving.py imports and re-plots rows in its JSON format."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", script)
    assert spec is not None and spec.loader is not None
    bench_serving = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serving", bench_serving)  # its dataclasses look themselves up
    spec.loader.exec_module(bench_serving)
    levels = [{"concurrency": c, "images_s": 10.0 * c} for c in (1, 2, 4)]
    rows = [
        {"setting": setting.label, "transport": transport, "wire": wire, "in_process_2_threads_img_s": 40.0}
        | {"levels": levels}
        for setting in bench_serving.SETTINGS[:2]
        for transport in ("grpc", "grpc + shm")
        for wire in bench_serving.WIRES
    ]
    bench_serving.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
