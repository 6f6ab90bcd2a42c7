"""The C backend ``kimi_patchify`` (``models/patchify/``): its kernels against the library's numba
ones (through ctypes, no server), its size bound against the NaViT rule, and the model in a real
tritonserver (the session server serves the CPU rendering, where the vision ensembles end in it).

Every expected value comes from the library in process (``write_patches``, ``patchify``,
``normalize_table``, ``navit_target_size``) or from the request itself; nothing the backend made
is hard-coded.
"""

from __future__ import annotations

import ctypes
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from c_step import F32_P, U8_P, load_c_step
from hypothesis import given, settings
from hypothesis import strategies as st
from make_inputs import corpus_names
from PIL import Image
from tritonclient.utils import InferenceServerException

from kimi_vision_client.client import error_from_server
from kimi_vision_common.errors import ImageTooLargeError, InvalidRequestError
from kimi_vision_common.models import SERVED_PRESETS, model_prefix
from kimi_vision_common.patches import normalize_table
from kimi_vision_common.sizing import navit_patch_bound, navit_target_size
from kimi_vision_prep import PRESETS, preprocess_bytes
from kimi_vision_prep.patchify.normalize import patchify, write_patches
from kimi_vision_server.models.config import DecoderSettings
from kimi_vision_server.render.repository import RenderOptions, repository_models
from kimi_vision_server.triton_install import patchify_library

PROTOCOLS = {"http": httpclient, "grpc": grpcclient}


@pytest.fixture(scope="module")
def backend() -> ctypes.CDLL:
    """The built backend, loaded outside tritonserver."""
    return load_c_step()


