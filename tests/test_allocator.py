"""allocator.py: the malloc settings that keep large buffers on the heap, in a child process; and
buffers.py's reuse, which needs no such setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kimi_vision_prep.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, allocator_env
from kimi_vision_prep.serving import triton_install

# Allocates and fills a 40 MiB buffer three times; prints the minor page faults of the last two.
CHILD = """
import json, resource, sys
import numpy as np
from kimi_vision_prep.buffers import empty_output
if sys.argv[1] == "keep":
    from kimi_vision_prep.allocator import keep_large_buffers
    assert keep_large_buffers()
new = empty_output if sys.argv[1] == "recycle" else lambda shape, dtype: np.empty(shape, dtype)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
new((40 << 20,), np.uint8).fill(1)
before = faults()
for _ in range(2):
    new((40 << 20,), np.uint8).fill(1)
print(json.dumps(faults() - before))
"""


def page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_large_buffers_reuses_the_heap_instead_of_faulting_pages_in() -> None:
    # Default: a fresh mmap per buffer, faulted in again (10240 faults of 4 KiB per buffer, fewer
    # with transparent huge pages); kept: the freed heap block is reused, nothing new to fault in.
    default, kept, recycled = page_faults("default"), page_faults("keep"), page_faults("recycle")
    assert kept <= 16
    assert default >= 40 and default > 10 * kept
    # buffers.empty_output under glibc's defaults: the freed block comes back from its free list.
    assert recycled <= 16 and default > 10 * recycled


def test_launcher_keeps_glibc_defaults_and_operator_values_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retention setting cost ~600-930 MiB under load (allocator.py, BENCHMARKS.md): the
    launcher no longer sets it; an operator's own values still reach tritonserver and the stubs."""
    assert allocator_env() == {
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
        "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
    }
    for name in allocator_env():
        monkeypatch.delenv(name, raising=False)
    env = triton_install.find_tritonserver().env
    assert not set(allocator_env()) & set(env)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1234")
    assert triton_install.find_tritonserver().env["MALLOC_TRIM_THRESHOLD_"] == "1234"
