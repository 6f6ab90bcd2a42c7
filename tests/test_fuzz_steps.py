"""The step models' request parsers under the structure-aware fuzzer (``fuzz/fuzz_steps.py``): a
short run against the built C step and the Python validators, the C step compiled warning-free
with ``-Wall -Wextra -Werror``, and a run with the C step built under AddressSanitizer and
UBSan where the compiler has them (their reports abort the run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_vision_common.errors import c_error_header
from kimi_vision_common.messages import c_message_header

REPO = Path(__file__).resolve().parents[1]
FUZZ = REPO / "fuzz" / "fuzz_steps.py"
# The C step's sources, as backend_src/server/setup.py builds them.
STEP = REPO / "backend_src" / "server" / "kimi_vision_server" / "models" / "patchify"
SOURCES = [str(STEP / f"{name}.c") for name in ("backend", "execute", "kernels", "kimi_json")]
CC = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``command``'s outcome (its exit status is the test's to judge)."""
    return subprocess.run(command, check=False, capture_output=True, text=True, env={**os.environ, **(env or {})})


def run_fuzzer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, str(FUZZ), *args], env)


def test_a_short_fuzz_run_of_the_step_parsers_finds_nothing() -> None:
    result = run_fuzzer("--seconds", "5", "--seed", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 findings" in result.stdout


def generated_include(folder: Path) -> str:
    """``-I`` of a folder holding the C step's generated headers (as backend_src/server/setup.py
    writes them)."""
    (folder / "kimi_errors.h").write_text(c_error_header())
    (folder / "kimi_messages.h").write_text(c_message_header())
    return f"-I{folder}"


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_c_step_compiles_without_warnings(tmp_path: Path) -> None:
    flags = ["-Wall", "-Wextra", "-Werror", "-O3", "-shared", "-fPIC", generated_include(tmp_path)]
    result = run([CC, *flags, *SOURCES, "-o", str(tmp_path / "step.so")])
    assert result.returncode == 0, result.stderr


def sanitizer_runtime(name: str) -> str | None:
    """The path of ``lib<name>.so`` the compiler links against, or None where it has none."""
    if CC is None:
        return None
    path = run([CC, f"-print-file-name=lib{name}.so"]).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(
    sanitizer_runtime("asan") is None or sanitizer_runtime("ubsan") is None, reason="no ASan/UBSan runtime"
)
def test_the_fuzzer_runs_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    library = tmp_path / "step_asan.so"
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]
    built = run([CC, *flags, "-shared", "-fPIC", generated_include(tmp_path), *SOURCES, "-o", str(library)])
    assert built.returncode == 0, built.stderr
    env = {
        "LD_PRELOAD": f"{sanitizer_runtime('asan')}:{sanitizer_runtime('ubsan')}",
        # CPython and numba hold memory until exit on purpose; the C step allocates nothing to leak here.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }
    result = run_fuzzer("--seconds", "5", "--seed", "2", "--library", str(library), env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert " 0 findings" in result.stdout
