"""Shared fixtures: the corpus and its manifest."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"


def manifest() -> list[dict[str, str]]:
    """Rows of ``shared/corpus/MANIFEST.tsv`` (empty when the corpus is missing)."""
    path = CORPUS / "MANIFEST.tsv"
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def corpus_files(accepted: bool | None = None) -> list[str]:
    """Corpus file names; ``accepted`` filters on the manifest's ``pil_load == "ok"``."""
    rows = manifest()
    return [r["filename"] for r in rows if accepted is None or (r["pil_load"] == "ok") == accepted]


@pytest.fixture(scope="session")
def corpus() -> Path:
    if not CORPUS.exists():
        pytest.skip("shared/corpus not present")
    return CORPUS


# -- the embedded tritonserver (tests marked `server`) --------------------------------------------


@pytest.fixture(scope="session")
def triton_server():
    """A real tritonserver on free ports serving ``model_repository/`` rendered with 1 instance per model.

    Yields a :class:`kimi_vision_prep.serving.launcher.EmbeddedServer` (``.http_url``, ``.grpc_url``,
    ``.metrics_url``, ``.log_tail()``); stopped at the end of the session.
    """
    from kimi_vision_prep.serving.launcher import EmbeddedServer, find_tritonserver

    try:
        find_tritonserver()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server = EmbeddedServer(instances=1)
    server.start()
    try:
        yield server
    finally:
        server.stop()