def c_tables(backend: ctypes.CDLL, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """The backend's float32 tables, channel-major ``(3, 256)``."""
    tables = np.empty((3, 256), np.float32)
    doubles = ctypes.c_double * 3
    backend.kimi_normalize_tables(doubles(*mean), doubles(*std), tables.ctypes.data_as(F32_P))
    return tables


def c_patches(backend: ctypes.CDLL, image: np.ndarray, grid: tuple[int, int], p: int, tables: Any) -> np.ndarray:
    """The backend's kernel on ``image`` (uint8 (H, W, 3)): float32 with ``tables``, else uint8."""
    image = np.ascontiguousarray(image)
    h, w, _ = image.shape
    pixels = image.ctypes.data_as(U8_P)
    if tables is None:
        out = np.full((grid[0] * grid[1], 3, p, p), 77, np.uint8)  # not zero: padding must be written
        backend.kimi_write_patches_u8(pixels, h, w, out.ctypes.data_as(U8_P), grid[0], grid[1], p)
    else:
        out = np.full((grid[0] * grid[1], 3, p, p), np.nan, np.float32)
        tables = np.ascontiguousarray(tables)
        backend.kimi_write_patches_f32(pixels, h, w, tables.ctypes.data_as(F32_P), out.ctypes.data_as(F32_P), *grid, p)
    return out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tables_equal_normalize_table(backend: ctypes.CDLL, preset: str) -> None:
    mean, std = PRESETS[preset].image_mean, PRESETS[preset].image_std
    assert c_tables(backend, mean, std).tobytes() == normalize_table(mean, std).T.copy().tobytes()


def test_tables_equal_normalize_table_for_other_statistics(backend: ctypes.CDLL) -> None:
    """CLIP's and ImageNet's mean/std: every float64 step rounds as the library's does."""
    for mean, std in [
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ]:
        assert c_tables(backend, mean, std).tobytes() == normalize_table(mean, std).T.copy().tobytes()


def random_cases(count: int, p: int = 14, factor: int = 28) -> list[tuple[int, int, int, int]]:
    """(height, width, grid_h, grid_w): odd sizes, exact multiples, one-pixel images, extra grid."""
    rng = random.Random(11)
    cases = [(1, 1, 2, 2), (28, 28, 2, 2), (29, 27, 4, 2), (14, 300, 2, 22), (3, 5, 4, 6)]
    for _ in range(count):
        h, w = rng.randint(1, 200), rng.randint(1, 200)
        grid = (-(-h // factor) * factor // p, -(-w // factor) * factor // p)
        cases.append((h, w, grid[0] + rng.choice((0, 0, 2)), grid[1] + rng.choice((0, 0, 2))))
    return cases


@pytest.mark.parametrize(("height", "width", "grid_h", "grid_w"), random_cases(24))
def test_kernels_equal_numba(backend: ctypes.CDLL, height: int, width: int, grid_h: int, grid_w: int) -> None:
    image = np.random.default_rng(height * 1000 + width).integers(0, 256, (height, width, 3), np.uint8)
    preset = PRESETS["kimi-k2.5"]
    table = normalize_table(preset.image_mean, preset.image_std)
    got = c_patches(backend, image, (grid_h, grid_w), 14, table.T)
    assert got.tobytes() == write_patches(image, table, grid_h, grid_w, 14).tobytes()
    got_u8 = c_patches(backend, image, (grid_h, grid_w), 14, None)
    assert got_u8.tobytes() == patchify(image, grid_h, grid_w, 14).tobytes()


def test_kernels_equal_numba_on_corpus_photos(backend: ctypes.CDLL, corpus: Path) -> None:
    """Real photos at their NaViT size (RGB, as the decode step sends them), under K3's statistics."""
    preset = PRESETS["kimi-k3"]
    table = normalize_table(preset.image_mean, preset.image_std)
    names = [name for name in corpus_names(accepted=True) if name.endswith(".jpg")][:12]
    for name in names:
        with Image.open(corpus / name) as opened:
            target = navit_target_size(opened.width, opened.height, preset)
            image = np.asarray(opened.convert("RGB").resize((target.new_width, target.new_height), Image.BICUBIC))
        grid = (target.grid_h, target.grid_w)
        expected = write_patches(image, table, *grid, 14)
        assert c_patches(backend, image, grid, 14, table.T).tobytes() == expected.tobytes(), name
        assert c_patches(backend, image, grid, 14, None).tobytes() == patchify(image, *grid, 14).tobytes(), name


@pytest.mark.parametrize("p", [14, 16])
def test_uint8_kernel_writes_nothing_past_its_output(backend: ctypes.CDLL, p: int) -> None:
    """Whole patches up to the last byte of the output (at 14, the shuffle kernel stores 16-byte
    rows), and another patch side (the scalar kernel): equal to numba, the bytes after untouched."""
    rng = np.random.default_rng(p)
    image = rng.integers(0, 256, (4 * p, 6 * p, 3), np.uint8)
    size = 24 * 3 * p * p
    buffer = np.full(size + 64, 77, np.uint8)
    backend.kimi_write_patches_u8(image.ctypes.data_as(U8_P), 4 * p, 6 * p, buffer.ctypes.data_as(U8_P), 4, 6, p)
    assert buffer[:size].tobytes() == patchify(image, 4, 6, p).tobytes()
    assert (buffer[size:] == 77).all()


def patch_bound_ratio(preset_name: str, sizes: list[tuple[int, int]]) -> float:
    """The largest patches / in_patch_limit of the NaViT sizes of ``sizes`` (width, height)."""
    preset = PRESETS[preset_name]
    return max(navit_target_size(w, h, preset).num_patches for w, h in sizes) / preset.in_patch_limit


@pytest.mark.parametrize("preset", SERVED_PRESETS)
def test_navit_sizes_stay_inside_the_backends_bound(preset: str) -> None:
    """The backend refuses more than navit_patch_bound (2 * in_patch_limit) patches an image: every
    NaViT size of a sweep (just below patch multiples, where floor(w / p) loses most; extreme
    aspect ratios) fits, so an image of the decode step is never refused by it."""
    p = PRESETS[preset].patch_size
    rng = random.Random(5)
    sizes = [(k * p + p - 1, j * p + p - 1) for k in (1, 2, 3, 7, 31, 64, 127, 128, 511) for j in range(1, 4000, 37)]
    sizes += [(j, k) for k, j in sizes]
    sizes += [(rng.randint(1, 20000), rng.randint(1, 20000)) for _ in range(5000)]
    ratio = patch_bound_ratio(preset, sizes)
    assert 0.9 < ratio <= navit_patch_bound(PRESETS[preset]) / PRESETS[preset].in_patch_limit, ratio


# -- the served model -------------------------------------------------------------------------------


def test_cpu_rendering_ends_the_vision_ensembles_in_patchify() -> None:
    """In a CPU rendering each vision ensemble's second step is ``<prefix>_patchify`` (the C backend),
    fed the decode step's IMAGE and IMAGE_SHAPES; elsewhere the Python preprocess step."""
    for kind, step in (("cpu", "patchify"), (None, "preprocess"), ("gpu", "preprocess")):
        models = {m.name: m for m in repository_models(RenderOptions(kind=kind))}
        for preset in SERVED_PRESETS:
            prefix = model_prefix(preset)
            for wire in ("", "_u8"):
                assert models[f"{prefix}_vision{wire}"].steps == (f"{prefix}_decode", f"{prefix}_{step}")
            assert (f"{prefix}_patchify" in models) == (kind == "cpu")
    config = {m.name: m for m in repository_models(RenderOptions(kind="cpu"))}["kimi_k25_patchify"].config
    assert 'backend: "kimi_patchify"' in config and "kind: KIND_CPU" in config


def raw_inputs(protocol: str, image: np.ndarray, shapes: np.ndarray) -> list[Any]:
    module = PROTOCOLS[protocol]
    tensors = [
        module.InferInput("IMAGE", list(image.shape), "UINT8"),
        module.InferInput("IMAGE_SHAPES", list(shapes.shape), "INT64"),
    ]
    tensors[0].set_data_from_numpy(image)
    tensors[1].set_data_from_numpy(shapes)
    return tensors


def client_for(server: Any, protocol: str) -> Any:
    module = PROTOCOLS[protocol]
    return module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_direct_requests_equal_the_library(triton_server: Any, protocol: str) -> None:
    """Two RGB images of odd sizes in one request: all four outputs, each equal to the library's."""
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (37, 61, 3), np.uint8), rng.integers(0, 256, (90, 15, 3), np.uint8)]
    flat = np.concatenate([im.ravel() for im in images])[None]
    shapes = np.array([[[37, 61, 3, 0], [90, 15, 3, images[0].size]]], np.int64)
    preset = PRESETS["kimi-k2.5"]
    table = normalize_table(preset.image_mean, preset.image_std)
    grids = [(-(-h // 28) * 2, -(-w // 28) * 2) for h, w, _ in (im.shape for im in images)]
    client = client_for(triton_server, protocol)
    try:
        result = client.infer("kimi_k25_patchify", raw_inputs(protocol, flat, shapes))
    finally:
        client.close()
    expected = np.concatenate([write_patches(im, table, *grid, 14) for im, grid in zip(images, grids, strict=True)])
    assert result.as_numpy("PIXEL_VALUES")[0].tobytes() == expected.tobytes()
    patches = np.concatenate([patchify(im, *grid, 14) for im, grid in zip(images, grids, strict=True)])
    assert result.as_numpy("PIXEL_PATCHES")[0].tobytes() == patches.tobytes()
    assert result.as_numpy("GRID_THW").tolist() == [[[1, *grid] for grid in grids]]
    assert result.as_numpy("NUM_TOKENS").tolist() == [[gh // 2 * (gw // 2) for gh, gw in grids]]


def bad_requests() -> list[tuple[str, np.ndarray, np.ndarray, type]]:
    """(what, IMAGE, IMAGE_SHAPES, the error class) of requests the backend must refuse."""
    pixels = np.zeros((1, 300), np.uint8)
    side = PRESETS["kimi-k2.5"].patch_limit_on_one_side * 14
    many = DecoderSettings().max_images_per_request + 1
    return [
        ("a row past IMAGE", pixels, np.array([[[10, 11, 3, 0]]], np.int64), InvalidRequestError),
        ("an offset past IMAGE", pixels, np.array([[[2, 2, 3, 299]]], np.int64), InvalidRequestError),
        ("a negative offset", pixels, np.array([[[2, 2, 3, -4]]], np.int64), InvalidRequestError),
        ("a zero height", pixels, np.array([[[0, 2, 3, 0]]], np.int64), InvalidRequestError),
        ("grey pixels", pixels, np.array([[[10, 10, 1, 0]]], np.int64), InvalidRequestError),
        ("huge sides", pixels, np.array([[[1 << 40, 1 << 40, 3, 0]]], np.int64), ImageTooLargeError),
        ("a side past the limit", pixels, np.array([[[1, side + 1, 3, 0]]], np.int64), ImageTooLargeError),
        ("too many images", pixels, np.tile(np.array([[[2, 2, 3, 0]]], np.int64), (1, many, 1)), InvalidRequestError),
        ("shapes of 3 columns", pixels, np.array([[[2, 2, 3]]], np.int64), InvalidRequestError),
        ("no images", pixels, np.zeros((1, 0, 4), np.int64), InvalidRequestError),
    ]


@pytest.mark.server
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_bad_direct_requests_get_their_class_and_the_server_keeps_serving(
    triton_server: Any, corpus: Path, protocol: str
) -> None:
    client = client_for(triton_server, protocol)
    try:
        for what, image, shapes, error in bad_requests():
            with pytest.raises(InferenceServerException) as info:
                client.infer("kimi_k25_patchify", raw_inputs(protocol, image, shapes))
                pytest.fail(f"{what}: answered")
            assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), what
            assert type(error_from_server(info.value)) is error, (what, info.value.message())
        data = (corpus / "pil__hopper.jpg").read_bytes()
        tensor = PROTOCOLS[protocol].InferInput("IMAGE_BYTES", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
        result = client.infer("kimi_k25_vision", [tensor])
        expected = preprocess_bytes(data, "kimi-k2.5").pixel_values
        assert result.as_numpy("PIXEL_VALUES")[0].tobytes() == expected.tobytes()
        assert client.is_model_ready("kimi_k25_patchify")
    finally:
        client.close()


@pytest.mark.server
def test_the_c_step_counts_its_seconds_with_the_python_steps(triton_server: Any, corpus: Path) -> None:
    """``kimi_prep_stage_seconds_total{stage="patchify"}`` grows with each request the C step runs,
    in the family the Python models' stages share."""
    import urllib.request

    def patchify_seconds() -> float:
        with urllib.request.urlopen(triton_server.metrics_url, timeout=30) as response:
            text = response.read().decode()
        lines = [line for line in text.splitlines() if line.startswith("kimi_prep_stage_seconds_total{")]
        assert any('stage="decode"' in line for line in lines), lines  # one family for both kinds of step
        found = [line for line in lines if 'model="kimi_k25_patchify"' in line and 'stage="patchify"' in line]
        return sum(float(line.rsplit(" ", 1)[1]) for line in found)

    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[(corpus / "pil__hopper.jpg").read_bytes()]], dtype=np.object_))
    client.infer("kimi_k25_vision", [tensor])
    before = patchify_seconds()
    client.infer("kimi_k25_vision", [tensor])
    assert patchify_seconds() > before
    client.close()


# -- a server that lacks a function ----------------------------------------------------------------

C_STEP = Path(__file__).resolve().parents[1] / "backend_src" / "server" / "kimi_vision_server" / "models" / "patchify"
C_DECLARATIONS, C_LIFECYCLE = C_STEP / "triton_api.h", C_STEP / "backend.c"  # the weak declarations; the check table


def declared_api() -> list[str]:
    """The Triton functions the C step declares (weak) and calls."""
    return re.findall(r"^WEAK [^;]*?\b(TRITON\w+)\(", C_DECLARATIONS.read_text(), re.M | re.S)


def fake_server(tmp_path: Path, missing: str | None) -> Path:
    """A shared object standing in for libtritonserver: every declared function but ``missing``
    (no-ops returning 0; ErrorNew keeps the message, ApiVersion says 1.19)."""
    special = {
        "TRITONSERVER_ErrorNew": (
            "void *TRITONSERVER_ErrorNew(int code, const char *msg) { (void)code; return strdup(msg); }"
        ),
        "TRITONSERVER_ErrorMessage": "const char *TRITONSERVER_ErrorMessage(void *error) { return error; }",
        "TRITONBACKEND_ApiVersion": (
            "void *TRITONBACKEND_ApiVersion(unsigned *major, unsigned *minor) { *major = 1; *minor = 19; return 0; }"
        ),
    }
    lines = ["#include <string.h>"]
    lines += [special.get(name, f"void *{name}(void) {{ return 0; }}") for name in declared_api() if name != missing]
    source = tmp_path / "fake_server.c"
    source.write_text("\n".join(lines) + "\n")
    library = tmp_path / "libfake_tritonserver.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, capture_output=True)
    return library


INITIALIZE = """
import ctypes, shutil, sys
fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
backend = ctypes.CDLL(sys.argv[2])
backend.TRITONBACKEND_Initialize.restype = ctypes.c_void_p
error = backend.TRITONBACKEND_Initialize(None)
print(ctypes.string_at(error).decode() if error else "loaded")
"""


def initialize_against(tmp_path: Path, missing: str | None) -> str:
    """TRITONBACKEND_Initialize of a fresh copy of the C step, run in its own process against a fake
    server that lacks ``missing``: the error message, or ``loaded``."""
    copy = tmp_path / "libtriton_kimi_patchify.so"
    shutil.copy(patchify_library(), copy)
    command = [sys.executable, "-c", INITIALIZE, str(fake_server(tmp_path, missing)), str(copy)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def test_the_check_table_names_every_declared_function() -> None:
    declared = declared_api()
    checked = re.findall(r"^\s+API\((\w+)\),$", C_LIFECYCLE.read_text(), re.M)
    assert len(declared) >= 36 and sorted(checked) == sorted(declared)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize(
    "missing", ["TRITONBACKEND_ModelInstanceName", "TRITONSERVER_MetricFamilyNew", "TRITONSERVER_ParameterDelete"]
)
def test_a_server_without_a_function_is_refused_by_name(tmp_path: Path, missing: str) -> None:
    message = initialize_against(tmp_path, missing)
    assert message.startswith("PreprocessError: internal error: kimi_patchify: this tritonserver lacks " + missing)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_server_with_every_function_loads_it(tmp_path: Path) -> None:
    assert initialize_against(tmp_path, None) == "loaded"


# -- the model config, read with the C step's JSON reader ------------------------------------------------


def c_parameter(backend: ctypes.CDLL, document: bytes, key: str, capacity: int = 256) -> tuple[int, str | None]:
    """``kimi_config_parameter``: (1, value) found, (0, None) absent, (-1, None) refused."""
    value = ctypes.create_string_buffer(capacity)
    code = backend.kimi_config_parameter(document, len(document), key.encode(), value, capacity)
    return code, value.value.decode() if code == 1 else None


def python_parameter(document: bytes, key: str) -> tuple[int, str | None]:
    try:
        config = json.loads(document)
    except ValueError:
        return -1, None
    entry = config.get("parameters", {}).get(key) if isinstance(config, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("string_value"), str):
        return 0, None
    return 1, entry["string_value"]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    value=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
    noise=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "parameters"), JSON_VALUES, max_size=4),
    others=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3),
    ascii_only=st.booleans(),
)
def test_the_c_json_reader_finds_what_python_finds(backend: ctypes.CDLL, value: str, noise: dict, others: dict,
                                                   ascii_only: bool) -> None:  # fmt: skip
    parameters = {**{k: {"other": v} for k, v in others.items()}, "wanted": {"string_value": value, "x": [1, {}]}}
    document = json.dumps({**noise, "parameters": parameters}, ensure_ascii=ascii_only).encode()
    assert python_parameter(document, "wanted") == (1, value)
    # A NUL (\u0000) fits no C string: the C step refuses the config rather than cut the value.
    assert c_parameter(backend, document, "wanted", 1024) == ((-1, None) if "\x00" in value else (1, value))
    for key in others:
        if key != "wanted":
            assert c_parameter(backend, document, key)[0] == 0


