"""The GPU served check's dry run: ``run_device_checks.sh --dry-run`` packs the served carry and
checks the size of each of its two runs (the work tree and one tarball) against the device limit,
then runs ``tests/gpu/served_check.py`` against the embedded tritonserver with KIND_CPU, so the
script that the GPU runs depend on cannot rot; and ``gpu_report.py``'s ``exact_route`` section
(``tests/gpu/exact_report.py``) runs on the CPU on a few files, so its code runs every ``make test``."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1200)  # above its script's own 900 s limit, so that one reports first
def test_device_checks_dry_run_packs_within_the_limit_and_the_served_checks_pass(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    command = ["bash", "tests/gpu/run_device_checks.sh", "--dry-run"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for part in ("site.tar.xz", "tritonserver.tar.xz"):  # one run each, both within the limit
        assert re.search(rf"run carrying tests/gpu/served/{part} \(.*\): [\d.]+ of 64 MiB, fits", done.stdout), part
    assert {p.name for p in (tmp_path / "served").iterdir()} == {"site.tar.xz", "tritonserver.tar.xz"}
    with tarfile.open(tmp_path / "served" / "site.tar.xz") as site:  # the exact GPU route's coefficient reader
        assert "kimi_libjpeg/_libjpeg.cpython-312-x86_64-linux-gnu.so" in site.getnames()
    report = json.loads((tmp_path / "served_check.json").read_text())
    steps = report["steps"]
    assert steps["outputs"]["passed"] and len(steps["outputs"]["images"]) == 5
    checks = ("decode_path_ok", "decode_equal_pillow", "http_equal_cpu_pipeline", "grpc_equal_cpu_pipeline")
    assert all(all(row[check] for check in checks) for row in steps["outputs"]["images"]), steps["outputs"]
    assert steps["zero_copy"]["passed"] and steps["zero_copy"]["inputs_in_expected_memory"] > 0
    assert steps["throughput"]["ensemble_img_s"]["per_s"] > 0


def test_the_exact_route_report_section_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``exact_report.exact_route`` as the device run calls it, on CPU tensors: four small corpus
    JPEGs and one small photo, one repeat (well under a second)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    import exact_report
    from gpu_common import CORPUS, accepted_files

    jpegs = sorted((f for f in accepted_files(CORPUS) if f.is_jpeg), key=lambda f: (CORPUS / f.name).stat().st_size)
    files = jpegs[:4]
    photo = io.BytesIO()
    Image.new("RGB", (96, 64), (200, 120, 40)).save(photo, "JPEG", quality=90)
    report = exact_report.exact_route("cpu", CORPUS, files, 1, {"small_photo": [photo.getvalue()]})

    equality = report["equality"]
    assert equality["files"] == len(files) and equality["exact"], equality
    assert equality["taken"] >= 1 and equality["taken"] + sum(equality["refused"].values()) == len(files)
    sets = report["throughput"]["sets"]
    assert set(sets) == {"corpus_exact_jpegs", "small_photo"}
    assert all(row["images_per_s"] > 0 for s in sets.values() for key, row in s.items() if key != "images")
    assert {"cpu_route", "exact_kernels_cpu"} <= set(sets["small_photo"])
    assert report["memory"] == {"skipped": "needs CUDA"}
