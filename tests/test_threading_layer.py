"""A process that chose a thread-safe numba threading layer (omp) runs kernels of several threads at
once, with the same pixels; under workqueue they take numba_lock. Importing the library starts
numba's threading layer, libgomp's idle workers spinning briefly (numba_runtime.IDLE_SPIN_SETTING)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kimi_vision_prep.numba_runtime import IDLE_SPIN_SETTING

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


# What GNU libgomp took at load: with OMP_DISPLAY_ENV=verbose each copy prints its settings to
# stderr as it loads, one block per copy, in load order.
SPIN_CHILD = """
import os, sys
if sys.argv[1] == "torch-first":
    import torch
import numba
import kimi_vision_prep.numba_runtime
print(numba.threading_layer(), "GOMP_SPINCOUNT" in os.environ, os.environ.get("OMP_WAIT_POLICY"))
"""


def libgomp_spin_counts(order: str, **environ: str) -> tuple[list[str], str]:
    """The spin count of each libgomp the child loaded, and its own report (layer, whether
    GOMP_SPINCOUNT is left in its environment, its OMP_WAIT_POLICY)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env |= {"OMP_DISPLAY_ENV": "verbose", "NUMBA_THREADING_LAYER": "omp", **environ}
    done = subprocess.run(
        [sys.executable, "-c", SPIN_CHILD, order], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    counts = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
    return counts, done.stdout.strip().splitlines()[-1]


def test_importing_the_library_starts_numbas_openmp_workers_with_a_short_idle_spin() -> None:
    counts, report = libgomp_spin_counts("library-only")
    assert counts == [IDLE_SPIN_SETTING[1]]
    assert report == "omp False None"  # started, and the variable gone again


def test_a_libgomp_loaded_before_keeps_its_own_spin() -> None:
    # An empty OMP_WAIT_POLICY is the process's choice for the library and nothing to libgomp.
    default = libgomp_spin_counts("library-only", OMP_WAIT_POLICY="")[0]
    counts, report = libgomp_spin_counts("torch-first")
    assert counts == [default[0], IDLE_SPIN_SETTING[1]]  # torch's copy, then numba's beside it
    assert report == "omp False None"


def test_a_wait_policy_the_process_chose_is_kept() -> None:
    counts, report = libgomp_spin_counts("library-only", OMP_WAIT_POLICY="active")
    assert counts != [IDLE_SPIN_SETTING[1]] and len(counts) == 1
    assert report == "omp False active"


# The parent runs every pool once (a lone JPEG's row bands, the batch threads, the video frame
# writers, numba's threads: a parallel kernel on the main thread too), then forks while another
# of its threads holds every lock the library takes; the child, which has none of those threads
# and whose copies of the locks are held by nobody, repeats it.
FORK_CHILD = """
import contextlib, os, sys, threading
import numba
import numpy as np
sys.path.insert(0, "tests")
from make_inputs import jpeg_rgb, rgb_pattern, video_clips
import kimi_vision_prep as kvp
from kimi_vision_prep.patchify.normalize import patchify
images = [jpeg_rgb(1800, 1300, seed=1), jpeg_rgb(640, 480, seed=2)]
clip = video_clips()["h264_29.97fps_320x240.mp4"]
pixels = rgb_pattern(1400, 1000)
def run():
    lone = kvp.preprocess_bytes(images[0]).pixel_values
    batch = [r.pixel_values for r in kvp.preprocess_batch(images)]
    chunks = [c.pixel_values for c in kvp.preprocess_video(clip)]
    return [lone, *batch, *chunks, patchify(pixels, 72, 100, 14)]
parent = run()
kvp.preprocess_bytes(images[0])  # dropped: its output's block goes to the free list
assert kvp.buffer_stats()["recycled_bytes"] > 0
print(numba.threading_layer())
from kimi_vision_prep import buffers, numba_runtime
from kimi_vision_prep.decode import decoder as decode
decoder = decode.default_decoder()
locks = [decode._default_lock, buffers._arenas_lock, buffers._free_list._lock, numba_runtime.numba_lock,
         decoder._codec_lock, decoder._callers_lock, decoder._thread_pool_lock, decoder.pool._cond, decoder.stats._lock]
holding, forked = threading.Event(), threading.Event()
def hold():
    with contextlib.ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        holding.set()
        forked.wait()
holder = threading.Thread(target=hold)
holder.start()
holding.wait()
pid = os.fork()
if pid == 0:
    fresh = kvp.buffer_stats()["recycled_bytes"] == 0  # the parent's free blocks are not the child's
    child = run()
    os._exit(0 if fresh and all(np.array_equal(a, b) for a, b in zip(parent, child, strict=True)) else 3)
forked.set()
holder.join()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("layer", ["omp", "workqueue"])
def test_a_forked_child_preprocesses_like_its_parent(layer: str) -> None:
    """Engines fork workers after using the library (a data loader's workers, a preloading
    server): the child makes its own threads and locks and gets the parent's pixels, instead of
    waiting on threads that were not forked, on locks a thread of the parent held at the fork, or
    being killed by numba's GNU OpenMP guard (the timeout only ends a hang)."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": layer}
    command = [sys.executable, "-c", FORK_CHILD]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split() == [layer, "0"], done.stderr[-2000:]
