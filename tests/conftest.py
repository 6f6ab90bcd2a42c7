"""Shared fixtures: the corpus and the embedded tritonserver.

Helpers live in ``make_inputs.py`` (import that, not ``conftest``: with several conftest.py files,
``import conftest`` may find the wrong one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from make_inputs import CORPUS, require_tritonserver

# tests/peer runs in .venv-peer (torchvision next to the torch it was built for: transformers'
# processor classes do not import in this venv's CPU torch) and tests/vllm in .venv-vllm (vLLM and
# its plugin); make test runs each there.
collect_ignore = ["peer", "vllm"]


@pytest.fixture(autouse=True)
def library_buffer_caps():
    """Each test starts from the library's buffer caps: a served model built in process (unit tests)
    applies its config's caps to the process, as it does in its stub."""
    from kimi_vision_prep.buffers import buffer_stats, configure_buffers

    stats = buffer_stats()
    yield
    configure_buffers(scratch_cap_bytes=stats["scratch_cap_bytes"], recycle_cap_bytes=stats["recycle_cap_bytes"])


@pytest.fixture(scope="session")
def corpus() -> Path:
    """The test corpus in the repository (``tests/data/corpus``: real images and videos, MANIFEST.tsv)."""
    return CORPUS


# -- the embedded tritonserver (tests marked `server`) --------------------------------------------


@pytest.fixture(scope="session")
def triton_server():
    """A real tritonserver on free ports serving every model rendered as ``kimi-prep serve`` renders
    them on a GPU-less host (KIND_CPU: the vision ensembles end in the C backend ``kimi_patchify``),
    1 instance per model; the checked-in repository (kind unset, the Python preprocess step) is
    served by test_faults.py.

    Yields a :class:`kimi_vision_server.launch.embedded.EmbeddedServer` (``.http_url``, ``.grpc_url``,
    ``.metrics_url``, ``.log_tail()``); stopped at the end of the session.
    """
    from kimi_vision_server.launch.embedded import EmbeddedServer
    from kimi_vision_server.render.repository import RenderOptions

    require_tritonserver()
    server = EmbeddedServer(render=RenderOptions(kind="cpu"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
