"""Repeats answered from tritonserver's response cache (docs/serving.md, "Repeats").

The rendering enables the cache on the image ensembles only; ``kimi-prep serve`` sizes one on
loopback and none beyond unless told; against a real tritonserver, a repeat is a hit with the same
bytes as the model's answer, and anything else (other bytes with the same pixels, another image,
a bad image, an answer larger than the cache) is never answered from another request's entry.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from make_inputs import jpeg_rgb, with_comment
from tritonclient.utils import InferenceServerException

from kimi_vision_prep import preprocess_bytes
from kimi_vision_server.launch.access import AccessPolicy
from kimi_vision_server.launch.command import Ports, server_args
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.launch.launcher import LaunchSpec
from kimi_vision_server.render.blocks import SERVING_DEFAULTS
from kimi_vision_server.render.repository import RenderOptions, repository_models
from kimi_vision_server.triton_install import find_tritonserver

MODEL = "kimi_k25_vision_u8"
CACHE_BYTES = 64 << 20
HITS, MISSES = "nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model"


def test_only_the_image_ensembles_are_cached() -> None:
    for options in (RenderOptions(), RenderOptions(kind="cpu"), RenderOptions(kind="gpu")):
        cached = {m.name for m in repository_models(options) if "response_cache { enable: true }" in m.config}
        assert cached == {f"{p}_vision{w}" for p in ("kimi_k25", "kimi_k3") for w in ("", "_u8")}


def test_serve_sizes_a_cache_on_loopback_and_none_beyond_unless_told() -> None:
    assert LaunchSpec().cache_bytes == SERVING_DEFAULTS.response_cache_bytes
    assert LaunchSpec(host="0.0.0.0").cache_bytes == 0
    assert LaunchSpec(host="0.0.0.0", response_cache_bytes=CACHE_BYTES).cache_bytes == CACHE_BYTES
    assert LaunchSpec(response_cache_bytes=0).cache_bytes == 0
    with pytest.raises(ValueError, match=">= 0"):
        LaunchSpec(response_cache_bytes=-1)


def test_the_server_gets_the_local_cache_of_its_own_install(tmp_path: Path) -> None:
    install = find_tritonserver()
    args = server_args(install, tmp_path, Ports(), AccessPolicy("k" * 24), cache_bytes=CACHE_BYTES)

    assert f"--cache-config=local,size={CACHE_BYTES}" in args
    assert f"--cache-directory={install.cache_directory}" in args
    assert (install.cache_directory / "local" / "libtritoncache_local.so").is_file()
    assert not any(a.startswith("--cache") for a in server_args(install, tmp_path, Ports(), AccessPolicy("k" * 24)))


def cache_counts(server: EmbeddedServer) -> tuple[int, int]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return tuple(  # type: ignore[return-value]
        int(float(re.search(rf'^{name}{{model="{MODEL}",version="1"}} (\S+)', text, re.M).group(1)))
        for name in (HITS, MISSES)
    )


def patches(server: EmbeddedServer, data: bytes) -> np.ndarray:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
    try:
        return client.infer(MODEL, [tensor]).as_numpy("PIXEL_PATCHES")[0]
    finally:
        client.close()


@pytest.fixture(scope="module")
def cached_server() -> EmbeddedServer:
    with EmbeddedServer(models=(MODEL,), response_cache_bytes=CACHE_BYTES) as server:
        yield server


def test_a_repeat_is_a_hit_with_the_models_answer(cached_server: EmbeddedServer) -> None:
    data = jpeg_rgb(300, 200, seed=11)
    expected = preprocess_bytes(data, "kimi-k2.5", output="pixel_patches").pixel_patches
    before = cache_counts(cached_server)
    first = patches(cached_server, data)
    after_first = cache_counts(cached_server)
    again = patches(cached_server, data)

    assert (after_first[0] - before[0], after_first[1] - before[1]) == (0, 1)
    assert cache_counts(cached_server)[0] - after_first[0] == 1
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(again, expected)


def test_other_bytes_never_get_another_requests_entry(cached_server: EmbeddedServer) -> None:
    one, other = jpeg_rgb(300, 200, seed=21), jpeg_rgb(300, 200, seed=22)
    patches(cached_server, one)
    before = cache_counts(cached_server)
    same_pixels = patches(cached_server, with_comment(one, b"turn 2"))
    another = patches(cached_server, other)

    assert cache_counts(cached_server)[0] == before[0]  # both missed
    np.testing.assert_array_equal(same_pixels, preprocess_bytes(one, "kimi-k2.5", output="pixel_patches").pixel_patches)
    np.testing.assert_array_equal(another, preprocess_bytes(other, "kimi-k2.5", output="pixel_patches").pixel_patches)


def test_a_failed_request_is_not_cached(cached_server: EmbeddedServer) -> None:
    bad = jpeg_rgb(300, 200, seed=31)[:400]
    for _ in range(2):
        before = cache_counts(cached_server)
        with pytest.raises(InferenceServerException, match="INVALID_ARG"):
            patches(cached_server, bad)
        assert cache_counts(cached_server)[0] == before[0]


def test_an_answer_larger_than_the_cache_is_served_and_not_kept() -> None:
    data = jpeg_rgb(1200, 900, seed=41)  # 5,568 patches: 3.3 MB of PIXEL_PATCHES
    expected = preprocess_bytes(data, "kimi-k2.5", output="pixel_patches").pixel_patches
    with EmbeddedServer(models=(MODEL,), response_cache_bytes=1 << 20) as server:
        answers = [patches(server, data) for _ in range(2)]
        hits, _ = cache_counts(server)

    assert expected.nbytes > 1 << 20
    assert hits == 0
    for answer in answers:
        np.testing.assert_array_equal(answer, expected)


def test_the_documents_state_the_default_size() -> None:
    mib = f"{SERVING_DEFAULTS.response_cache_bytes >> 20} MiB"
    root = Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/serving.md", "docs/memory.md", "docs/security.md"):
        assert mib in (root / doc).read_text(), doc
