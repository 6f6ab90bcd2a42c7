"""Secure by default (docs/security.md), against a real tritonserver over HTTP and gRPC.

- The administrative APIs need the admin key: a load carrying a ``file:`` (code) is refused without
  it (the code never runs: its marker file stays absent) and accepted with it; an unload without
  it is refused and the model stays ready.
- Shared memory is open on loopback (the session server) and behind the key on a server listening
  on every interface.
- Every step model checks the layout of what it is sent (the K images tile IMAGE in order, no
  aliasing, no gaps) and every model that returns patches the request's patch budget, before any
  output exists; the server stays ready and exact afterwards.
"""

from __future__ import annotations

import base64
import io
import json
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from PIL import Image
from tritonclient.utils import InferenceServerException

from kimi_vision_client.client import error_from_server
from kimi_vision_common.errors import ImageTooLargeError, InvalidRequestError
from kimi_vision_common.sizing import navit_target_size
from kimi_vision_common.wire import ADMIN_HEADER, admin_headers, checked_key, operator_key
from kimi_vision_prep import PRESETS, preprocess_bytes
from kimi_vision_server.launch.access import (
    ADMIN_APIS,
    SHARED_MEMORY_API,
    AccessPolicy,
    access_args,
    generated_key,
    write_key_file,
)
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.blocks import SERVING_DEFAULTS

PROTOCOLS = {"http": httpclient, "grpc": grpcclient}
INVALID_ARG = ("400", "StatusCode.INVALID_ARGUMENT")
KEY = "k" * 24


# -- the policy, without a server ---------------------------------------------------------------


def test_loopback_leaves_shared_memory_open_and_every_interface_restricts_it() -> None:
    assert AccessPolicy(KEY).restricted_apis == ADMIN_APIS
    assert AccessPolicy(KEY, "0.0.0.0").restricted_apis == (*ADMIN_APIS, SHARED_MEMORY_API)
    assert AccessPolicy(KEY, "0.0.0.0", (SHARED_MEMORY_API,)).restricted_apis == ADMIN_APIS
    with pytest.raises(ValueError, match="only shared-memory"):
        AccessPolicy(KEY, open_apis=("model-repository",))


def test_access_args_bind_every_listener_and_restrict_both_protocols() -> None:
    args = access_args(AccessPolicy(KEY, "0.0.0.0"))
    for listener in ("http", "grpc", "metrics"):
        assert f"--{listener}-address=0.0.0.0" in args
    expected = f"model-repository,logging,trace,shared-memory:{ADMIN_HEADER}={KEY}"
    assert f"--http-restricted-api={expected}" in args
    assert f"--grpc-restricted-protocol={expected}" in args


def test_keys_are_long_and_plain(tmp_path: Path) -> None:
    for bad in ("short", "x" * 20 + ",", "x" * 20 + ":y", "x" * 10 + " " + "y" * 10):
        with pytest.raises(ValueError):
            checked_key(bad, "test")
    assert len(generated_key()) >= 32 and generated_key() != generated_key()
    (tmp_path / "key").write_text(KEY + "\n")
    assert operator_key(tmp_path / "key", {}) == KEY
    assert operator_key(None, {"KIMI_PREP_ADMIN_KEY": KEY}) == KEY
    assert operator_key(None, {}) is None


def test_a_generated_key_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = write_key_file(KEY, tmp_path / "run" / "admin-key-8000")
    assert path.read_text().strip() == KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


# -- the administrative APIs on a real server ---------------------------------------------------


