"""A process that chose a thread-safe numba threading layer (omp) runs kernels of several threads at
once, with the same pixels; under workqueue (the default) they take numba_lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
import numba, numpy as np
sys.path.insert(0, "tests")
from make_inputs import jpeg_rgb
import kimi_vision_prep as kvp
from kimi_vision_prep.numba_runtime import kernel_lock, numba_lock
images = [jpeg_rgb(1800 + 40 * i, 1300, seed=i) for i in range(6)]
serial = [kvp.preprocess_bytes(d).pixel_values for d in images]
with ThreadPoolExecutor(3) as pool:
    threaded = list(pool.map(lambda d: kvp.preprocess_bytes(d).pixel_values, images))
batch = [r.pixel_values for r in kvp.preprocess_batch(images)]
print(json.dumps({
    "layer": numba.threading_layer(),
    "locked": kernel_lock() is numba_lock,
    "equal": all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(serial, threaded, batch)),
}))
"""


def run_child(layer: str) -> dict[str, object]:
    env = {**os.environ, "NUMBA_THREADING_LAYER": layer}
    command = [sys.executable, "-c", CHILD]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_omp_layer_runs_kernels_unlocked_with_the_same_pixels() -> None:
    assert run_child("omp") == {"layer": "omp", "locked": False, "equal": True}


def test_workqueue_layer_keeps_the_lock() -> None:
    assert run_child("workqueue") == {"layer": "workqueue", "locked": True, "equal": True}
