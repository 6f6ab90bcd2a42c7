"""Every code block of README.md and docs/library.md runs, as shown, in the install of its door.

A block that imports the library runs in the library door (``pip install .`` into a numpy 2 venv
without torch, transformers or the server: ``$KIMI_LIBRARY_VENV``, default ``.venv-library``); a
block that imports the client or tritonclient, or runs ``kimi-prep infer``, in the client door
(``pip install ./client``: ``$KIMI_CLIENT_VENV``). Each runs in a fresh folder holding the files the
examples open (``photo.jpg``, ``a.jpg``, ``b.png``, ``photos/``, ``frame0.jpg``...), with the test
server's addresses put in place of ``localhost:8000`` / ``localhost:8001``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/library.md")
LIBRARY_VENV = ROOT / os.environ.get("KIMI_LIBRARY_VENV", ".venv-library")
CLIENT_VENV = ROOT / os.environ.get("KIMI_CLIENT_VENV", ".venv-client")
# Blocks run elsewhere: the two make commands are what runs this suite; the curl request has its
# own test against a real server (tests/test_readme.py); the vLLM plugin's install, as `make
# vllm-venv` does it, and vLLM with and without the plugin run in tests/vllm/ (a local checkpoint).
RUN_ELSEWHERE = {
    "make serve": "the Makefile",
    "curl -s -o response.bin": "tests/test_readme.py",
    "vllm serve": "tests/vllm/",
}
FILES = {  # name in the example folder -> corpus file
    "photo.jpg": "pil__hopper.jpg",
    "a.jpg": "sklearn__flower.jpg",
    "b.png": "pilx__hopper.png",
    "photos/b.webp": "pilx__flower.webp",
    "photos/c.jpg": "imagers__progressive3.jpg",
    **{f"frame{i}.jpg": name for i, name in enumerate(["pil__hopper.jpg", "pil__hopper_orientation_3.jpg"] * 2)},
}


def blocks() -> list[tuple[str, str, str]]:
    """``(id, language, code)`` of every fenced bash/python block of the documents."""
    found = []
    for document in DOCUMENTS:
        text = (ROOT / document).read_text()
        for number, (language, code) in enumerate(re.findall(r"```(bash|python)\n(.*?)```", text, re.S)):
            found.append((f"{document}#{number}-{language}", language, code))
    return found


def door(language: str, code: str) -> Path | None:
    """The venv a block runs in (None: run elsewhere, see RUN_ELSEWHERE)."""
    if any(marker in code for marker in RUN_ELSEWHERE):
        return None
    if re.search(r"^(from|import) kimi_vision_prep\b", code, re.M):
        return LIBRARY_VENV
    if re.search(r"^(from|import) (kimi_vision_client|tritonclient)\b", code, re.M) or "kimi-prep infer" in code:
        return CLIENT_VENV
    raise AssertionError(f"a {language} block of no known door:\n{code}")


BLOCKS = blocks()


def test_every_block_has_a_door_or_runs_elsewhere() -> None:
    doors = [door(language, code) for _, language, code in BLOCKS]
    elsewhere = [code for (_, _, code), venv in zip(BLOCKS, doors, strict=True) if venv is None]
    assert {marker for marker in RUN_ELSEWHERE if any(marker in code for code in elsewhere)} == set(RUN_ELSEWHERE)
    assert {LIBRARY_VENV, CLIENT_VENV} <= set(doors)


@pytest.fixture
def example_folder(corpus: Path, tmp_path: Path) -> Path:
    for name, source in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((corpus / source).read_bytes())
    (tmp_path / "client").symlink_to(ROOT / "client")  # `pip install ./client`, as from a checkout
    return tmp_path


@pytest.mark.parametrize(
    ("language", "code"),
    [(language, code) for _, language, code in BLOCKS if door(language, code)],
    ids=[block_id for block_id, language, code in BLOCKS if door(language, code)],
)
def test_the_block_runs_in_its_doors_install(triton_server, example_folder: Path, language: str, code: str) -> None:
    venv = door(language, code)
    assert venv is not None and (venv / "bin" / "python").exists(), f"`make doors` builds {venv}"
    code = code.replace("localhost:8000", triton_server.http_url).replace("localhost:8001", triton_server.grpc_url)
    command = [str(venv / "bin" / "python"), "-c", code] if language == "python" else ["bash", "-e", "-c", code]
    environment = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    environment.pop("PYTHONPATH", None)
    done = subprocess.run(command, cwd=example_folder, env=environment, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