def probe_model(marker: Path) -> tuple[str, bytes]:
    """A model config and a ``model.py`` that writes ``marker`` when the stub imports it."""
    config = {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}],
    }
    code = (
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
    return json.dumps(config), code.encode()


def http_post(server: EmbeddedServer, path: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    request = urllib.request.Request(
        f"http://{server.http_url}/v2{path}", data=json.dumps(body).encode(), method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def load_with_file(server: EmbeddedServer, protocol: str, name: str, marker: Path, headers: dict[str, str]) -> None:
    config, code = probe_model(marker)
    if protocol == "http":
        body = {"parameters": {"config": config, "file:1/model.py": base64.b64encode(code).decode()}}
        status = http_post(server, f"/repository/models/{name}/load", body, headers)
        if status != 200:
            raise PermissionError(status)
        return
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.load_model(name, headers=headers, config=config, files={"file:1/model.py": code})
    except InferenceServerException as exc:
        raise PermissionError(exc.message()) from None
    finally:
        client.close()


def unload(server: EmbeddedServer, protocol: str, name: str, headers: dict[str, str]) -> None:
    if protocol == "http":
        status = http_post(server, f"/repository/models/{name}/unload", {}, headers)
        if status != 200:
            raise PermissionError(status)
        return
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.unload_model(name, headers=headers)
    except InferenceServerException as exc:
        raise PermissionError(exc.message()) from None
    finally:
        client.close()


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_loading_code_needs_the_admin_key(triton_server: EmbeddedServer, tmp_path: Path, protocol: str) -> None:
    name, marker = f"probe_{protocol}", tmp_path / "marker"
    with pytest.raises(PermissionError):
        load_with_file(triton_server, protocol, name, marker, {})
    with pytest.raises(PermissionError):
        load_with_file(triton_server, protocol, name, marker, admin_headers("wrong-key-of-enough-length", protocol))
    assert not marker.exists(), "code ran without the admin key"
    load_with_file(triton_server, protocol, name, marker, triton_server.admin_headers(protocol))
    try:
        assert marker.read_text() == "ran"
    finally:
        unload(triton_server, protocol, name, triton_server.admin_headers(protocol))
        triton_server.wait_ready()  # the unload finishes in the background


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_unloading_needs_the_admin_key(triton_server: EmbeddedServer, protocol: str) -> None:
    with pytest.raises(PermissionError):
        unload(triton_server, protocol, "kimi_k3_decode", {})
    assert triton_server.is_ready()
    for api in ("/repository/index", "/logging", "/trace/setting"):
        assert http_post(triton_server, api, {}, {}) == 403, api


@pytest.mark.server
def test_shared_memory_is_open_on_loopback(triton_server: EmbeddedServer) -> None:
    region = shm.create_shared_memory_region("kimi_security_probe", "/kimi_security_probe", 64)
    client = httpclient.InferenceServerClient(triton_server.http_url)
    try:
        client.register_system_shared_memory("kimi_security_probe", "/kimi_security_probe", 64)
        registered = {region["name"] for region in client.get_system_shared_memory_status()}
        client.unregister_system_shared_memory("kimi_security_probe")
        assert "kimi_security_probe" in registered
        left = {region["name"] for region in client.get_system_shared_memory_status()}
        assert "kimi_security_probe" not in left
    finally:
        client.close()
        shm.destroy_shared_memory_region(region)


@pytest.mark.server
def test_every_interface_restricts_shared_memory_and_the_generated_key_opens_it() -> None:
    with EmbeddedServer(models=("kimi_k25_tokens",), host="0.0.0.0") as server:
        key_file = server.launched.key_file
        assert key_file is not None and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        region = shm.create_shared_memory_region("kimi_security_wide", "/kimi_security_wide", 64)
        try:
            for protocol, module in PROTOCOLS.items():
                client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
                try:
                    with pytest.raises(InferenceServerException):
                        client.register_system_shared_memory("kimi_security_wide", "/kimi_security_wide", 64)
                    headers = admin_headers(key, protocol)
                    client.register_system_shared_memory(
                        "kimi_security_wide", "/kimi_security_wide", 64, headers=headers
                    )
                    client.unregister_system_shared_memory("kimi_security_wide", headers=headers)
                finally:
                    client.close()
        finally:
            shm.destroy_shared_memory_region(region)
    assert not key_file.exists()


# -- layouts and budgets on every step model ----------------------------------------------------


def raw_inputs(protocol: str, tensors: dict[str, np.ndarray]) -> list[Any]:
    module, inputs = PROTOCOLS[protocol], []
    for name, array in tensors.items():
        datatype = "BYTES" if array.dtype == np.object_ else {"uint8": "UINT8", "int64": "INT64"}[array.dtype.name]
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def refused(server: EmbeddedServer, protocol: str, model: str, tensors: dict[str, np.ndarray], outputs: list[str]):
    module = PROTOCOLS[protocol]
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    try:
        requested = [module.InferRequestedOutput(name) for name in outputs]
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, raw_inputs(protocol, tensors), outputs=requested)
    finally:
        client.close()
    assert info.value.status() in INVALID_ARG, info.value.message()
    return error_from_server(info.value)


def step_inputs(model: str, image: np.ndarray, shapes: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of a step model: IMAGE and IMAGE_SHAPES, plus MODE and RESAMPLE for preprocess."""
    tensors = {"IMAGE": image, "IMAGE_SHAPES": shapes}
    if model.endswith("_preprocess"):
        k = shapes.shape[1]
        tensors["MODE"] = np.array([[b"RGB"] * k], dtype=np.object_)
        tensors["RESAMPLE"] = np.zeros((1, k), np.uint8)
    return tensors


def hostile_layouts() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(what, IMAGE, IMAGE_SHAPES) that break the tiling; each row alone would fit inside IMAGE."""
    side = 56
    one = side * side * 3
    pixels = np.full((1, one * 2), 7, np.uint8)
    row = lambda offset: [side, side, 3, offset]  # noqa: E731
    return [
        ("every row at offset 0 (aliasing)", pixels[:, :one], np.array([[row(0)] * 8], np.int64)),
        ("the second image overlapping the first", pixels, np.array([[row(0), row(one // 2)]], np.int64)),
        ("a gap before the first image", pixels, np.array([[row(one)]], np.int64)),
        ("a gap between two images", pixels, np.array([[row(0), row(one + 3)]], np.int64)),
        ("bytes left after the last image", pixels, np.array([[row(0)]], np.int64)),
        ("images out of order", pixels, np.array([[row(one), row(0)]], np.int64)),
    ]


STEP_MODELS = ["kimi_k25_patchify", "kimi_k3_patchify", "kimi_k25_preprocess", "kimi_k3_preprocess"]


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("model", STEP_MODELS)
def test_step_models_refuse_aliasing_and_gapped_layouts(
    triton_server: EmbeddedServer, protocol: str, model: str
) -> None:
    for what, image, shapes in hostile_layouts():
        error = refused(triton_server, protocol, model, step_inputs(model, image, shapes), ["PIXEL_VALUES"])
        assert type(error) is InvalidRequestError, (what, str(error))
        assert "tile IMAGE" in str(error) or "no gaps" in str(error), (what, str(error))


def solid_jpeg(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 140, 200)).save(buffer, "JPEG", quality=50)
    return buffer.getvalue()


def over_budget_images(preset: str) -> list[bytes]:
    """Solid JPEGs (a few KB each) whose NaViT patches in all exceed the served budget by one image."""
    budget = SERVING_DEFAULTS.patch_budget(PRESETS[preset])
    data = solid_jpeg(4000, 4000)
    each = navit_target_size(4000, 4000, PRESETS[preset]).num_patches
    return [data] * (budget // each + 1)


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize(
    "model",
    ["kimi_k25_vision", "kimi_k25_vision_u8", "kimi_k25_decode", "kimi_k25_vision_fused", "kimi_k3_vision"],
)
def test_requests_over_the_patch_budget_are_refused_before_decoding(
    triton_server: EmbeddedServer, protocol: str, model: str
) -> None:
    preset = "kimi-k3" if "k3" in model else "kimi-k2.5"
    images = over_budget_images(preset)
    output = {"kimi_k25_vision_u8": "PIXEL_PATCHES", "kimi_k25_decode": "IMAGE"}.get(model, "PIXEL_VALUES")
    tensors = {"IMAGE_BYTES": np.array([images], dtype=np.object_)}
    error = refused(triton_server, protocol, model, tensors, [output])
    assert type(error) is ImageTooLargeError, str(error)
    assert f"max_patches_per_request={SERVING_DEFAULTS.patch_budget(PRESETS[preset])}" in str(error)


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("model", ["kimi_k25_patchify", "kimi_k25_preprocess"])
def test_step_models_refuse_a_tiled_request_over_the_patch_budget(
    triton_server: EmbeddedServer, protocol: str, model: str
) -> None:
    """Well-tiled images at their NaViT size whose patches in all exceed the budget: refused."""
    preset = PRESETS["kimi-k2.5"]
    target = navit_target_size(1792, 1792, preset)
    h, w = target.new_height, target.new_width
    count = SERVING_DEFAULTS.patch_budget(preset) // target.num_patches + 1
    size = h * w * 3
    image = np.zeros((1, size * count), np.uint8)
    shapes = np.array([[[h, w, 3, k * size] for k in range(count)]], np.int64)
    tensors = step_inputs(model, image, shapes)
    if model.endswith("_preprocess"):
        tensors["STORED_SIZES"] = np.array([[[1792, 1792]] * count], np.int64)
    error = refused(triton_server, protocol, model, tensors, ["PIXEL_VALUES"])
    assert type(error) is ImageTooLargeError, str(error)
    assert "max_patches_per_request" in str(error)


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_the_server_stays_ready_and_exact_after_hostile_requests(
    triton_server: EmbeddedServer, corpus: Path, protocol: str
) -> None:
    for _what, image, shapes in hostile_layouts()[:2]:
        refused(triton_server, protocol, "kimi_k3_patchify", step_inputs("kimi_k3_patchify", image, shapes), [])
    module = PROTOCOLS[protocol]
    client = module.InferenceServerClient(triton_server.http_url if protocol == "http" else triton_server.grpc_url)
    try:
        data = (corpus / "pil__hopper.jpg").read_bytes()
        for model, preset in (("kimi_k25_vision", "kimi-k2.5"), ("kimi_k3_vision", "kimi-k3")):
            result = client.infer(model, raw_inputs(protocol, {"IMAGE_BYTES": np.array([[data]], dtype=np.object_)}))
            expected = preprocess_bytes(data, preset).pixel_values
            assert result.as_numpy("PIXEL_VALUES")[0].tobytes() == expected.tobytes()
    finally:
        client.close()
    assert triton_server.is_ready()
