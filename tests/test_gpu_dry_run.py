"""The GPU served check's dry run: ``run_device_checks.sh --dry-run`` packs the served carry and
checks the size of each of its two runs (the work tree and one tarball) against the device limit,
then runs ``tests/gpu/served_check.py`` against the embedded tritonserver with KIND_CPU, so the
script that the GPU runs depend on cannot rot."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

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
    report = json.loads((tmp_path / "served_check.json").read_text())
    steps = report["steps"]
    assert steps["outputs"]["passed"] and len(steps["outputs"]["images"]) == 5
    assert all(row["http_equal_cpu_pipeline"] and row["grpc_equal_cpu_pipeline"] for row in steps["outputs"]["images"])
    assert steps["zero_copy"]["passed"] and steps["zero_copy"]["inputs_in_expected_memory"] > 0
    assert steps["throughput"]["ensemble_img_s"]["per_s"] > 0