@pytest.mark.parametrize(
    "document",
    [b'{"parameters": {"k": {"string_value": "v"}}', b'{"parameters": {"k": {"string_value": "v"}}} x',
     b'{"parameters": {"k": {"string_value": "\\q"}}}', b'{"parameters": {"k": {"string_value": "a\nb"}}}',
     b'{"a": 01, "parameters": {}}', b'{"a": [1,], "parameters": {}}', b'[' * 100 + b']' * 100,
     b'{"a": ' + b'[' * 70 + b']' * 70 + b'}', b'{"parameters": {"k": {"string_value": "\\ud800"}}}', b'',
     b'{"parameters": {"k": {"string_value": "\\u12g4"}}}', b'{"parameters": {"k": {"string_value": "\\udc00"}}}',
     b'{"parameters": {"k": {"string_value": "\\u0000"}}}', b'{"parameters": {"k": {"string_value": 1}}} '],
)  # fmt: skip
def test_the_c_json_reader_refuses_what_is_not_json(backend: ctypes.CDLL, document: bytes) -> None:
    assert c_parameter(backend, document, "k") == (-1, None)


def test_the_c_json_reader_reads_a_rendered_patchify_config(backend: ctypes.CDLL) -> None:
    """The parameters of a rendered C step, as Triton serializes its config (a JSON object)."""
    model = next(m for m in repository_models(RenderOptions(kind="cpu")) if m.name == "kimi_k3_patchify")
    parameters = dict(re.findall(r'parameters \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}', model.config))
    config = {"name": model.name, "max_batch_size": 1, "input": [{"name": "IMAGE", "dims": [-1]}],
              "parameters": {k: {"string_value": v} for k, v in parameters.items()}}  # fmt: skip
    document = json.dumps(config, indent=1).encode()
    for key in ("max_patches_per_image", "max_patches_per_request", "image_mean", "patch_size"):
        assert c_parameter(backend, document, key) == (1, parameters[key])
    assert c_parameter(backend, document, "in_patch_limit")[0] == 1
    assert c_parameter(backend, document, "max_patches_per_request", capacity=3) == (-1, None)  # too long
