"""What the vLLM tests share: one real ``kimi-prep serve`` for the remote form, for the session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from make_inputs import kimi_prep_serve  # noqa: E402

# What the remote side's server serves: each preset's uint8 image ensemble, K2.5's chunk model.
SERVED = ("kimi_k25_vision_u8", "kimi_k25_video_chunk", "kimi_k3_vision_u8")


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    """A real ``kimi-prep serve`` (the serving environment's: ``KIMI_SERVING_VENV``, default ``.venv``)
    of :data:`SERVED` on free loopback ports: its gRPC address."""
    venv = Path(os.environ.get("KIMI_SERVING_VENV", TESTS.parent / ".venv"))
    serve = venv / "bin" / "kimi-prep"
    assert serve.exists(), f"no {serve}: make setup (or set KIMI_SERVING_VENV) serves the remote side"
    with kimi_prep_serve([str(serve)], "--models", *SERVED, "--instances", "1", "--threads", "1") as (_, grpc):
        yield f"127.0.0.1:{grpc}"
