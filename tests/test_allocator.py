"""allocator.py: the malloc settings that keep large buffers on the heap, in a child process; and
buffers.py's reuse, which needs no such setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_vision_server import triton_install
from kimi_vision_server.allocator import (
    JEMALLOC_CONF,
    MMAP_THRESHOLD_BYTES,
    SERVER_ONLY_ENV,
    TRIM_THRESHOLD_BYTES,
    allocator_env,
    describe_server_allocator,
    server_allocator_env,
)

# Allocates and fills a 40 MiB buffer three times; prints the minor page faults of the last two.
CHILD = """
import json, resource, sys
import numpy as np
from kimi_vision_prep.buffers import empty_output
if sys.argv[1] == "keep":
    from kimi_vision_server.allocator import keep_large_buffers
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


def test_server_allocator_is_jemalloc_where_found_and_the_operators_choice_wins() -> None:
    found = server_allocator_env({})
    if found:  # Debian's libjemalloc2 (`make` installs it as root)
        assert found == {"LD_PRELOAD": "libjemalloc.so.2", "MALLOC_CONF": JEMALLOC_CONF}
        line = describe_server_allocator({**found, SERVER_ONLY_ENV: "LD_PRELOAD MALLOC_CONF"})
        assert line.startswith("malloc: jemalloc in tritonserver") and "glibc's in the stubs" in line
    for operators in ({"LD_PRELOAD": ""}, {"LD_PRELOAD": "libtcmalloc.so.4"}, {"MALLOC_CONF": "narenas:1"}):
        assert server_allocator_env(operators) == {}  # LD_PRELOAD= (empty) keeps glibc's
        assert "the operator's" in describe_server_allocator({**operators, SERVER_ONLY_ENV: ""})
    assert describe_server_allocator({SERVER_ONLY_ENV: ""}).startswith("malloc: glibc's")
    assert "of its own" in describe_server_allocator({})  # tritonserver from PATH: no wrapper, nothing added


def test_stub_wrapper_drops_only_the_servers_own_entries(tmp_path: Path) -> None:
    """triton_install.STUB_WRAPPER, run as the Python backend runs a stub: by its full path, with arguments."""
    (tmp_path / "bin").mkdir()
    real = tmp_path / "bin" / triton_install.STUB
    real.write_text('#!/bin/sh\necho "args: $*"\nenv\n')
    wrapper = tmp_path / triton_install.STUB
    wrapper.write_text(triton_install.STUB_WRAPPER)
    for script in (real, wrapper):
        script.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SERVER_A": "1", "SERVER_B": "2", "KEPT": "3", SERVER_ONLY_ENV: "SERVER_A SERVER_B"}
    out = subprocess.run([str(wrapper), "/models/x", "region 1"], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "args: /models/x region 1"
    names = {line.split("=", 1)[0] for line in lines[1:]}
    assert "KEPT" in names and not names & {"SERVER_A", "SERVER_B", SERVER_ONLY_ENV}
